"""`python bench/queue_peers.py`: queue throughput, derivd against pgqueuer and procrastinate.

The benchmark itself lives in bench/throughput.py. This file only exists under the name
the Makefile uses, and that name is the standard library's `queue`: Python puts bench/
first on sys.path for every script run from here (bench/derive.py too), so psycopg,
logging.handlers or concurrent.futures importing `queue` would find this file. When
imported under that name it therefore loads the real standard-library module in its
place (the import system returns whatever sys.modules holds after the import).
"""

import importlib.util
import os
import sys
import sysconfig

if __name__ == "queue":
    _path = os.path.join(sysconfig.get_path("stdlib"), "queue.py")
    _spec = importlib.util.spec_from_file_location("queue", _path)
    assert _spec is not None and _spec.loader is not None
    _stdlib = importlib.util.module_from_spec(_spec)
    sys.modules["queue"] = _stdlib
    _spec.loader.exec_module(_stdlib)
elif __name__ == "__main__":
    import runpy

    runpy.run_path(
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "throughput.py"),
        run_name="__main__",
    )
