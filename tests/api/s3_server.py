"""A real S3-compatible server for tests: moto's server app on 127.0.0.1, behind a middleware that counts the
requests it answers (method and object key, as the store sees them) and can break them: a body cut short, a slow
answer. `stop` / `start` take the store away and bring it back on the same port."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import Counter
from pathlib import Path

from werkzeug.serving import make_server

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true"}


class S3Server:
    def __init__(self) -> None:
        from moto.server import DomainDispatcherApplication, create_backend_app

        for key, value in CREDENTIALS.items():  # boto3 in this process reads them (the AWS chain, as in production)
            os.environ.setdefault(key, value)
        self.app = DomainDispatcherApplication(create_backend_app)
        self.counts: Counter[tuple[str, str]] = Counter()
        self.cut: set[str] = set()  # keys whose GET answers half the body, then closes
        self.delay_s = 0.0  # before each answer
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = None
        self.start()

    def __call__(self, environ, start_response):
        path = environ.get("PATH_INFO", "")
        query = environ.get("QUERY_STRING", "")
        method = environ["REQUEST_METHOD"]
        key = path.lstrip("/").split("/", 1)[1] if path.count("/") > 1 else ""
        self.counts[method if not query.startswith("list-type") else "LIST", key] += 1
        if self.delay_s:
            time.sleep(self.delay_s)
        body = self.app(environ, start_response)
        if method == "GET" and key in self.cut:
            data = b"".join(body)
            return [data[:len(data) // 2]]  # Content-Length says more: the client's read breaks off
        return body

    def gets(self, key_part: str = "") -> int:
        """GETs of objects whose key contains `key_part`."""
        return sum(n for (method, key), n in self.counts.items() if method == "GET" and key_part in key)

    def start(self) -> None:
        self._server = make_server("127.0.0.1", self.port, self, threaded=True)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.url)

    def put_adapter(self, bucket: str, prefix: str, name: str, folder: Path) -> None:
        """A PEFT folder's two files as objects `<prefix>/<name>/<file>`."""
        s3 = self.client()
        try:
            s3.create_bucket(Bucket=bucket)
        except s3.exceptions.BucketAlreadyOwnedByYou:
            pass
        for file in ("adapter_config.json", "adapter_model.safetensors"):
            key = "/".join(p for p in (prefix, name, file) if p)
            s3.put_object(Bucket=bucket, Key=key, Body=(Path(folder) / file).read_bytes())
