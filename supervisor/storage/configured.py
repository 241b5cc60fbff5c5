"""The store the configuration names: `open_storage(config)`.

Apart from `derivd.storage.base` so that the protocol every backend implements imports no
backend: `fs` and `s3` import the base, this module imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from derivd.storage.base import Storage

if TYPE_CHECKING:
    from derivd.config import Config


def open_storage(config: Config) -> Storage:
    """Create the configured store. Call in the process that will use it (after fork)."""
    if config.storage.backend == "s3":
        from derivd.storage.s3 import S3Storage  # boto3 only where S3 is configured

        return S3Storage(
            bucket=config.storage.bucket,
            endpoint_url=config.storage.endpoint_url or None,
            region=config.storage.region or None,
            prefix=config.storage.prefix,
        )
    from derivd.storage.fs import FsStorage

    return FsStorage(config.fs_root)
