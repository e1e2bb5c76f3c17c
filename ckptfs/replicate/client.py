"""The object store as ckptfs uses it: one boto3 S3 client, its calls, and why they failed.

Both sides of replication go through this module: the uploads (made in the
uploader process, uploader.py, for replicator.py) and the restore
(restore.py, in the daemon, and the mount-time checks in cli.py). `make_client(endpoint)` builds the boto3 client (thread-safe; every
call is blocking, so the trio services run them in worker threads):
credentials and region come from boto3's default chain (environment,
~/.aws files, instance role); `endpoint` is for stores other than AWS
(MinIO, Ceph RGW, SeaweedFS). `Target` binds one client to one bucket and
prefix, with the few calls replication needs: list, get (whole or a byte
range), put, delete, and the manifests under the prefix (`generations`,
`manifest`).

botocore retries each request a little itself (connection errors, 5xx,
throttling); what still fails leaves a Target call as `S3Error` (`classify`),
one line whose `cause` says what kind of failure it is, for the CLI, status,
logs and metrics:

    auth        credentials missing, unknown or wrong (403, InvalidAccessKeyId...)
    no-bucket   the bucket does not exist
    network     the endpoint cannot be reached (refused, DNS, timeout, reset)
    throttled   the store asks us to slow down (503 SlowDown, 429)
    server      the store failed (5xx)
    other       anything else (the message says what: a missing object, ...)
    device      (the replicator's own) reading the data to upload from a device failed
    uploader    (the replicator's own) the uploader process that makes replication's
                calls (uploader.py) died, hung or could not start
    conflict    (the replicator's own) another pool writes manifests under the prefix
                (lineage.py): replication stopped, not retried

Their kinds: TRANSIENT causes (network, throttled, server, uploader) may
pass by themselves and are retried with backoff, forever; the others are
permanent for the work they concern (auth and no-bucket, GLOBAL, for every
call: replication stops its cycle and tries again later, reading the
credentials again: a Target rebuilds its client after an auth failure).

What every upload carries besides its bytes (server-side encryption, a KMS
key, a storage class) comes from the environment (`upload_args`), where
`ckptfs mount --s3-sse/--s3-sse-kms-key-id/--s3-storage-class` put it, so
the daemon and its uploader process see the same; the region and a CA
bundle are boto3's own AWS_DEFAULT_REGION and AWS_CA_BUNDLE (`--s3-region`,
`--s3-ca-bundle`).

`Target.check()` is the mount-time check of --replicate: it looks up the
bucket and lists one key under the prefix, which needs the endpoint, the
credentials and the bucket to be right.
"""
from __future__ import annotations

import logging
import os

import boto3
from botocore.config import Config
from botocore.exceptions import (BotoCoreError, ClientError, ConnectionError as BotoConnectionError,
                                 NoCredentialsError, PartialCredentialsError)

from .manifest import MANIFESTS, Manifest, S3Url, manifest_generation, manifest_name

log = logging.getLogger("ckptfs.replicate")

AUTH, NO_BUCKET, NETWORK, THROTTLED, SERVER, OTHER, DEVICE, UPLOADER, CONFLICT = (
    "auth", "no-bucket", "network", "throttled", "server", "other", "device", "uploader", "conflict")
CAUSES = (AUTH, NO_BUCKET, NETWORK, THROTTLED, SERVER, OTHER, DEVICE, UPLOADER, CONFLICT)
TRANSIENT = frozenset({NETWORK, THROTTLED, SERVER, UPLOADER})  # may pass by themselves: retried with backoff
GLOBAL = frozenset({AUTH, NO_BUCKET})  # every call fails alike until a person acts
_AUTH_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken", "ExpiredToken",
               "AuthorizationHeaderMalformed", "InvalidSecurity", "403"}
_THROTTLE_CODES = {"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
                   "429"}


class S3Error(Exception):
    """A failed object-store call, in one line; `cause` is one of CAUSES."""

    def __init__(self, cause: str, message: str):
        super().__init__(message)
        self.cause = cause


SSE_ENV, KMS_KEY_ENV, STORAGE_CLASS_ENV = "CKPTFS_S3_SSE", "CKPTFS_S3_SSE_KMS_KEY_ID", "CKPTFS_S3_STORAGE_CLASS"
SSE_MODES = ("AES256", "aws:kms")
STORAGE_CLASSES = ("STANDARD", "STANDARD_IA", "ONEZONE_IA", "INTELLIGENT_TIERING", "GLACIER_IR",
                   "REDUCED_REDUNDANCY", "EXPRESS_ONEZONE")


