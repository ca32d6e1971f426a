"""OLMo-core (torch, CPU) and olmax (JAX, CPU) training the same OLMo 3 shape, side by side.

One script, one process, one run. Every leg trains the same shape, batch, sequence and windows
(``benchmarks/shapes.py``: ``d768``, ``A``, ``B``): OLMo 3 blocks (reordered post-norm, full-width
QK-norm, SwiGLU, RoPE 5e5), fp32 parameters and AdamW state (olmax: its SkipStep AdamW), z-loss
1e-5, clip 1.0, synthetic tokens (one fixed batch, so every leg's loss falls step by step).

Legs: OLMo-core per ``--oc-dtypes`` (``float32``; ``bfloat16`` = the model under
``torch.autocast("cpu", bfloat16)``, OLMo-core's ``autocast_precision``, fp32 weights and AdamW), and
olmax per ``--olmax`` x ``--dtype`` (``train.compute_dtype``; fp32 master weights either way).
A training step is forward + backward + gradient clipping + optimizer update. After compilation
and ``--warmup`` untimed steps each, the timed steps are *interleaved* (leg 1, leg 2, ..., leg 1,
...) so that every leg sees the same load on a shared machine. Reported per leg: the median step
time, tokens/s, the ratio to the first leg per round (then the median, robust to load drifting),
the loss after each step (``--check-steps``: after that many steps the olmax legs' losses are
compared across dtypes) and, with ``--memory``, the peak resident memory of a process that runs
that leg alone (compilation and two steps; ``ru_maxrss``).

``--olmax-tree NAME=SRC`` (repeatable) adds olmax legs that run another version of olmax: the
trainer's step of the shape's recipe (``benchmarks/shapes/A.yaml``, ``B.yaml``) in a worker process
whose ``PYTHONPATH`` starts with SRC (e.g. ``src/`` of a ``git worktree`` of an earlier revision),
interleaved with the others (``olmax.perf.abtest``). Two trees and ``--no-olmo-core`` measure a code
change before and after in one run.

    python benchmarks/cpu_side_by_side.py [--shape A] [--rounds 5] [--dtype float32,bfloat16]
        [--oc-dtypes float32,bfloat16] [--memory] [--json benchmarks/results/cpu_side_by_side_A.json]
    git worktree add /tmp/base BASE_REV
    python benchmarks/cpu_side_by_side.py --shape B --no-olmo-core --olmax '' --dtype bfloat16 \
        --olmax-tree before=/tmp/base/src --olmax-tree after=src
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

from olmax.io import write_json_atomic

from shapes import SHAPES, model_overrides


def _shape_args(a) -> dict:
    s = dict(SHAPES[a.shape])
    for k in ("batch", "seq", "window"):
        if getattr(a, k) is not None:
            s[k] = getattr(a, k)
    return s


class OlmoCoreStep:
    """OLMo-core's model (attn_backend=torch) with torch AdamW; one step per ``run()``."""

    def __init__(self, a, dtype: str = "float32"):
        import warnings

        import torch
        from olmo_core.nn.attention import AttentionBackendName, SlidingWindowAttentionConfig
        from olmo_core.nn.transformer import TransformerBlockType, TransformerConfig

        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        s = _shape_args(a)
        w = s["window"]
        sliding = SlidingWindowAttentionConfig(pattern=[w, w, w, -1], force_full_attention_on_first_layer=False,
                                               force_full_attention_on_last_layer=True)
        if a.shape == "d768":
            cfg = TransformerConfig.olmo3_190M(vocab_size=s["vocab"], n_layers=s["n_layers"],
                                               attn_backend=AttentionBackendName.torch, sliding_window=sliding)
        else:   # OLMo 3 blocks at the shape's widths; llama_like's MLP is 8d/3 rounded up to 256
            cfg = TransformerConfig.llama_like(
                d_model=s["d_model"], vocab_size=s["vocab"], n_layers=s["n_layers"], n_heads=s["n_heads"],
                qk_norm=True, block_name=TransformerBlockType.reordered_norm, layer_norm_eps=1e-6,
                rope_theta=500_000, attn_backend=AttentionBackendName.torch, sliding_window=sliding)
        self.model = cfg.build(init_device="cpu")
        self.model.init_weights(device=torch.device("cpu"))
        self.n_params = sum(p.numel() for p in self.model.parameters())
        if a.oc_compile:
            self.model = torch.compile(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                                     weight_decay=0.1, foreach=True)
        gen = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, min(100278, s["vocab"]), (s["batch"], s["seq"]), generator=gen)
        # olmo_core.data.utils.get_labels: shift left, last position ignored
        self.labels = torch.cat([self.tokens[:, 1:], torch.full((s["batch"], 1), -100)], dim=1)
        self.torch = torch
        self.autocast = dtype == "bfloat16"
        self.name = ("OLMo-core" + (" (torch.compile)" if a.oc_compile else " (eager)") +
                     (", bf16 autocast" if self.autocast else ", float32"))
        self.version = f"ai2-olmo-core {version('ai2-olmo-core')}, torch {torch.__version__}"
        self.losses: list[float] = []
        t0 = time.perf_counter()
        self.run()
        self.first_s = time.perf_counter() - t0

    def run(self) -> float:
        torch = self.torch
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model(self.tokens, labels=self.labels, z_loss_multiplier=1e-5)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        dt = time.perf_counter() - t0
        self.loss = float(out.ce_loss)
        self.losses.append(self.loss)
        return dt


