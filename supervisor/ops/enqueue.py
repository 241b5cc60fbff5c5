"""What an upload API does, for the command line: store originals, confirm, queue."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from derivd.priorities import DEFAULT_PRIORITY
from derivd.queue.db import QueueDB
from derivd.storage.base import Storage, new_original_key

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
    context: Mapping[str, str | None] | None = None,
) -> list[int]:
    """Upload each file under a generated key, then queue the confirmed versions in
    batches (one INSERT per batch), all at `priority` for `tenant`, with the app's
    `context` (external_id, metadata as JSON text: derivd.client.app_context). Returns
    the new row ids in input order.

    Each batch's keys are registered write-ahead (the orphan registry) before its first
    PUT, and the INSERT clears them: interrupted between the two (Ctrl-C, a crash, the
    table locked), the originals it stored are deleted by the orphan sweep after
    [sweep] orphan_guard instead of staying in the store with nothing naming them."""
    ids: list[int] = []
    token = uuid.uuid4()  # this run's, never a lease: nothing keeps its orphans alive
    for chunk in batched(paths, batch):
        keys = [new_original_key(storage.prefix) for _ in chunk]
        queue.enqueue_write_ahead(keys, token)
        originals: list[tuple[str, str | None]] = []
        for path, key in zip(chunk, keys, strict=True):
            originals.append((key, storage.put(key, path.read_bytes(), CONTENT_TYPE)))
            if progress:
                progress(path)
        ids += queue.enqueue(originals, priority=priority, tenant=tenant, **(context or {}))
    return ids


def batched(items: Iterable[Path], size: int) -> Iterator[list[Path]]:
    """`items` in lists of `size` (the last one shorter), read lazily."""
    chunk: list[Path] = []
    for item in items:
        chunk.append(item)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
