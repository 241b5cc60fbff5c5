"""What an upload API does, for the command line: store originals, confirm, queue."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from derivd.queue.db import QueueDB
from derivd.storage.base import Storage, new_original_key
from derivd.traffic import DEFAULT_PRIORITY

CONTENT_TYPE = "application/octet-stream"


def expand_paths(paths: Iterable[Path]) -> Iterator[Path]:
    """Files as given; directories walked recursively (hidden entries skipped), sorted."""
    for path in paths:
        if path.is_dir():
            for child in sorted(path.rglob("*")):
                relative = child.relative_to(path).parts
                if child.is_file() and not any(p.startswith(".") for p in relative):
                    yield child
        else:
            yield path


def upload_and_queue(
    paths: Iterable[Path],
    storage: Storage,
    queue: QueueDB,
    *,
    batch: int = 100,
    progress: Callable[[Path], None] | None = None,
    priority: int = DEFAULT_PRIORITY,
    tenant: str | None = None,
) -> list[int]:
    """Upload each file under a generated key, then queue the confirmed versions in
    batches (one INSERT per batch), all at `priority` for `tenant`. Returns the new row
    ids in input order."""
    ids: list[int] = []
    pending: list[tuple[str, str | None]] = []
    for path in paths:
        key = new_original_key()
        version = storage.put(key, path.read_bytes(), CONTENT_TYPE)
        pending.append((key, version))
        if progress:
            progress(path)
        if len(pending) >= batch:
            ids += queue.enqueue(pending, priority=priority, tenant=tenant)
            pending = []
    ids += queue.enqueue(pending, priority=priority, tenant=tenant)
    return ids