def olmax_run_config(a, attn: str, dtype: str):
    from olmax.config import OptimConfig, RunConfig, TrainConfig
    from olmax.model.presets import resolve_model

    s = _shape_args(a)
    w = s["window"]
    model = resolve_model({**model_overrides(a.shape), "window_pattern": [w, w, w, None]})
    return RunConfig(model=model, optim=OptimConfig(lr=3e-4), train=TrainConfig(
        seq_len=s["seq"], global_batch_size=s["batch"], compute_dtype=dtype, attn_impl=attn,
        remat=a.remat, z_loss_multiplier=1e-5))


class OlmaxStep:
    """The olmax trainer's compiled step (``olmax.perf.bench.TrainStepRunner``)."""

    def __init__(self, a, attn: str, dtype: str = "float32"):
        import jax

        from olmax.perf.bench import TrainStepRunner

        self.runner = TrainStepRunner(olmax_run_config(a, attn, dtype))
        self.n_params = sum(int(x.size) for x in jax.tree.leaves(self.runner.state.params))
        self.name = f"olmax (attn={attn}, {dtype}, remat={a.remat})"
        self.version = f"olmax, jax {jax.__version__}"
        ma = self.runner.compiled.memory_analysis()
        self.compiled_temp_bytes = int(ma.temp_size_in_bytes)
        self.losses: list[float] = []
        self.first_s = self.runner.compile_s + self.run()

    def run(self) -> float:
        dt = self.runner.run()
        self.loss = float(self.runner.metrics["loss"])
        self.losses.append(self.loss)
        return dt


