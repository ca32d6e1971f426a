"""The rates a TPU's matrix products reach inside a training step, by form, from the chip's profile
of a measured step, into the rates table that ``olmax plan`` prices that TPU's steps with.

``olmax bench matmul --table`` times each product of its grid alone, in the forward form
(``x @ W``). Inside a step two thirds of the products are the backward's: the weight gradient
(contracting the rows: ``...i,...o->io``) and the product with the transposed weight
(``...o,io->...i``), fused with what XLA puts around them. On a v5e chip (the 7B slice's profile,
``results/tpu_v5e_2026-12-06_round2/profile_slice.json.gz``) they ran at 164.6 and 155.9 TFLOP/s
where the grid's products of the same widths ran at 185-190, and the step's forward products at
179.7. This reads the profile (``olmax bench profile --json``: every op's time and its matmul
FLOPs), groups its matrix products by form (:func:`olmax.perf.gpu_estimate.gemm_form`; the
attention kernels are not products of the grid), and writes each form's FLOPs over its time into
the table as ``gemm_in_step`` with the profile it came from. The estimate then prices each product
at the lower of the grid's rate at its shape and its form's in-step rate
(:meth:`olmax.perf.gpu_estimate.Rates.gemm_in_step`).

    python benchmarks/tpu_gemm_forms.py PROFILE.json[.gz] TABLE.json
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


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("profile", help="olmax bench profile --json output (.json or .json.gz)")
    p.add_argument("table", help="the rates table to add gemm_in_step to (written in place)")
    a = p.parse_args(argv)
    opener = gzip.open if a.profile.endswith(".gz") else open
    with opener(a.profile, "rt") as f:
        profile = json.load(f)
    with open(a.table) as f:
        table = json.load(f)
    got = forms(profile)
    if not got["flops_per_s"]:
        print(f"{a.profile}: no matrix products with FLOPs in the profile", file=sys.stderr)
        return 2
    got["source"] = (f"{os.path.relpath(a.profile)}: olmax bench profile ({profile.get('steps')} steps, "
                     f"jax {profile.get('jax')}) of olmo3_tiny {' '.join(profile.get('overrides', []))}")
    table["gemm_in_step"] = got
    write_json_atomic(a.table, table, overwrite=True)
    for form, rate in sorted(got["flops_per_s"].items()):
        print(f"{form}: {rate / 1e12:.1f} TFLOP/s ({got['flops'][form] / 1e12:.2f} TFLOP in {got['ms'][form]:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
