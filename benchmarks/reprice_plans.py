"""Stored TPU plans re-estimated with the current price of their Pallas kernels, without compiling.

A plan's JSON keeps what its estimate was made of: the parts' cost-model time (``compute_s -
kernel_s``), the kernels' FLOPs at their MXU occupancy (``details.kernel_flops_at_mxu_occupancy``)
and its collectives timed asynchronous / synchronous (``details.collective_time``). When the rate
the kernels are priced at changes (:attr:`olmax.hardware.Accelerator.matmul_rate`), the estimate
is redone from those figures exactly as ``olmax plan`` combines them (:func:`olmax.perf.network.
overlap`): kernels, compute, step, tokens/s, MFU, the method's text and ``estimate.calibration``
(the package's current table). Everything else -- memory, collectives, FLOP counts -- is the
compiled program's and is left as it is. The file records what it was before (``estimate.
repriced``). A plan without kernels or without a cost-model estimate (GPU plans, parts skipped)
is left untouched.

    python benchmarks/reprice_plans.py FILE [FILE ...]     (a plan's JSON, or a tpu_plan.py record)
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

from olmax.hardware import accelerator_of
from olmax.io import write_json_atomic
from olmax.perf import calibration, network
from olmax.perf.plan import kernel_price

_KERNEL_PRICE = re.compile(r"Pallas kernels at their FLOPs / \([^)]*\)")


def reprice(plan: dict) -> str | None:
    """Re-estimate ``plan`` (in place) at its accelerator's current matrix rate; a line saying what
    moved, or None when the plan has nothing to reprice."""
    e, d = plan.get("estimate") or {}, plan.get("details") or {}
    acc = accelerator_of(plan.get("device_kind", ""))
    effective = d.get("kernel_flops_at_mxu_occupancy")
    if (acc is None or acc.platform != "tpu" or not effective or e.get("compute_s") is None
            or e.get("kernel_s") is None or e.get("step_s") is None
            or not (e.get("method") or "").startswith("estimate: XLA TPU cost model")):
        return None      # (a step priced from a measured rates table has no matrix rate to change)
    rate = acc.matmul_rate
    before = {k: e[k] for k in ("kernel_s", "compute_s", "step_s", "step_s_no_overlap",
                                "tokens_per_s_per_chip", "mfu_olmo_core", "mfu_causal")}
    kernel_s = effective / rate
    compute_s = e["compute_s"] - e["kernel_s"] + kernel_s
    coll = d.get("collective_time")
    if coll and coll.get("async_s") is not None:
        step_s, no_overlap = network.overlap(compute_s, {**coll, "collective_s": e["collective_s"]})
    else:   # collectives not timed: the step is the compute
        step_s = no_overlap = compute_s
    scale = e["step_s"] / step_s
    e.update(kernel_s=kernel_s, compute_s=compute_s, step_s=step_s, step_s_no_overlap=no_overlap,
             tokens_per_s_per_chip=e["tokens_per_s_per_chip"] * scale,
             mfu_olmo_core=e["mfu_olmo_core"] * scale if e.get("mfu_olmo_core") else e.get("mfu_olmo_core"),
             mfu_causal=e["mfu_causal"] * scale if e.get("mfu_causal") else e.get("mfu_causal"),
             calibration=calibration.for_accelerator(acc))
    e["method"] = _KERNEL_PRICE.sub(kernel_price(rate), e.get("method") or "")
    first = e.get("repriced", {}).get("before", before)   # a second run keeps the original figures
    e["repriced"] = {"date": datetime.date.today().isoformat(), "kernel_rate": rate,
                     "how": "benchmarks/reprice_plans.py: the stored estimate's parts, kernels "
                            "and collectives recombined, kernels at the current matrix rate",
                     "before": first}
    return (f"kernels {before['kernel_s'] * 1e3:.1f} -> {kernel_s * 1e3:.1f} ms, step "
            f"{before['step_s'] * 1e3:.1f} -> {step_s * 1e3:.1f} ms"
            + (f", MFU (causal) {before['mfu_causal']:.1%} -> {e['mfu_causal']:.1%}"
               if e.get("mfu_causal") else ""))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", type=Path)
    args = p.parse_args(argv)
    for path in args.files:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            print(f"reprice_plans: {path}: {e}", file=sys.stderr)
            return 2
        plan = record.get("plan", record) if isinstance(record, dict) else None
        said = reprice(plan) if isinstance(plan, dict) else None
        if said is None:
            print(f"{path.name}: nothing to reprice")
            continue
        write_json_atomic(path, record)
        print(f"{path.name}: {said}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
