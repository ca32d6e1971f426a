"""The OLMo 3 7B TPU study: ``olmax plan`` over a grid of topologies, batches, remat policies,
meshes and head shapes, plus MaxText 0.2.5's own ahead-of-time compile of the same work.

Every case is one ``olmax plan olmo3_7b_stage1 ... --topology T --json`` command in a process of its
own (``nice``d, one at a time: libtpu compiles with every core it gets), so a crash or an
out-of-memory kill loses only that case; its result (the plan's JSON, the command, its wall time,
the last lines it printed) is written to ``benchmarks/results/tpu_plan/<case>.json`` as soon as it
ends, and a case whose file exists is not run again (``--rerun`` to force). ``table`` turns the
files into ``benchmarks/results/tpu_plan.md`` and ``tpu_plan.json``.

    python benchmarks/tpu_plan.py list
    python benchmarks/tpu_plan.py run [--only CASE,...] [--group remat,...] [--python PY] [--rerun]
    python benchmarks/tpu_plan.py maxtext [--only CASE,...] --maxtext-python /work/venvs/maxtext/bin/python
    python benchmarks/tpu_plan.py table

``--python`` is the interpreter that runs ``olmax plan`` (Python >= 3.12 with the ``tpu`` extra;
default: this one). The MaxText cases run ``benchmarks/maxtext_compile.py`` in MaxText's own
environment (see that file).

All figures are per device and are the compiler's: memory is XLA's buffer assignment; the step
time is an *estimate* (``olmax plan``'s method: the TPU cost model over unscanned one-device parts,
Pallas kernels at their FLOPs over the peak, collectives not timed). The ``ici`` column relates the
collectives to the interconnect: the step's collective bytes per device over the step's estimated
time, as a share of the device's part of the chip's ICI bandwidth (1200 GB/s bidirectional per chip
for v5p and tpu7x; a tpu7x chip's two devices share it). Above ~50 % the collectives are unlikely to
hide behind the compute; it is a rough indicator, not a time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "tpu_plan"
RECIPE = "olmo3_7b_stage1"

# ICI bandwidth per chip, bidirectional, bytes/s (Cloud TPU system architecture tables).
ICI_PER_CHIP = {"tpu7x": 1200e9, "v5p": 1200e9}
DEVICES_PER_CHIP = {"tpu7x": 2, "v5p": 1}
# MaxText's topology names for the same slices (``accelerator_to_spec_map``): cores, not chips.
MAXTEXT_TOPOLOGY = {"tpu7x:2x2x2": "tpu7x-16", "tpu7x:4x4x4": "tpu7x-128", "tpu7x:4x8x8": "tpu7x-512"}


def _batch(devices: int, per_device: int, data: int = 1, tensor: int = 1) -> list[str]:
    """Overrides for ``per_device`` sequences of work per device and no accumulation: the batch
    splits over data x fsdp, so with tensor parallelism each data-parallel rank takes
    ``per_device * tensor`` sequences (the same tokens per device)."""
    dp = devices // tensor
    mesh = [] if (data, tensor) == (1, 1) else [f"mesh.data={data}", f"mesh.fsdp={dp // data}",
                                                 f"mesh.tensor={tensor}"]
    return [f"train.global_batch_size={dp * per_device * tensor}",
            f"train.micro_batch_size={per_device * tensor}", *mesh]


SMALL = "tpu7x:2x2x2"          # 16 devices (8 chips): where policies and meshes are compared
REMATS = ("full", "save_attn", "save_proj", "save_outputs", "dots_no_batch", "dots", "none")


def cases() -> dict[str, dict]:
    """name -> {group, topology, overrides, question}."""
    out: dict[str, dict] = {}

    def add(name, group, topology, overrides, question):
        out[name] = {"group": group, "topology": topology, "overrides": overrides, "question": question}

    # Remat policies, FSDP over 16 devices, 4 and 1 sequences per device.
    for b in (4, 1):
        for r in REMATS:
            add(f"remat_{r}_b{b}", "remat", SMALL, [*_batch(16, b), f"train.remat={r}"],
                f"remat={r}, {b} x 8192 per device")
    # Meshes at full remat (the fsdp-16 twin is remat_full_b*).
    for b in (4, 1):
        add(f"mesh_fsdp8_tensor2_b{b}", "mesh", SMALL, [*_batch(16, b, tensor=2), "train.remat=full"],
            f"fsdp 8 x tensor 2, {b} x 8192 per device (twin: remat_full_b{b}, fsdp 16)")
        add(f"mesh_data2_fsdp8_b{b}", "mesh", SMALL, [*_batch(16, b, data=2), "train.remat=full"],
            f"data 2 x fsdp 8, {b} x 8192 per device (twin: remat_full_b{b}, fsdp 16)")
    # Heads 16 x 256 (the 32 x 128 twin is remat_full_b*).
    for b in (4, 1):
        add(f"heads_16x256_b{b}", "heads", SMALL,
            [*_batch(16, b), "model.preset=olmo3-7b-16x256", "train.remat=full"],
            f"16 x 256 heads, {b} x 8192 per device (twin: remat_full_b{b})")
    # v5p (one device per chip, 95 GiB): 8 devices at 1 and 4 sequences each, full remat.
    for b in (1, 4):
        add(f"v5p_full_b{b}", "v5p", "v5p:2x2x2", [*_batch(8, b), "train.remat=full"],
            f"v5p, remat=full, {b} x 8192 per device")
    # The reproduction's device counts: 512 devices at 1 sequence each, 128 at 4 each.
    add("scale_tpu7x_512_b1", "scale", "tpu7x:4x8x8", _batch(512, 1), "512 devices x 1 sequence")
    add("scale_tpu7x_128_b4", "scale", "tpu7x:4x4x4", _batch(128, 4), "128 devices x 4 sequences")
    add("scale_v5p_512_b1", "scale", "v5p:8x8x8", _batch(512, 1), "512 devices x 1 sequence")
    add("scale_v5p_128_b4", "scale", "v5p:4x4x8", _batch(128, 4), "128 devices x 4 sequences")
    # The recipe as written (global batch 512, micro-batch 2) on the 'Done when' topologies.
    add("recipe_tpu7x_2x2x2", "recipe", "tpu7x:2x2x2", [], "the recipe unchanged")
    for r in ("full", "dots_no_batch", "save_outputs", "save_proj"):   # its micro-batch of 2 per device
        add(f"recipe_tpu7x_2x2x2_{r}", "recipe", "tpu7x:2x2x2", [f"train.remat={r}"],
            f"the recipe, remat={r}")
    add("recipe_v5p_2x2x2", "recipe", "v5p:2x2x2", [], "the recipe unchanged")
    return out


# MaxText's own OLMo 3 7B stage-1 launcher (``trainers/pre_train/scripts/olmo/run_olmo3_7b_stage1.sh``
# in maxtext 0.2.5), the settings that shape the compiled step: its remat policy keeps every
# projection except the MLP's up projection on the device, tokamax's splash kernel with 2048-blocks
# and the fused backward kernel, and the Ironwood libtpu flags it exports.
MAXTEXT_REPRO_ARGS = [
    "z_loss_multiplier=1e-5", "cast_logits_to_fp32=True", "logits_dot_in_fp32=True",
    "skip_step_on_spikes=True", "gradient_clipping_threshold=1.0", "remat_policy=custom",
    "decoder_layer_input=device", "context=device", "query_proj=device", "key_proj=device",
    "value_proj=device", "qkv_proj=device", "out_proj=device", "mlpwi_0=device", "mlpwo=device",
    "use_iota_embed=True", "use_tokamax_splash=True", "attention=flash", "sa_block_q=2048",
    "sa_block_kv=2048", "sa_block_kv_compute=2048", "sa_block_q_dkv=2048", "sa_block_kv_dkv=2048",
    "sa_block_kv_dkv_compute=2048", "sa_q_layout=SEQ_MINOR", "sa_k_layout=SEQ_MINOR",
    "sa_v_layout=HEAD_DIM_MINOR", "sa_use_fused_bwd_kernel=True"]
MAXTEXT_REPRO_LIBTPU = " ".join([
    "--xla_tpu_scoped_vmem_limit_kib=65536", "--xla_tpu_bf16_emission_mode=NATIVE_EMISSION",
    "--xla_tpu_dvfs_p_state=7", "--xla_tpu_enable_sparse_core_collective_offload_all_reduce=true",
    "--xla_tpu_enable_sparse_core_collective_offload_all_gather=true",
    "--xla_tpu_enable_sparse_core_collective_offload_2d_all_gather=true",
    "--xla_tpu_enable_sparse_core_collective_offload_reduce_scatter=true",
    "--xla_tpu_use_tc_device_shape_on_sc=True", "--xla_sc_disable_megacore_partitioning=True",
    "--xla_tpu_enable_async_collective_fusion_fuse_all_gather=false"])


def _maxtext_cases() -> dict[str, dict]:
    """MaxText's ahead-of-time compiles (``maxtext_compile.py`` modes) and the parts that put its
    step through olmax's estimation method. ``b1_full``: the plain invocation (flash attention,
    full remat; z-loss on, as in olmax); ``b4_repro``: its OLMo 3 launcher's settings at 4 x 8192
    per device."""
    plain = ["per_device_batch_size=1", "max_target_length=8192", "attention=flash", "remat_policy=full",
             "z_loss_multiplier=1e-5"]
    repro = ["per_device_batch_size=4", "max_target_length=8192", *MAXTEXT_REPRO_ARGS]
    out = {}
    for tag, args, env in (("b1_full", plain, {}), ("b4_repro", repro, {"LIBTPU_INIT_ARGS": MAXTEXT_REPRO_LIBTPU})):
        out[f"maxtext_tpu7x16_{tag}"] = {
            "mode": "step", "topology": "tpu7x:2x2x2", "args": args, "env": env,
            "question": f"MaxText olmo3-7b-pt step, {tag}"}
        for layers in (4, 8):
            out[f"maxtext_parts_l{layers}_{tag}"] = {
                "mode": "parts", "topology": "tpu7x:2x2x2", "layers": layers, "args": args, "env": env,
                "question": f"MaxText fwd+bwd, {layers} unscanned layers, one device, {tag}"}
    return out


def _run_case(name: str, case: dict, python: str, timeout: int, hlo_dir: str | None = None) -> dict:
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        out_json = Path(tmp) / "plan.json"
        cmd = [python, "-m", "olmax.cli", "plan", RECIPE, *case["overrides"], "--topology",
               case["topology"], "--json", str(out_json)]
        shown = " ".join(["olmax", *cmd[3:-2]])
        if hlo_dir:
            cmd[-2:-2] = ["--hlo", str(Path(hlo_dir) / f"{name}.hlo.txt")]
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(["nice", "-n", "5", *cmd], env=env, capture_output=True, text=True,
                                  timeout=timeout)
            rc, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = None, f"timed out after {timeout} s\n" + _text(e.stdout)
        wall = time.perf_counter() - t0
        plan = json.loads(out_json.read_text()) if out_json.exists() else None
    result = {"case": name, **case, "command": shown, "rc": rc,
              "wall_s": wall, "output_tail": text[-4000:], "plan": plan,
              "load_avg_end": os.getloadavg()[0]}
    _write(RESULTS / f"{name}.json", result)
    print(f"  rc={rc} wall {wall:.0f} s" + ("" if plan else "  (no plan: see output_tail)"), flush=True)
    return result


def _text(out) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def _write(path: Path, data: dict) -> None:
    sys.path.insert(0, str(ROOT / "src"))
    from olmax.io import write_bytes_atomic

    write_bytes_atomic(path, (json.dumps(data, indent=2) + "\n").encode())


def _run_maxtext(name: str, case: dict, python: str, timeout: int) -> dict:
    RESULTS.mkdir(parents=True, exist_ok=True)
    hlo = RESULTS / f"{name}.hlo.txt"
    with tempfile.TemporaryDirectory() as tmp:
        out_json = Path(tmp) / "out.json"
        cmd = [python, str(HERE / "maxtext_compile.py"), case["mode"], "--topology",
               MAXTEXT_TOPOLOGY[case["topology"]], "--json", str(out_json), "--hlo", str(hlo)]
        if case["mode"] == "parts":
            cmd += ["--layers", str(case["layers"])]
        cmd += ["--", *case["args"]]
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(["nice", "-n", "5", *cmd], capture_output=True, text=True, timeout=timeout,
                                  env={**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
                                       "TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost",
                                       **case.get("env", {})})
            rc, text = proc.returncode, proc.stdout + proc.stderr
        except subprocess.TimeoutExpired as e:
            rc, text = None, f"timed out after {timeout} s\n" + _text(e.stdout)
        wall = time.perf_counter() - t0
        out = json.loads(out_json.read_text()) if out_json.exists() else None
    if out is not None and hlo.exists():
        out["hlo_analysis"] = _analyse_hlo(hlo.read_text())
        hlo.unlink()    # hundreds of MB: the analysis is kept, not the text
    result = {"case": name, **case, "command": " ".join(cmd[1:]), "rc": rc, "wall_s": wall,
              "output_tail": text[-6000:], "maxtext": out, "load_avg_end": os.getloadavg()[0]}
    _write(RESULTS / f"{name}.json", result)
    print(f"  rc={rc} wall {wall:.0f} s", flush=True)
    return result


def _analyse_hlo(text: str) -> dict:
    """olmax's HLO reader over a compiled program: collectives by kind (loop trip counts
    included) and the Pallas kernel calls with their executions per step."""
    sys.path.insert(0, str(ROOT / "src"))
    from olmax.perf import hlo

    prog = hlo.analyse(text)
    kernels: dict[str, float] = {}
    for ins, mult in hlo.custom_calls(prog, "tpu_custom_call"):
        names = (ins.name + " " + " ".join(hlo.op_names(ins))).lower()
        key = next((k for k in ("fwd", "dkv", "dq", "bwd") if f"_{k}" in names), "other")
        kernels[key] = kernels.get(key, 0) + mult
    return {"collectives": hlo.collectives(prog), "kernel_calls": kernels,
            "loops_with_unknown_trip_count": prog.unknown_loops}


# ----------------------------------------------------------------------------------------------
# Tables

GIB = 2 ** 30


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _gib(x) -> str:
    return "-" if x is None else f"{x / GIB:.1f}"


def _pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f} %"


def _coll(plan: dict, kind: str) -> float:
    return sum(c["bytes"] for c in plan.get("collectives", []) if c["kind"] == kind)


def ici_share(plan: dict) -> float | None:
    """Collective bytes per device per estimated step time, over the device's share of the chip's
    ICI bandwidth (a rough indicator of whether the collectives can hide behind the compute)."""
    step = (plan.get("estimate") or {}).get("step_s")
    kind = (plan.get("topology") or "").split(":")[0]
    if not step or kind not in ICI_PER_CHIP:
        return None
    per_device = ICI_PER_CHIP[kind] / DEVICES_PER_CHIP[kind]
    return sum(c["bytes"] for c in plan["collectives"]) / step / per_device


def summary(name: str) -> dict | None:
    """One case's figures (per device) in a flat dict."""
    r = _load(name)
    if r is None:
        return None
    p = r.get("plan") or {}
    mem = p.get("memory") or {}
    est = p.get("estimate") or {}
    fl = p.get("flops_per_step") or {}
    det = p.get("details") or {}
    out = {"case": name, "topology": r["topology"], "question": r["question"], "rc": r["rc"],
           "wall_s": r["wall_s"], "fits": mem.get("fits"), "peak_bytes": mem.get("peak_bytes"),
           "hbm_bytes": mem.get("hbm_bytes"), "headroom": mem.get("headroom"),
           "argument_bytes": mem.get("argument_bytes"), "temp_bytes": mem.get("temp_bytes"),
           "error": p.get("error"), "remat": p.get("remat"), "attn_impl": p.get("attn_impl"),
           "num_devices": p.get("num_devices"), "chips": det.get("chips"), "mesh": det.get("mesh"),
           "global_batch_size": p.get("global_batch_size"), "n_micro": det.get("n_micro"),
           "step_s": est.get("step_s"), "tokens_per_s_per_chip": est.get("tokens_per_s_per_chip"),
           "mfu_causal": est.get("mfu_causal"), "mfu_olmo_core": est.get("mfu_olmo_core"),
           "xla_over_causal": (fl["xla"] / fl["causal"]) if fl.get("xla") and fl.get("causal") else None,
           "kernel_flops": det.get("kernel_flops"), "compile_s": p.get("compile_s"),
           "collectives": {c["kind"]: c["bytes"] for c in p.get("collectives", [])},
           "ici_share": ici_share(p) if p.get("collectives") is not None else None,
           "parts": det.get("parts")}
    return out


