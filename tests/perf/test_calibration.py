"""The calibration cases (``benchmarks/calibration/*.yaml``), the script that reads them
(``benchmarks/calibration_cases.py``) and the table ``olmax plan`` reports as ``estimate.calibration``."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from olmax.hardware import BY_NAME
from olmax.perf import calibration, calibration_cases

ROOT = Path(__file__).resolve().parents[2]


CASES = ROOT / "benchmarks" / "calibration"


def test_every_case_file_matches_the_schema():
    files = sorted(CASES.glob("*.yaml"))
    assert len(files) >= 5
    for path in files:
        case = calibration_cases.validate(yaml.safe_load(path.read_text()), path.stem)
        assert case["measured"]["source"].strip()
        named = "model.preset=" if case["peer"]["program"] == "olmax" else "model_name="
        assert any(a.startswith(named) for a in case["peer"]["args"])
        if case["peer"]["program"] == "olmax" and "hlo" in case["peer"]:   # the stored program is there
            assert (CASES.parent / case["peer"]["hlo"]).is_file()
    cases = calibration_cases.load_cases(CASES)     # relative_to names a case too
    assert {"olmo3_7b_maxtext_512", "olmo3_7b_maxtext_128", "olmo3_7b_maxtext_128_heads16x256",
            "llama31_70b_tpu7x_4x4x4", "llama2_7b_h100x8", "olmo3_7b_slice_h200"} <= set(cases)


def test_an_olmax_case_names_its_stored_program():
    good = yaml.safe_load((CASES / "olmo3_7b_slice_h200.yaml").read_text())
    calibration_cases.validate(copy.deepcopy(good))
    no_hlo = copy.deepcopy(good)
    del no_hlo["peer"]["hlo"]
    maxtext_with_hlo = yaml.safe_load((CASES / "olmo3_7b_maxtext_128.yaml").read_text())
    maxtext_with_hlo["peer"]["hlo"] = "results/x.txt"
    no_model = copy.deepcopy(good)
    no_model["peer"]["args"] = [a for a in good["peer"]["args"] if not a.startswith("model.preset=")]
    for case, what in ((no_hlo, "hlo"), (maxtext_with_hlo, "hlo"), (no_model, "model.preset")):
        with pytest.raises(calibration_cases.CaseError, match=what):
            calibration_cases.validate(case)


TPU_OLMAX_CASE = {
    "name": "tiny_v5e", "accelerator": "v5e", "topology": "v5e:1x1", "devices": 1,
    "peer": {"program": "olmax", "version": "olmax", "launcher": "benchmarks/tpu.sh",
             "topology": "v5e:1x1", "recipe": "olmo3_tiny",
             "args": ["model.preset=olmo3-tiny", "train.global_batch_size=4", "train.micro_batch_size=4",
                      "train.remat=none", "train.attn_impl=auto"]},
    "measured": {"step_s": 0.01, "convention": "causal", "source": "a test's case"}}


def test_an_olmax_tpu_case_names_its_recipe_and_no_program():
    """A step measured on a TPU (benchmarks/tpu.sh writes such cases) is planned, not read from a
    stored program: it names its recipe, and no HLO."""
    calibration_cases.validate(copy.deepcopy(TPU_OLMAX_CASE))
    with_hlo = copy.deepcopy(TPU_OLMAX_CASE)
    with_hlo["peer"]["hlo"] = "results/x.txt"
    no_recipe = copy.deepcopy(TPU_OLMAX_CASE)
    del no_recipe["peer"]["recipe"]
    for case, what in ((with_hlo, "hlo"), (no_recipe, "recipe")):
        with pytest.raises(calibration_cases.CaseError, match=what):
            calibration_cases.validate(case)


@pytest.mark.tpu
@pytest.mark.slow
def test_an_olmax_tpu_case_is_estimated_by_olmax_plan(tmp_path, monkeypatch):
    """benchmarks/calibrate.py estimates such a case by olmax plan of its recipe and overrides for
    its topology (what a user's plan says), kept like a compile and reused."""
    import importlib.util

    from olmax.perf import plan as plan_module
    from olmax.train.recipes import load_recipe

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))     # its sibling modules
    spec = importlib.util.spec_from_file_location("calibrate", ROOT / "benchmarks" / "calibrate.py")
    cal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cal)
    monkeypatch.setattr(cal, "COMPILES", tmp_path)
    planned, real_plan = [], plan_module.plan   # each plan the script makes, with what it returned

    def recorded(cfg, topology, *args, **kwargs):
        planned.append((cfg, topology, args, kwargs, real_plan(cfg, topology, *args, **kwargs)))
        return planned[-1][-1]

    monkeypatch.setattr(plan_module, "plan", recorded)
    case = calibration_cases.validate(copy.deepcopy(TPU_OLMAX_CASE))
    first = cal.calibrate_case(case, "", rerun=False, compile_=True, timeout=600)
    assert first["status"] == "estimated", first
    # one plan, of the case's recipe and overrides for its topology, as a user's plan is asked
    [(cfg, topology, args, kwargs, direct)] = planned
    assert (topology, args, kwargs) == ("v5e:1x1", (), {})
    assert cfg == load_recipe("olmo3_tiny", TPU_OLMAX_CASE["peer"]["args"], find_mix=False)
    assert first["estimate"]["step_s"] == pytest.approx(direct.estimate["step_s"], rel=1e-9)
    again = cal.calibrate_case(case, "", rerun=False, compile_=False, timeout=600)   # the record
    assert again["estimate"]["step_s"] == first["estimate"]["step_s"]


