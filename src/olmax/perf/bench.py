"""Throughput benchmarks: the measured matmul ceiling and steady-state training steps.

``bench_train`` times the trainer's own step (``olmax.train.step.make_train_step``: chunked fused
loss, SkipStep AdamW, donated state) on synthetic tokens, on one device. It reports

- ``compile_s``: lowering + XLA compilation of the step (ahead of time, not in the timed steps);
- ``step_s``: the median of ``steps`` timed steps after ``warmup`` untimed ones (the median is
  robust to a noisy shared machine; ``step_s_mean``/``step_s_min`` are reported too);
- ``tokens_per_s`` = batch * seq_len / step_s (per device: one device is used);
- ``mfu_olmo_core`` / ``mfu_causal``: ``tokens_per_s * flops_per_token / peak`` in both
  conventions of :mod:`olmax.model.flops` (None where the device has no peak entry, e.g. CPU);
- ``pct_of_ceiling_*``: the same achieved FLOP/s against a measured matmul ceiling;
- ``peak_memory_bytes``: the device allocator's peak where it reports one (GPU/TPU), else the
  process's peak resident set (CPU; includes everything the process allocated).
"""

from __future__ import annotations

import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from olmax.config import RunConfig
from olmax.errors import ConfigError
from olmax.model.flops import flops_per_token, mfu, peak_flops
from olmax.model.params import count_params, init_params
from olmax.model.runtime import Runtime, dtype_of
from olmax.train.optim import build_optimizer
from olmax.train.state import init_train_state
from olmax.train.step import jit_train_step, make_train_step, num_micro_batches

def _sync(x: Any) -> Any:
    return jax.block_until_ready(x)


# ----------------------------------------------------------------------------------------------
# Matmul ceiling


def matmul_ceiling(size: int | None = None, dtype: str | None = None, iters: int = 10,
                   device: jax.Device | None = None) -> dict:
    """Best FLOP/s of a square ``size``^3 matmul (fp32 accumulation) on one device.

    Defaults: 8192 in bf16 on accelerators, 1024 in fp32 on CPU (bf16 CPU GEMMs are emulated)."""
    device = device or jax.devices()[0]
    cpu = device.platform == "cpu"
    size = size or (1024 if cpu else 8192)
    dtype = dtype or ("float32" if cpu else "bfloat16")
    a = jax.device_put(jax.random.normal(jax.random.key(0), (size, size), dtype_of(dtype)), device)
    b = jax.device_put(jax.random.normal(jax.random.key(1), (size, size), dtype_of(dtype)), device)
    mm = jax.jit(lambda x, y: jnp.matmul(x, y, preferred_element_type=jnp.float32).astype(x.dtype))
    _sync(mm(a, b))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        _sync(mm(a, b))
        times.append(time.perf_counter() - t0)
    best = min(times)
    flops = 2.0 * size ** 3
    return {"device": device.device_kind, "platform": device.platform, "size": size, "dtype": dtype,
            "best_s": best, "median_s": statistics.median(times), "flops_per_s": flops / best,
            "peak_flops": peak_flops(device)}


# ----------------------------------------------------------------------------------------------
# Training step


@dataclass
class TrainBench:
    device: str
    platform: str
    n_params: int
    batch: int
    seq_len: int
    compute_dtype: str
    profile: str
    attn_impl: str
    remat: str
    steps: int
    compile_s: float
    step_s: float
    step_s_mean: float
    step_s_min: float
    tokens_per_s: float
    flops_per_token_olmo_core: float
    flops_per_token_causal: float
    tflops_per_s_causal: float
    mfu_olmo_core: float | None
    mfu_causal: float | None
    ceiling_flops_per_s: float | None
    pct_of_ceiling_olmo_core: float | None
    pct_of_ceiling_causal: float | None
    peak_memory_bytes: int | None
    peak_memory_kind: str
    final_loss: float

    def to_dict(self) -> dict:
        return asdict(self)


def _peak_memory(device: jax.Device) -> tuple[int | None, str]:
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # some backends do not implement it
        pass
    if stats and "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device_peak"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "process_max_rss"


class TrainStepRunner:
    """The trainer's compiled step on synthetic tokens, one device; ``run()`` does one step and
    waits for it. ``compile_s`` is the ahead-of-time lowering + compilation time."""

    def __init__(self, cfg: RunConfig, seed: int = 0):
        model_cfg, train_cfg = cfg.model, cfg.train
        b, t = train_cfg.global_batch_size, train_cfg.seq_len
        tx = build_optimizer(cfg.optim)
        self.runtime = Runtime.of(train_cfg, jax.devices()[:1])
        step = make_train_step(model_cfg, train_cfg, tx, n_micro=num_micro_batches(train_cfg, 1),
                               runtime=self.runtime)
        self.state = init_train_state(init_params(model_cfg, jax.random.key(seed)), tx)
        rng = np.random.default_rng(seed)
        self.batch = {"tokens": jnp.asarray(rng.integers(0, model_cfg.vocab_size, (b, t)), jnp.int32),
                      "instance_mask": jnp.ones((b,), jnp.bool_)}
        self.lr = jnp.asarray(cfg.optim.lr, jnp.float32)
        t0 = time.perf_counter()
        self.compiled = jit_train_step(step).lower(self.state, self.batch, self.lr).compile()
        self.compile_s = time.perf_counter() - t0
        self.metrics: dict = {}

    def run(self) -> float:
        """One step; returns its wall time in seconds."""
        t0 = time.perf_counter()
        self.state, self.metrics = self.compiled(self.state, self.batch, self.lr)
        _sync((self.state, self.metrics))
        return time.perf_counter() - t0


