"""A compiled training step's estimated time, for choosing among steps that fit
(``train.auto_choice=estimate``, :func:`olmax.train.fit.fit_step`'s ``price``), and the timing of
its collectives that ``olmax plan`` shares.

The price is ``olmax plan``'s estimate of the step on a device whose kind has a table of rates
measured on it (a v5e, an H100, an H200): every op of the compiled program at the table's rates
(:func:`olmax.perf.gpu_estimate.estimate`), and on more than one device the program's collectives
timed by :mod:`olmax.perf.network` beside that, ``max(compute, asynchronous) + synchronous``.
"""

from __future__ import annotations

from typing import Any, Callable

from olmax.hardware import accelerator_of
from olmax.perf import gpu_estimate, hlo, network
from olmax.perf.targets import libtpu_topology, parse_gpu, slice_wrap
from olmax.platforms import backend_of


def topology_wrap(mesh: Any, topology: str | None) -> tuple[bool, ...]:
    """Which axes of the TPU slice ``topology`` names have wraparound links (none where no TPU
    topology is named: a slice of live devices, a GPU target)."""
    if topology and mesh.devices.flat[0].platform == "tpu" and parse_gpu(topology) is None:
        return slice_wrap(libtpu_topology(topology))
    return ()


def step_collectives(prog: Any, mesh: Any, wrap: tuple[bool, ...] = ()) -> dict | None:
    """The compiled step's collectives (``prog``: :func:`olmax.perf.hlo.analyse` of its text)
    timed by :mod:`olmax.perf.network` on ``mesh``, or None where the devices' network is unknown;
    :class:`olmax.perf.network.Unpriced` where a link the step uses has no figure."""
    if not network.timed(mesh.devices.flat[0]):
        return None
    # device ids in the program's replica groups are positions in its device assignment: the
    # mesh's devices in order
    return network.time_collectives(hlo.collective_ops(prog), list(mesh.devices.flat), wrap)


def step_pricer(mesh: Any, wrap: tuple[bool, ...] = ()) -> Callable[[Any], float | None] | None:
    """``price(compiled)``: a compiled step's estimated seconds on ``mesh`` (``wrap``: the slice's
    wraparound axes, :func:`topology_wrap`), or None for a step whose collectives the network
    model cannot time; None where no measured table prices the devices (the CPU, TPUs of other
    generations)."""
    devices = list(mesh.devices.flat)
    platform = backend_of(devices)
    if platform not in ("tpu", "gpu"):
        return None
    rates = gpu_estimate.rates_for(accelerator_of(devices[0]))
    if rates is None:
        return None

    def price(compiled: Any) -> float | None:
        text = compiled.as_text()
        compute = float(gpu_estimate.estimate(text, rates, platform)["compute_s"])
        if len(devices) == 1:
            return compute
        try:
            coll = step_collectives(hlo.analyse(text), mesh, wrap)
        except network.Unpriced:
            return None
        return None if coll is None else network.overlap(compute, coll)[0]
    return price


__all__ = ["topology_wrap", "step_collectives", "step_pricer"]