def test_the_schema_refuses_what_the_script_would_not_read():
    good = yaml.safe_load((ROOT / "benchmarks" / "calibration" / "olmo3_7b_maxtext_128.yaml").read_text())
    calibration_cases.validate(copy.deepcopy(good))
    bad = []
    for path, value in ((("measured", "mfu_percent"), 44.5), (("peer", "model"), "olmo3"),
                        (("measured", "convention"), "palm"), (("accelerator",), "tpu9"),
                        (("parts", "layers"), [8, 4]), (("measured", "mfu"), 44.5)):
        case = copy.deepcopy(good)
        node = case
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        bad.append(case)
    no_model = copy.deepcopy(good)
    no_model["peer"]["args"] = [a for a in good["peer"]["args"] if not a.startswith("model_name=")]
    no_source = copy.deepcopy(good)
    del no_source["measured"]["source"]
    for case in [*bad, no_model, no_source]:
        with pytest.raises(calibration_cases.CaseError):
            calibration_cases.validate(case)
    with pytest.raises(calibration_cases.CaseError, match="file's name"):
        calibration_cases.validate(copy.deepcopy(good), "another_name")


def test_visited_pairs_agree_with_the_square_block_count():
    from olmax.model.splash import visited_blocks

    for t, w, b in ((8192, None, 2048), (8192, 4096, 2048), (8192, 4096, 512), (1000, 100, 128)):
        assert calibration_cases.visited_pairs(t, w, b, b) == visited_blocks(t, w, b)
    # rectangular blocks: causal 2048-query x 1024-key blocks over 8192 tokens
    assert calibration_cases.visited_pairs(8192, None, 2048, 1024) == 2 + 4 + 6 + 8


def test_plan_calibration_per_accelerator():
    table = {"method": "m", "generated": "2026-12-04",
             "cases": [{"case": "a", "accelerator": "tpu7x", "ratio": 1.12, "measured_step_s": 3.0,
                        "estimated_step_s": 2.68},
                       {"case": "b", "accelerator": "tpu7x", "ratio": 0.95, "measured_step_s": 1.0,
                        "estimated_step_s": 1.05},
                       {"case": "g", "accelerator": "h100", "ratio": None}]}
    cal = calibration.for_accelerator(BY_NAME["tpu7x"], table)
    assert cal["ratio_range"] == [0.95, 1.12] and [c["case"] for c in cal["cases"]] == ["a", "b"]
    assert "not applied" in calibration.summary(cal)
    # a case without an estimate does not calibrate its family; no case, no device: uncalibrated
    assert calibration.for_accelerator(BY_NAME["h100"], table) == "uncalibrated"
    assert calibration.for_accelerator(BY_NAME["v5p"], table) == "uncalibrated"
    assert calibration.for_accelerator(None, table) == "uncalibrated"


def test_shipped_table_names_existing_cases():
    """The package's table (written by calibration_cases.py) and the case files agree on every case."""
    shipped = json.loads((ROOT / "src" / "olmax" / "perf" / "calibration.json").read_text())
    names = {p.stem for p in CASES.glob("*.yaml")}
    for row in shipped["cases"]:
        assert row["case"] in names
        assert row["accelerator"] in BY_NAME
        if row["ratio"] is not None:
            assert row["ratio"] == pytest.approx(row["measured_step_s"] / row["estimated_step_s"])
    assert calibration.table() == shipped
