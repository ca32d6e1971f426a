"""The OLMo 3 7B TPU study, as its case list: ``olmax plan olmo3_7b_stage1`` over topologies,
batches, remat policies, meshes and head shapes, and MaxText 0.2.5's own ahead-of-time compile of
the same work (``maxtext_compile.py``, in MaxText's Python 3.12 environment).

Each case runs in a process of its own (``nice``d, one at a time: libtpu compiles with every core
it gets); its result (the plan's or MaxText's JSON, the command, its wall time, the last lines it
printed) goes to ``results/tpu_plan/<case>.json``, and a case whose file exists is skipped. The
tables made from them are ``results/tpu_plan.{md,json}`` and the README section "The 7B TPU study".

    python benchmarks/tpu_plan.py [--only CASE,...] [--group remat,...] [--python PY] [--rerun]
    python benchmarks/tpu_plan.py --maxtext --maxtext-python /work/venvs/maxtext/bin/python

MaxText's environment is not part of the repository: benchmarks/README.md, "Calibration", says how
to create it (the default interpreter path does not exist on a fresh machine).
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

from olmax.io import write_json_atomic
from olmax.hardware import BY_NAME

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "tpu_plan"
RECIPE = "olmo3_7b_stage1"
# MaxText's topology names for the same slices (``accelerator_to_spec_map``): cores, not chips.
MAXTEXT_TOPOLOGY = {"tpu7x:2x2x2": "tpu7x-16", "tpu7x:4x4x4": "tpu7x-128", "tpu7x:4x8x8": "tpu7x-512"}


def run_niced(cmd: list[str], env: dict, timeout: float) -> tuple[int | None, str, float]:
    """``cmd`` at nice 5 (its exit status, None on timeout; its output; its wall seconds)."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(["nice", "-n", "5", *cmd], env=env, capture_output=True, text=True,
                              timeout=timeout)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, text = None, f"timed out after {timeout} s\n" + (e.stdout or b"").decode(errors="replace")
    return rc, text, time.perf_counter() - t0


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

    def add(name, group, topology, overrides, question, recipe=RECIPE):
        out[name] = {"group": group, "topology": topology, "overrides": overrides, "question": question,
                     "recipe": recipe}

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
    # The same twins under the estimate that prices the splash kernels at their MXU occupancy and
    # times the collectives (the cases above predate it).
    for h in ("32x128", "16x256"):
        preset = [] if h == "32x128" else ["model.preset=olmo3-7b-16x256"]
        add(f"heads_mxu_{h}_b1", "heads", SMALL, [*_batch(16, 1), *preset, "train.remat=full"],
            f"{h} heads, 1 x 8192 per device, full remat (MXU-aware estimate)")
    # v5p (one device per chip, 95 GiB): 8 devices at 1 and 4 sequences each, full remat.
    for b in (1, 4):
        add(f"v5p_full_b{b}", "v5p", "v5p:2x2x2", [*_batch(8, b), "train.remat=full"],
            f"v5p, remat=full, {b} x 8192 per device")
    # The reproduction's device counts: 512 devices at 1 sequence each, 128 at 4 each.
    add("scale_tpu7x_512_b1", "scale", "tpu7x:4x8x8", _batch(512, 1), "512 devices x 1 sequence")
    add("scale_tpu7x_128_b4", "scale", "tpu7x:4x4x4", _batch(128, 4), "128 devices x 4 sequences")
    add("scale_v5p_512_b1", "scale", "v5p:8x8x8", _batch(512, 1), "512 devices x 1 sequence")
    add("scale_v5p_128_b4", "scale", "v5p:4x4x8", _batch(128, 4), "128 devices x 4 sequences")
    # The layout at 512 devices (one sequence per device, the recipe's remat), on the 4x8x8 torus
    # (olmax.perf.targets.torus_links): FSDP over the whole slice (the default) against HSDP,
    # FSDP groups of 32 with 16 replicas (the weight gathers stay inside a group).
    for name, mesh in (("fsdp512", ["mesh.data=1", "mesh.fsdp=512"]),
                       ("hsdp16x32", ["mesh.data=16", "mesh.fsdp=32"])):
        add(f"layout_tpu7x_512_{name}", "layout", "tpu7x:4x8x8",
            ["train.global_batch_size=512", "train.micro_batch_size=1", *mesh],
            f"512 devices x 1 sequence, {name}")
    # The recipe as written (global batch 512, micro-batch 2) on the 'Done when' topologies.
    add("recipe_tpu7x_2x2x2", "recipe", "tpu7x:2x2x2", [], "the recipe unchanged")
    for r in ("full", "dots_no_batch", "save_outputs", "save_proj"):   # its micro-batch of 2 per device
        add(f"recipe_tpu7x_2x2x2_{r}", "recipe", "tpu7x:2x2x2", [f"train.remat={r}"],
            f"the recipe, remat={r}")
    add("recipe_v5p_2x2x2", "recipe", "v5p:2x2x2", [], "the recipe unchanged")
    # The original run's scale, each recipe as packaged (micro-batch: auto): stage 1 on 512
    # Ironwood devices (256 chips), resized to 128 devices at the same global batch, stage 2 on a
    # v5p slice of 128 chips; and 16 devices at stage 1's per-device batch (the weak-scaling twin).
    add("original_stage1_tpu7x_512", "original", "tpu7x:4x8x8", [], "stage 1, 512 devices (256 chips)")
    add("original_stage1_tpu7x_128", "original", "tpu7x:4x4x4", [],
        "stage 1 resized to 128 devices, same global batch")
    add("original_stage1_tpu7x_16_b1", "original", SMALL, ["train.global_batch_size=16"],
        "stage 1 at 512's per-device batch on 16 devices (weak-scaling twin)")
    add("original_stage2_v5p_128", "original", "v5p:4x4x8", [], "stage 2 on v5p, 128 chips",
        recipe="olmo3_7b_stage2")
    # Splash blocks: stage 1 on 128 devices (4 x 8192 each, where MaxText's OLMo 3 launcher ran)
    # with olmax's 512-blocks and with MaxText's 2048 (train.splash_block), compiled side by side.
    for block in (512, 2048):
        add(f"blocks_tpu7x_128_splash{block}", "blocks", "tpu7x:4x4x4", [f"train.splash_block={block}"],
            f"stage 1 on 128 devices, splash blocks of {block}")
    # GPUs (JAX's CUDA plugin; XLA's GPU compiler gives no cost-model time, so no parts): the
    # recipe on one node of 8, and on 64 nodes of 8 with FSDP inside a node, replicas across (HSDP)
    add("original_stage1_h100_8", "original", "h100:8", ["--no-parts"], "stage 1 on 8 H100s")
    add("original_stage1_h100_8_mb1", "original", "h100:8", ["train.micro_batch_max=1", "--no-parts"],
        "stage 1 on 8 H100s, one sequence per micro-batch")
    add("original_stage1_h100_64x8_hsdp", "original", "h100:64x8",
        ["mesh.data=64", "mesh.fsdp=8", "--no-parts"], "stage 1 on 64 nodes of 8 H100s, HSDP 64 x 8")
    # OLMo 3 32B as packaged: stage 1 (1024 x 8192, one sequence per device) on what a lab would
    # rent for it, 512 Ironwood chips (1024 devices) or a v5p slice of 1024 chips, FSDP over the
    # slice; stage 3 (128 x 65,536, context 8) on 512 Ironwood devices, fsdp 64 x context 8. The
    # parts are skipped: the question is memory and collectives, not the step-time estimate.
    # AI2's 1024 H100s (128 nodes of 8) need JAX's CUDA plugin (`pip install 'jax[cuda12]'`) in
    # the Python 3.12 environment: HSDP with the state sharded within a node (128 x 8), over two
    # nodes (64 x 16), and AI2's own layout, shard degree 64 (16 x 64, the recipe's header and
    # docs/reproduce.md).
    add("olmo3_32b_stage1_tpu7x_1024", "32b", "tpu7x:8x8x8", ["--no-parts"],
        "32B stage 1, 512 Ironwood chips (1024 devices)", recipe="olmo3_32b_stage1")
    add("olmo3_32b_stage1_v5p_1024", "32b", "v5p:8x8x16", ["--no-parts"],
        "32B stage 1, v5p 1024 chips", recipe="olmo3_32b_stage1")
    add("olmo3_32b_stage3_tpu7x_512", "32b", "tpu7x:4x8x8", ["mesh.fsdp=64", "--no-parts"],
        "32B stage 3, 256 Ironwood chips (512 devices), fsdp 64 x context 8", recipe="olmo3_32b_stage3")
    add("olmo3_32b_stage1_h100_128x8_hsdp", "32b", "h100:128x8", ["mesh.data=128", "mesh.fsdp=8", "--no-parts"],
        "32B stage 1 on 1024 H100s, HSDP 128 x 8 (sharded within a node)", recipe="olmo3_32b_stage1")
    add("olmo3_32b_stage1_h100_64x16_hsdp", "32b", "h100:128x8", ["mesh.data=64", "mesh.fsdp=16", "--no-parts"],
        "32B stage 1 on 1024 H100s, HSDP 64 x 16 (sharded over two nodes)", recipe="olmo3_32b_stage1")
    add("olmo3_32b_stage1_h100_16x64_hsdp", "32b", "h100:128x8", ["mesh.data=16", "mesh.fsdp=64", "--no-parts"],
        "32B stage 1 on AI2's 1024 H100s, HSDP 16 x 64 (AI2's shard degree 64)", recipe="olmo3_32b_stage1")
    return out


