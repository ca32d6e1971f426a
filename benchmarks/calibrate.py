"""Calibration of ``olmax plan``'s step-time estimate against published measurements of a peer.

A case is one YAML file in ``benchmarks/calibration/`` (fields: :data:`SCHEMA`): the peer's program
and arguments as its launcher ran them (MaxText 0.2.5: model name, configuration overrides, libtpu
flags), the topology, the measured figure (step time and/or MFU) with its convention and its
source. For each case this script compiles the peer's program ahead of time in the peer's own
environment (``maxtext_compile.py`` with MaxText's Python 3.12 interpreter: the whole step for the
topology, and two unscanned one-device parts), puts it through olmax plan's estimation method
(:func:`estimate`: XLA's TPU cost model over the parts, one layer as the difference of the two,
MaxText's optimizer update over a device's share, the splash kernels at their FLOPs over the
device's sustained matrix rate times their MXU occupancy, the step's collectives timed by
:mod:`olmax.perf.network`, step = max(compute, asynchronous collectives) + synchronous ones), and
prints one row: case, estimate (s, MFU in the case's convention), measurement, measured / estimated.

No factor is fitted: the ratios are reported as they come out. A GPU case goes through olmax plan's GPU
method instead (:mod:`olmax.perf.gpu_estimate`: every kernel of the compiled step at the measured
rates of the GPU's table): MaxText's whole step is compiled for the case's GPUs as compile-only
devices of olmax's target description (``maxtext_compile.py --gpu-target``, JAX's CUDA plugin in
MaxText's environment) and its program is kept beside the record, so that the kernels and
collectives are read again from it on every run. An ``olmax`` case (``peer.program: olmax``) is olmax's own step, measured
on a GPU, whose compiled program is stored (``peer.hlo``): it is estimated from that program and
needs no compile. A TPU ``olmax`` case (``benchmarks/tpu.sh`` writes them: olmax's step measured on
a chip) is ``olmax plan`` of its recipe and overrides for its topology, kept like a compile.

Compiles are cached in ``results/calibration/compiles/`` by what was compiled (mode, topology,
arguments, flags, peer version): a compile whose record exists is not repeated unless ``--rerun``;
a parts compile ``tpu_plan.py --maxtext`` already made of exactly the same request (compared as
MaxText received it) is taken from ``results/tpu_plan/``.
The step's collectives are stored as olmax reads them from the HLO (kinds, bytes, groups), so the
estimate is redone from the records with the current network model on every run. Results:
``results/calibration/<case>.json`` per case, ``results/calibration.json`` (``--json``) for all, and
the table ``olmax plan`` reports as ``estimate.calibration`` (``src/olmax/perf/calibration.json``,
package data).

    python benchmarks/calibrate.py [--case NAME ...] [--maxtext-python PY] [--json OUT] [--rerun]
                                   [--no-compile]

Run it with the Python >= 3.12 environment that has olmax's ``tpu`` extra (libtpu: the topology's
devices for the collectives' groups); MaxText runs in its own (``--maxtext-python``; see
``benchmarks/README.md``, "Calibration", for how to install it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from olmax.perf.calibration_cases import CONVENTIONS, CaseError, visited_pairs
from olmax.perf.calibration_cases import load_cases as _load_cases
from tpu_plan import run_niced

HERE = Path(__file__).resolve().parent
CASES = HERE / "calibration"
RESULTS = HERE / "results" / "calibration"
COMPILES = RESULTS / "compiles"
SUMMARY = HERE / "results" / "calibration.json"
PACKAGE_TABLE = HERE.parent / "src" / "olmax" / "perf" / "calibration.json"
DEFAULT_MAXTEXT_PYTHON = "/work/venvs/maxtext/bin/python"


def load_cases(names: list[str] | None = None) -> dict[str, dict]:
    return _load_cases(CASES, names)


# --- compiling (the peer's environment) -----------------------------------------------------------

def compile_request(case: dict, mode: str, layers: int | None = None) -> dict:
    from olmax.hardware import BY_NAME

    peer = case["peer"]
    req = {"program": peer["program"], "version": peer["version"], "mode": mode,
           "topology": peer["topology"] if mode == "step" else case["parts"]["topology"],
           "layers": layers, "args": list(peer["args"]),
           "libtpu_init_args": " ".join(peer.get("libtpu_init_args", []))}
    if BY_NAME[case["accelerator"]].platform == "gpu":
        # compiled for compile-only GPUs of olmax's target description, with the launcher's XLA_FLAGS
        # (TPU requests, and so their cache keys, carry none of these)
        req.update(gpu_target=case["accelerator"], gpu_count=case["devices"],
                   xla_flags=" ".join(peer.get("xla_flags", [])))
    return req


def _key(req: dict) -> str:
    digest = hashlib.sha256(json.dumps(req, sort_keys=True).encode()).hexdigest()[:16]
    tail = f"_l{req['layers']}" if req["layers"] else ""
    return f"{req['mode']}_{req['topology']}{tail}_{digest}"


def compile_record(req: dict) -> dict | None:
    path = COMPILES / f"{_key(req)}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _overrides(argv: list[str]) -> dict[str, str]:
    """MaxText's key=value overrides of an argv (the last of a repeated key wins, as in MaxText),
    less those naming where output goes."""
    out = dict(a.split("=", 1) for a in argv if "=" in a)
    for k in ("run_name", "base_output_directory"):
        out.pop(k, None)
    return out


def _expected_argv(req: dict) -> list[str]:
    """The overrides ``maxtext_compile.py`` passes MaxText for ``req`` (its argv less base.yml)."""
    argv = [f"compile_topology={req['topology']}", "compile_topology_num_slices=1"]
    if req["mode"] == "parts":
        argv += ["internal_compile=true", "internal_compile_num_devices=1", "scan_layers=false",
                 f"base_num_decoder_layers={req['layers']}", "gradient_clipping_threshold=0",
                 "skip_step_on_spikes=false", "override_model_config=true"]
        args = [a for a in req["args"] if a.split("=")[0] not in ("gradient_clipping_threshold",
                                                                  "skip_step_on_spikes")]
    else:
        args = req["args"]
    return argv + list(args)


def earlier_compile(req: dict) -> dict | None:
    """A parts compile ``tpu_plan.py --maxtext`` made of exactly this request (the same MaxText
    version, mode, layers, overrides as MaxText received them and LIBTPU_INIT_ARGS), as a compile
    record. Only parts are taken: their cost analysis is all the estimate reads of them, while a
    step's record must carry what ``maxtext_compile.py`` records today (collectives, model,
    optimizer part)."""
    if req["mode"] != "parts":
        return None
    want = _overrides(_expected_argv(req))
    for path in sorted((HERE / "results" / "tpu_plan").glob("maxtext_parts_*.json")):
        old = json.loads(path.read_text())
        mt = old.get("maxtext") or {}
        if (old.get("rc") != 0 or mt.get("mode") != "parts" or mt.get("layers") != req["layers"]
                or mt.get("topology") != req["topology"]
                or (mt.get("versions") or {}).get("maxtext") != req["version"]
                or (old.get("env") or {}).get("LIBTPU_INIT_ARGS", "") != req["libtpu_init_args"]):
            continue
        got = _overrides(mt["argv"])
        # the parts compile for the slice's topology name (tpu7x-16 -> 2x2x2): compared as recorded
        got.pop("compile_topology", None)
        mine = dict(want)
        mine.pop("compile_topology", None)
        if got == mine:
            return {"request": req, "command": old["command"], "rc": 0, "wall_s": old["wall_s"],
                    "output_tail": "", "result": mt, "collective_ops": None,
                    "when": "reused", "reused_from": str(path.relative_to(HERE))}
    return None


def run_compile(req: dict, maxtext_python: str, timeout: int) -> dict:
    """One ``maxtext_compile.py`` run in its own process (``nice``d); its record written to the
    compile cache. A TPU step's HLO is read for its collectives and not kept; a GPU step's is kept
    beside its record (``<key>.hlo.gz``), since the GPU method prices each of its kernels."""
    import gzip

    from olmax.hardware import BY_NAME
    from olmax.io import write_bytes_atomic, write_json_atomic

    with tempfile.TemporaryDirectory() as tmp:
        out, hlo_path = Path(tmp) / "out.json", Path(tmp) / "step.hlo"
        gpu = []
        if req.get("gpu_target"):
            target = Path(tmp) / "gpu_target.txt"
            target.write_text(BY_NAME[req["gpu_target"]].gpu_target or "")
            gpu = ["--gpu-target", str(target), "--gpu-count", str(req["gpu_count"])]
        cmd = [maxtext_python, str(HERE / "maxtext_compile.py"), req["mode"], "--topology", req["topology"],
               "--json", str(out), *(["--layers", str(req["layers"])] if req["mode"] == "parts" else []),
               *(["--hlo", str(hlo_path)] if req["mode"] == "step" else []), *gpu, "--", *req["args"]]
        env = {**os.environ, "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_SKIP_MDS_QUERY": "1",
               "TPU_WORKER_HOSTNAMES": "localhost", "JAX_PLATFORMS": "cpu"}
        env.pop("PYTHONPATH", None)
        if req["libtpu_init_args"]:
            env["LIBTPU_INIT_ARGS"] = req["libtpu_init_args"]
        if gpu:
            env["XLA_FLAGS"] = req["xla_flags"]
            env["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"   # no driver here to check the libraries against
        print(f"[{time.strftime('%H:%M:%S')}] compile {_key(req)}", flush=True)
        rc, text, wall = run_niced(cmd, env, timeout)
        got = json.loads(out.read_text()) if out.exists() else None
        ops = None
        if got is not None and hlo_path.exists():
            from olmax.perf import hlo

            text = hlo_path.read_text()
            prog = hlo.analyse(text)
            ops = hlo.collective_ops(prog)
            got["kernel_calls"] = sum(m for _, m in hlo.custom_calls(prog, "tpu_custom_call"))
            if gpu:   # the GPU method prices every kernel of the program: it is kept
                write_bytes_atomic(COMPILES / f"{_key(req)}.hlo.gz", gzip.compress(text.encode(), 9, mtime=0))
    record = {"request": req, "command": " ".join(cmd[1:]), "rc": rc, "wall_s": wall,
              "output_tail": text[-3000:], "result": got, "collective_ops": ops,
              "when": time.strftime("%Y-%m-%d %H:%M:%S"), "load_avg_end": os.getloadavg()[0]}
    write_json_atomic(COMPILES / f"{_key(req)}.json", record)
    print(f"  rc={rc} wall {wall:.0f} s", flush=True)
    return record


# --- the estimate (olmax plan's method) -----------------------------------------------------------

def kernel_work(model: dict, layer_attention: list[dict], mxu: int | None) -> dict:
    """FLOPs per device and step of MaxText's splash kernels, and the same divided by their
    matmuls' MXU occupancy (each has the head dimension on one side and a block on the other)."""
    from olmax.model.splash import MATMULS
    from olmax.perf.costs import mxu_occupancy

    b, t, d = model["per_device_batch_size"], model["max_target_length"], model["head_dim"]
    heads = model["num_query_heads"] // max(1, int(model.get("ici_tensor_parallelism") or 1))
    fused = str(model.get("sa_use_fused_bwd_kernel")) == "True"
    # matmuls per visited pair: forward QK^T, PV; backward with the fused kernel QK^T (again),
    # dO V^T, P^T dO, dS^T Q, dS K, else olmax's dq (3) + dkv (4); full remat runs the forward twice
    fwd_mm = MATMULS["fwd"] * (2 if model.get("remat_policy") == "full" else 1)
    bwd_mm = 5 if fused else MATMULS["dq"] + MATMULS["dkv"]
    blk = lambda k, default: int(model.get(k) or default)  # noqa: E731
    fq, fk = blk("sa_block_q", 512), blk("sa_block_kv", 512)
    bq, bk = blk("sa_block_q_dkv", fq), blk("sa_block_kv_dkv", fk)
    flops = 0.0
    for layer in layer_attention:
        w = layer["window"]
        flops += fwd_mm * 2 * fq * fk * d * visited_pairs(t, w, fq, fk) * heads * b
        flops += bwd_mm * 2 * bq * bk * d * visited_pairs(t, w, bq, bk) * heads * b
    narrowest = min(fq, fk, bq, bk, blk("sa_block_kv_compute", fk), blk("sa_block_kv_dkv_compute", bk))
    occ = mxu_occupancy(d, narrowest, mxu)
    return {"flops": flops, "mxu_occupancy": occ, "flops_at_occupancy": flops / occ,
            "matmuls_per_pair": {"fwd": fwd_mm, "bwd": bwd_mm}, "blocks": {"fwd": [fq, fk], "bwd": [bq, bk]}}


