"""A real S3 API server (moto's server mode) that counts the requests it answers.

Run as a process: ``python tests/s3_server.py`` prints ``PORT <n>`` once it listens on 127.0.0.1.
``GET /_requests`` returns the count of S3 requests so far (by method) as JSON; ``DELETE /_requests``
resets it. ``PUT /_requests/fail`` with a body makes every later PUT whose path contains that text
fail with a real S3 ``500 InternalError`` (a storage fault, injected at the server; an empty body
clears it); a server-side copy's path is matched as ``/bucket/key<-bucket/source-key``. Used by
tests/test_remote.py and benchmarks/remote_export.py, so both count the same way: at the server, for
every client.

Checksums as S3 checks them: a PUT (object or part) that carries ``x-amz-checksum-crc32`` (as a header,
or as the trailer of an ``aws-chunked`` body) is refused with ``400 BadDigest`` when the bytes received
do not match it. moto stores such a value unchecked (a TODO in its ``_get_checksum``), so without this
the server would accept what real S3 refuses. ``PUT /_requests/corrupt`` with a body flips one byte of
every later PUT body whose path contains that text (damage in transit; an empty body clears it).
``GET /_requests/kinds`` counts the same requests by kind: ``LIST`` (a GET of a bucket: listings, location),
``GET`` (of an object), ``HEAD``, ``PUT``, ``POST``, ``DELETE``; ``DELETE /_requests`` resets both.
``GET /_requests/checks`` counts PUT bodies by how they were checked (``crc32``, ``none``, ``bad_digest``).
``PUT /_requests/hold`` with a body holds every later request whose ``METHOD path?query`` contains it (a
server-side copy as ``PUT /bucket/key<-bucket/source-key?query``) until the hold is cleared (an empty body) or
``HOLD_SECONDS`` pass; ``GET /_requests/held`` says how many are held now. A test that interrupts a transfer
waits until one is held, sends its signal, then clears the hold: the transfer cannot finish before the signal
arrives, however fast or slow the machine is.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
import zlib
from collections import Counter
from typing import Any

COUNTER_PATH = "/_requests"
FAIL_PATH = "/_requests/fail"
CORRUPT_PATH = "/_requests/corrupt"
CHECKS_PATH = "/_requests/checks"
KINDS_PATH = "/_requests/kinds"
HOLD_PATH = "/_requests/hold"
HELD_PATH = "/_requests/held"
HOLD_SECONDS = 600  # a hold nobody clears ends by itself: a failed test does not hang the server
FAULT = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>InternalError</Code>'
         b"<Message>injected by the test server</Message></Error>")
BAD_DIGEST = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>BadDigest</Code>'
              b"<Message>The CRC32 you specified did not match the calculated checksum.</Message></Error>")


def crc32_b64(data: bytes) -> str:
    return base64.b64encode(zlib.crc32(data).to_bytes(4, "big")).decode()


def unchunk(body: bytes) -> tuple[bytes, dict[str, str], int]:
    """An ``aws-chunked`` body: its payload, its trailer headers and where the first chunk's data starts."""
    out, trailers, pos, first = bytearray(), {}, 0, -1
    while True:
        eol = body.index(b"\r\n", pos)
        size = int(body[pos:eol].split(b";")[0], 16)
        pos = eol + 2
        if size == 0:
            break
        first = pos if first < 0 else first
        out += body[pos:pos + size]
        pos += size + 2
    for line in body[pos:].split(b"\r\n"):
        if b":" in line:
            k, v = line.split(b":", 1)
            trailers[k.decode().strip().lower()] = v.decode().strip()
    return bytes(out), trailers, first


