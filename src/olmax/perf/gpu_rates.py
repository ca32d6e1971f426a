"""Measured rates of one GPU or TPU, the table that the kernel-by-kernel step-time estimate reads
(:mod:`olmax.perf.gpu_estimate`): ``olmax bench matmul --table OUT`` writes it.

- ``gemm``: bf16 matrix products (fp32 accumulation) on a grid of shapes ``m x k @ k x n``, each
  timed as ``calls`` back-to-back launches of the compiled product with one wait at the end (the
  launches are queued asynchronously, so a product longer than the host's dispatch is timed by the
  GPU); the median of ``repeats`` such runs. A product shorter than :data:`DISPATCH_BOUND_S` is
  marked ``dispatch_bound`` (its rate is a lower bound).
- ``attention``: cuDNN's fused attention (``jax.nn.dot_product_attention(implementation="cudnn")``,
  causal, with or without a sliding window), forward alone and backward alone (from residuals
  computed once; forward + backward is their sum), per sequence length, head dimension and
  window; FLOPs are the window-aware count (the (query, key) pairs the mask keeps,
  :func:`olmax.model.flops.causal_attention_pairs`): 4 x pairs x head_dim per head for the
  forward, 10 x for forward + backward (recomputed scores, the four products of the backward).
- on a TPU, ``attention`` is olmax's splash kernels instead (:mod:`olmax.model.splash`, at the
  default block, with the fused backward), and its FLOPs are those the kernels *execute*: every
  visited block pair, masked entries included (:func:`olmax.model.splash.kernel_flops`), which is
  what the estimate counts in a compiled step; the GEMM grid is the one of :data:`TPU_GEMM_M` and
  :data:`TPU_GEMM_SIZES` (the widths of OLMo 3's smaller sizes and the vocabulary slice too).
- ``hbm``: the bytes per second of a large elementwise kernel (read + write) and of a reduction
  (read): what XLA's memory-bound fusions reach, not the datasheet's figure.
- ``kernel``: the time per kernel of a chain of tiny dependent kernels in one program: the floor
  every launched kernel pays.

Every program is compiled with the compiler options of the platform's training step
(:func:`olmax.platforms.compiler_options`: on v5e, 32 MiB of scoped VMEM), so that a rate is the
one the step's kernels get. A table carries the device kind, the JAX version, those options and
the date; the estimate uses a table only for the device kind it was measured on (or, for another
GPU, says which it scaled from and how).
"""

from __future__ import annotations

import datetime
import statistics
import time
from collections.abc import Mapping
from typing import Any

GEMM_SIZES = (1024, 4096, 11008, 16384)       # m, n and k each; 11008: the 7B's MLP width
GEMM_M = (1024, 4096, 8192, 16384)              # rows (tokens per device per micro-batch)
ATTENTION_CASES = tuple((seq, hd, win) for seq in (4096, 8192, 16384) for hd in (128, 256)
                        for win in (None, 4096))
# FLOPs per kept (query, key) pair and head dimension: QK^T and PV forward; the backward's
# recomputed scores and its four products (dV, dP, dQ, dK) make 10 for forward + backward.
ATTENTION_FWD_FLOPS, ATTENTION_BWD_FLOPS = 4.0, 6.0
# TPU: tokens per device per micro-batch of one to eight 4096-token rows; the widths of OLMo 3's
# d_model (768 to 4096), MLPs (3072 to 11008) and the vocabulary (a 32,768 slice; 100,352 clamps)
TPU_GEMM_M = (4096, 32768)
TPU_GEMM_SIZES = (768, 2048, 4096, 11008, 32768)
# (sequence, head dim, window): the head dims of olmo3-190m/370m (64), -600m (80) and the 7B (128)
SPLASH_CASES = ((4096, 64, None), (4096, 80, None), (4096, 128, None), (8192, 128, None),
                (8192, 128, 4096), (8192, 64, None))
DISPATCH_BOUND_S = 100e-6   # on the H200 here one call took 35-65 us to dispatch


