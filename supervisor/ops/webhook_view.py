"""The webhooks as operators and apps see them: per endpoint (backlog, oldest undelivered
age, delivered and failed in the window, failed rows kept, the circuit, the last error)
for `derivd status`, the dashboard and `derivd webhooks list`; and the test event of
`derivd webhooks test`."""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from derivd.redact import shown_url
from derivd.webhooks.endpoints import Endpoint


def endpoint_json(row: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": row["name"],
        "backlog": row["backlog"],
        "oldest_undelivered_age_s": row["oldest_undelivered_age_s"],
        "delivered_recent": row["delivered_recent"],
        "failed_recent": row["failed_recent"],
        "failed_kept": row["failed_kept"],
        "consecutive_failures": row["failures"],
        "paused": row["paused"],
        "circuit": circuit_state(row),
        "next_probe_s": row["next_probe_s"],  # null: closed; 0: due (or in flight)
        "failed_probes": row["probes"],
        "open_for_s": row["open_age_s"],  # null: closed
        "removed": bool(row.get("removed")),  # from the INI; listed while rows are kept
        "last_error": row["last_error"],
        "last_error_age_s": row["last_error_age_s"],
    }


def circuit_state(row: dict[str, Any]) -> str:
    """`closed` (claims as usual), `open` (no claim until its next probe is due) or
    `probing` (open, its one probe in flight)."""
    if row["probing"]:
        return "probing"
    return "open" if row["open"] or row["paused"] else "closed"


def circuit_text(row: dict[str, Any]) -> str:
    """The status table's and `webhooks list`'s word for an endpoint's circuit."""
    if row.get("removed"):
        return "removed"  # its undelivered rows ended failed ("endpoint removed")
    state = circuit_state(row)
    if state == "probing":
        return "open, probing"
    if state == "open":
        return f"open, next probe in {_age(row['next_probe_s'])}"
    return "failing" if row["failures"] else "ok"


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def endpoint_lines(rows: Sequence[dict[str, Any]], window: str) -> list[str]:
    """The status table's webhook section (nothing when no endpoint is known)."""
    if not rows:
        return []
    lines = [
        "",
        f"webhooks (delivered/failed: last {window})",
        f"  {'endpoint':<16}{'backlog':>8}{'oldest':>8}{'delivered':>10}{'failed':>8}"
        f"{'kept':>6}  circuit / last error",
    ]
    for r in rows:
        circuit = circuit_text(r)
        error = (
            f" / {r['last_error']} ({_age(r['last_error_age_s'])} ago)" if r["last_error"] else ""
        )
        lines.append(
            f"  {r['name']:<16}{r['backlog']:>8}{_age(r['oldest_undelivered_age_s']):>8}"
            f"{r['delivered_recent']:>10}{r['failed_recent']:>8}{r['failed_kept']:>6}  "
            f"{circuit}{error}"
        )
    return lines


def test_body(endpoint: str) -> str:
    """A `file.ready`-shaped event that names no file (file_id 0): what a receiver's
    signature check and dedupe can be tried with."""
    return json.dumps(
        {
            "type": "file.ready",
            "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
            "data": {
                "file_id": 0,
                "tenant": None,
                "status": "ready",
                "error_code": None,
                "attempts": 1,
                "variants": [],
                "original": None,
                "test": True,
                "endpoint": endpoint,
            },
        },
        separators=(", ", ": "),
    )


def configured_json(endpoints: Sequence[Endpoint]) -> list[dict[str, Any]]:
    return [
        {
            "name": e.name,
            "url": shown_url(e.url),
            "events": list(e.events),
            "tenants": list(e.tenants),
            "timeout": e.timeout,
            "retry_horizon": e.retry_horizon,
            "concurrency": e.concurrency,
        }
        for e in endpoints
    ]


def send_test(endpoint: Endpoint) -> tuple[bool, str]:
    """POST a signed test event now; (answered 2xx, one line saying what happened)."""
    from derivd.webhooks.policy import error_text
    from derivd.webhooks.sender import post
    from derivd.webhooks.signing import headers

    body = test_body(endpoint.name)
    webhook_id = f"msg_test_{secrets.token_hex(8)}"
    sent = headers(endpoint.signing_key(), webhook_id, int(time.time()), body)
    response = post(endpoint.url, body.encode(), sent, timeout=endpoint.timeout)
    error = error_text(response)
    if error is None:
        return True, f"{endpoint.name}: answered {response.status} (webhook-id {webhook_id})"
    return False, f"{endpoint.name}: {error} (webhook-id {webhook_id})"
