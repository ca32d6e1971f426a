"""Float8 dense layers under FSDP on a TPU with float8 matmuls: the weights are gathered in float8.

Compiled ahead of time for tpu7x 2x2x1 (olmo3-tiny, bf16, FSDP over the 4 devices): every layer
weight the step all-gathers moves as ``f8e4m3fn`` (each device casts its shard with the weight's
global scale, an all-reduce of its amax, before the gather, as torchao's
``enable_fsdp_float8_all_gather``); the embedding and LM head, which OLMo-core leaves in high
precision, move as bf16; the three GEMMs of every dense layer take float8 operands (e4m3 x e4m3
forward, e5m2 x e4m3 grad input, e4m3 x e5m2 grad weight)."""

from __future__ import annotations

import re
from collections import Counter

import pytest

from olmax.perf.plan import plan
from olmax.train.recipes import load_recipe

pytestmark = [pytest.mark.tpu, pytest.mark.slow]

TOPOLOGY = "tpu7x:2x2x1"
OVERRIDES = ["train.global_batch_size=8", "train.micro_batch_size=1", "train.seq_len=128",
             "train.compute_dtype=bfloat16"]


def _compiled(tmp_path, float8: bool):
    cfg = load_recipe("olmo3_tiny", [*OVERRIDES, f"train.float8={str(float8).lower()}"])
    out = tmp_path / f"step-{float8}.hlo"
    plan(cfg, TOPOLOGY, parts=False, hlo_out=str(out))
    return cfg, out.read_text()


def _gathers(text: str, vocab: int) -> Counter:
    """(embedding/LM head or layer weight, dtype) -> how many all-gathers."""
    found = re.findall(r"= \(?(\w+)\[([\d,]*)\][^=\n]*? all-gather(?:-start)?\(", text)
    return Counter(("vocab" if str(vocab) in shape.split(",") else "layer", dtype)
                   for dtype, shape in found)


def _dot_operand_types(text: str) -> Counter:
    """(lhs dtype, rhs dtype) of every dot and convolution, operands looked up in their computation."""
    out: Counter = Counter()
    for comp in re.split(r"\n(?=\S)", text):
        defs = dict(re.findall(r"\n\s*(?:ROOT )?(%[\w.\-]+) = (\w+)\[", comp))
        for a, b in re.findall(r"\n\s*(?:ROOT )?%[\w.\-]+ = \w+\[[^\n]*? (?:dot|convolution)"
                               r"\((%[\w.\-]+), (%[\w.\-]+)\)", comp):
            out[(defs.get(a), defs.get(b))] += 1
    return out


def test_fsdp_gathers_float8_weights_on_tpu7x(tmp_path):
    cfg, bf16 = _compiled(tmp_path, False)
    _, fp8 = _compiled(tmp_path, True)
    vocab = cfg.model.padded_vocab_size
    assert set(_gathers(bf16, vocab)) == {("layer", "bf16"), ("vocab", "bf16")}
    assert set(_gathers(fp8, vocab)) == {("layer", "f8e4m3fn"), ("vocab", "bf16")}
    dots = _dot_operand_types(fp8)
    for pair in (("f8e4m3fn", "f8e4m3fn"), ("f8e5m2", "f8e4m3fn"), ("f8e4m3fn", "f8e5m2")):
        assert dots[pair] > 0, dots
    assert not any("f8" in str(k) for k in _dot_operand_types(bf16))