Options = Mapping[str, Any] | None


def _jit(fn, options: Options):
    """``fn`` compiled with ``options``: the compiler options of the platform's training step
    (:func:`olmax.platforms.compiler_options`), so that a rate is measured as the step compiles."""
    import jax

    return jax.jit(fn, compiler_options=dict(options) if options else None)


def _backward_of(fn, *args):
    """The backward of ``fn`` at ``args``: a pytree (its residuals computed once here) that a
    jitted function takes as an argument, so that the backward kernels are timed alone. Timing the
    forward and backward together and subtracting the forward's time adds both timings' noise (at
    a millisecond a call, on a 2-core host, the difference came out negative), and it times a
    forward whose unused output a compiler may drop."""
    import jax

    return jax.vjp(fn, *args)[1]


def _apply(backward, cotangent):
    return backward(cotangent)


def _timed(fn, args, calls: int, repeats: int) -> float:
    """Seconds per call: ``calls`` queued launches and one wait, median of ``repeats``."""
    import jax

    jax.block_until_ready(fn(*args))
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = None
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        runs.append((time.perf_counter() - t0) / calls)
    return statistics.median(runs)


def _calls_for(seconds_guess: float, budget_s: float = 0.05) -> int:
    return max(3, min(200, int(budget_s / max(seconds_guess, 1e-6))))


def gemm_rates(ms=GEMM_M, sizes=GEMM_SIZES, dtype: str = "bfloat16", repeats: int = 3,
               guess_flops: float = 5e14, options: Options = None) -> list[dict]:
    import jax
    import jax.numpy as jnp

    dt = jnp.dtype(dtype)
    mm = _jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(dt), options)
    rows = []
    for m in ms:
        for k in sizes:
            a = jax.random.normal(jax.random.key(0), (m, k), dt)
            for n in sizes:
                b = jax.random.normal(jax.random.key(1), (k, n), dt)
                flops = 2.0 * m * n * k
                s = _timed(mm, (a, b), _calls_for(flops / guess_flops), repeats)
                rows.append({"m": m, "n": n, "k": k, "dtype": dtype, "seconds": s, "flops": flops,
                             "flops_per_s": flops / s, "dispatch_bound": s < DISPATCH_BOUND_S})
            del a
    return rows


def attention_flops(seq: int, heads: int, head_dim: int, window: int | None, batch: int = 1) -> dict:
    from olmax.model.flops import causal_attention_pairs

    pairs = causal_attention_pairs(seq, window) * heads * batch
    return {"pairs": pairs, "fwd": ATTENTION_FWD_FLOPS * pairs * head_dim,
            "fwd_bwd": (ATTENTION_FWD_FLOPS + ATTENTION_BWD_FLOPS) * pairs * head_dim}


def attention_rates(cases=ATTENTION_CASES, d_model: int = 4096, repeats: int = 3,
                    options: Options = None) -> list[dict]:
    """cuDNN attention, forward and forward + backward, at ``d_model / head_dim`` heads."""
    import jax
    import jax.numpy as jnp

    from olmax.model.attention_impls import cudnn_attention

    rows = []
    for seq, hd, win in cases:
        heads = d_model // hd
        shape = (1, seq, heads, hd)
        q, k, v, do = (jax.random.normal(jax.random.key(i), shape, jnp.bfloat16) for i in range(4))

        def attn(q, k, v, win=win, hd=hd):
            return cudnn_attention(q, k, v, win, hd ** -0.5, native=True)

        fwd = _jit(attn, options)
        bwd = _jit(_apply, options)
        text = fwd.lower(q, k, v).as_text()
        fl = attention_flops(seq, heads, hd, win)
        row: dict[str, Any] = {"seq": seq, "head_dim": hd, "heads": heads, "window": win,
                               "cudnn": "__cudnn$fmha" in text or "cudnn" in text.lower(), **fl}
        try:
            row["fwd_s"] = _timed(fwd, (q, k, v), _calls_for(fl["fwd"] / 4e14), repeats)
            row["bwd_s"] = _timed(bwd, (_backward_of(attn, q, k, v), do),
                                  _calls_for((fl["fwd_bwd"] - fl["fwd"]) / 4e14), repeats)
            row["fwd_bwd_s"] = row["fwd_s"] + row["bwd_s"]
            row["fwd_flops_per_s"] = fl["fwd"] / row["fwd_s"]
            row["bwd_flops_per_s"] = (fl["fwd_bwd"] - fl["fwd"]) / row["bwd_s"]
        except Exception as e:  # an unsupported case is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        rows.append(row)
    return rows


