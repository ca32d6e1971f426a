"""The training step's three stages, each on its own (:mod:`olmax.train.step`): the batch's rows,
the accumulation over micro-batches, the update. The step that composes them is checked against
OLMo-core by ``test_oc_parity.py``; here each stage meets hand-computed numbers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from olmax.config import OptimConfig
from olmax.train.loss import IGNORE_INDEX, LossSums
from olmax.train.optim import skip_step_adamw
from olmax.train.state import TrainState, init_train_state
from olmax.train.step import Placement, accumulate_gradients, apply_update, batch_rows

X = IGNORE_INDEX
NO_MESH = Placement(None, None)


def test_rows_labels_are_the_next_token_where_the_instance_and_its_position_are_scored():
    tokens = jnp.array([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33]])
    label_mask = jnp.array([[1, 1, 0, 1], [1, 1, 1, 1], [1, 1, 1, 1]], bool)
    rows = batch_rows({"tokens": tokens, "instance_mask": jnp.array([True, False, True]),
                       "label_mask": label_mask}, context=1)
    np.testing.assert_array_equal(rows.labels, [[11, X, 13, X], [X, X, X, X], [31, 32, 33, X]])
    # scored labels (2 + 0 + 3) plus T per masked instance (OLMo-core's denominator)
    assert float(rows.denom) == 5 + 4
    assert rows.segment_ids is None and rows.positions is None and rows.context == 1
    np.testing.assert_array_equal(rows.tokens, tokens)


def test_rows_without_an_instance_mask_score_every_row():
    rows = batch_rows({"tokens": jnp.arange(6).reshape(2, 3)}, context=1)
    np.testing.assert_array_equal(rows.labels, [[1, 2, X], [4, 5, X]])
    assert float(rows.denom) == 4


def test_rows_documents_become_segment_ids():
    rows = batch_rows({"tokens": jnp.zeros((2, 6), jnp.int32),
                       "doc_lens": jnp.array([[2, 4, 0], [6, 0, 0]])}, context=1)
    np.testing.assert_array_equal(rows.segment_ids, [[0, 0, 1, 1, 1, 1], [0] * 6])
    assert rows.positions is None    # natural order: the model derives positions from segments


def test_rows_on_context_devices_take_the_zigzag_layout_with_true_positions():
    # 8 positions on 2 devices: chunks of 2, device 0 holds chunks 0 and 3, device 1 chunks 1, 2
    tokens = jnp.arange(16).reshape(2, 8)
    rows = batch_rows({"tokens": tokens, "doc_lens": jnp.array([[3, 5], [8, 0]])}, context=2)
    order = [0, 1, 6, 7, 2, 3, 4, 5]
    assert rows.context == 2
    np.testing.assert_array_equal(rows.tokens, np.asarray(tokens)[:, order])
    natural_labels = np.array([[1, 2, 3, 4, 5, 6, 7, X], [9, 10, 11, 12, 13, 14, 15, X]])
    np.testing.assert_array_equal(rows.labels, natural_labels[:, order])
    np.testing.assert_array_equal(rows.segment_ids, np.array([[0, 0, 0, 1, 1, 1, 1, 1], [0] * 8])[:, order])
    # RoPE positions restart in each document, then move with their tokens
    np.testing.assert_array_equal(rows.positions, np.array([[0, 1, 2, 0, 1, 2, 3, 4],
                                                            list(range(8))])[:, order])
    # without documents every row shares one position vector
    np.testing.assert_array_equal(batch_rows({"tokens": tokens}, context=2).positions, order)


def test_rows_that_do_not_cut_into_two_chunks_per_device_keep_the_natural_order():
    rows = batch_rows({"tokens": jnp.arange(12).reshape(2, 6)}, context=2)   # 6 = 2 x 2 x 1.5
    assert rows.context == 1 and rows.positions is None
    np.testing.assert_array_equal(rows.tokens, np.arange(12).reshape(2, 6))


def _linear_grad_fn(params, tokens, labels, denom, **kw):
    """A loss whose gradient records which rows a micro-batch held: sum(w * tokens) / denom."""
    ce = jnp.sum(params["w"] * tokens.astype(jnp.float32) * (labels != X))
    sums = LossSums(ce, 0.5 * ce)
    return (ce / denom, sums), {"w": jnp.sum(tokens.astype(jnp.float32) * (labels != X), 0)[None] / denom}


def test_accumulation_sums_every_micro_batch_into_the_full_batch_gradient():
    tokens = jnp.arange(32, dtype=jnp.int32).reshape(8, 4)
    rows = batch_rows({"tokens": tokens}, context=1)
    params = {"w": jnp.full((1, 4), 0.5, jnp.float32)}
    whole, whole_sums = accumulate_gradients(_linear_grad_fn, params, rows, 1, NO_MESH)
    for n_micro in (2, 4, 8):
        grads, sums = accumulate_gradients(_linear_grad_fn, params, rows, n_micro, NO_MESH)
        np.testing.assert_allclose(grads["w"], whole["w"], rtol=1e-6)
        np.testing.assert_allclose([sums.ce, sums.z], [whole_sums.ce, whole_sums.z], rtol=1e-6)
    # by hand: every scored token (labels drop the last column) weighs 1/denom
    scored = np.asarray(tokens)[:, :3]
    np.testing.assert_allclose(whole["w"][0, :3], scored.sum(0) / (8 * 3), rtol=1e-6)
    assert float(whole["w"][0, 3]) == 0
    np.testing.assert_allclose(float(whole_sums.ce), 0.5 * scored.sum(), rtol=1e-6)


def test_micro_batch_k_holds_rows_k_plus_multiples_of_the_count():
    seen = []

    def recording(params, tokens, labels, denom, **kw):
        jax.debug.callback(lambda t: seen.append(np.asarray(t)[:, 0].tolist()), tokens)
        return _linear_grad_fn(params, tokens, labels, denom)

    rows = batch_rows({"tokens": jnp.arange(6, dtype=jnp.int32)[:, None] * jnp.ones((1, 2), jnp.int32)},
                      context=1)
    accumulate_gradients(recording, {"w": jnp.ones((1, 2))}, rows, 3, NO_MESH)
    jax.effects_barrier()
    assert seen == [[0, 3], [1, 4], [2, 5]]


def test_update_applies_adamw_and_reports_the_batch_metrics():
    opt = OptimConfig(lr=1e-2, weight_decay=0.0)
    tx = skip_step_adamw(opt)
    params = {"w": jnp.array([1.0, -2.0], jnp.float32)}
    state = init_train_state(params, tx)
    grads = {"w": jnp.array([0.3, -0.4], jnp.float32)}
    new, metrics = apply_update(tx, state, grads, LossSums(jnp.float32(6.0), jnp.float32(0.5)),
                                jnp.float32(4.0), jnp.float32(1e-2))
    assert isinstance(new, TrainState) and int(new.step) == int(state.step) + 1
    assert float(metrics["loss"]) == 1.5 and float(metrics["z_loss"]) == 0.125
    assert float(metrics["num_tokens"]) == 4.0 and float(metrics["skipped"]) == 0.0
    np.testing.assert_allclose(float(metrics["grad_norm"]), 0.5, rtol=1e-6)
    # Adam's first step moves each weight by lr against its gradient's sign (m/sqrt(v) = sign)
    np.testing.assert_allclose(new.params["w"], [1.0 - 1e-2, -2.0 + 1e-2], rtol=1e-5)

