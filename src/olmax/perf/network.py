"""Timing a compiled step's collectives: a stated bandwidth model of the target's network.

``olmax plan`` reads every collective of the compiled program (:func:`olmax.perf.hlo.collective_ops`:
kind, bytes per device, executions per step, replica group, whether it runs asynchronously) and
prices each execution here. The model, per device:

- **Which links a group uses.** A TPU group's devices are placed on the slice by their chip
  coordinates (``device.coords``). Each torus axis along which the group varies contributes its
  links: two directions of :attr:`~olmax.hardware.Accelerator.link_bw` where the group covers
  the whole axis and the slice wraps around it (a ring: which axes wrap is
  :func:`olmax.perf.targets.slice_wrap`), one where it does not (a line: the end link carries all
  but one share, as in a ring without its closing link). The group's bandwidth is the sum over
  its axes (a multi-dimensional algorithm uses the axes at once), shared by the devices of a chip
  (TPU7x: its 2 TensorCores), all of which run the same collective at once. A group within one
  chip moves no data over links (priced by its latency only). On a GPU target a group inside a
  node (one process: 8 GPUs behind NVSwitch) gets one direction of NVLink per GPU; a group across
  nodes the network card's (``dcn_bw``). A TPU group across slices gets the chip's DCN share; a
  target without a DCN figure cannot price it (:class:`Unpriced`), and the plan says so.
- **Bytes.** For ``S`` bytes per device (:func:`olmax.perf.hlo.collective_bytes`: the gathered
  result, the scattered input, the reduced buffer) over ``g`` devices at bandwidth ``B``:
  all-gather and reduce-scatter ``S (g-1)/g / B`` (bandwidth-optimal), all-reduce twice that
  (reduce-scatter + all-gather). All-to-all (:func:`all_to_all_seconds`, after the JAX scaling
  book): on a torus axis of ``k`` chips ``S floor(k^2/4)/k`` over the axis' link directions
  (about ``S k/4`` over a ring's bidirectional bandwidth, a quarter of an all-gather of the
  ``k S`` result), the slowest axis setting the time; through a switch or across slices
  ``S (g-1)/g / B``. Collective-permute (:func:`pair_seconds`): every source-target pair sends
  ``S`` over one direction of one link (or the chip's DCN share across slices, nodes), free
  within a chip; the permute takes as long as its slowest pair.
- **Latency.** :data:`STEP_LATENCY_S` per algorithm step: ``sum(k_i - 1)`` steps over the ``k_i``
  positions the group spans per axis for all-gather, reduce-scatter and all-to-all, twice that
  for all-reduce, one per hop of the slowest pair's route for a permute (the shorter way round a
  wrapped axis; one within a chip).

Overlap (how :mod:`olmax.perf.plan` combines these with the compute time): a collective the
compiled schedule runs asynchronously (``-start``/``-done`` pairs, or on TPU a ``custom-call-start``
that runs it on the SparseCores) can proceed beside compute; a synchronous one blocks. The
estimate is ``max(compute, asynchronous collectives) + synchronous collectives``, next to the
no-overlap sum. It is a model, not a measurement: link contention between concurrent
collectives (or between the pairs of one permute whose routes share a link), the compiler's
chunking and congestion are not modelled.
"""

from __future__ import annotations

from typing import Any, Sequence

from olmax.hardware import Accelerator, accelerator_of
from olmax.perf.targets import GPUS_PER_NODE

# Seconds per algorithm step of a collective (a hop and its synchronisation): assumed.
STEP_LATENCY_S = {"tpu": 1e-6, "gpu": 5e-6}


class Unpriced(ValueError):
    """A collective the model has no figures for (a link the hardware table does not give)."""


def _link_bw(device: Any) -> tuple[Accelerator, float]:
    """(the device's row of the hardware table, its ``link_bw``); :class:`Unpriced` where either
    is not known."""
    acc = accelerator_of(device)
    if acc is None or acc.link_bw is None:
        raise Unpriced(f"no network figures for {device.device_kind}")
    return acc, acc.link_bw


def _dcn_bw(acc: Accelerator) -> float:
    """Bytes/s per chip across slices (TPU) or nodes (GPU); :class:`Unpriced` where the table has
    no figure, rather than a guess."""
    if acc.dcn_bw is None:
        raise Unpriced(f"no data-center network (DCN) figure for {acc.name}: a collective across "
                       f"slices or nodes cannot be priced")
    return acc.dcn_bw


def _axis_sizes(all_devices: Sequence[Any]) -> list[int]:
    """Chips along each torus axis of the slice (from the devices' chip coordinates)."""
    return [n + 1 for n in map(max, zip(*(tuple(d.coords) for d in all_devices)))]


def _axes(devices: Sequence[Any], sizes: Sequence[int], wrap: Sequence[bool]) -> list[tuple[int, int]]:
    """(positions the group spans, link directions it has) per torus axis the group varies along:
    2 where it covers the whole axis and the slice wraps around it (a ring), else 1 (a line)."""
    coords = [tuple(d.coords) for d in devices]
    out = []
    for i, n in enumerate(sizes):
        k = len({c[i] for c in coords})
        if k > 1:
            out.append((k, 2 if (k == n and i < len(wrap) and wrap[i]) else 1))
    return out


def _slices(devices: Sequence[Any]) -> int:
    return len({getattr(d, "slice_index", 0) for d in devices})


