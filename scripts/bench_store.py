"""Where a benchmark puts its warehouses: a local scratch directory, or fresh
prefixes of a bucket (a real one given by `--warehouse s3://…`, or the
loopback server of `scripts/s3_loopback.py` started by `--s3-loopback`).

Both benchmarks take the same flags from `add_arguments` and get their stores
from `stores_from_args`: with an object store they measure local disk and the
object store in one invocation, so its cost is a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import urllib.request
import uuid

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from txn_core.config import Config, absolute_warehouse, load_config
from txn_core.storage import Storage, is_s3, use

from s3_loopback import Running

LOOPBACK_BUCKET = "bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("object store (measured beside local disk)")
    group.add_argument(
        "--warehouse",
        default=None,
        metavar="s3://BUCKET/PREFIX",
        help="measure on this bucket too; each measured design gets a fresh "
        "prefix under it (credentials from the AWS environment/profile)",
    )
    group.add_argument("--s3-endpoint", default="", help="as the s3_endpoint key")
    group.add_argument("--s3-region", default="", help="as the s3_region key")
    group.add_argument("--s3-path-style", choices=("true", "false"), default="false")
    group.add_argument("--s3-allow-http", choices=("true", "false"), default="false")
    group.add_argument(
        "--s3-loopback",
        nargs="?",
        const="minio",
        choices=("minio", "moto"),
        default=None,
        help="start an S3 server on 127.0.0.1 (scripts/s3_loopback.py: MinIO "
        "unless 'moto' is given) and measure on it; it also counts the "
        "requests per message",
    )


class Store:
    """Local scratch space (`root` None) or an object-store prefix.

    `counts_url`: where the server reports its request counts (the loopback
    server does; a real bucket does not, and `requests()` is then empty)."""

    def __init__(
        self,
        root: str | None = None,
        *,
        s3_endpoint: str = "",
        s3_region: str = "",
        s3_path_style: bool = False,
        s3_allow_http: bool = False,
        counts_url: str | None = None,
    ):
        self.local_root = None if root else tempfile.mkdtemp(prefix="bench-")
        # The URI form both engines read (delta-rs and Spark's s3a).
        self.root = (
            absolute_warehouse(root.rstrip("/") + "/" + uuid.uuid4().hex[:12])
            if root
            else self.local_root
        )
        self.name = "local" if root is None else "s3"
        self.s3 = {
            "s3_endpoint": s3_endpoint,
            "s3_region": s3_region,
            "s3_path_style": s3_path_style,
            "s3_allow_http": s3_allow_http,
        }
        self.counts_url = counts_url

    def warehouse(self, name: str | None = None) -> str:
        """A location for a warehouse, fresh unless `name` was used before."""
        return f"{self.root}/{name or uuid.uuid4().hex}"

    def config(self, warehouse: str, **keys) -> Config:
        """The configuration of `warehouse`, registered for delta-rs (and the
        store checked once) so that every path under it finds its settings."""
        config = self._config(warehouse, **keys)
        use(Storage.from_config(config))
        return config

    def _config(self, warehouse: str, **keys) -> Config:
        return load_config(
            env={}, warehouse=warehouse, **(self.s3 if self.name == "s3" else {}), **keys
        )

    def cli_flags(self) -> list[str]:
        """The same settings as `txn-reconcile` flags."""
        if self.name == "local":
            return []
        flags = []
        for key, value in self.s3.items():
            if value not in ("", False):
                flags += [
                    "--" + key.replace("_", "-"),
                    str(value).lower() if isinstance(value, bool) else value,
                ]
        return flags

    def copy(self, source: str, target: str) -> None:
        """Copy a warehouse, object by object on a store."""
        if self.name == "local":
            shutil.copytree(source, target)
            return
        client, bucket, src = self._client(source)
        dst = self._key(target)
        for key in self._keys(client, bucket, src):
            client.copy_object(
                Bucket=bucket, Key=dst + key[len(src) :], CopySource={"Bucket": bucket, "Key": key}
            )

    def remove(self, warehouse: str) -> None:
        if self.name == "local":
            shutil.rmtree(warehouse, ignore_errors=True)
            return
        client, bucket, prefix = self._client(warehouse)
        keys = list(self._keys(client, bucket, prefix))
        for i in range(0, len(keys), 1000):
            client.delete_objects(
                Bucket=bucket,
                Delete={"Objects": [{"Key": k} for k in keys[i : i + 1000]], "Quiet": True},
            )

    def requests(self) -> dict[str, int]:
        """The server's request counts by kind so far ({} when it keeps none)."""
        if self.counts_url is None:
            return {}
        with urllib.request.urlopen(self.counts_url, timeout=10) as resp:
            return json.load(resp)

    def close(self) -> None:
        if self.local_root:
            shutil.rmtree(self.local_root, ignore_errors=True)
        else:
            self.remove(self.root)

    def _key(self, uri: str) -> str:
        return uri.split("://", 1)[1].split("/", 1)[1].rstrip("/") + "/"

    def _client(self, uri: str):
        storage = Storage.from_config(self._config(uri))
        return storage.s3_client(), storage.bucket, self._key(uri)

    @staticmethod
    def _keys(client, bucket: str, prefix: str):
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                yield obj["Key"]


class Loopback(Running):
    """The loopback server with one bucket, for a benchmark."""

    def __init__(self, server: str = "minio", bucket: str = LOOPBACK_BUCKET):
        # This process's credentials become MinIO's (moto takes any).
        os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
        os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench-secret")
        super().__init__(server, bucket)
        self.bucket = bucket

    def store(self) -> Store:
        return Store(
            f"s3://{self.bucket}",
            s3_endpoint=self.endpoint,
            s3_path_style=True,
            s3_allow_http=True,
            counts_url=self.counts_url,
        )


def stores_from_args(args) -> tuple[list[Store], Loopback | None]:
    """[local] alone, or [local, object store] with the loopback server (to
    stop after) when the flags ask for one."""
    if args.s3_loopback:
        server = Loopback(args.s3_loopback)
        return [Store(), server.store()], server
    if args.warehouse:
        if not is_s3(args.warehouse):
            raise SystemExit(f"--warehouse must be an s3:// URI; got {args.warehouse!r}")
        return [
            Store(),
            Store(
                args.warehouse,
                s3_endpoint=args.s3_endpoint,
                s3_region=args.s3_region,
                s3_path_style=args.s3_path_style == "true",
                s3_allow_http=args.s3_allow_http == "true",
            ),
        ], None
    return [Store()], None
