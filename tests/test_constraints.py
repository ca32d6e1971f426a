"""The two interpreter lines pin the same versions except the jax line (and libtpu, 3.12 only), so a
dependency added to one constraints file cannot be left unpinned in the other."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINE_SPECIFIC = {"jax", "jaxlib", "libtpu"}


def _pins(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            pkg, _, version = line.partition("==")
            pins[pkg.lower().replace("_", "-")] = version
    return pins


def test_constraints_lines_agree():
    py311, py312 = _pins("constraints.txt"), _pins("constraints-py312.txt")
    assert (py311["jax"], py311["jaxlib"]) == ("0.10.2", "0.10.2")
    assert (py312["jax"], py312["jaxlib"], py312["libtpu"]) == ("0.12.0.1", "0.12.0.1", "0.0.52")
    assert "libtpu" not in py311
    assert {k: v for k, v in py311.items() if k not in LINE_SPECIFIC} == \
        {k: v for k, v in py312.items() if k not in LINE_SPECIFIC}
