"""Helpers for the end-to-end fault tests: run ``olmax train`` in subprocesses, read metrics.jsonl."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from helpers.xla import xla_flags

RECIPE = "olmo3_tiny"
STEPS = 8                       # steps of the reference run the fault tests compare against
# Smaller than olmo3-tiny where it costs nothing in coverage: a step takes well under a second on
# 2 CPU cores and a checkpoint (params + Adam) is ~40 MB. No dashboard and no evaluation at a
# run's end (~2 s and ~4 s of every run; losses do not depend on them): the runs that compare
# evaluations turn it back on (EVAL_AT_END).
SMALL = ["model.d_model=32", "model.mlp_hidden=64", "train.seq_len=32", "train.global_batch_size=8",
         "scheduler.warmup_steps=3", "scheduler.t_max=40", "logging.tensorboard=false",
         "logging.progress=false", "logging.dashboard=false", "eval.on_end=false",
         "checkpoint.keep=2"]
EVAL_AT_END = "eval.on_end=true"
# The data of every run (``command``): :func:`make_byte_corpus`'s overrides, set once a session
# (``tests/fault/conftest.py``). Empty: the recipe's own (the embedded corpus, dolma2).
DATA: list[str] = []

BYTE_VOCAB = 258            # 256 bytes, EOS, pad
BYTE_PADDED_VOCAB = 384
TRAIN_DOCS, HELDOUT_DOCS = 24, 12


def byte_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer as an HF ``tokenizer.json``: ids 0..255 are the bytes (GPT-2's byte
    alphabet, no merges), 256 ``<|endoftext|>`` (EOS), 257 ``<|pad|>``."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True),
                            AddedToken("<|pad|>", special=True)])
    folder.mkdir(parents=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}))


def make_byte_corpus(root: Path) -> None:
    """The fault tests' data in ``root``: the first documents of the embedded corpus's training and
    held-out splits (real text) in :func:`byte_tokenizer`'s ids, and ``overrides.json``, the
    overrides that train on them (:data:`DATA`).

    The runs' model is olmax's olmo3-tiny at a 384-entry vocabulary instead of dolma2's 100,352:
    the embedding, the output layer and their Adam moments were 6.4 M of the 6.5 M parameters and
    most of a step's time, and a checkpoint is 1 MB instead of 40. What the fault tests prove (a
    resumed, resized, restarted run is the uninterrupted one, bit for bit or within the resize
    tolerance) does not depend on the vocabulary; the quickstart and the reference tests keep
    dolma2. The held-out documents that share n-grams with the training file (byte 13-grams are
    short) are left out, so the trainer's overlap check passes as it would for real held-out data."""
    from olmax.data.embedded import embedded_documents
    from olmax.data.token_files import DocumentWriter
    from olmax.data.tokenizer import get_tokenizer
    from olmax.eval.contamination import check_heldout_disjoint

    byte_tokenizer(root / "tokenizer")
    tok = get_tokenizer(str(root / "tokenizer"))
    assert tok.vocab_size == BYTE_VOCAB and tok.eos_token_id == 256

    def write(name: str, docs: list[list[int]]) -> str:
        w = DocumentWriter(root, lambda _: f"{name}.npy", max_tokens=1 << 30,
                           dtype=np.dtype(np.uint32), eos_token_id=tok.eos_token_id,
                           vocab_size=tok.vocab_size)
        for ids in docs:
            w.add(ids, name)
        w.flush()
        return str(root / f"{name}.npy")

    train_file = write("train", tok.encode_batch(embedded_documents("train")[:TRAIN_DOCS]))
    held = tok.encode_batch(embedded_documents("heldout")[:HELDOUT_DOCS])
    candidates = write("heldout-candidates", held)
    report = check_heldout_disjoint([train_file], {"bytes": [candidates]},
                                    eos_token_id=tok.eos_token_id, allow=True)
    flagged = {i for s in report.contaminated for i in s.flagged}
    heldout_file = write("heldout", [d for i, d in enumerate(held) if i not in flagged])
    (root / "overrides.json").write_text(json.dumps([
        f"data.paths=[{train_file}]", f"data.tokenizer={root / 'tokenizer'}",
        f"model.vocab_size={BYTE_VOCAB}", f"model.padded_vocab_size={BYTE_PADDED_VOCAB}",
        f"eval.heldout=[bytes={heldout_file}]",
        # a bits-per-byte task: the recipe's other one (fast multiple choice) needs answers of one
        # token, which bytes are not
        "eval.tasks=[arc_easy_test_bpb_5shot]"]))


