"""Interleaved A/B measurement of training steps in worker processes.

Speed is measured as ratios side by side in one run: every leg is compiled and warmed up, then the
timed steps are interleaved (leg 1, leg 2, ..., leg 1, ...) so that every leg sees the same load
on a shared machine, and each round's time is divided by the first leg's of the same round; the
median of those per-round ratios is robust to load drifting during the run.

A leg here is a worker process: what it runs is the trainer's compiled step of a recipe (with
overrides), under an environment of its own. That is what a process-wide setting needs (XLA reads
``XLA_FLAGS`` once per process) and what comparing two versions of olmax needs: a leg whose
``PYTHONPATH`` starts with another source tree (``src/`` of a ``git worktree``) imports that
version. The worker is this file run as a script, and in it imports only what every version of
olmax has (``olmax.perf.bench.TrainStepRunner``, ``olmax.train.recipes.load_recipe``).

Protocol: the worker prints ``READY compile_s jax_version program_hash device_kind``, then answers
each ``step`` line on stdin with ``STEP seconds loss``; at end of input it prints ``DONE
peak_rss_bytes``. ``program_hash`` identifies the compiled program's instructions
(:func:`program_hash`): two legs with the same hash run the same program, so any difference in
their times is the machine's, not the code's.

    legs = [Leg("before", "benchmarks/shapes/B.yaml", env={"PYTHONPATH": "/tmp/base/src"}),
            Leg("after", "benchmarks/shapes/B.yaml")]
    result = interleave(legs, rounds=5, warmup=1)
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import statistics
import subprocess
import sys
from typing import Callable, Sequence


@dataclasses.dataclass
class Leg:
    name: str
    recipe: str                                   # a packaged recipe name or a YAML path
    overrides: Sequence[str] = ()
    env: dict[str, str] = dataclasses.field(default_factory=dict)   # added to this environment


class Worker:
    """One leg's worker process, its step compiled and kept alive."""

    def __init__(self, leg: Leg) -> None:
        env = dict(os.environ, **leg.env)
        self.leg = leg
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", leg.recipe,
                                      *leg.overrides], env=env, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "READY":
            err = self.proc.stderr.read().strip().splitlines()
            self.close()
            raise RuntimeError(f"{leg.name}: {err[-1] if err else f'worker exited with {self.proc.returncode}'}")
        self.compile_s, self.jax_version, self.program_hash = float(line[1]), line[2], line[3]
        self.device = " ".join(line[4:])
        self.times: list[float] = []
        self.losses: list[float] = []
        self.peak_rss_bytes: int | None = None

    def step(self) -> float:
        self.proc.stdin.write("step\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "STEP":
            raise RuntimeError(f"{self.leg.name}: the worker died: {self.proc.stderr.read()[-2000:]}")
        self.times.append(float(line[1]))
        self.losses.append(float(line[2]))
        return self.times[-1]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                for line in self.proc.stdout:
                    if line.startswith("DONE"):
                        self.peak_rss_bytes = int(line.split()[1])
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait()


_NUMBERED = re.compile(r"\.\d+\b")
_METADATA = re.compile(r", metadata=\{[^}]*\}|origin=\{[^}]*\}")
_INSTRUCTION = re.compile(r"^\s*(ROOT )?%|^\S.*\{$")


def program_hash(hlo_text: str) -> str:
    """A hash of a compiled program's instructions and computations, in any order, without the
    names' numeric suffixes and the metadata (source files and lines), which differ between two
    source trees that compile to the same program."""
    lines = sorted(_METADATA.sub("", _NUMBERED.sub("", line)) for line in hlo_text.splitlines()
                   if _INSTRUCTION.match(line) and not line.startswith(("HloModule", "FileNames",
                                                                         "FunctionNames")))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()[:16]


def summarise(names: Sequence[str], times: Sequence[Sequence[float]]) -> list[dict]:
    """Per leg: the median step and, per round, the first leg's time over this leg's (its speed
    relative to the first leg), with their median."""
    rows = []
    for name, t in zip(names, times):
        per_round = [first / mine for first, mine in zip(times[0], t)]
        rows.append({"leg": name, "step_s": list(t), "step_s_median": statistics.median(t),
                     "speed_vs_first_per_round": per_round,
                     "speed_vs_first": statistics.median(per_round)})
    return rows


def interleave(legs: Sequence[Leg], rounds: int = 5, warmup: int = 1,
               log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    """Start every leg's worker, ``warmup`` untimed steps each, then ``rounds`` interleaved timed
    steps; returns ``{"rows": [...], "loadavg": [...]}`` with each leg's compile time, device, jax
    version, losses and peak resident memory."""
    workers: list[Worker] = []
    try:
        for leg in legs:
            w = Worker(leg)
            workers.append(w)
            for _ in range(warmup):
                w.step()
            log(f"ready: {leg.name} (compile {w.compile_s:.1f} s, jax {w.jax_version}, {w.device})")
        load = []
        for i in range(rounds):
            for w in workers:
                w.step()
            load.append(os.getloadavg()[0])
            log(f"round {i + 1}: " + ", ".join(f"{w.leg.name} {w.times[-1]:.3f}s" for w in workers))
    finally:
        for w in workers:
            w.close()
    rows = summarise([w.leg.name for w in workers], [w.times[warmup:] for w in workers])
    for row, w in zip(rows, workers):
        row.update(recipe=w.leg.recipe, overrides=list(w.leg.overrides), env=dict(w.leg.env),
                   compile_s=w.compile_s, jax=w.jax_version, device=w.device,
                   program_hash=w.program_hash, losses=w.losses, peak_rss_bytes=w.peak_rss_bytes)
    return {"rounds": rounds, "warmup": warmup, "loadavg": load, "rows": rows}


def _worker(recipe: str, overrides: list[str]) -> int:
    import resource

    import jax

    from olmax.perf.bench import TrainStepRunner
    from olmax.train.recipes import load_recipe

    runner = TrainStepRunner(load_recipe(recipe, overrides))
    print("READY", runner.compile_s, jax.__version__, program_hash(runner.compiled.as_text()),
          jax.devices()[0].device_kind, flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            break
        dt = runner.run()
        print("STEP", dt, repr(float(runner.metrics["loss"])), flush=True)
    print("DONE", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, flush=True)
    return 0


if __name__ == "__main__" and len(sys.argv) > 2 and sys.argv[1] == "--worker":
    # Run as a script: this file's folder must not shadow top-level modules, and ``olmax`` comes
    # from PYTHONPATH when the leg names another source tree.
    sys.path = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
    sys.exit(_worker(sys.argv[2], sys.argv[3:]))
