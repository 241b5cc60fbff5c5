"""`derivd show ID`: one upload as an operator first asks about it — its row, the analysis
of its original, every variant and its event timeline (text, or one JSON object).

Read-only: a few primary-key and index lookups (the events through each retained day's
(file_id, at) index), whatever the size of the history.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime
from typing import Any

from derivd.handlers.base import Analysis
from derivd.queue.db import QueueDB, StoredVariant

ANALYSIS = tuple(f.name for f in fields(Analysis))  # stored as the original_* columns
UNSIGNED_64 = 2**64 - 1


@dataclass(frozen=True)
class FileView:
    row: dict[str, Any]  # archive_files, the analysis columns included
    variants: list[StoredVariant]
    events: list[dict[str, Any]]

    @property
    def analysis(self) -> dict[str, Any] | None:
        """The original's analysis as stored (None: none stored: not derived yet, or the
        handler analyses nothing)."""
        values = {name: self.row[f"original_{name}"] for name in ANALYSIS}
        return None if values["width"] is None else values


def read(queue: QueueDB, file_id: int) -> FileView | None:
    """Everything `show` prints about one file; None when no row has this id."""
    row = queue.file_row(file_id)
    if row is None:
        return None
    return FileView(row, queue.file_variants(file_id), queue.file_events(file_id))


# --------------------------------------------------------------------------- JSON


def as_json(view: FileView) -> dict[str, Any]:
    """{row, analysis, variants, events}: times in ISO 8601 (UTC), tokens as text."""
    analysed = {f"original_{name}" for name in ANALYSIS}
    row = {k: v for k, v in view.row.items() if k not in analysed}
    return {
        "row": _plain(row),
        "analysis": view.analysis,
        "variants": [asdict(v) for v in view.variants],
        "events": [_plain(e) for e in view.events],
    }


def _plain(values: dict[str, Any]) -> dict[str, Any]:
    return {k: _json_value(v) for k, v in values.items()}


def _json_value(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    if value is None or isinstance(value, bool | int | float | str | dict | list):
        return value  # metadata: the app's JSON object as it is
    return str(value)  # uuid


def to_json(view: FileView) -> str:
    return json.dumps(as_json(view), indent=2)


# --------------------------------------------------------------------------- text


def render(view: FileView) -> str:
    return "\n".join([*_row_lines(view.row), "", *_analysis_lines(view.analysis), "",
                      *_variant_lines(view.variants), "", *_event_lines(view.events)])  # fmt: skip


def stamp(at: datetime | None) -> str:
    """A time in UTC to the millisecond: 2026-12-02 00:41:03.120Z."""
    if at is None:
        return "-"
    return at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"


def _pairs(pairs: Iterable[tuple[str, str]]) -> list[str]:
    return [f"  {label:<12} {value}" for label, value in pairs]


def _row_lines(row: dict[str, Any]) -> list[str]:
    lines = [
        f"file {row['id']}: {row['status']}"
        + (f" ({row['error_code']})" if row["error_code"] else "")
    ]
    pairs = [
        ("original", f"{row['original_key']}  version {row['original_version'] or '-'}"),
        *([("bucket", row["bucket"])] if row.get("bucket") else []),
        ("attempts", str(row["attempts"])),
        ("created", stamp(row["created_at"])),
        ("available", stamp(row["available_at"])),
        ("claimed", f"{stamp(row['claimed_at'])}  by {row['claimed_by'] or '-'}"),
    ]
    if row.get("external_id") is not None:
        pairs.append(("external id", row["external_id"]))
    if row.get("metadata") is not None:
        pairs.append(("metadata", json.dumps(row["metadata"], ensure_ascii=False)))
    if row["lease_token"] is not None:
        pairs.append(("lease", f"{row['lease_token']}  until {stamp(row['lease_until'])}"))
    pairs.append(("finished", stamp(row["finished_at"])))
    pairs.append(("updated", stamp(row["updated_at"])))
    if row["derived_key"] is not None:
        size = f"{row['width']}x{row['height']}"
        pairs.append(("primary", f"{row['derived_key']}  {size}  sha256 {row['sha256']}"))
    return lines + _pairs(pairs)


def _analysis_lines(analysis: dict[str, Any] | None) -> list[str]:
    if analysis is None:
        return ["analysis: none (the file is not derived yet, or its handler analyses nothing)"]
    a = analysis
    frames = f"{a['frames']} frame{'s' if a['frames'] != 1 else ''}"
    alpha = "alpha" if a["has_alpha"] else "no alpha"
    return ["analysis of the original", *_pairs([
        ("size", f"{a['width']}x{a['height']} (as displayed)"),
        ("format", f"{a['format']}, {frames}, {alpha}"),
        ("colour", a["colour"]),
        ("placeholder", f"{a['placeholder']} (ThumbHash, base64)"),
        ("dhash", f"{a['dhash'] & UNSIGNED_64:016x} ({a['dhash']})"),
        *([("media", _media_text(a["media"]))] if a.get("media") else []),
    ])]  # fmt: skip


def _media_text(media: dict[str, Any]) -> str:
    """A preview's facts on one line: `pages 12, page 1, page_size [612.0, 792.0]`."""
    return ", ".join(f"{key} {value}" for key, value in media.items())


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]
    return [
        "  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip()
        for r in [headers, *rows]
    ]


def _variant_lines(variants: list[StoredVariant]) -> list[str]:
    if not variants:
        return ["variants: none"]
    rows = [
        [v.name, v.format, f"{v.width}x{v.height}", "-" if v.bytes is None else str(v.bytes),
         v.sha256[:16], v.key, v.version]
        for v in variants
    ]  # fmt: skip
    headers = ["name", "format", "size", "bytes", "sha256", "key", "version"]
    return [f"variants ({len(variants)})", *_table(headers, rows)]


def _event_lines(events: list[dict[str, Any]]) -> list[str]:
    if not events:
        return ["events: none (or older than [sweep] events_retention_days)"]
    rows = [
        [
            stamp(e["at"]),
            e["kind"],
            "-" if e["attempt"] is None else str(e["attempt"]),
            e["error_code"] or "-",
            e["actor"] or "-",
        ]
        for e in events
    ]
    return [f"events ({len(events)})", *_table(["at", "kind", "attempt", "code", "by"], rows)]