def _node(d: Any) -> int:
    return getattr(d, "process_index", d.id // GPUS_PER_NODE)


def group_bandwidth(devices: Sequence[Any], all_devices: Sequence[Any],
                    wrap: Sequence[bool]) -> tuple[float, int]:
    """(bytes/s per device, algorithm steps) of a collective over ``devices`` (see module);
    bandwidth 0: the group never leaves a chip (only its latency counts)."""
    acc, link_bw = _link_bw(devices[0])
    steps = len(devices) - 1
    if acc.platform == "gpu":
        nodes = {_node(d) for d in devices}
        return (link_bw if len(nodes) == 1 else _dcn_bw(acc)), steps
    if _slices(devices) > 1:
        return _dcn_bw(acc) / acc.devices_per_chip, steps
    axes = _axes(devices, _axis_sizes(all_devices), wrap)
    links = sum(d for _, d in axes)
    cores = len({getattr(d, "core_on_chip", 0) for d in devices})
    steps = sum(k - 1 for k, _ in axes) + cores - 1
    return links * link_bw / acc.devices_per_chip, steps


def _hops(a: Any, b: Any, sizes: Sequence[int], wrap: Sequence[bool]) -> int:
    """Links between the chips of ``a`` and ``b`` on the shortest route: per axis the distance,
    the shorter way round where the axis wraps."""
    hops = 0
    for i, (x, y) in enumerate(zip(a.coords, b.coords)):
        d = abs(x - y)
        hops += min(d, sizes[i] - d) if (i < len(wrap) and wrap[i]) else d
    return hops


def pair_seconds(nbytes: float, a: Any, b: Any, sizes: Sequence[int], wrap: Sequence[bool],
                 acc: Accelerator | None = None) -> float:
    """Seconds for ``a`` to send ``nbytes`` to ``b`` (one pair of a collective-permute): one
    direction of one link (ICI, NVLink) or the chip's DCN share across slices or nodes, plus one
    step latency per hop; within a chip (or to itself) the latency only. ``acc``: ``a``'s row of
    the hardware table, if already looked up."""
    acc, link_bw = _link_bw(a) if acc is None or acc.link_bw is None else (acc, acc.link_bw)
    latency = STEP_LATENCY_S.get(acc.platform, STEP_LATENCY_S["tpu"])
    if acc.platform == "gpu":
        if a.id == b.id:
            return latency
        return latency + nbytes / (link_bw if _node(a) == _node(b) else _dcn_bw(acc))
    if getattr(a, "slice_index", 0) != getattr(b, "slice_index", 0):
        return latency + nbytes / (_dcn_bw(acc) / acc.devices_per_chip)
    hops = _hops(a, b, sizes, wrap)
    if hops == 0:
        return latency
    return hops * latency + nbytes / link_bw


def all_to_all_seconds(nbytes: float, devices: Sequence[Any], all_devices: Sequence[Any],
                       wrap: Sequence[bool]) -> float:
    """Seconds of one all-to-all of ``nbytes`` per device (its buffer: it keeps 1/g and sends
    1/g to each of the other g-1 devices) over ``devices``.

    On a TPU torus, as the JAX scaling book's "Sharded matrices" chapter ("AllToAll ... is thus
    1/4 the cost of an AllGather" on a bidirectional ring; its exercise on AllToAll on a ring
    derives the 1/2 of a one-way ring): along an axis of ``k`` chips the 1/k shards travel
    ``min(d, k - d)`` hops, in all ``floor(k^2/4)`` shard-hops per device, which a ring carries on
    its 2 link directions per chip and a line (no wraparound) puts on its middle link's one
    direction -- either way ``nbytes * floor(k^2/4) / k`` over the axis' link directions (about
    ``nbytes * k/4`` over the bidirectional bandwidth of a ring: a quarter of an all-gather of the
    ``k * nbytes`` result). With dimension-ordered routing each torus axis the group varies along
    carries its own share at once, so the slowest axis sets the time. Through a switch (GPUs in a
    node) or across slices or nodes each device sends its ``(g-1)/g`` at its own bandwidth."""
    acc, link_bw = _link_bw(devices[0])
    g = len(devices)
    bw, steps = group_bandwidth(devices, all_devices, wrap)
    latency = STEP_LATENCY_S.get(acc.platform, STEP_LATENCY_S["tpu"])
    if acc.platform == "gpu" or _slices(devices) > 1:
        return nbytes * (g - 1) / g / bw + steps * latency
    per_link = link_bw / acc.devices_per_chip   # one direction, shared by the chip's devices
    axes = _axes(devices, _axis_sizes(all_devices), wrap)
    moved = max((nbytes * (k * k // 4) / k / (links * per_link) for k, links in axes), default=0.0)
    return moved + steps * latency


def collective_seconds(op: dict, assignment: Sequence[Any], wrap: Sequence[bool]) -> float:
    """Seconds of one execution of collective ``op`` (a :func:`olmax.perf.hlo.collective_ops`
    entry) on the program's devices ``assignment`` (device id -> device). A collective-permute
    takes as long as its slowest source-target pair (all of them move at once)."""
    platform = assignment[0].platform
    latency = STEP_LATENCY_S.get(platform, STEP_LATENCY_S["tpu"])
    if op["kind"] == "collective-permute":
        pairs = op.get("pairs") or ([op["pair"]] if op.get("pair") else [(0, 1 % len(assignment))])
        sizes = _axis_sizes(assignment) if platform == "tpu" else []
        acc = accelerator_of(assignment[0])
        return max(pair_seconds(op["bytes"], assignment[s], assignment[t], sizes, wrap, acc)
                   for s, t in pairs)
    ids = op["group"] if op["group"] is not None else range(len(assignment))
    devices = [assignment[i] for i in ids]
    g = len(devices)
    if g <= 1:
        return 0.0
    if op["kind"] == "all-to-all":
        return all_to_all_seconds(op["bytes"], devices, assignment, wrap)
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
