"""A remote read that hangs, under the watchdog: one line, exit 75, and nothing after it.

A tiny run reads its token files from a loopback HTTP server through 2 data worker processes.
After its first steps the server stops answering (every read hangs). The watchdog ends the
trainer with its one line and exit status 75; the data workers end with it (they used to read on,
orphaned, and fill the job's log with retries and then a traceback), and multiprocessing's
resource tracker, which frees the workers' shared memory, adds nothing to the log.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from helpers import trainrun
from helpers.remote_servers import file_server

pytestmark = pytest.mark.slow


def _alive(marker: str) -> list[int]:
    """The processes whose environment holds ``marker`` (the trainer's and its children's)."""
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in env.read_bytes():
                found.append(int(env.parent.name))
        except OSError:
            continue
    return found


def test_a_hung_remote_read_ends_in_the_watchdogs_one_line(tmp_path):
    rng = np.random.default_rng(0)
    files = {}
    for i in range(2):
        tokens = rng.integers(0, 256, 40_000).astype("<u4")      # trainrun's byte ids
        tokens[::500] = 256
        files[f"/d/part-{i}.npy"] = tokens.tobytes()
    run = tmp_path / "hung-read-run"
    marker = f"OLMAX_TEST_HUNG_READ={uuid.uuid4().hex}"
    with file_server(files) as srv:
        urls = ",".join(srv.url + k for k in files)
        proc = trainrun.start(run, [f"data.paths=[{urls}]", "data.num_workers=2",
                                    "data.prefetch=1", "train.watchdog_s=6",
                                    "train.max_steps=500"], devices=1,
                                extra_env=dict([marker.split("=")]))
        metrics = run / "metrics.jsonl"
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        srv.delay = 1e6                      # every read from now on hangs
        assert proc.wait(timeout=120) == 75
    time.sleep(4)       # the server is gone: an orphaned worker would now retry, warn and fail
    assert _alive(marker) == []
    log = trainrun.log_path(run).read_text()
    lines = [line for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    assert len(errors) == 1 and "watchdog: no step completed" in errors[0], log
    assert lines[-1] == errors[0], log       # nothing after it: no retries, no warnings
    assert "Traceback" not in log and "resource_tracker" not in log, log
    assert list((run / "hangs").glob("*.txt"))
