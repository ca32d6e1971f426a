"""``olmax plan`` for a TPU topology (libtpu compiles for it on this CPU-only machine), and the
splash kernel compiled by Mosaic inside the real training step."""

from __future__ import annotations

import json

import pytest

from olmax.cli import main
from olmax.model.flops import flops_per_token
from olmax.model.params import count_params
from olmax.train.recipes import load_recipe

pytestmark = pytest.mark.tpu

KEYS = {"topology", "num_devices", "device_kind", "attn_impl", "remat", "global_batch_size", "seq_len",
        "memory", "flops_per_step", "estimate", "collectives", "compile_s"}
OVERRIDES = ["train.attn_impl=auto", "train.global_batch_size=8", "train.micro_batch_size=1"]


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    rc = main(["plan", "olmo3_tiny", "--topology", "v5e:2x2", *OVERRIDES, "--json", str(out)])
    assert rc == 0
    return json.loads(out.read_text())


def test_plan_json_contract(tiny_plan):
    p = tiny_plan
    assert KEYS <= set(p)
    assert set(p["memory"]) >= {"argument_bytes", "output_bytes", "temp_bytes", "alias_bytes",
                                "code_bytes", "peak_bytes", "hbm_bytes", "fits"}
    assert set(p["flops_per_step"]) >= {"olmo_core", "causal", "xla"}
    assert set(p["estimate"]) >= {"method", "compute_s", "kernel_s", "collective_s", "step_s",
                                  "step_s_no_overlap", "tokens_per_s_per_chip", "mfu_olmo_core",
                                  "mfu_causal"}
    assert all(set(c) >= {"kind", "count", "bytes"} for c in p["collectives"])
    assert (p["topology"], p["num_devices"], p["device_kind"]) == ("v5e:2x2", 4, "TPU v5 lite")
    assert (p["attn_impl"], p["global_batch_size"], p["seq_len"]) == ("splash", 8, 128)


def test_plan_memory_is_consistent(tiny_plan):
    m = tiny_plan["memory"]
    # libtpu's compile-time limit for a v5e device ("available HBM (15.75G)"), not the nominal 16 GiB
    assert m["hbm_bytes"] == 16_908_218_368 and m["fits"] is True
    # The state is donated: every output aliases an argument of the same size.
    assert m["alias_bytes"] > 0 and m["alias_bytes"] <= min(m["argument_bytes"], m["output_bytes"])
    assert m["peak_bytes"] >= m["argument_bytes"] + m["temp_bytes"] - m["alias_bytes"]
    assert m["peak_bytes"] < m["hbm_bytes"]
    # fp32 parameters + Adam mu/nu, FSDP over 4 devices: arguments hold about 12 bytes/param / 4.
    cfg = load_recipe("olmo3_tiny", OVERRIDES)
    n = count_params(cfg.model)
    assert 12 * n / 4 <= m["argument_bytes"] <= 1.2 * 12 * n / 4 + 2 ** 20