def upload_args(env=os.environ) -> dict:
    """The put arguments the environment asks for (ValueError: a bad value)."""
    out = {}
    sse, key, cls = env.get(SSE_ENV), env.get(KMS_KEY_ENV), env.get(STORAGE_CLASS_ENV)
    if sse:
        if sse not in SSE_MODES:
            raise ValueError(f"bad server-side encryption {sse!r}: one of {', '.join(SSE_MODES)}")
        out["ServerSideEncryption"] = sse
    if key:
        if sse != "aws:kms":
            raise ValueError("a KMS key id needs server-side encryption aws:kms")
        out["SSEKMSKeyId"] = key
    if cls:
        if cls not in STORAGE_CLASSES:
            raise ValueError(f"bad storage class {cls!r}: one of {', '.join(STORAGE_CLASSES)}")
        out["StorageClass"] = cls
    return out


def transient(e: S3Error) -> bool:
    return e.cause in TRANSIENT


def make_client(endpoint: str | None = None, *, connections: int = 16, attempts: int = 3,
                connect_timeout: float = 5.0, read_timeout: float = 60.0):
    """A boto3 S3 client: the default credential chain, `endpoint` (None: AWS), `attempts` tries a call."""
    cfg = Config(max_pool_connections=connections, connect_timeout=connect_timeout, read_timeout=read_timeout,
                 retries={"max_attempts": attempts, "mode": "standard"},
                 request_checksum_calculation="when_required", response_checksum_validation="when_required")
    return boto3.session.Session().client("s3", endpoint_url=endpoint or None, config=cfg)


