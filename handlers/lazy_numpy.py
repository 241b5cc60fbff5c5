"""numpy, loaded on first use, not at a worker's boot (tests/test_boot.py): the analysis
and libjpeg-turbo's decoder (simplejpeg) use it, the supervisor never does."""

from __future__ import annotations

import os
from functools import cache
from types import ModuleType


@cache
def numpy() -> ModuleType:
    """numpy maps OpenBLAS, which starts a thread per core with its buffers (12 MiB more
    RSS on this machine): derivd does no linear algebra, so one thread unless the
    operator asked for more."""
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    import numpy as module

    return module
