#!/usr/bin/env python3
"""An S3-compatible server on loopback, for the tests, the benchmarks and a demo.

Two servers, both installed by `make setup` and both enforcing conditional
writes (`If-None-Match: *`):

- `--server moto` (the default): moto's standalone server, in this process.
  It accepts any credentials and keeps its data in memory. Two additions of
  ours sit in front of it: `--no-conditional-writes` drops the conditional
  headers before moto sees them (a store that does not enforce put-if-absent,
  which the broker core must refuse to write to), and the request counts.
- `--server minio`: MinIO built from its Go module (`target/bin/minio`), in a
  child process, with its data in a scratch directory removed at exit. It
  checks signatures: its only credentials are the AWS_ACCESS_KEY_ID /
  AWS_SECRET_ACCESS_KEY this script is started with (the secret at least 8
  characters). Being a compiled server, its CPU per request is close to a
  real store's, which is what the benchmarks measure.

Either way `GET /_txn/requests` on the counts port printed at start returns
the requests answered so far by kind (PUT, GET, HEAD, LIST, DELETE, POST):
the benchmarks' requests per message.

    python scripts/s3_loopback.py --port 9000 --bucket warehouse
    # then: warehouse = "s3://warehouse/demo", s3_endpoint = "http://127.0.0.1:9000",
    #       s3_path_style = true, s3_allow_http = true, and any AWS_ACCESS_KEY_ID /
    #       AWS_SECRET_ACCESS_KEY (moto accepts every key)

It prints `ready <port> counts <port>` once the buckets exist, and runs until
killed (SIGTERM or Ctrl-C stops
MinIO too; a SIGKILL stops it through the parent-death signal).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

COUNTS_PATH = "/_txn/requests"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINIO = os.path.join(REPO, "target", "bin", "minio")


def _kind(environ: dict) -> str:
    method = environ["REQUEST_METHOD"]
    if method == "GET" and "list-type" in environ.get("QUERY_STRING", ""):
        return "LIST"
    return method


def counting_app(app, *, conditional_writes: bool = True):
    """Wrap a WSGI app: count requests by kind, serve the counts, and drop
    conditional-write headers when `conditional_writes` is False."""
    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()

    def wrapped(environ, start_response):
        if environ.get("PATH_INFO") == COUNTS_PATH:
            with lock:
                body = json.dumps(dict(counts)).encode()
            start_response(
                "200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))]
            )
            return [body]
        with lock:
            counts[_kind(environ)] += 1
        if not conditional_writes:
            environ.pop("HTTP_IF_NONE_MATCH", None)
            environ.pop("HTTP_IF_MATCH", None)
        return app(environ, start_response)

    return wrapped


def _create_buckets(endpoint: str, buckets: list[str], key_id: str, secret: str) -> None:
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=key_id,
        aws_secret_access_key=secret,
    )
    for bucket in buckets:
        client.create_bucket(Bucket=bucket)


def serve_moto(args) -> int:
    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app = counting_app(
        DomainDispatcherApplication(create_backend_app),
        conditional_writes=not args.no_conditional_writes,
    )
    server = make_server("127.0.0.1", args.port, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _create_buckets(f"http://127.0.0.1:{server.port}", args.bucket, "loopback", "loopback")
    print(f"ready {server.port} counts {server.port}", flush=True)
    try:
        thread.join()
    except KeyboardInterrupt:
        pass
    return 0


# --- MinIO ----------------------------------------------------------------------------

#: MinIO's S3 API names (its `minio_api_requests_total` metric) by the kind counted
_MINIO_KINDS = (
    ("List", "LIST"),
    ("Head", "HEAD"),
    ("Get", "GET"),
    ("Delete", "DELETE"),
    ("Put", "PUT"),
    ("Copy", "PUT"),
    ("NewMultipart", "POST"),
    ("CompleteMultipart", "POST"),
)
#: its metrics v3 (v2's are cached for a while, too stale for a window of seconds)
_MINIO_METRICS = "/minio/metrics/v3/api/requests"


def minio_counts(metrics_text: str) -> dict[str, int]:
    """Requests by kind from MinIO's Prometheus text."""
    counts: collections.Counter = collections.Counter()
    for match in re.finditer(
        r'^minio_api_requests_total\{name="(\w+)"([^}]*)\}\s+([0-9.e+]+)$', metrics_text, re.M
    ):
        if 'type="s3"' not in match.group(2):
            continue
        api, value = match.group(1), int(float(match.group(3)))
        kind = next((k for prefix, k in _MINIO_KINDS if api.startswith(prefix)), "OTHER")
        counts[kind] += value
    return dict(counts)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: receive SIGKILL when this script dies, however it dies."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def serve_minio(args) -> int:
    if not os.path.exists(args.minio):
        print(f"error: MinIO is not installed at {args.minio}: run `make setup`", flush=True)
        return 2
    key_id, secret = os.environ.get("AWS_ACCESS_KEY_ID"), os.environ.get("AWS_SECRET_ACCESS_KEY")
    if not key_id or not secret or len(secret) < 8:
        print(
            "error: MinIO needs AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (8+ characters) "
            "in the environment: they become its only credentials",
            flush=True,
        )
        return 2
    port = args.port or _free_port()
    data = tempfile.mkdtemp(prefix="s3-loopback-minio-")
    env = dict(
        os.environ,
        MINIO_ROOT_USER=key_id,
        MINIO_ROOT_PASSWORD=secret,
        MINIO_BROWSER="off",
        MINIO_PROMETHEUS_AUTH_TYPE="public",
        MINIO_UPDATE="off",
        MINIO_CI_CD="on",
    )
    minio = subprocess.Popen(
        [
            args.minio,
            "server",
            data,
            "--quiet",
            "--address",
            f"127.0.0.1:{port}",
            "--console-address",
            f"127.0.0.1:{_free_port()}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        endpoint = f"http://127.0.0.1:{port}"
        _wait_ready(endpoint, minio)
        _create_buckets(endpoint, args.bucket, key_id, secret)
        counts = _serve_counts(endpoint)
        print(f"ready {port} counts {counts}", flush=True)
        while not stop.is_set() and minio.poll() is None:
            stop.wait(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        minio.terminate()
        try:
            minio.wait(timeout=10)
        except subprocess.TimeoutExpired:
            minio.kill()
        shutil.rmtree(data, ignore_errors=True)
    return 0


def _wait_ready(endpoint: str, minio: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(endpoint + "/minio/health/ready", timeout=2).close()
            return
        except OSError:
            if minio.poll() is not None or time.monotonic() > deadline:
                print(f"error: MinIO did not start on {endpoint}", flush=True)
                raise SystemExit(2) from None
            time.sleep(0.2)


def _serve_counts(endpoint: str) -> int:
    """Serve `GET /_txn/requests` (MinIO's request counts by kind) on a port
    of its own; returns the port."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Counts(BaseHTTPRequestHandler):
        def do_GET(self):
            with urllib.request.urlopen(endpoint + _MINIO_METRICS, timeout=10) as r:
                body = json.dumps(minio_counts(r.read().decode())).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Counts)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server.server_address[1]


class Running:
    """This script in a child process, for other scripts and the tests: the
    server kind, its buckets, more flags; `endpoint` and `counts_url` once
    it is ready."""

    def __init__(self, server: str = "minio", *buckets: str, extra_args: tuple[str, ...] = ()):
        self.proc = subprocess.Popen(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--server",
                server,
                "--port",
                "0",
                *(arg for bucket in buckets for arg in ("--bucket", bucket)),
                *extra_args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line.startswith("ready "):
            self.proc.kill()
            raise RuntimeError(
                f"the loopback S3 server ({server}) did not start: {line.strip() or 'no answer'}"
            )
        _, port, _, counts_port = line.split()
        self.endpoint = f"http://127.0.0.1:{port}"
        self.counts_url = f"http://127.0.0.1:{counts_port}{COUNTS_PATH}"

    def stop(self) -> None:
        self.proc.terminate()  # MinIO's parent then stops it and removes its data
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", choices=("moto", "minio"), default="moto")
    parser.add_argument("--port", type=int, default=9000, help="0: a free port")
    parser.add_argument(
        "--bucket", action="append", default=[], help="a bucket to create at start (repeatable)"
    )
    parser.add_argument(
        "--no-conditional-writes",
        action="store_true",
        help="moto only: ignore If-None-Match / If-Match (a store that does not enforce them)",
    )
    parser.add_argument("--minio", default=MINIO, help=f"the MinIO binary ({MINIO})")
    args = parser.parse_args(argv)
    if args.server == "minio":
        if args.no_conditional_writes:
            parser.error("--no-conditional-writes is for --server moto")
        return serve_minio(args)
    return serve_moto(args)


if __name__ == "__main__":
    sys.exit(main())