def time_collectives(ops: list[dict], topology: str) -> dict:
    """The step's collectives timed as ``olmax plan`` times its own, over the topology's devices in
    olmax's mesh order (a group over every device is the same in any order)."""
    from olmax.config import MeshConfig
    from olmax.parallel.mesh import make_mesh
    from olmax.perf import network
    from olmax.perf.targets import libtpu_topology, slice_wrap, topology_devices

    wrap = slice_wrap(libtpu_topology(topology))
    order = list(make_mesh(MeshConfig(), topology_devices(topology)).devices.flat)
    return {**network.time_collectives(ops, order, wrap), "wrap": list(wrap)}


def estimate(case: dict, step: dict, small: dict, large: dict) -> dict:
    """The peer's step through olmax plan's method, from its compile records (see the module)."""
    from olmax.hardware import BY_NAME
    from olmax.perf import network

    acc = BY_NAME[case["accelerator"]]
    mt, ops = step["result"], step["collective_ops"]
    model, layers = mt["model"], mt["layer_attention"]
    l_small, l_large = case["parts"]["layers"]
    cs, cl = small["result"]["cost"]["optimal_seconds"], large["result"]["cost"]["optimal_seconds"]
    per_layer = (cl - cs) / (l_large - l_small)
    rest = cs - l_small * per_layer               # embedding, LM head, loss
    n_layers = len(layers)
    period = next(p for p in range(1, n_layers + 1)
                  if n_layers % p == 0 and layers == layers[:p] * (n_layers // p))
    if l_small % period or l_large % period:
        raise CaseError(f"{case['name']}: parts of {l_small} and {l_large} layers are not whole "
                        f"periods of the attention pattern ({period} layers)")
    opt = mt.get("optimizer") or {}
    if "cost" not in opt:
        raise CaseError(f"{case['name']}: the step's record has no optimizer part ({opt.get('error')})")
    opt_s = opt["cost"]["optimal_seconds"]
    kern = kernel_work(model, layers, acc.mxu)
    kernel_s = kern["flops_at_occupancy"] / acc.matmul_rate
    compute = n_layers * per_layer + rest + opt_s + kernel_s
    coll = time_collectives(ops, case["topology"])
    step_s, no_overlap = network.overlap(compute, coll)
    tflops = (mt.get("maxtext_tflops") or {}).get("total")
    return {"compute_s": compute, "layer_s": per_layer, "rest_s": rest, "optimizer_s": opt_s,
            "kernel_s": kernel_s, "kernel": kern, "collective_s": coll["collective_s"],
            "async_s": coll["async_s"], "sync_s": coll["sync_s"], "collectives_by_kind_s": coll["by_kind"],
            "wrap": coll["wrap"], "step_s": step_s, "step_s_no_overlap": no_overlap,
            "mfu": None if tflops is None else tflops * 1e12 / step_s / acc.peak_bf16,
            "maxtext_tflops_per_device": tflops, "num_params": mt.get("num_params"),
            "peak_bytes": mt["memory"].get("peak_memory_in_bytes"),
            "compile_s": {"step": mt.get("compile_s"), "parts": [small["result"].get("compile_s"),
                                                                 large["result"].get("compile_s")]},
            "method": ("olmax plan's: XLA TPU cost model (optimal_seconds) of two unscanned one-device "
                       f"parts ({l_small} and {l_large} layers; one layer = their difference / "
                       f"{l_large - l_small}, the rest = embedding/LM head/loss), MaxText's optimizer "
                       "update over one device's share, splash kernels at their FLOPs / "
                       f"({acc.matmul_rate / 1e12:.1f} TFLOP/s, the device's sustained matrix rate, x "
                       "MXU occupancy), the compiled step's collectives timed by olmax.perf.network; "
                       "step = max(compute, asynchronous collectives) + synchronous collectives")}


def measured_step(case: dict, cases: dict, tflops: dict[str, float | None]) -> tuple[float | None, str]:
    """The measured step time of ``case`` in seconds and how it was read (``tflops``: MaxText's
    own count per device and step, by case)."""
    from olmax.hardware import BY_NAME

    m = case["measured"]
    if m.get("relative_to"):
        ref, how = measured_step(cases[m["relative_to"]], cases, tflops)
        if ref is None:
            return None, f"relative to {m['relative_to']}, which has no measured step ({how})"
        return ref / m["speedup"], f"{m['relative_to']}'s {ref:.4g} s / {m['speedup']} ({how})"
    if m.get("step_s") is not None:
        return float(m["step_s"]), "published step time"
    peak = BY_NAME[case["accelerator"]].peak_bf16
    count = tflops.get(case["name"])
    if count is None or not peak:
        return None, "an MFU without the peer's FLOP count (its step not compiled)"
    return count * 1e12 / (m["mfu"] * peak), (f"{m['convention']} MFU {m['mfu']:.3f}: MaxText's "
                                              f"{count:.1f} TFLOP per device / (MFU x {peak / 1e12:.1f} TFLOP/s)")


def gpu_assignment(accelerator: str, count: int) -> list:
    """The devices of a GPU case's program as the network model reads them: GPU ``i`` of the
    program's device assignment on node ``i // GPUS_PER_NODE`` (MaxText's mesh over one node's
    GPUs puts them in id order; a group inside a node is timed alike in any order)."""
    from types import SimpleNamespace

    from olmax.hardware import BY_NAME
    from olmax.perf.targets import GPUS_PER_NODE

    kind = BY_NAME[accelerator].kinds[0]
    return [SimpleNamespace(platform="gpu", device_kind=kind, id=i, process_index=i // GPUS_PER_NODE)
            for i in range(count)]


def estimate_gpu(case: dict, text: str, ops: list[dict] | None = None, tflops: float | None = None) -> dict:
    """A GPU program through olmax plan's GPU method (:mod:`olmax.perf.gpu_estimate`): each kernel
    of the compiled step at the measured rates of the GPU's table; its collectives (``ops``, as
    :func:`olmax.perf.hlo.collective_ops` read them) timed by the network model over the case's
    GPUs and combined as ``olmax plan`` does (:func:`olmax.perf.network.overlap`). A stored
    program of one GPU has none. ``tflops``: the peer's own FLOP count per device and step, for
    the estimate's MFU in its convention."""
    from olmax.hardware import BY_NAME
    from olmax.perf import gpu_estimate, hlo, network

    acc = BY_NAME[case["accelerator"]]
    rates = gpu_estimate.rates_for(acc)
    if rates is None:
        raise CaseError(f"{case['name']}: no GPU rates table prices {acc.name}")
    if ops is None:
        if hlo.collective_ops(hlo.analyse(text)):
            raise CaseError(f"{case['name']}: a stored program with collectives needs its device "
                            "assignment (not recorded)")
        ops = []
    est = gpu_estimate.estimate(text, rates)
    coll = network.time_collectives(ops, gpu_assignment(acc.name, case["devices"]))
    step_s, no_overlap = network.overlap(est["compute_s"], coll)
    m = case["measured"]
    mfu = (tflops * 1e12 / step_s / acc.peak_bf16 if tflops
           else (m["mfu"] * m["step_s"] / step_s) if (m.get("mfu") and m.get("step_s")) else None)
    return {**est, "step_s": step_s, "step_s_no_overlap": no_overlap, "collective_s": coll["collective_s"],
            "async_s": coll["async_s"], "sync_s": coll["sync_s"], "collectives_by_kind_s": coll["by_kind"],
            "mfu": mfu, "maxtext_tflops_per_device": tflops,
            "method": gpu_estimate.METHOD + ("; collectives timed by olmax.perf.network, step = max(compute, "
                                             "asynchronous collectives) + synchronous collectives" if ops else "")}


def _calibrate_gpu_step(case: dict, base: dict, maxtext_python: str, rerun: bool, compile_: bool,
                        timeout: int) -> dict:
    """A MaxText GPU case: its whole step compiled for the case's compile-only GPUs, priced kernel
    by kernel from the stored program, its collectives from the record."""
    import gzip

    req = compile_request(case, "step")
    rec = None if rerun else compile_record(req)
    if rec is None and compile_:
        rec = run_compile(req, maxtext_python, timeout)
    base["compiles"]["step"] = {"key": _key(req), "rc": None if rec is None else rec["rc"],
                                "wall_s": None if rec is None else rec["wall_s"], "reused_from": None}
    if rec is None:
        return {**base, "status": "not compiled (MaxText's environment with JAX's CUDA plugin compiles "
                                  "it: benchmarks/README.md, 'Calibration')"}
    if rec["rc"] != 0 or rec["result"] is None:
        return {**base, "status": "failed: step", "failure_tails": {"step": rec["output_tail"][-600:]}}
    path = COMPILES / f"{_key(req)}.hlo.gz"
    if not path.exists():
        return {**base, "status": f"no stored program: {path.name} is missing"}
    text = gzip.decompress(path.read_bytes()).decode()
    tflops = (rec["result"].get("maxtext_tflops") or {}).get("total")
    from olmax.perf import hlo

    try:   # the collectives read from the kept program with today's reader, as the kernels are
        est = estimate_gpu(case, text, hlo.collective_ops(hlo.analyse(text)), tflops)
    except CaseError as e:
        return {**base, "status": f"no estimate: {e}"}
    est.update(peak_bytes=rec["result"]["memory"].get("peak_memory_in_bytes"),
               num_params=rec["result"].get("num_params"), compile_s={"step": rec["result"].get("compile_s")})
    return {**base, "estimate": est, "status": "estimated"}


def _calibrate_olmax_tpu(case: dict, base: dict, rerun: bool, compile_: bool) -> dict:
    """An olmax step measured on a TPU (``benchmarks/tpu.sh`` writes these cases): ``olmax plan``
    of its recipe and overrides (``peer.recipe``, ``peer.args``) for its topology, which is the
    estimate; the plan is kept in the compile records by what it was asked."""
    from olmax.io import write_json_atomic
    from olmax.perf.plan import plan
    from olmax.train.recipes import load_recipe

    recipe, overrides = case["peer"]["recipe"], case["peer"]["args"]
    req = {"mode": "olmax-plan", "topology": case["topology"], "recipe": recipe, "args": overrides,
           "layers": None}
    path = COMPILES / f"{_key(req)}.json"
    if path.exists() and not rerun:
        p = json.loads(path.read_text())
    elif compile_:
        t0 = time.perf_counter()
        p = plan(load_recipe(recipe, overrides, find_mix=False), case["topology"]).to_dict()
        p["wall_s"] = time.perf_counter() - t0
        write_json_atomic(path, p)
    else:
        return {**base, "status": f"not compiled: olmax plan ({path.name} is missing)"}
    base["compiles"]["plan"] = {"key": _key(req), "rc": 0, "wall_s": p.get("wall_s"), "reused_from": None}
    est = dict(p["estimate"])
    if not est.get("step_s"):
        return {**base, "status": f"no estimate: {est.get('method')}"}
    est["mfu"] = est.get("mfu_causal")
    est["peak_bytes"] = p["memory"]["peak_bytes"]
    return {**base, "estimate": est, "status": "estimated"}


def calibrate_case(case: dict, maxtext_python: str, rerun: bool, compile_: bool, timeout: int) -> dict:
    from olmax.hardware import BY_NAME

    acc = BY_NAME[case["accelerator"]]
    base = {"case": case["name"], "accelerator": case["accelerator"], "topology": case["topology"],
            "devices": case["devices"], "convention": case["measured"]["convention"],
            "source": case["measured"]["source"].strip(), "estimate": None, "status": None, "compiles": {}}
    if case["peer"]["program"] == "olmax" and acc.platform == "tpu":
        return _calibrate_olmax_tpu(case, base, rerun, compile_)
    if case["peer"]["program"] == "olmax":
        import gzip

        path = HERE / case["peer"]["hlo"]
        if not path.exists():
            return {**base, "status": f"no stored program: {case['peer']['hlo']} is missing"}
        raw = path.read_bytes()
        text = (gzip.decompress(raw) if path.name.endswith(".gz") else raw).decode()
        try:
            return {**base, "estimate": estimate_gpu(case, text), "status": "estimated"}
        except CaseError as e:
            return {**base, "status": f"no estimate: {e}"}
    if acc.platform != "tpu":
        return _calibrate_gpu_step(case, base, maxtext_python, rerun, compile_, timeout)
    reqs = {f"parts_l{n}": compile_request(case, "parts", n) for n in case["parts"]["layers"]}
    reqs["step"] = compile_request(case, "step")
    records = {}
    for label, req in reqs.items():
        rec = None if rerun else (compile_record(req) or earlier_compile(req))
        if rec is None and compile_:
            rec = run_compile(req, maxtext_python, timeout)
        records[label] = rec
        base["compiles"][label] = {"key": _key(req), "rc": None if rec is None else rec["rc"],
                                   "wall_s": None if rec is None else rec["wall_s"],
                                   "reused_from": None if rec is None else rec.get("reused_from")}
    missing = [k for k, r in records.items() if r is None]
    failed = [k for k, r in records.items() if r is not None and (r["rc"] != 0 or r["result"] is None)]
    if missing or failed:
        why = (f"not compiled: {', '.join(missing)}" if missing else "") + \
              (f"; failed: {', '.join(failed)}" if failed else "")
        tails = {k: records[k]["output_tail"][-600:] for k in failed}
        return {**base, "status": why.strip("; "), "failure_tails": tails}
    small, large = (records[f"parts_l{n}"] for n in case["parts"]["layers"])
    try:
        est = estimate(case, records["step"], small, large)
    except CaseError as e:
        return {**base, "status": f"no estimate: {e}"}
    return {**base, "estimate": est, "status": "estimated"}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", action="append", default=[], help="a case name (repeatable; default: all)")
    p.add_argument("--maxtext-python", default=os.environ.get("MAXTEXT_PYTHON", DEFAULT_MAXTEXT_PYTHON),
                   help="MaxText's interpreter (default: $MAXTEXT_PYTHON or %(default)s)")
    p.add_argument("--json", dest="json_out", default=str(SUMMARY))
    p.add_argument("--rerun", action="store_true", help="compile again even where a record exists")
    p.add_argument("--no-compile", action="store_true", help="only what the compile records give")
    p.add_argument("--timeout", type=int, default=5400, help="seconds per compile")
    p.add_argument("--check", action="store_true", help="validate every case file and stop")
    a = p.parse_args()
    cases = load_cases()
    chosen = load_cases(a.case or None)
    if a.check:
        print(f"{len(cases)} case files valid: {', '.join(cases)}")
        return 0
    maxtext = any(c["peer"]["program"] == "maxtext" for c in chosen.values())
    if maxtext and not a.no_compile and not Path(a.maxtext_python).exists():
        print(f"calibrate: MaxText's interpreter {a.maxtext_python} does not exist (see benchmarks/README.md, "
              "'Calibration'); --no-compile uses the compile records there are", file=sys.stderr)
        return 2
    from olmax.hardware import BY_NAME
    from olmax.io import write_json_atomic

    results = {}
    for name, case in chosen.items():
        results[name] = calibrate_case(case, a.maxtext_python, a.rerun, not a.no_compile, a.timeout)
        write_json_atomic(RESULTS / f"{name}.json", results[name])
    # every case with a result on disk goes into the tables, not only those run now
    for name, case in cases.items():
        path = RESULTS / f"{name}.json"
        if name not in results:
            results[name] = json.loads(path.read_text()) if path.exists() else {
                "case": name, "accelerator": case["accelerator"], "topology": case["topology"],
                "devices": case["devices"], "convention": case["measured"]["convention"],
                "source": case["measured"]["source"].strip(), "estimate": None,
                "status": "not run yet (no result in results/calibration/)"}
    tflops = {n: (r.get("estimate") or {}).get("maxtext_tflops_per_device") for n, r in results.items()}
    rows = []
    for name in cases:
        r = results.get(name)
        if r is None:
            continue
        meas, how = measured_step(cases[name], cases, tflops)
        est = r.get("estimate") or {}
        r["measured_step_s"], r["measured_how"] = meas, how
        r["estimated_step_s"] = est.get("step_s")
        r["ratio"] = meas / est["step_s"] if (meas and est.get("step_s")) else None
        count = tflops.get(name)
        peak = BY_NAME[r["accelerator"]].peak_bf16
        r["measured_mfu"] = cases[name]["measured"].get("mfu") or (
            count * 1e12 / meas / peak if (count and meas and peak) else None)
        rel = cases[name]["measured"].get("relative_to")
        if rel and results.get(rel, {}).get("estimate") and est:
            r["estimated_speedup"] = results[rel]["estimate"]["step_s"] / est["step_s"]
            r["measured_speedup"] = cases[name]["measured"]["speedup"]
        rows.append(r)
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    sec = lambda x: "-" if x is None else f"{x:.3f}"  # noqa: E731
    print("\n| case | estimate s | estimate MFU | measured s | measured MFU | measured / estimated | status |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        est = r.get("estimate") or {}
        ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
        extra = (f"; speed-up estimated {r['estimated_speedup']:.3f} vs measured {r['measured_speedup']:.3f}"
                 if r.get("estimated_speedup") else "")
        print(f"| {r['case']} | {sec(est.get('step_s'))} | {pct(est.get('mfu'))} ({r['convention']}) | "
              f"{sec(r['measured_step_s'])} | {pct(r['measured_mfu'])} | "
              f"{ratio} | {r['status']}{extra} |")
    write_json_atomic(a.json_out, {"conventions": CONVENTIONS, "cases": rows})
    table = {"generated": time.strftime("%Y-%m-%d"), "generated_by": "benchmarks/calibrate.py",
             "method": "published peer runs compiled ahead of time and put through olmax plan's estimate; "
                       "ratio = measured / estimated step time, not applied to any estimate",
             "cases": [{k: r.get(k) for k in ("case", "accelerator", "topology", "devices", "measured_step_s",
                                              "estimated_step_s", "ratio", "convention", "source", "status")}
                       for r in rows]}
    write_json_atomic(PACKAGE_TABLE, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