@pytest.fixture(scope="module")
def v5p_plan(tmp_path_factory):
    """The same step on four v5p chips: a generation without a rates table measured on its chip,
    priced by XLA's cost model over the unscanned parts."""
    out = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main(["plan", "olmo3_tiny", "--topology", "v5p:2x2x1", *OVERRIDES, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def _flops_and_collectives(p):
    cfg = load_recipe("olmo3_tiny", OVERRIDES)
    f = p["flops_per_step"]
    tokens = 8 * 128
    assert f["olmo_core"] == pytest.approx(flops_per_token(cfg.model, 128, "olmo_core") * tokens / 4)
    assert f["causal"] == pytest.approx(flops_per_token(cfg.model, 128, "causal") * tokens / 4)
    e = p["estimate"]
    assert e["step_s"] > 0 and e["tokens_per_s_per_chip"] == pytest.approx(tokens / 4 / e["step_s"])
    assert 0 < e["mfu_causal"] <= e["mfu_olmo_core"] < 1
    assert "collectives timed" in e["method"]
    # timed collectives: the step overlaps the asynchronous ones with compute
    ct = p["details"]["collective_time"]
    assert e["collective_s"] == pytest.approx(ct["async_s"] + ct["sync_s"]) and e["collective_s"] > 0
    assert e["step_s_no_overlap"] == pytest.approx(e["compute_s"] + e["collective_s"])
    assert e["step_s"] == pytest.approx(max(e["compute_s"], ct["async_s"]) + ct["sync_s"])
    kinds = {c["kind"]: c for c in p["collectives"]}
    assert kinds["all-gather"]["count"] > 0 and kinds["all-gather"]["bytes"] > 0   # FSDP gathers
    assert p["compile_s"] > 0


@pytest.mark.slow
def test_plan_flops_and_estimate_from_the_cost_model(v5p_plan):
    p = v5p_plan
    _flops_and_collectives(p)
    f = p["flops_per_step"]
    # XLA's count (parts + kernels) adds elementwise work and the kernels' masked blocks but no
    # remat (remat=none here): a little above the model FLOPs, far from the 2x undercount of
    # counting the micro-batch loop once.
    assert 1.0 < f["xla"] / f["causal"] < 1.3
    e = p["estimate"]
    assert e["method"].startswith("estimate: XLA TPU cost model")
    assert "(2 groups - 1 group)" in e["method"]
    assert set(p["details"]["parts"]) == {"one_layer_group", "two_layer_groups", "optimizer"}
    # the splash matmuls of a 16-wide head dimension (d_model 64, 4 heads) against 128-wide
    # blocks keep 16/128 of v5p's 128 x 128 MXU busy: priced at 8x their FLOPs
    d = p["details"]
    assert d["kernel_flops_at_mxu_occupancy"] == pytest.approx(8 * d["kernel_flops"])
    # ... at v5p's sustained matrix rate (its cost model's, 394 TFLOP/s per device)
    assert e["kernel_s"] == pytest.approx(8 * d["kernel_flops"] / 394e12)
    assert "Pallas kernels at their FLOPs / (394.0 TFLOP/s" in e["method"]


def test_plan_estimate_from_the_rates_measured_on_a_v5e_chip(tiny_plan):
    """v5e has a rates table measured on its chip: the compiled step is priced op by op from it,
    and no parts are compiled."""
    from olmax.hardware import BY_NAME
    from olmax.perf import gpu_estimate

    p = tiny_plan
    _flops_and_collectives(p)
    e, d = p["estimate"], p["details"]
    assert e["method"].startswith("estimate: every op of the compiled step priced from a table")
    assert "TPU v5 lite" in e["method"] and "parts" not in d and p["flops_per_step"]["xla"] is None
    by = d["tpu_kernels"]["by_kind"]
    assert e["kernel_s"] == pytest.approx(by["attention"]["seconds"]) and by["attention"]["kernels"] == 16
    assert e["compute_s"] == pytest.approx(sum(v["seconds"] for k, v in by.items() if k != "async"))
    # the kernels' FLOPs are those the plan counts from the step (every visited block pair)
    assert by["attention"]["flops"] == pytest.approx(d["kernel_flops"])
    rates = gpu_estimate.rates_for(BY_NAME["v5e"])
    assert e["kernel_s"] >= d["kernel_flops"] / max(r["bwd_flops_per_s"] for r in rates.table["attention"])


def test_splash_kernels_in_the_compiled_step(tiny_plan):
    """4 layers x 2 micro-batches (8 sequences on 4 devices, 1 per micro-step): every layer runs the
    forward kernel and the fused backward kernel (dk, dv and dq in one, ``train.splash_fused_bwd``)
    once per micro-batch (counted through the loop's trip count); no dq kernel runs. Their FLOPs
    are 2 matmuls a block pair forward and 5 backward: 7 / 2 of the forward's."""
    from olmax.model.splash import visited_blocks

    assert tiny_plan["details"]["n_micro"] == 2
    assert tiny_plan["details"]["kernel_calls"] == {"fwd": 8, "dkv": 8}
    # olmo3_tiny at sequence 128: one 128-block, 4 query heads of 16, windows (64, 64, 64, full):
    # every layer visits the one block pair; per device 1 sequence a micro-batch
    assert visited_blocks(128, 64, 128) == visited_blocks(128, None, 128) == 1
    fwd = 2 * 2 * 128 * 128 * 16 * 1 * 4 * 1
    assert tiny_plan["details"]["kernel_flops"] == 8 * fwd * 7 // 2


# Published measurements of a large bf16 GEMM per JAX device, where one exists: Ironwood, m = n = k
# = 32,768 (AI-Hypercomputer/accelerator-microbenchmarks, Ironwood_Microbenchmarks_readme.md).
PUBLISHED_GEMM = {"tpu7x": 956.38e12}


@pytest.mark.parametrize("name,topology", [("v5e", "v5e:2x2"), ("v5p", "v5p:2x2x1"),
                                           ("v6e", "v6e:2x2"), ("tpu7x", "tpu7x:2x2x1")])
def test_sustained_matrix_rate_is_the_cost_models_or_a_lower_measurement(name, topology):
    """The rate a Pallas kernel's matmuls are priced at is the lower of the rate libtpu's own cost
    model gives an 8192-cube bf16 product on one device and the published measurement: never above
    what the compiler prices the parts around the kernel at."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from olmax.hardware import BY_NAME
    from olmax.perf.costs import cost
    from olmax.perf.targets import topology_devices

    device = topology_devices(topology)[0]
    n = 8192
    x = jax.ShapeDtypeStruct((n, n), jnp.bfloat16,
                             sharding=NamedSharding(Mesh(np.asarray([device]), ("x",)), P()))
    seconds = cost(jax.jit(jnp.matmul).lower(x, x).compile())["optimal_seconds"]
    cost_model_rate = 2 * n ** 3 / seconds
    acc = BY_NAME[name]
    assert acc.mxu_bf16 <= cost_model_rate * (1 + 1e-6) and acc.mxu_bf16 <= acc.peak_bf16
    assert acc.mxu_bf16 == pytest.approx(min(cost_model_rate, PUBLISHED_GEMM.get(name, np.inf)), rel=1e-4)
    assert acc.matmul_rate == acc.mxu_bf16


@pytest.mark.slow
def test_a_stored_plan_repriced_is_the_plan_at_the_new_rate(v5p_plan, tiny_plan, monkeypatch):
    """``benchmarks/reprice_plans.py`` redoes a stored plan's estimate as ``olmax plan`` combines
    it: at the rate the plan was made with, every figure comes back; at half that rate the kernels
    take twice as long and the compute, step, tokens/s and MFU follow. A plan priced from a
    measured rates table (v5e) has no such rate and is left as it is."""
    import copy
    import dataclasses
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "reprice_plans.py"
    spec = importlib.util.spec_from_file_location("reprice_plans", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    keys = ("kernel_s", "compute_s", "step_s", "step_s_no_overlap", "tokens_per_s_per_chip",
            "mfu_olmo_core", "mfu_causal")
    measured = copy.deepcopy(tiny_plan)
    assert mod.reprice(measured) is None and measured == tiny_plan
    e0 = v5p_plan["estimate"]
    same = copy.deepcopy(v5p_plan)
    assert mod.reprice(same) is not None
    assert all(same["estimate"][k] == pytest.approx(e0[k], rel=1e-12) for k in keys)
    assert same["estimate"]["method"] == e0["method"]

    v5p = mod.accelerator_of(v5p_plan["device_kind"])
    monkeypatch.setattr(mod, "accelerator_of", lambda kind: dataclasses.replace(v5p, mxu_bf16=394e12 / 2))
    half = copy.deepcopy(v5p_plan)
    mod.reprice(half)
    e, ct = half["estimate"], v5p_plan["details"]["collective_time"]
    assert e["kernel_s"] == pytest.approx(2 * e0["kernel_s"])
    assert e["compute_s"] == pytest.approx(e0["compute_s"] + e0["kernel_s"])
    assert e["step_s"] == pytest.approx(max(e["compute_s"], ct["async_s"]) + ct["sync_s"])
    assert e["mfu_causal"] * e["step_s"] == pytest.approx(e0["mfu_causal"] * e0["step_s"])
    assert e["tokens_per_s_per_chip"] * e["step_s"] == pytest.approx(e0["tokens_per_s_per_chip"] * e0["step_s"])
    assert "(197.0 TFLOP/s, the device's sustained matrix rate" in e["method"]
    assert e["repriced"]["before"]["step_s"] == e0["step_s"]


@pytest.mark.slow
def test_a_kernel_over_the_cores_vmem_is_one_line(capsys, tmp_path):
    """libtpu's own refusal of a kernel whose blocks overflow a v5e core's scoped VMEM (splash at
    blocks of 2,048, heads of 64: 19.9 MiB of libtpu's default 16, as the chip refused it) names
    the kernel, its need and the limit, and the settings that lower it or raise the limit; never
    "0.0 MiB of device memory". At v5e's own limit in olmax (32 MiB, the hardware table's
    ``compiler_options``), the step compiles: the table's option reaches the compiler."""
    args = ["model.d_model=256", "model.n_heads=4", "model.n_kv_heads=4", "model.head_dim=64",
            "model.max_seq_len=4096", "model.window_pattern=[null]", "train.seq_len=4096",
            "train.global_batch_size=1", "train.compute_dtype=bfloat16", "train.attn_impl=auto",
            "train.splash_block=2048", "train.unroll_layers=false"]   # the layer loop the chip ran
    libtpu_default = "train.compiler_options=[xla_tpu_scoped_vmem_limit_kib=16384]"
    assert main(["plan", "olmo3_tiny", "--topology", "v5e:1x1", "--no-parts", *args, libtpu_default]) == 1
    line = capsys.readouterr().out.strip()
    assert line == ("olmax plan: does not fit: the step (v5e:1x1 x1, batch 1 x 4096, micro-batch "
                    "whole, remat=none): its kernel splash_mha_fwd_residuals needs 19.9 MiB of on-chip "
                    "vector memory (VMEM) per device, 16.0 MiB available; to lower it: "
                    "train.splash_block (a smaller block); or raise it to at least 20 MiB: "
                    "train.compiler_options=[xla_tpu_scoped_vmem_limit_kib=20480]")
    # v5e's own option reaches the compiler of the step: 32 MiB of scoped VMEM holds every kernel
    out = tmp_path / "plan.json"
    assert main(["plan", "olmo3_tiny", "--topology", "v5e:1x1", "--no-parts", *args,
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["details"]["compiler_options"] == {
        "xla_tpu_scoped_vmem_limit_kib": "32768"}


def test_plan_one_line_errors(tmp_path, capsys):
    assert main(["plan", "olmo3_tiny", "--topology", "v9z:2x2"]) == 2
    assert main(["plan", "olmo3_tiny", "--topology", "v5e:2x2", "mesh.fsdp=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "unknown TPU topology 'v9z:2x2'" in err[0] and "mesh:" in err[1]
    out = tmp_path / "oom.json"
    assert main(["plan", "olmo3_tiny", "--topology", "v5e:1x1", "model.vocab_size=8000000",
                 "model.padded_vocab_size=8000000", "train.seq_len=64", "--json", str(out)]) == 1
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and line.startswith("olmax plan: does not fit:") and "GiB available" in line
    mem = json.loads(out.read_text())["memory"]
    assert mem["fits"] is False and mem["peak_bytes"] > mem["hbm_bytes"] > 15 * 2 ** 30


def test_mesh_over_a_topology_is_in_physical_order():
    """The plan's mesh orders a topology's devices as a real slice's mesh is ordered: by their
    chips' torus coordinates, a chip's two cores side by side, so that an axis of the mesh runs
    along physical links (the order the topology lists them in goes host block by host block)."""
    from olmax.config import MeshConfig
    from olmax.parallel.mesh import make_mesh
    from olmax.perf.targets import topology_devices

    devices = topology_devices("tpu7x:4x4x4")
    key = lambda d: (*d.coords, d.core_on_chip)  # noqa: E731
    order = list(make_mesh(MeshConfig(), devices).devices.flat)
    assert [d.id for d in order] == [d.id for d in sorted(devices, key=key)]
    assert [d.id for d in devices] != [d.id for d in order]
    tensor2 = make_mesh(MeshConfig(fsdp=-1, tensor=2), devices).devices
    assert all(a.coords == b.coords for a, b in tensor2.reshape(-1, 2))   # tensor pairs: one chip


def test_cpu_plan_beside_libtpu_prints_nothing_of_libtpus(tmp_path):
    """libtpu installed, no TPU attached: a plan for the local devices (or a GPU target) starts
    JAX's backends, libtpu's among them; it is told there is no TPU first, so none of its
    warnings about accelerator types or worker hostnames reach the terminal."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "JAX_PLATFORMS", "XLA_FLAGS"))}
    proc = subprocess.run([sys.executable, "-m", "olmax.cli", "plan", "olmo3_tiny", "--no-parts",
                           "train.seq_len=32", "train.global_batch_size=2"], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == "" and "peak vs HBM" in proc.stdout, proc.stderr


def test_libtpu_refusing_a_flag_is_one_line_and_its_noise_is_hidden():
    """libtpu ends the process itself on a flag it does not know: the user gets one line naming
    the flag (not an exit with nothing said), and a plan that compiles prints none of libtpu's
    start-up warnings."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "JAX_PLATFORMS", "XLA_FLAGS"))}
    cmd = [sys.executable, "-m", "olmax.cli", "plan", "olmo3_tiny", "--topology", "v5e:2x2",
           "--no-parts", "train.seq_len=32", "train.global_batch_size=4"]
    bad = subprocess.run(cmd, env={**env, "LIBTPU_INIT_ARGS": "--xla_no_such_flag=1"},
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode != 0 and bad.stdout == ""
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "'--xla_no_such_flag'" in lines[0] and "LIBTPU_INIT_ARGS" in lines[0], \
        bad.stderr
    good = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert good.returncode == 0, good.stderr
    assert good.stderr.strip() == "" and "peak vs HBM" in good.stdout, good.stderr


def test_mistyped_topology_beside_libtpu(capsys):
    assert main(["plan", "olmo3_tiny", "--topology", "banana:2x2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unknown TPU topology 'banana:2x2' (no TPU generation 'banana'" in err


def test_plan_takes_the_accelerator_type_launch_takes(tiny_plan, tmp_path):
    """``v5litepod-4`` (as ``olmax launch`` names a slice) is ``v5e:2x2``: the same compiled step
    (its parts, the estimate's programs, are not compiled again)."""
    out = tmp_path / "plan.json"
    assert main(["plan", "olmo3_tiny", "--topology", "v5litepod-4", "--no-parts", *OVERRIDES,
                 "--json", str(out)]) == 0
    p = json.loads(out.read_text())
    assert (p["topology"], p["num_devices"], p["device_kind"]) == ("v5litepod-4", 4, "TPU v5 lite")
    assert p["memory"]["peak_bytes"] == tiny_plan["memory"]["peak_bytes"]
    assert p["memory"]["hbm_fraction"] == tiny_plan["memory"]["hbm_fraction"] == 1.0
    for key in ("olmo_core", "causal"):
        assert p["flops_per_step"][key] == tiny_plan["flops_per_step"][key]


# One full-attention layer of width 1024 under a 300,032-entry vocabulary: 0.63 G parameters,
# whose training state (12 bytes each) fits one v5e device, but whose optimizer update compiled
# apart, undonated (gradients, parameters and moments in, new ones out: 28 bytes each), does not.
WIDE = ["model.preset=olmo3-tiny", "model.n_layers=1", "model.window_pattern=[null]",
        "model.d_model=1024", "model.n_heads=8", "model.n_kv_heads=8", "model.head_dim=128",
        "model.mlp_hidden=1024", "model.vocab_size=300000", "model.padded_vocab_size=300032",
        "model.max_seq_len=2048", "train.compute_dtype=bfloat16", "train.attn_impl=xla"]


@pytest.mark.slow
def test_a_part_of_the_estimate_never_decides_the_fit(tmp_path, capsys):
    """The step fits a v6e device; the optimizer part compiled for the estimate does not (a v5e
    chip ran a step olmax plan had called "does not fit: a part of the step needs 17.64 GiB", when
    v5e was priced by its parts too). The verdict is the step's; the part is compiled for half the
    state and scaled, and says so. (v6e has no rates table measured on its chip: its step is
    priced by XLA's cost model over the parts; WIDE's vocabulary doubled for its 31.24 GiB.)"""
    out = tmp_path / "plan.json"
    assert main(["plan", "olmo3_tiny", "--topology", "v6e:1x1", *WIDE, "model.vocab_size=600000",
                 "model.padded_vocab_size=600064", "train.seq_len=128",
                 "train.global_batch_size=1", "--json", str(out)]) == 0, capsys.readouterr()
    p = json.loads(out.read_text())
    assert p["memory"]["fits"] is True and p["memory"]["peak_bytes"] < p["memory"]["hbm_bytes"]
    assert p["details"]["optimizer_part_share"] == 2
    assert "the optimizer part compiled for 1/2 of the device's state" in p["estimate"]["method"]
    assert p["estimate"]["step_s"] > 0


@pytest.mark.slow
def test_auto_micro_batch_is_the_largest_the_tpu_compiler_accepts(tmp_path, capsys):
    """``train.micro_batch_size=auto`` for a v5e device, chosen by memory
    (``train.auto_choice=memory``): the compiler itself refuses the candidates that do not fit (its out-of-memory error, read for its figures); the choice fits
    and the next larger divisor was refused. The LM head's chunk holds a whole micro-batch (its
    fp32 logits over 300,032 entries grow with it), so that not every micro-batch fits."""
    out = tmp_path / "plan.json"
    assert main(["plan", "olmo3_tiny", "--topology", "v5e:1x1", *WIDE, "train.seq_len=2048",
                 "train.global_batch_size=8", "train.micro_batch_size=auto", "--no-parts",
                 "train.loss_chunk_rows=16384", "train.auto_choice=memory",
                 "--json", str(out)]) == 0, capsys.readouterr()
    p = json.loads(out.read_text())
    fit, hbm = p["details"]["fit"], p["memory"]["hbm_bytes"]
    trials = {t["micro_batch_size"]: t for t in fit["trials"]}
    chosen = fit["micro_batch_size"]
    assert fit["auto"] == ["micro_batch_size"] and fit["limit_bytes"] == hbm
    assert trials[chosen]["fits"] and trials[chosen]["peak_bytes"] == p["memory"]["peak_bytes"] <= hbm
    larger = [d for d in (8, 4, 2, 1) if d > chosen]
    assert larger, "every micro-batch fits: the case no longer tests the search"
    # each larger divisor tried was refused by the compiler, or fits only by the compiler's
    # recomputation (what auto takes last), and the largest was refused
    for d in larger:
        if d in trials:
            t = trials[d]
            assert (not t["fits"] and t["peak_bytes"] > hbm) or t["compiler_remat_ops"] > 0, t
    assert not trials[8]["fits"] and trials[8]["peak_bytes"] > hbm
    assert p["details"]["n_micro"] == 8 // chosen


@pytest.mark.slow
def test_auto_micro_batch_by_the_estimate_on_a_v5e(tmp_path, capsys):
    """``train.auto_choice=estimate`` (the default) for v5e devices, whose step is priced from
    rates measured on the chip, here four of them (FSDP: the step's collectives timed beside its
    compute): every candidate that fits is priced, the choice follows the rule (the memory rule's
    choice, the largest micro-batch, unless another is estimated more than 1 % faster), the plan's
    own estimate of the step it kept is the chosen trial's, and a trial's estimate is that of its
    micro-batch planned on its own (a separate compile of that step)."""
    from olmax.train.fit import AUTO_MARGIN

    args = ["olmo3_tiny", "--topology", "v5e:2x2", "train.global_batch_size=16", "train.seq_len=512",
            "model.max_seq_len=512", "--no-parts"]
    out = tmp_path / "auto.json"
    assert main(["plan", *args, "train.micro_batch_size=auto", "--json", str(out)]) == 0, \
        capsys.readouterr()
    p = json.loads(out.read_text())
    fit = p["details"]["fit"]
    assert p["estimate"]["collective_s"] > 0
    trials = {t["micro_batch_size"]: t for t in fit["trials"]}
    assert all(t["fits"] and t["estimated_step_s"] > 0 for t in trials.values())
    assert fit["trials"][0]["micro_batch_size"] == 4        # fits: the memory rule's choice
    assert len(trials) >= 2                                  # and the next smaller, priced
    best = min(trials, key=lambda m: trials[m]["estimated_step_s"])
    base = trials[4]["estimated_step_s"]
    expected = best if trials[best]["estimated_step_s"] < (1 - AUTO_MARGIN) * base else 4
    assert fit["micro_batch_size"] == expected
    assert fit["chosen_by"] == ("estimate" if expected != 4 else "memory")
    assert p["estimate"]["step_s"] == pytest.approx(trials[expected]["estimated_step_s"], rel=1e-9)
    other = next(m for m in trials if m != expected)
    alone = tmp_path / "alone.json"
    assert main(["plan", *args, f"train.micro_batch_size={other}", "--json", str(alone)]) == 0
    assert json.loads(alone.read_text())["estimate"]["step_s"] == pytest.approx(
        trials[other]["estimated_step_s"], rel=1e-6)
