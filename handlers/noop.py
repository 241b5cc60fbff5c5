"""`noop`: derives nothing and lets the job commit `ready`; it measures the queue itself."""

from __future__ import annotations

from derivd.handlers.base import Derivation, DeriveSpec


class NoopHandler:
    name = "noop"
    # It measures the queue itself: the worker skips the GET of the original.
    reads_original = False
    # Nor does it store any: its claims register no write-ahead prefix.
    stores_objects = False

    def __init__(self, spec: DeriveSpec | None = None) -> None:
        self.spec = spec

    def derive(self, original: bytes, spec: DeriveSpec) -> Derivation:
        return Derivation(())
