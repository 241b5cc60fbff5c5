"""The store the configuration names: `open_storage(config)`, and `store_name(config)`,
where it is as apps and webhook receivers name it.

Apart from `derivd.storage.base` so that the protocol every backend implements imports no
backend: `fs` and `s3` import the base, this module imports them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from derivd.storage.base import Storage, StoreName

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


def store_name(config: Config) -> StoreName:
    """The backend, the bucket (s3; None for fs) and the prefix of derivd's own keys."""
    if config.storage.backend == "s3":
        return StoreName("s3", config.storage.bucket, config.storage.prefix)
    return StoreName(config.storage.backend, None, "")
