"""The S3 side of a restore: a boto3 client from the standard AWS chain, and errors in one line.

`make_client(endpoint)` builds a thread-safe boto3 S3 client: credentials and
region come from the standard chain (environment, config files, instance
role); `endpoint` is for non-AWS stores (MinIO, Ceph RGW, SeaweedFS).
`describe(exc)` turns whatever boto3 raises into one line naming the cause
(wrong credentials, missing bucket, unreachable endpoint), for the CLI, the
logs and `ckptfs status`. `newest_manifest` finds and decodes the newest
manifest under a prefix, raising `SourceError` with such a line.
"""
from __future__ import annotations

from .manifest import MANIFESTS, BadManifest, Manifest, S3Url, manifest_generation, manifest_name


class SourceError(Exception):
    """The object store cannot give what a restore needs; the message says why, in one line."""


def make_client(endpoint: str | None = None, *, connections: int = 16, attempts: int = 3,
                connect_timeout: float = 5.0):
    import boto3
    from botocore.config import Config

    config = Config(retries={"mode": "standard", "max_attempts": attempts}, max_pool_connections=connections,
                    connect_timeout=connect_timeout, read_timeout=60)
    return boto3.session.Session().client("s3", endpoint_url=endpoint or None, config=config)


def describe(e: BaseException, where: str = "") -> str:
    """One line for a failed S3 call: the cause first (credentials, bucket, endpoint...)."""
    from botocore import exceptions as bx

    at = f" ({where})" if where else ""
    if isinstance(e, bx.NoCredentialsError):
        return f"no S3 credentials found: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or a profile{at}"
    if isinstance(e, (bx.EndpointConnectionError, bx.ConnectTimeoutError, bx.ReadTimeoutError,
                      bx.ConnectionClosedError)):
        return f"cannot reach the object store: {e}"
    if isinstance(e, bx.ClientError):
        err = e.response.get("Error", {})
        code = err.get("Code", "")
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken",
                    "ExpiredToken") or status == 403:
            return f"access denied by the object store ({code or status}): check the credentials{at}"
        if code == "NoSuchBucket":
            return f"no such bucket{at}"
        if code in ("NoSuchKey", "404") or status == 404:
            return f"no such object{at}"
        return f"object store error {code or status}: {err.get('Message', e)}{at}"
    if isinstance(e, bx.BotoCoreError):
        return f"object store error: {e}{at}"
    return f"{type(e).__name__}: {e}{at}"


def list_generations(client, url: S3Url) -> list[int]:
    """The generations of the manifests under `url`'s prefix (raises botocore errors)."""
    gens = []
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=url.bucket, Prefix=url.key(MANIFESTS))
    for page in pages:
        for obj in page.get("Contents", []):
            gen = manifest_generation(obj["Key"][len(url.prefix):])
            if gen is not None:
                gens.append(gen)
    return sorted(gens)


def load_manifest(client, url: S3Url, generation: int | None = None) -> Manifest:
    """The manifest of `generation` (None: the newest) under `url`; SourceError with the cause."""
    try:
        if generation is None:
            gens = list_generations(client, url)
            if not gens:
                raise SourceError(f"no manifest under {url}: nothing was replicated there "
                                  f"(expected {url}{MANIFESTS}<generation>.json)")
            generation = gens[-1]
        key = url.key(manifest_name(generation))
        raw = client.get_object(Bucket=url.bucket, Key=key)["Body"].read()
    except SourceError:
        raise
    except Exception as e:  # noqa: BLE001 - every failure becomes one line
        raise SourceError(describe(e, str(url))) from None
    try:
        return Manifest.decode(raw, f"s3://{url.bucket}/{key}")
    except BadManifest as e:
        raise SourceError(str(e)) from None