# MaxText's own OLMo 3 7B stage-1 launcher (``trainers/pre_train/scripts/olmo/run_olmo3_7b_stage1.sh``
# in maxtext 0.2.5), the settings that shape the compiled step: its remat policy keeps every
# projection except the MLP's up projection on the device, tokamax's splash kernel with 2048-blocks
# and the fused backward kernel, and the Ironwood libtpu flags it exports.
MAXTEXT_REPRO_ARGS = [
    "model_name=olmo3-7b-pt", "z_loss_multiplier=1e-5", "cast_logits_to_fp32=True", "logits_dot_in_fp32=True",
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
    full remat; z-loss on, as in olmax), ``b1_full_vmem`` the same with olmax's Ironwood compiler
    option; ``b4_repro``: its OLMo 3 launcher's settings at 4 x 8192
    per device."""
    plain = ["model_name=olmo3-7b-pt", "per_device_batch_size=1", "max_target_length=8192", "attention=flash", "remat_policy=full",
             "z_loss_multiplier=1e-5"]
    repro = ["per_device_batch_size=4", "max_target_length=8192", *MAXTEXT_REPRO_ARGS]
    # ``b1_full_vmem``: the plain invocation with the one libtpu option olmax's Ironwood step is
    # compiled with (the tpu7x row of olmax.hardware, also the first of its launcher's flags):
    # equal settings down to the compiler's options.
    vmem = " ".join(f"--{k}={v}" for k, v in BY_NAME["tpu7x"].compiler_options)
    out = {}
    for tag, args, env in (("b1_full", plain, {}), ("b1_full_vmem", plain, {"LIBTPU_INIT_ARGS": vmem}),
                           ("b4_repro", repro, {"LIBTPU_INIT_ARGS": MAXTEXT_REPRO_LIBTPU})):
        out[f"maxtext_tpu7x16_{tag}"] = {
            "mode": "step", "topology": "tpu7x:2x2x2", "args": args, "env": env,
            "question": f"MaxText olmo3-7b-pt step, {tag}"}
        for layers in (4, 8):
            out[f"maxtext_parts_l{layers}_{tag}"] = {
                "mode": "parts", "topology": "tpu7x:2x2x2", "layers": layers, "args": args, "env": env,
                "question": f"MaxText fwd+bwd, {layers} unscanned layers, one device, {tag}"}
    # Its launcher's settings at 4 x 8192 per device need 103 GiB per device on 16 devices (FSDP 16
    # holds 1/16 of the state): compiled where the original run used them, 128 devices (global
    # batch 512), the olmax twin being original_stage1_tpu7x_128.
    out["maxtext_tpu7x128_b4_repro"] = {
        "mode": "step", "topology": "tpu7x:4x4x4", "args": repro,
        "env": {"LIBTPU_INIT_ARGS": MAXTEXT_REPRO_LIBTPU},
        "question": "MaxText olmo3-7b-pt step, 128 devices x 4 sequences, its launcher's settings"}
    # The 512-device slice (layout cases): MaxText's default mesh there, FSDP over every device.
    out["maxtext_tpu7x512_b1_full"] = {
        "mode": "step", "topology": "tpu7x:4x8x8", "args": plain, "env": {},
        "question": "MaxText olmo3-7b-pt step, 512 devices x 1 sequence, b1_full"}
    return out


def time_maxtext_collectives(text: str, topology: str) -> dict:
    """MaxText's compiled step's collectives, timed as ``olmax plan`` times its own
    (:mod:`olmax.perf.network`), over the topology's devices in olmax's mesh order (MaxText orders
    its mesh physically too; a group over every device is the same either way)."""
    from olmax.config import MeshConfig
    from olmax.parallel.mesh import make_mesh
    from olmax.perf import hlo, network
    from olmax.perf.targets import libtpu_topology, slice_wrap, topology_devices

    prog = hlo.analyse(text)
    wrap = slice_wrap(libtpu_topology(topology))
    order = list(make_mesh(MeshConfig(), topology_devices(topology)).devices.flat)
    coll = network.time_collectives(hlo.collective_ops(prog), order, wrap)
    kernels: dict[str, float] = {}   # Pallas calls per step by their op name's last part
    for ins, times in hlo.custom_calls(prog, "tpu_custom_call"):
        names = hlo.op_names(ins)
        key = (names[0].split("/")[-1] if names else ins.name)[:80]
        kernels[key] = kernels.get(key, 0) + times
    return {**coll, "collectives": hlo.collectives(prog), "kernel_calls": kernels}


# Matmuls per visited block pair of MaxText's splash kernels with the fused backward kernel
# (sa_use_fused_bwd_kernel): forward QK^T, PV; backward QK^T (recomputed), dO V^T, P^T dO, dS^T Q,
# dS K; without it, olmax's (olmax.model.splash.MATMULS). Every one has the head dimension on one
# side and the block on the other.
MAXTEXT_FUSED_MATMULS = {"fwd": 2, "bwd": 5}


def maxtext_estimate(tag: str, step_case: str, olmax_case: str) -> dict:
    """MaxText's step (``maxtext_<step_case>``'s compiled program, parts ``maxtext_parts_l4/l8_<tag>``)
    put through ``olmax plan``'s method: one 4-layer group = parts(8 layers) - parts(4 layers), the
    rest = 2 parts(4) - parts(8); olmax's optimizer part at the same share of the state
    (``olmax_case``'s), the splash kernels' FLOPs at 2048-blocks over the device's sustained matrix
    rate times their MXU occupancy, and the collectives of MaxText's compiled step timed by the same network model."""
    from olmax.model.flops import flops_per_token, peak_flops
    from olmax.model.presets import PRESETS
    from olmax.model.splash import MATMULS, visited_blocks
    from olmax.perf.costs import mxu_occupancy
    from olmax.hardware import accelerator_of

    load = lambda n: json.loads((RESULTS / f"{n}.json").read_text())  # noqa: E731
    l4, l8 = (load(f"maxtext_parts_l{n}_{tag}")["maxtext"]["cost"] for n in (4, 8))
    step = load(step_case)
    mt = step["maxtext"]
    ours = load(olmax_case)["plan"]
    args = dict(a.split("=", 1) for a in step["args"])
    b, t = int(args["per_device_batch_size"]), int(args["max_target_length"])
    block = int(args.get("sa_block_q", 512))
    kind = ours["device_kind"]
    peak = peak_flops(kind)
    acc = accelerator_of(kind)
    mxu = acc.mxu
    # the widths MaxText compiled (recorded by maxtext_compile.py; results older than that record
    # are of model_name=olmo3-7b-pt, whose widths are olmax's olmo3-7b preset)
    cfg = _maxtext_model(mt) or PRESETS["olmo3-7b"]
    groups = cfg.n_layers // len(cfg.window_pattern)
    group_s = l8["optimal_seconds"] - l4["optimal_seconds"]
    rest_s = 2 * l4["optimal_seconds"] - l8["optimal_seconds"]
    opt_s = ours["details"]["parts"]["optimizer"]["optimal_seconds"]
    occ = mxu_occupancy(cfg.head_dim, block, mxu)
    # matmuls per visited block pair: forward (twice where full remat recomputes it) + backward
    matmuls = (sum(MAXTEXT_FUSED_MATMULS.values()) if args.get("sa_use_fused_bwd_kernel") == "True"
               else sum(MATMULS.values()))
    if args.get("remat_policy") == "full":
        matmuls += MATMULS["fwd"]
    kernel = 0.0
    for window in cfg.window_pattern:
        pairs = visited_blocks(t, window, block)
        per_call = 2 * block * block * cfg.head_dim * pairs * cfg.n_heads * b
        kernel += groups * per_call * matmuls
    kernel_s = kernel / occ / acc.matmul_rate
    compute = groups * group_s + rest_s + opt_s + kernel_s
    coll = mt["collective_time"]
    step_s = max(compute, coll["async_s"]) + coll["sync_s"]
    n_dev = ours["num_devices"]
    tokens = b * t                                   # per device
    return {"tag": tag, "step_case": step_case, "olmax_case": olmax_case, "per_device": [b, t],
            "group_s": group_s, "rest_s": rest_s, "optimizer_s": opt_s, "kernel_s": kernel_s,
            "kernel_flops": kernel, "compute_s": compute, "collective_s": coll["collective_s"],
            "async_s": coll["async_s"], "sync_s": coll["sync_s"], "step_s": step_s,
            "step_s_no_overlap": compute + coll["collective_s"],
            "mfu_causal": flops_per_token(cfg, t, "causal") * tokens / step_s / peak,
            "peak_bytes": mt["memory"].get("peak_memory_in_bytes"), "compile_s": mt.get("compile_s"),
            "devices": n_dev, "kernel_calls": coll.get("kernel_calls"),
            "method": "olmax plan's: cost-model parts (8 - 4 layers), olmax's optimizer part, splash "
                      f"at its 2048-blocks / ({acc.matmul_rate / 1e12:.1f} TFLOP/s sustained x MXU "
                      "occupancy), collectives by olmax.perf.network"}


def _maxtext_model(mt: dict):
    """An olmax model config with the widths, layers and windows MaxText recorded compiling
    (``maxtext_compile.py``'s ``model`` and ``layer_attention``), or None where not recorded."""
    from olmax.model.presets import PRESETS

    m, layers = mt.get("model"), mt.get("layer_attention")
    if not m or not layers:
        return None
    windows = tuple(x["window"] for x in layers)
    period = next(p for p in range(1, len(windows) + 1)
                  if len(windows) % p == 0 and windows == windows[:p] * (len(windows) // p))
    return PRESETS["olmo3-7b"].replace(
        d_model=m["emb_dim"], n_heads=m["num_query_heads"], n_kv_heads=m["num_kv_heads"],
        head_dim=m["head_dim"], mlp_hidden=m["mlp_dim"], n_layers=len(windows),
        window_pattern=windows[:period], vocab_size=m["vocab_size"],
        padded_vocab_size=-(-m["vocab_size"] // 128) * 128)


def run(name: str, case: dict, python: str, maxtext_python: str, timeout: int) -> None:
    """One case in its own process; its result written to ``results/tpu_plan/<name>.json``."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out.json"
        env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", **case.get("env", {})}
        hlo_text = Path(tmp) / "step.hlo"
        if "mode" in case:      # MaxText
            cmd = [maxtext_python, str(HERE / "maxtext_compile.py"), case["mode"], "--topology",
                   MAXTEXT_TOPOLOGY[case["topology"]], "--json", str(out),
                   *(["--layers", str(case["layers"])] if case["mode"] == "parts" else []),
                   *(["--hlo", str(hlo_text)] if case["mode"] == "step" else []), "--", *case["args"]]
            env.update(TPU_SKIP_MDS_QUERY="1", TPU_WORKER_HOSTNAMES="localhost")
        else:
            cmd = [python, "-m", "olmax.cli", "plan", case.get("recipe", RECIPE), *case["overrides"], "--topology",
                   case["topology"], "--json", str(out)]
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE.parent / "src"), env.get("PYTHONPATH")]))
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {' '.join(cmd[1:])}", flush=True)
        rc, text, wall = run_niced(cmd, env, timeout)
        got = json.loads(out.read_text()) if out.exists() else None
        if got is not None and hlo_text.exists():
            got["collective_time"] = time_maxtext_collectives(hlo_text.read_text(), case["topology"])
    write_json_atomic(RESULTS / f"{name}.json", {
        "case": name, **case, "command": " ".join(cmd[1:]), "rc": rc, "wall_s": wall,
        "output_tail": text[-4000:], ("maxtext" if "mode" in case else "plan"): got,
        "load_avg_end": os.getloadavg()[0]})
    print(f"  rc={rc} wall {wall:.0f} s", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--maxtext", action="store_true", help="the MaxText cases instead of olmax's")
    p.add_argument("--only", default="", help="comma-separated case names")
    p.add_argument("--group", default="", help="comma-separated groups (remat, mesh, heads, v5p, scale, layout, recipe, original, blocks, 32b)")
    p.add_argument("--python", default=sys.executable, help="interpreter for olmax plan (>= 3.12, tpu extra)")
    p.add_argument("--maxtext-python", default="/work/venvs/maxtext/bin/python")
    p.add_argument("--timeout", type=int, default=5400, help="seconds per case")
    p.add_argument("--rerun", action="store_true", help="run cases whose result file exists")
    p.add_argument("--maxtext-estimate", nargs=3, metavar=("TAG", "STEP_CASE", "OLMAX_CASE"),
                   help="put MaxText's compiled step through olmax plan's estimate (see maxtext_estimate)")
    a = p.parse_args()
    if a.maxtext_estimate:
        est = maxtext_estimate(*a.maxtext_estimate)
        write_json_atomic(RESULTS / f"maxtext_estimate_{a.maxtext_estimate[1]}.json", est)
        print(json.dumps(est, indent=1))
        return 0
    only, groups = {s for s in a.only.split(",") if s}, {s for s in a.group.split(",") if s}
    for name, case in (_maxtext_cases() if a.maxtext else cases()).items():
        if (only and name not in only) or (groups and case.get("group") not in groups):
            continue
        if (RESULTS / f"{name}.json").exists() and not a.rerun:
            print(f"{name}: done already (--rerun to repeat)")
            continue
        run(name, case, a.python, a.maxtext_python, a.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
