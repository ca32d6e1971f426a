"""TPU slice names, one reading for ``olmax plan`` and ``olmax launch``.

A slice can be named two ways, and both commands take both:

- an accelerator type, as Cloud TPU and GKE name it: ``v5p-128``, ``v4-32``, ``v5litepod-16``,
  ``v6e-16``, ``tpu7x-128``. The number counts TensorCores for v4, v5p and tpu7x (two per chip)
  and chips for v5e (``v5litepod``) and v6e; the slice has the standard shape of that size;
- a generation and a shape, as libtpu names a topology: ``v5p:4x4x4``, ``v5e:4x4``, ``v6e:4x4``,
  ``tpu7x:4x4x4`` (any shape the generation offers, not only the standard one; a shape that is
  no slice, such as ``v5p:3x3x3`` or ``v6e:3x3``, is refused).

``v5p-128`` and ``v5p:4x4x4`` are the same slice: 64 chips on 16 hosts of 4 chips. JAX shows one
device per chip, except on tpu7x (Ironwood), whose two TensorCores per chip are two devices.
Multi-host slices have 4 chips per host; v5e and v6e slices of up to 8 chips are one host.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from olmax import hardware
from olmax.errors import ConfigError


@dataclass(frozen=True)
class Generation:
    libtpu: str            # libtpu's name, as in v5p:4x4x4 (the hardware table's row)
    accelerator: str       # the accelerator type's prefix, as in v5p-128
    counts: str            # what the accelerator type's number counts: "cores" or "chips"
    dims: int              # 3 (a torus in 3 dimensions) or 2
    gke_label: str         # GKE node label cloud.google.com/gke-tpu-accelerator

    @property
    def devices_per_chip(self) -> int:
        """JAX devices per chip (:mod:`olmax.hardware`)."""
        return hardware.BY_NAME[self.libtpu].devices_per_chip


GENERATIONS = (
    Generation("v4", "v4", "cores", 3, "tpu-v4-podslice"),
    Generation("v5p", "v5p", "cores", 3, "tpu-v5p-slice"),
    Generation("v5e", "v5litepod", "chips", 2, "tpu-v5-lite-podslice"),
    Generation("v6e", "v6e", "chips", 2, "tpu-v6e-slice"),
    Generation("tpu7x", "tpu7x", "cores", 3, "tpu7x"),
)
_BY_NAME = {**{g.libtpu: g for g in GENERATIONS}, **{g.accelerator: g for g in GENERATIONS}}
_ACCELERATOR = re.compile(r"([a-z0-9]+)-(\d+)")
_SHAPE = re.compile(r"[1-9]\d*(x[1-9]\d*){1,2}")
EXAMPLES = "e.g. v5p-128 or v5p:4x4x4, v4-32, v5litepod-16 or v5e:4x4, v6e-16, tpu7x-128 or tpu7x:4x4x4"


@dataclass(frozen=True)
class TpuSlice:
    """One TPU slice (see the module docstring)."""

    name: str              # as given
    generation: Generation
    shape: tuple[int, ...]

    @property
    def chips(self) -> int:
        return math.prod(self.shape)

    @property
    def hosts(self) -> int:
        if self.generation.counts == "chips" and self.chips <= 8:
            return 1
        return max(1, self.chips // 4)

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts

    @property
    def devices(self) -> int:
        return self.chips * self.generation.devices_per_chip

    @property
    def devices_per_host(self) -> int:
        return self.devices // self.hosts

    @property
    def topology(self) -> str:
        """The physical shape, e.g. ``4x4x4`` (GKE's ``gke-tpu-topology`` label)."""
        return "x".join(map(str, self.shape))

    @property
    def gke_accelerator(self) -> str:
        return self.generation.gke_label

    @property
    def libtpu_name(self) -> str:
        """``v5p:4x4x4``: the name libtpu compiles for."""
        return f"{self.generation.libtpu}:{self.topology}"

    @property
    def accelerator_type(self) -> str:
        """``v5p-128``: the name Cloud TPU and GKE give the slice."""
        g = self.generation
        size = self.chips * (2 if g.counts == "cores" else 1)
        return f"{g.accelerator}-{size}"


def standard_shape(chips: int, dims: int) -> tuple[int, ...]:
    """The standard slice shape of ``chips``: from 2x2(x1), double the last of the smallest
    dimensions."""
    if chips == 1:
        return (1,) * dims
    shape = [2, 2] + [1] * (dims - 2)
    while math.prod(shape) < chips:
        smallest = min(shape)
        shape[max(i for i, s in enumerate(shape) if s == smallest)] *= 2
    return tuple(shape)


_SMALL_3D = {(1, 2, 2), (2, 2, 2), (2, 2, 4), (2, 4, 4)}


def _not_a_slice(shape: tuple[int, ...]) -> str | None:
    """Why a shape is no slice Cloud TPU offers, or None. In 3 dimensions (v4, v5p, tpu7x):
    2x2x1, 2x2x2, 2x2x4, 2x4x4, or sides that are all multiples of 4 (4x4x4, 4x4x12, ...). In 2
    (v5e, v6e): sides that are powers of two up to 16, one at most twice the other, not 1x2."""
    if len(shape) == 3:
        if tuple(sorted(shape)) in _SMALL_3D or all(s % 4 == 0 for s in shape):
            return None
        return "3-dimensional slices are 2x2x1, 2x2x2, 2x2x4, 2x4x4 or have sides that are all " \
               "multiples of 4"
    a, b = sorted(shape)
    if (a & (a - 1) == 0 and b & (b - 1) == 0 and b <= 16 and b <= 2 * a and (a, b) != (1, 2)):
        return None
    return "2-dimensional slices are 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, 8x16 or 16x16"


def is_tpu_name(name: str) -> bool:
    """Whether ``name`` is spelt as a TPU slice of a known generation (valid or not)."""
    head = name.partition(":")[0] if ":" in name else name.rpartition("-")[0]
    return head.lower() in _BY_NAME


def parse_tpu(name: str, flag: str = "--topology") -> TpuSlice:
    """A slice from either spelling (module docstring); a ConfigError naming ``flag`` otherwise."""
    def bad(why: str) -> ConfigError:
        return ConfigError(f"{flag} {name!r}: {why}; {EXAMPLES}")

    text = name.strip().lower()
    if ":" in text:
        gen_name, _, shape_text = text.partition(":")
        gen = _BY_NAME.get(gen_name)
        if gen is None or gen_name != gen.libtpu:
            raise bad(f"no TPU generation '{gen_name}' (known: "
                      f"{', '.join(g.libtpu for g in GENERATIONS)})")
        if not _SHAPE.fullmatch(shape_text):
            raise bad(f"the shape '{shape_text}' is not AxB or AxBxC in positive whole numbers")
        shape = tuple(int(x) for x in shape_text.split("x"))
        if len(shape) != gen.dims:
            raise bad(f"a {gen.libtpu} shape has {gen.dims} dimensions")
        why = _not_a_slice(shape)
        if why:
            raise bad(f"{shape_text} is no {gen.libtpu} slice ({why})")
        return TpuSlice(name, gen, shape)
    m = _ACCELERATOR.fullmatch(text)
    gen = _BY_NAME.get(m.group(1)) if m else None
    if m is None or gen is None or m.group(1) != gen.accelerator:
        raise bad("expected a TPU accelerator type such as v5p-128, or a generation and a shape "
                  "such as v5p:4x4x4")
    size = int(m.group(2))
    chips = size // 2 if gen.counts == "cores" else size
    if (chips < 1 or chips & (chips - 1) or (gen.counts == "cores" and (size % 8 or chips < 4))
            or (gen.counts == "chips" and (chips == 2 or chips > 256))):
        raise bad(f"{size} is not a slice size of {gen.accelerator} (a power of two; "
                  f"{'TensorCores, at least 8' if gen.counts == 'cores' else 'chips'})")
    return TpuSlice(name, gen, standard_shape(chips, gen.dims))


__all__ = ["TpuSlice", "Generation", "GENERATIONS", "parse_tpu", "is_tpu_name", "standard_shape"]
