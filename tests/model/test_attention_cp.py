"""The zig-zag layout of context-parallel attention (:mod:`olmax.model.attention_cp`) and the FLOPs
of the split splash calls; the losses and the compiled program on 8 devices are tested in
``tests/parallel/test_context_parallel.py``."""

import jax.numpy as jnp

from olmax.model.attention_cp import (device_positions, from_zigzag, halo_query_coords, to_zigzag,
                                      uses_halo, zigzag_order)
from olmax.model.splash import kernel_flops, parse_scope, split_visited_blocks, visited_blocks


def test_zigzag_layout_gives_device_d_chunks_d_and_its_mirror():
    order = zigzag_order(16, 4)                        # 8 chunks of 2, devices of 4 positions
    assert order.reshape(4, 4).tolist() == [[0, 1, 14, 15], [2, 3, 12, 13], [4, 5, 10, 11],
                                            [6, 7, 8, 9]]
    for d in range(4):
        assert device_positions(16, 4, d).tolist() == order.reshape(4, 4)[d].tolist()
    x = jnp.arange(2 * 16).reshape(2, 16)
    assert (to_zigzag(x, 4)[:, :4] == x[:, [0, 1, 14, 15]]).all()
    assert (from_zigzag(to_zigzag(x, 4), 4) == x).all()
    assert (to_zigzag(x, 1) == x).all()


def test_halo_layout_and_when_it_is_used():
    # keys [halo_A (W), A (C), halo_B (W), B (C)]: query r of A at W + r, of B at 2W + C + r
    assert halo_query_coords(4, 2).tolist() == [2, 3, 4, 5, 8, 9, 10, 11]
    assert uses_halo(8, 8) and not uses_halo(9, 8) and not uses_halo(None, 8)


def test_causal_work_is_balanced_over_the_devices():
    """Each device's two chunks see 2N + 1 chunks of keys: with blocks of a chunk, every device
    visits the same number of (query block, key block) pairs, 2N + 1 (a contiguous block d of two
    chunks would visit 4d + 3: from 3 to 4N - 1)."""
    t, n, c = 8 * 1024, 8, 512
    per_device = []
    for d in range(n):
        q = device_positions(t, n, d)
        blocks = {(qi // c, kj) for qi in q for kj in range(0, qi + 1, c)}
        per_device.append(len(blocks))
    assert per_device == [2 * n + 1] * n
    assert split_visited_blocks(t, None, n, False, 512) == 2 * n + 1
    # halo: 2 query blocks of 512 against the 2 (C + W) = 1536 keys [halo, A, halo, B] in blocks
    # of 512; each query chunk's rows visit the 2 blocks holding its halo and itself
    assert split_visited_blocks(t, 256, n, True, 512) == 4


def test_split_kernel_flops_and_scope():
    name = "jit(step)/olmax_splash_t16_w12_h4_d8_b4_bs128_kv128_bk128_cp8gather/splash_mha_fwd"
    shape = parse_scope(name)
    assert shape == {"t": 16, "window": 12, "heads": 4, "head_dim": 8, "batch": 4, "block": 128,
                     "kv_len": 128, "kv_block": 128, "context": 8, "halo": False}
    extra = {k: shape[k] for k in ("kv_len", "kv_block", "context", "halo")}
    f = kernel_flops(shape["t"], shape["window"], shape["heads"], shape["head_dim"], shape["batch"],
                     "fwd", shape["block"], **extra)
    assert f == 2 * 2 * 128 * 128 * 8 * 1 * 4 * 4          # one (128 x 128) block pair per head
    # 64k tokens on 8 devices: each device's causal work is 1/8 of the whole sequence's, up to the
    # diagonal blocks (17 of 2 x 8 x 128 block pairs, vs 128 x 129 / 2 for the whole)
    whole = kernel_flops(65536, None, 32, 128, 1, "fwd", 512)
    split = kernel_flops(8192, None, 32, 128, 1, "fwd", 512, kv_len=65536, context=8)
    assert split == 2 * 2 * 512 * 512 * 128 * 32 * split_visited_blocks(65536, None, 8, False, 512)
    assert whole / 8 <= split <= whole / 8 * 1.07
    assert visited_blocks(65536, None, 512) == 128 * 129 // 2
    # the non-split scope keeps its keys
    assert set(parse_scope("olmax_splash_t37_wfull_h4_d16_b2_bs128")) == {
        "t", "window", "heads", "head_dim", "batch", "block"}