def splash_rates(cases=SPLASH_CASES, heads: int = 16, batch: int = 2, repeats: int = 3,
                 native: bool = True, options: Options = None) -> list[dict]:
    """olmax's splash kernels (TPU), forward alone and forward + fused backward, per case; FLOPs
    executed (every visited block pair), so that a compiled step's kernel calls are priced by the
    same count. ``native=False``: Pallas interpret mode (a test of this function off TPU)."""
    import jax
    import jax.numpy as jnp

    from olmax.model.splash import DEFAULT_BLOCK, kernel_flops, splash_attention

    rows = []
    for seq, hd, win in cases:
        shape = (batch, seq, heads, hd)
        dt = jnp.bfloat16 if native else jnp.float32
        q, k, v, do = (jax.random.normal(jax.random.key(i), shape, dt) for i in range(4))

        def attn(q, k, v, win=win, hd=hd):
            return splash_attention(q, k, v, win, hd ** -0.5, native=native, fused_bwd=True)

        fwd = _jit(attn, options)
        bwd = _jit(_apply, options)
        f_fwd = kernel_flops(seq, win, heads, hd, batch, "fwd")
        f_bwd = kernel_flops(seq, win, heads, hd, batch, "dkv", fused=True)
        row: dict[str, Any] = {"seq": seq, "head_dim": hd, "heads": heads, "batch": batch, "window": win,
                               "block": DEFAULT_BLOCK, "kernel": "splash", "fwd": f_fwd,
                               "fwd_bwd": f_fwd + f_bwd}
        try:
            row["fwd_s"] = _timed(fwd, (q, k, v), _calls_for(f_fwd / 1e14), repeats)
            row["bwd_s"] = _timed(bwd, (_backward_of(attn, q, k, v), do), _calls_for(f_bwd / 1e14), repeats)
            row["fwd_bwd_s"] = row["fwd_s"] + row["bwd_s"]
            row["fwd_flops_per_s"] = f_fwd / row["fwd_s"]
            row["bwd_flops_per_s"] = f_bwd / row["bwd_s"]
        except Exception as e:  # an unsupported case is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        rows.append(row)
    return rows


