"""OLMo-core (torch, CPU) and olmax (JAX, CPU) training the same OLMo 3 shape, side by side.

One script, one process, one run. Both frameworks train the same shape, batch, sequence and windows:

    OLMo 3 block structure (reordered post-norm, full-width QK-norm, SwiGLU, RoPE 5e5), d_model 768,
    12 heads x 64, MLP 3072 (OLMo 3 190M widths), 4 layers, windows [W, W, W, full],
    dolma2 padded vocabulary 100352, fp32, AdamW (olmax: its SkipStep AdamW), z-loss 1e-5, clip 1.0.

A training step is forward + backward + gradient clipping + optimizer update. After compilation
and ``--warmup`` untimed steps each, the timed steps are *interleaved* (OLMo-core, olmax variant 1,
olmax variant 2, OLMo-core, ...) so that every framework sees the same load on a shared machine.
Reported per framework: the median step time, tokens/s, and the ratio to OLMo-core computed per
round (then the median), which is robust to load drifting during the run.

    python benchmarks/cpu_side_by_side.py [--seq 512 --window 128 --batch 1 --rounds 5]
        [--olmax xla,chunked] [--json benchmarks/results/cpu_side_by_side.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from importlib.metadata import version

from olmax.io import write_json_atomic

D_MODEL, N_HEADS, MLP, N_LAYERS, VOCAB = 768, 12, 3072, 4, 100352


class OlmoCoreStep:
    """OLMo-core's model (attn_backend=torch) with torch AdamW; one step per ``run()``."""

    def __init__(self, a):
        import warnings

        import torch
        from olmo_core.nn.attention import AttentionBackendName, SlidingWindowAttentionConfig
        from olmo_core.nn.transformer import TransformerConfig

        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        cfg = TransformerConfig.olmo3_190M(
            vocab_size=VOCAB, n_layers=N_LAYERS, attn_backend=AttentionBackendName.torch,
            sliding_window=SlidingWindowAttentionConfig(
                pattern=[a.window, a.window, a.window, -1], force_full_attention_on_first_layer=False,
                force_full_attention_on_last_layer=True))
        self.model = cfg.build(init_device="cpu")
        self.model.init_weights(device=torch.device("cpu"))
        self.n_params = sum(p.numel() for p in self.model.parameters())
        if a.oc_compile:
            self.model = torch.compile(self.model)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                                     weight_decay=0.1, foreach=True)
        gen = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, 100278, (a.batch, a.seq), generator=gen)
        # olmo_core.data.utils.get_labels: shift left, last position ignored
        self.labels = torch.cat([self.tokens[:, 1:], torch.full((a.batch, 1), -100)], dim=1)
        self.torch = torch
        self.name = "OLMo-core" + (" (torch.compile)" if a.oc_compile else " (eager)")
        self.version = f"ai2-olmo-core {version('ai2-olmo-core')}, torch {torch.__version__}"
        t0 = time.perf_counter()
        self.run()
        self.first_s = time.perf_counter() - t0

    def run(self) -> float:
        t0 = time.perf_counter()
        out = self.model(self.tokens, labels=self.labels, z_loss_multiplier=1e-5)
        out.loss.backward()
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.loss = float(out.ce_loss)
        return time.perf_counter() - t0


class OlmaxStep:
    """The olmax trainer's compiled step (``olmax.perf.bench.TrainStepRunner``)."""

    def __init__(self, a, attn: str):
        import jax

        from olmax.perf.bench import TrainStepRunner
        from olmax.config import RunConfig, TrainConfig
        from olmax.model.presets import resolve_model

        model = resolve_model({"preset": "olmo3-190m", "n_layers": N_LAYERS,
                               "window_pattern": [a.window, a.window, a.window, None]})
        cfg = RunConfig(model=model, train=TrainConfig(
            seq_len=a.seq, global_batch_size=a.batch, compute_dtype=a.dtype, attn_impl=attn,
            remat=a.remat))
        self.runner = TrainStepRunner(cfg)
        self.n_params = sum(int(x.size) for x in jax.tree.leaves(self.runner.state.params))
        self.name = f"olmax (attn={attn}, {a.dtype}, remat={a.remat})"
        self.version = f"olmax, jax {jax.__version__}"
        self.first_s = self.runner.compile_s + self.runner.run()

    def run(self) -> float:
        dt = self.runner.run()
        self.loss = float(self.runner.metrics["loss"])
        return dt


