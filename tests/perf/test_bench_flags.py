"""``olmax bench profile`` refuses a step or op count below 1 at once, before the recipe is
compiled (it used to compile and warm up, then fail on an empty profile)."""

from __future__ import annotations

import pytest

from olmax.cli import main


@pytest.mark.parametrize("flag,value", [("--steps", "0"), ("--steps", "-3"), ("--top", "0")])
def test_profile_counts_below_one_are_refused_first(capsys, flag, value):
    assert main(["bench", "profile", "olmo3_tiny", flag, value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{flag} must be >= 1 (got {value})" in err, err