class OlmaxPlainStep:
    """Ablation, not the trainer: olmax's model with full (not chunked, not recomputed) fp32 logits,
    cross-entropy + z-loss, and plain optax clip + AdamW -- what the trainer's step would cost
    without the fused chunked loss and the skip-step bookkeeping."""

    def __init__(self, a, attn: str, dtype: str = "float32"):
        import jax
        import jax.numpy as jnp
        import numpy as np
        import optax

        from olmax.model import forward, init_params
        from olmax.model.runtime import Runtime

        cfg = olmax_run_config(a, attn, dtype)
        model = cfg.model
        s = _shape_args(a)
        tx = optax.chain(optax.clip_by_global_norm(1.0),
                         optax.adamw(3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1))
        params = init_params(model, jax.random.key(0))
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.vocab_size, (s["batch"], s["seq"])),
                             jnp.int32)

        def loss_fn(p):
            logits = forward(p, tokens, model, Runtime(dtype, attn))[:, :-1]
            lse = jax.nn.logsumexp(logits, axis=-1)
            target = jnp.take_along_axis(logits, tokens[:, 1:, None], axis=-1)[..., 0]
            return jnp.mean(lse - target) + 1e-5 * jnp.mean(jnp.square(lse))

        def step(p, opt_state):
            loss, g = jax.value_and_grad(loss_fn)(p)
            updates, opt_state = tx.update(g, opt_state, p)
            return optax.apply_updates(p, updates), opt_state, loss

        self.state = (params, tx.init(params))
        t0 = time.perf_counter()
        self.step = jax.jit(step, donate_argnums=(0, 1)).lower(*self.state).compile()
        compile_s = time.perf_counter() - t0
        self.compiled_temp_bytes = int(self.step.memory_analysis().temp_size_in_bytes)
        self.n_params = sum(int(x.size) for x in jax.tree.leaves(params))
        self.name = f"olmax model, plain step (full logits, optax AdamW; attn={attn}, {dtype}) [ablation]"
        self.version = f"olmax, jax {jax.__version__}"
        self.losses: list[float] = []
        self.first_s = compile_s + self.run()

    def run(self) -> float:
        import jax

        t0 = time.perf_counter()
        p, o, loss = self.step(*self.state)
        jax.block_until_ready(loss)
        dt = time.perf_counter() - t0
        self.state, self.loss = (p, o), float(loss)
        self.losses.append(self.loss)
        return dt


class OlmaxTreeStep:
    """The trainer's step of another olmax source tree, in a worker process (``olmax.perf.abtest``)."""

    def __init__(self, a, tree: str, attn: str, dtype: str):
        from olmax.perf.abtest import Leg, Worker

        name, src = tree, dict(t.split("=", 1) for t in a.olmax_tree)[tree]
        recipe = Path(__file__).resolve().parent / "shapes" / f"{a.shape}.yaml"
        if not recipe.is_file():
            raise SystemExit(f"--olmax-tree: shape {a.shape} has no recipe {recipe}")
        s = _shape_args(a)
        w = s["window"]
        overrides = [f"train.compute_dtype={dtype}", f"train.attn_impl={attn}", f"train.remat={a.remat}",
                     f"train.seq_len={s['seq']}", f"train.global_batch_size={s['batch']}",
                     f"model.window_pattern=[{w},{w},{w},null]"]
        pythonpath = os.pathsep.join(x for x in (os.path.abspath(src), os.environ.get("PYTHONPATH")) if x)
        self.worker = Worker(Leg(f"olmax@{name}", str(recipe), overrides, {"PYTHONPATH": pythonpath}))
        self.name = f"olmax@{name} (attn={attn}, {dtype}, remat={a.remat})"
        self.version = f"olmax from {src}, jax {self.worker.jax_version}"
        self.n_params = None
        self.losses: list[float] = []
        self.first_s = self.worker.compile_s + self.run()

    def run(self) -> float:
        dt = self.worker.step()
        self.loss = self.worker.losses[-1]
        self.losses.append(self.loss)
        return dt


def leg_specs(a) -> list[str]:
    """``oc:DTYPE``, ``olmax:ATTN[:plain]:DTYPE`` and ``tree:NAME:ATTN:DTYPE`` in run order."""
    specs = [] if a.no_olmo_core else [f"oc:{d}" for d in a.oc_dtypes.split(",")]
    for impl in filter(None, a.olmax.split(",")):
        for d in a.dtype.split(","):
            specs.append(f"olmax:{impl}:{d}")
    for tree in a.olmax_tree:
        for d in a.dtype.split(","):
            specs.append(f"tree:{tree.split('=', 1)[0]}:{a.tree_attn}:{d}")
    return specs


def build_leg(a, spec: str):
    parts = spec.split(":")
    if parts[0] == "oc":
        return OlmoCoreStep(a, parts[1])
    if parts[0] == "tree":
        return OlmaxTreeStep(a, parts[1], parts[2], parts[3])
    impl, dtype = parts[1], parts[-1]
    return (OlmaxPlainStep if "plain" in parts[2:-1] else OlmaxStep)(a, impl, dtype)