class OlmaxPlainStep:
    """Ablation, not the trainer: olmax's model with full (not chunked, not recomputed) fp32 logits,
    cross-entropy + z-loss, and plain optax clip + AdamW -- what the trainer's step would cost
    without the chunked-loss recompute and the skip-step bookkeeping."""

    def __init__(self, a, attn: str):
        import jax
        import jax.numpy as jnp
        import numpy as np
        import optax

        from olmax.model import forward, init_params
        from olmax.model.presets import resolve_model
        from olmax.model.runtime import Runtime

        model = resolve_model({"preset": "olmo3-190m", "n_layers": N_LAYERS,
                               "window_pattern": [a.window, a.window, a.window, None]})
        tx = optax.chain(optax.clip_by_global_norm(1.0),
                         optax.adamw(3e-4, b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1))
        params = init_params(model, jax.random.key(0))
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, model.vocab_size, (a.batch, a.seq)),
                             jnp.int32)

        def loss_fn(p):
            logits = forward(p, tokens, model, Runtime(attn_impl=attn))[:, :-1]
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
        self.n_params = sum(int(x.size) for x in jax.tree.leaves(params))
        self.name = f"olmax model, plain step (full logits, optax AdamW; attn={attn}) [ablation]"
        self.version = f"olmax, jax {jax.__version__}"
        self.first_s = compile_s + self.run()

    def run(self) -> float:
        import jax

        t0 = time.perf_counter()
        p, o, loss = self.step(*self.state)
        jax.block_until_ready(loss)
        self.state, self.loss = (p, o), float(loss)
        return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--window", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5, help="timed steps per framework (interleaved)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the first")
    p.add_argument("--olmax", default="chunked",
                   help="olmax runs: comma list of ATTN (the trainer's step) or ATTN:plain (ablation)")
    p.add_argument("--no-olmo-core", action="store_true",
                   help="olmax runs only; ratios are then against the first one")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--remat", default="none")
    p.add_argument("--oc-compile", action="store_true", help="torch.compile the OLMo-core model")
    p.add_argument("--json", dest="json_out")
    a = p.parse_args()

    runners = [] if a.no_olmo_core else [OlmoCoreStep(a)]
    for spec in a.olmax.split(","):
        impl, _, kind = spec.partition(":")
        runners.append((OlmaxPlainStep if kind == "plain" else OlmaxStep)(a, impl))
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

    tokens = a.batch * a.seq
    rows = []
    for j, r in enumerate(runners):
        per_round = [oc / mine for oc, mine in zip(times[0], times[j])]
        rows.append({"framework": r.name, "version": r.version, "n_params": r.n_params,
                     "step_s_median": statistics.median(times[j]), "step_s": times[j],
                     "tokens_per_s": tokens / statistics.median(times[j]),
                     "speedup_vs_first_row": statistics.median(per_round),
                     "first_step_s": r.first_s, "loss": r.loss})
    print(f"\nOLMo 3 shape: d_model {D_MODEL}, {N_HEADS}x64 heads, MLP {MLP}, {N_LAYERS} layers, windows "
          f"[{a.window}]*3+[full], vocab {VOCAB}; batch {a.batch} x seq {a.seq}; {os.cpu_count()} CPUs; "
          f"{a.rounds} interleaved rounds; 1-min load avg during rounds {min(load):.1f}-{max(load):.1f}\n")
    print("| framework | params | step s (median) | tokens/s | speed vs first row | first step incl. compile s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['framework']} | {r['n_params'] / 1e6:.1f}M | {r['step_s_median']:.2f} | "
              f"{r['tokens_per_s']:.0f} | {r['speedup_vs_first_row']:.2f}x | {r['first_step_s']:.1f} |")
    write_json(a.json_out, {"args": vars(a), "loadavg": load, "rows": rows})
    return 0


def write_json(path: str | None, data: dict) -> None:
    """Atomic JSON write (temp + rename); the side-by-side rewrites it after every round so that a
    killed run leaves its completed rounds."""
    if path:
        write_json_atomic(path, data)


if __name__ == "__main__":
    sys.exit(main())
