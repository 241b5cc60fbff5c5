"""Database-level statements (create and drop databases) on a maintenance connection."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql

from derivd.queue.sqlfiles import query


class ClusterAdmin:
    """Database-level statements on a maintenance connection (autocommit: CREATE
    DATABASE cannot run in a transaction). Names are composed as identifiers."""

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self.conn = conn

    def _identifiers(self, query_name: str, **names: str) -> sql.Composed:
        statement = sql.SQL(query(query_name))
        return statement.format(**{k: sql.Identifier(v) for k, v in names.items()})

    def database_exists(self, name: str) -> bool:
        return self.conn.execute(query("database_exists"), {"name": name}).fetchone() is not None

    def create_database(self, name: str, template: str | None = None) -> None:
        if template is None:
            self.conn.execute(self._identifiers("create_database", name=name))
        else:
            query = self._identifiers("create_database_from_template", name=name, template=template)
            self.conn.execute(query)

    def create_schema(self, name: str) -> None:
        """[database] schema, made by `migrate` when missing."""
        self.conn.execute(self._identifiers("create_schema", name=name))

    def drop_database(self, name: str) -> None:
        self.conn.execute(self._identifiers("drop_database", name=name))
