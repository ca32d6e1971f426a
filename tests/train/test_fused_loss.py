"""The fused chunked LM-head loss (``lm_loss``) and the CPU dense layer's backward pass against
plain autodiff of the unfused computations (full logits, ``jnp.einsum``)."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from olmax.config import TrainConfig
from olmax.model.kernels import KERNELS
from olmax.model.runtime import Runtime
from olmax.platforms import PROFILES
from olmax.train.loss import IGNORE_INDEX, lm_loss, lm_loss_sums
from olmax.train.step import loss_chunk

contract_rows, dense = KERNELS["cpu"].contract_rows, KERNELS["cpu"].dense

ZM = 1e-4      # z-loss multiplier large enough that its gradient term is visible in fp32


def _inputs(dtype=jnp.float32, b=2, t=24, d=32, v=128):
    k = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k[0], (b, t, d), jnp.float32).astype(dtype)
    w = 0.3 * jax.random.normal(k[1], (d, v), jnp.float32)
    labels = jax.random.randint(k[2], (b, t), 0, v)
    labels = labels.at[0, :3].set(IGNORE_INDEX).at[1, -1].set(IGNORE_INDEX).at[1, 0].set(v - 1)
    return h, w, labels


def _reference(h, w, labels):
    """``sum(lse - target) + ZM sum(lse^2)`` over scored positions from the full fp32 logits."""
    logits = jnp.einsum("btd,dv->btv", h.astype(jnp.float32), w.astype(jnp.float32))
    scored = labels != IGNORE_INDEX
    lse = jax.nn.logsumexp(logits, axis=-1)
    target = jnp.take_along_axis(logits, jnp.where(scored, labels, 0)[..., None], axis=-1)[..., 0]
    return jnp.sum(jnp.where(scored, lse - target, 0.0)) + ZM * jnp.sum(jnp.where(scored, lse ** 2, 0.0))


@pytest.mark.parametrize("kernels", sorted(KERNELS))
@pytest.mark.parametrize("chunk", [24, 8, 5])
def test_fused_loss_value_and_gradients_equal_autodiff_of_full_logits(chunk, kernels):
    h, w, labels = _inputs()
    fused = lambda h, w: lm_loss(h, w, labels, z_loss_multiplier=ZM, chunk_size=chunk,  # noqa: E731
                                 kernels=KERNELS[kernels])[0]
    (val, (dh, dw)) = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(h, w)
    (ref, (dh_r, dw_r)) = jax.jit(jax.value_and_grad(_reference, argnums=(0, 1)))(h, w, labels)
    assert float(val) == pytest.approx(float(ref), rel=1e-6)
    np.testing.assert_allclose(np.asarray(dh), np.asarray(dh_r), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(dw), np.asarray(dw_r), rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(dh[0, :3]).max()) == 0.0          # unscored rows get no gradient
    # the sums are the same statistics as before fusing
    sums = lm_loss_sums(h, w, labels, z_loss_multiplier=ZM, chunk_size=chunk)
    assert float(sums.ce + sums.z) == pytest.approx(float(ref), rel=1e-6)


def test_fused_loss_scales_its_gradients_by_the_incoming_cotangent():
    h, w, labels = _inputs()
    f = lambda s: lambda h, w: s * lm_loss(h, w, labels, z_loss_multiplier=ZM, chunk_size=8)[0]  # noqa: E731
    g1 = jax.grad(f(1.0), argnums=(0, 1))(h, w)
    g3 = jax.grad(f(-3.0), argnums=(0, 1))(h, w)
    for a, b in zip(g1, g3):
        np.testing.assert_allclose(np.asarray(b), -3.0 * np.asarray(a), rtol=1e-6)


def test_bf16_fused_loss_gradients_within_bf16_rounding_of_fp32():
    h, w, labels = _inputs(jnp.bfloat16)
    fused = lambda h, w: lm_loss(h, w, labels, z_loss_multiplier=ZM, chunk_size=8)[0]  # noqa: E731
    dh, dw = jax.grad(fused, argnums=(0, 1))(h, w)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32      # head gradient kept fp32
    dh_r, dw_r = jax.grad(_reference, argnums=(0, 1))(h.astype(jnp.float32), w, labels)
    for a, r in ((dh, dh_r), (dw, dw_r)):
        err = float(jnp.linalg.norm(a.astype(jnp.float32) - r) / jnp.linalg.norm(r))
        assert 0 < err < 2e-2, err       # bf16 GEMM inputs (8 mantissa bits): ~1e-2 at most


def test_differentiating_the_sums_is_refused():
    h, w, labels = _inputs()
    with pytest.raises(ValueError, match="statistics without a gradient"):
        jax.grad(lambda h: lm_loss_sums(h, w, labels, z_loss_multiplier=ZM, chunk_size=8).ce)(h)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_cpu_dense_backward_equals_einsum_autodiff(dtype):
    k = jax.random.split(jax.random.key(1), 3)
    x = jax.random.normal(k[0], (3, 16, 24), jnp.float32).astype(dtype)
    w = jax.random.normal(k[1], (24, 40), jnp.float32).astype(dtype)
    g = jax.random.normal(k[2], (3, 16, 40), jnp.float32).astype(dtype)

    def plain(x, w):
        return jnp.einsum("...i,io->...o", x, w, preferred_element_type=jnp.float32).astype(x.dtype)

    out, vjp = jax.vjp(dense, x, w)
    out_r, vjp_r = jax.vjp(plain, x, w)
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), np.asarray(out_r.astype(jnp.float32)))
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    for a, r in zip(vjp(g), vjp_r(g)):
        assert a.dtype == r.dtype == dtype
        np.testing.assert_allclose(np.asarray(a.astype(jnp.float32)), np.asarray(r.astype(jnp.float32)),
                                   rtol=tol, atol=tol)
    # the weight gradient is the row contraction, computed in fp32
    ref = np.einsum("bti,bto->io", np.asarray(x, np.float64), np.asarray(g, np.float64))
    np.testing.assert_allclose(np.asarray(contract_rows(x, g)), ref, rtol=1e-5 if dtype == jnp.float32 else 1e-2,
                               atol=1e-4)


def test_loss_chunk_length_holds_the_rows_per_device():
    cpu, tpu, gpu = PROFILES["cpu"], PROFILES["tpu"], PROFILES["gpu"]
    assert cpu.loss_chunk_rows == 256
    # one device: 256 rows over the sequences of a micro-batch; at least one position
    assert cpu.loss_chunk(8, 1) == 32 and cpu.loss_chunk(1, 1) == 256 and cpu.loss_chunk(1024, 1) == 1
    assert cpu.loss_chunk(3, 8) == 10            # 8 devices of one host: 32 rows each, 3 sequences
    assert gpu.loss_chunk(1, 4) == gpu.loss_chunk(8, 1) == 1024   # positions, whatever the rows
    # 4096 rows on each device, whatever the host's devices
    assert tpu.loss_chunk(8, 1) == tpu.loss_chunk(8, 4) == 512 and tpu.loss_chunk(1, 4) == 4096
    assert tpu.loss_chunk(3, 8) == 1365 and tpu.loss_chunk(8192, 1) == 1
    # no mesh, one device: 8 rows per micro-batch of 8 -> 32 positions; 2 micro-batches of 4 -> 64
    train = TrainConfig(seq_len=512, global_batch_size=8)
    assert loss_chunk(train, 1, None, Runtime(profile=cpu)) == 32
    assert loss_chunk(train, 2, None, Runtime(profile=cpu)) == 64
    assert loss_chunk(train, 2, None, Runtime(profile=tpu)) == 1024     # 4 rows a micro-batch
    assert loss_chunk(train, 1, None, Runtime(profile=tpu)) == 512      # 8
    assert loss_chunk(train, 2, None, Runtime(profile=PROFILES["gpu"])) == 1024


def test_loss_chunk_rows_overrides_the_profile_and_keeps_the_loss():
    """``train.loss_chunk_rows``: rows of logits per chunk on a device, whatever the profile (8192
    rows: 2048 positions for 4 sequences, 8192 for 1); the loss and its gradients over 4, 2 and 1
    chunks of a 4 x 64 batch are equal up to the order of fp32 sums (1e-6 of the largest)."""
    tpu = PROFILES["tpu"]
    train = TrainConfig(seq_len=8192, global_batch_size=16, loss_chunk_rows=8192)
    assert loss_chunk(train, 4, None, Runtime(profile=tpu)) == 2048
    assert loss_chunk(train, 16, None, Runtime(profile=tpu)) == 8192
    assert loss_chunk(TrainConfig(seq_len=8192, global_batch_size=16), 16, None, Runtime(profile=tpu)) == 4096
    from olmax.model.olmo3 import seq_chunks

    h = jax.random.normal(jax.random.key(0), (4, 64, 16), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (16, 40), jnp.float32) * 0.3
    labels = jax.random.randint(jax.random.key(2), (4, 64), 0, 40)
    kernels = KERNELS["reference"]
    got = {}
    for rows in (64, 128, 256):
        chunk = loss_chunk(TrainConfig(seq_len=64, global_batch_size=4, loss_chunk_rows=rows), 1, None,
                           Runtime(profile=tpu))
        assert seq_chunks(h, chunk).shape[0] == 256 // rows
        got[rows] = jax.value_and_grad(
            lambda h, w, c=chunk: lm_loss(h, w, labels, z_loss_multiplier=1e-4, chunk_size=c,
                                          kernels=kernels)[0], argnums=(0, 1))(h, w)
    for rows in (64, 128):
        for a, b in zip(jax.tree.leaves(got[rows]), jax.tree.leaves(got[256])):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            assert np.max(np.abs(a - b)) <= 1e-6 * np.max(np.abs(b)), (rows, np.max(np.abs(a - b)))
