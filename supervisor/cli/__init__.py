"""The `derivd` command line (click). Commands stay thin: they parse, then call modules.

The top group and what every command shares are in `common`; the commands, by what they do,
in `running`, `queue_commands`, `views` and `webhook_commands`, each imported here so that
it registers with `main` (the console script `derivd = derivd.cli:main`).
"""

from __future__ import annotations

from derivd.cli import queue_commands, running, views, webhook_commands
from derivd.cli.common import main

__all__ = ["main", "queue_commands", "running", "views", "webhook_commands"]