def maxtext_vs_olmax(tag: str, olmax_case: str, layers: int = 32) -> dict | None:
    """MaxText's step put through olmax's estimation method, beside the olmax case of the same work.

    MaxText's parts (``maxtext_compile.py parts``: embedding + L unscanned layers + LM head and loss,
    forward and backward on one device) at L = 4 and 8 give one 4-layer group (their difference) and
    the rest (embedding, head, loss). Its step: ``layers / 4`` groups + the rest + the optimizer +
    the attention kernels. The optimizer part and the kernels' time are olmax's own for the same
    shapes: MaxText's parts leave the update out, and both run splash kernels with the same masks
    (windows of 4096 on three layers of four, causal on the fourth), the same 512-blocks and the
    same number of calls (counted in both HLOs), so the same kernel FLOPs at the device's peak.
    Memory is MaxText's own whole-step compile on the same topology."""
    l4, l8, step = (_load(f"maxtext_parts_l4_{tag}"), _load(f"maxtext_parts_l8_{tag}"),
                    _load(f"maxtext_tpu7x16_{tag}"))
    ours = summary(olmax_case)
    if not (l4 and l8 and step and ours) or not all(r.get("maxtext") for r in (l4, l8, step)):
        return None
    c4, c8 = l4["maxtext"]["cost"], l8["maxtext"]["cost"]
    group_s = c8["optimal_seconds"] - c4["optimal_seconds"]
    rest_s = c4["optimal_seconds"] - group_s
    group_bytes = c8["bytes accessed"] - c4["bytes accessed"]
    parts = ours["parts"]
    o_group_s = parts["layer_group_plus_head"]["optimal_seconds"] - parts["head_and_loss"]["optimal_seconds"]
    o_group_bytes = (parts["layer_group_plus_head"]["bytes accessed"]
                     - parts["head_and_loss"]["bytes accessed"])
    kernel_s = ours["step_s"] - (layers // 4) * o_group_s - parts["head_and_loss"]["optimal_seconds"] \
        - parts["optimizer"]["optimal_seconds"]
    mt_step = (layers // 4) * group_s + rest_s + parts["optimizer"]["optimal_seconds"] + kernel_s
    mem = step["maxtext"]["memory"]
    mt_peak = mem["peak_memory_in_bytes"]     # XLA's own peak, as olmax plan's peak_bytes
    return {"olmax": {"step_s": ours["step_s"], "group_s": o_group_s,
                      "rest_s": parts["head_and_loss"]["optimal_seconds"], "group_bytes": o_group_bytes,
                      "peak_bytes": ours["peak_bytes"], "argument_bytes": ours["argument_bytes"],
                      "temp_bytes": ours["temp_bytes"], "mfu_causal": ours["mfu_causal"]},
            "maxtext": {"step_s": mt_step, "group_s": group_s, "rest_s": rest_s, "group_bytes": group_bytes,
                        "peak_bytes": mt_peak, "argument_bytes": mem["argument_size_in_bytes"],
                        "temp_bytes": mem["temp_size_in_bytes"],
                        "mfu_causal": ours["mfu_causal"] * ours["step_s"] / mt_step,
                        "group_flops": c8["flops"] - c4["flops"]},
            "kernel_s": kernel_s, "optimizer_s": parts["optimizer"]["optimal_seconds"],
            "olmax_group_flops": (parts["layer_group_plus_head"]["flops"] - parts["head_and_loss"]["flops"])}


def _fit_cell(s: dict) -> str:
    if s["fits"] is None and s["rc"] != 0:
        return "failed"
    if not s["fits"]:
        return f"**no**: needs {_gib(s['peak_bytes'])} of {_gib(s['hbm_bytes'])} GiB"
    return f"{_gib(s['peak_bytes'])} GiB, {_pct(s['headroom'])} free"


def _step_cells(s: dict) -> list[str]:
    if not s["step_s"]:
        return ["-"] * 4
    return [f"{s['step_s'] * 1e3:,.0f}", f"{s['tokens_per_s_per_chip']:,.0f}", _pct(s["mfu_causal"]),
            _pct(s["mfu_olmo_core"])]


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(r) + " |" for r in rows)]


