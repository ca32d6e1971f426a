"""``train.micro_batch_size=auto`` / ``train.remat=auto``: the step chosen from its compiled memory
against a limit (``train.memory_limit_gib`` here: the CPU has no device memory of its own), the
search's answer held against the brute-force answer over every candidate, each candidate's peak
read from XLA's memory analysis of that candidate compiled on its own."""

from __future__ import annotations

import functools
import math
from dataclasses import replace

import jax
import numpy as np
import pytest

from helpers.tiny import narrow_cfg
from olmax.config import MeshConfig, OptimConfig, TrainConfig
from olmax.device_memory import DoesNotFit, compiled_peak
from olmax.parallel.mesh import make_mesh
from olmax.train.fit import AUTO_MARGIN, REMAT_LADDER, choose, fit_step, remat_candidates
from olmax.train.optim import build_optimizer
from olmax.train.step import ABSTRACT_LR, abstract_batch, build_sharded_training

MODEL = narrow_cfg(vocab_size=64, padded_vocab_size=64, window_pattern=(8, None), max_seq_len=64)
B, T = 8, 32
TRAIN = TrainConfig(seq_len=T, global_batch_size=B, max_steps=1)
TX = build_optimizer(OptimConfig())


def test_the_search_finds_the_largest_that_fits_in_few_compiles():
    micros = [24, 12, 8, 6, 4, 3, 2, 1]
    for limit in range(26):
        asked: list[int] = []

        def fits(micro, remat, limit=limit, asked=asked):
            asked.append(micro)
            return micro <= limit

        best = max((m for m in micros if m <= limit), default=None)
        assert choose(micros, ["none"], fits) == (None if best is None else (best, "none"))
        assert len(asked) <= 2 + math.ceil(math.log2(len(micros)))     # largest, smallest, bisection


def test_the_lightest_policy_comes_first():
    """Memory per row by policy (a model of it): the lightest policy under which anything fits
    wins, with the largest micro-batch that fits under it, not the largest micro-batch anywhere."""
    per_row = {"none": 10, "save_proj": 7, "save_attn": 5, "save_kernels": 4, "full": 3}

    def run(limit):
        return choose([8, 4, 2, 1], REMAT_LADDER, lambda m, r: m * per_row[r] <= limit)

    assert run(20) == (2, "none")            # full would take 4 (12 <= 20): recomputation loses
    assert run(9) == (1, "save_proj")
    assert run(4) == (1, "save_kernels")
    assert run(3) == (1, "full")
    assert run(2) is None


def test_the_ladder_tries_save_kernels_only_over_an_attention_kernel():
    """``save_kernels`` keeps splash's residuals; where attention is no Pallas kernel it is the
    program ``full`` is, and ``auto`` does not compile it twice."""
    auto = replace(TRAIN, remat="auto")
    assert remat_candidates(auto) == ["none", "save_proj", "save_attn", "save_kernels", "full"]
    assert remat_candidates(auto, False) == ["none", "save_proj", "save_attn", "full"]
    assert remat_candidates(replace(TRAIN, remat="save_kernels"), False) == ["save_kernels"]


@functools.cache
def _compiled(micro: int, remat: str = "none"):
    """A candidate compiled on its own, the way the trainer builds its step (not through the
    search): its peak is the reference the search's figures must equal."""
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    st = build_sharded_training(MODEL, replace(TRAIN, micro_batch_size=micro, remat=remat), TX,
                                mesh, jax.random.key(0))
    return st, st.step_fn.lower(st.abstract_state, abstract_batch(st, B, T), ABSTRACT_LR).compile()


def _fit(train: TrainConfig, limit: int):
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    return fit_step(MODEL, train, TX, mesh, jax.random.key(0), lambda st: abstract_batch(st, B, T),
                    where="the step", limit=(limit, "given"))


