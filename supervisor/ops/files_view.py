"""`derivd files` and `derivd similar`: the views an app's developer would otherwise
write SQL for, as a table or as JSON, paged by id (newest first)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any


def _when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M:%S") if value else "-"


def file_json(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": row["id"],
        "status": row["status"],
        "error_code": row["error_code"],
        "tenant": row["tenant"],
        "attempts": row["attempts"],
        "priority": row["priority"],
        "created_at": row["created_at"].isoformat(),
        "finished_at": row["finished_at"].isoformat() if row["finished_at"] else None,
        "original_key": row["original_key"],
    }


def next_page(rows: Sequence[dict[str, Any]], limit: int) -> int | None:
    """The `--before` of the next page, when this one is full."""
    return int(rows[-1]["id"]) if len(rows) >= limit and rows else None


def files_json(rows: Sequence[dict[str, Any]], limit: int) -> str:
    return json.dumps(
        {"files": [file_json(r) for r in rows], "next_before": next_page(rows, limit)}
    )


def files_table(rows: Sequence[dict[str, Any]], limit: int) -> str:
    if not rows:
        return "no files match"
    lines = [
        f"{'id':>10}  {'status':<10}  {'error code':<19}  {'tenant':<16}  {'att':>3}  "
        f"{'created':<19}  {'finished':<19}  original key"
    ]
    for r in rows:
        tenant = (r["tenant"] or "-")[:16]
        lines.append(
            f"{r['id']:>10}  {r['status']:<10}  {r['error_code'] or '-':<19}  {tenant:<16}  "
            f"{r['attempts']:>3}  {_when(r['created_at']):<19}  {_when(r['finished_at']):<19}  "
            f"{r['original_key']}"
        )
    before = next_page(rows, limit)
    if before is not None:
        lines.append(f"(more: --before {before})")
    return "\n".join(lines)