def _case_rows(names: list[str], first) -> list[list[str]]:
    rows = []
    for n in names:
        s = summary(n)
        if s is None:
            continue
        coll = s["collectives"]
        rows.append([first(s), _fit_cell(s), _gib(s["argument_bytes"]), _gib(s["temp_bytes"]),
                     *_step_cells(s),
                     "-" if s["xla_over_causal"] is None else f"{s['xla_over_causal']:.2f}",
                     " / ".join(_gib(coll.get(k)) for k in ("all-gather", "reduce-scatter", "all-reduce",
                                                            "collective-permute")),
                     _pct(s["ici_share"]),
                     "-" if s["compile_s"] is None else f"{s['compile_s']:.0f}", f"{s['wall_s']:.0f}"])
    return rows


HEAD = ["peak / device (of HBM)", "args GiB", "temps GiB", "est. step ms", "tokens/s/chip",
        "MFU causal", "MFU olmo_core", "XLA / causal FLOPs", "AG / RS / AR / CP GiB", "ICI share",
        "compile s", "wall s"]


def _scale_label(s: dict) -> str:
    micro = "" if s["n_micro"] in (None, 1) else f", {s['n_micro']} micro-batches"
    return (f"{s['topology']} ({s['num_devices']} devices), batch {s['global_batch_size']}{micro}, "
            f"remat {s['remat']}")


