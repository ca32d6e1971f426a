"""The model's kernel sets: the few functions whose computation differs by platform profile.

Each set gives the same three functions with the same values (up to fp32 summation order):

- ``dense(x, w)``: ``x @ w`` accumulated in fp32, rounded to ``x``'s dtype;
- ``rms_norm(x, weight, eps)``: OLMo's RMSNorm (fp32 normalisation and weight multiply);
- ``contract_rows(x, g)``: a weight gradient ``sum_n x[n, :]^T g[n, :]`` in fp32.

``reference`` (:mod:`.reference`) is the plain JAX formulation, differentiated by autodiff: what the
TPU and GPU profiles run. ``cpu`` (:mod:`.cpu`) writes out the backward passes in the shapes XLA's CPU
backend runs fast. ``norm`` is ``reference`` but for RMSNorm, which is ``cpu``'s: its backward
pass keeps the norm's input in its own dtype and one fp32 scale per row, where autodiff of the
fp32 formulation keeps an fp32 copy of the input (measured on a v5e chip it is not faster:
1.008x and 1.059x the step time of ``reference``, benchmarks/notes/
2026-12-07-one-v5e-chip-round-eight.md). A profile names its set
(``olmax.platforms.Profile.kernels``); ``train.kernels`` overrides it.

:data:`FLOAT8_KERNELS` holds each set with its ``dense`` in float8 (:mod:`.float8`, torchao's
tensorwise recipe; ``Runtime.float8``): on the ``cpu`` set as torchao's emulation (float8 casts,
fp32 matmuls), on ``reference`` with float8 operands in the dots.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from olmax.model.kernels import cpu, float8, reference


class Kernels(NamedTuple):
    name: str
    dense: Callable
    rms_norm: Callable
    contract_rows: Callable


KERNELS: dict[str, Kernels] = {
    "reference": Kernels("reference", reference.dense, reference.rms_norm, reference.contract_rows),
    "cpu": Kernels("cpu", cpu.dense, cpu.rms_norm, cpu.contract_rows),
    "norm": Kernels("norm", reference.dense, cpu.rms_norm, reference.contract_rows),
}


def _with_float8(k: Kernels) -> Kernels:
    return k._replace(name=f"{k.name}+float8",
                      dense=float8.float8_dense(k.dense, emulate=k.name == "cpu"))


FLOAT8_KERNELS: dict[str, Kernels] = {name: _with_float8(k) for name, k in KERNELS.items()}
