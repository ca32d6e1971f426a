"""``olmax.perf.abtest``: interleaved worker legs, their per-round ratios, and the program hash that
tells whether two legs compiled the same program."""

import pytest

from olmax.perf.abtest import Leg, interleave, program_hash, summarise

HLO = """HloModule jit_step, entry_computation_layout={(f32[4]{0})->f32[4]{0}}

%fused_add.12 (p.1: f32[4]) -> f32[4] {
  %p.1 = f32[4]{0} parameter(0)
  ROOT %add.3 = f32[4]{0} add(f32[4]{0} %p.1, f32[4]{0} %p.1), metadata={op_name="jit(step)/add" source_file="/a/src/olmax/model/olmo3.py" source_line=10}
}

ENTRY %main.7 (x.1: f32[4]) -> f32[4] {
  %x.1 = f32[4]{0} parameter(0)
  ROOT %fusion.2 = f32[4]{0} fusion(f32[4]{0} %x.1), kind=kLoop, calls=%fused_add.12
}
"""


def test_program_hash_ignores_names_numbers_and_source_lines_only():
    renumbered = HLO.replace("fused_add.12", "fused_add.40").replace("%main.7", "%main.9")
    moved = HLO.replace('source_file="/a/src/olmax/model/olmo3.py" source_line=10',
                        'source_file="/b/src/olmax/model/kernels/cpu.py" source_line=77')
    head, fused, entry = HLO.split("\n\n")
    reordered = "\n\n".join([head, entry, fused])          # the computations in another order
    assert program_hash(HLO) == program_hash(renumbered) == program_hash(moved) == program_hash(reordered)
    assert program_hash(HLO) != program_hash(HLO.replace(" add(", " multiply("))
    assert program_hash(HLO) != program_hash(HLO.replace("f32[4]{0} parameter", "bf16[4]{0} parameter"))


def test_summarise_divides_each_round_by_the_first_leg():
    rows = summarise(["a", "b"], [[2.0, 4.0, 3.0], [1.0, 4.0, 6.0]])
    assert rows[0]["speed_vs_first_per_round"] == [1.0, 1.0, 1.0]
    assert rows[1]["speed_vs_first_per_round"] == [2.0, 1.0, 0.5]
    assert rows[1]["speed_vs_first"] == 1.0 and rows[1]["step_s_median"] == 4.0


@pytest.mark.slow
def test_two_workers_of_one_recipe_run_the_same_program(tmp_path):
    """Two real worker processes, interleaved: the same recipe gives the same program and the same
    losses; another dtype another program."""
    tiny = ["model.n_layers=2", "model.window_pattern=[16,null]", "model.vocab_size=512",
            "model.padded_vocab_size=512", "train.seq_len=32", "train.global_batch_size=2"]
    result = interleave([Leg("a", "olmo3_tiny", tiny), Leg("b", "olmo3_tiny", tiny),
                         Leg("c", "olmo3_tiny", [*tiny, "train.compute_dtype=bfloat16"])],
                        rounds=2, warmup=1, log=lambda s: None)
    a, b, c = result["rows"]
    assert a["program_hash"] == b["program_hash"] != c["program_hash"]
    assert a["losses"] == b["losses"] and len(a["losses"]) == 3 and a["losses"][2] < a["losses"][0]
    assert len(a["step_s"]) == 2 and all(r["peak_rss_bytes"] > 0 for r in (a, b, c))
