"""The rates a TPU's matrix products reach inside a training step, by form, from the chip's profiles
of measured steps, into the rates table that ``olmax plan`` prices that TPU's steps with.

``olmax bench matmul --table`` times each product of its grid alone, in the forward form
(``x @ W``). Inside a step two thirds of the products are the backward's: the weight gradient
(contracting the rows: ``...i,...o->io``) and the product with the transposed weight
(``...o,io->...i``), fused with what XLA puts around them. On a v5e chip the 7B slice's products
of the same widths as the grid's (which ran at 185-190 TFLOP/s) ran, by form (forward, transposed
weight, weight gradient), at 189.4, 176.3 and 180.2 TFLOP/s in a step of one micro-batch of
16,384 tokens, and at 186.4, 167.4 and 159.7 in a step of four micro-batches of 4,096
(``results/tpu_v5e_2026-12-07_round9/profile_slice_m{4,1}.json.gz``): the same products, slower
where the step accumulates over micro-batches.

This reads each profile (``olmax bench profile --json``: every op's time and its matmul FLOPs),
groups its matrix products by form (:func:`olmax.perf.gpu_estimate.gemm_form`; the attention
kernels are not products of the grid), and writes each form's FLOPs over its time into the table
as ``gemm_in_step``, one point per profile keyed by its step's tokens per micro-batch (``rows``:
micro-batch x sequence, one device), with the profile it came from. The estimate then prices each
product at the lower of the grid's rate at its shape and its form's in-step rate at the priced
step's tokens per micro-batch (:meth:`olmax.perf.gpu_estimate.Rates.gemm_in_step`).

    python benchmarks/tpu_gemm_forms.py PROFILE.json[.gz] [PROFILE ...] TABLE.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
from collections import defaultdict

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from olmax.io import write_json_atomic
from olmax.perf.gpu_estimate import gemm_form


def forms(profile: dict) -> dict:
    """Per form: the matrix products' milliseconds per step, FLOPs per step and FLOP/s."""
    ms: dict[str, float] = defaultdict(float)
    flops: dict[str, float] = defaultdict(float)
    for op in profile["ops"]:
        form = gemm_form(op.get("op_name", ""))
        if not op.get("dot_flops") or form is None or "splash" in op["op"]:
            continue
        ms[form] += op["ms"]
        flops[form] += op["dot_flops"]
    return {"ms": dict(ms), "flops": dict(flops),
            "flops_per_s": {f: flops[f] / (ms[f] * 1e-3) for f in ms if ms[f] > 0}}


def micro_rows(profile: dict, path: str) -> int:
    """Tokens per micro-batch of the profiled step (one device): its micro-batch (recorded by
    ``olmax bench profile``, else its ``train.micro_batch_size`` override) x its sequence."""
    micro = profile.get("micro_batch_size")
    if micro is None:
        given = [o.split("=", 1)[1] for o in profile.get("overrides", [])
                 if o.startswith("train.micro_batch_size=")]
        if not given or not given[-1].isdigit():
            raise SystemExit(f"{path}: the profile does not say its micro-batch size "
                             "(profile with train.micro_batch_size=N)")
        micro = int(given[-1])
    return int(micro) * int(profile["seq_len"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profiles", nargs="+", metavar="PROFILE",
                   help="olmax bench profile --json output (.json or .json.gz), one per step size")
    p.add_argument("table", help="the rates table to add gemm_in_step to (written in place)")
    a = p.parse_args(argv)
    with open(a.table) as f:
        table = json.load(f)
    points = []
    for path in a.profiles:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            profile = json.load(f)
        got = forms(profile)
        if not got["flops_per_s"]:
            print(f"{path}: no matrix products with FLOPs in the profile", file=sys.stderr)
            return 2
        got["rows"] = micro_rows(profile, path)
        got["source"] = (f"{os.path.relpath(path)}: olmax bench profile ({profile.get('steps')} steps, "
                         f"jax {profile.get('jax')}) of olmo3_tiny {' '.join(profile.get('overrides', []))}")
        points.append(got)
    rows = [pt["rows"] for pt in points]
    if len(set(rows)) != len(rows):
        print(f"two profiles of steps of the same tokens per micro-batch ({rows})", file=sys.stderr)
        return 2
    table["gemm_in_step"] = {"by_rows": sorted(points, key=lambda pt: pt["rows"])}
    write_json_atomic(a.table, table, overwrite=True)
    for pt in table["gemm_in_step"]["by_rows"]:
        for form, rate in sorted(pt["flops_per_s"].items()):
            print(f"{pt['rows']} tokens per micro-batch, {form}: {rate / 1e12:.1f} TFLOP/s "
                  f"({pt['flops'][form] / 1e12:.2f} TFLOP in {pt['ms'][form]:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