def leg_memory(a, spec: str) -> dict:
    """Peak RSS of a fresh process that builds ``spec`` alone and runs two steps."""
    cmd = [sys.executable, __file__, "--shape", a.shape, "--remat", a.remat, "--only", spec,
           "--host-malloc", a.host_malloc, *[f"--olmax-tree={t}" for t in a.olmax_tree]]
    for k in ("batch", "seq", "window"):
        if getattr(a, k) is not None:
            cmd += [f"--{k}", str(getattr(a, k))]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate()
    if proc.returncode:
        return {"error": (err or out).strip().splitlines()[-1:]}
    return json.loads(out.strip().splitlines()[-1])


def only(a) -> int:
    """``--only SPEC``: build one leg, two steps, print its peak RSS (JSON) -- for ``--memory``."""
    leg = build_leg(a, a.only)
    leg.run()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"peak_rss_bytes": rss, "compiled_temp_bytes": getattr(leg, "compiled_temp_bytes", None)}))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="d768", choices=sorted(SHAPES))
    p.add_argument("--seq", type=int, default=None, help="override the shape's sequence length")
    p.add_argument("--window", type=int, default=None, help="override the shape's sliding window")
    p.add_argument("--batch", type=int, default=None, help="override the shape's batch")
    p.add_argument("--rounds", type=int, default=5, help="timed steps per leg (interleaved)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the first")
    p.add_argument("--olmax", default="chunked",
                   help="olmax runs: comma list of ATTN (the trainer's step) or ATTN:plain (ablation)")
    p.add_argument("--dtype", default="float32", help="olmax compute dtypes (comma list)")
    p.add_argument("--oc-dtypes", default="float32",
                   help="OLMo-core legs (comma list): float32, bfloat16 (torch.autocast)")
    p.add_argument("--olmax-tree", action="append", default=[], metavar="NAME=SRC",
                   help="olmax legs from another source tree (repeatable; see the module docstring)")
    p.add_argument("--tree-attn", default="chunked", help="attention of the --olmax-tree legs")
    p.add_argument("--no-olmo-core", action="store_true",
                   help="olmax runs only; ratios are then against the first one")
    p.add_argument("--remat", default="none")
    p.add_argument("--oc-compile", action="store_true", help="torch.compile the OLMo-core model")
    p.add_argument("--check-steps", type=int, default=8,
                   help="compare the olmax legs' losses across dtypes after this many steps")
    p.add_argument("--memory", action="store_true",
                   help="also measure each leg's peak RSS, each in a process of its own")
    p.add_argument("--host-malloc", choices=("system", "keep"), default="system",
                   help="keep: this process (every leg, OLMo-core's too) keeps large host blocks "
                        "mapped between steps, as the olmax command does with "
                        "OLMAX_HOST_MALLOC=keep (olmax.host_memory); system: glibc's defaults")
    p.add_argument("--only", help=argparse.SUPPRESS)
    p.add_argument("--json", dest="json_out")
    a = p.parse_args()
    apply_host_malloc(a.host_malloc)
    if a.only:
        return only(a)

    specs = leg_specs(a)
    memory = {spec: leg_memory(a, spec) for spec in specs} if a.memory else {}
    for spec, m in memory.items():
        print(f"memory {spec}: {m}", file=sys.stderr, flush=True)
    runners = [build_leg(a, spec) for spec in specs]
    for r in runners:
        for _ in range(a.warmup):
            r.run()
        print(f"ready: {r.name} (first step incl. compile {r.first_s:.1f} s)", file=sys.stderr, flush=True)
    times: list[list[float]] = [[] for _ in runners]
    load = []
    for i in range(a.rounds):
        for j, r in enumerate(runners):
            times[j].append(r.run())
        load.append(os.getloadavg()[0])
        print(f"round {i + 1}: " + ", ".join(f"{t[-1]:.2f}s" for t in times), file=sys.stderr, flush=True)
        write_json(a.json_out, {"args": vars(a), "loadavg": load, "partial_times": times,
                                 "frameworks": [r.name for r in runners]})

    for r in runners:          # worker legs report their peak resident memory as they stop
        if hasattr(r, "worker"):
            r.worker.close()
    s = _shape_args(a)
    tokens = s["batch"] * s["seq"]
    rows = []
    for j, (spec, r) in enumerate(zip(specs, runners)):
        per_round = [first / mine for first, mine in zip(times[0], times[j])]
        m = memory.get(spec, {})
        if hasattr(r, "worker"):          # a worker leg's own peak RSS
            m = m or {"peak_rss_bytes": r.worker.peak_rss_bytes}
        rows.append({"leg": spec, "framework": r.name, "version": r.version, "n_params": r.n_params,
                     "step_s_median": statistics.median(times[j]), "step_s": times[j],
                     "tokens_per_s": tokens / statistics.median(times[j]),
                     "speedup_vs_first_row": statistics.median(per_round),
                     "speedup_per_round": per_round, "first_step_s": r.first_s, "loss": r.loss,
                     "losses": r.losses, "peak_rss_bytes": m.get("peak_rss_bytes"),
                     "compiled_temp_bytes": m.get("compiled_temp_bytes"),
                     "program_hash": r.worker.program_hash if hasattr(r, "worker") else None})
    k = a.check_steps
    olmax_rows = [r for r in rows if r["leg"].startswith("olmax") and len(r["losses"]) >= k]
    loss_check = None
    if k and len(olmax_rows) > 1:
        ref = olmax_rows[0]["losses"][k - 1]
        loss_check = {r["framework"]: {"loss": r["losses"][k - 1], "rel_diff_vs_first": abs(r["losses"][k - 1] - ref) / abs(ref)}
                      for r in olmax_rows}
    print(f"\nshape {a.shape}: {SHAPES[a.shape]['label']}; batch {s['batch']} x seq {s['seq']}, windows "
          f"[{s['window']}]*3+[full]; {os.cpu_count()} CPUs; {a.rounds} interleaved rounds; "
          f"1-min load avg during rounds {min(load):.1f}-{max(load):.1f}\n")
    print("| leg | params | step s (median) | tokens/s | speed vs first row (median of rounds) | "
          "peak RSS alone | loss after all steps |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        mem = f"{r['peak_rss_bytes'] / 2**30:.2f} GiB" if r["peak_rss_bytes"] else "-"
        params = "-" if r["n_params"] is None else f"{r['n_params'] / 1e6:.1f}M"
        print(f"| {r['framework']} | {params} | {r['step_s_median']:.2f} | "
              f"{r['tokens_per_s']:.0f} | {r['speedup_vs_first_row']:.2f}x | {mem} | {r['loss']:.4f} |")
    hashes = {r["framework"]: r["program_hash"] for r in rows if r["program_hash"]}
    if hashes:
        print("\ncompiled programs (olmax.perf.abtest.program_hash): "
              + "; ".join(f"{n}: {h}" for n, h in hashes.items()))
    if loss_check:
        print(f"\nloss after {k} steps: " + "; ".join(f"{n}: {v['loss']:.5f} (rel. diff {v['rel_diff_vs_first']:.1e})"
                                                  for n, v in loss_check.items()))
    write_json(a.json_out, {"args": vars(a), "shape": s, "loadavg": load, "rows": rows,
                            "loss_check_after_steps": k, "loss_check": loss_check})
    return 0


def apply_host_malloc(choice: str) -> bool:
    """``--host-malloc keep``: the olmax command's opt-in host allocator set-up for this process
    (every leg in it); ``system``: glibc's defaults."""
    from olmax.host_memory import ENV, keep_host_memory_mapped

    return keep_host_memory_mapped(dict(os.environ, **{ENV: choice}))


def write_json(path: str | None, data: dict) -> None:
    """Atomic JSON write (temp + rename); the side-by-side rewrites it after every round so that a
    killed run leaves its completed rounds."""
    if path:
        write_json_atomic(path, data)


if __name__ == "__main__":
    sys.exit(main())
