"""The step that fits the device: ``train.micro_batch_size=auto`` and ``train.remat=auto`` chosen
from the compiled step's own memory, and every step checked against the device before it runs.

:func:`fit_step` compiles the training step the run will run (the real program: model, loss,
optimizer, mesh and shardings, :func:`olmax.train.step.build_sharded_training`) ahead of time and
reads its peak memory per device from XLA's memory analysis (:func:`olmax.device_memory.compiled_peak`).
A compile that the compiler itself refuses for lack of memory (the TPU compiler does) is a step that
does not fit, with the bytes the compiler names.

- ``train.micro_batch_size=auto``: the largest micro-batch that divides the per-device batch, is at
  most ``train.micro_batch_max`` and fits. Memory grows with the micro-batch, so the divisors are
  searched by bisection: the largest first (most runs fit at once, in one compile), then the
  smallest, then halfway, a few compiles in all.
- ``train.remat=auto``: the policy of :data:`REMAT_LADDER` with the least recomputation that fits;
  with an ``auto`` micro-batch too, the lightest policy comes first and the micro-batch is the
  largest that fits under it (recomputation costs a third of a step's FLOPs and more; a smaller
  micro-batch costs only its share of fixed per-step work).
- "Fits" means fits as written first: a step that fits only because the compiler recomputes some
  of its instructions to stay within the device (XLA's rematerialization pass:
  :func:`olmax.device_memory.compiler_remat_ops`) runs slower than its FLOPs say (measured on a
  v5e chip: the 370m's micro-batch 2 under save_proj, 29 instructions recomputed, 7 % slower than
  micro-batch 1), so ``auto`` takes the largest micro-batch and lightest policy that fit with
  nothing recomputed by the compiler, and only where none does, those that fit at all.
- ``train.auto_choice=estimate`` (the default), where a table of rates measured on the device's
  own kind prices its compiled step (a v5e, an H100 or an H200: the method of ``olmax plan``'s
  estimate there, :func:`olmax.perf.step_price.step_pricer`, which the trainer, ``olmax bench``
  and ``olmax plan`` pass as ``price``): the rules above give the first choice, and the steps
  that fit are then held against it by their estimated step time (:func:`choose_by_estimate`).
  With an ``auto`` micro-batch the smaller micro-batches of the chosen policy are compiled in
  turn while each is estimated faster than the last (a larger micro-batch is not always the
  faster: on a v5e chip the olmo3-190m's micro-batch 4 took 1.038x the step of micro-batch 2:
  compiled for v5e its program moves 12.9 % more bytes for the same FLOPs, the compiler fusing
  and placing the larger buffers otherwise; the estimate priced it 1.024x from the compiled
  programs). Every candidate compiled that fits is priced, also a lighter
  policy's that fits only by the compiler's recomputation (on the chip the olmo3-600m at
  micro-batch 1 without remat, which the compiler fits by recomputing some of its instructions,
  took 0.845x the step of micro-batch 8 under save_kernels, in one command), and the fastest
  replaces the first choice where it is estimated more than :data:`AUTO_MARGIN` faster. Each
  trial's estimate is in ``fit.json``. ``memory``: the rules above alone, as on devices no
  measured table prices (the CPU, other TPU generations).
- A kernel whose blocks overflow the core's on-chip memory (a TPU's scoped VMEM: splash at too
  large a ``train.splash_block``) does not fit at any micro-batch or policy: it is refused at once.
- A step given in full (neither ``auto``) is compiled once and checked; one that does not fit is
  :class:`olmax.device_memory.DoesNotFit`: one line naming what it needs of what there is and the
  settings that lower it, exit status 2 (no restart can help).

The limit a step is held to (:func:`memory_limit`): ``train.memory_limit_gib`` when set, else what
the device gives a program (:func:`olmax.device_memory.device_limit`: the runtime's limit on TPU
and GPU). The CPU has no device memory of its own (its "device" is the host's memory, which the
operating system hands out, and XLA's CPU backend reports no peak, only an upper bound): there
only what must be resident at once, the step's arguments (parameters, optimizer state, batch), is
held to the host's memory shared by its CPU devices, unless ``train.memory_limit_gib`` sets a
limit; ``auto`` takes the largest micro-batch up to the cap and the lightest policy.

The compiled step of the choice is kept (:attr:`StepFit.compiled`): the trainer runs it, so the
check costs no compile of its own. :meth:`StepFit.record` is what ``RUN_DIR/fit.json`` holds; a
resumed run tries its earlier choice first (``prefer``), so that it keeps the same micro-batches
(the losses depend on how a batch is accumulated) wherever that choice still fits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence, cast

import jax

from olmax.config import ModelConfig, TrainConfig
from olmax.config.schema import Remat
from olmax.device_memory import (DoesNotFit, GiB, as_does_not_fit, compiled_peak, compiler_remat_ops,
                                 device_limit, gib, hbm_bytes, oom_of, resident_bytes)
from olmax.errors import ConfigError
from olmax.model.runtime import Runtime
from olmax.platforms import backend_of, compile_option_error
from olmax.parallel.mesh import data_parallel_size
from olmax.train.step import ABSTRACT_LR, ShardedTraining, build_sharded_training, micro_batch_size

log = logging.getLogger(__name__)

# From the least recomputation to the most: none (keep every activation), save_proj (keep every
# projection's output: only element-wise work is recomputed), save_attn (keep q/k/v and the
# attention kernel's output: the MLP and the output projection are recomputed), save_kernels (keep
# each layer's input and the attention kernel's output and statistics: every matmul is recomputed,
# never the attention kernel; where attention is no Pallas kernel, it compiles as ``full`` and
# fits where ``full`` does), full (keep each layer's input only). ``dots`` keeps what save_proj keeps in fp32 (twice the bytes, the same
# recomputation) and ``save_outputs`` recomputes nearly what ``full`` does: neither is a step of
# the ladder.
REMAT_LADDER = ("none", "save_proj", "save_attn", "save_kernels", "full")
# train.auto_choice=estimate: how much faster (a fraction of its step) another step that fits must
# be estimated to replace the memory rule's choice
AUTO_MARGIN = 0.01
FSDP_HINT = "mesh.fsdp (more devices to shard the parameters and optimizer state over)"


@dataclass(frozen=True)
class Trial:
    """One compiled candidate: its micro-batch and policy, its peak per device (the bytes the
    compiler named when it refused it), whether it fits, how many of its instructions the
    compiler recomputes to fit (None: not read) and its estimated step time (None: not priced)."""

    micro_batch_size: int
    remat: str
    peak_bytes: int | None
    fits: bool
    compiler_remat_ops: int | None = None
    estimated_step_s: float | None = None   # its compiled step priced (None: not priced)

    @property
    def as_written(self) -> bool:
        """Fits with nothing recomputed by the compiler."""
        return self.fits and not self.compiler_remat_ops

    def to_dict(self) -> dict:
        return {"micro_batch_size": self.micro_batch_size, "remat": self.remat,
                "peak_bytes": self.peak_bytes, "fits": self.fits,
                "compiler_remat_ops": self.compiler_remat_ops,
                "estimated_step_s": self.estimated_step_s}


@dataclass
class StepFit:
    """The step chosen (or checked): its settings, its peak and the limit, what was tried, the
    sharded training and its compiled step."""

    micro_batch_size: int
    remat: str
    peak_bytes: int
    limit_bytes: int | None
    limit_source: str
    auto: tuple[str, ...]                 # the settings that were ``auto``
    trials: list[Trial] = field(default_factory=list)
    training: ShardedTraining | None = None
    compiled: Any = None
    chosen_by: str = "memory"             # "estimate": the estimated step time chose

    @property
    def compiler_remat_ops(self) -> int | None:
        """Instructions of the chosen step the compiler recomputes to fit (None: not read)."""
        return next((t.compiler_remat_ops for t in reversed(self.trials)
                     if (t.micro_batch_size, t.remat) == (self.micro_batch_size, self.remat)), None)

    def record(self) -> dict:
        """What ``RUN_DIR/fit.json`` holds (JSON)."""
        return {"micro_batch_size": self.micro_batch_size, "remat": self.remat,
                "peak_bytes": self.peak_bytes, "compiler_remat_ops": self.compiler_remat_ops,
                "limit_bytes": self.limit_bytes,
                "limit_source": self.limit_source, "auto": list(self.auto),
                "chosen_by": self.chosen_by,
                "trials": [t.to_dict() for t in self.trials]}

    def summary(self) -> str:
        """One line: the choice and why."""
        chosen = f"micro-batch {self.micro_batch_size}, remat {self.remat}"
        limit = ("no device limit" if self.limit_bytes is None
                 else f"{gib(self.limit_bytes)} ({self.limit_source})")
        tried = ", ".join(f"{t.micro_batch_size}/{t.remat}: {gib(t.peak_bytes)}"
                          + ("" if t.fits else " (no)")
                          + (f" ({t.compiler_remat_ops} recomputed by the compiler)"
                             if t.fits and t.compiler_remat_ops else "")
                          + (f", est. {t.estimated_step_s * 1e3:,.1f} ms"
                             if t.estimated_step_s is not None else "") for t in self.trials)
        by = " (the least estimated step time)" if self.chosen_by == "estimate" else ""
        return (f"{chosen}{by} ({' and '.join(f'train.{a}=auto' for a in self.auto)}): peak "
                f"{gib(self.peak_bytes)} per device of {limit}"
                + (f"; tried {tried}" if len(self.trials) > 1 else ""))


def memory_limit(train: TrainConfig, devices: Sequence[Any]) -> tuple[int | None, str]:
    """(bytes per device a step may use, where that comes from); see the module docstring."""
    if train.memory_limit_gib is not None:
        return int(train.memory_limit_gib * GiB), "train.memory_limit_gib"
    backend = backend_of(devices)
    if backend == "cpu":
        return None, "none on the CPU"
    return device_limit(devices[0], backend)


def micro_candidates(train: TrainConfig, dp: int) -> list[int]:
    """The micro-batches ``auto`` may choose, largest first: the divisors of the per-device batch
    up to ``train.micro_batch_max``; a given micro-batch alone."""
    if train.micro_batch_size != "auto":
        return [micro_batch_size(train, dp)]
    per_device = micro_batch_size(replace(train, micro_batch_size=None), dp)
    cap = min(per_device, train.micro_batch_max or per_device)
    return [d for d in range(cap, 0, -1) if per_device % d == 0]


def remat_candidates(train: TrainConfig, attention_kernel: bool = True) -> list[str]:
    """The policies ``auto`` may choose, least recomputation first; a given policy alone.
    ``attention_kernel``: attention is a Pallas kernel (splash) with residuals to keep; where it
    is not, ``save_kernels`` is the program ``full`` is and is not tried twice."""
    if train.remat != "auto":
        return [train.remat]
    return [r for r in REMAT_LADDER if attention_kernel or r != "save_kernels"]


def choose(micros: Sequence[int], remats: Sequence[str],
           fits: Callable[[int, str], bool]) -> tuple[int, str] | None:
    """The lightest policy under which some micro-batch fits, with the largest micro-batch that
    fits under it (``micros`` largest first); None when nothing fits. ``fits(micro, remat)``
    compiles, so it is asked as few times as the search allows.

    The largest (the whole per-device batch) first, then the smallest, then bisection between the
    last that did not fit and the last that did. Memory grows with the micro-batch among the
    micro-batches that accumulate; the whole batch keeps no gradient accumulator (an fp32 copy of
    the gradients: for a 7B-wide slice more than a micro-batch's activations), so it may need less
    than the next smaller one, never more than the bisection assumes of the ones below it."""
    for remat in remats:
        if fits(micros[0], remat):
            return micros[0], remat
        if len(micros) == 1 or not fits(micros[-1], remat):
            continue
        lo, hi = len(micros) - 1, 0    # micros[lo] fits, micros[hi] does not
        while lo - hi > 1:
            mid = (lo + hi) // 2
            if fits(micros[mid], remat):
                lo = mid
            else:
                hi = mid
        return micros[lo], remat
    return None


class _Unpriced(Exception):
    """A candidate's step the estimate cannot price."""


def choose_by_estimate(choice: tuple[int, str], micros: Sequence[int], auto: Sequence[str],
                       fitting: Callable[[], list[tuple[int, str]]],
                       fits: Callable[[int, str], bool],
                       seconds: Callable[[tuple[int, str]], float]) -> tuple[int, str]:
    """Among the steps that fit, the one with the least estimated step time, starting from the
    memory rule's ``choice``: with an ``auto`` micro-batch, the smaller micro-batches of its
    policy (``micros`` largest first) are compiled in turn while each fits and is estimated
    faster than the last; then every candidate compiled and fitting (``fitting()``: also a
    lighter policy's that fits only by the compiler's own recomputation) is priced, and the
    fastest replaces ``choice`` only where it is estimated more than :data:`AUTO_MARGIN` faster
    (the estimate's resolution between two programs of the same model; a tie keeps the larger
    micro-batch and the lighter policy). ``fits(micro, remat)`` compiles; ``seconds(candidate)``
    prices one."""
    if "micro_batch_size" in auto and choice[0] in micros:
        last = seconds(choice)
        for micro in micros[micros.index(choice[0]) + 1:]:
            if not fits(micro, choice[1]):
                break
            now = seconds((micro, choice[1]))
            if now >= last:
                break
            last = now
    base = seconds(choice)
    best = min(fitting(), key=seconds, default=choice)
    return best if seconds(best) < (1 - AUTO_MARGIN) * base else choice


def memory_hints(train: TrainConfig, micro: int, remat: str) -> list[str]:
    """The settings that lower a step's memory, each with its value now."""
    hints = []
    if micro > 1 or train.micro_batch_size == "auto":
        hints.append(f"train.micro_batch_size (now {micro}; auto picks the largest that fits)")
    if remat != "full":
        hints.append(f"train.remat (now {remat}; full stores least, auto picks what fits)")
    hints.append(FSDP_HINT)
    hints.append(f"train.seq_len (now {train.seq_len})")
    return hints


def fit_step(model: ModelConfig, train: TrainConfig, tx: Any, mesh: Any, key: jax.Array,
             batch_of: Callable[[ShardedTraining], dict], *, where: str,
             compile_fn: Callable[[Any], Any] | None = None,
             prefer: tuple[int, str] | None = None,
             limit: tuple[int | None, str] | None = None,
             price: Callable[[Any], float | None] | None = None) -> StepFit:
    """Compile the step of ``train`` on ``mesh`` and choose its ``auto`` settings (see the module
    docstring). ``batch_of(st)``: the abstract batch the step takes; ``where``: the step in a
    message (``the training step (1 x TPU v5 lite, batch 16 x 4096)``); ``compile_fn(lowered)``:
    how to compile (default ``lowered.compile()``); ``prefer``: an earlier (micro-batch, remat)
    tried first; ``limit``: (bytes, source) instead of :func:`memory_limit`; ``price(compiled)``:
    a compiled step's estimated seconds (None: it cannot be priced), which
    ``train.auto_choice=estimate`` chooses by (:func:`olmax.perf.step_price.step_pricer` gives it
    where the devices' kind has a measured rates table); without it ``auto`` chooses by memory."""
    devices = list(mesh.devices.flat)
    platform = backend_of(devices)
    limit_bytes, source = limit if limit is not None else memory_limit(train, devices)
    auto = tuple(k for k in ("micro_batch_size", "remat") if getattr(train, k) == "auto")
    dp = data_parallel_size(mesh)
    splash = Runtime.of(train, devices, remat="none").attn_impl == "splash"   # remat: any one
    all_micros, all_remats = micro_candidates(train, dp), remat_candidates(train, splash)
    micros, remats = all_micros, all_remats
    if limit_bytes is None:           # nothing to fit against: the largest, the lightest
        micros, remats = micros[:1], remats[:1]
    # With no limit on the CPU, only what cannot be less is checked: a step's arguments (its
    # parameters, optimizer state and batch) all live at once, and the host's memory holds them.
    host: tuple[int, str] | None = None
    if limit_bytes is None and platform == "cpu":
        size, where_from = hbm_bytes(devices[0])
        if size is not None:
            host = (size, where_from)
            source = f"{where_from}, for the step's parameters, optimizer state and batch"
    compile_fn = compile_fn or (lambda lowered: lowered.compile())
    trials: list[Trial] = []
    built: dict[tuple[int, str], tuple[ShardedTraining, Any]] = {}
    tried: dict[tuple[int, str], Trial] = {}
    refused_at: dict[tuple[int, str], int] = {}   # the compiler's own limit, where it refused one
    # the compiler's own recomputation is read where a step is held to a device's limit
    count_remat = limit_bytes is not None

    def compile_one(micro: int, remat: str) -> Trial:
        if (micro, remat) in tried:
            return tried[(micro, remat)]
        cfg = replace(train, micro_batch_size=micro, remat=cast(Remat, remat))
        st = build_sharded_training(model, cfg, tx, mesh, key)
        try:
            compiled = compile_fn(st.step_fn.lower(st.abstract_state, batch_of(st), ABSTRACT_LR))
        except DoesNotFit as e:  # the compiler's refusal, explained by compile_fn
            if e.space == "vmem":   # a kernel's blocks: no micro-batch or policy changes them
                raise
            trial = Trial(micro, remat, e.needed or None, False)
            if e.available:
                refused_at[(micro, remat)] = e.available
        except Exception as e:   # the compiler's own out-of-memory refusal: a candidate that does not fit
            refused_option = compile_option_error(e, train.compiler_options_dict())
            if refused_option is not None:
                raise refused_option from None
            oom = oom_of(e)
            if oom is None:
                raise
            if oom.space == "vmem":
                refused = as_does_not_fit(e, where)
                assert refused is not None
                raise refused from None
            trial = Trial(micro, remat, oom.needed or None, False)
            if oom.available:
                refused_at[(micro, remat)] = oom.available
        else:
            peak = compiled_peak(compiled, platform)
            ok = limit_bytes is None or peak <= limit_bytes
            if host is not None:     # the CPU: what must be resident at once, against the host
                peak = resident_bytes(compiled)
                ok = peak <= host[0]
            trial = Trial(micro, remat, peak, ok, compiler_remat_ops(compiled) if ok and count_remat else None)
            if ok:
                built[(micro, remat)] = (st, compiled)
        trials.append(trial)
        tried[(micro, remat)] = trial
        return trial

    choice = None
    if prefer is not None and prefer[0] in all_micros and prefer[1] in all_remats and compile_one(*prefer).fits:
        choice = prefer
    chosen_by, preferred = "memory", choice is not None
    if choice is None and count_remat:   # fits as written first
        choice = choose(micros, remats, lambda m, r: compile_one(m, r).as_written)
    if choice is None:
        choice = choose(micros, remats, lambda m, r: compile_one(m, r).fits)
    pricer = price
    if (pricer is not None and choice is not None and not preferred and auto and count_remat
            and train.auto_choice == "estimate"):
        as_written = tried[choice].as_written      # then so must the smaller micro-batches be

        def seconds(key: tuple[int, str]) -> float:
            t = tried[key]
            if t.estimated_step_s is None:
                s = pricer(built[key][1])
                if s is None:
                    raise _Unpriced
                t = tried[key] = replace(t, estimated_step_s=s)
                trials[:] = [t if (x.micro_batch_size, x.remat) == key else x for x in trials]
            assert t.estimated_step_s is not None
            return t.estimated_step_s

        memory_choice = choice
        try:
            choice = choose_by_estimate(
                choice, micros, auto, lambda: list(built),     # built: the candidates that fit
                lambda m, r: compile_one(m, r).as_written if as_written else compile_one(m, r).fits,
                seconds)
        except _Unpriced:      # a candidate's collectives the network model cannot time
            choice = memory_choice
        chosen_by = "estimate" if choice != memory_choice else "memory"
    if choice is None:
        least = min(trials, key=lambda t: t.peak_bytes or float("inf"))
        hints = memory_hints(train, least.micro_batch_size, least.remat)
        if host is not None:    # the arguments alone: only more devices help
            hints = [FSDP_HINT]
        elif auto:    # what auto could change, it has tried
            hints = [h for h in hints if not any(h.startswith(f"train.{a} ") for a in auto)]
            where = (f"{where}, at micro-batch {least.micro_batch_size} and remat {least.remat} "
                     f"(the least memory {' and '.join(f'train.{a}=auto' for a in auto)} can choose),")
        available = host[0] if host else limit_bytes
        compiler_limit = refused_at.get((least.micro_batch_size, least.remat))
        if compiler_limit is not None and (available is None or compiler_limit < available):
            # the compiler refused it against the device's memory, below the limit given
            available, source = compiler_limit, "the compiler's own limit for the device"
        raise DoesNotFit(least.peak_bytes or 0, available, where, hints, source=source)
    st, compiled = built.pop(choice)
    built.clear()     # the other candidates' executables
    peak = next(t.peak_bytes for t in reversed(trials) if (t.micro_batch_size, t.remat) == choice)
    fit = StepFit(choice[0], choice[1], peak or 0, host[0] if host else limit_bytes, source, auto,
                  trials, st, compiled, chosen_by)
    if auto:
        log.debug("step fit: %s", fit.summary())
    return fit


def agree_across_processes(choice: tuple[int, str]) -> tuple[int, str]:
    """Process 0's (micro-batch, remat) on every process of a multi-process job: each compiles the
    same program and should choose alike; if a process did not, it follows process 0."""
    if jax.process_count() == 1:
        return choice
    import numpy as np
    from jax.experimental import multihost_utils

    ladder = list(REMAT_LADDER) + [r for r in _all_policies() if r not in REMAT_LADDER]
    mine = np.asarray([choice[0], ladder.index(choice[1])], np.int64)
    theirs = multihost_utils.broadcast_one_to_all(mine)
    return int(theirs[0]), ladder[int(theirs[1])]


def _all_policies() -> list[str]:
    from olmax.model.runtime import REMAT_POLICIES

    return list(REMAT_POLICIES)


def check_record(record: Any, path: str) -> tuple[int, str] | None:
    """The (micro-batch, remat) of an earlier ``fit.json`` (None when it holds none)."""
    if not isinstance(record, dict):
        return None
    micro, remat = record.get("micro_batch_size"), record.get("remat")
    if not isinstance(micro, int) or micro < 1 or remat not in _all_policies():
        raise ConfigError(f"{path}: not a fit record of olmax (micro_batch_size {micro!r}, remat "
                          f"{remat!r}); remove it to choose again")
    return micro, remat


__all__ = ["REMAT_LADDER", "AUTO_MARGIN", "FSDP_HINT", "StepFit", "Trial", "fit_step", "choose",
           "choose_by_estimate", "memory_limit",
           "micro_candidates", "remat_candidates", "memory_hints", "agree_across_processes",
           "check_record"]
