"""S3 object store on boto3 (``s3://bucket/prefix``): AWS S3, MinIO, SeaweedFS (SPEC §7).

- Create-if-absent is a conditional write: ``PutObject`` (or, for large blobs,
  ``CompleteMultipartUpload``) with ``If-None-Match: *``. HTTP 412 -> ``AlreadyExists``;
  HTTP 409 (a concurrent conditional write) -> ``Conflict`` (retryable).
- Large blobs go up in parts (``multipart_chunksize``) in parallel; the conditional header sits on
  the completing request, so a large create-if-absent is as atomic as a small one.
- Botocore's defaults (60 s timeouts, legacy retries) make a call against a dead endpoint hang
  for about three minutes. Here ``connect_timeout=1``, ``read_timeout=5`` and two attempts in
  total bound it to a few seconds, after which the store raises ``Unavailable`` and the caller
  decides (retry, spill, keep training).
- Listing is byte order on AWS and MinIO. SeaweedFS lists a directory's keys right after the
  directory name (``a``, ``a/b``, ``a-b``), so callers that rely on order or ``start_after`` list
  one level (``log/``, ``checkpoints/``): there every backend agrees (docs/storage.md).

Endpoint: ``endpoint`` or the standard ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL``;
credentials and region: the standard AWS chain (region defaults to us-east-1 for custom endpoints).
"""
from __future__ import annotations

import io
import os
import re
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import threading

import boto3
import botocore.exceptions as bce
import botocore.session
from boto3.s3.transfer import TransferConfig
from botocore.config import Config

from .errors import AlreadyExists, BadLocation, Conflict, NotFound, StoreError, Unavailable
from .store import ObjectInfo, check_key, check_limit, check_prefix

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
MIN_PART = 5 << 20  # S3's minimum part size (all parts but the last)
# refused or timed-out connections, read timeouts, resets, cut streams
_UNAVAILABLE = (bce.ConnectionError, bce.HTTPClientError, bce.IncompleteReadError)
_NO_CREDENTIALS = (bce.NoCredentialsError, bce.PartialCredentialsError)


_loader_lock = threading.Lock()
_loader = None


