"""`s3`: any S3 API through boto3 (AWS, MinIO, Ceph, moto).

The client is created lazily, in the process that uses it, so none crosses a fork.
Credentials come from boto3's usual chain (environment, profile, instance role); they
are never logged. Versioning must be enabled on the bucket: `check()` refuses otherwise.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

from derivd.errors import ResourceLimit
from derivd.storage.base import (
    ObjectMissing,
    StorageConfigError,
    StorageUnavailable,
    cache_control,
    refuse_oversize,
    refused_is_missing,
    validate_key,
)

# The object is not there, for good. A missing bucket is not: it is the deployment's
# fault (and would reject every job), so it is retried like an outage.
_MISSING = {"NoSuchKey", "NoSuchVersion", "404", "NotFound", "InvalidArgument"}
_NOT_OURS = {"NoSuchBucket"}
_RETRYABLE_HTTP = {408, 429, 500, 502, 503, 504}
# Bodies up to this size go out without `Expect: 100-continue`: botocore asks for it on
# every PUT, which costs a second round trip (the headers, a wait for `100 Continue`, then
# the body). It saves sending a body the server would refuse; for a variant of a few
# hundred KB, resending it costs less than the wait.
NO_CONTINUE_MAX_BYTES = 8 * 1024 * 1024


class S3Storage:
    name = "s3"

    def __init__(
        self,
        *,
        bucket: str,
        endpoint_url: str | None = None,
        region: str | None = None,
        prefix: str = "",
    ) -> None:
        self.bucket = bucket
        self.endpoint_url = endpoint_url
        self.region = region
        self.prefix = prefix
        self._client: Any = None

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config as BotoConfig

            self._client = boto3.session.Session().client(
                "s3",
                endpoint_url=self.endpoint_url,
                region_name=self.region,
                config=BotoConfig(
                    retries={"max_attempts": 3, "mode": "standard"},
                    connect_timeout=5,
                    read_timeout=30,
                    # The worker's concurrent PUTs (derivd.storage.parallel) each get a
                    # connection of their own instead of waiting for one.
                    max_pool_connections=16,
                ),
            )
            # Last of the generic `before-call.s3` handlers, one of which adds the header.
            self._client.meta.events.register_last("before-call.s3", _no_continue_for_small_bodies)
        return self._client

    def _full(self, key: str) -> str:
        """The key as S3 names it: the key itself (keys are the store's real keys; the
        prefix is part of those derivd generates), validated."""
        return validate_key(key.rstrip("/")) + ("/" if key.endswith("/") else "")

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        """Run one S3 call, translating failures into outcomes with safe messages."""
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(Bucket=self.bucket, **kwargs)
        except ClientError as error:
            code = str(error.response.get("Error", {}).get("Code", ""))
            status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))
            if code not in _NOT_OURS and (code in _MISSING or status == 404):
                raise ObjectMissing(f"s3 {what}: {code or status}") from None
            if status in _RETRYABLE_HTTP or status == 0:
                raise StorageUnavailable(f"s3 {what}: {code or status}") from None
            raise StorageUnavailable(f"s3 {what} refused: {code} (HTTP {status})") from None
        except BotoCoreError as error:
            raise StorageUnavailable(f"s3 {what}: {type(error).__name__}") from None

    def check(self) -> None:
        try:
            answer = self._call("versioning check", self.client.get_bucket_versioning)
        except (StorageUnavailable, ObjectMissing) as error:
            raise StorageConfigError(f"s3 bucket {self.bucket!r} is not usable: {error}") from None
        if answer.get("Status") != "Enabled":
            raise StorageConfigError(
                f"s3 bucket {self.bucket!r} has versioning off; derivd needs it: "
                f"aws s3api put-bucket-versioning --bucket {self.bucket} "
                "--versioning-configuration Status=Enabled"
            )

    def put(self, key: str, data: bytes, content_type: str, *, sha256: str | None = None) -> str:
        # With our digest S3 checks the body against the hash taken when the variant was
        # encoded and keeps it as the object's checksum (GetObjectAttributes shows the
        # archive_variants.sha256 value); botocore then computes no checksum of its own.
        checksum = (
            {"ChecksumSHA256": base64.b64encode(bytes.fromhex(sha256)).decode()} if sha256 else {}
        )
        answer = self._call(
            "put",
            self.client.put_object,
            Key=self._full(key),
            Body=data,
            ContentType=content_type,
            **({"CacheControl": cc} if (cc := cache_control(key, self.prefix)) else {}),
            **checksum,
        )
        version = answer.get("VersionId")
        if not version or version == "null":
            raise StorageConfigError(f"s3 bucket {self.bucket!r} returned no version id")
        if answer.get("ResponseMetadata", {}).get("RetryAttempts"):
            # A retried PUT may have stored the bytes twice: the connection broke after S3
            # kept the first copy. derivd writes each key once (keys are generated per
            # upload and per attempt), so any other version is such a ghost, and nothing
            # would ever reference or sweep it. Failing here leaves the key to the sweep.
            self._delete_other_versions(key, str(version))
        return str(version)

    def _delete_other_versions(self, key: str, keep: str) -> None:
        full = self._full(key)
        ghosts = [{"Key": k, "VersionId": v} for k, v in self._versions(full) if k == full]
        ghosts = [g for g in ghosts if g["VersionId"] != keep]
        if ghosts:
            self._call(
                "delete", self.client.delete_objects, Delete={"Objects": ghosts, "Quiet": True}
            )

    def get(self, key: str, version: str, *, max_bytes: int | None = None) -> bytes:
        with refused_is_missing():
            full = self._full(key)
        answer = self._call("get", self.client.get_object, Key=full, VersionId=version)
        try:
            refuse_oversize(int(answer.get("ContentLength") or 0), max_bytes)
        except ResourceLimit:
            answer["Body"].close()
            raise
        try:
            body: bytes = answer["Body"].read()
        except Exception as error:  # a connection dropped mid-body
            raise StorageUnavailable(f"s3 get: body read failed ({type(error).__name__})") from None
        return body

    def _versions(self, prefix: str) -> Iterator[tuple[str, str]]:
        paginator = self.client.get_paginator("list_object_versions")
        pages = self._call("list versions", paginator.paginate, Prefix=prefix)
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            for page in pages:
                for item in page.get("Versions", []) + page.get("DeleteMarkers", []):
                    yield item["Key"], item["VersionId"]
        except (BotoCoreError, ClientError) as error:
            raise StorageUnavailable(f"s3 list versions: {type(error).__name__}") from None

    def delete_all_versions(self, key: str) -> int:
        full = self._full(key)
        exact = not key.endswith("/")
        doomed = [
            {"Key": k, "VersionId": v} for k, v in self._versions(full) if not exact or k == full
        ]
        for start in range(0, len(doomed), 1000):
            self._call(
                "delete",
                self.client.delete_objects,
                Delete={"Objects": doomed[start : start + 1000], "Quiet": True},
            )
        return len(doomed)

    def list_keys(self, prefix: str = "") -> Iterator[str]:
        seen: set[str] = set()
        for key, _ in self._versions(prefix):
            if key not in seen:
                seen.add(key)
                yield key


def _no_continue_for_small_bodies(model: Any, params: dict[str, Any], **_: Any) -> None:
    """`before-call` of PutObject (after botocore added the header): one round trip for a
    body of at most NO_CONTINUE_MAX_BYTES."""
    if getattr(model, "name", None) != "PutObject":
        return
    body = params.get("body")
    size = len(body) if isinstance(body, bytes | bytearray) else _stream_size(body)
    if size is not None and size <= NO_CONTINUE_MAX_BYTES:
        params.get("headers", {}).pop("Expect", None)


def _stream_size(body: Any) -> int | None:
    """The bytes left in a seekable body (botocore wraps `bytes` in a stream), or None."""
    try:
        here = body.tell()
        end = body.seek(0, 2)
        body.seek(here)
    except (AttributeError, OSError, ValueError):
        return None
    return int(end - here)
