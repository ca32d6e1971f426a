"""``olmax bench``: the training benchmark's figures are consistent with the FLOPs accounting, and
the CLI writes JSON atomically and refuses to overwrite."""

from __future__ import annotations

import json

import pytest

from olmax.cli import main
from olmax.model.flops import flops_per_token
from olmax.train.recipes import load_recipe

TINY = ["model.vocab_size=120", "model.padded_vocab_size=128", "train.global_batch_size=2",
        "train.seq_len=96", "train.attn_impl=chunked"]


def test_bench_train_figures(tmp_path):
    from olmax.perf.bench import bench_train

    cfg = load_recipe("olmo3_tiny", TINY)
    r = bench_train(cfg, steps=2, warmup=1, ceiling_flops=1e12)
    assert r.platform == "cpu" and r.batch == 2 and r.seq_len == 96 and r.attn_impl == "chunked"
    assert r.profile == "cpu"
    assert r.tokens_per_s == pytest.approx(2 * 96 / r.step_s)
    assert r.step_s_min <= r.step_s <= max(r.step_s_mean * 2, r.step_s)
    assert r.flops_per_token_olmo_core == flops_per_token(cfg.model, 96, "olmo_core")
    assert r.flops_per_token_causal == flops_per_token(cfg.model, 96, "causal")
    assert r.pct_of_ceiling_causal == pytest.approx(r.tokens_per_s * r.flops_per_token_causal / 1e12)
    assert r.mfu_causal is None and r.mfu_olmo_core is None      # no peak for a CPU
    assert r.compile_s > 0 and r.peak_memory_bytes > 0
    assert 4.0 < r.final_loss < 6.0                               # ~ln(120) at initialisation


def test_a_row_that_did_not_raise_the_runtime_counter_has_no_peak_of_its_own():
    """The allocator's peak counts since the process started: a second, smaller row of one
    process would read the first row's peak; it reads nothing, saying why."""
    from olmax.perf.bench import row_peak

    kind = "device allocator's peak_bytes_in_use (runtime counter)"
    assert row_peak(0, 7 << 30, kind) == (7 << 30, kind)             # the process's first row
    assert row_peak(None, 5 << 30, kind) == (5 << 30, kind)          # no counter before it
    assert row_peak(7 << 30, 9 << 30, kind) == (9 << 30, kind)       # raised it: its own peak
    peak, why = row_peak(7 << 30, 7 << 30, kind)                     # did not: an earlier one's
    assert peak is None and why == ("not observable: device allocator's peak_bytes_in_use "
                                    "(runtime counter) kept an earlier, larger peak of this "
                                    "process (7.00 GiB)")
    assert row_peak(1 << 30, None, kind) == (None, kind)


def test_bench_matmul_cli_json(tmp_path, capsys):
    out = tmp_path / "mm.json"
    assert main(["bench", "matmul", "--size", "128", "--iters", "2", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["size"] == 128 and r["dtype"] == "float32" and r["flops_per_s"] > 0
    assert r["peak_flops"] is None
    assert "TFLOP/s" in capsys.readouterr().out
    # An existing output is never overwritten without --force.
    assert main(["bench", "matmul", "--size", "64", "--iters", "1", "--json", str(out)]) == 2
    assert json.loads(out.read_text())["size"] == 128
    assert "already exists" in capsys.readouterr().err


def test_bench_train_bad_override(capsys):
    assert main(["bench", "train", "olmo3_tiny", "train.no_such_key=1", "--steps", "1"]) == 2
    assert "no_such_key" in capsys.readouterr().err


@pytest.mark.slow
def test_interleaved_legs_step_one_shared_state(tmp_path, capsys):
    """``olmax bench ab``: two legs of the same settings step one training state in turn, so their
    (1 warm-up + 2 rounds) x 2 = 6 steps are the 6 steps of one runner, loss for loss; a leg of
    another micro-batch compiles its own program; the JSON names each leg's settings. A compile
    budget that is not spent drops no leg."""
    from olmax.perf.bench import TrainStepRunner, interleave_steps

    cfg = load_recipe("olmo3_tiny", TINY)
    res = interleave_steps({"a": cfg, "b": cfg}, rounds=2, warmup=1, compile_budget_s=1e6)
    alone = TrainStepRunner(cfg)
    losses = []
    for _ in range(6):
        alone.run()
        losses.append(float(alone.metrics["loss"]))
    assert res["b"]["loss"] == losses[-1] and res["a"]["loss"] == losses[-2]
    assert res["a"]["ratio_to_first"] == 1.0 and len(res["b"]["steps_s"]) == 2
    out = tmp_path / "ab.json"
    assert main(["bench", "ab", "olmo3_tiny", *TINY, "--leg", "one", "--leg", "two",
                 "train.micro_batch_size=1", "--rounds", "1", "--json", str(out)]) == 0
    legs = json.loads(out.read_text())["legs"]
    assert (legs["one"]["micro_batch_size"], legs["two"]["micro_batch_size"]) == (2, 1)
    assert legs["two"]["overrides"] == ["train.micro_batch_size=1"]
    assert "| two | train.micro_batch_size=1 | 1 |" in capsys.readouterr().out


def test_bench_ab_needs_two_named_legs(capsys):
    assert main(["bench", "ab", "olmo3_tiny", "--leg", "only"]) == 2
    assert "at least two legs" in capsys.readouterr().err
    assert main(["bench", "ab", "olmo3_tiny", "--leg", "a", "--leg", "a"]) == 2


def test_a_spent_compile_budget_measures_the_legs_already_compiled(tmp_path, capsys):
    """``--compile-budget-s 0``: the first leg (it holds the state) is compiled and measured; the
    others are reported as not compiled, in the table and the JSON, and the command succeeds
    (a command under a time limit keeps what it compiled)."""
    out = tmp_path / "ab.json"
    assert main(["bench", "ab", "olmo3_tiny", *TINY, "--leg", "one", "--leg", "two",
                 "train.micro_batch_size=1", "--rounds", "1", "--warmup", "0",
                 "--compile-budget-s", "0", "--json", str(out)]) == 0
    legs = json.loads(out.read_text())["legs"]
    assert legs["one"]["ratio_to_first"] == 1.0 and len(legs["one"]["steps_s"]) == 1
    assert legs["two"]["error"].startswith("not compiled: ") and "compile budget of 0 s" in legs["two"]["error"]
    assert "| two | train.micro_batch_size=1 | not compiled: " in capsys.readouterr().out


def test_bench_ab_compile_budget_must_be_seconds(capsys):
    for bad in ("-1", "nan"):
        assert main(["bench", "ab", "olmo3_tiny", "--leg", "a", "--leg", "b",
                     "--compile-budget-s", bad]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "--compile-budget-s must be a number of seconds >= 0" in err, err
