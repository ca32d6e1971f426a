"""Device memory: what a compiled program needs, what a device has, and out-of-memory errors read.

A program that needs more device memory than there is cannot run however often it is started: it
is a configuration error (exit status 2), reported in one line saying what needs how much of how
much and which settings lower it (:class:`DoesNotFit`). XLA and the runtimes say so in their own
words, at compile time and at run time, on each platform; :func:`parse_oom` reads all of them:

- TPU, compile time: ``Ran out of memory on HBM, the total memory required for HLO temporaries
  (59.00G) exceeds available HBM (15.75G)``; ``Ran out of memory in memory space hbm. Used 20.53G
  of 15.48G hbm. Exceeded hbm capacity by 5.05G.`` (``vmem`` for a kernel's on-chip memory);
- TPU, compile time, a kernel's scoped on-chip memory: ``CompileTimeScopedVmemOom: Ran out of
  memory in memory space vmem while allocating on stack for %splash_mha_dkv_no_residuals.16 = ...
  Scoped allocation with size 19.89M and limit 16.00M exceeded scoped vmem limit by 3.89M``;
- TPU, run time: ``Error allocating device buffer: Attempting to allocate 8.00G. That was not
  possible. There are 3.12G free.``; ``Attempting to reserve 12.83G at the bottom of memory. That
  was not possible. There are 9.19G free, 0B reserved, and 9.19G reservable.``;
- GPU: ``Out of memory while trying to allocate 34359738368 bytes.``; the BFC allocator's
  ``Failed to allocate request for 32.00GiB (34359738368B) on device ordinal 0``;
- CPU: ``Out of memory allocating 17592186044416 bytes.``

each after the status ``RESOURCE_EXHAUSTED``. :func:`compiled_peak` is a compiled program's peak
per device from XLA's own memory analysis, and :func:`device_limit` the memory a device gives a
program (the runtime's own limit where it reports one, else the hardware table's HBM, on GPUs the
share JAX's allocator takes; the host's memory shared by its devices on the CPU).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from olmax import hardware
from olmax.errors import OlmaxError

GiB = hardware.GiB
_UNITS = {"": 1, "b": 1, "k": 2 ** 10, "m": 2 ** 20, "g": 2 ** 30, "t": 2 ** 40}
_SIZE = r"([\d.]+)\s*([KMGT]?)(?:i?B)?"


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit.lower()])


# (pattern, what the first and second number are): "need"/"have" of a whole program at compile
# time, or "alloc"/"free" of one allocation at run time
_PATTERNS = (
    (re.compile(r"\(" + _SIZE + r"\)\s*exceeds available (HBM|VMEM) \(" + _SIZE + r"\)", re.I),
     "compile"),
    (re.compile(r"Used " + _SIZE + r" of " + _SIZE + r" (hbm|vmem|smem)", re.I), "compile"),
    (re.compile(r"Attempting to (?:allocate|reserve) " + _SIZE + r".*?There (?:are|is) " + _SIZE
                + r" free", re.I | re.S), "run"),
    (re.compile(r"Failed to allocate request for " + _SIZE, re.I), "run"),
    (re.compile(r"Out of memory (?:while trying to allocate|allocating) (\d+)() bytes", re.I), "run"),
)


# libtpu's refusal of a kernel over the core's scoped VMEM: the allocation and the limit, and the
# kernel (the custom call's name less its ".N")
_SCOPED_VMEM = re.compile(r"Scoped allocation with size " + _SIZE + r" and limit " + _SIZE, re.I)
_SCOPED_KERNEL = re.compile(r"allocating on stack for %([A-Za-z_]\w*?)(?:\.\d+)?\s*=")


@dataclass(frozen=True)
class OutOfMemory:
    """What an out-of-memory error says: at ``when`` ("compile" or "run"), ``needed`` bytes
    (a program's whole need at compile time; one allocation at run time) against ``available``
    (None where the message gives no figure), in the memory ``space`` (``hbm``; ``vmem``: a
    kernel's on-chip memory)."""

    when: str
    needed: int
    available: int | None
    space: str = "hbm"
    kernel: str | None = None     # the kernel whose scoped VMEM ran out, where the message names it


def parse_oom(message: str) -> OutOfMemory | None:
    """The out-of-memory error ``message`` reports (see the module docstring), else None."""
    text = str(message)
    if re.search(r"ScopedVmemOom|Scoped allocation with size", text, re.I):
        # a kernel's blocks overflow the core's scoped VMEM (0: the message gives no figure)
        kernel = _SCOPED_KERNEL.search(text)
        m = _SCOPED_VMEM.search(text)
        return OutOfMemory("compile", _bytes(*m.groups()[:2]) if m else 0,
                           _bytes(*m.groups()[2:]) if m else None, "vmem",
                           kernel.group(1) if kernel else None)
    for pattern, when in _PATTERNS:
        m = pattern.search(text)
        if not m:
            continue
        g = m.groups()
        if pattern is _PATTERNS[0][0]:
            return OutOfMemory(when, _bytes(g[0], g[1]), _bytes(g[3], g[4]), g[2].lower())
        if pattern is _PATTERNS[1][0]:
            return OutOfMemory(when, _bytes(g[0], g[1]), _bytes(g[2], g[3]), g[4].lower())
        if len(g) >= 4:
            return OutOfMemory(when, _bytes(g[0], g[1]), _bytes(g[2], g[3]))
        return OutOfMemory(when, _bytes(g[0], g[1]), None)
    if "RESOURCE_EXHAUSTED" in text and re.search(r"out of memory|ran out of memory", text, re.I):
        return OutOfMemory("run", 0, None)
    return None


def oom_of(exc: BaseException) -> OutOfMemory | None:
    """The out-of-memory error ``exc`` is (XLA's and the runtimes' errors, of any Python type and
    under any status: ``JaxRuntimeError``, ``XlaRuntimeError``, a ``RuntimeError`` with their text;
    the CPU runtime reports a failed allocation while dispatching as ``INTERNAL``), else None.
    A Python ``MemoryError`` (the host's memory) is not one: it has no device figures."""
    if isinstance(exc, (OlmaxError, MemoryError, OSError)):
        return None
    return parse_oom(str(exc))


def gib(n: int | float | None) -> str:
    """Bytes for a person: GiB to two places, below 1 GiB in MiB."""
    if n is None:
        return "n/a"
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2 ** 20:.1f} MiB"


# The TPU compiler's limit on a kernel's on-chip vector memory (a compile option, per program).
VMEM_OPTION = "xla_tpu_scoped_vmem_limit_kib"


class DoesNotFit(OlmaxError):
    """A program needs more device memory than there is: a configuration error (exit status 2).
    ``needed``/``available``: bytes per device (``available`` None where unknown); ``where``: what
    was compiled or run; ``hints``: the settings that lower its memory, each ``key (now VALUE)``."""

    def __init__(self, needed: int, available: int | None, where: str,
                 hints: Iterable[str] = (), *, when: str = "compile", space: str = "hbm",
                 source: str | None = None, kernel: str | None = None):
        self.needed, self.available, self.where, self.when, self.space = (
            needed, available, where, when, space)
        self.kernel = kernel
        self.source = source
        self.hints = list(hints)
        super().__init__(self.describe())

    def describe(self) -> str:
        memory = "on-chip vector memory (VMEM)" if self.space == "vmem" else "device memory"
        if self.when == "run":
            what = (f"could not allocate {gib(self.needed)} of {memory} while running"
                    if self.needed else f"ran out of {memory} while running")
            free = "" if self.available is None else f" ({gib(self.available)} free)"
            text = f"does not fit: {self.where} {what}{free}"
        else:
            limit = ("no limit known" if self.available is None else
                     f"{gib(self.available)} available" + (f" ({self.source})" if self.source else ""))
            what = f"{self.where}: its kernel {self.kernel}" if self.kernel else self.where
            need = (f"needs {gib(self.needed)} of {memory} per device, {limit}" if self.needed else
                    f"needs more {memory} per device than there is ({limit}; the compiler gave no figure)")
            text = f"does not fit: {what} {need}"
        if self.hints:
            text += "; to lower it: " + ", ".join(self.hints)
        if self.space == "vmem" and self.when == "compile":   # the limit is the compiler's option
            if self.needed:    # whole MiB; the step's other kernels may need more still
                kib = -(-self.needed // 2 ** 20) * 1024
                text += (f"; or raise it to at least {kib // 1024} MiB: "
                         f"train.compiler_options=[{VMEM_OPTION}={kib}]")
            else:
                text += f"; or raise it: train.compiler_options=[{VMEM_OPTION}=KIB]"
        return text


def as_does_not_fit(exc: BaseException, where: str, hints: Iterable[str] = ()) -> DoesNotFit | None:
    """``exc`` as a :class:`DoesNotFit` for ``where`` when it is an out-of-memory error."""
    oom = oom_of(exc)
    if oom is None:
        return None
    hints = list(hints)
    if oom.space == "vmem":   # a kernel's blocks, not the batch
        hints = ["train.splash_block (a smaller block)"]
    return DoesNotFit(oom.needed, oom.available, where, hints, when=oom.when, space=oom.space,
                      kernel=oom.kernel)


class raising_does_not_fit:
    """``with raising_does_not_fit(where, hints):`` turns an out-of-memory error raised inside into
    :class:`DoesNotFit` (anything else passes through unchanged)."""

    def __init__(self, where: str, hints: Iterable[str] = ()):
        self.where, self.hints = where, list(hints)

    def __enter__(self) -> "raising_does_not_fit":
        return self

    def __exit__(self, kind, exc, tb) -> None:
        if exc is None or isinstance(exc, DoesNotFit):
            return
        err = as_does_not_fit(exc, self.where, self.hints)
        if err is not None:
            raise err from None


def compiled_peak(compiled: Any, platform: str) -> int:
    """A compiled program's peak memory per device, from XLA's memory analysis: the buffer
    assignment's peak (live buffers at the worst point) on TPU and GPU; the CPU backend reports no
    peak, so there every argument, output and temporary as if live at once (an upper bound)."""
    ma = compiled.memory_analysis()
    if isinstance(ma, (list, tuple)):
        ma = ma[0]
    arg, out, tmp = ma.argument_size_in_bytes, ma.output_size_in_bytes, ma.temp_size_in_bytes
    alias, code = ma.alias_size_in_bytes, ma.generated_code_size_in_bytes
    peak = int(getattr(ma, "peak_memory_in_bytes", 0) or 0) if platform != "cpu" else 0
    return peak or int(arg + out - alias + tmp + code)


_REMAT_CLONE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+\.remat\d*)\s*=", re.M)


def compiler_remat_ops(compiled: Any) -> int | None:
    """How many instructions of a compiled program the compiler itself recomputes: XLA's
    rematerialization pass clones an instruction (``NAME.remat``, ``NAME.remat2``, ...) to compute
    it again later when the program's buffers, as written, exceed the device's memory. Such a
    program fits by recomputing work, and runs slower than its FLOPs say (a larger micro-batch
    that the compiler squeezes in can be slower than a smaller one). None where the compiled text
    cannot be read."""
    try:
        text = compiled.as_text()
    except Exception:  # some executables have no text
        return None
    if not isinstance(text, str):
        return None
    return len(set(_REMAT_CLONE.findall(text)))


def resident_bytes(compiled: Any) -> int:
    """The bytes a compiled program's arguments and outputs hold at once (its inputs and its
    results, the donated ones counted once): a floor of its memory on any backend."""
    ma = compiled.memory_analysis()
    if isinstance(ma, (list, tuple)):
        ma = ma[0]
    return int(ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes)


# The share of a GPU's memory JAX's allocator takes (``XLA_PYTHON_CLIENT_MEM_FRACTION``; JAX's own
# default is 0.75): ``olmax launch`` exports this value in GPU jobs, and ``olmax plan`` and the
# trainer judge a GPU step against it, so that "fits" means what the job will have. The rest is left
# to the CUDA context, NCCL's buffers and cuDNN's workspaces, which live outside JAX's allocator.
MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"
MEM_FRACTION = 0.90

# HBM per device (bytes), matched as lower-case substrings of ``device_kind``, in table order.
HBM_BYTES: tuple[tuple[str, int], ...] = tuple(
    (k, a.hbm) for a in hardware.ACCELERATORS if a.hbm for k in a.kinds)


def hbm_bytes(device: Any) -> tuple[int | None, str]:
    """(bytes, source) of one device's memory: the runtime's limit where a real device reports one,
    else the hardware table, else (CPU) the host's physical memory shared by its devices."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # topology devices and some backends have none
        stats = {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), "runtime"
    kind = str(getattr(device, "device_kind", "")).lower()
    for key, value in HBM_BYTES:
        if key in kind:
            return value, "table"
    if getattr(device, "platform", "") == "cpu":
        import jax

        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return host // max(1, len(jax.local_devices(backend="cpu"))), "host memory / devices"
    return None, "unknown"


def mem_fraction(environ: Mapping[str, str] = os.environ) -> float:
    """The allocator's share of GPU memory: ``XLA_PYTHON_CLIENT_MEM_FRACTION`` when set (what the
    job will export), else :data:`MEM_FRACTION` (what ``olmax launch`` exports)."""
    raw = environ.get(MEM_FRACTION_ENV)
    if raw is None or raw == "":
        return MEM_FRACTION
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0.0 < value <= 1.0:
        raise OlmaxError(f"{MEM_FRACTION_ENV}={raw!r}: expected a fraction in (0, 1]")
    return value


def usable_hbm(backend: str, hbm: int | None, source: str,
               environ: Mapping[str, str] = os.environ) -> tuple[int | None, float, str]:
    """(bytes a step may use, the share of the device's memory that is, where it comes from). On
    GPUs JAX's allocator takes ``XLA_PYTHON_CLIENT_MEM_FRACTION`` of the memory (0.90 in the jobs
    ``olmax launch`` writes: :data:`MEM_FRACTION`); a real GPU's runtime
    limit has it applied already. Elsewhere the whole memory."""
    if backend != "gpu":
        return hbm, 1.0, source
    fraction = mem_fraction(environ)
    if hbm is None or source != "table":
        return hbm, fraction, source
    return int(hbm * fraction), fraction, f"{source} x {MEM_FRACTION_ENV} {fraction:g}"


def device_limit(device: Any, backend: str) -> tuple[int | None, str]:
    """(bytes a program may use on ``device``, where that figure comes from) for a program of
    ``backend`` (``cpu``, ``gpu``, ``tpu``): :func:`usable_hbm` of :func:`hbm_bytes`."""
    limit, _, source = usable_hbm(backend, *hbm_bytes(device))
    return limit, source


__all__ = ["DoesNotFit", "OutOfMemory", "parse_oom", "oom_of", "as_does_not_fit",
           "raising_does_not_fit", "compiled_peak", "compiler_remat_ops", "resident_bytes", "device_limit", "hbm_bytes", "usable_hbm",
           "mem_fraction", "MEM_FRACTION", "MEM_FRACTION_ENV", "HBM_BYTES", "GiB", "gib"]