def write_tables() -> None:
    lines = ["# OLMo 3 7B stage 1 on TPU: `olmax plan` study (generated by `benchmarks/tpu_plan.py table`)",
             "", "Per device; estimates are the TPU cost model over one-device parts "
             "(see `olmax plan`), collectives not timed.", ""]
    for b in (4, 1):
        lines += [f"## Remat policies, {SMALL} (16 devices, FSDP), {b} x 8192 per device", ""]
        lines += _table(["remat", *HEAD], _case_rows([f"remat_{r}_b{b}" for r in REMATS],
                                                    lambda s: s["case"][6:].rsplit("_b", 1)[0]))
        lines.append("")
    for b in (4, 1):
        lines += [f"## Meshes, {SMALL}, {b} x 8192 per device, full remat", ""]
        lines += _table(["mesh", *HEAD], _case_rows(
            [f"remat_full_b{b}", f"mesh_fsdp8_tensor2_b{b}", f"mesh_data2_fsdp8_b{b}"],
            lambda s: " x ".join(f"{k} {v}" for k, v in (s["mesh"] or {}).items() if v > 1)))
        lines.append("")
    lines += ["## v5p:2x2x2 (8 devices, FSDP), full remat", ""]
    lines += _table(["per device", *HEAD], _case_rows([f"v5p_full_b{b}" for b in (1, 4)],
                                                      lambda s: s["case"].rsplit("_b", 1)[1] + " x 8192"))
    lines.append("")
    lines += ["## Heads, " + SMALL, ""]
    rows = []
    for b in (4, 1):
        base, alt = summary(f"remat_full_b{b}"), summary(f"heads_16x256_b{b}")
        if base and alt and base["step_s"] and alt["step_s"]:
            rows.append([f"{b} x 8192", f"{base['step_s'] * 1e3:,.0f}", f"{alt['step_s'] * 1e3:,.0f}",
                         f"{base['step_s'] / alt['step_s'] - 1:+.1%}", _pct(base["mfu_causal"]),
                         _pct(alt["mfu_causal"]), _fit_cell(base), _fit_cell(alt)])
    lines += _table(["per device", "32x128 est. ms", "16x256 est. ms", "speed-up", "MFU 32x128",
                     "MFU 16x256", "peak 32x128", "peak 16x256"], rows)
    lines += ["", f"## olmax vs MaxText 0.2.5 (its own ahead-of-time compile of `olmo3-7b-pt`), {SMALL}", ""]
    rows = []
    for tag, case, label in (("b1_full", "remat_full_b1", "1 x 8192, full remat"),):
        cmp_ = maxtext_vs_olmax(tag, case)
        if cmp_ is None:
            continue
        for who in ("olmax", "maxtext"):
            x = cmp_[who]
            rows.append([label, "olmax" if who == "olmax" else "MaxText", f"{x['step_s'] * 1e3:,.0f}",
                         f"{x['group_s'] * 1e3:.1f}", f"{x['rest_s'] * 1e3:.1f}",
                         f"{x['group_bytes'] / 1e9:.1f}", _pct(x["mfu_causal"]), _gib(x["argument_bytes"]),
                         _gib(x["temp_bytes"]), _gib(x["peak_bytes"])])
        o, m = cmp_["olmax"], cmp_["maxtext"]
        rows.append([label, "olmax / MaxText", f"{o['step_s'] / m['step_s']:.3f}",
                     f"{o['group_s'] / m['group_s']:.3f}", f"{o['rest_s'] / m['rest_s']:.3f}",
                     f"{o['group_bytes'] / m['group_bytes']:.3f}", "", "", "",
                     f"{o['peak_bytes'] / m['peak_bytes']:.3f}"])
    lines += _table(["per device", "", "est. step ms", "4-layer group ms", "embedding + head + loss ms",
                     "group GB accessed", "MFU causal", "args GiB", "temps GiB", "peak GiB"], rows)
    lines += ["", "MaxText's estimate: its parts compiled as olmax's are (4 and 8 unscanned layers, one "
              "device), plus olmax's optimizer part and attention-kernel time (same kernels, masks, "
              "blocks and call counts in both HLOs); see `maxtext_vs_olmax`."]
    lines += ["", "## The reproduction's device counts", ""]
    lines += _table(["topology", *HEAD], _case_rows(
        [n for n, c in cases().items() if c["group"] in ("scale", "recipe")],
        _scale_label))
    lines.append("")
    (HERE / "results" / "tpu_plan.md").write_text("\n".join(lines) + "\n")
    allcases = {n: summary(n) for n in cases()}
    out = {n: s for n, s in allcases.items() if s is not None}
    out["maxtext_vs_olmax"] = {"b1_full": maxtext_vs_olmax("b1_full", "remat_full_b1")}
    _write(HERE / "results" / "tpu_plan.json", out)
    print("\n".join(lines))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("list", "run", "maxtext", "table"))
    p.add_argument("--only", default="", help="comma-separated case names")
    p.add_argument("--group", default="", help="comma-separated groups (remat, mesh, heads, scale, recipe)")
    p.add_argument("--python", default=sys.executable, help="interpreter for olmax plan (>= 3.12, tpu extra)")
    p.add_argument("--maxtext-python", default="/work/venvs/maxtext/bin/python")
    p.add_argument("--timeout", type=int, default=5400, help="seconds per case")
    p.add_argument("--rerun", action="store_true", help="run cases whose result file exists")
    p.add_argument("--hlo-dir", help="also keep each case's compiled HLO text here")
    a = p.parse_args()

    grid = _maxtext_cases() if a.action == "maxtext" else cases()
    only = {s for s in a.only.split(",") if s}
    groups = {s for s in a.group.split(",") if s}
    chosen = {n: c for n, c in grid.items()
              if (not only or n in only) and (not groups or c.get("group") in groups)}
    if a.action == "list":
        for n, c in {**cases(), **_maxtext_cases()}.items():
            done = "done" if (RESULTS / f"{n}.json").exists() else "    "
            print(f"{done}  {n:28s} {c['topology']:12s} {c['question']}")
        return 0
    if a.action == "table":
        write_tables()
        return 0
    for name, case in chosen.items():
        if (RESULTS / f"{name}.json").exists() and not a.rerun:
            print(f"{name}: done already (--rerun to repeat)")
            continue
        if a.action == "maxtext":
            _run_maxtext(name, case, a.maxtext_python, a.timeout)
        else:
            _run_case(name, case, a.python, a.timeout, a.hlo_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
