"""The store's own listing, every version of every key, read straight from the store (not
through derivd): what `harness.history.load` compares the tables against."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

VERSIONS_SUFFIX = ".versions"  # derivd.storage.base.RESERVED_SUFFIX, the fs layout


def s3_objects(client: Any, bucket: str, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(key, version id) of every version and delete marker in `bucket` (a boto3
    client) under `prefix`; keys whole, as the tables hold them (keys are the store's
    real keys, [storage] prefix included)."""
    for page in client.get_paginator("list_object_versions").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Versions", []) + page.get("DeleteMarkers", []):
            yield item["Key"], item["VersionId"]


def fs_objects(root: Path) -> Iterator[tuple[str, str]]:
    """(key, version id) of every file under an fs store's `root`; a half-written PUT
    (`.tmp-<version>`) is listed too, under its key, as `.tmp-<version>`."""
    for folder in sorted(root.rglob(f"*{VERSIONS_SUFFIX}")):
        if not folder.is_dir():
            continue
        key = folder.relative_to(root).as_posix().removesuffix(VERSIONS_SUFFIX)
        for entry in sorted(folder.iterdir()):
            if entry.is_file():
                name = entry.name
                yield key, name if name.startswith(".") else name.split(".", 1)[0]
