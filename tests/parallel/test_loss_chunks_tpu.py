"""The fused LM-head loss under context parallelism moves no logits between devices.

Each loss chunk's rows are the positions of every device's own block (``seq_chunks``); each
device computes its rows' logits and their gradient, and adds its rows' part of the head's gradient
to a partial of its own (``olmax.train.loss``). The 7B stage-3 step on tpu7x 4x4x4 with FSDP 64
and context 2 once kept the rows split over ``fsdp`` only and accumulated the head's gradient
sharded like the head: every chunk then computed both context halves' logits on each device and
all-gathered the whole chunk's logit gradient (``bf16[131072,100352]``, 823 GiB per device per
step with 4 layers). Here the olmo3-tiny step is compiled for the same torus and mesh: no
collective moves an array with a vocabulary dimension other than one of the head's (or the
embedding's) size -- the weights' gathers and their gradients' reductions -- and the logits each
device computes per chunk are its own rows only."""

from __future__ import annotations

import math
import re

import pytest

from olmax.perf import hlo
from olmax.perf.plan import plan
from olmax.train.recipes import load_recipe

pytestmark = [pytest.mark.tpu, pytest.mark.slow]

TOPOLOGY = "tpu7x:4x4x4"
BATCH, SEQ = 64, 2048


def test_loss_chunks_move_no_logits_under_context_parallelism(tmp_path):
    cfg = load_recipe("olmo3_tiny", [f"train.global_batch_size={BATCH}", "train.micro_batch_size=1",
                                     f"train.seq_len={SEQ}", "mesh.fsdp=64", "mesh.context=2",
                                     "model.d_model=256", f"model.max_seq_len={SEQ}",
                                     "train.compute_dtype=bfloat16"])
    out = tmp_path / "step.hlo"
    p = plan(cfg, TOPOLOGY, parts=False, hlo_out=str(out))
    text = out.read_text()
    assert p.details["mesh"] == {"data": 1, "fsdp": 64, "context": 2, "tensor": 1}
    vocab, d = cfg.model.padded_vocab_size, cfg.model.d_model
    logits_moved = []
    for ins, times in hlo.analyse(text).instructions():
        if hlo.collective_kind(ins) is None:
            continue
        for _, a in hlo.array_shapes(ins.shape):
            if vocab in a and math.prod(a) != vocab * d:     # not the head or embedding weight
                logits_moved.append((hlo.collective_kind(ins), a, times))
    assert not logits_moved, logits_moved
    # The logits of one chunk on one device: the profile's 1024 positions of its own block for
    # its one row, in fp32 (the forward pass's GEMM output).
    rows = {int(m.group(1)) for m in re.finditer(rf"f32\[(\d+),{vocab}\]", text)}
    assert rows and max(rows) == BATCH // 64 * min(1024, SEQ // 2), rows
