"""Stand-ins for the cluster tools a generated job calls (``srun``, ``scancel``, ``scontrol``,
``sbatch``, ``gcloud``) and for ``olmax`` itself, installed as executables in a directory put first
on PATH.

``srun`` starts ``--ntasks-per-node`` tasks on each node of the batch job (``SLURM_JOB_NUM_NODES``)
with the variables real ``srun`` gives each task (``SLURM_PROCID``, ``SLURM_LOCALID``,
``SLURM_STEP_NODELIST``, ``SLURMD_NODENAME``, ...), each task in its own process group, and records
them; ``scancel --signal=SIG JOBID`` delivers SIG to every process of those tasks, as Slurm signals
a job step's processes; ``--kill-on-bad-exit`` kills the other tasks when one fails; its exit
status is the highest of the tasks' (128 + the signal for a task killed by one), as srun(1) says.
``scontrol``, ``sbatch`` and ``gcloud`` record their arguments. The recording ``olmax`` writes its
argv and environment and, when asked, waits for SIGTERM, or ends with the status its environment
names for its rank (``FAKE_OLMAX_EXIT_RANK<r>``: a number, or ``kill`` to die of SIGKILL) or for
its call (``FAKE_OLMAX_EXITS``: a comma list, one status per call, counted in the output folder).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

SRUN_VARS = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_STEP_NODELIST",
             "SLURM_STEP_NUM_NODES", "SLURM_STEP_NUM_TASKS", "SLURM_JOB_ID")


def _srun(argv: list[str]) -> int:
    opts, i = {}, 0
    while i < len(argv) and argv[i].startswith("-"):
        key, _, value = argv[i].partition("=")
        opts[key] = value
        i += 1
    command = argv[i:]
    nodes = int(os.environ["SLURM_JOB_NUM_NODES"])
    per_node = int(opts.get("--ntasks-per-node") or 1)
    n = nodes * per_node
    procs = []
    for rank in range(n):
        env = dict(os.environ, SLURM_STEP_ID="0", SLURM_STEPID="0", SLURM_PROCID=str(rank),
                   SLURM_LOCALID=str(rank % per_node), SLURM_NODEID=str(rank // per_node),
                   SLURM_NTASKS=str(n), SLURM_NPROCS=str(n), SLURM_STEP_NUM_TASKS=str(n),
                   SLURM_STEP_NUM_NODES=str(nodes), SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"],
                   SLURM_STEP_TASKS_PER_NODE=f"{per_node}(x{nodes})",
                   SLURMD_NODENAME=f"node{rank // per_node}")
        procs.append(subprocess.Popen(command, env=env, start_new_session=True))
    tasks = Path(os.environ["FAKE_SLURM_DIR"]) / f"{os.environ['SLURM_JOB_ID']}.tasks"
    tasks.write_text("".join(f"{p.pid}\n" for p in procs))
    kill_on_bad_exit = opts.get("--kill-on-bad-exit", "0") not in ("0", "")
    codes: dict[int, int] = {}
    while len(codes) < n:
        for k, p in enumerate(procs):
            if k not in codes and p.poll() is not None:
                codes[k] = p.returncode
                if p.returncode != 0 and kill_on_bad_exit:
                    for q in procs:
                        if q.poll() is None:
                            _killpg(q.pid, signal.SIGKILL)
        time.sleep(0.05)
    tasks.unlink()
    return max((128 - c if c < 0 else c) for c in codes.values())


def _scancel(argv: list[str]) -> int:
    sig = signal.SIGTERM
    for a in argv:
        if a.startswith("--signal="):
            name = a.split("=", 1)[1]
            sig = getattr(signal, name if name.startswith("SIG") else f"SIG{name}")
    job = [a for a in argv if not a.startswith("-")][0]
    _record("scancel", argv)
    tasks = Path(os.environ["FAKE_SLURM_DIR"]) / f"{job}.tasks"
    for pid in tasks.read_text().split() if tasks.exists() else []:
        _killpg(int(pid), sig)
    return 0


def _killpg(pid: int, sig: int) -> None:
    """``sig`` to every process of the task ``pid`` leads (its process group)."""
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _record(tool: str, argv: list[str]) -> None:
    with open(Path(os.environ["FAKE_SLURM_DIR"]) / f"{tool}.log", "a") as f:
        f.write(json.dumps(argv) + "\n")


def _olmax(argv: list[str]) -> int:
    got = {"argv": argv, "env": {k: v for k, v in os.environ.items()
                                 if k.startswith(("SLURM_", "OLMAX_", "XLA_", "JOB_", "NCCL_",
                                                  "JAX_", "MEGASCALE_"))}}
    calls = Path(os.environ["FAKE_OLMAX_DIR"])
    out = calls / f"{os.getpid()}.json"
    call = len(list(calls.glob("*.json")))
    out.write_text(json.dumps(got))
    code = os.environ.get(f"FAKE_OLMAX_EXIT_RANK{os.environ.get('SLURM_PROCID', '')}")
    sequence = [c for c in os.environ.get("FAKE_OLMAX_EXITS", "").split(",") if c]
    if code is None and sequence:
        code = sequence[min(call, len(sequence) - 1)]
    if code == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if code is not None:
        return int(code)
    if os.environ.get("FAKE_OLMAX_WAIT"):
        stopped = []
        signal.signal(signal.SIGTERM, lambda *_: stopped.append(True))
        deadline = time.time() + float(os.environ["FAKE_OLMAX_WAIT"])
        while not stopped and time.time() < deadline:
            time.sleep(0.02)
        out.write_text(json.dumps({**got, "sigterm": bool(stopped)}))
    return 0


TOOLS = {"srun": _srun, "scancel": _scancel, "olmax": _olmax,
         "scontrol": lambda argv: _record("scontrol", argv) or 0,
         "sbatch": lambda argv: _record("sbatch", argv) or 0,
         "gcloud": lambda argv: _record("gcloud", argv) or 0}


def install(bin_dir: Path, tools=("srun", "scancel", "scontrol", "sbatch", "gcloud", "olmax"), *,
            real_olmax: bool = False) -> Path:
    """Executables for ``tools`` in ``bin_dir``; ``real_olmax``: ``olmax`` runs this Python's
    ``olmax.cli`` instead of the recording stand-in."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for tool in tools:
        if tool == "olmax" and real_olmax:
            body = f'exec {sys.executable} -m olmax.cli "$@"\n'
        else:
            body = f'exec {sys.executable} {Path(__file__).resolve()} {tool} "$@"\n'
        p = bin_dir / tool
        p.write_text("#!/bin/sh\n" + body)
        p.chmod(0o755)
    return bin_dir