def test_auto_takes_the_largest_micro_batch_under_a_given_limit():
    (_, c4), (st2, c2) = _compiled(4), _compiled(2)
    p4, p2 = compiled_peak(c4, "cpu"), compiled_peak(c2, "cpu")
    assert p4 > p2
    fit = _fit(replace(TRAIN, micro_batch_size="auto"), (p2 + p4) // 2)
    assert (fit.micro_batch_size, fit.remat, fit.peak_bytes) == (2, "none", p2)
    # the largest (8), the smallest (1), then bisection: 4 does not fit, 2 does
    assert [(t.micro_batch_size, t.fits) for t in fit.trials] == [(8, False), (1, True), (4, False),
                                                                 (2, True)]
    assert fit.auto == ("micro_batch_size",) and fit.training.n_micro == B // 2
    # The step it keeps is the program it chose: one step equals the directly compiled one's.
    tokens = np.random.default_rng(0).integers(0, 64, (B, T)).astype(np.int32)
    results = []
    for st, compiled in ((fit.training, fit.compiled), (st2, c2)):
        batch = {"tokens": jax.device_put(tokens, st.batch_shardings["tokens"]),
                 "instance_mask": jax.device_put(np.ones(B, bool), st.batch_shardings["instance_mask"])}
        results.append(float(compiled(st.fresh_state(None), batch, np.float32(1e-3))[1]["loss"]))
    assert results[0] == results[1]


def test_auto_remat_takes_the_least_recomputation_that_fits():
    micro = 4
    peaks = {r: compiled_peak(_compiled(micro, r)[1], "cpu") for r in REMAT_LADDER}
    lighter = min(peaks[r] for r in REMAT_LADDER[1:])
    assert lighter < peaks["none"]              # some policy of the ladder stores less
    limit = (lighter + peaks["none"]) // 2
    # brute force, ladder order; attention here is XLA's, so save_kernels is full's program and
    # is not tried
    ladder = [r for r in REMAT_LADDER if r != "save_kernels"]
    expected = next(r for r in ladder if peaks[r] <= limit)
    fit = _fit(replace(TRAIN, micro_batch_size=micro, remat="auto"), limit)
    assert (fit.micro_batch_size, fit.remat, fit.peak_bytes) == (micro, expected, peaks[expected])
    assert "save_kernels" not in {t.remat for t in fit.trials}


def test_nothing_that_fits_is_one_line_naming_the_least_tried():
    with pytest.raises(DoesNotFit) as info:
        _fit(replace(TRAIN, micro_batch_size="auto"), 1000)
    line = str(info.value)
    assert line.startswith("does not fit: the step, at micro-batch 1 and remat none (the least "
                           "memory train.micro_batch_size=auto can choose), needs ")
    assert line.endswith("0.0 MiB available (given); to lower it: train.remat (now "
                         "none; full stores least, auto picks what fits), mesh.fsdp (more devices to "
                         "shard the parameters and optimizer state over), train.seq_len (now 32)")
    assert info.value.exit_code == 2 and info.value.available == 1000


@pytest.mark.slow
def test_a_resumed_run_keeps_the_micro_batches_it_chose(token_files, tmp_path, caplog):
    """The choice is saved in the run directory and taken again on resume wherever it still fits,
    though the resumed command would choose otherwise (the losses depend on how a batch is
    accumulated): here the first run may take at most 2 sequences a micro-step, the resumed one
    up to all 8."""
    import json
    import logging

    import yaml

    from olmax.cli import main

    _, recipe = token_files
    run = tmp_path / "run"
    common = ["train", str(recipe), "--run-dir", str(run), "train.micro_batch_size=auto",
              "checkpoint.interval=2", "logging.tensorboard=false"]
    assert main([*common, "train.micro_batch_max=2", "train.max_steps=2"]) == 0
    record = json.loads((run / "fit.json").read_text())
    assert (record["micro_batch_size"], record["auto"]) == (2, ["micro_batch_size"])
    with caplog.at_level(logging.INFO, logger="olmax.train.trainer"):
        assert main([*common, "train.max_steps=4"]) == 0
    said = [r.getMessage() for r in caplog.records if "chose micro-batch" in r.getMessage()]
    assert len(said) == 1 and said[0].endswith("this run's earlier choice"), said
    assert json.loads((run / "fit.json").read_text())["micro_batch_size"] == 2
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["micro_batch_size"] == 2
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    # without the record the same command chooses the largest: the record is what kept it
    fresh = tmp_path / "fresh"
    assert main([*common[:3], str(fresh), *common[4:], "train.max_steps=1"]) == 0
    assert json.loads((fresh / "fit.json").read_text())["micro_batch_size"] == 8


class _Recomputing:
    """A compiled step as a compiler that fits programs above ``size`` by recomputing some of their
    instructions would return it: the same program and memory analysis, its text with clones."""

    def __init__(self, compiled, size: int):
        self.compiled, self.size = compiled, size

    def memory_analysis(self):
        return self.compiled.memory_analysis()

    def as_text(self):
        text = self.compiled.as_text()
        if compiled_peak(self.compiled, "cpu") > self.size:
            text += "\n  %fusion.1.remat = f32[8]{0} fusion(f32[8]{0} %p), kind=kLoop\n"
        return text

    def __call__(self, *args):
        return self.compiled(*args)


@pytest.mark.slow
def test_auto_takes_what_fits_as_written_before_what_the_compiler_squeezes_in():
    """Every micro-batch fits the limit, but the compiler recomputes instructions of those above
    micro-batch 2 (as libtpu did for the 370m on a v5e chip at micro-batch 2, which ran 7 % slower
    than micro-batch 1): auto takes the largest that fits as written, and a limit under which every
    candidate needs the compiler's recomputation still gets the largest that fits at all."""
    p2, p4 = compiled_peak(_compiled(2)[1], "cpu"), compiled_peak(_compiled(4)[1], "cpu")
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    train = replace(TRAIN, micro_batch_size="auto")

    def fit(size):
        return fit_step(MODEL, train, TX, mesh, jax.random.key(0), lambda st: abstract_batch(st, B, T),
                        where="the step", limit=(10 * p4, "given"),
                        compile_fn=lambda lowered: _Recomputing(lowered.compile(), size))

    chosen = fit((p2 + p4) // 2)
    assert (chosen.micro_batch_size, chosen.compiler_remat_ops) == (2, 0)
    assert [(t.micro_batch_size, t.fits, t.compiler_remat_ops) for t in chosen.trials] == [
        (8, True, 1), (1, True, 0), (4, True, 1), (2, True, 0)]
    assert chosen.record()["compiler_remat_ops"] == 0
    assert "(1 recomputed by the compiler)" in chosen.summary()
    squeezed = fit(0)       # every candidate recomputed: the largest that fits at all
    assert (squeezed.micro_batch_size, squeezed.compiler_remat_ops) == (8, 1)
    assert len(squeezed.trials) == 2     # 8 and 1, each compiled once over both searches


def test_a_step_the_compiler_refuses_under_a_larger_limit_names_the_compiler_s():
    """A limit given above the device's memory (train.memory_limit_gib=32 on a 15.75 GiB chip):
    the compiler refuses the step against the device's own, and the line says that limit, never
    "needs 16.67 GiB ..., 32.00 GiB available"."""
    def refuse(lowered):
        raise RuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory "
                           "in memory space hbm. Used 16.67G of 15.75G hbm. Exceeded hbm capacity "
                           "by 941.23M.")

    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    with pytest.raises(DoesNotFit) as info:
        fit_step(MODEL, replace(TRAIN, micro_batch_size=1), TX, mesh, jax.random.key(0),
                 lambda st: abstract_batch(st, B, T), where="the step",
                 limit=(32 * 2 ** 30, "train.memory_limit_gib"), compile_fn=refuse)
    assert str(info.value).startswith(
        "does not fit: the step needs 16.67 GiB of device memory per device, 15.75 GiB available "
        "(the compiler's own limit for the device); to lower it: ")


def test_a_kernels_on_chip_memory_is_refused_at_once():
    """A kernel's blocks that overflow the core's scoped VMEM do not fit at any micro-batch or
    policy: the first candidate's refusal is the answer, in one line naming the block."""
    compiles = []

    def refuse(lowered):
        compiles.append(1)
        raise RuntimeError("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: Ran out of memory in "
                           "memory space vmem while allocating on stack for %splash_mha_fwd.3 = (). "
                           "Scoped allocation with size 19.89M and limit 16.00M exceeded")

    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    with pytest.raises(DoesNotFit) as info:
        fit_step(MODEL, replace(TRAIN, micro_batch_size="auto", remat="auto"), TX, mesh,
                 jax.random.key(0), lambda st: abstract_batch(st, B, T), where="the step",
                 limit=(2 ** 40, "given"), compile_fn=refuse)
    assert len(compiles) == 1 and info.value.exit_code == 2
    assert str(info.value) == ("does not fit: the step: its kernel splash_mha_fwd needs 19.9 MiB of "
                               "on-chip vector memory (VMEM) per device, 16.0 MiB available; to "
                               "lower it: train.splash_block (a smaller block); or raise it to at least 20 MiB: "
                    "train.compiler_options=[xla_tpu_scoped_vmem_limit_kib=20480]")


def _priced_fit(train: TrainConfig, price, prefer=None, compile_fn=None):
    mesh = make_mesh(MeshConfig(), jax.devices()[:1])
    limit = 10 * compiled_peak(_compiled(B)[1], "cpu")       # every candidate fits
    return fit_step(MODEL, train, TX, mesh, jax.random.key(0), lambda st: abstract_batch(st, B, T),
                    where="the step", limit=(limit, "given"), price=price, prefer=prefer,
                    compile_fn=compile_fn)


def _by_micro(seconds: dict[int, float]):
    """A price of each micro-batch's compiled step, told apart by its peak (the micro-batch's own,
    compiled on its own)."""
    micro_of = {compiled_peak(_compiled(m)[1], "cpu"): m for m in seconds}
    assert len(micro_of) == len(seconds)
    priced: list[int] = []

    def price(compiled):
        priced.append(micro := micro_of[compiled_peak(compiled, "cpu")])
        return seconds[micro]
    return price, priced


def test_auto_takes_the_step_estimated_fastest_among_those_that_fit():
    """``train.auto_choice=estimate``: where a larger micro-batch is estimated slower (as a v5e
    chip ran the olmo3-190m's micro-batch 4 3.8 % slower than 2), the smaller micro-batches of the
    chosen policy are compiled while each is estimated faster, and the fastest is taken; the rest
    is never compiled. Every trial priced carries its estimate into fit.json."""
    auto = replace(TRAIN, micro_batch_size="auto")
    price, priced = _by_micro({8: 1.00, 4: 0.95, 2: 0.97, 1: 0.90})
    fit = _priced_fit(auto, price)
    assert (fit.micro_batch_size, fit.chosen_by, fit.training.n_micro) == (4, "estimate", B // 4)
    # 8 fits (the memory rule's choice), 4 is faster, 2 is not: the descent stops before 1
    assert [(t.micro_batch_size, t.estimated_step_s) for t in fit.trials] == [(8, 1.00), (4, 0.95),
                                                                              (2, 0.97)]
    assert sorted(priced) == [2, 4, 8]                # each priced once
    record = fit.record()
    assert record["chosen_by"] == "estimate" and record["micro_batch_size"] == 4
    assert [t["estimated_step_s"] for t in record["trials"]] == [1.00, 0.95, 0.97]
    assert "micro-batch 4, remat none (the least estimated step time)" in fit.summary()
    assert "8/none: " in fit.summary() and ", est. 950.0 ms" in fit.summary()
    # The step it keeps is the one it chose: the same memory as micro-batch 4 compiled alone.
    assert fit.peak_bytes == compiled_peak(_compiled(4)[1], "cpu")


@pytest.mark.slow
def test_an_estimate_within_the_margin_keeps_the_memory_rule_s_choice():
    """A candidate estimated faster by no more than AUTO_MARGIN (1 %) of the step does not replace
    the largest micro-batch; auto_choice=memory and a resumed run's earlier choice price nothing."""
    auto = replace(TRAIN, micro_batch_size="auto")
    fit = _priced_fit(auto, _by_micro({8: 1.00, 4: 1 - AUTO_MARGIN / 2, 2: 1.00})[0])
    assert (fit.micro_batch_size, fit.chosen_by) == (8, "memory")
    assert [t.micro_batch_size for t in fit.trials] == [8, 4, 2]
    assert _priced_fit(auto, _by_micro({8: 1.00, 4: 1 - 2 * AUTO_MARGIN, 2: 1.00})[0]).micro_batch_size == 4
    for fit in (_priced_fit(replace(auto, auto_choice="memory"), _by_micro({8: 1.0})[0]),
                _priced_fit(auto, _by_micro({2: 1.0})[0], prefer=(2, "none"))):
        assert fit.chosen_by == "memory" and len(fit.trials) == 1
        assert fit.trials[0].estimated_step_s is None


def test_a_step_the_compiler_recomputes_competes_by_its_estimate():
    """What fits only by the compiler's own recomputation is not the memory rule's choice (fits
    as written first), but it was compiled and fits: priced, it is taken where it is estimated
    faster (on a v5e chip the olmo3-600m at micro-batch 1 without remat, fitted by the compiler's
    recomputation, took 0.845x the step of micro-batch 8 under save_kernels), and is never
    compiled again."""
    p2, p4 = compiled_peak(_compiled(2)[1], "cpu"), compiled_peak(_compiled(4)[1], "cpu")

    def recomputing(lowered):
        return _Recomputing(lowered.compile(), (p2 + p4) // 2)

    def price(compiled):     # the estimate: the recomputed programs (4 and 8) the faster
        return 0.9 if "%fusion.1.remat" in compiled.as_text() else 1.0

    fit = _priced_fit(replace(TRAIN, micro_batch_size="auto"), price, compile_fn=recomputing)
    assert (fit.micro_batch_size, fit.compiler_remat_ops, fit.chosen_by) == (8, 1, "estimate")
    # 8 and 4 recomputed, 1 and 2 as written: the memory rule's 2; then 1 is not faster
    assert [(t.micro_batch_size, t.compiler_remat_ops, t.estimated_step_s) for t in fit.trials] == [
        (8, 1, 0.9), (1, 0, 1.0), (4, 1, 0.9), (2, 0, 1.0)]
