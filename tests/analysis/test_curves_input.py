"""``olmax curves`` on malformed sources: each bad line or row is named by its number (never
dropped without a word), a UTF-8 byte-order mark is read through, and a threshold that is not a
finite number >= 0 is refused; one line, exit 2, never an internal error."""

from __future__ import annotations

import re

import pytest

from olmax.cli import main

GOOD = '{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n'


def _err(capsys, argv):
    rc = main(argv)
    err = capsys.readouterr().err
    return rc, err


@pytest.mark.parametrize("text,name,expect", [
    (GOOD + '[1, 2]\n{"step": 4, "loss": 2.0}\n', "m.jsonl", r"m.jsonl: line 3 is not a JSON object"),
    (GOOD + '{"step": 3, "loss": "high"}\n', "m.jsonl", r"m.jsonl: line 3: loss 'high' is not a number"),
    (GOOD + '{"step": "three", "loss": 2.0}\n', "m.jsonl", r"m.jsonl: line 3: step 'three' is not a number"),
    (GOOD + '{"step": 1' + "0" * 400 + ', "loss": 2.0}\n', "m.jsonl",
     r"m.jsonl: line 3: step 1000.* is beyond the range of a float"),
    (GOOD + '{"step": 1e999, "loss": 2.0}\n', "m.jsonl", r"m.jsonl: line 3: step inf is not finite"),
    (GOOD + '{"step": 1' + "0" * 5000 + ', "loss": 2.0}\n', "m.jsonl", r"m.jsonl: line 3 is not JSON"),
    ("step,loss\n1,3.0\n2,2.5,9\n3,2.0\n", "m.csv", r"m.csv: line 3 has 3 fields, the header 2"),
    ("step,loss\n1,3.0\n2\n", "m.csv", r"m.csv: line 3 has 1 fields, the header 2"),
    ("step,loss\n1,3.0\n2,abc\n", "m.csv", r"m.csv: line 3: loss 'abc' is not a number"),
])
def test_a_malformed_line_is_named_by_its_number(tmp_path, capsys, text, name, expect):
    src = tmp_path / name
    src.write_text(text)
    rc, err = _err(capsys, ["curves", str(src)])
    assert rc == 2 and err.count("\n") == 1, err
    assert re.search(expect, err), err


@pytest.mark.parametrize("name,text", [("m.jsonl", GOOD), ("m.csv", "step,loss\n1,3.0\n2,2.5\n")])
def test_a_byte_order_mark_is_read_through(tmp_path, capsys, name, text):
    src = tmp_path / name
    src.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert main(["curves", str(src)]) == 0
    assert "2 points, final loss 2.5" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["nan", "inf", "-0.5"])
def test_a_threshold_that_is_not_a_finite_non_negative_number_is_refused(tmp_path, capsys, value):
    src = tmp_path / "m.jsonl"
    src.write_text(GOOD)
    rc, err = _err(capsys, ["curves", str(src), str(src), "--threshold", value])
    assert rc == 2 and err.count("\n") == 1 and "--threshold must be a finite number >= 0" in err, err
