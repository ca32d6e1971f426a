"""Run directories in a bucket, on loopback servers (moto's S3, fake-gcs-server): the store's
conditional writes, the bucket run lock (one holder; a second refused; takeover by a later attempt
or of a dead process at once; a heartbeat that finds its lock replaced has lost it), the rolled
metrics segments (flushed, rewound, read back as one metrics file) and the one-line errors, of
the store and of ``olmax train`` given a bucket that does not exist or that it may not write."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from helpers.remote_servers import denying_server, s3_denied, store_bucket
from helpers.trainrun import RECIPE, SMALL
from olmax import store, transport
from olmax.bucket_lock import BucketLock
from olmax.config import LoggingConfig
from olmax.errors import ConfigError, OlmaxError
from olmax.lockfile import LockHeld
from olmax.train.run_log import MetricsLogger, metrics_location, rewind_jsonl


@pytest.fixture(scope="module", params=["s3", "gs"])
def bucket(request):
    with store_bucket(request.param) as url:
        yield url


def test_conditional_create_and_replace(bucket):
    url = f"{bucket}/cond/obj"
    v1 = store.create(url, b"one")
    assert v1 is not None
    assert store.create(url, b"two") is None            # exists: refused, not overwritten
    assert store.read(url) == b"one"
    v2 = store.replace(url, b"three", v1)
    assert v2 is not None and v2 != v1
    assert store.replace(url, b"four", v1) is None      # a stale version: refused
    assert store.read(url) == b"three"
    assert store.listdir(f"{bucket}/cond") == ["obj"]
    store.delete(url)
    assert store.read(url) is None and store.stat(url) is None


def _lock(url, **kw):
    return BucketLock(url, subject=f"run directory {url.rsplit('/', 1)[0]}", user="olmax train",
                      heartbeat=0.05, **kw)


def test_lock_one_holder_second_refused_then_released(bucket):
    url = f"{bucket}/lock1/.olmax-lock"
    a = _lock(url).acquire()
    try:
        with pytest.raises(LockHeld, match="is in use by olmax train pid"):
            _lock(url).acquire()
        before = store.stat(url)["version"]
        a.refresh()                                      # a heartbeat: a conditional replace
        assert store.stat(url)["version"] != before and a.verify()
    finally:
        a.release()
    assert store.stat(url) is None
    _lock(url).acquire().release()


def test_lock_takeover_by_later_attempt_and_of_dead_process(bucket):
    url = f"{bucket}/lock2/.olmax-lock"
    first = _lock(url, attempt="job7.0").acquire()
    first._stop.set()                                    # no background beats: the test beats
    second = _lock(url, attempt="job7.1").acquire()      # a later attempt: at once
    assert "attempt job7.1 replaces attempt job7.0" in second.took_over
    first.refresh()                                      # its conditional beat fails: lost
    assert not first.verify() and "was taken over" in first.lost
    with pytest.raises(LockHeld, match="held by attempt job7.1"):
        _lock(url, attempt="job7.0").acquire()
    second._stop.set()
    # a holder on this host whose process is gone (kill -9): taken over at once
    record = json.loads(store.read(url))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    record.update(pid=int(dead), proc_start=None)
    store.replace(url, json.dumps(record).encode(), store.stat(url)["version"])
    third = _lock(url).acquire()
    assert f"process {dead} is gone" in third.took_over
    third.release()


def test_metrics_segments_flush_rewind_and_read_back(bucket):
    from olmax.analysis.curves import read_rows

    run = f"{bucket}/seg-run"
    cfg = LoggingConfig(tensorboard=True, progress=False, flush_s=3600)
    log = MetricsLogger(run, cfg)
    for step in range(1, 6):
        log.log(step, {"loss": 10.0 - step})
    assert store.segment_names(metrics_location(run)) == []   # not due yet: buffered
    log.flush()                                               # (a checkpoint save flushes)
    assert [r["step"] for r in read_rows(run)] == [1, 2, 3, 4, 5]
    log.log(6, {"loss": 3.0})     # logged after the last flush, then the process is killed
    log._segments = None
    # the resumed run (restored step 4) rewinds, then logs in a new segment
    assert rewind_jsonl(metrics_location(run), 4) == 1
    log2 = MetricsLogger(run, cfg, purge_step=5)
    for step in (5, 6, 7):
        log2.log(step, {"loss": 10.0 - step})
    log2.close()
    assert store.segment_names(metrics_location(run)) == ["000000.jsonl", "000001.jsonl"]
    assert [r["step"] for r in read_rows(run)] == [1, 2, 3, 4, 5, 6, 7]
    assert store.listdir(f"{run}/tb")                          # the events were uploaded


def test_missing_bucket_and_unreachable_store_one_line(bucket, monkeypatch):
    scheme = bucket.split("://")[0]
    with pytest.raises(OlmaxError, match=rf"bucket {scheme}://no-such-bucket not found") as e:
        store.check_bucket(f"{scheme}://no-such-bucket/run")
    assert e.value.exit_code == 2
    monkeypatch.setattr(transport, "BACKOFF_S", 0.01)
    monkeypatch.setenv("AWS_ENDPOINT_URL" if scheme == "s3" else "STORAGE_EMULATOR_HOST",
                       "http://127.0.0.1:9")
    with pytest.raises(OlmaxError, match="failed after 5 attempts") as e:
        store.check_bucket(f"{bucket}/run")
    assert e.value.exit_code == 75 and "\n" not in str(e.value)


def train_line(run: str, capsys) -> tuple[int, list[str]]:
    """``olmax train --run-dir run`` in this process: its exit status and the lines it printed on
    stderr."""
    from olmax.cli import main

    capsys.readouterr()
    rc = main(["train", RECIPE, "--run-dir", run, *SMALL, "train.max_steps=2"])
    return rc, [x for x in capsys.readouterr().err.splitlines() if x.strip()]


def test_train_on_a_missing_or_denied_bucket_one_line(bucket, tmp_path, monkeypatch, capsys):
    """A bucket that does not exist, and one the credentials may not write (moto's IAM checks an
    S3 user whose policy grants nothing there; fake-gcs-server has no permissions, so a server
    answering as Cloud Storage does stands in for it): one line naming the bucket, exit 2 (a
    restart cannot help), nothing written locally nor in the bucket."""
    scheme = bucket.split("://")[0]
    monkeypatch.chdir(tmp_path)
    rc, lines = train_line(f"{scheme}://no-such-bucket/runs/a", capsys)
    assert rc == 2 and lines == [f"olmax train: error: run directory {scheme}://no-such-bucket/"
                                 f"runs/a: bucket {scheme}://no-such-bucket not found"], lines
    if scheme == "s3":
        with s3_denied("olmax-denied"):
            rc, lines = train_line("s3://olmax-denied/runs/a", capsys)
        want = (r"^olmax train: error: run directory s3://olmax-denied/runs/a: access to bucket "
                r"s3://olmax-denied denied \(An error occurred \(AccessDenied\) when calling the "
                r"PutObject operation: Access Denied\); check the AWS_\* variables or profile$")
    else:
        with denying_server() as srv, monkeypatch.context() as m:
            m.setenv("STORAGE_EMULATOR_HOST", srv.url)
            rc, lines = train_line("gs://olmax-runs/runs/a", capsys)
        assert srv.log and all(m == "POST" for m, _ in srv.log), srv.log   # the write probe
        want = (r"^olmax train: error: run directory gs://olmax-runs/runs/a: access to bucket "
                r"gs://olmax-runs denied \(\S+ does not have storage.objects.create access to "
                r"the Google Cloud Storage object\); check the application-default credentials")
    assert rc == 2 and len(lines) == 1 and re.match(want, lines[0]), lines
    assert list(tmp_path.iterdir()) == []                     # nothing written locally
    assert store.listdir(f"{bucket}/runs") == []              # nor in the bucket


def test_bucket_paths():
    assert store.bucket_path("s3://b-1/a//b/") == "s3://b-1/a/b"
    assert store.join("gs://bk/run", "checkpoints", "3") == "gs://bk/run/checkpoints/3"
    for bad in ("s3:///x", "gs://A_b/x"):
        with pytest.raises(ConfigError, match="not a bucket name"):
            store.bucket_path(bad)
    with pytest.raises(ConfigError, match="only s3:// and gs://"):
        store.run_location("az://c/x")
    assert os.fspath(store.run_location("runs/x")) == "runs/x"


def test_orbax_directory_requests_to_gcs_retry_on_olmax_schedule(monkeypatch):
    """Orbax's directory requests (:func:`olmax.store.library_filesystem`) to a GCS store that
    answers 503: the request is tried ``transport.ATTEMPTS`` times with waits of 0.25 s doubling
    (gcsfs's own loop: 6 tries, waits of 1-2 s doubling to 16-17 s, half a minute in all, which held
    a failed save and the exit after it on a store that was gone); a store that recovers is
    answered; a 404 is an answer, not retried."""
    import asyncio
    import threading
    from collections import Counter

    from helpers.remote_servers import _LoopbackServer, _QuietHandler

    class Store(_QuietHandler):
        def do_GET(self):
            self.server.log.append(self.path.split("?")[0])
            if self.server.fail > 0:
                self.server.fail -= 1
                code, body = 503, b'{"error": {"code": 503, "message": "Service Unavailable"}}'
            elif self.path.split("?")[0].endswith("/o"):     # a listing: nothing below
                code, body = 200, b'{"kind": "storage#objects"}'
            else:
                code, body = 404, b'{"error": {"code": 404, "message": "No such object"}}'
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    waits: list[float] = []
    sleep = asyncio.sleep

    async def recorded(delay, *args, **kwargs):
        if delay > 0:
            waits.append(delay)
        return await sleep(0, *args, **kwargs)

    srv = _LoopbackServer(Store)
    srv.log, srv.fail = [], 10 ** 6
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", srv.url)
        monkeypatch.setattr(asyncio, "sleep", recorded)
        fs = store.library_filesystem("gs://olmax-runs/run")
        obj = "/storage/v1/b/olmax-runs/o/run%2Fx"
        with pytest.raises(Exception, match="Service Unavailable"):
            fs.info("gs://olmax-runs/run/x")
        assert srv.log.count(obj) == transport.ATTEMPTS == 5
        assert sorted(set(waits)) == [0.25, 0.5, 1.0, 2.0], waits   # (two requests per try)
        srv.log.clear()
        srv.fail = 0
        assert fs.exists("gs://olmax-runs/run/x") is False
        answered = list(srv.log)            # what gcsfs asks to learn that nothing is there
        srv.log.clear()
        srv.fail = 2               # the first try's two requests fail, the second try is answered
        assert fs.exists("gs://olmax-runs/run/x") is False
        assert len(srv.log) == len(answered) + 2 and Counter(answered) <= Counter(srv.log), (
            srv.log, answered)                                    # and no 404 was retried
    finally:
        srv.shutdown()
        srv.server_close()
