"""The targets ``olmax plan`` compiles for: the rows of the hardware table
(:mod:`olmax.hardware`) that can be compiled for without the device (:data:`ACCELERATORS`: libtpu's
topology name for a TPU, a ``GpuTargetConfig`` for a GPU), the devices of a ``--topology`` and
libtpu's start-up noise filtered from stderr.

GPUs: XLA's GPU compiler can compile for a device it is only told about (a ``GpuTargetConfig``: the
device description a real GPU would report) through the CUDA PJRT plugin's topology
(``get_topology_desc(platform="cuda", target_config=..., topology="1x1xN")``). That needs the
plugin (``pip install "jax[cuda12]"`` at the jax pin) but no GPU and no driver.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import sys

from olmax import hardware
from olmax.errors import ConfigError, OlmaxError
from olmax.hardware import Accelerator
# The device-memory figures live with the rest of what is known of device memory; ``olmax plan``
# and ``olmax launch`` read them from here too.
from olmax.device_memory import (HBM_BYTES, MEM_FRACTION, MEM_FRACTION_ENV, hbm_bytes,  # noqa: F401
                                 mem_fraction, usable_hbm)

GPUS_PER_NODE = 8     # an HGX node: 8 GPUs behind NVSwitch

# What ``olmax plan --topology`` compiles for.
ACCELERATORS: tuple[Accelerator, ...] = tuple(a for a in hardware.ACCELERATORS if a.plan_target)
TPU_GENERATIONS = tuple(a.name for a in ACCELERATORS if a.platform == "tpu")   # libtpu's topology names
GPU_TARGETS = {a.name: a.gpu_target for a in ACCELERATORS if a.gpu_target}

_LIBTPU_NOISE = ("TPU_ACCELERATOR_TYPE", "TPU_WORKER_HOSTNAMES", "Failed to find host bounds",
                 "Logging before InitGoogle", "libtpu_init_utils", "Source Location Trace",
                 "could not determine TPU")


def parse_gpu(name: str) -> tuple[str, int] | None:
    """``h100:8`` -> ("h100", 8); ``h200`` -> ("h200", 1); ``h100:64x8`` (64 nodes of 8) ->
    ("h100", 512); None for names of no GPU here. A GPU count that is not a positive whole number
    (``h100:eight``, ``h100:0``) is an OlmaxError."""
    kind, _, count = name.lower().partition(":")
    if kind not in GPU_TARGETS:
        return None
    nodes, _, per_node = count.rpartition("x")
    if count and not (per_node.isdigit() and int(per_node) > 0
                      and (not nodes or (nodes.isdigit() and int(nodes) > 0))):
        raise OlmaxError(f"--topology {name}: the GPU count must be a positive whole number "
                         f"(e.g. {kind}:8, or {kind}:64x8 for 64 nodes of 8)")
    return kind, int(nodes or 1) * int(per_node or 1)


def _no_tpu_attached() -> bool:
    import glob

    return not (glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


# The filter runs in a process of its own: libtpu ends the process itself on some bad input (an
# unknown flag in LIBTPU_INIT_ARGS), and what it said last must still reach the user. Lines are
# passed on as they come, but for libtpu's start-up noise; an unknown flag becomes one olmax line.
_STDERR_FILTER = r"""
import re, sys
noise = sys.argv[1:]
flag = re.compile(r"Unknown command line flag '([^']+)'")
for raw in sys.stdin.buffer:
    line = raw.decode(errors="replace").rstrip("\n")
    m = flag.search(line)
    if m:
        line = ("olmax: libtpu does not know the flag '--%s' (from LIBTPU_INIT_ARGS or the step's "
                "compiler options): remove it or check its spelling" % m.group(1))
    elif not line.strip() or any(n in line for n in noise):
        continue
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
"""


@contextlib.contextmanager
def filtered_stderr():
    """Drop libtpu's start-up warnings (file-descriptor level: they come from C++). The rest of
    what is written to standard error meanwhile is passed on, also when libtpu exits the process
    (:data:`_STDERR_FILTER`)."""
    import subprocess

    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real stderr (some test runners)
        yield
        return
    read, write = os.pipe()
    try:
        child = subprocess.Popen([sys.executable, "-S", "-c", _STDERR_FILTER, *_LIBTPU_NOISE],
                                 stdin=read, stdout=saved, stderr=subprocess.DEVNULL, close_fds=True)
    except OSError:  # cannot start a process: unfiltered
        os.close(read), os.close(write), os.close(saved)
        yield
        return
    os.close(read)
    os.dup2(write, 2)
    os.close(write)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # the pipe's last write end in this process: the filter sees its end
        os.close(saved)
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:  # a process started meanwhile still holds the pipe
            child.kill()


def cuda_plugin_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("jax_plugins.xla_cuda12") is not None
    except ModuleNotFoundError:  # no jax_plugins package at all
        return False


def gpu_topology_devices(kind: str, count: int) -> list:
    """``count`` compile-only GPUs described by :data:`GPU_TARGETS` (no GPU needed; the CUDA
    PJRT plugin must be installed); more than one node's worth are nodes of
    :data:`GPUS_PER_NODE`."""
    import glob

    if not cuda_plugin_installed():
        import jax

        raise OlmaxError(f"--topology {kind}:{count}: compiling for GPUs needs JAX's CUDA plugin: "
                         f"pip install 'jax[cuda12]=={jax.__version__}'")
    if not glob.glob("/dev/nvidia[0-9]*"):  # no driver to check the CUDA libraries against
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    from jax.experimental import topologies

    try:
        # beyond one node: nodes of GPUS_PER_NODE, each its own process (host)
        hosts, per_host = ((count // GPUS_PER_NODE, GPUS_PER_NODE) if count > GPUS_PER_NODE
                           and count % GPUS_PER_NODE == 0 else (1, count))
        desc = topologies.get_topology_desc(platform="cuda", target_config=GPU_TARGETS[kind],
                                            topology=f"1x{hosts}x{per_host}")
    except (RuntimeError, NotImplementedError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise OlmaxError(f"--topology {kind}:{count}: the CUDA plugin cannot compile without a GPU "
                         f"here ({msg})") from None
    return list(desc.devices)


_TPU_SHAPE = re.compile(r"[1-9]\d*(x[1-9]\d*){1,2}")
_TOPOLOGY_EXAMPLES = ("examples: v5e:2x2, v5p:2x2x1, v5p:4x4x4 or v5p-128, v6e:4x4, tpu7x:2x2x1, "
                      "tpu7x:4x4x4 or tpu7x-128 (GPUs: h100:8, h200:8, h100:64x8 for 64 nodes)")


def libtpu_topology(name: str) -> str:
    """The libtpu name of a TPU ``--topology``: an accelerator type (``v5p-128``, as ``olmax
    launch`` takes it) becomes its generation and shape (``v5p:4x4x4``); other names are kept."""
    from olmax.topology import parse_tpu

    return parse_tpu(name).libtpu_name if ":" not in name else name


def check_topology_name(name: str) -> None:
    """Refuse a ``--topology`` that names no TPU topology or GPU target, by its spelling alone,
    before any plugin is looked for (so a typo is not answered with "install libtpu")."""
    from olmax.topology import is_tpu_name

    if parse_gpu(name) is not None:
        return
    if ":" not in name and is_tpu_name(name):
        try:
            libtpu_topology(name)
        except ConfigError as e:
            raise OlmaxError(str(e)) from None
        return
    gen, colon, shape = name.partition(":")
    if gen.lower() not in TPU_GENERATIONS:
        why = f"no TPU generation '{gen}'; known: {', '.join(TPU_GENERATIONS)}"
    elif not colon or not _TPU_SHAPE.fullmatch(shape):
        why = f"the shape '{shape}' is not AxB or AxBxC in positive whole numbers"
    else:   # spelt right: a slice Cloud TPU offers (its dimensions, its sides)?
        from olmax.topology import parse_tpu

        try:
            parse_tpu(name)
        except ConfigError as e:
            raise OlmaxError(str(e)) from None
        return
    raise OlmaxError(f"unknown TPU topology '{name}' ({why}); {_TOPOLOGY_EXAMPLES}")


def tell_libtpu_no_tpu() -> None:
    """On a host without TPUs, tell libtpu so before it loads, whatever the plan's target (JAX
    initialises every installed backend, libtpu's too, for a CPU or GPU plan): no metadata-server
    lookups, no warnings about accelerator type or worker hostnames, several compiling processes
    allowed. Variables already set are kept."""
    if _no_tpu_attached():
        for key, value in {"TPU_SKIP_MDS_QUERY": "1", "TPU_WORKER_HOSTNAMES": "localhost",
                           "TPU_ACCELERATOR_TYPE": "v5litepod-4",  # any valid type: only silences a warning
                           "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}.items():
            os.environ.setdefault(key, value)


# The side of a whole pod of the 2-D TPU generations: 256 chips as a 16x16 2-D torus (Cloud TPU
# docs, "TPU v5e" and "TPU v6e": "TPU Pod size 256 chips", "Interconnect topology 2D torus").
POD_SIDE_2D = {"v5e": 16, "v6e": 16}


def _slice_sides(libtpu_name: str) -> list[int]:
    """The chips per axis of a TPU slice (libtpu's name, ``v6e:8x16``: [8, 16]); [] for a name
    that is no slice shape."""
    shape = libtpu_name.partition(":")[2]
    return [int(x) for x in shape.split("x")] if _TPU_SHAPE.fullmatch(shape) else []


def slice_wrap(libtpu_name: str) -> tuple[bool, ...]:
    """Per axis of a TPU slice (libtpu's name, ``v6e:8x16``), whether it wraps around (a ring):

    - **2-D slices** (v5e, v6e): an axis wraps where it spans the whole pod (16 chips): ``8x16``
      (False, True), ``16x16`` (True, True), smaller ones none. The third entry (no z axis) is
      False, as libtpu's ``wrap`` option takes it.
    - **3-D slices** (v4, v5p, tpu7x): every axis wraps where every side is a multiple of 4 chips
      (whole cubes: 4x4x4, 4x8x8, 8x8x8, ...); none otherwise (2x2x2, 2x4x4).

    As the table of slices of MaxText 0.2.5 (``accelerator_to_spec_map.py``: ``v6e-128`` = 8x16
    wraps (F, T, F), ``v5e-256`` and ``v6e-256`` (T, T, F), all 207 3-D slices as above) and the
    JAX scaling book ("TPU v5e only has a wraparound connection when one axis has size 16").
    ``()`` for a name that is no slice shape."""
    gen, _, _ = libtpu_name.partition(":")
    sides = _slice_sides(libtpu_name)
    if len(sides) == 3:
        return (all(x % 4 == 0 for x in sides),) * 3
    if len(sides) == 2:
        pod = POD_SIDE_2D.get(gen.lower())
        return (sides[0] == pod, sides[1] == pod, False)
    return ()


def torus_links(libtpu_name: str) -> dict:
    """The wraparound links of a TPU slice (:func:`slice_wrap`), as libtpu's ``wrap`` option; {}
    where none wraps (libtpu's default). The compiler plans collectives on the links it is told
    of: without the wraparound, the TPU compiler's all-gather decomposer rewrites an all-gather
    over a whole slice of 64 devices or more as a full-size all-reduce (on 4x8x8, FSDP over the
    512 devices gathered no weight:
    benchmarks/notes/2026-12-01-512-devices-the-collectives-of-the-step-on.md), which a torus does not need."""
    wrap = slice_wrap(libtpu_name)
    return {"wrap": wrap} if any(wrap) else {}


def host_bounds(libtpu_name: str) -> dict:
    """libtpu's ``chips_per_host_bounds`` for a slice smaller than one host (fewer than 4 chips:
    ``v5e:1x1``, ``v5p:2x1x1``): the slice's own shape. On a TPU host libtpu takes the host's bounds
    from its environment (a v5e host: ``TPU_CHIPS_PER_HOST_BOUNDS=2,2,1``) and refuses a smaller
    slice ("not divisible by ... chips_per_host_bounds 2x2x1"; on a v5e chip, libtpu 0.0.42.1);
    larger slices are whole hosts and keep libtpu's default. {} otherwise."""
    sides = _slice_sides(libtpu_name)
    return {"chips_per_host_bounds": tuple((sides + [1])[:3])} if sides and math.prod(sides) < 4 else {}


def topology_devices(name: str) -> list:
    """The devices of a TPU topology such as ``v5p:4x4x4`` or ``tpu7x:2x2x2`` or a GPU target
    such as ``h100:8`` (compilation only; :func:`check_topology_name` first)."""
    check_topology_name(name)
    tell_libtpu_no_tpu()
    gpu = parse_gpu(name)
    if gpu is not None:
        return gpu_topology_devices(*gpu)
    try:
        from jax.experimental import topologies
    except ImportError as e:  # pragma: no cover - every supported jax has it
        raise OlmaxError(f"this jax has no ahead-of-time topology support ({e})") from None
    libtpu_name = libtpu_topology(name)
    try:
        with filtered_stderr():
            desc = topologies.get_topology_desc(platform="tpu", topology_name=libtpu_name,
                                                **torus_links(libtpu_name), **host_bounds(libtpu_name))
    except RuntimeError as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        if "lockfile" in msg:
            # libtpu lets one process at a time load it on a host with TPUs (its lock file); the
            # lock belongs to the process that holds the chip, which removing it would not stop
            raise OlmaxError(f"--topology {name}: the TPU of this host is held by another process "
                             "(libtpu loads in one process at a time); plan when it has ended, or on "
                             "a host without TPUs") from None
        if "not installed" in msg or "libtpu" in msg.lower() and "lockfile" not in msg:
            raise OlmaxError(f"--topology {name}: compiling for TPUs needs libtpu: install the tpu "
                             f"extra on Python >= 3.12 (PYTHON=python3.12 scripts/bootstrap tpu)") from None
        if "INVALID_ARGUMENT" in msg or "Invalid" in msg or "not divisible" in msg:
            detail = msg.split("INVALID_ARGUMENT:")[-1].strip()
            raise OlmaxError(f"unknown TPU topology '{name}' ({detail}); {_TOPOLOGY_EXAMPLES}") from None
        raise OlmaxError(f"--topology {name}: {msg}") from None
    return list(desc.devices)


def chips(devices: list) -> int:
    coords = {tuple(c) for d in devices if (c := getattr(d, "coords", None)) is not None}
    return len(coords) or len(devices)