def hbm_rates(nbytes: int = 4 << 30, repeats: int = 3, options: Options = None) -> dict:
    import jax.numpy as jnp

    n = nbytes // 2
    x = jnp.ones((n // 4096, 4096), jnp.bfloat16)
    scale = _jit(lambda x: x * jnp.bfloat16(1.5) + jnp.bfloat16(1), options)
    total = _jit(lambda x: jnp.sum(x.astype(jnp.float32), axis=0), options)
    s_rw = _timed(scale, (x,), 10, repeats)
    s_r = _timed(total, (x,), 10, repeats)
    return {"bytes": nbytes, "elementwise_s": s_rw, "elementwise_bytes_per_s": 2 * nbytes / s_rw,
            "reduce_s": s_r, "reduce_bytes_per_s": nbytes / s_r}


def kernel_floor(length: int = 2000, repeats: int = 3, options: Options = None) -> dict:
    import jax
    import jax.numpy as jnp

    def chain(x):
        for _ in range(length):     # the barrier keeps each step its own kernel
            x = jax.lax.optimization_barrier(x * 1.0001 + 1.0)
        return x

    x = jnp.ones((1024,), jnp.float32)
    one = _jit(lambda x: x * 1.0001 + 1.0, options)
    many = _jit(chain, options).lower(x).compile()     # compiled once: timed, and its kernels counted
    s_many = _timed(many, (x,), 3, repeats)
    s_one = _timed(one, (x,), 20, repeats)
    kernels = (many.as_text() or "").count("fusion(")
    return {"chain_length": length, "chain_s": s_many, "one_call_s": s_one,
            "kernels_in_chain": kernels, "per_kernel_s": (s_many - s_one) / length}


def _log_attention(r: dict, log) -> None:
    log(f"attention seq {r['seq']} hd {r['head_dim']} window {r['window']}: "
        + (r["error"] if "error" in r else
           f"fwd {r['fwd_s'] * 1e3:.2f} ms ({r['fwd_flops_per_s'] / 1e12:.0f} TFLOP/s), "
           f"bwd {r['bwd_s'] * 1e3:.2f} ms ({r['bwd_flops_per_s'] / 1e12:.0f} TFLOP/s)"
           f"{'' if r.get('cudnn', True) else ' [not cuDNN]'}"))


def measure(*, gemm: bool = True, attention: bool = True, log=print, progress=None) -> dict:
    """Every rate above on the first device, with what it was measured on. ``progress``: called
    with the table as it stands after each part (a measurement cut short keeps what it measured;
    ``complete`` is False until the end)."""
    import jax

    from olmax.platforms import backend_of, compiler_options

    dev = jax.devices()[0]
    options = compiler_options(backend_of([dev]), [dev])
    out: dict[str, Any] = {"device_kind": dev.device_kind, "platform": dev.platform,
                           "jax": jax.__version__, "compiler_options": dict(options or {}),
                           "date": datetime.date.today().isoformat(),
                           "method": __doc__.split("\n\n")[0].replace("\n", " "), "complete": False}
    done = progress or (lambda table: None)
    t0 = time.perf_counter()
    out["hbm"] = hbm_rates(1 << 26 if dev.platform == "cpu" else 4 << 30, options=options)
    log(f"hbm: elementwise {out['hbm']['elementwise_bytes_per_s'] / 1e12:.3f} TB/s, "
        f"reduce {out['hbm']['reduce_bytes_per_s'] / 1e12:.3f} TB/s ({time.perf_counter() - t0:.0f} s)")
    out["kernel"] = kernel_floor({"cpu": 50, "tpu": 500}.get(dev.platform, 2000), options=options)
    log(f"kernel floor: {out['kernel']['per_kernel_s'] * 1e6:.2f} us per kernel "
        f"({out['kernel']['kernels_in_chain']} kernels)")
    done(out)
    # the attention kernels first on a TPU: the GEMM grid's many compiles take longest there
    parts = ["attention", "gemm"] if dev.platform == "tpu" else ["gemm", "attention"]
    for part in parts:
        if part == "gemm" and gemm:
            out["gemm"] = (gemm_rates((64, 128), (64, 256), "float32", options=options)
                           if dev.platform == "cpu" else
                           gemm_rates(TPU_GEMM_M, TPU_GEMM_SIZES, guess_flops=1.5e14, options=options)
                           if dev.platform == "tpu" else gemm_rates(options=options))
            best = max(r["flops_per_s"] for r in out["gemm"])
            log(f"gemm: {len(out['gemm'])} shapes, best {best / 1e12:.1f} TFLOP/s "
                f"({time.perf_counter() - t0:.0f} s)")
        elif part == "attention" and attention:
            if dev.platform == "tpu":
                out["attention"] = splash_rates(options=options)
            else:
                out["attention"] = attention_rates(((256, 16, None), (256, 16, 64)), d_model=64,
                                                   options=options) \
                    if dev.platform == "cpu" else attention_rates(options=options)
            for r in out["attention"]:
                _log_attention(r, log)
        done(out)
    out["measure_s"] = time.perf_counter() - t0
    out["complete"] = True
    done(out)
    return out
