"""A real S3 API server (moto's server mode) that counts the requests it answers.

Run as a process: ``python tests/s3_server.py`` prints ``PORT <n>`` once it listens on 127.0.0.1.
``GET /_requests`` returns the count of S3 requests so far (by method) as JSON; ``DELETE /_requests``
resets it. ``PUT /_requests/fail`` with a body makes every later PUT whose path contains that text
fail with a real S3 ``500 InternalError`` (a storage fault, injected at the server; an empty body
clears it). Used by tests/test_remote.py and benchmarks/remote_export.py, so both count the same way:
at the server, for every client.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from typing import Any

COUNTER_PATH = "/_requests"
FAIL_PATH = "/_requests/fail"
FAULT = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
         b"<Message>injected by the test server</Message></Error>")


class RequestCounter:
    """WSGI middleware: counts requests by method and answers the counter path itself."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.counts: Counter[str] = Counter()
        self.fail_match = ""
        self.lock = threading.Lock()

    def __call__(self, environ: dict, start_response: Any) -> Any:
        path = environ.get("PATH_INFO", "")
        if path == FAIL_PATH:
            size = int(environ.get("CONTENT_LENGTH") or 0)
            self.fail_match = environ["wsgi.input"].read(size).decode() if size else ""
            start_response("200 OK", [("Content-Length", "0")])
            return [b""]
        if self.fail_match and environ["REQUEST_METHOD"] == "PUT" and self.fail_match in path:
            with self.lock:
                self.counts["failed"] += 1
            start_response("500 Internal Server Error", [("Content-Type", "application/xml"),
                                                          ("Content-Length", str(len(FAULT)))])
            return [FAULT]
        if path == COUNTER_PATH:
            with self.lock:
                if environ["REQUEST_METHOD"] == "DELETE":
                    self.counts.clear()
                body = json.dumps(dict(self.counts)).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        with self.lock:
            self.counts[environ["REQUEST_METHOD"]] += 1
        if os.environ.get("S3_SERVER_LOG"):  # for a person debugging request counts
            print(environ["REQUEST_METHOD"], path, environ.get("QUERY_STRING", ""), environ.get("HTTP_RANGE", ""),
                  file=sys.stderr, flush=True)
        return self.app(environ, start_response)


def serve() -> None:
    import logging

    from moto.server import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request

    app = RequestCounter(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, app, threaded=True)
    print(f"PORT {server.server_port}", flush=True)
    server.serve_forever()


class S3Server:
    """The server in a child process; ``endpoint`` is its URL; ``requests()`` reads the count."""

    def __init__(self) -> None:
        env = dict(os.environ, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing")
        quiet = None if os.environ.get("S3_SERVER_LOG") else subprocess.DEVNULL  # moto logs retried errors
        self.proc = subprocess.Popen([sys.executable, __file__], stdout=subprocess.PIPE, stderr=quiet, env=env,
                                     text=True)
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()  # type: ignore[union-attr]
            if line.startswith("PORT ") or not line:
                break
        if not line.startswith("PORT "):
            self.proc.kill()
            raise RuntimeError("the moto S3 server did not start")
        self.endpoint = f"http://127.0.0.1:{int(line.split()[1])}"

    def requests(self) -> dict[str, int]:
        with urllib.request.urlopen(self.endpoint + COUNTER_PATH, timeout=30) as r:
            return json.loads(r.read())

    def total(self) -> int:
        return sum(self.requests().values())

    def reset(self) -> None:
        req = urllib.request.Request(self.endpoint + COUNTER_PATH, method="DELETE")
        urllib.request.urlopen(req, timeout=30).close()

    def fail_puts(self, match: str) -> None:
        """Make PUTs whose path contains ``match`` fail with 500 InternalError ("" clears it)."""
        req = urllib.request.Request(self.endpoint + FAIL_PATH, data=match.encode(), method="PUT")
        urllib.request.urlopen(req, timeout=30).close()

    def env(self) -> dict[str, str]:
        """Environment for a client process that talks to this server."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout:
            self.proc.stdout.close()


if __name__ == "__main__":
    serve()
