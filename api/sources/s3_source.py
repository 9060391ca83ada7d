"""An adapter source in S3-compatible object storage (`--adapter-source s3://bucket/prefix`): adapter `name` is the
objects `<prefix>/<name>/adapter_config.json` and `<prefix>/<name>/adapter_model.safetensors`. Listing gives each
object's size and ETag; a download streams to a file and is checked against both (an ETag without a `-` is the
object's MD5; a multipart upload's ETag is checked by size alone). boto3 signs, retries (its standard mode: bounded
attempts with exponential backoff) and times out; credentials come from the usual AWS chain, never a request."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

FILES = ("adapter_config.json", "adapter_model.safetensors")  # what a PEFT adapter needs, and all that is fetched
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CHUNK = 1 << 20


class StoreError(Exception):
    """Fetching failed. `status`: 503 (store unreachable or its answer unusable) or 504 (it did not answer in
    time); `reason`: what a client may read (no endpoint, bucket, path or credential)."""

    def __init__(self, reason: str, status: int = 503) -> None:
        super().__init__(reason)
        self.reason, self.status = reason, status


@dataclass(frozen=True)
class StoredObject:
    file: str  # one of FILES
    key: str
    size: int
    etag: str  # without its quotes


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, prefix without slashes at its ends) of `s3://bucket[/prefix]`; a ValueError saying what is wrong."""
    match = re.fullmatch(r"s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(.*))?", url)
    if match is None:
        raise ValueError(f"adapter source {url!r}: expected s3://bucket/prefix")
    return match.group(1), (match.group(2) or "").strip("/")


def valid_name(name: str) -> bool:
    """Whether `name` can be an adapter folder in a bucket: no separators, no `..`, nothing a key would read
    differently."""
    return bool(_NAME.match(name)) and ".." not in name


class S3Source:
    def __init__(self, url: str, endpoint_url: str | None = None, timeout_s: float = 30.0,
                 max_attempts: int = 3) -> None:
        import boto3
        from botocore.config import Config

        self.url, self.endpoint_url = url.rstrip("/"), endpoint_url
        self.bucket, self.prefix = parse_url(url)
        config = Config(connect_timeout=timeout_s, read_timeout=timeout_s,
                        retries={"max_attempts": max_attempts, "mode": "standard"})
        self.client = boto3.client("s3", endpoint_url=endpoint_url, config=config)

    @property
    def identity(self) -> str:
        """Where this source's objects live, as one string (the disk cache keys its folders by it)."""
        return f"{self.endpoint_url or 'aws'}|{self.url}"

    def key(self, name: str, file: str) -> str:
        return "/".join(p for p in (self.prefix, name, file) if p)

    def listing(self, name: str) -> list[StoredObject] | None:
        """The adapter's objects (both FILES), None when it is not in this source (either file missing)."""
        folder = self.key(name, "") + "/"  # the slash: `a0` must not list `a01/...`
        with _translated():
            answer = self.client.list_objects_v2(Bucket=self.bucket, Prefix=folder, MaxKeys=100)
        found = {item["Key"][len(folder):]: item for item in answer.get("Contents", ())}
        if not all(file in found for file in FILES):
            return None
        return [StoredObject(file, found[file]["Key"], int(found[file]["Size"]), found[file]["ETag"].strip('"'))
                for file in FILES]

    def download(self, obj: StoredObject, dest: Path) -> str:
        """`obj` into `dest`, checked against its listed size and ETag; the file's SHA-256 (hex). The object must
        still be the listed version (`IfMatch`): one changed meanwhile fails rather than mixing versions."""
        sha, md5, size = hashlib.sha256(), hashlib.md5(usedforsecurity=False), 0
        with dest.open("wb") as out, _translated():
            body = self.client.get_object(Bucket=self.bucket, Key=obj.key, IfMatch=f'"{obj.etag}"')["Body"]
            for chunk in body.iter_chunks(_CHUNK):
                sha.update(chunk)
                md5.update(chunk)
                out.write(chunk)
                size += len(chunk)
        if size != obj.size or ("-" not in obj.etag and md5.hexdigest() != obj.etag.lower()):
            raise StoreError("the stored adapter is incomplete or corrupt")
        return sha.hexdigest()


class _translated:
    """botocore's failures as StoreErrors a client may read (what they were goes to the operator's log)."""

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or isinstance(exc, StoreError):
            return False
        from botocore.exceptions import (BotoCoreError, ClientError, ConnectTimeoutError, ReadTimeoutError,
                                         ResponseStreamingError)

        if isinstance(exc, (ConnectTimeoutError, ReadTimeoutError)):
            raise StoreError("the adapter store did not answer in time", 504) from exc
        if isinstance(exc, ResponseStreamingError):
            raise StoreError("the download from the adapter store broke off") from exc
        if isinstance(exc, ClientError):
            code = exc.response.get("Error", {}).get("Code", "")
            if code in ("PreconditionFailed", "412"):
                raise StoreError("the stored adapter changed during the download; retry") from exc
            raise StoreError("the adapter store refused the request") from exc
        if isinstance(exc, (BotoCoreError, OSError)):
            raise StoreError("the adapter store is unreachable") from exc
        return False
