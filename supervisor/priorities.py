"""Priorities and tenants: their ranges and the one check of each (docs/traffic.md).

The database holds the same limits as CHECK constraints (migration 0014); these let
`derivd.client.enqueue` and `derivd enqueue` refuse bad input with one line before any
statement runs.
"""

from __future__ import annotations

PRIORITY_MIN = -100
PRIORITY_MAX = 100
DEFAULT_PRIORITY = 0
# Backfill re-derivations run below live uploads (at the default priority) by default.
BACKFILL_PRIORITY = -10
TENANT_MAX_CHARS = 200
# The starvation bound: every CLAIM_SHARE-th claim call takes the oldest due rows
# whatever their priority (sql: derivd_commit_and_claim, `% 20`).
CLAIM_SHARE = 20


def priority_problem(priority: object) -> str | None:
    """Why `priority` cannot be a file's priority, or None when it can."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        return f"priority must be a whole number between {PRIORITY_MIN} and {PRIORITY_MAX}"
    if not PRIORITY_MIN <= priority <= PRIORITY_MAX:
        return f"priority {priority} is outside {PRIORITY_MIN}..{PRIORITY_MAX} (higher runs first)"
    return None


def tenant_problem(tenant: object) -> str | None:
    """Why `tenant` cannot be a file's tenant (None: no tenant, which is fine)."""
    if tenant is None:
        return None
    if not isinstance(tenant, str) or not tenant:
        return "tenant must be a non-empty string (or None for no tenant)"
    if len(tenant) > TENANT_MAX_CHARS:
        return f"tenant is {len(tenant)} characters long; at most {TENANT_MAX_CHARS}"
    if any(ord(c) < 32 or 127 <= ord(c) < 160 for c in tenant):
        return "tenant must not contain control characters"
    return None
