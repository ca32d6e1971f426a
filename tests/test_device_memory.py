"""Out-of-memory errors of XLA and the device runtimes, read in each platform's words, at compile
time and at run time, become one configuration-error line (exit status 2): the program does not fit,
and no restart can help. The messages are the runtimes' own formats; the figures are computed by
hand from them."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from olmax.device_memory import (DoesNotFit, as_does_not_fit, compiler_remat_ops, parse_oom,
                                 raising_does_not_fit)
from olmax.reporting import describe_error, exit_code

G, M = 2 ** 30, 2 ** 20

# (message, when, needed bytes, available bytes, memory space)
FORMATS = [
    # TPU compiler: the step's temporaries against HBM (what a v5e chip printed)
    ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
     "(59.00G) exceeds available HBM (15.75G).", "compile", int(59.0 * G), int(15.75 * G), "hbm"),
    ("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
     "Used 20.53G of 15.48G hbm. Exceeded hbm capacity by 5.05G.", "compile", int(20.53 * G),
     int(15.48 * G), "hbm"),
    # a kernel's blocks larger than the core's vector memory
    ("RESOURCE_EXHAUSTED: Ran out of memory in memory space vmem. Used 40.00M of 16.00M vmem.",
     "compile", 40 * M, 16 * M, "vmem"),
    # a kernel's blocks over the core's scoped VMEM (libtpu, splash at blocks of 2,048, heads of 64)
    ("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom:\nRan out of memory in memory space vmem "
     "while allocating on stack for %splash_mha_dkv_no_residuals.16 = (bf16[8,4096,64]{2,1,0:T(8,128)"
     "(2,1)S(1)}, bf16[8,4096,64]{2,1,0:T(8,128)(2,1)S(1)}) custom-call(%get-tuple-element.12230."
     "data_next_ref), custom_call_target=\"tpu_custom_call\". Scoped allocation with size 19.89M and "
     "limit 16.00M exceeded scoped vmem limit by 3.89M. It should not be possible to run out of "
     "scoped vmem - ", "compile", int(19.89 * M), 16 * M, "vmem"),
    # TPU runtime: one allocation
    ("RESOURCE_EXHAUSTED: Error allocating device buffer: Attempting to allocate 8.00G. That was "
     "not possible. There are 3.12G free.; (0x0x0_HBM0)", "run", 8 * G, int(3.12 * G), "hbm"),
    ("RESOURCE_EXHAUSTED: Attempting to reserve 12.83G at the bottom of memory. That was not "
     "possible. There are 9.19G free, 0B reserved, and 9.19G reservable.", "run", int(12.83 * G),
     int(9.19 * G), "hbm"),
    # GPU: XLA's and the BFC allocator's words
    ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 34359738368 bytes.", "run",
     34359738368, None, "hbm"),
    ("RESOURCE_EXHAUSTED: Failed to allocate request for 32.00GiB (34359738368B) on device "
     "ordinal 0", "run", 32 * G, None, "hbm"),
    # CPU
    ("RESOURCE_EXHAUSTED: Out of memory allocating 17592186044416 bytes.", "run", 2 ** 44, None, "hbm"),
]


@pytest.mark.parametrize("message, when, needed, available, space", FORMATS)
def test_every_platforms_words(message, when, needed, available, space):
    oom = parse_oom(message)
    assert (oom.when, oom.needed, oom.available, oom.space) == (when, needed, available, space)
    err = as_does_not_fit(RuntimeError(message), "the step (1 x TPU v5 lite)",
                          ["train.micro_batch_size (now 4)"])
    assert isinstance(err, DoesNotFit) and err.exit_code == 2
    line = str(err)
    assert "\n" not in line and line.startswith("does not fit: the step (1 x TPU v5 lite)")
    if space == "vmem":     # the kernel's blocks are the setting to change, not the batch
        assert "train.splash_block" in line and "micro_batch_size" not in line
    else:
        assert line.endswith("to lower it: train.micro_batch_size (now 4)")


def test_other_errors_are_not_out_of_memory():
    for text in ("INVALID_ARGUMENT: shapes do not match", "RESOURCE_EXHAUSTED: too many open files",
                 "Out of memory"):    # no runtime status: not XLA's
        assert as_does_not_fit(RuntimeError(text), "x") is None
    assert as_does_not_fit(MemoryError(), "x") is None          # the host's memory: no figures


def test_a_real_allocation_failure_is_exit_2_and_one_line():
    """The CPU runtime refusing an allocation (16 TiB: malloc fails at once, nothing is touched)
    reaches the command line as a configuration error, not 'a bug in olmax' with exit 75."""
    with pytest.raises(Exception) as info:
        jnp.zeros((2 ** 42,), jnp.float32).block_until_ready()
    assert exit_code(info.value) == 2
    line = describe_error(info.value)
    assert line == "does not fit: the program could not allocate 16384.00 GiB of device memory while running"
    with pytest.raises(DoesNotFit, match=r"^does not fit: the forward pass could not allocate "
                                         r"16384.00 GiB .*; to lower it: --batch \(now 8\)$"):
        with raising_does_not_fit("the forward pass", ["--batch (now 8)"]):
            jnp.zeros((2 ** 42,), jnp.float32).block_until_ready()


def test_a_kernels_scoped_vmem_names_the_kernel_and_never_claims_zero_bytes():
    """libtpu's scoped-VMEM refusal names the kernel whose blocks overflow the core's memory; a
    refusal that gives no figure says so instead of claiming 0 bytes."""
    message = FORMATS[3][0]
    assert parse_oom(message).kernel == "splash_mha_dkv_no_residuals"
    line = str(as_does_not_fit(RuntimeError(message), "the step (1 x TPU v5 lite)",
                               ["train.micro_batch_size (now 4)"]))
    assert line == ("does not fit: the step (1 x TPU v5 lite): its kernel splash_mha_dkv_no_residuals "
                    "needs 19.9 MiB of on-chip vector memory (VMEM) per device, 16.0 MiB available; "
                    "to lower it: train.splash_block (a smaller block); or raise it to at least 20 MiB: "
                    "train.compiler_options=[xla_tpu_scoped_vmem_limit_kib=20480]")
    bare = "RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: out of scoped vmem"
    assert (parse_oom(bare).space, parse_oom(bare).needed) == ("vmem", 0)
    line = str(as_does_not_fit(RuntimeError(bare), "the step"))
    assert "0.0 MiB" not in line and "the compiler gave no figure" in line


class _Text:
    def __init__(self, text):
        self.text = text

    def as_text(self):
        return self.text


def test_the_compilers_own_recomputation_is_counted_by_instruction():
    """XLA's rematerialization pass names each clone after the instruction it recomputes
    (``NAME.remat``, then ``NAME.remat2`` ...): distinct clones are counted, their uses are not."""
    text = """HloModule jit_step, is_scheduled=true
ENTRY %main {
  %fusion.12.remat = bf16[1,4096,4096]{2,1,0:T(8,128)(2,1)} fusion(bf16[4096,1024] %p0), kind=kLoop
  %convolution_add_fusion.3.remat2 = f32[4096,1024]{1,0:T(8,128)} fusion(%fusion.12.remat), kind=kOutput
  %add.7 = f32[4096,1024]{1,0} add(%convolution_add_fusion.3.remat2, %fusion.12.remat)
  ROOT %tuple.1.remat = (f32[4096,1024]{1,0}) tuple(%add.7)
  %not_a_clone_remat.5 = f32[] constant(0)
}"""
    assert compiler_remat_ops(_Text(text)) == 3
    assert compiler_remat_ops(_Text("HloModule m\nENTRY %e { ROOT %a = f32[] constant(1) }")) == 0

    class NoText:
        def as_text(self):
            raise RuntimeError("no text")
    assert compiler_remat_ops(NoText()) is None
