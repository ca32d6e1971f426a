"""Ordinary mistakes, run through the ``olmax`` command line; each must end in one clean line.

Every case below is a real command on real (tiny) files: a Hugging Face directory, olmax
checkpoints, token files, recipes, and HTTP servers on 127.0.0.1 (one answering 500, one ignoring
``Range``; a closed port stands for a store that cannot be reached). *Clean* means: a non-zero
exit status, nothing on stdout, and exactly one line on stderr, ``olmax COMMAND: error: ...``,
with the message the case expects (the file, key or value at fault); for a case whose answer is a
result rather than an error (a plan that does not fit) one line on stdout instead, and nothing on
stderr. Either way nothing that existed before the case was changed or removed, and a refused ``olmax
train`` left nothing in its run directory (not even the directory). The table in
``docs/bad-inputs.md`` is this list with what olmax printed; regenerate it with

    PYTHONPATH=src:tests python tests/cli/bad_inputs.py --write docs/bad-inputs.md

``tests/cli/test_bad_inputs.py`` runs every case and checks the table is current. All cases run
in one process (``olmax.cli.main``, with stdout/stderr captured at the file-descriptor level, so
library output counts too), in a scratch directory with relative paths.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gzip
import json
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "bad-inputs.md"
CASE_TIMEOUT_S = 120


@dataclasses.dataclass
class Case:
    group: str
    mistake: str                 # what the user did wrong, in words
    argv: list[str]              # the olmax command line (relative paths, run in the scratch dir)
    expect: str                  # a regex the error line must match (after "error: ")
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    result: bool = False         # the answer is one line on stdout (``olmax CMD: ...``), not an error


@dataclasses.dataclass(frozen=True)
class ExitStatus:
    cause: str       # what happened, in words
    status: int      # what ``olmax`` ends with (a constant of olmax.errors)
    name: str        # that constant's name
    launcher: str    # what the jobs ``olmax launch`` writes do next


def exit_statuses() -> list[ExitStatus]:
    """Exit status by cause: the policy of :mod:`olmax.errors` (decided by
    :func:`olmax.reporting.exit_code`), and what the launchers (:mod:`olmax.launch`) do with each.
    ``tests/cli/test_exit_status.py`` runs a real ``olmax`` process for every row it can trigger
    cheaply and names the test that covers each of the others."""
    from olmax import errors as E

    return [
        ExitStatus("finished, or stopped as asked (`olmax train` after a SIGTERM, by default)",
                   E.EXIT_DONE, "EXIT_DONE", "done: not started again"),
        ExitStatus("a configuration or input error: a bad key or value, a missing, malformed or "
                   "not permitted input or output path, a run directory another trainer holds",
                   E.EXIT_INPUT, "EXIT_INPUT", f"stops for good ({E.NO_RESTART[E.EXIT_INPUT]})"),
        ExitStatus("the run cannot go on without a person (a non-finite loss)",
                   E.EXIT_ATTENTION, "EXIT_ATTENTION",
                   f"stops for good ({E.NO_RESTART[E.EXIT_ATTENTION]})"),
        ExitStatus("storage: a full disk or quota, a file too large, a read-only file system, an "
                   "I/O error, a lost connection, remote reads or writes that ran out of retries",
                   E.EXIT_RESTART, "EXIT_RESTART",
                   "started again, the whole job, up to --max-restarts times"),
        ExitStatus("peers that did not all start within distributed.init_timeout_s, a lost or hung "
                   "peer (the watchdog)", E.EXIT_RESTART, "EXIT_RESTART",
                   "started again, the whole job, up to --max-restarts times"),
        ExitStatus("an internal error (a bug in olmax, an error of the runtime): anything not "
                   "above", E.EXIT_RESTART, "EXIT_RESTART",
                   "started again, up to --max-restarts times: the budget bounds a bug that "
                   "recurs"),
        ExitStatus("preempted or stopped (SIGTERM): `olmax train` saves a checkpoint and exits "
                   "with --exit-code-on-stop (143 in the Kubernetes jobs olmax launch writes; 0 "
                   "by default); another command ends by the signal (128 + 15)",
                   E.EXIT_STOPPED, "EXIT_STOPPED",
                   "Kubernetes: the pod is started again, not counted against --max-restarts "
                   "(Slurm and TPU VM jobs stop with 0; Slurm requeues a preempted job itself)"),
        ExitStatus("interrupted (Ctrl-C)", E.EXIT_INTERRUPTED, "EXIT_INTERRUPTED",
                   "like 75: started again up to --max-restarts times (not 2 or 3)"),
        ExitStatus("`olmax plan`: the step does not fit (a result, one line on stdout)",
                   E.EXIT_DOES_NOT_FIT, "EXIT_DOES_NOT_FIT", "not launched (a planning command)"),
    ]


def _render(line: str) -> str:
    shown = ""
    for part in line.split("\r"):
        shown = part + shown[len(part):]
    return shown.rstrip()


@dataclasses.dataclass
class Result:
    rc: int | str
    stdout: str
    stderr: str
    seconds: float

    def lines(self) -> list[str]:
        """The non-blank lines of stderr as a terminal shows them (a carriage return moves back to
        the start of the line: what follows overwrites it, as progress bars rely on)."""
        return [ln for ln in map(_render, self.stderr.split("\n")) if ln.strip()]

    def error_line(self) -> str:
        lines = self.lines()
        return lines[-1].strip() if lines else ""

    def result_line(self) -> str:
        lines = [ln for ln in self.stdout.splitlines() if ln.strip()]
        return lines[-1].strip() if lines else ""

    def clean(self, case: Case) -> bool:
        lines = self.lines()
        if not isinstance(self.rc, int) or self.rc == 0:
            return False
        if case.result:
            out = [ln for ln in self.stdout.splitlines() if ln.strip()]
            m = re.match(r"olmax( [a-z-]+)*: (.*)$", out[0]) if len(out) == 1 and not lines else None
            return bool(m) and re.search(case.expect, m.group(2)) is not None
        if self.stdout.strip() or len(lines) != 1:
            return False
        m = re.match(r"olmax( [a-z0-9-]+)*: error: (.*)$", lines[0])
        return bool(m) and re.search(case.expect, m.group(2)) is not None


# ----------------------------------------------------------------------------------------------
# Scratch files


TINY = dict(d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, mlp_hidden=64,
            vocab_size=100278, padded_vocab_size=100352, rope_theta=500_000.0, norm_eps=1e-6,
            window_pattern=(16, 16, 16, None), max_seq_len=256)


def _tiny_cfg(**changes):
    from olmax.config import ModelConfig

    return ModelConfig(**{**TINY, **changes})


def _params(cfg, seed=0):
    import jax

    from olmax.model.params import init_params

    return jax.tree.map(np.asarray, init_params(cfg, jax.random.key(seed)))


def _hf_dir(path: Path, cfg, params) -> None:
    from olmax.interop.hf import write_hf_dir

    path.mkdir(parents=True)
    write_hf_dir(path, params, cfg, dtype="float32")


class _Pwned:
    """A pickle that, if anything ever unpickles it, leaves a marker file behind."""

    def __reduce__(self):
        return (os.system, ("touch PWNED-by-pickle",))


def make_workspace(root: Path) -> dict[str, str]:
    """Create the scratch files every case uses; returns names for the ones cases refer to."""
    from olmax.config import CheckpointConfig, to_dict
    from olmax.checkpoint.weights import save_params
    from olmax.checkpoint.checkpointer import Checkpointer
    from olmax.train.optim import build_optimizer
    from olmax.config import OptimConfig
    from olmax.train.state import init_train_state

    os.chdir(root)
    cfg = _tiny_cfg()
    params = _params(cfg)
    _hf_dir(root / "hf", cfg, params)
    bad = {k: (dict(v) if isinstance(v, dict) else v.copy()) for k, v in params.items()}
    bad["layers"]["up_proj"] = params["layers"]["up_proj"].copy()
    bad["layers"]["up_proj"][2, 5, 7] = np.nan
    bad["final_norm"] = params["final_norm"].copy()
    bad["final_norm"][3] = np.inf
    one_nan = {**params, "layers": {**params["layers"], "up_proj": bad["layers"]["up_proj"]}}
    _hf_dir(root / "hf-nan", cfg, one_nan)
    save_params(root / "ckpt-nan", bad, cfg)
    save_params(root / "ckpt", params, cfg)
    other = _tiny_cfg(rope_theta=10_000.0, norm_eps=1e-5, window_pattern=(8, 8, 8, None))
    _hf_dir(root / "hf-theta", other, params)
    save_params(root / "ckpt-theta", params, other)

    # A training step directory (params + optimizer state), as `olmax train` writes them.
    tx = build_optimizer(OptimConfig())
    state = init_train_state(params, tx)
    ck = Checkpointer(root / "run-done" / "checkpoints", CheckpointConfig(interval=1, async_save=False),
                      report=lambda m: None)
    ck.save(5, state, {"model": to_dict(cfg), "data_position": 5, "seed": 1}, force=True)
    ck.close()
    ck = Checkpointer(root / "run-nan" / "checkpoints", CheckpointConfig(interval=1, async_save=False),
                      report=lambda m: None)
    ck.save(5, init_train_state(bad, tx), {"model": to_dict(cfg), "data_position": 5, "seed": 1},
            force=True)
    ck.close()

    # An HF directory in the pickle format: refused before anything reads it.
    binary = root / "hf-bin"
    binary.mkdir()
    (binary / "config.json").write_text((root / "hf" / "config.json").read_text())
    (binary / "pytorch_model.bin").write_bytes(pickle.dumps(_Pwned()))
    (root / "not-hf").mkdir()
    (root / "not-hf" / "config.json").write_text("{not json")
    llama = root / "hf-llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": [
        "LlamaForCausalLM"], "hidden_size": 32}))
    nohidden = root / "hf-nohidden"
    nohidden.mkdir()
    config = json.loads((root / "hf" / "config.json").read_text())
    del config["hidden_size"]
    (nohidden / "config.json").write_text(json.dumps(config))
    (nohidden / "model.safetensors").write_bytes((root / "hf" / "model.safetensors").read_bytes())
    trunc = root / "hf-truncated"
    trunc.mkdir()
    (trunc / "config.json").write_text((root / "hf" / "config.json").read_text())
    data = (root / "hf" / "model.safetensors").read_bytes()
    (trunc / "model.safetensors").write_bytes(data[: len(data) // 2])

    # Token files: raw uint32 (named .npy, as olmax tokenize and Dolma name them), a tokenized
    # folder with its manifest, a copy cut short, an odd-sized file.
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 1000, 4096).astype("<u4")
    (root / "tokens.npy").write_bytes(tokens.tobytes())
    (root / "odd.npy").write_bytes(tokens.tobytes()[:-2])
    (root / "docs").mkdir()
    (root / "docs" / "a.txt").write_text("The quick brown fox jumps over the lazy dog. " * 200)
    from olmax.data.tokenize_files import TokenizeSettings, tokenize_files

    tokenize_files([str(root / "docs")], str(root / "tokenized"), TokenizeSettings(),
                   progress=False, log=lambda m: None)
    short = root / "short"
    short.mkdir()
    (short / "manifest.json").write_text((root / "tokenized" / "manifest.json").read_text())
    for f in (root / "tokenized").glob("*.npy"):
        (short / f.name).write_bytes(f.read_bytes()[:-400])

    # Text inputs.
    (root / "latin1.txt").write_bytes("caf\xe9 cr\xe8me br\xfbl\xe9e".encode("latin-1"))
    with gzip.open(root / "good.jsonl.gz", "wt") as f:
        f.write(json.dumps({"text": "hello world"}) + "\n")
    gz = (root / "good.jsonl.gz").read_bytes()
    (root / "corrupt.jsonl.gz").write_bytes(gz[:12] + b"\x00garbage\xff" * 8)
    (root / "bad.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    (root / "notext.jsonl").write_text('{"body": "no text field"}\n')
    (root / "afile").write_text("I am a file\n")
    (root / "nonempty").mkdir()
    (root / "nonempty" / "keep.txt").write_text("x")
    (root / "exists.json").write_text("{}\n")

    # Recipes.
    (root / "broken.yaml").write_text("model: {preset: olmo3-tiny\ntrain: [\n")
    (root / "list.yaml").write_text("- 1\n- 2\n")
    (root / "pytag.yaml").write_text('model: !!python/object/apply:os.system ["touch PWNED-by-yaml"]\n')
    recipe = {"model": {k: (list(v) if isinstance(v, tuple) else v) for k, v in TINY.items()},
              "data": {"paths": ["tokens.npy"]},
              "train": {"seq_len": 32, "global_batch_size": 4, "max_steps": 2},
              "logging": {"tensorboard": False, "progress": False},
              "eval": {"interval": None}}
    import yaml

    (root / "tiny.yaml").write_text(yaml.safe_dump(recipe))

    # Runs: a metrics file that is not JSON; a run directory held by a live process.
    (root / "run-bad-metrics").mkdir()
    (root / "run-bad-metrics" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\nnot json\n')
    (root / "run-good").mkdir()
    (root / "run-good" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": i, "loss": 3.0 / i, "tokens": 128 * i}) + "\n" for i in range(1, 6)))
    (root / "nodocs").mkdir()
    (root / "nodocs" / "weights.bin").write_bytes(b"\0" * 16)
    _newer_surfaces(root, cfg, params, tokens, recipe)
    _read_not_guessed(root, cfg, params)
    held = root / "run-held"
    held.mkdir()
    # its own output: a caller reading this process's pipes must not wait for the holder to end
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    boot = Path("/proc/sys/kernel/random/boot_id")
    me = {"host": socket.gethostname(), "boot_id": boot.read_text().strip() if boot.exists() else None,
          "pid_ns": os.readlink("/proc/self/ns/pid") if os.path.exists("/proc/self/ns/pid") else None}
    (held / ".olmax-lock").write_text(json.dumps({**me, "pid": holder.pid, "proc_start": None,
                                              "token": "0" * 32, "started": "2026-01-01T00:00:00Z",
                                              "command": ["olmax", "train"]}) + "\n")
    return {"holder_pid": str(holder.pid), **_servers(root)}


def _servers(root: Path) -> dict[str, str]:
    """HTTP servers on 127.0.0.1 for the remote cases: one serving the token file (and answering
    500 under /fail/), one that ignores Range, a store that denies every request (HTTP 403, in
    S3's words or Cloud Storage's); a closed port. Stopped by :func:`run_all`."""
    from helpers.remote_servers import DenyingServer, FileServer, refused_port

    data = (root / "tokens.npy").read_bytes()
    servers = {"http": FileServer({"/data/tokens.npy": data, "/fail/tokens.npy": data}),
               "norange": FileServer({"/data/tokens.npy": data})}
    servers["denied"] = DenyingServer()
    servers["http"].fail["/fail/tokens.npy"] = -1
    servers["norange"].ignore_range = True
    for srv in servers.values():
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        _SERVERS.append(srv)
    closed = _REFUSING.enter_context(refused_port())     # held while the cases run
    return {"@HTTP": servers["http"].url, "@NORANGE": servers["norange"].url,
            "@DENIED": servers["denied"].url, "@CLOSED": f"http://127.0.0.1:{closed}"}


_SERVERS: list = []
_REFUSING = contextlib.ExitStack()


def _newer_surfaces(root: Path, cfg, params, tokens, recipe: dict) -> None:
    """Files for the cases of data fetch, remote reads, launch, plan, the run lock, curves and
    recipe YAML."""
    import yaml

    from olmax.checkpoint.checkpointer import Checkpointer
    from olmax.config import CheckpointConfig, OptimConfig, to_dict
    from olmax.train.optim import build_optimizer
    from olmax.train.state import init_train_state

    # A mix line that climbs out of the destination onto a user's file there.
    (root / "evil-mix.txt").write_text("ok,{TOKENIZER}/tokens.npy\nx,{TOKENIZER}/../../../../escaped.npy\n")
    (root / "deep").mkdir()
    (root / "deep" / "escaped.npy").write_text("the user's own file\n")
    (root / "latin1-mix.txt").write_bytes("caf\xe9,{TOKENIZER}/tokens.npy\n".encode("latin-1"))
    # Recipes: an alias bomb (9^9 values from 400 bytes), a section given twice, not UTF-8, too big.
    levels = [f"l{i}" for i in range(10)]
    bomb = [f"{levels[0]}: &{levels[0]} [{', '.join(['x'] * 9)}]"]
    bomb += [f"{b}: &{b} [{', '.join(['*' + a] * 9)}]" for a, b in zip(levels, levels[1:])]
    (root / "bomb.yaml").write_text("\n".join(bomb) + "\n")
    (root / "bomb-override.txt").write_text("{" + ", ".join(bomb) + "}")
    dup = yaml.safe_dump(recipe) + "train:\n  max_steps: 1000\n"
    (root / "dup.yaml").write_text(dup)
    (root / "latin1.yaml").write_bytes(yaml.safe_dump({**recipe, "data": {"root": "caf\xe9"}},
                                                      allow_unicode=True).encode("latin-1"))
    (root / "big.yaml").write_text("# " + "x" * (4 << 20) + "\n" + yaml.safe_dump(recipe))
    # A run whose newest checkpoint a later olmax wrote (format_version 2).
    tx = build_optimizer(OptimConfig())
    ck = Checkpointer(root / "run-newer" / "checkpoints", CheckpointConfig(interval=1, async_save=False),
                      report=lambda m: None)
    for step in (1, 2):
        ck.save(step, init_train_state(params, tx), {"model": to_dict(cfg), "data_position": step,
                                                     "seed": 1}, force=True)
    ck.close()
    meta = root / "run-newer" / "checkpoints" / "2" / "meta" / "metadata"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "format_version": 2}))
    # A run directory whose lock file is not olmax's (not even UTF-8), fresh.
    (root / "run-badlock").mkdir()
    (root / "run-badlock" / ".olmax-lock").write_bytes(b"\xff\xfe\x00garbage\xe9\n")
    # A run directory held by a later attempt of a job (on another host, heartbeat fresh).
    (root / "run-replaced").mkdir()
    (root / "run-replaced" / ".olmax-lock").write_text(json.dumps({
        "pid": 12345, "host": "other-host.example", "boot_id": "x", "pid_ns": "pid:[1]",
        "proc_start": "1", "token": "t" * 32, "started": "2026-01-01T00:00:00Z",
        "command": ["olmax", "train"], "attempt": "7.3"}) + "\n")
    # A --patch that is not a pod template.
    (root / "notpod.yaml").write_text("kind: Pod\nspec: {}\n")
    # Patches the API server would refuse or the job would misread; one nested 300 levels deep.
    (root / "drop-container.yaml").write_text("spec:\n  containers:\n  - name: olmax\n    $patch: delete\n")
    (root / "on-failure.yaml").write_text("spec:\n  restartPolicy: OnFailure\n")
    (root / "deep-patch.yaml").write_text("spec:\n  x: " + "[" * 300 + "]" * 300 + "\n")
    # Outputs that must survive: a user's notes, a FIFO.
    (root / "notes.txt").write_text("my notes\n")
    os.mkfifo(root / "pipe")
    # Metrics that are not UTF-8.
    (root / "run-latin").mkdir()
    (root / "run-latin" / "metrics.jsonl").write_bytes(b'{"step": 1, "loss": 2.0, "note": "caf\xe9"}\n')
    # Names that are not UTF-8 (bytes a file system allows): a checkpoint and a token file.
    shutil.copytree(root / "ckpt", root / NOT_UTF8_CKPT)
    shutil.copyfile(root / "tokens.npy", root / NOT_UTF8_TOKENS)
    # Metrics with a line that is JSON but no object, a step beyond float range, a short CSV row.
    (root / "run-list-line").mkdir()
    (root / "run-list-line" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n[2, 1.5]\n')
    (root / "run-huge-step").mkdir()
    (root / "run-huge-step" / "metrics.jsonl").write_text(
        '{"step": 1, "loss": 2.0}\n{"step": 1' + "0" * 400 + ', "loss": 1.5}\n')
    (root / "short-row.csv").write_text("step,loss\n1,2.0\n2\n3,1.0\n")
    # An HF config.json whose YaRN factor is 0 (used to become a math domain error, or the default).
    _hf_dir(root / "hf-yarn0", cfg, params)
    hf_cfg = json.loads((root / "hf-yarn0" / "config.json").read_text())
    hf_cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 0, "original_max_position_embeddings": 64}
    (root / "hf-yarn0" / "config.json").write_text(json.dumps(hf_cfg))
    # An OLMo-core checkpoint whose config.json gives 1.5 layers (int() used to make it 1).
    from olmax.interop.olmo_core.convert import convert_olmax_to_olmo_core, olmo_core_config

    convert_olmax_to_olmo_core(root / "ckpt", root / "oc-half-layer", weights_only=True)
    oc_cfg = olmo_core_config(cfg, None)
    oc_cfg["model"]["n_layers"] = 1.5
    (root / "oc-half-layer" / "config.json").write_text(json.dumps(oc_cfg))
    _start_surfaces(root, cfg, params, recipe)


def _start_surfaces(root: Path, cfg, params, recipe: dict) -> None:
    """Starts that must be refused before anything is written: a run of tiny.yaml's data (its
    fingerprint, its seed, its batch) checkpointed at step 2, as an olmax run directory and as
    an OLMo-core checkpoint (``oc-run``: trainer state, tokenizer, data_paths.txt)."""
    from olmax.checkpoint.checkpointer import Checkpointer
    from olmax.config import (CheckpointConfig, DataConfig, OptimConfig, RunConfig, TrainConfig,
                              from_dict, to_dict)
    from olmax.data.loader import TrainData
    from olmax.data.tokenizer import get_tokenizer
    from olmax.interop.olmo_core.convert import convert_olmax_to_olmo_core
    from olmax.train.optim import build_optimizer
    from olmax.train.state import init_train_state

    run = RunConfig(model=cfg, data=from_dict(DataConfig, recipe["data"], "data"),
                    train=from_dict(TrainConfig, recipe["train"], "train"))
    data = TrainData(["tokens.npy"], seq_len=32, global_batch_size=4, seed=run.seed,
                     tokenizer=get_tokenizer().identity)
    meta = {"model": to_dict(cfg), "data_position": 2, "seed": run.seed,
            "config": {"train": to_dict(run.train), "data": to_dict(run.data)},
            "data_fingerprint": data.fingerprint}
    ck = Checkpointer(root / "run-fp" / "checkpoints", CheckpointConfig(interval=1, async_save=False),
                      report=lambda m: None)
    ck.save(2, init_train_state(params, build_optimizer(OptimConfig())), meta, force=True)
    ck.close()
    convert_olmax_to_olmo_core(root / "run-fp", root / "oc-run")


def _oc_config_case(root: Path, name: str, change) -> None:
    """``oc-full`` with its ``config.json`` changed by ``change`` (a function of its dict)."""
    shutil.copytree(root / "oc-full", root / name)
    config = json.loads((root / name / "config.json").read_text())
    change(config["model"])
    (root / name / "config.json").write_text(json.dumps(config))


def _read_not_guessed(root: Path, cfg, params) -> None:
    """What olmax reads from the field, checked: an OLMo-core checkpoint with its trainer state
    and variants of it (config fields olmax cannot compute, damaged bytes, no or an unreadable
    ``rank0.pt``, a NaN stored with its CRC); a byte-level tokenizer."""
    import zlib

    from olmax.checkpoint.weights import save_train_state
    from olmax.config import OptimConfig, to_dict
    from olmax.interop.olmo_core.convert import convert_olmax_to_olmo_core, olmax_opt_state
    from olmax.interop.olmo_core.dcp import DcpReader, Files
    from olmax.interop.olmo_core.torch_zip import Archive
    from olmax.train.optim import skip_step_adamw

    import jax

    mu = jax.tree.map(lambda p: p * 0.5, params)
    opt = olmax_opt_state(skip_step_adamw(OptimConfig()), mu, jax.tree.map(lambda p: p * p, params), 12)
    meta = {"optim": to_dict(OptimConfig()), "data_position": 12, "seed": 1,
            "config": {"train": {"global_batch_size": 4, "seq_len": 32}}}
    state = save_train_state(root / "olmax-state", 12, params, opt, cfg, extra_meta=meta)
    convert_olmax_to_olmo_core(state, root / "oc-full")
    _oc_config_case(root, "oc-gelu", lambda m: m["block"]["feed_forward"].update(activation="gelu"))
    _oc_config_case(root, "oc-layernorm", lambda m: m["block"]["layer_norm"].update(name="default"))
    _oc_config_case(root, "oc-bias", lambda m: m["block"]["sequence_mixer"].pop("bias"))
    _oc_config_case(root, "oc-complex-rope",
                    lambda m: m["block"]["sequence_mixer"]["rope"].update(name="complex"))
    _oc_config_case(root, "oc-moe", lambda m: m["block"].update(
        name="moe_reordered_norm", feed_forward_moe={"num_experts": 8, "hidden_size": 64}))
    _oc_config_case(root, "oc-unknown-field",
                    lambda m: m["block"]["sequence_mixer"].update(softcap=30.0))
    # 8 bytes of the embedding's chunk inverted (the same size); a rank0.pt likewise
    data = root / "oc-full" / "model_and_optim"
    reader = DcpReader(Files(str(data)))
    at = reader.meta.tensors["model.embeddings.weight"].chunks[0].at
    for name, path, offset in (("oc-flipped", f"model_and_optim/{at.file}", at.offset + at.length // 2),
                               ("oc-flipped-state", "train/rank0.pt", 100)):
        shutil.copytree(root / "oc-full", root / name)
        raw = bytearray((root / name / path).read_bytes())
        raw[offset:offset + 8] = bytes(b ^ 0xFF for b in raw[offset:offset + 8])
        (root / name / path).write_bytes(bytes(raw))
    # no train/rank0.pt, and one that is a link to itself
    shutil.copytree(root / "oc-full", root / "oc-no-state")
    (root / "oc-no-state" / "train" / "rank0.pt").unlink()
    shutil.copytree(root / "oc-full", root / "oc-loop")
    (root / "oc-loop" / "train" / "rank0.pt").unlink()
    (root / "oc-loop" / "train" / "rank0.pt").symlink_to("rank0.pt")
    # a NaN in a weight, stored with its CRC (what a diverged run writes)
    shutil.copytree(root / "oc-full", root / "oc-nan")
    at = reader.meta.tensors["model.blocks.1.feed_forward.w1.weight"].chunks[0].at
    path = root / "oc-nan" / "model_and_optim" / at.file
    raw = bytearray(path.read_bytes())
    archive = Archive(lambda o, n: bytes(raw[at.offset + o:at.offset + o + n]), at.length, str(path))
    entry = archive.entries["archive/data/0"]
    first = at.offset + archive.data_offset("archive/data/0")
    raw[first + 20:first + 24] = np.float32(np.nan).tobytes()
    crc = zlib.crc32(bytes(raw[first:first + entry.size])).to_bytes(4, "little")
    raw[at.offset + entry.header_offset + 14:at.offset + entry.header_offset + 18] = crc
    central = bytes(raw).rfind(b"archive/data/0", at.offset, at.offset + at.length) - 46
    raw[central + 16:central + 20] = crc
    path.write_bytes(bytes(raw))
    from helpers.trainrun import byte_tokenizer

    byte_tokenizer(root / "bytetok")
    # an HF config that ties the embeddings, over files whose LM head is another tensor
    shutil.copytree(root / "hf", root / "hf-tied-head")
    hf_config = json.loads((root / "hf-tied-head" / "config.json").read_text())
    (root / "hf-tied-head" / "config.json").write_text(json.dumps({**hf_config,
                                                                   "tie_word_embeddings": True}))


# ----------------------------------------------------------------------------------------------
# The cases


NOT_UTF8_CKPT = os.fsdecode(b"ckpt-caf\xe9")      # held by Python as a lone surrogate
NOT_UTF8_TOKENS = os.fsdecode(b"tokens-caf\xe9.npy")
TRAIN = ["train", "tiny.yaml", "--run-dir", "RUN"]
CONTINUE = ["init.checkpoint=oc-run", "init.load_trainer_state=true", "init.load_optimizer=true"]
HELDOUT = "tokenized/part-00000-0000.npy"


def LAUNCH(target: str) -> list[str]:
    return ["launch", target, "tiny.yaml", "--nodes", "1", "--gpus-per-node", "0"]


def INSPECT(*paths: str) -> list[str]:
    return ["data", "inspect", "--paths", *paths, "--seq-len", "32", "--global-batch-size", "2",
            "--seed", "1", "--batches", "0:1"]


def OC_IMPORT(folder: str) -> list[str]:
    return ["convert", "olmo-core-to-olmax", folder, "OUT"]


def EVAL(checkpoint: str, *options: str, heldout: str = HELDOUT) -> list[str]:
    return ["eval", checkpoint, "--heldout", heldout, *options, "--json", "OUT.json"]


def cases() -> list[Case]:
    C = Case
    out = [
        # -- the command line itself
        C("cli", "no command", [], r"required: COMMAND"),
        C("cli", "unknown command", ["trian"], r"invalid choice: 'trian'"),
        C("cli", "unknown option", ["train", "olmo3_tiny", "--bogus"], r"unknown option '--bogus'"),
        C("cli", "an option that needs a value, without it", ["eval", "ckpt", "--json"],
          r"--json: expected one argument"),
        C("cli", "an integer option given a word", ["eval", "ckpt", "--limit", "ten", "--json", "OUT.json"],
          r"--limit: invalid int value: 'ten'"),
        C("cli", "options after overrides, one of them unknown",
          ["bench", "train", "tiny.yaml", "--steps", "1", "train.seq_len=32", "--bogus"],
          r"unknown option '--bogus'"),
        # -- recipes and overrides
        C("train", "unknown recipe", ["train", "no_such_recipe"], r"recipe 'no_such_recipe' is neither"),
        C("train", "recipe with invalid YAML", ["train", "broken.yaml"], r"broken.yaml line \d+: invalid YAML"),
        C("train", "recipe that is a list, not a mapping", ["train", "list.yaml"], r"top level must be a mapping"),
        C("train", "recipe with a python tag (code execution attempt)", ["train", "pytag.yaml"],
          r"pytag.yaml.*invalid YAML"),
        C("train", "misspelt key", [*TRAIN, "train.max_step=5"], r"unknown config key 'train.max_step'"),
        C("train", "a list given as a single value", [*TRAIN, "data.paths=tokens.npy"],
          r"data.paths: expected a list"),
        C("train", "model section that is not a mapping", [*TRAIN, "model=olmo3-tiny"], r"model: expected a mapping"),
        C("init", "init.allow_architecture_override not a boolean",
          [*TRAIN, "init.hf_dir=hf-theta", "init.allow_architecture_override=maybe"],
          r"init.allow_architecture_override: expected bool"),
        C("train", "misspelt section", [*TRAIN, "trian.max_steps=5"], r"unknown config key 'trian'"),
        C("train", "wrong type", [*TRAIN, "train.max_steps=many"], r"train.max_steps: expected int"),
        C("train", "override without '='", [*TRAIN, "train.max_steps"], r"not of the form key.sub=value"),
        C("train", "override with an empty key", [*TRAIN, "=5"], r"has an empty key"),
        C("train", "unknown model preset", ["train", "olmo3_tiny", "model.preset=olmo9"],
          r"unknown model preset 'olmo9'"),
        C("train", "zero steps", [*TRAIN, "train.max_steps=0"], r"train.max_steps must be positive"),
        C("train", "a length in epochs and in tokens", [*TRAIN, "train.max_epochs=1", "train.max_tokens=1000"],
          r"set one of train.max_steps, train.max_epochs, train.max_tokens \(got train.max_epochs=1, "
          r"train.max_tokens=1000\)"),
        C("train", "a length in epochs that ends before the first epoch",
          [*TRAIN, "train.max_epochs=1", "data.epoch=2"], r"train.max_epochs \(1\) is before data.epoch \(2\)"),
        C("train", "a hard stop of zero", [*TRAIN, "train.hard_stop=0"], r"train.hard_stop must be positive"),
        C("train", "sequence length 1", [*TRAIN, "train.seq_len=1"], r"train.seq_len must be at least 2"),
        C("train", "sequence longer than the model allows", [*TRAIN, "train.seq_len=4096"],
          r"train.seq_len 4096 exceeds model.max_seq_len 256"),
        C("train", "unknown attention implementation", [*TRAIN, "train.attn_impl=flash9"],
          r"train.attn_impl.*'flash9'"),
        C("train", "unknown remat policy", [*TRAIN, "train.remat=everything"], r"train.remat.*'everything'"),
        C("train", "unknown compute dtype", [*TRAIN, "train.compute_dtype=float8"],
          r"train.compute_dtype.*'float8'"),
        C("train", "learning rate that overflows to inf", [*TRAIN, "optim.lr=1e999"],
          r"optim.lr: .*(finite|inf)"),
        C("train", "learning rate NaN", [*TRAIN, "optim.lr=.nan"], r"optim.lr: .*(finite|nan)"),
        C("train", "init seed beyond 64 bits", [*TRAIN, "init.seed=123456789012345678901234567890"],
          r"init.seed"),
        C("train", "run seed beyond 64 bits", [*TRAIN, "seed=-123456789012345678901234567890"], r"\bseed\b"),
        C("train", "unknown scheduler", [*TRAIN, "scheduler.name=cosine"], r"scheduler.*'cosine'"),
        C("train", "unknown optimizer", [*TRAIN, "optim.name=sgd"], r"optim.*'sgd'"),
        C("train", "heads not a multiple of KV heads", [*TRAIN, "model.n_kv_heads=3"],
          r"n_heads \(4\) must be a multiple of n_kv_heads \(3\)"),
        C("train", "layers not a multiple of the window pattern", [*TRAIN, "model.n_layers=3"],
          r"n_layers \(3\) must be a multiple of len\(window_pattern\)"),
        C("train", "checkpoint interval 0", [*TRAIN, "checkpoint.interval=0"], r"checkpoint.interval must be positive"),
        C("train", "negative eval interval", [*TRAIN, "eval.interval=-5"], r"eval.interval must be positive"),
        C("train", "micro-batch that does not divide the batch", [*TRAIN, "train.micro_batch_size=3"],
          r"train.micro_batch_size \(3\) must divide"),
        C("train", "mesh that does not fit the devices", [*TRAIN, "mesh.tensor=3"], r"mesh"),
        C("train", "--exit-code-on-stop out of range", [*TRAIN, "--exit-code-on-stop", "300"],
          r"--exit-code-on-stop must be 0..255"),
        C("train", "--exit-code-on-stop not a number", [*TRAIN, "--exit-code-on-stop", "x"],
          r"argument --exit-code-on-stop: invalid int value: 'x'"),
        # -- run directories
        C("train", "--run-dir that is an existing file", ["train", "tiny.yaml", "--run-dir", "afile"],
          r"run directory afile exists and is not a directory"),
        C("train", "--run-dir below a file", ["train", "tiny.yaml", "--run-dir", "afile/run"],
          r"a parent path is a file"),
        C("train", "--run-dir that cannot be created", ["train", "tiny.yaml", "--run-dir", "/sys/olmax-run"],
          r"cannot create run directory /sys/olmax-run: Operation not permitted"),
        C("train", "--run-dir the user cannot write", ["train", "tiny.yaml", "--run-dir", "/sys/fs"],
          r"run directory /sys/fs is not writable: Permission denied"),
        C("train", "--run-dir in use by another trainer", ["train", "tiny.yaml", "--run-dir", "run-held"],
          r"run directory run-held is in use by olmax train pid \d+ on host "),
        # -- training data
        C("data", "token file whose name is not UTF-8", INSPECT(NOT_UTF8_TOKENS),
          r"^token file 'tokens-caf\\udce9.npy': the name is not UTF-8 text, which the data fingerprint "
          r"\(OLMo-core's\) needs; rename it$"),
        C("train", "run directory whose name is not UTF-8", [*TRAIN[:3], "run-caf\udce9"],
          r"^--run-dir '\S*run-caf\\udce9' is not UTF-8 text, which the checkpoint library needs"),
        C("data", "token file that does not exist", [*TRAIN, "data.paths=[missing.npy]"],
          r"token file not found: missing.npy"),
        C("data", "a folder where a token file belongs", [*TRAIN, "data.paths=[tokenized]"],
          r"tokenized.* is a directory"),
        C("data", "token file shorter than its manifest says", [*TRAIN, "data.paths=[short/part-00000-0000.npy]"],
          r"short/part-00000-0000.npy.*manifest"),
        C("data", "token file size not a multiple of the token size", [*TRAIN, "data.paths=[odd.npy]"],
          r"odd.npy: size 16382 bytes is not a multiple of 4"),
        C("data", "unknown token dtype", [*TRAIN, "data.dtype=uint128"], r"data.dtype"),
        C("data", "token dtype other than the manifest's", ["data", "inspect", "--paths", HELDOUT, "--dtype",
                                                          "uint64", "--seq-len", "32", "--global-batch-size",
                                                          "2", "--seed", "1", "--batches", "0:1"],
          r"manifest.json says the tokens are uint32"),
        C("data", "mix file that does not exist", [*TRAIN, "data.mix=nomix.txt"],
          r"nomix.txt"),
        C("data", "fewer instances than one batch", [*TRAIN, "train.global_batch_size=512"],
          r"fewer than one global batch"),
        C("data", "held-out file that does not exist", [*TRAIN, "eval.interval=1", "eval.heldout=[gone.npy]"],
          r"gone.npy"),
        C("data", "unknown downstream task", [*TRAIN, "eval.interval=1", "eval.tasks=[arc_hard_bogus]"],
          r"unknown downstream task 'arc_hard_bogus'"),
        # -- starting points
        C("init", "init.hf_dir that does not exist", [*TRAIN, "init.hf_dir=nope"], r"nope"),
        C("init", "init.hf_dir holding pytorch_model.bin only", [*TRAIN, "init.hf_dir=hf-bin"],
          r"hf-bin.*safetensors"),
        C("init", "init.hf_dir whose architecture disagrees with the recipe", [*TRAIN, "init.hf_dir=hf-theta"],
          r"rope_theta"),
        C("init", "init.hf_dir with NaN weights", [*TRAIN, "init.hf_dir=hf-nan", "model=null"],
          r"non-finite.*layers.2.mlp.up_proj"),
        C("init", "init.checkpoint that does not exist", [*TRAIN, "init.checkpoint=nowhere"], r"nowhere"),
        C("init", "init.checkpoint pointing at an HF directory", [*TRAIN, "init.checkpoint=hf"],
          r"(no olmax checkpoint|Hugging Face)"),
        C("init", "init.checkpoint with NaN weights", [*TRAIN, "init.checkpoint=run-nan"],
          r"non-finite.*up_proj"),
        C("init", "init.load_optimizer=true from a checkpoint of parameters only",
          [*TRAIN, "init.checkpoint=ckpt", "init.load_optimizer=true"],
          r"^init.checkpoint \S*ckpt has no optimizer state \(set init.load_optimizer=false to "
          r"start a fresh optimizer\)$"),
        C("init", "a run continued on other data (its fingerprint)",
          [*TRAIN, *CONTINUE, f"data.paths=[{HELDOUT}]"],
          r"^init.checkpoint \S*oc-run: dataset fingerprint mismatch: data file 0 was tokens.npy, "
          r"now part-00000-0000.npy \(the checkpoint's data_paths.txt\); the data order would "
          r"change \(override with data.ignore_fingerprint_mismatch=true\)$"),
        C("init", "a run continued with other token ids than its checkpoint's",
          [*TRAIN, *CONTINUE, "data.tokenizer=gpt2"],
          r"^data.tokenizer \(gpt2\) has vocab_size 50257, eos_token_id 50256, pad_token_id "
          r"50256, bos_token_id 50256, but init.checkpoint was trained with vocab_size 100278, "
          r"eos_token_id 100257, pad_token_id 100277, bos_token_id none \(\S*oc-run/config.json "
          r"dataset.tokenizer\); leave data.tokenizer unset to read the data with the "
          r"checkpoint's ids, or name those$"),
        C("init", "a run continued at another sequence length",
          [*TRAIN, *CONTINUE, "train.seq_len=16"],
          r"^init.checkpoint \S*oc-run: its data loader's sequence_length is 32, this run's "
          r"train.seq_len 16; continuing it needs train.seq_len=32$"),
        C("train", "a resumed run on other data (its fingerprint)",
          ["train", "tiny.yaml", "--run-dir", "run-fp", f"data.paths=[{HELDOUT}]"],
          r"^dataset fingerprint mismatch: data file 0 was tokens.npy \(16384 bytes\), now "
          r"\S*part-00000-0000.npy \(\d+ bytes\); the data order would change \(override with "
          r"data.ignore_fingerprint_mismatch=true\)$"),
        C("train", "an unknown tokenizer", [*TRAIN, "data.tokenizer=gpt3"],
          r"^tokenizer: unknown tokenizer 'gpt3' \(use dolma2, dolma2_sigdig, "
          r"gpt_neox_olmo_dolma_v1_5, gpt2, a path to a tokenizer.json, or OLMo-core "
          r"TokenizerConfig fields\)$"),
        C("train", "downstream tasks with a tokenizer of ids only",
          [*TRAIN, "eval.interval=1", "eval.tasks=[arc_challenge_rc_0shot]", "data.tokenizer=gpt2"],
          r"^eval.tasks: data.tokenizer gpt2 gives token ids only and cannot encode the tasks' "
          r"text; name a tokenizer that can"),
        C("train", "tokenizer fields with an id beyond its vocabulary",
          [*TRAIN, "data.tokenizer={vocab_size: 1000, eos_token_id: 1000, pad_token_id: 0}"],
          r"^data.tokenizer.eos_token_id must be an id below vocab_size 1000 \(got 1000\)$"),
        # -- eval
        C("eval", "checkpoint that does not exist", EVAL("nowhere"), r"checkpoint not found: nowhere"),
        C("eval", "a file instead of a checkpoint", EVAL("afile"), r"afile is a file, not an olmax checkpoint"),
        C("eval", "checkpoint whose name is not UTF-8", EVAL(NOT_UTF8_CKPT),
          r"^checkpoint '\S*ckpt-caf\\udce9': the name is not UTF-8 text, which the checkpoint library "
          r"\(TensorStore\) needs; rename it$"),
        C("eval", "HF directory with pytorch_model.bin only", EVAL("hf-bin"), r"hf-bin.*safetensors"),
        C("eval", "olmax checkpoint with NaN weights", EVAL("ckpt-nan"), r"non-finite.*up_proj"),
        C("eval", "HF directory with NaN weights", EVAL("hf-nan"), r"non-finite.*up_proj"),
        C("eval", "nothing to evaluate", ["eval", "ckpt", "--json", "OUT.json"], r"give --tasks and/or --heldout"),
        C("eval", "--json file exists", [*EVAL("ckpt")[:-1], "exists.json"], r"exists.json already exists"),
        C("eval", "--limit 0", ["eval", "ckpt", "--tasks", "arc_easy", "--limit", "0", "--json", "OUT.json"],
          r"--limit must be positive"),
        C("eval", "--batch-size 0", EVAL("ckpt", "--batch-size", "0"), r"--batch-size must be positive"),
        C("eval", "--max-length 0", EVAL("ckpt", "--max-length", "0"), r"--max-length must be positive"),
        C("eval", "unknown task", ["eval", "ckpt", "--tasks", "arc_hard_bogus", "--json", "OUT.json"],
          r"unknown downstream task"),
        C("eval", "held-out file that does not exist", EVAL("ckpt", heldout="gone.npy"), r"gone.npy"),
        C("eval", "held-out file missing, for a training checkpoint (read first)",
          EVAL("run-done/checkpoints/5", heldout="gone.npy"), r"gone.npy"),
        C("eval", "held-out folder instead of files", EVAL("ckpt", heldout="tokenized"), r"tokenized is a directory"),
        C("eval", "tokenizer file that does not exist", EVAL("ckpt", "--tokenizer", "tok.json"), r"tok.json"),
        C("eval", "unknown compute dtype", EVAL("ckpt", "--dtype", "float16"), r"invalid choice: 'float16'"),
        # -- convert
        C("merge", "checkpoints of two architectures", ["merge", "ckpt", "ckpt-theta", "--out", "OUT",
                                                         "--weights-only"],
          r"are different models: model.rope_theta is 10000.0 in \S*ckpt-theta but"),
        C("merge", "a checkpoint without optimizer state", ["merge", "run-done", "ckpt", "--out", "OUT"],
          r"ckpt holds no optimizer state: merge the weights alone \(--weights-only\)"),
        C("merge", "one weight for two checkpoints", ["merge", "run-done", "ckpt", "--out", "OUT",
                                                      "--weights-only", "--weights", "1"],
          r"--weights: 1 weights for 2 checkpoints"),
        C("merge", "a checkpoint with NaN weights", ["merge", "run-done", "run-nan", "--out", "OUT"],
          r"run-nan\S*: non-finite weights"),
        C("convert", "OLMo-core config.json with a fractional layer count",
          ["convert", "olmo-core-to-olmax", "oc-half-layer", "OUT", "--weights-only"],
          r"config\.json: model\.n_layers must be a whole number \(got 1\.5\)"),
        C("convert", "HF directory that does not exist", ["convert", "hf-to-olmax", "nope", "OUT"], r"nope"),
        C("convert", "output directory whose name is not UTF-8", ["convert", "hf-to-olmax", "hf",
                                                                  "OUT-" + NOT_UTF8_CKPT],
          r"^checkpoint directory '\S*ckpt-caf\\udce9': the name is not UTF-8 text, which the "
          r"checkpoint library \(TensorStore\) needs; rename it$"),
        C("convert", "checkpoint whose name is not UTF-8", ["convert", "olmax-to-hf", NOT_UTF8_CKPT, "OUT"],
          r"^checkpoint '\S*ckpt-caf\\udce9': the name is not UTF-8 text"),
        C("convert", "output directory in a bucket", ["convert", "hf-to-olmax", "not-hf",
                                                       "gs://bkt/out"],
          r"^output directory gs://bkt/out: a bucket path; this writes a local directory"),
        C("convert", "HF config that is not JSON", ["convert", "hf-to-olmax", "not-hf", "OUT"],
          r"not-hf/config.json: invalid JSON"),
        C("convert", "config.json without a required key", ["convert", "hf-to-olmax", "hf-nohidden", "OUT"],
          r"hf-nohidden/config.json: missing 'hidden_size'"),
        C("convert", "another architecture", ["convert", "hf-to-olmax", "hf-llama", "OUT"],
          r"model_type 'llama'.*not supported"),
        C("convert", "HF directory with pytorch_model.bin only", ["convert", "hf-to-olmax", "hf-bin", "OUT"],
          r"hf-bin.*safetensors"),
        C("convert", "truncated safetensors file", ["convert", "hf-to-olmax", "hf-truncated", "OUT"],
          r"hf-truncated/model.safetensors"),
        C("convert", "HF weights with NaN/Inf", ["convert", "hf-to-olmax", "hf-nan", "OUT"],
          r"non-finite.*model.layers.2.mlp.up_proj.weight"),
        C("convert", "output folder not empty", ["convert", "hf-to-olmax", "hf", "nonempty"],
          r"output directory exists and is not empty: nonempty"),
        C("convert", "output is a file", ["convert", "hf-to-olmax", "hf", "afile"],
          r"output path exists and is not a directory: afile"),
        C("convert", "checkpoint that does not exist", ["convert", "olmax-to-hf", "nowhere", "OUT"],
          r"checkpoint not found: nowhere"),
        C("convert", "an HF directory given as the checkpoint", ["convert", "olmax-to-hf", "hf", "OUT"],
          r"(no olmax checkpoint|Hugging Face)"),
        C("convert", "checkpoint with NaN/Inf weights", ["convert", "olmax-to-hf", "ckpt-nan", "OUT"],
          r"non-finite.*up_proj"),
        C("convert", "unknown direction", ["convert", "hf-to-jax", "hf", "OUT"], r"invalid choice: 'hf-to-jax'"),
        C("convert", "unknown dtype", ["convert", "hf-to-olmax", "hf", "OUT", "--dtype", "int8"],
          r"invalid choice: 'int8'"),
        # -- parity
        C("parity", "HF directory that does not exist", ["parity", "nope"], r"nope"),
        C("parity", "HF directory with pytorch_model.bin only", ["parity", "hf-bin", "--checkpoint", "ckpt"],
          r"hf-bin.*safetensors"),
        C("parity", "--checkpoint that does not exist", ["parity", "hf", "--checkpoint", "nowhere"], r"nowhere"),
        C("parity", "--checkpoint of another architecture", ["parity", "hf-theta", "--checkpoint", "ckpt"],
          r"rope_theta"),
        C("parity", "--checkpoint with NaN weights", ["parity", "hf", "--checkpoint", "ckpt-nan"],
          r"non-finite.*up_proj"),
        C("parity", "--tokens file that does not exist", ["parity", "hf", "--tokens", "gone.npy"], r"gone.npy"),
        C("parity", "--tokens missing, with a training checkpoint (read first)",
          ["parity", "hf", "--checkpoint", "run-done/checkpoints/5", "--tokens", "gone.npy"], r"gone.npy"),
        C("parity", "--tokens file too short", ["parity", "hf", "--tokens", "tokens.npy", "--seq-len", "8192"],
          r"tokens.npy: has 4096 tokens, need"),
        C("parity", "--text file that is not UTF-8", ["parity", "hf", "--text", "latin1.txt"],
          r"latin1.txt.*UTF-8"),
        C("parity", "--text file that does not exist", ["parity", "hf", "--text", "gone.txt"], r"gone.txt"),
        C("parity", "--seq-len 0", ["parity", "hf", "--seq-len", "0"], r"must be positive"),
        C("parity", "--tokens and --text together", ["parity", "hf", "--tokens", "tokens.npy", "--text", "a.txt"],
          r"not allowed with argument"),
        # -- tokenize
        C("tokenize", "input that does not exist", ["tokenize", "gone.jsonl", "--out", "tok1"],
          r"input not found: gone.jsonl"),
        C("tokenize", "corrupt .jsonl.gz", ["tokenize", "corrupt.jsonl.gz", "--out", "tok2"],
          r"corrupt.jsonl.gz"),
        C("tokenize", "a JSONL line that is not JSON", ["tokenize", "bad.jsonl", "--out", "tok3"], r"bad.jsonl:2: unreadable JSON line"),
        C("tokenize", "JSONL without the text field", ["tokenize", "notext.jsonl", "--out", "tok4"],
          r"notext.jsonl.*text"),
        C("tokenize", "text file that is not UTF-8", ["tokenize", "latin1.txt", "--out", "tok5"],
          r"latin1.txt.*UTF-8"),
        C("tokenize", "--out that is a file", ["tokenize", "docs", "--out", "afile"], r"afile"),
        C("tokenize", "--out holding other files", ["tokenize", "docs", "--out", "nonempty"],
          r"nonempty is not empty"),
        C("tokenize", "--out of a finished tokenization", ["tokenize", "docs", "--out", "tokenized"],
          r"already holds a finished tokenization"),
        C("tokenize", "tokenizer file that does not exist", ["tokenize", "docs", "--out", "tok6",
                                                             "--tokenizer", "tok.json"], r"tok.json"),
        C("tokenize", "--workers 0", ["tokenize", "docs", "--out", "tok7", "--workers", "0"], r"--workers must be >= 1"),
        C("tokenize", "--max-file-tokens 0", ["tokenize", "docs", "--out", "tok8", "--max-file-tokens", "0"],
          r"file size limit must be positive"),
        C("tokenize", "folder without any text file", ["tokenize", "nodocs", "--out", "tok9"],
          r"nodocs: folder holds no"),
        # -- data inspect
        C("data", "inspect: token file that does not exist", ["data", "inspect", "--paths", "gone.npy",
                                                              "--seq-len", "32", "--global-batch-size", "2",
                                                              "--seed", "1", "--batches", "0:1"], r"gone.npy"),
        C("data", "inspect: a folder as a token file", ["data", "inspect", "--paths", "tokenized", "--seq-len",
                                                        "32", "--global-batch-size", "2", "--seed", "1",
                                                        "--batches", "0:1"], r"tokenized.* is a directory"),
        C("data", "inspect: malformed --batches", ["data", "inspect", "--paths", "tokens.npy", "--seq-len", "32",
                                                   "--global-batch-size", "2", "--seed", "1", "--batches", "5"],
          r"--batches"),
        C("data", "inspect: empty batch range", ["data", "inspect", "--paths", "tokens.npy", "--seq-len", "32",
                                                 "--global-batch-size", "2", "--seed", "1", "--batches", "5:3"],
          r"--batches"),
        C("data", "inspect: --seq-len 0", ["data", "inspect", "--paths", "tokens.npy", "--seq-len", "0",
                                           "--global-batch-size", "2", "--seed", "1", "--batches", "0:1"],
          r"seq.len"),
        # -- curves
        C("curves", "run that does not exist", ["curves", "no-run"], r"no-run"),
        C("curves", "metrics file with a line that is not JSON", ["curves", "run-bad-metrics"],
          r"run-bad-metrics/metrics.jsonl.*line 2"),
        C("curves", "metric the runs do not have", ["curves", "run-good", "--metric", "accuracy"],
          r"accuracy"),
        C("curves", "--smooth outside [0, 1)", ["curves", "run-good", "--smooth", "1.5"], r"--smooth"),
        C("curves", "--map without '='", ["curves", "run-good", "--map", "loss"], r"--map"),
        # -- bench and launch
        C("bench", "unknown recipe", ["bench", "train", "no_such_recipe"], r"no_such_recipe"),
        C("bench", "--steps 0", ["bench", "train", "tiny.yaml", "--steps", "0", "--no-ceiling"], r"--steps"),
        C("bench", "an A/B of one leg", ["bench", "ab", "tiny.yaml", "--leg", "only"],
          r"^--leg: at least two legs, each named first"),
        C("bench", "an A/B leg named like an override", ["bench", "ab", "tiny.yaml", "--leg", "a",
                                                         "--leg", "train.remat=full"],
          r"^--leg: at least two legs, each named first"),
        C("bench", "--json file exists", ["bench", "matmul", "--json", "exists.json"],
          r"exists.json already exists"),
        C("launch", "no node count", ["launch", "slurm", "tiny.yaml", "--out", "job.sh"], r"--nodes"),
        C("launch", "misspelt override", ["launch", "slurm", "tiny.yaml", "trian.x=1", "--nodes", "2",
                                          "--run-dir", "/shared/r", "--out", "job.sh"],
          r"unknown config key 'trian'"),
        C("plan", "--json file exists", ["plan", "tiny.yaml", "--json", "exists.json"],
          r"exists.json already exists"),
        C("plan", "misspelt override after an option", ["plan", "tiny.yaml", "--no-parts", "trian.x=1"],
          r"unknown config key 'trian'"),
        C("quickstart", "--run-dir that is an existing file", ["quickstart", "--run-dir", "afile"],
          r"run directory afile exists and is not a directory"),
        # -- the newer surfaces: data fetch, remote reads, recipes, checkpoints, launch, plan, curves
        C("data", "fetch: a mix line that climbs out of --to onto a user's file",
          ["data", "fetch", "evil-mix.txt", "--root", "@HTTP/data", "--to", "deep/a/b", "--no-progress"],
          r"^evil-mix.txt:2: 'allenai/dolma3-tokenizer/../../../../escaped.npy' would be written "
          r"outside deep/a/b \('\.\.' segments\); nothing was written$"),
        C("data", "fetch: a path with '..' below --root",
          ["data", "fetch", "../escaped.npy", "--root", "@HTTP/data", "--to", "fetched", "--no-progress"],
          r"would be written outside fetched"),
        C("data", "fetch: a mix file that is not UTF-8",
          ["data", "fetch", "latin1-mix.txt", "--root", "@HTTP/data", "--to", "fetched"],
          r"^latin1-mix.txt: not UTF-8 text"),
        C("data", "fetch: OLMAX_COPY_CHUNK_BYTES with a unit",
          ["data", "fetch", "tokens.npy", "--root", "@HTTP/data", "--to", "fetched", "--no-progress"],
          r"^OLMAX_COPY_CHUNK_BYTES='8MiB': expected a whole number of bytes",
          env={"OLMAX_COPY_CHUNK_BYTES": "8MiB"}),
        C("data", "remote token file the server does not have (404: not retried)",
          INSPECT("@HTTP/data/missing.npy"),
          r"^token file not found: http://127.0.0.1:\d+/data/missing.npy$"),
        C("data", "server answering HTTP 500 to the size request",
          INSPECT("@HTTP/fail/tokens.npy"),
          r"/fail/tokens.npy: size request failed after 5 attempts: HTTP 500 Internal Server Error$"),
        C("data", "nothing listening on the port",
          INSPECT("@CLOSED/tokens.npy"),
          r"size request failed after 5 attempts: connection refused \(127.0.0.1:\d+\)$"),
        C("data", "server that ignores Range",
          INSPECT("@NORANGE/data/tokens.npy"),
          r"/data/tokens.npy: the server ignores byte ranges \(asked for 128 bytes at \d+, it sent 16384\)"),
        C("data", "gs:// with no network (the GCS endpoint a closed port)",
          INSPECT("gs://bucket/tokens.npy"),
          r"^gs://bucket/tokens.npy: size request failed after 5 attempts: connection refused",
          env={"STORAGE_EMULATOR_HOST": "@CLOSED"}),
        C("train", "bucket run directory without a bucket name", [*TRAIN[:3], "s3:///runs/a"],
          r"^--run-dir s3:///runs/a: '' is not a bucket name \(expected s3://BUCKET/PATH\)$"),
        C("train", "run directory in a store olmax does not write", [*TRAIN[:3], "az://c/runs/a"],
          r"^--run-dir az://c/runs/a: only s3:// and gs:// bucket paths \(or a local directory\)"),
        C("train", "bucket run directory with the S3 endpoint a closed port (exit 75)",
          [*TRAIN[:3], "s3://olmax-runs/a"],
          r"^run directory s3://olmax-runs/a: write failed after 5 attempts",
          env={"AWS_ENDPOINT_URL": "@CLOSED", "AWS_ACCESS_KEY_ID": "x",
               "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}),
        C("train", "bucket run directory the S3 credentials may not write (HTTP 403)",
          [*TRAIN[:3], "s3://olmax-runs/a"],
          r"^run directory s3://olmax-runs/a: access to bucket s3://olmax-runs denied \(An error "
          r"occurred \(AccessDenied\) when calling the PutObject operation: Access Denied\); "
          r"check the AWS_\* variables or profile$",
          env={"AWS_ENDPOINT_URL": "@DENIED", "AWS_ACCESS_KEY_ID": "x",
               "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}),
        C("train", "bucket run directory the Cloud Storage account may not write (HTTP 403)",
          [*TRAIN[:3], "gs://olmax-runs/a"],
          r"^run directory gs://olmax-runs/a: access to bucket gs://olmax-runs denied \(\S+ does "
          r"not have storage.objects.create access to the Google Cloud Storage object\); check "
          r"the application-default credentials",
          env={"STORAGE_EMULATOR_HOST": "@DENIED"}),
        C("train", "recipe with a YAML alias bomb", ["train", "bomb.yaml", "--run-dir", "RUN"],
          r"^bomb.yaml: more than 1,000,000 values once its YAML aliases are expanded"),
        C("train", "override with a YAML alias bomb", [*TRAIN, "data.paths=@BOMB"],
          r"^override 'data.paths': more than 1,000,000 values"),
        C("train", "recipe with a section given twice", ["train", "dup.yaml", "--run-dir", "RUN"],
          r"^dup.yaml line \d+: invalid YAML \(duplicate key 'train' \(first given at line \d+\)\)$"),
        C("train", "override with a key given twice", [*TRAIN, "train={seq_len: 32, seq_len: 64}"],
          r"^override 'train': duplicate key 'seq_len'"),
        C("train", "recipe that is not UTF-8", ["train", "latin1.yaml", "--run-dir", "RUN"],
          r"^latin1.yaml: not UTF-8 text \(invalid continuation byte at byte \d+\)$"),
        C("train", "recipe larger than 4 MiB", ["train", "big.yaml", "--run-dir", "RUN"],
          r"^big.yaml: [\d,]+ bytes, more than a recipe may hold \(4,194,304\)$"),
        C("train", "newest checkpoint written by a later olmax (format_version 2)",
          ["train", "tiny.yaml", "--run-dir", "run-newer"],
          r"^checkpoint \S*run-newer/checkpoints/2: format_version 2 is newer than this olmax reads"),
        C("train", "run directory whose lock file is not UTF-8",
          ["train", "tiny.yaml", "--run-dir", "run-badlock"],
          r"^run directory run-badlock holds a lock file olmax cannot read, run-badlock/.olmax-lock"),
        C("init", "a packaged recipe from init.hf_dir with other shapes",
          ["train", "olmo3_tiny", "--run-dir", "RUN", "init.hf_dir=hf"],
          r"model.d_model is 64 in the recipe but 32 in hf/config.json.*model=null"),
        C("launch", "--out that holds the user's notes", [*LAUNCH("slurm"), "--out", "notes.txt"],
          r"^--out notes.txt already exists \(remove it or pass --force\)$"),
        C("launch", "--out that is the recipe itself, with --force",
          [*LAUNCH("slurm"), "--out", "tiny.yaml", "--force"],
          r"^--out tiny.yaml is the recipe this command reads"),
        C("launch", "--out that is a FIFO, with --force",
          [*LAUNCH("k8s"), "--out", "pipe", "--force"],
          r"^--out pipe exists and is not a regular file"),
        C("launch", "--grace beyond what sbatch --signal takes",
          [*LAUNCH("slurm"), "--grace", "70000", "--out", "OUT.sh"],
          r"^--grace 70000: sbatch --signal takes at most 65535 seconds"),
        C("launch", "--namespace that is not a DNS label",
          [*LAUNCH("k8s"), "--namespace", "Team_A", "--out", "OUT.yaml"],
          r"^--namespace 'Team_A': use lower-case letters"),
        C("plan", "--hlo that is the recipe itself, with --force",
          ["plan", "tiny.yaml", "--no-parts", "--hlo", "tiny.yaml", "--force"],
          r"^--hlo tiny.yaml is the recipe this command reads"),
        C("plan", "--hlo that holds the user's notes", ["plan", "tiny.yaml", "--no-parts", "--hlo", "notes.txt"],
          r"^--hlo notes.txt already exists"),
        C("plan", "--topology of no accelerator", ["plan", "tiny.yaml", "--topology", "banana:2x2"],
          r"^unknown TPU topology 'banana:2x2' \(no TPU generation 'banana'"),
        C("plan", "--topology with a four-part shape", ["plan", "tiny.yaml", "--topology", "v5e:2x2x2x2"],
          r"^unknown TPU topology 'v5e:2x2x2x2' \(the shape '2x2x2x2' is not AxB or AxBxC"),
        C("plan", "--topology of a shape that is no slice", ["plan", "tiny.yaml", "--topology", "tpu7x:3x3x3"],
          r"^--topology 'tpu7x:3x3x3': 3x3x3 is no tpu7x slice"),
        C("plan", "--topology with a GPU count in words", ["plan", "tiny.yaml", "--topology", "h100:eight"],
          r"^--topology h100:eight: the GPU count must be a positive whole number"),
        C("plan", "--topology with no GPUs", ["plan", "tiny.yaml", "--topology", "h100:0"],
          r"^--topology h100:0: the GPU count must be a positive whole number"),
        C("plan", "a step larger than the local devices' memory (a result: exit 1)",
          ["plan", "tiny.yaml", "--no-parts", "model.mlp_hidden=1073741824"],
          r"^does not fit: the step \(cpu x1, .*\) needs [\d.]+ GiB of device memory per device, "
          r"[\d.]+ GiB available \(host memory / devices, for the step's parameters, optimizer state "
          r"and batch\); to lower it: mesh\.fsdp",
          result=True),
        C("train", "a step larger than train.memory_limit_gib", [*TRAIN, "train.memory_limit_gib=0.0001"],
          r"^does not fit: the training step \(1 x cpu, .*, batch 4 x 32\) needs [\d.]+ MiB of device "
          r"memory per device, 0.1 MiB available \(train.memory_limit_gib\); to lower it: "
          r"train.micro_batch_size \(now 4; auto picks the largest that fits\), train.remat"),
        C("train", "auto settings of which none fits",
          [*TRAIN, "train.micro_batch_size=auto", "train.remat=auto", "train.memory_limit_gib=0.0001"],
          r"^does not fit: the training step \(.*\), at micro-batch 1 and remat \w+ \(the least memory "
          r"train.micro_batch_size=auto and train.remat=auto can choose\), needs [\d.]+ MiB .*; to "
          r"lower it: mesh.fsdp"),
        C("train", "parameters larger than the machine's memory", [*TRAIN, "model.mlp_hidden=1073741824"],
          r"^does not fit: the training step \(.*\) needs [\d.]+ GiB of device memory per device, "
          r"[\d.]+ GiB available \(host memory / devices, for the step's parameters, optimizer state "
          r"and batch\); to lower it: mesh.fsdp"),
        C("train", "train.memory_limit_gib of zero", [*TRAIN, "train.memory_limit_gib=0"],
          r"^train.memory_limit_gib must be positive or null \(got 0.0\)$"),
        C("bench", "a step larger than train.memory_limit_gib",
          ["bench", "train", "tiny.yaml", "--steps", "1", "--no-ceiling", "train.memory_limit_gib=0.0001"],
          r"^does not fit: the training step \(1 x cpu, batch 4 x 32\) needs [\d.]+ MiB of device "
          r"memory per device"),
        C("eval", "--json that is the held-out file, with --force",
          ["eval", "ckpt", "--heldout", "tokens.npy", "--json", "tokens.npy", "--force"],
          r"^--json tokens.npy is a held-out file this command reads"),
        C("curves", "metrics file that is not UTF-8", ["curves", "run-latin"],
          r"^run-latin/metrics.jsonl: not UTF-8 text"),
        C("curves", "--json that is a compared metrics file, with --force",
          ["curves", "run-good", "run-latin", "--json", "run-good/metrics.jsonl", "--force"],
          r"^--json run-good/metrics.jsonl is a metrics file this command reads"),
        C("train", "platform profile that does not exist", [*TRAIN, "train.profile=npu"],
          r"train.profile.*'npu'"),
        C("plan", "--profile that does not exist", ["plan", "tiny.yaml", "--no-parts", "--profile", "npu"],
          r"argument --profile: invalid choice: 'npu'"),
        C("parity", "--json that holds the user's notes", ["parity", "hf", "--json", "notes.txt"],
          r"^--json notes.txt already exists \(remove it or pass --force\)$"),
        # -- operating a long run: attempts, platform pins, watchdog and start-up limits, launch
        C("train", "--attempt that is not JOB.N", [*TRAIN, "--attempt", "4242"],
          r"argument --attempt: '4242': expected JOB.N"),
        C("train", "--expect-devices of a platform olmax does not name", [*TRAIN, "--expect-devices", "cuda:8"],
          r"argument --expect-devices: 'cuda:8': expected PLATFORM:N"),
        C("train", "--expect-devices other than the devices here", [*TRAIN, "--expect-devices", "gpu:8"],
          r"^the job was written for 8 gpu devices, but this process sees \d+ cpu device\(s\) in all"),
        C("train", "watchdog of zero seconds", [*TRAIN, "train.watchdog_s=0"],
          r"^train.watchdog_s must be positive or null \(got 0"),
        C("train", "splash block that is not a multiple of 128", [*TRAIN, "train.splash_block=192"],
          r"^train.splash_block must be a positive multiple of 128 \(got 192\)$"),
        C("train", "layer unrolling that is not a boolean", [*TRAIN, "train.unroll_layers=maybe"],
          r"^train.unroll_layers: expected bool, got str 'maybe'$"),
        C("train", "loss chunk of no rows", [*TRAIN, "train.loss_chunk_rows=0"],
          r"^train.loss_chunk_rows must be positive or null \(got 0"),
        C("train", "start-up timeout that is negative", [*TRAIN, "distributed.init_timeout_s=-5"],
          r"^distributed.init_timeout_s must be positive or null \(got -5\)"),
        C("train", "--run-dir held by a later attempt of the same job",
          ["train", "tiny.yaml", "--run-dir", "run-replaced", "--attempt", "7.2"],
          r"^run directory run-replaced is held by attempt 7.3 of this job, pid 12345 on host "
          r"other-host.example \(attempt 7.3\); this is attempt 7.2, which it replaced$",
          # the holder's heartbeat stays fresh however long the cases before this one take
          env={"OLMAX_RUN_LOCK_STALE_S": "86400"}),
        C("launch", "slurm over two nodes with no --run-dir",
          ["launch", "slurm", "tiny.yaml", "--nodes", "2", "--gpus-per-node", "0", "--out", "OUT.sh"],
          r"^--run-dir DIR is required for 2 nodes"),
        C("launch", "--processes-per-node gpus on CPU nodes",
          [*LAUNCH("slurm"), "--processes-per-node", "gpus", "--out", "OUT.sh"],
          r"^--processes-per-node gpus needs GPUs"),
        C("launch", "--max-restarts below zero", [*LAUNCH("slurm"), "--max-restarts", "-1", "--out", "OUT.sh"],
          r"^--max-restarts must be >= 0 \(got -1\)$"),
        C("launch", "--topology of a size v5p does not have",
          ["launch", "k8s", "tiny.yaml", "--topology", "v5p-12", "--out", "OUT.yaml"],
          r"^--topology 'v5p-12': 12 is not a slice size of v5p"),
        C("launch", "--topology with a shape of the wrong rank",
          ["launch", "tpu-vm", "tiny.yaml", "--topology", "v5p:4x4", "--out", "OUT.sh"],
          r"^--topology 'v5p:4x4': a v5p shape has 3 dimensions"),
        C("launch", "--num-slices for GPU pods", [*LAUNCH("k8s"), "--num-slices", "2", "--out", "OUT.yaml"],
          r"^--num-slices needs a TPU --topology"),
        C("launch", "--controller that does not exist", [*LAUNCH("k8s"), "--controller", "deployment",
                                                          "--out", "OUT.yaml"],
          r"argument --controller: invalid choice: 'deployment'"),
        C("launch", "--resource without a quantity", [*LAUNCH("k8s"), "--resource", "rdma/ib",
                                                       "--out", "OUT.yaml"],
          r"^--resource 'rdma/ib' is not of the form NAME=QUANTITY"),
        C("launch", "--memory that is not a quantity", [*LAUNCH("k8s"), "--memory", "lots",
                                                         "--out", "OUT.yaml"],
          r"^--memory 'lots': a Kubernetes quantity"),
        C("launch", "--patch that is not a pod template", [*LAUNCH("k8s"), "--patch", "notpod.yaml",
                                                            "--out", "OUT.yaml"],
          r"^--patch notpod.yaml: expected a mapping of the pod template's metadata and/or spec"),
        C("launch", "--patch that does not exist", [*LAUNCH("k8s"), "--patch", "nopatch.yaml",
                                                     "--out", "OUT.yaml"],
          r"^--patch nopatch.yaml: cannot read it \(No such file or directory\)$"),
        C("launch", "--queue that is not a DNS label", [*LAUNCH("k8s"), "--queue", "Q_1", "--out", "OUT.yaml"],
          r"^--queue 'Q_1': use lower-case letters"),
        C("plan", "--topology of an accelerator type of no slice size",
          ["plan", "tiny.yaml", "--topology", "v5p-12"],
          r"^--topology 'v5p-12': 12 is not a slice size of v5p"),
        C("train", "float8 dense layers on devices without float8 matmuls",
          [*TRAIN, "train.float8=true"], r"^train.float8: the cpu devices \(cpu\) have no float8 matmuls"),
        # -- every key checked where it is declared; recipes that state their start
        C("train", "YaRN factor 0", [*TRAIN, "model.rope_scaling={factor: 0}"],
          r"^model.rope_scaling.factor must be >= 1 \(got 0.0\)$"),
        C("train", "YaRN beta_fast 0", [*TRAIN, "model.rope_scaling={beta_fast: 0}"],
          r"^model.rope_scaling.beta_fast must be positive \(got 0.0\)$"),
        C("train", "YaRN original context 0",
          [*TRAIN, "model.rope_scaling={original_max_position_embeddings: 0}"],
          r"^model.rope_scaling.original_max_position_embeddings must be >= 1 \(got 0\)$"),
        C("train", "learning rate beyond float32", [*TRAIN, "optim.lr=1e39"],
          r"^optim.lr must be within float32's range"),
        C("train", "Adam beta of 1", [*TRAIN, "optim.betas=[0.9, 1.0]"],
          r"^optim.betas\[1\] must be in \[0, 1\) \(got 1.0\)$"),
        C("train", "a choice in the wrong case", [*TRAIN, "train.micro_batch_size=Auto"],
          r"^train.micro_batch_size: expected int or auto or null, got str 'Auto' "
          r"\(did you mean 'auto'\?\)$"),
        C("train", "an empty tokenizer name", [*TRAIN, "data.tokenizer=''"],
          r"^data.tokenizer: expected a non-empty string, got ''$"),
        C("train", "a step count beyond int64", [*TRAIN, "train.max_steps=1.0e+30"],
          r"^train.max_steps: 1000000000000000019884624838656 does not fit in 64 bits"),
        C("train", "coordinator address without a port", [*TRAIN, "distributed.coordinator=node0"],
          r"^distributed.coordinator: expected HOST:PORT, got 'node0' \(no port\)$"),
        C("train", "coordinator address with a port out of range",
          [*TRAIN, "distributed.coordinator=node0:70000"],
          r"^distributed.coordinator: the port must be a number in 1..65535"),
        C("train", "coordinator address given as a URL",
          [*TRAIN, "distributed.coordinator=http://node0:8476"],
          r"^distributed.coordinator: expected HOST:PORT, not a URL"),
        C("train", "OLMAX_COORDINATOR without a port", TRAIN,
          r"^OLMAX_COORDINATOR: expected HOST:PORT, got 'node0' \(no port\)$",
          env={"OLMAX_COORDINATOR": "node0"}),
        C("init", "stage 3 without the checkpoint it starts from",
          ["train", "olmo3_7b_stage3", "--run-dir", "RUN", "data.embedded=true"],
          r"^init.checkpoint must be set: this recipe \(init.required=optimizer\) starts from a "
          r"checkpoint with its optimizer state; init.required=none trains it from fresh weights"),
        C("init", "stage 1 part 2 in a run directory without part 1's checkpoint",
          ["train", "olmo3_7b_stage1_part2", "--run-dir", "RUN", "data.embedded=true"],
          r"^--run-dir must hold the checkpoint this recipe continues \(init.required=resume\): the "
          r"run directory of the run it extends, or init.checkpoint with init.load_optimizer=true "
          r"and init.load_trainer_state=true; init.required=none trains it from fresh weights"),
        C("init", "stage 2 without the weights it starts from",
          ["launch", "slurm", "olmo3_7b_stage2", "data.embedded=true", "--nodes", "1",
           "--gpus-per-node", "8", "--out", "OUT.sh"],
          r"^init.checkpoint or init.hf_dir must be set: this recipe \(init.required=weights\)"),
        C("convert", "HF config.json with YaRN factor 0", ["convert", "hf-to-olmax", "hf-yarn0", "OUT"],
          r"^hf-yarn0/config.json: model.rope_scaling.factor must be >= 1 \(got 0.0\)$"),
        C("curves", "--threshold nan", ["curves", "run-good", "run-good", "--threshold", "nan"],
          r"^--threshold must be a finite number >= 0 \(got nan\)$"),
        C("curves", "metrics line that is JSON but not an object", ["curves", "run-list-line"],
          r"^run-list-line/metrics.jsonl: line 2 is not a JSON object \(a list\)$"),
        C("curves", "step beyond the range of a float", ["curves", "run-huge-step"],
          r"^run-huge-step/metrics.jsonl: line 2: step 1000.* is beyond the range of a float$"),
        C("curves", "CSV row with fewer fields than the header", ["curves", "short-row.csv"],
          r"^short-row.csv: line 3 has 1 fields, the header 2$"),
        C("bench", "profile with --steps 0", ["bench", "profile", "tiny.yaml", "--steps", "0"],
          r"^--steps must be >= 1 \(got 0\)$"),
        # -- what launch writes, checked like what it reads
        C("launch", "--patch that deletes the training container",
          [*LAUNCH("k8s"), "--patch", "drop-container.yaml", "--out", "OUT.yaml"],
          r"^--patch removes the training container 'olmax' from the pod template$"),
        C("launch", "--patch with a restart policy beside the pod failure policy",
          [*LAUNCH("k8s"), "--patch", "on-failure.yaml", "--out", "OUT.yaml"],
          r"^--patch sets restartPolicy 'OnFailure'; the job's pod failure policy"),
        C("launch", "--patch nested 300 levels deep",
          [*LAUNCH("k8s"), "--patch", "deep-patch.yaml", "--out", "OUT.yaml"],
          r"^--patch deep-patch.yaml: more than 100 levels of nesting"),
        C("launch", "--resource that replaces the GPU count",
          ["launch", "k8s", "tiny.yaml", "--nodes", "1", "--gpus-per-node", "2", "--run-dir",
           "/mnt/runs/r", "--resource", "nvidia.com/gpu=1", "--out", "OUT.yaml"],
          r"^--resource nvidia.com/gpu=1 would replace the 2 the job was written for"),
        C("launch", "--max-restarts beyond the API's int32",
          [*LAUNCH("slurm"), "--max-restarts", "3000000000", "--out", "OUT.sh"],
          r"^--max-restarts 3000000000 times 1 node\(s\) exceeds 2,147,483,647"),
        C("launch", "--topology of a shape that is no slice",
          ["launch", "k8s", "tiny.yaml", "--topology", "v5p:3x3x3", "--out", "OUT.yaml"],
          r"^--topology 'v5p:3x3x3': 3x3x3 is no v5p slice"),
        # -- what olmax reads from the field is verified, never assumed
        C("convert", "OLMo-core config.json whose feed-forward is GELU", OC_IMPORT("oc-gelu"),
          r"^oc-gelu/config.json: model.block.feed_forward.activation is 'gelu': olmax's MLP is "
          r"SwiGLU \(olmax reads 'silu'\)$"),
        C("convert", "OLMo-core config.json whose layer norm is OLMo-core's default (LayerNorm)",
          OC_IMPORT("oc-layernorm"),
          r"model.block.layer_norm.name is 'default': olmax's norms are RMSNorm \(OLMo-core's "
          r"default is LayerNorm\)"),
        C("convert", "OLMo-core config.json without the attention's bias (OLMo-core's default: true)",
          OC_IMPORT("oc-bias"),
          r"model.block.sequence_mixer.bias is None \(OLMo-core's default: biases\): olmax's "
          r"layers have no biases"),
        C("convert", "OLMo-core config.json with complex RoPE", OC_IMPORT("oc-complex-rope"),
          r"model.block.sequence_mixer.rope.name is 'complex'"),
        C("convert", "OLMo-core config.json of a mixture-of-experts block", OC_IMPORT("oc-moe"),
          r"model.block.name is 'moe_reordered_norm'"),
        C("convert", "OLMo-core config.json with a field OLMo-core 3.0 does not have",
          OC_IMPORT("oc-unknown-field"),
          r"model.block.sequence_mixer.softcap is 30.0: OLMo-core 3.0's AttentionConfig has no "
          r"field 'softcap', so olmax cannot know what it computes"),
        C("convert", "OLMo-core .distcp chunk with 8 bytes flipped (same size)",
          OC_IMPORT("oc-flipped"),
          r"^oc-flipped/model_and_optim/__0_0.distcp \(model.embeddings.weight\): entry "
          r"archive/data/0 fails its CRC-32 check"),
        C("convert", "OLMo-core train/rank0.pt with 8 bytes flipped", OC_IMPORT("oc-flipped-state"),
          r"^oc-flipped-state/train/rank0.pt: entry archive/data.pkl fails its CRC-32 check"),
        C("convert", "OLMo-core train/rank0.pt that is a link to itself", OC_IMPORT("oc-loop"),
          r"^oc-loop/train/rank0.pt: not a readable file \(a directory, a broken link or a link loop\)"),
        C("init", "continuing an OLMo-core checkpoint without train/rank0.pt",
          [*TRAIN, "init.checkpoint=oc-no-state", "init.load_optimizer=true",
           "init.load_trainer_state=true"],
          r"^init.load_trainer_state=true: init.checkpoint oc-no-state has no train/rank0.pt: its "
          r"step, data position and seed are unknown"),
        C("convert", "OLMo-core weights holding a NaN", OC_IMPORT("oc-nan"),
          r"^oc-nan: non-finite weights in 1 tensor\(s\): model.blocks.1.feed_forward.w1.weight "
          r"\(1 NaN\)$"),
        C("merge", "an OLMo-core checkpoint holding a NaN", ["merge", "oc-full", "oc-nan", "--out", "OUT"],
          r"^oc-nan: non-finite weights in 1 tensor\(s\): model.blocks.1.feed_forward.w1.weight"),
        C("train", "--run-dir s3:/bucket/run (one slash)", [*TRAIN[:3], "s3:/bucket/run"],
          r"^--run-dir s3:/bucket/run: not a URL \(s3: is followed by '//': s3://BUCKET/PATH\)"),
        C("data", "token file at gs:x", INSPECT("gs:x"), r"^data.paths gs:x: not a URL"),
        C("train", "AWS_ENDPOINT_URL that is not a URL (a configuration error, not retried)",
          [*TRAIN[:3], "s3://olmax-runs/a"],
          r"^AWS_ENDPOINT_URL='notaurl': not an http:// or https:// URL",
          env={"AWS_ENDPOINT_URL": "notaurl", "AWS_ACCESS_KEY_ID": "x",
               "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"}),
        C("convert", "OLMo-core checkpoint at an http:// address nothing answers (exit 75)",
          OC_IMPORT("@CLOSED/step12"),
          r"^http://127.0.0.1:\d+/step12/model_and_optim/.metadata: size request failed after 5 "
          r"attempts: connection refused"),
        C("merge", "merge of a checkpoint at an http:// address nothing answers (exit 75)",
          ["merge", "@CLOSED/step12", "ckpt", "--out", "OUT", "--weights-only"],
          r"size request failed after 5 attempts: connection refused"),
        C("merge", "--weights with a share float32 rounds to zero",
          ["merge", "ckpt", "ckpt-nan", "--out", "OUT", "--weights-only", "--weights", "1", "1e-60"],
          r"^--weights: weight 1e-60 is 1e-60 of the total, which rounds to 0 in float32"),
        C("merge", "--weights nan", ["merge", "ckpt", "ckpt-nan", "--out", "OUT", "--weights-only",
                                     "--weights", "1", "nan"],
          r"^--weights: every weight must be a positive number \(got nan\)$"),
        C("tokenize", "--group-mb inf", ["tokenize", "docs", "--out", "tok10", "--group-mb", "inf"],
          r"argument --group-mb: expected a finite number > 0 and <= 1e\+06, got inf"),
        C("data", "overlap: --threshold nan", ["data", "overlap", "--train", "tokens.npy", "--eval",
                                               "tokens.npy", "--threshold", "nan"],
          r"argument --threshold: expected a finite number >= 0 and <= 1, got nan"),
        C("data", "token ids beyond the model's vocabulary",
          [*TRAIN, "model.vocab_size=500", "model.padded_vocab_size=512"],
          r"^the model's vocabulary \(model.padded_vocab_size 512; data.tokenizer 'dolma2'\) does "
          r"not hold token id \d+, at position \d+ of tokens.npy \(tokens \d+..\d+\): the ids "
          r"come from another tokenizer$"),
        C("data", "the embedded corpus with another data.tokenizer",
          [*TRAIN, "data.paths=[]", "data.embedded=true", "data.tokenizer=bytetok"],
          r"^data.embedded=true: the embedded corpus is tokenized with dolma2, but data.tokenizer is "
          r"'bytetok'"),
        C("data", "packed instances from files without the EOS id", [*TRAIN, "data.instances=packed"],
          r"^data.instances=packed: no token file holds a document ending in EOS id 100257 "
          r"\(data.tokenizer 'dolma2'\)"),
        C("train", "override value that is not UTF-8", [*TRAIN, "data.paths=[" + NOT_UTF8_TOKENS + "]"],
          r"^override 'data.paths': the value is not UTF-8 text \(byte 0xe9 at character \d+\)"),
        C("convert", "HF config.json that ties the embeddings over files with another LM head",
          ["convert", "hf-to-olmax", "hf-tied-head", "OUT"],
          r"^hf-tied-head/config.json: tie_word_embeddings is true, but the files' lm_head.weight "
          r"differs from model.embed_tokens.weight \(from row 0\): transformers then computes with "
          r"lm_head.weight, untied; set tie_word_embeddings to false$"),
        C("plan", "--hlo and --json on one new path", ["plan", "tiny.yaml", "--no-parts", "--hlo",
                                                      "same.txt", "--json", "same.txt"],
          r"^--json and --hlo both name same.txt: give each output a file of its own$"),
        C("train", "compiler option that is not NAME=VALUE", [*TRAIN, "train.compiler_options=[fast]"],
          r"^train.compiler_options: 'fast' is not NAME=VALUE \(an XLA option, e.g. "
          r"xla_tpu_scoped_vmem_limit_kib=98304; a value with commas is quoted: \['NAME=A,B'\]\)$"),
        C("train", "compiler option this XLA does not have",
          [*TRAIN, "train.compiler_options=[xla_tpu_scoped_vmem_limit_kib=32768]"],
          r"^train.compiler_options: xla_tpu_scoped_vmem_limit_kib=32768 is refused by the compiler "
          r"\(this XLA has no such option\)$"),
        C("train", "kernel set that does not exist", [*TRAIN, "train.kernels=fast"],
          r"^train.kernels: expected one of reference, cpu, norm, got 'fast'$"),
        C("train", "auto choice that does not exist", [*TRAIN, "train.auto_choice=fastest"],
          r"^train.auto_choice: expected one of estimate, memory, got 'fastest'$"),
    ]
    return out


# ----------------------------------------------------------------------------------------------
# Running


@contextlib.contextmanager
def captured():
    """stdout/stderr of Python and of native code, into two temporary files."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    files = tempfile.TemporaryFile(), tempfile.TemporaryFile()
    old_sys = sys.stdout, sys.stderr
    out: dict[str, str] = {}
    try:
        os.dup2(files[0].fileno(), 1)
        os.dup2(files[1].fileno(), 2)
        sys.stdout = open(1, "w", closefd=False, buffering=1)
        sys.stderr = open(2, "w", closefd=False, buffering=1)
        yield out
    finally:
        for s in (sys.stdout, sys.stderr):
            try:
                s.flush()
            except Exception:
                pass
        sys.stdout, sys.stderr = old_sys
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        for name, f in zip(("stdout", "stderr"), files):
            f.seek(0)
            out[name] = f.read().decode("utf-8", "replace")
            f.close()