def _new_session(profile: str | None = None) -> boto3.session.Session:
    """A fresh session (credentials and region resolved now, from the shared-config ``profile``
    when one is named: each region of a run may use its own, docs/regions.md) sharing one data
    loader: loading botocore's service models is ~90% of the cost of a new client."""
    global _loader
    core = botocore.session.get_session()
    if profile is not None:
        core.set_config_variable("profile", profile)
    with _loader_lock:
        if _loader is None:
            _loader = core.get_component("data_loader")
        else:
            core.register_component("data_loader", _loader)
    return boto3.session.Session(botocore_session=core)


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> ``("bucket", "some/prefix")``; ``BadLocation`` if malformed."""
    parts = urlsplit(uri)
    if parts.scheme.lower() != "s3":
        raise BadLocation(f"not an s3:// URI: {uri!r}")
    if parts.query or parts.fragment or "@" in parts.netloc:
        raise BadLocation(f"s3 URI {uri!r} must be s3://bucket/prefix (no credentials, query or fragment)")
    bucket = parts.netloc
    if not _BUCKET_RE.match(bucket) or ".." in bucket:
        raise BadLocation(f"bad bucket name {bucket!r} in {uri!r}: 3-63 characters of a-z, 0-9, '.', '-'")
    prefix = parts.path.strip("/")
    if prefix:
        try:
            check_key(prefix)
        except BadLocation as exc:
            raise BadLocation(f"bad prefix in {uri!r}: {exc.detail}") from None
    return bucket, prefix


EXPECT_CONTINUE_MIN = 1 << 20   # bodies below this are sent without "Expect: 100-continue"


def _no_expect_for_small_bodies(request, **_) -> None:
    """botocore asks every PutObject to wait for "100 Continue" before sending the body: a second
    round trip on every PUT (0.21 s instead of 0.11 s at rtt 100 ms, docs/regions.md). It only saves
    sending a body the server refuses, which for a small one costs less than that round trip."""
    body = request.body
    if isinstance(body, io.BytesIO) and len(body.getbuffer()) < EXPECT_CONTINUE_MIN:
        request.headers.pop("Expect", None)


class S3Store:
    """An ``ObjectStore`` on one bucket and prefix. Thread-safe (one boto3 client)."""

    def __init__(self, uri: str, *, endpoint: str | None = None, path_style: bool | None = None,
                 connect_timeout: float = 1.0, read_timeout: float = 5.0, attempts: int = 2,
                 multipart_threshold: int = 16 << 20, multipart_chunksize: int = 16 << 20,
                 max_concurrency: int = 4, page_size: int = 1000, profile: str | None = None) -> None:
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.uri = f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"
        self._base = f"{self.prefix}/" if self.prefix else ""
        if multipart_chunksize < MIN_PART or multipart_threshold < multipart_chunksize:
            raise ValueError(f"need multipart_threshold >= multipart_chunksize >= {MIN_PART}, got "
                             f"{multipart_threshold} and {multipart_chunksize}")
        if not 1 <= page_size <= 1000:
            raise ValueError(f"page_size must lie in 1..1000 (S3's maximum), got {page_size}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.transfer = TransferConfig(multipart_threshold=multipart_threshold,
                                       multipart_chunksize=multipart_chunksize, max_concurrency=max_concurrency)
        self.page_size = page_size
        self.endpoint = endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None
        if self.endpoint is not None:
            ep = urlsplit(self.endpoint)
            if ep.scheme not in ("http", "https") or not ep.hostname:
                raise BadLocation(f"bad S3 endpoint {self.endpoint!r}: expected http(s)://host[:port]", uri=self.uri)
        if path_style is None:
            path_style = self.endpoint is not None  # MinIO/SeaweedFS rarely have wildcard DNS
        try:
            session = _new_session(profile)
            region = session.region_name or "us-east-1"
        except bce.ProfileNotFound:
            # A region's profile this machine's AWS config lacks (a --wan run's servers and config
            # went with the run, issue 26): a clear error, not botocore's traceback.
            raise BadLocation(f"AWS profile {profile!r} (the credentials of {self.uri}) is not in this machine's "
                              "AWS config (AWS_CONFIG_FILE / ~/.aws/config)", uri=self.uri) from None
        config = Config(
            connect_timeout=connect_timeout, read_timeout=read_timeout,
            retries={"total_max_attempts": attempts, "mode": "standard"},
            s3={"addressing_style": "path" if path_style else "auto"},
            max_pool_connections=max(10, 2 * max_concurrency),
            # Our envelopes carry sha256 checksums; default CRC trailers break older S3 clones.
            request_checksum_calculation="when_required", response_checksum_validation="when_required",
        )
        self._client = session.client("s3", endpoint_url=self.endpoint, region_name=region, config=config)
        self._client.meta.events.register("before-send.s3", _no_expect_for_small_bodies)

    def __repr__(self) -> str:
        return f"S3Store({self.uri!r}, endpoint={self.endpoint!r})"

    # -- reads ---------------------------------------------------------------------------------

    def get(self, key: str) -> bytes:
        full = self._full(key)
        try:
            resp = self._client.get_object(Bucket=self.bucket, Key=full)
            return resp["Body"].read()
        except Exception as exc:
            raise self._error(exc, key, "get") from None

    def head(self, key: str) -> ObjectInfo:
        full = self._full(key)
        try:
            resp = self._client.head_object(Bucket=self.bucket, Key=full)
        except Exception as exc:
            raise self._error(exc, key, "head") from None
        return ObjectInfo(key=key, size=int(resp["ContentLength"]), etag=str(resp.get("ETag", "")).strip('"'))

    def exists(self, key: str) -> bool:
        try:
            self.head(key)
            return True
        except NotFound:
            return False

    def list(self, prefix: str = "", start_after: str | None = None, limit: int | None = None) -> list[str]:
        check_prefix(prefix, self.uri)
        if start_after is not None:
            check_prefix(start_after, self.uri, "start_after")
        check_limit(limit, self.uri)
        keys: list[str] = []
        kwargs = {"Bucket": self.bucket, "Prefix": self._base + prefix}
        if start_after is not None:
            kwargs["StartAfter"] = self._base + start_after
        while limit is None or len(keys) < limit:
            page = self.page_size if limit is None else min(self.page_size, limit - len(keys))
            try:
                resp = self._client.list_objects_v2(MaxKeys=page, **kwargs)
            except Exception as exc:
                raise self._error(exc, prefix or None, "list") from None
            keys += [obj["Key"][len(self._base):] for obj in resp.get("Contents", ())]
            token = resp.get("NextContinuationToken")
            if not resp.get("IsTruncated") or not token:
                break
            kwargs["ContinuationToken"] = token
        return keys if limit is None else keys[:limit]

    # -- writes --------------------------------------------------------------------------------

    def put_if_absent(self, key: str, data: bytes) -> None:
        self._put(key, data, conditional=True)

    def put(self, key: str, data: bytes) -> None:
        self._put(key, data, conditional=False)

    def delete(self, key: str) -> None:
        full = self._full(key)
        try:
            self._client.delete_object(Bucket=self.bucket, Key=full)
        except Exception as exc:
            err = self._error(exc, key, "delete")
            if not isinstance(err, NotFound):
                raise err from None

    def _put(self, key: str, data: bytes, conditional: bool) -> None:
        full = self._full(key)
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"object data must be bytes, got {type(data).__name__}")
        data = bytes(data)
        if len(data) > self.transfer.multipart_threshold:
            return self._multipart(key, full, data, conditional)
        extra = {"IfNoneMatch": "*"} if conditional else {}
        try:
            self._client.put_object(Bucket=self.bucket, Key=full, Body=data, **extra)
        except Exception as exc:
            raise self._error(exc, key, "create" if conditional else "put") from None

    def _multipart(self, key: str, full: str, data: bytes, conditional: bool) -> None:
        op = "create" if conditional else "put"
        try:
            upload_id = self._client.create_multipart_upload(Bucket=self.bucket, Key=full)["UploadId"]
        except Exception as exc:
            raise self._error(exc, key, op) from None
        size = self.transfer.multipart_chunksize
        chunks = [(n + 1, data[off:off + size]) for n, off in enumerate(range(0, len(data), size))]

        def upload(part: tuple[int, bytes]) -> dict:
            number, body = part
            resp = self._client.upload_part(Bucket=self.bucket, Key=full, UploadId=upload_id,
                                            PartNumber=number, Body=body)
            return {"PartNumber": number, "ETag": resp["ETag"]}

        try:
            with ThreadPoolExecutor(max_workers=min(self.transfer.max_concurrency, len(chunks))) as pool:
                parts = list(pool.map(upload, chunks))
            extra = {"IfNoneMatch": "*"} if conditional else {}
            self._client.complete_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id,
                                                   MultipartUpload={"Parts": parts}, **extra)
        except Exception as exc:
            self._abort(full, upload_id)
            err = self._error(exc, key, op)
            code = getattr(exc, "response", {}).get("Error", {}).get("Code", "")
            if code == "NoSuchUpload" and self.exists(key):
                # A retried completion whose first attempt landed: the object is there.
                if conditional:
                    raise AlreadyExists("object exists (an earlier, timed-out attempt may have created it)",
                                        uri=self.uri, key=key) from None
                return
            raise err from None

    def _abort(self, full: str, upload_id: str) -> None:
        try:
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=full, UploadId=upload_id)
        except Exception:
            pass  # best effort; a bucket lifecycle rule reaps what is left

    # -- helpers -------------------------------------------------------------------------------

    def _full(self, key: str) -> str:
        check_key(key, self.uri)
        return self._base + key

    def _error(self, exc: Exception, key: str | None, op: str) -> StoreError:
        """Translate a boto3/botocore exception into the store's errors (never leak them)."""
        uri, where = self.uri, f" at {self.endpoint}" if self.endpoint else ""
        if isinstance(exc, StoreError):
            return exc
        if isinstance(exc, bce.ClientError):
            err = exc.response.get("Error", {}) or {}
            code, msg = str(err.get("Code", "")), str(err.get("Message", ""))
            status = int((exc.response.get("ResponseMetadata", {}) or {}).get("HTTPStatusCode") or 0)
            if code == "NoSuchBucket":
                return StoreError(f"bucket {self.bucket!r} does not exist{where}; create it first "
                                  "(infra/minio/bootstrap.sh or `aws s3 mb`)", uri=uri, key=key)
            if code in ("NoSuchKey", "NotFound", "404") or status == 404:
                return NotFound("no such object", uri=uri, key=key)
            if status == 412 or code == "PreconditionFailed":
                return AlreadyExists("object exists (create-if-absent refused, HTTP 412)", uri=uri, key=key)
            if status == 409 or code in ("ConditionalRequestConflict", "OperationAborted"):
                return Conflict(f"{op}: concurrent write to the same key (HTTP {status} {code}); retry",
                                uri=uri, key=key)
            if status in (401, 403) or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return StoreError(f"{op}: access denied{where} ({code}); check the credentials and the "
                                  "bucket policy", uri=uri, key=key)
            if status == 501 or code == "NotImplemented":
                return StoreError(f"{op}: this store does not implement the request ({code}: {msg})", uri=uri, key=key)
            if code == "InvalidBucketName":
                return BadLocation(f"invalid bucket name {self.bucket!r}", uri=uri)
            if status in (429, 503) or status >= 500 or code in ("SlowDown", "RequestTimeout", "InternalError"):
                return Unavailable(f"{op}: store failing{where} (HTTP {status} {code})", uri=uri, key=key)
            return StoreError(f"{op} failed: HTTP {status} {code} {msg}", uri=uri, key=key)
        if isinstance(exc, _NO_CREDENTIALS):
            return StoreError("no S3 credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                              "(or AWS_PROFILE / an instance role)", uri=uri, key=key)
        if isinstance(exc, _UNAVAILABLE):
            return Unavailable(f"{op}: store unreachable{where} ({type(exc).__name__})", uri=uri, key=key)
        if isinstance(exc, bce.BotoCoreError):
            return StoreError(f"{op} failed: {exc}", uri=uri, key=key)
        if isinstance(exc, (TypeError, ValueError)):
            raise exc
        return StoreError(f"{op} failed: {type(exc).__name__}: {exc}", uri=uri, key=key)
