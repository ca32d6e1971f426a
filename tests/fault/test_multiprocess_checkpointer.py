"""Checkpoints written by 2 processes x 4 CPU devices restore in 1 process x 8 devices and back.

``jax.distributed`` on localhost with gloo collectives; every process writes and reads its own
shards, and each process verifies its shards of the restored arrays bit for bit.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

WORKER = str(Path(__file__).with_name("ckpt_worker.py"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run(args: list[str], processes: int) -> list[list[str]]:
    """Run the worker in ``processes`` processes (8 devices in all); RESTORED/SAVED lines of each."""
    port = str(free_port())
    extra = [] if processes == 1 else ["--num-processes", str(processes), "--port", port]
    procs = [subprocess.Popen([sys.executable, WORKER, *args, "--devices", str(8 // processes),
                               *extra, *([] if processes == 1 else ["--process-id", str(i)])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(processes)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=180)
        assert p.returncode == 0, err[-3000:]
        outs.append([line.split() for line in out.splitlines() if line.startswith(("RESTORED", "SAVED"))])
    return outs


def test_two_processes_to_one_and_back(tmp_path):
    d = str(tmp_path / "checkpoints")
    assert run(["save", d, "5"], 2) == [[["SAVED", "5"]]] * 2
    # both processes wrote their own shards
    assert {p.name for p in (tmp_path / "checkpoints" / "5" / "params").iterdir()} >= {
        "ocdbt.process_0", "ocdbt.process_1"}
    assert run(["check", d], 1) == [[["RESTORED", "5", "True", "8", "2", "incomplete="]]]
    assert run(["save", d, "6"], 1) == [[["SAVED", "6"]]]
    assert run(["check", d], 2) == [[["RESTORED", "6", "True", "8", "1", "incomplete="]]] * 2
