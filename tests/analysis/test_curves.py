"""Curve comparison on synthetic runs with a known divergence point; CSV mapping; dashboard."""

import json

import numpy as np
import pytest

from olmax.analysis.curves import compare, compare_runs, ema, load_curve, plot_comparison, write_dashboard
from olmax.errors import OlmaxError


def _loss(steps, seed=0):
    rng = np.random.default_rng(seed)
    return 8 * np.exp(-steps / 300) + 2.5 + 0.01 * rng.standard_normal(len(steps))


def _write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.fixture()
def runs(tmp_path):
    steps = np.arange(1, 1001)
    ref = _loss(steps)
    other = ref.copy()
    other[steps >= 600] *= 1.05                    # diverges by 5% from step 600 on
    _write_jsonl(tmp_path / "ref" / "metrics.jsonl",
                 [{"step": int(s), "loss": float(v), "tokens": int(s) * 4096, "lr": 1e-3} for s, v in zip(steps, ref)])
    # the other run logged every 2nd step, and step 10 twice (a resume): the last value wins
    rows = [{"step": int(s), "loss": float(v), "tokens": int(s) * 4096} for s, v in zip(steps, other) if s % 2 == 0]
    rows.insert(4, {"step": 10, "loss": 99.0, "tokens": 40960})  # before the real step 10
    _write_jsonl(tmp_path / "other" / "metrics.jsonl", rows)
    return tmp_path, steps, ref, other


def test_known_divergence_point(runs):
    tmp, steps, ref, other = runs
    a, b = load_curve(tmp / "ref"), load_curve(tmp / "other")
    assert (a.name, b.name) == ("ref", "other") and len(b.x) == 500
    comp = compare(a, b, threshold=0.01)
    assert comp["first_divergence"] == 600.0 and comp["aligned_points"] == 500 and not comp["interpolated"]
    np.testing.assert_allclose(comp["max_rel_diff"], 0.05, rtol=1e-9)
    assert comp["windows"][0]["max_abs_diff"] == 0.0          # identical before the divergence
    np.testing.assert_allclose(comp["windows"][-1]["mean_rel_diff"], 0.05, rtol=1e-9)
    # EMA 0.9 on both: the smoothed gap reaches 1% after a few points of the sparser run
    sm = compare(a, b, threshold=0.01, smooth=0.9)
    assert 600 < sm["first_divergence"] <= 610
    # absolute threshold beyond the gap: no divergence
    assert compare(a, b, threshold=1.0, relative=False)["first_divergence"] is None


def test_align_by_tokens_and_interpolation(runs, tmp_path):
    tmp, *_ = runs
    a, b = load_curve(tmp / "ref", x="tokens"), load_curve(tmp / "other", x="tokens")
    assert compare(a, b)["first_divergence"] == 600 * 4096
    shifted = load_curve(tmp / "other", x="tokens")
    shifted.x = shifted.x + 1                                   # no common x: interpolate
    comp = compare(a, shifted)
    assert comp["interpolated"] and comp["first_divergence"] is not None


def test_csv_with_column_mapping(runs, tmp_path):
    tmp, steps, ref, _ = runs
    csv = tmp_path / "wandb.csv"
    csv.write_text("_step,train/CE loss,other\n" + "".join(f"{s},{float(v)!r},x\n" for s, v in zip(steps, ref)))
    c = load_curve(csv, columns={"step": "_step", "loss": "train/CE loss"})
    np.testing.assert_array_equal(c.y, ref)
    assert compare(load_curve(tmp / "ref"), c)["max_abs_diff"] == 0.0
    with pytest.raises(OlmaxError, match=r"no column 'train/loss'"):
        load_curve(csv, columns={"loss": "train/loss"})
    with pytest.raises(OlmaxError, match=r"no 'step' values.*--map step=COLUMN"):
        load_curve(csv)


def test_ema_tensorboard_convention():
    np.testing.assert_allclose(ema(np.array([1.0, 3.0, 3.0]), 0.5), [1.0, 2.0, 2.5])
    with pytest.raises(OlmaxError):
        ema(np.array([1.0]), 1.0)


def test_plot_and_dashboard(runs, tmp_path):
    tmp, *_ = runs
    curves = [load_curve(tmp / "ref"), load_curve(tmp / "other")]
    summary = compare_runs(curves, threshold=0.01)
    out = plot_comparison(curves, summary, tmp_path / "cmp.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(OlmaxError, match="already exists"):
        plot_comparison(curves, summary, out)
    rows = [{"step": s, "loss": 3.0 - s / 100, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 1e4}
            for s in range(1, 50)]
    rows += [{"step": 25, "eval/lm/heldout/CE loss": 2.6, "eval/downstream/arc (BPB v2)": 3.1}]
    _write_jsonl(tmp_path / "run" / "metrics.jsonl", rows)
    dash = write_dashboard(tmp_path / "run")
    assert dash == tmp_path / "run" / "dashboard.png" and dash.stat().st_size > 10_000
