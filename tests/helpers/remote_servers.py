"""Real servers on the loopback interface for the remote-data tests: a threaded HTTP file server
with Range support and fault knobs, and moto's S3 server. Both bind 127.0.0.1 on a free port."""

from __future__ import annotations

import re
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FileServer(ThreadingHTTPServer):
    """Serves ``files`` ({"/path": bytes}) with ``HEAD`` and (ranged) ``GET``.

    Faults: ``drop`` cuts that many of the next GET bodies in half and closes the connection;
    ``truncated`` ({"/path": n}) keeps listing the full size but has only the first n bytes;
    ``delay`` sleeps that long per 64 KiB sent; ``fail`` ({"/path": n}) answers the next n
    requests for a path (HEAD or GET; n < 0: all) with ``fail_status``; ``ignore_range`` answers
    every GET with the whole file (200), as a server without Range support does. ``log`` records
    (method, path, range header).
    """

    daemon_threads = True

    def __init__(self, files: dict[str, bytes]) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files = files
        self.drop = 0
        self.dropped = 0
        self.truncated: dict[str, int] = {}
        self.delay = 0.0
        self.fail: dict[str, int] = {}
        self.fail_status = 500
        self.ignore_range = False
        self.log: list[tuple[str, str, str | None]] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

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