class RequestCounter:
    """WSGI middleware: counts requests by method and answers the counter path itself."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.counts: Counter[str] = Counter()
        self.kinds: Counter[str] = Counter()
        self.fail_match = ""
        self.corrupt_match = ""
        self.hold_match = ""
        self.released = threading.Event()
        self.held = 0
        self.checks: Counter[str] = Counter()
        self.lock = threading.Lock()

    def __call__(self, environ: dict, start_response: Any) -> Any:
        path = environ.get("PATH_INFO", "")
        if path in (FAIL_PATH, CORRUPT_PATH):
            size = int(environ.get("CONTENT_LENGTH") or 0)
            text = environ["wsgi.input"].read(size).decode() if size else ""
            setattr(self, {FAIL_PATH: "fail_match", CORRUPT_PATH: "corrupt_match"}[path], text)
            start_response("200 OK", [("Content-Length", "0")])
            return [b""]
        if path == HOLD_PATH:
            size = int(environ.get("CONTENT_LENGTH") or 0)
            with self.lock:
                self.hold_match = environ["wsgi.input"].read(size).decode() if size else ""
                if self.hold_match:
                    self.released = threading.Event()
                else:
                    self.released.set()
            start_response("200 OK", [("Content-Length", "0")])
            return [b""]
        if path == HELD_PATH:
            with self.lock:
                body = str(self.held).encode()
            start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
            return [body]
        self.hold_if_asked(environ, path)
        if path in (CHECKS_PATH, KINDS_PATH):
            with self.lock:
                body = json.dumps(dict(self.checks if path == CHECKS_PATH else self.kinds)).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        copied = environ.get("HTTP_X_AMZ_COPY_SOURCE")
        seen = f"{path}<-{urllib.parse.unquote(copied).lstrip('/')}" if copied else path
        if self.fail_match and environ["REQUEST_METHOD"] == "PUT" and self.fail_match in seen:
            with self.lock:
                self.counts["failed"] += 1
            start_response("500 Internal Server Error", [("Content-Type", "application/xml"),
                                                          ("Content-Length", str(len(FAULT)))])
            return [FAULT]
        if path == COUNTER_PATH:
            with self.lock:
                if environ["REQUEST_METHOD"] == "DELETE":
                    self.counts.clear()
                    self.kinds.clear()
                body = json.dumps(dict(self.counts)).encode()
            start_response("200 OK", [("Content-Type", "application/json"), ("Content-Length", str(len(body)))])
            return [body]
        method = environ["REQUEST_METHOD"]
        on_bucket = "/" not in path.strip("/")  # /bucket (a listing, the bucket's location), not /bucket/key
        with self.lock:
            self.counts[method] += 1
            self.kinds["LIST" if method == "GET" and on_bucket else method] += 1
        if environ["REQUEST_METHOD"] == "PUT" and "HTTP_X_AMZ_COPY_SOURCE" not in environ:
            refused = self.check_body(environ, path)
            if refused:
                start_response("400 Bad Request", [("Content-Type", "application/xml"),
                                                   ("Content-Length", str(len(BAD_DIGEST)))])
                return [BAD_DIGEST]
        if os.environ.get("S3_SERVER_LOG"):  # for a person debugging request counts
            print(environ["REQUEST_METHOD"], path, environ.get("QUERY_STRING", ""), environ.get("HTTP_RANGE", ""),
                  file=sys.stderr, flush=True)
        return self.app(environ, start_response)


    def hold_if_asked(self, environ: dict, path: str) -> None:
        """Hold a request that matches the hold until it is cleared (see the module's docstring)."""
        copied = environ.get("HTTP_X_AMZ_COPY_SOURCE")
        seen = f"{path}<-{urllib.parse.unquote(copied).lstrip('/')}" if copied else path
        seen = f"{environ['REQUEST_METHOD']} {seen}?{environ.get('QUERY_STRING', '')}"
        with self.lock:
            if not self.hold_match or self.hold_match not in seen:
                return
            released = self.released
            self.held += 1
        try:
            released.wait(HOLD_SECONDS)
        finally:
            with self.lock:
                self.held -= 1

    def check_body(self, environ: dict, path: str) -> bool:
        """Damage the body when asked, then check it against its CRC32 as S3 does; True: refuse it."""
        if not environ.get("CONTENT_LENGTH"):
            return False  # no length: a body we do not read here (none of our clients sends one)
        body = environ["wsgi.input"].read(int(environ["CONTENT_LENGTH"]))
        chunked = "aws-chunked" in environ.get("HTTP_CONTENT_ENCODING", "")
        payload, trailers, first = unchunk(body) if chunked else (body, {}, 0)
        if self.corrupt_match and self.corrupt_match in path and payload:
            at = max(first, 0) + min(1, len(payload) - 1)  # the second payload byte (the first of one)
            body = body[:at] + bytes([body[at] ^ 0xFF]) + body[at + 1:]
            payload = unchunk(body)[0] if chunked else body
        claimed = environ.get("HTTP_X_AMZ_CHECKSUM_CRC32") or trailers.get("x-amz-checksum-crc32")
        environ["wsgi.input"] = io.BytesIO(body)
        environ["CONTENT_LENGTH"] = str(len(body))
        if not payload and claimed is None:
            return False  # a bucket or folder marker: nothing to check
        refused = claimed is not None and claimed != crc32_b64(payload)
        with self.lock:
            self.checks["bad_digest" if refused else "crc32" if claimed else "none"] += 1
        return refused


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

    def kinds(self) -> dict[str, int]:
        """The requests so far by kind: LIST (GET of a bucket), GET (of an object), HEAD, PUT, ..."""
        with urllib.request.urlopen(self.endpoint + KINDS_PATH, timeout=30) as r:
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

    def corrupt_puts(self, match: str) -> None:
        """Flip one byte of every PUT body whose path contains ``match`` ("" clears it)."""
        req = urllib.request.Request(self.endpoint + CORRUPT_PATH, data=match.encode(), method="PUT")
        urllib.request.urlopen(req, timeout=30).close()

    def hold(self, match: str) -> None:
        """Hold every request whose ``METHOD path?query`` contains ``match`` until ``hold("")``."""
        req = urllib.request.Request(self.endpoint + HOLD_PATH, data=match.encode(), method="PUT")
        urllib.request.urlopen(req, timeout=30).close()

    def held(self) -> int:
        """How many requests the hold keeps waiting now."""
        with urllib.request.urlopen(self.endpoint + HELD_PATH, timeout=30) as r:
            return int(r.read())

    def wait_until_held(self, proc: subprocess.Popen, timeout: float = 120) -> None:
        """Wait until the hold keeps one of ``proc``'s requests (it must not end first)."""
        deadline = time.monotonic() + timeout
        while self.held() == 0:
            if proc.poll() is not None:
                raise AssertionError(f"the client ended (exit {proc.returncode}) before a request was held")
            if time.monotonic() > deadline:
                raise AssertionError(f"no request was held in {timeout} s")
            time.sleep(0.02)

    def checks(self) -> dict[str, int]:
        """PUT bodies so far by how they were checked: ``crc32``, ``none``, ``bad_digest``."""
        with urllib.request.urlopen(self.endpoint + CHECKS_PATH, timeout=30) as r:
            return json.loads(r.read())

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
