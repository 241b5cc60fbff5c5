"""`python -m derivd.cli` (the console script calls main itself)."""

from __future__ import annotations

from derivd.cli import main

main()
