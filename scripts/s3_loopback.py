#!/usr/bin/env python3
"""An S3-compatible server on loopback, for the tests, the benchmarks and a demo.

It is moto's standalone server (installed by `make setup`), which speaks the
S3 HTTP protocol and enforces conditional writes (`If-None-Match: *`), with
two additions of ours in front of it:

- it counts the requests it answers by kind (PUT, GET, HEAD, LIST, DELETE,
  POST); `GET /_txn/requests` returns the counts as JSON, the benchmarks'
  requests per message;
- `--no-conditional-writes` drops the conditional headers before moto sees
  them: a store that does not enforce put-if-absent, which the broker core
  must refuse to write to.

    python scripts/s3_loopback.py --port 9000 --bucket warehouse
    # then: warehouse = "s3://warehouse/demo", s3_endpoint = "http://127.0.0.1:9000",
    #       s3_path_style = true, s3_allow_http = true, and any AWS_ACCESS_KEY_ID /
    #       AWS_SECRET_ACCESS_KEY (moto accepts every key)

It prints `ready <port>` once the bucket exists, and runs until killed. Its
data lives in memory: a restart starts empty.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import threading

COUNTS_PATH = "/_txn/requests"


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
            start_response("200 OK", [("Content-Type", "application/json"),
                                      ("Content-Length", str(len(body)))])
            return [body]
        with lock:
            counts[_kind(environ)] += 1
        if not conditional_writes:
            environ.pop("HTTP_IF_NONE_MATCH", None)
            environ.pop("HTTP_IF_MATCH", None)
        return app(environ, start_response)

    return wrapped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--bucket", action="append", default=[],
                        help="a bucket to create at start (repeatable)")
    parser.add_argument("--no-conditional-writes", action="store_true",
                        help="ignore If-None-Match / If-Match (a store that does not enforce them)")
    args = parser.parse_args(argv)

    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    app = counting_app(DomainDispatcherApplication(create_backend_app),
                       conditional_writes=not args.no_conditional_writes)
    server = make_server("127.0.0.1", args.port, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    if args.bucket:
        import boto3
        client = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{server.port}",
                              region_name="us-east-1", aws_access_key_id="loopback",
                              aws_secret_access_key="loopback")
        for bucket in args.bucket:
            client.create_bucket(Bucket=bucket)
    print(f"ready {server.port}", flush=True)
    try:
        thread.join()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
