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
- ``peak_memory_bytes``: the step's peak per device from the compiled program (XLA's memory
  analysis: the buffer assignment's peak on TPU/GPU; on the CPU, which reports none, arguments +
  outputs + temporaries), against ``memory_limit_bytes`` (what the step was fitted to); beside it
  ``device_peak_bytes``, the runtime's own counter where it keeps one (the device allocator's
  ``peak_bytes_in_use``; the process's peak resident set on the CPU), labelled in
  ``device_peak_kind``; None where an earlier step of the same process had peaked higher (the
  counter never goes down);
- ``micro_batch_size``, ``remat``: the step's, ``auto`` ones as chosen (``fit_trials``: each
  candidate compiled, its peak, whether it fit and its estimated step time where priced;
  ``fit_chosen_by``: ``estimate`` where the least estimated step time chose, else ``memory``).
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

from olmax.config import MeshConfig, RunConfig
from olmax.device_memory import DoesNotFit, gib, raising_does_not_fit
from olmax.errors import ConfigError
from olmax.model.flops import flops_per_token, mfu, peak_flops
from olmax.model.params import count_params
from olmax.model.runtime import dtype_of
from olmax.parallel.mesh import make_mesh
from olmax.perf.step_price import step_pricer
from olmax.train.fit import fit_step, memory_hints
from olmax.train.optim import build_optimizer
from olmax.train.step import abstract_batch

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
    micro_batch_size: int
    auto: list
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
    memory_limit_bytes: int | None
    memory_limit_source: str
    device_peak_bytes: int | None
    device_peak_kind: str
    fit_trials: list
    final_loss: float
    # instructions of the step the compiler recomputes to fit (None: not read; see
    # olmax.device_memory.compiler_remat_ops)
    compiler_remat_ops: int | None = None
    fit_chosen_by: str = "memory"

    def to_dict(self) -> dict:
        return asdict(self)


# What ``peak_memory_bytes`` is: the compiled step's own peak per device.
PEAK_KIND = "compiled step (XLA's buffer assignment: peak of live buffers)"
PEAK_KIND_CPU = "compiled step (XLA CPU reports no peak: arguments + outputs + temporaries)"


def _device_peak(device: jax.Device) -> tuple[int | None, str]:
    """The runtime's own peak counter, labelled: the device allocator's ``peak_bytes_in_use``
    where it keeps one (it counts the buffers it allocated, which on TPU need not include a
    program's temporaries), else the process's peak resident set (CPU: everything the process
    allocated, the Python heap and the compiler's included)."""
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # some backends do not implement it
        pass
    if stats and "peak_bytes_in_use" in stats:
        return int(stats["peak_bytes_in_use"]), "device allocator's peak_bytes_in_use (runtime counter)"
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024), "process max RSS (host)"


def row_peak(before: int | None, after: int | None, kind: str) -> tuple[int | None, str]:
    """The runtime's peak counter as one row's figure: it counts since the process started, so
    a row that did not raise it (an earlier row of the same process peaked higher) has no
    figure of its own, and says so."""
    if after is None:
        return None, kind
    if before and after <= before:
        return None, (f"not observable: {kind} kept an earlier, larger peak of this process "
                      f"({gib(before)})")
    return after, kind


