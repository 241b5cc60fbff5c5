"""The embedded default: a private PostgreSQL cluster under the state directory, and the
demo that runs on it. Commands given a DSN import none of its modules (a health probe
runs `derivd status` every few seconds): they catch `EmbeddedError`, defined here."""

from __future__ import annotations


class EmbeddedError(RuntimeError):
    """The embedded cluster cannot be used (no server binaries, a set-up that failed);
    the message is one line for humans."""