def bench_train(cfg: RunConfig, steps: int = 5, warmup: int = 2, *,
                ceiling_flops: float | None = None, seed: int = 0, hlo_out: str | None = None,
                trace_dir: str | None = None) -> TrainBench:
    """Time ``steps`` training steps of ``cfg`` (model, train, optim sections) on one device.
    ``hlo_out``: also write the compiled step's optimized HLO text there (gzip if it ends in
    ``.gz``); ``trace_dir``: then profile 3 more steps with JAX's profiler into that folder (a
    Perfetto trace beside the XLA one)."""
    if steps < 1 or warmup < 0:
        raise ConfigError(f"--steps must be >= 1 and --warmup >= 0 (got {steps}, {warmup})")
    model_cfg, train_cfg = cfg.model, cfg.train
    device = jax.devices()[0]
    b, t = train_cfg.global_batch_size, train_cfg.seq_len
    runner = TrainStepRunner(cfg, seed)
    compile_s = runner.compile_s
    for _ in range(warmup):
        runner.run()
    times = [runner.run() for _ in range(steps)]
    metrics = runner.metrics
    if hlo_out:
        _write_text(hlo_out, runner.compiled.as_text())
    if trace_dir:
        with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
            for _ in range(3):
                runner.run()

    step_s = statistics.median(times)
    tps = b * t / step_s
    f_oc = flops_per_token(model_cfg, t, "olmo_core")
    f_c = flops_per_token(model_cfg, t, "causal")
    peak = peak_flops(device)
    mem, mem_kind = _peak_memory(device)
    ratio = (lambda f: tps * f / ceiling_flops) if ceiling_flops else (lambda f: None)
    return TrainBench(
        device=device.device_kind, platform=device.platform, n_params=count_params(model_cfg),
        batch=b, seq_len=t, compute_dtype=train_cfg.compute_dtype,
        profile=runner.runtime.profile_name, attn_impl=runner.runtime.attn_impl,
        remat=train_cfg.remat, steps=steps, compile_s=compile_s, step_s=step_s,
        step_s_mean=statistics.fmean(times), step_s_min=min(times), tokens_per_s=tps,
        flops_per_token_olmo_core=f_oc, flops_per_token_causal=f_c,
        tflops_per_s_causal=tps * f_c / 1e12,
        mfu_olmo_core=mfu(tps, model_cfg, t, peak, "olmo_core"),
        mfu_causal=mfu(tps, model_cfg, t, peak, "causal"),
        ceiling_flops_per_s=ceiling_flops,
        pct_of_ceiling_olmo_core=ratio(f_oc), pct_of_ceiling_causal=ratio(f_c),
        peak_memory_bytes=mem, peak_memory_kind=mem_kind, final_loss=float(metrics["loss"]))


def _write_text(path: str, text: str) -> None:
    import gzip

    from olmax.io import write_bytes_atomic

    data = text.encode()
    write_bytes_atomic(path, gzip.compress(data) if path.endswith(".gz") else data)


def format_train(r: TrainBench) -> str:
    """Human-readable summary of one training benchmark."""
    pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    lines = [
        f"device            {r.device} ({r.platform})",
        f"model             {r.n_params / 1e6:.1f}M params, batch {r.batch} x seq {r.seq_len}, "
        f"{r.compute_dtype}, profile={r.profile}, attn={r.attn_impl}, remat={r.remat}",
        f"compile           {r.compile_s:.2f} s",
        f"step (median)     {r.step_s * 1e3:.1f} ms  (mean {r.step_s_mean * 1e3:.1f}, "
        f"min {r.step_s_min * 1e3:.1f}; {r.steps} steps)",
        f"tokens/s          {r.tokens_per_s:,.0f}",
        f"model TFLOP/s     {r.tflops_per_s_causal:.3f} (causal)",
        f"MFU               {pct(r.mfu_olmo_core)} (OLMo-core convention), {pct(r.mfu_causal)} (causal)",
        f"% of ceiling      {pct(r.pct_of_ceiling_olmo_core)} (OLMo-core), "
        f"{pct(r.pct_of_ceiling_causal)} (causal)",
        f"peak memory       {'n/a' if r.peak_memory_bytes is None else f'{r.peak_memory_bytes / 2**30:.2f} GiB'}"
        f" ({r.peak_memory_kind})",
        f"loss (last step)  {r.final_loss:.4f}",
    ]
    return "\n".join(lines)
