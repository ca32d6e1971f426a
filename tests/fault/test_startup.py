"""A multi-process start-up whose peer never comes (real ``olmax train`` processes on 127.0.0.1):
after ``distributed.init_timeout_s`` each lone process prints one line and exits 75 (a restart may
cure it), before it touches the run directory. JAX alone would abort the process (SIGABRT) after
its own 300 s."""

from __future__ import annotations

import subprocess
import time

from helpers.trainrun import command, env_for, free_port


def test_a_process_whose_peer_never_comes_exits_75_with_one_line(tmp_path):
    coord = f"127.0.0.1:{free_port()}"
    run_dir = tmp_path / "run"
    t0 = time.monotonic()
    procs = {pid: subprocess.Popen(
        command(run_dir, [f"distributed.coordinator={coord}", "distributed.num_processes=3",
                          f"distributed.process_id={pid}", "distributed.init_timeout_s=3"]),
        env=env_for(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for pid in (0, 1)}     # process 2 never starts: neither the coordinator's host nor a peer can go on
    out = {pid: p.communicate(timeout=120) for pid, p in procs.items()}
    took = time.monotonic() - t0
    for pid, p in procs.items():
        stdout, stderr = out[pid]
        lines = [ln for ln in stderr.splitlines() if ln.strip()]
        assert p.returncode == 75, stderr
        assert lines == [f"olmax train: error: distributed: the other processes did not all join "
                         f"within 3 s (3 processes, coordinator {coord}, this is process {pid}; "
                         f"distributed.init_timeout_s); exiting with 75 to be started again"], stderr
        assert stdout == ""
    assert took < 60, took
    assert not run_dir.exists()