class _Timeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def run_case(case: Case) -> Result:
    from olmax.cli import main

    env_before = {k: os.environ.get(k) for k in case.env}
    os.environ.update(case.env)
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CASE_TIMEOUT_S)
    t0 = time.time()
    rc: int | str
    with captured() as out:
        try:
            rc = main(list(case.argv))
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except _Timeout:
            rc = "timeout"
        except BaseException:   # an exception escaping main(): a traceback, as a user would see
            traceback.print_exc()
            rc = "exception"
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
    for k, v in env_before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    return Result(rc, out.get("stdout", ""), out.get("stderr", ""), time.time() - t0)


def normalise(text: str, workdir: Path, names: dict[str, str]) -> str:
    text = text.replace(str(workdir.resolve()) + "/", "").replace(str(workdir.resolve()), ".")
    text = text.replace(str(workdir) + "/", "").replace(str(workdir), ".")
    text = re.sub(r"\b127\.0\.0\.1:\d+", "127.0.0.1:PORT", text)
    text = re.sub(r"\bchanged \d+ s ago\b", "changed N s ago", text)
    text = re.sub(r"\b\d+\.\d\d GiB available\b", "MEM GiB available", text)   # this host's memory
    text = re.sub(r"\bpid \d+ on host \S+", "pid PID on host HOST", text)
    text = re.sub(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", "TIME", text)
    text = re.sub(r"/tmp/[^ ]*?\.tmp-[A-Za-z0-9_]+", "TMP", text)
    return text


def _snapshot(root: Path) -> dict[str, tuple]:
    """Every file (size, mtime, kind) and folder below ``root``, by relative path."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            kind = "dir" if name in dirnames else "file"
            out[os.path.relpath(p, root)] = (kind,) if kind == "dir" else (kind, st.st_mode, st.st_size,
                                                                         st.st_mtime_ns)
    return out


def _destroyed(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """What a case removed or changed of what existed before it."""
    return sorted(f"{path} ({'removed' if path not in after else 'changed'})"
                  for path, was in before.items() if after.get(path) != was)


def _written(case: Case, before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    """What a refused ``olmax train`` left in its run directory that was not there before (it
    must leave nothing: every check that can refuse a start runs before the directory is
    touched), the directory itself included."""
    if "--run-dir" not in case.argv:
        return []
    run = case.argv[case.argv.index("--run-dir") + 1]
    return sorted(p for p in after if p not in before and (p == run or p.startswith(run + "/")))


def _substitute(text: str, names: dict[str, str]) -> str:
    for key in ("@HTTP", "@NORANGE", "@DENIED", "@CLOSED"):
        text = text.replace(key, names[key])
    return text.replace("@BOMB", BOMB_OVERRIDE) if "@BOMB" in text else text


# The retries' back-off while the cases run: every try is still made (the lines name the count),
# only the waits between them shrink (from 0.25 s doubling to 4 s: ~4 s a case).
QUICK_BACKOFF_S = (0.01, 0.02)


def run_all(workdir: Path, select: Callable[[Case], bool] = lambda c: True) -> list[dict]:
    from olmax import transport

    names = make_workspace(workdir)
    global BOMB_OVERRIDE
    BOMB_OVERRIDE = (workdir / "bomb-override.txt").read_text()
    rows = []
    backoffs = [(m, m.BACKOFF_S, m.MAX_BACKOFF_S) for m in (transport,)]
    for m, _, _ in backoffs:
        m.BACKOFF_S, m.MAX_BACKOFF_S = QUICK_BACKOFF_S
    try:
        for case in cases():
            if not select(case):
                continue
            case = dataclasses.replace(case, argv=[_substitute(a, names).replace(
                "RUN", f"run-{len(rows) + 1}").replace("OUT", f"out-{len(rows) + 1}") for a in case.argv],
                env={k: _substitute(v, names) for k, v in case.env.items()})
            before = _snapshot(workdir)
            r = run_case(case)
            after = _snapshot(workdir)
            destroyed = _destroyed(before, after)
            wrote = _written(case, before, after)
            pwned = sorted(p.name for p in workdir.glob("PWNED*"))
            shown = [a.replace(BOMB_OVERRIDE, "<alias bomb: 9^10 values>").encode(
                "utf-8", "backslashreplace").decode("utf-8") for a in case.argv]   # a name not UTF-8
            rows.append({"group": case.group, "mistake": case.mistake,
                         "command": normalise("olmax " + " ".join(shown), workdir, names),
                         "expect": case.expect, "rc": r.rc,
                         "clean": r.clean(case) and not pwned and not destroyed and not wrote,
                         "lines": len(r.lines()), "stdout": normalise(r.stdout, workdir, names),
                         "output": normalise(r.result_line() if case.result else r.error_line(),
                                             workdir, names),
                         "stderr": normalise(r.stderr, workdir, names)[-3000:],
                         "seconds": round(r.seconds, 2), "code_executed": pwned,
                         "destroyed": destroyed, "wrote": wrote})
    finally:
        for m, b, mb in backoffs:
            m.BACKOFF_S, m.MAX_BACKOFF_S = b, mb
        os.kill(int(names["holder_pid"]), signal.SIGKILL)
        for srv in _SERVERS:
            srv.shutdown()
            srv.server_close()
        _SERVERS.clear()
        _REFUSING.close()
    return rows


BOMB_OVERRIDE = ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def markdown(rows: list[dict]) -> str:
    clean = sum(r["clean"] for r in rows)
    out = [
        "# Bad inputs: what olmax prints",
        "",
        "Ordinary mistakes, each run through the `olmax` command line on real (tiny) files and, for",
        "remote token files, real HTTP servers on 127.0.0.1 (one answering 500, one ignoring `Range`;",
        "a closed port stands for a store that cannot be reached). Every one must end in **one line**",
        "on stderr naming the file, key or value at fault, a non-zero exit status and nothing else (no",
        "traceback; `--debug` or `OLMAX_DEBUG=1` adds one); a plan that does not fit is a result, one",
        "line on stdout and exit status 1. Nothing in these files is ever executed (a pickled",
        "`pytorch_model.bin` and a YAML `!!python` tag are refused before they are read), no output is",
        "half-written, no file that existed before a case is changed or removed by it, and a refused",
        "`olmax train` leaves nothing in its run directory (every check that can refuse a start runs",
        "before the directory is touched).",
        "",
        "Generated by `tests/cli/bad_inputs.py` (`PYTHONPATH=src:tests python tests/cli/bad_inputs.py --write",
        "docs/bad-inputs.md`), which runs them; `tests/cli/test_bad_inputs.py` checks every case and that",
        "this table is current. Paths are relative to the scratch directory the cases run in; `PID`,",
        "`HOST`, `TIME`, `PORT`, `N` and `MEM` (the host's memory) stand for the values of the run.",
        "",
        "## Exit status by cause",
        "",
        "What `olmax` ends with (`olmax.errors`, decided by `olmax.reporting.exit_code`) and what the",
        "jobs `olmax launch` writes do next. `tests/cli/test_exit_status.py` runs one real `olmax`",
        "process for each row it can trigger cheaply and names the test that covers each of the others.",
        "",
        "| cause | exit | constant | the launcher |",
        "|---|---|---|---|",
        *[f"| {_cell(x.cause)} | {x.status} | `{x.name}` | {_cell(x.launcher)} |" for x in exit_statuses()],
        "",
        "## The mistakes",
        "",
        f"**{len(rows)} mistakes tried, {clean} end in one clean line.**",
        "",
        "| # | area | mistake | command | exit | what olmax prints |",
        "|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rows, 1):
        shown = r["output"] if r["clean"] else f"NOT CLEAN ({r['lines']} lines): {r['output']}"
        out.append(f"| {i} | {r['group']} | {_cell(r['mistake'])} | `{_cell(r['command'])}` | {r['rc']} | "
                   f"{_cell(shown)} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", metavar="MD", help="write the markdown table here")
    ap.add_argument("--json", metavar="OUT", help="write the raw results here")
    ap.add_argument("-k", default=None, help="only cases whose mistake or command contains this")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ.pop("OLMAX_DEBUG", None)
    here = os.getcwd()
    with tempfile.TemporaryDirectory(prefix="olmax-bad-inputs-") as d:
        sel = (lambda c: args.k in c.mistake or args.k in " ".join(c.argv)) if args.k else (lambda c: True)
        rows = run_all(Path(d), sel)
        os.chdir(here)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    if args.write:
        Path(args.write).parent.mkdir(parents=True, exist_ok=True)
        Path(args.write).write_text(markdown(rows))
    bad = [r for r in rows if not r["clean"]]
    for r in bad:
        print(f"NOT CLEAN: {r['command']}  (rc {r['rc']}, {r['lines']} lines)\n    "
              + r["stderr"].strip().replace("\n", "\n    ")[-1500:], file=sys.stderr)
    print(f"{len(rows)} cases, {len(rows) - len(bad)} clean", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
