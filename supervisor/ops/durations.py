"""A duration as a person reads it, for status lines, the dashboard and the daemon's
closing lines: a module of its own so that the daemon's boot need not import the status
report to print one."""

from __future__ import annotations


def duration(seconds: float | None) -> str:
    """A short human duration: 850ms, 42s, 3m12s, 2h05m."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"