def env_for(devices: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = xla_flags(devices)
    env["JAX_CPU_COLLECTIVES_IMPLEMENTATION"] = "gloo"
    env["JAX_PLATFORMS"] = "cpu"
    if os.environ.get("OLMAX_FAULT_JAX_CACHE"):  # compiled steps shared by the runs of a session
        env["JAX_COMPILATION_CACHE_DIR"] = os.environ["OLMAX_FAULT_JAX_CACHE"]
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    return env


def run_overrides() -> list[str]:
    """What every fault-test run passes before its own overrides: :data:`SMALL`, then the
    session's :data:`DATA`."""
    return [*SMALL, *DATA]


def command(run_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "olmax.cli", "train", RECIPE, "--run-dir", str(run_dir),
            *run_overrides(), *overrides]


def log_path(run_dir: Path) -> Path:
    return Path(run_dir).parent / f"{Path(run_dir).name}.log"


def start(run_dir: Path, overrides: list[str], devices: int = 8,
          extra_env: dict | None = None) -> subprocess.Popen:
    """``olmax train`` in the background; its output is appended to :func:`log_path` (a file, so
    that a process nobody reads from never blocks on a full pipe)."""
    Path(run_dir).parent.mkdir(parents=True, exist_ok=True)
    with open(log_path(run_dir), "a") as log:
        return subprocess.Popen(command(run_dir, overrides), env={**env_for(devices), **(extra_env or {})},
                                stdout=log, stderr=subprocess.STDOUT, text=True)


def train(run_dir: Path, overrides: list[str], devices: int = 8, timeout: float = 900,
          check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(command(run_dir, overrides), env=env_for(devices), capture_output=True,
                         text=True, timeout=timeout)
    if check and out.returncode != 0:
        raise AssertionError(f"olmax train failed ({out.returncode}):\n{out.stdout[-2000:]}\n"
                             f"{out.stderr[-4000:]}")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def train_multiprocess(run_dir: Path | str, overrides: list[str], processes: int = 2,
                       devices_per_process: int = 4, timeout: float = 900,
                       log_dir: Path | None = None) -> list[str]:
    """``olmax train`` as ``processes`` jax.distributed processes on localhost; their outputs.

    Their logs go beside ``run_dir`` (``log_dir`` instead: a run directory in a bucket)."""
    coord = f"localhost:{free_port()}"
    name = str(run_dir).rstrip("/").rsplit("/", 1)[-1]
    log_dir = Path(log_dir) if log_dir is not None else Path(run_dir).parent
    log_dir.mkdir(parents=True, exist_ok=True)
    logs = [log_dir / f"{name}.process{i}.log" for i in range(processes)]
    procs = []
    for i, log in enumerate(logs):
        with open(log, "a") as f:
            procs.append(subprocess.Popen(
                command(run_dir, [*overrides, f"distributed.coordinator={coord}",
                                  f"distributed.num_processes={processes}",
                                  f"distributed.process_id={i}"]),
                env=env_for(devices_per_process), stdout=f, stderr=subprocess.STDOUT, text=True))
    deadline = time.time() + timeout
    try:
        for p, log in zip(procs, logs):
            rc = p.wait(timeout=max(1.0, deadline - time.time()))
            if rc != 0:
                raise AssertionError(f"process failed ({rc}):\n{log.read_text()[-4000:]}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [log.read_text() for log in logs]


def records(run_dir: Path) -> list[dict]:
    """Every complete line of the run's metrics.jsonl (steps and evaluations)."""
    p = Path(run_dir) / "metrics.jsonl"
    if not p.is_file():
        return []
    rows = []
    for line in p.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written right now
            continue
    return rows


def metrics(run_dir: Path) -> list[dict]:
    """The per-step training records."""
    return [r for r in records(run_dir) if "loss" in r]


def eval_metrics(run_dir: Path) -> dict[str, float]:
    """The in-loop evaluation's numbers (``eval/...`` keys, timing left out), latest per key."""
    out = {}
    for rec in records(run_dir):
        out.update({k: v for k, v in rec.items() if k.startswith("eval/") and k != "eval/seconds"})
    return out


def series(run_dir: Path, key: str) -> dict[int, object]:
    return {r["step"]: r[key] for r in metrics(run_dir)}


def wait_for_step(p: subprocess.Popen, run_dir: Path, step: int, timeout: float = 600) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        rows = metrics(run_dir)
        if rows and rows[-1]["step"] >= step:
            return
        if p.poll() is not None:
            raise AssertionError(f"olmax train exited ({p.returncode}) before step {step}:\n"
                                 f"{log_path(run_dir).read_text()[-4000:]}")
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def check_against(reference: Path, run_dir: Path, steps: int) -> list[float]:
    """``run_dir`` logged steps 1..``steps`` once each (process 0 only), with the reference run's
    batch hashes and losses (rtol 2e-5); returns the loss differences."""
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), "one line per step (process 0 only)"
    ref_loss, ref_hash = series(reference, "loss"), series(reference, "batch_hash")
    assert [r["batch_hash"] for r in rows] == [ref_hash[s] for s in range(1, steps + 1)]
    np.testing.assert_allclose([r["loss"] for r in rows], [ref_loss[s] for s in range(1, steps + 1)],
                               rtol=2e-5, atol=0)
    return [r["loss"] - ref_loss[r["step"]] for r in rows]


def checkpoint_steps(run_dir: Path) -> list[int]:
    d = Path(run_dir) / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []
