"""Outcome exceptions: the code that knows why a job failed decides whether it is final.

Handlers and storage raise these; the worker turns them into fenced state changes.
The message of an outcome goes to the log only; the database receives the `code`.
"""

from __future__ import annotations

# Re-exported: the codes themselves live with the other states, in derivd.states.
from derivd.states import ErrorCode as ErrorCode


class Outcome(Exception):
    """Base class of every failure a job can end an attempt with.

    `own_words`: the message is derivd's own (a path, a reason, a status code), never
    text a plugin or a library wrote, so the log shows it whole at any level."""

    own_words = False


class Permanent(Outcome):
    """Retrying cannot help (bad content, over a limit): reject at once with `code`."""

    def __init__(self, code: ErrorCode, message: str = "") -> None:
        super().__init__(message or code)
        self.code: ErrorCode = code


class UnsupportedContent(Permanent):
    def __init__(self, message: str = "") -> None:
        super().__init__("unsupported_content", message)


class CorruptContent(Permanent):
    def __init__(self, message: str = "") -> None:
        super().__init__("corrupt_content", message)


class ResourceLimit(Permanent):
    def __init__(self, message: str = "") -> None:
        super().__init__("resource_limit", message)


class Transient(Outcome):
    """Something outside the content failed (storage, network, database): retry later.

    `code` is what the row ends with if the attempts run out.
    """

    def __init__(self, message: str = "", code: ErrorCode = "processing_failed") -> None:
        super().__init__(message or "transient failure")
        self.code: ErrorCode = code