def slurm_port_and_job_id() -> tuple[int, int]:
    """A job id whose JAX coordinator port (``61440 + id % 4096``, JAX's SLURM rule) is free here."""
    start = os.getpid() % 4096
    for k in range(4096):
        offset = (start + k) % 4096
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", 61440 + offset))
            except OSError:
                continue
        return 61440 + offset, 4096 * 17 + offset
    raise RuntimeError("no free port in 61440..65535")


def batch_env(base: dict, bin_dir: Path, slurm_dir: Path, nodes: int, job_id: int) -> dict:
    """The environment sbatch gives the batch script of a ``nodes``-node job on this machine."""
    slurm_dir.mkdir(parents=True, exist_ok=True)
    return {**base, "PATH": f"{bin_dir}{os.pathsep}{base.get('PATH', os.defpath)}",
            "FAKE_SLURM_DIR": str(slurm_dir), "SLURM_JOB_ID": str(job_id),
            "SLURM_JOB_NAME": "olmax-test", "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_NNODES": str(nodes), "SLURM_NTASKS": str(nodes),
            "SLURM_JOB_NODELIST": ",".join(["127.0.0.1"] * nodes)}


def recorded(path: Path) -> list[list[str]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


if __name__ == "__main__":
    sys.exit(TOOLS[sys.argv[1]](sys.argv[2:]))


def expand_k8s(text: str, env: dict[str, str]) -> str:
    """``text`` as Kubernetes passes a command's argument or an env value on: ``$(NAME)`` is the
    container's variable NAME (left as written when there is none), ``$$`` one dollar."""
    out, i = [], 0
    while i < len(text):
        if text.startswith("$$", i):
            out.append("$")
            i += 2
        elif text.startswith("$(", i) and ")" in text[i:]:
            end = text.index(")", i)
            name = text[i + 2:end]
            out.append(env.get(name, text[i:end + 1]))
            i = end + 1
        else:
            out.append(text[i])
            i += 1
    return "".join(out)