class TrainStepRunner:
    """The trainer's compiled step on synthetic tokens, one device; ``run()`` does one step and
    waits for it. The step is the trainer's own (:func:`olmax.train.step.build_sharded_training`
    on a mesh of one device), compiled ahead of time and fitted to the device's memory as the
    trainer fits it (:func:`olmax.train.fit.fit_step`: ``auto`` settings chosen, a step that does
    not fit refused in one line); ``compile_s`` is the lowering + compilation of the step it runs,
    ``fit`` what was chosen and its compiled peak."""

    def __init__(self, cfg: RunConfig, seed: int = 0, *, share: "TrainStepRunner | None" = None):
        """``share``: another runner of the same model and batch shape whose state and batch this
        one steps (its own compiled step, no second copy of the state on the device: how two
        programs of one model are timed side by side on a device that holds one state)."""
        model_cfg, train_cfg = cfg.model, cfg.train
        b, t = train_cfg.global_batch_size, train_cfg.seq_len
        tx = build_optimizer(cfg.optim)
        device = jax.devices()[0]
        mesh = make_mesh(MeshConfig(), [device])
        where = f"the training step (1 x {device.device_kind}, batch {b} x {t})"
        t0 = time.perf_counter()
        self.fit = fit_step(model_cfg, train_cfg, tx, mesh, jax.random.key(seed),
                            lambda st: abstract_batch(st, b, t), where=where,
                            price=step_pricer(mesh))
        self.compile_s = time.perf_counter() - t0
        if len(self.fit.trials) > 1:   # the search compiled others too: the step's own compile alone
            self.compile_s /= len(self.fit.trials)
        st = self.fit.training
        assert st is not None
        self.runtime, self.compiled, self.n_micro = st.runtime, self.fit.compiled, st.n_micro
        self.lr = jnp.asarray(cfg.optim.lr, jnp.float32)
        self.metrics: dict = {}
        self._where = where
        self._hints = memory_hints(train_cfg, self.fit.micro_batch_size, self.fit.remat)
        self._share = share
        if share is not None:
            return
        self.state = st.fresh_state(None)      # init_params from the seed's key, on the device
        rng = np.random.default_rng(seed)
        tokens = jnp.asarray(rng.integers(0, model_cfg.vocab_size, (b, t)), jnp.int32)
        self.batch = {"tokens": jax.device_put(tokens, st.batch_shardings["tokens"]),
                      "instance_mask": jax.device_put(jnp.ones((b,), jnp.bool_),
                                                      st.batch_shardings["instance_mask"])}

    def run(self) -> float:
        """One step; returns its wall time in seconds. Out of device memory while running (what
        the compiled program's analysis did not foresee): :class:`DoesNotFit`."""
        owner = self._share or self
        t0 = time.perf_counter()
        with raising_does_not_fit(self._where, self._hints):
            owner.state, self.metrics = self.compiled(owner.state, owner.batch, self.lr)
            _sync((owner.state, self.metrics))
        return time.perf_counter() - t0


