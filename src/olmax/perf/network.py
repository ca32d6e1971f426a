"""Timing a compiled step's collectives: a stated bandwidth model of the target's network.

``olmax plan`` reads every collective of the compiled program (:func:`olmax.perf.hlo.collective_ops`:
kind, bytes per device, executions per step, replica group, whether it runs asynchronously) and
prices each execution here. The model, per device:

- **Which links a group uses.** A TPU group's devices are placed on the slice by their chip
  coordinates (``device.coords``). Each torus axis along which the group varies contributes its
  links: two directions of :attr:`~olmax.hardware.Accelerator.link_bw` where the group covers
  the whole axis and the slice wraps around it (a ring), one where it does not (a line: the end
  link carries all but one share, as in a ring without its closing link). The group's bandwidth is
  the sum over its axes (a multi-dimensional algorithm uses the axes at once), shared by the
  devices of a chip (TPU7x: its 2 TensorCores), all of which run the same collective at once.
  A group within one chip moves no data over links (priced by its latency only). On a GPU target
  a group inside a node (one process: 8 GPUs behind NVSwitch) gets one direction of NVLink per GPU; a group
  across nodes the network card's (``dcn_bw``). A TPU group across slices gets the chip's DCN
  share.
- **Bytes.** For ``S`` bytes per device (:func:`olmax.perf.hlo.collective_bytes`: the gathered
  result, the scattered input, the reduced buffer) over ``g`` devices at bandwidth ``B``:
  all-gather and reduce-scatter ``S (g-1)/g / B`` (bandwidth-optimal), all-reduce twice that
  (reduce-scatter + all-gather), all-to-all as an all-gather (a lower bound: a torus' bisection
  may be less), collective-permute ``S`` over one direction of one link (neighbours; free within
  a chip).
- **Latency.** :data:`STEP_LATENCY_S` per algorithm step: ``sum(k_i - 1)`` steps over the ``k_i``
  positions the group spans per axis for all-gather and reduce-scatter, twice that for
  all-reduce, one hop for a permute.

Overlap (how :mod:`olmax.perf.plan` combines these with the compute time): a collective the
compiled schedule runs asynchronously (``-start``/``-done`` pairs, or on TPU a ``custom-call-start``
that runs it on the SparseCores) can proceed beside compute; a synchronous one blocks. The
estimate is ``max(compute, asynchronous collectives) + synchronous collectives``, next to the
no-overlap sum. It is a model, not a measurement: link contention between concurrent
collectives, the compiler's chunking and congestion are not modelled.
"""

from __future__ import annotations

from typing import Any, Sequence

from olmax.hardware import accelerator_of
from olmax.perf.targets import GPUS_PER_NODE

# Seconds per algorithm step of a collective (a hop and its synchronisation): assumed.
STEP_LATENCY_S = {"tpu": 1e-6, "gpu": 5e-6}


def _spans(devices: Sequence[Any], all_devices: Sequence[Any]) -> list[tuple[int, int, int]]:
    """(axis, positions the group spans, axis length) per torus axis the group varies along."""
    coords = [tuple(d.coords) for d in devices]
    sizes = [n + 1 for n in map(max, zip(*(tuple(d.coords) for d in all_devices)))]
    spans = [(i, len({c[i] for c in coords}), n) for i, n in enumerate(sizes)]
    return [s for s in spans if s[1] > 1]


def group_bandwidth(devices: Sequence[Any], all_devices: Sequence[Any],
                    wrap: Sequence[bool]) -> tuple[float, int]:
    """(bytes/s per device, algorithm steps) of a collective over ``devices`` (see module);
    bandwidth 0: the group never leaves a chip (only its latency counts)."""
    acc = accelerator_of(devices[0])
    if acc is None or acc.link_bw is None:
        raise ValueError(f"no network figures for {devices[0].device_kind}")
    steps = len(devices) - 1
    if acc.platform == "gpu":
        nodes = {getattr(d, "process_index", d.id // GPUS_PER_NODE) for d in devices}
        return (acc.link_bw if len(nodes) == 1 else acc.dcn_bw), steps
    if len({getattr(d, "slice_index", 0) for d in devices}) > 1:
        return acc.dcn_bw / acc.devices_per_chip, steps
    spans = _spans(devices, all_devices)
    links = sum(2 if (k == n and i < len(wrap) and wrap[i]) else 1 for i, k, n in spans)
    cores = len({getattr(d, "core_on_chip", 0) for d in devices})
    steps = sum(k - 1 for _, k, _ in spans) + cores - 1
    return links * acc.link_bw / acc.devices_per_chip, steps


def collective_seconds(op: dict, assignment: Sequence[Any], wrap: Sequence[bool]) -> float:
    """Seconds of one execution of collective ``op`` (a :func:`olmax.perf.hlo.collective_ops`
    entry) on the program's devices ``assignment`` (device id -> device)."""
    platform = assignment[0].platform
    latency = STEP_LATENCY_S.get(platform, STEP_LATENCY_S["tpu"])
    acc = accelerator_of(assignment[0])
    if op["kind"] == "collective-permute":
        src, dst = op["pair"] or (0, 1 % len(assignment))
        a, b = assignment[src], assignment[dst]
        same_chip = platform == "tpu" and tuple(a.coords) == tuple(b.coords)
        if same_chip:
            return latency
        bw = acc.link_bw
        if platform == "tpu" and getattr(a, "slice_index", 0) != getattr(b, "slice_index", 0):
            bw = acc.dcn_bw / acc.devices_per_chip
        return latency + op["bytes"] / bw
    ids = op["group"] if op["group"] is not None else range(len(assignment))
    devices = [assignment[i] for i in ids]
    g = len(devices)
    if g <= 1:
        return 0.0
    bw, steps = group_bandwidth(devices, assignment, wrap)
    factor = 2.0 if op["kind"] == "all-reduce" else 1.0
    moved = 0.0 if bw == 0 else factor * op["bytes"] * (g - 1) / g / bw
    return moved + factor * steps * latency


def time_collectives(ops: list[dict], assignment: Sequence[Any], wrap: Sequence[bool] = ()) -> dict:
    """Seconds per step of the program's collectives: ``collective_s`` (all), ``async_s`` and
    ``sync_s`` (by :func:`olmax.perf.hlo.collective_ops`' ``async``) and ``by_kind``."""
    by_kind: dict[str, float] = {}
    total = {True: 0.0, False: 0.0}
    for op in ops:
        s = collective_seconds(op, assignment, wrap) * op["count"]
        by_kind[op["kind"]] = by_kind.get(op["kind"], 0.0) + s
        total[bool(op["async"])] += s
    return {"collective_s": total[True] + total[False], "async_s": total[True],
            "sync_s": total[False], "by_kind": by_kind}


def timed(device: Any) -> bool:
    """Whether the network of ``device``'s kind is known to the model."""
    acc = accelerator_of(device)
    return acc is not None and acc.link_bw is not None and getattr(device, "platform", "") in ("tpu", "gpu")


def overlap(compute_s: float, coll: dict) -> tuple[float, float]:
    """(step seconds with the asynchronous collectives beside compute, without any overlap)."""
    return (max(compute_s, coll["async_s"]) + coll["sync_s"],
            compute_s + coll["collective_s"])