def code_status(exc: ClientError) -> tuple[str, int]:
    """The error code and HTTP status of a boto3 ClientError ("", 0 where it has none)."""
    return (str(exc.response.get("Error", {}).get("Code", "")),
            exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def classify(exc: BaseException, what: str = "") -> S3Error:
    """The S3Error for an exception raised by a boto3 call; `what` (the call and its object) leads the line."""
    prefix = f"{what}: " if what else ""
    if isinstance(exc, S3Error):
        return exc
    if isinstance(exc, (NoCredentialsError, PartialCredentialsError)):
        return S3Error(AUTH, f"{prefix}no usable AWS credentials (set AWS_ACCESS_KEY_ID and "
                             f"AWS_SECRET_ACCESS_KEY, ~/.aws/credentials, or an instance role): {exc}")
    if isinstance(exc, ClientError):
        code, status = code_status(exc)
        msg = exc.response.get("Error", {}).get("Message") or code
        if code in _AUTH_CODES or status == 403:
            return S3Error(AUTH, f"{prefix}access denied by the object store ({code}: {msg}); check the credentials")
        if code == "NoSuchBucket" or (status == 404 and what.startswith("bucket")):
            return S3Error(NO_BUCKET, f"{prefix}the bucket does not exist")
        if code in ("NoSuchKey", "404") or status == 404:
            return S3Error(OTHER, f"{prefix}no such object")
        if code in _THROTTLE_CODES or status == 429:
            return S3Error(THROTTLED, f"{prefix}the store asks to slow down ({code})")
        if status >= 500:
            return S3Error(SERVER, f"{prefix}the store failed ({status} {code}: {msg})")
        return S3Error(OTHER, f"{prefix}{code}: {msg}")
    if isinstance(exc, (BotoConnectionError, ConnectionError, TimeoutError)):
        return S3Error(NETWORK, f"{prefix}cannot reach the object store ({exc})")
    if isinstance(exc, BotoCoreError):
        return S3Error(OTHER, f"{prefix}{exc}")
    return S3Error(OTHER, f"{prefix}{type(exc).__name__}: {exc}")


class Target:
    """One bucket and prefix on one endpoint; blocking calls (run them in threads). `client` is
    made with `make_client(endpoint, **kw)` unless given."""

    def __init__(self, url: S3Url, endpoint: str | None = None, *, client=None, **kw):
        self.url = url
        self.endpoint = endpoint
        self._made = client is None  # our own client: rebuilt after an auth failure
        self._kw = kw
        self.client = client if client is not None else make_client(endpoint, **kw)
        self.bucket = url.bucket
        self.extra = upload_args()  # SSE, KMS key, storage class of every object written
        self.conditional = True  # the store takes If-None-Match on puts (until it says it does not)

    def __str__(self) -> str:
        return str(self.url) + (f" at {self.endpoint}" if self.endpoint else "")

    def key(self, rel: str) -> str:
        return self.url.key(rel)

    def _where(self, rel: str) -> str:
        return f"s3://{self.bucket}/{self.key(rel)}"

    def _call(self, what: str, fn, **kw):
        try:
            return fn(**kw)
        except Exception as e:  # noqa: BLE001 - every failure becomes an S3Error with its cause
            err = classify(e, what)
            if err.cause == AUTH and self._made:  # rotated credentials are picked up at the next call
                self.client = make_client(self.endpoint, **self._kw)
            raise err from None

    def list(self, rel: str) -> dict[str, int]:
        """Every key under PREFIX/rel: key relative to the prefix -> size."""
        return {k: size for k, (size, _) in self.list_detailed(rel).items()}

    def list_detailed(self, rel: str) -> dict[str, tuple[int, float]]:
        """Every key under PREFIX/rel: key relative to the prefix -> (size, last-modified time, s)."""
        out: dict[str, tuple[int, float]] = {}
        token = None
        while True:
            kw = {"Bucket": self.bucket, "Prefix": self.key(rel)}
            if token:
                kw["ContinuationToken"] = token
            page = self._call(f"list {self._where(rel)}", self.client.list_objects_v2, **kw)
            for obj in page.get("Contents", ()):
                out[obj["Key"][len(self.url.prefix):]] = (obj["Size"], obj["LastModified"].timestamp())
            token = page.get("NextContinuationToken")
            if not page.get("IsTruncated") or not token:
                return out

    def get(self, rel: str, start: int | None = None, end: int | None = None) -> bytes:
        """The object PREFIX/rel, or its bytes [start, end)."""
        what = f"get {self._where(rel)}"
        kw = {"Bucket": self.bucket, "Key": self.key(rel)}
        if start is not None:
            kw["Range"] = f"bytes={start}-{end - 1}"
            what += f" bytes {start}-{end - 1}"
        res = self._call(what, self.client.get_object, **kw)
        try:
            return res["Body"].read()
        except Exception as e:  # noqa: BLE001
            raise classify(e, what) from None

    def put(self, rel: str, body) -> None:
        self._call(f"put {self._where(rel)}", self.client.put_object, Bucket=self.bucket, Key=self.key(rel),
                   Body=body, **self.extra)

    def put_new(self, rel: str, body: bytes) -> bool:
        """Put `body` at `rel` unless something is there (If-None-Match: *): of two writers of one
        name, one wins. True when these bytes are there now (written, or an earlier attempt of the
        same put that botocore retried was), False when another object holds the name. A store
        that does not implement the condition gets plain puts from then on (logged once)."""
        what = f"put {self._where(rel)} if absent"
        if self.conditional:
            try:
                self.client.put_object(Bucket=self.bucket, Key=self.key(rel), Body=body, IfNoneMatch="*",
                                       **self.extra)
                return True
            except ClientError as e:
                code, status = code_status(e)
                if code == "PreconditionFailed" or status == 412:
                    return self.get(rel) == body
                if code != "NotImplemented" and status != 501:
                    raise classify(e, what) from None
                self.conditional = False
                log.warning("%s does not implement conditional puts (If-None-Match): two writers of one "
                            "manifest name cannot be told apart there", self)
            except Exception as e:  # noqa: BLE001
                raise classify(e, what) from None
        self.put(rel, body)
        return True

    def delete(self, rels: list[str]) -> None:
        for i in range(0, len(rels), 1000):
            batch = [{"Key": self.key(r)} for r in rels[i:i + 1000]]
            res = self._call(f"delete objects under {self._where('')}", self.client.delete_objects,
                             Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            errors = res.get("Errors") or []
            if errors:
                e = errors[0]
                raise S3Error(OTHER, f"delete {e.get('Key')}: {e.get('Code')}: {e.get('Message')}")

    def generations(self) -> list[int]:
        """The generations of the manifests under the prefix, oldest first."""
        return sorted(g for g in (manifest_generation(k) for k in self.list(MANIFESTS)) if g is not None)

    def manifest(self, generation: int) -> Manifest:
        """The manifest of `generation` (BadManifest when it does not decode)."""
        name = manifest_name(generation)
        return Manifest.decode(self.get(name), self._where(name))

    def newest(self) -> Manifest | None:
        """The newest manifest under the prefix (None: there is none; BadManifest when it does not decode)."""
        gens = self.generations()
        return self.manifest(gens[-1]) if gens else None

    def check(self) -> None:
        """Mount-time check that the target can be used; raises S3Error with one clear line."""
        self._call(f"bucket {self.bucket}", self.client.head_bucket, Bucket=self.bucket)
        # the listing needs the read permission on the prefix too
        self._call(f"list {self._where('')}", self.client.list_objects_v2, Bucket=self.bucket,
                   Prefix=self.key(""), MaxKeys=1)
