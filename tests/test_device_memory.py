"""Out-of-memory errors of XLA and the device runtimes, read in each platform's words, at compile
time and at run time, become one configuration-error line (exit status 2): the program does not fit,
and no restart can help. The messages are the runtimes' own formats; the figures are computed by
hand from them."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from olmax.device_memory import DoesNotFit, as_does_not_fit, parse_oom, raising_does_not_fit
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