def interleave_steps(cfgs: dict[str, RunConfig], rounds: int = 6, warmup: int = 1,
                     seed: int = 0, compile_budget_s: float | None = None) -> dict:
    """A/B of training steps in this process, on one device: every leg's step compiled (the first
    leg's state and batch on the device, the others stepping that same state: one copy of it,
    however many programs), ``warmup`` steps of each, then ``rounds`` rounds of one step of
    each leg in turn. Per leg: its settings, compile, every step's seconds, the median; per round,
    each leg's time over the first leg's, and the median of those ratios (robust to the machine
    drifting). The legs must share the model and the batch shape (what the state is); a leg after
    the first that does not fit the device is reported (``error``) and left out.

    ``compile_budget_s``: the legs after the first are compiled in order while the time since the
    start, plus the longest compile so far, stays within it; the rest are reported as not
    compiled and left out, and the compiled ones are measured (a command under a time limit
    then keeps what it compiled, where one killed at its limit keeps nothing)."""
    names = list(cfgs)
    shape = lambda c: (c.model, c.train.global_batch_size, c.train.seq_len)  # noqa: E731
    for n in names[1:]:                   # refused before anything compiles
        if shape(cfgs[n]) != shape(cfgs[names[0]]):
            raise ConfigError(f"A/B leg {n!r}: its model or batch shape differs from {names[0]!r}'s")
    start = time.perf_counter()
    first = TrainStepRunner(cfgs[names[0]], seed)
    runners = {names[0]: first}
    refused: dict[str, str] = {}
    longest = time.perf_counter() - start
    for n in names[1:]:
        c = cfgs[n]
        spent = time.perf_counter() - start
        if compile_budget_s is not None and spent + longest > compile_budget_s:
            refused[n] = (f"not compiled: {spent:.0f} s spent and a compile takes up to "
                          f"{longest:.0f} s, over the compile budget of {compile_budget_s:g} s")
            continue
        began = time.perf_counter()
        try:
            runners[n] = TrainStepRunner(c, seed, share=first)
        except DoesNotFit as e:          # a leg that does not fit is reported, the others run
            refused[n] = str(e)
        longest = max(longest, time.perf_counter() - began)
    names = [n for n in names if n not in refused]
    for _ in range(warmup):
        for r in runners.values():
            r.run()
    times: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(rounds):
        for n in names:
            times[n].append(runners[n].run())
    out = {}
    for n in names:
        r = runners[n]
        ratios = [t / t0 for t, t0 in zip(times[n], times[names[0]])]
        out[n] = {"micro_batch_size": r.fit.micro_batch_size, "remat": r.fit.remat,
                  "peak_bytes": r.fit.peak_bytes, "compile_s": r.compile_s, "steps_s": times[n],
                  "step_s": statistics.median(times[n]), "ratio_to_first": statistics.median(ratios),
                  "loss": float(r.metrics["loss"]) if "loss" in r.metrics else None}
    out.update({n: {"error": why} for n, why in refused.items()})
    return out


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
    counted_before, _ = _device_peak(device)
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
    counter, counter_kind = row_peak(counted_before, *_device_peak(device))
    fit = runner.fit
    ratio = (lambda f: tps * f / ceiling_flops) if ceiling_flops else (lambda f: None)
    return TrainBench(
        device=device.device_kind, platform=device.platform, n_params=count_params(model_cfg),
        batch=b, seq_len=t, compute_dtype=train_cfg.compute_dtype,
        profile=runner.runtime.profile_name, attn_impl=runner.runtime.attn_impl,
        remat=fit.remat, micro_batch_size=fit.micro_batch_size, auto=list(fit.auto),
        steps=steps, compile_s=compile_s, step_s=step_s,
        step_s_mean=statistics.fmean(times), step_s_min=min(times), tokens_per_s=tps,
        flops_per_token_olmo_core=f_oc, flops_per_token_causal=f_c,
        tflops_per_s_causal=tps * f_c / 1e12,
        mfu_olmo_core=mfu(tps, model_cfg, t, peak, "olmo_core"),
        mfu_causal=mfu(tps, model_cfg, t, peak, "causal"),
        ceiling_flops_per_s=ceiling_flops,
        pct_of_ceiling_olmo_core=ratio(f_oc), pct_of_ceiling_causal=ratio(f_c),
        peak_memory_bytes=fit.peak_bytes,
        peak_memory_kind=PEAK_KIND_CPU if device.platform == "cpu" else PEAK_KIND,
        memory_limit_bytes=fit.limit_bytes, memory_limit_source=fit.limit_source,
        device_peak_bytes=counter, device_peak_kind=counter_kind,
        fit_trials=[tr.to_dict() for tr in fit.trials], fit_chosen_by=fit.chosen_by,
        final_loss=float(metrics["loss"]),
        compiler_remat_ops=fit.compiler_remat_ops)


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
        f"micro-batch {r.micro_batch_size}, {r.compute_dtype}, profile={r.profile}, "
        f"attn={r.attn_impl}, remat={r.remat}" + (f" ({', '.join(r.auto)} auto)" if r.auto else ""),
        f"compile           {r.compile_s:.2f} s",
        f"step (median)     {r.step_s * 1e3:.1f} ms  (mean {r.step_s_mean * 1e3:.1f}, "
        f"min {r.step_s_min * 1e3:.1f}; {r.steps} steps)",
        f"tokens/s          {r.tokens_per_s:,.0f}",
        f"model TFLOP/s     {r.tflops_per_s_causal:.3f} (causal)",
        f"MFU               {pct(r.mfu_olmo_core)} (OLMo-core convention), {pct(r.mfu_causal)} (causal)",
        f"% of ceiling      {pct(r.pct_of_ceiling_olmo_core)} (OLMo-core), "
        f"{pct(r.pct_of_ceiling_causal)} (causal)",
        f"peak memory       {gib(r.peak_memory_bytes)} of {gib(r.memory_limit_bytes)} "
        f"({r.memory_limit_source}): {r.peak_memory_kind}",
        f"device counter    {gib(r.device_peak_bytes)} ({r.device_peak_kind})",
        *([f"recomputed        {r.compiler_remat_ops} instructions recomputed by the compiler to fit "
           "(XLA's rematerialization: the step runs slower than its FLOPs say)"]
          if r.compiler_remat_ops else []),
        f"loss (last step)  {r.final_loss:.4f}",
    ]
    return "\n".join(lines)
