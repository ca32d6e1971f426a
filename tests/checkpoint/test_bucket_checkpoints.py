"""Checkpoints straight to a bucket (moto's S3 server and fake-gcs-server on 127.0.0.1), in process: the round trip,
keep-last-K plus permanent steps, a half-written step (no commit file) never restored and never
counted against a complete one, and a store that stops answering before a save (retried, then
exit 75).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from helpers.remote_servers import s3_bucket, store_bucket
from helpers.tiny import narrow_cfg
from olmax import store, transport
from olmax.checkpoint.checkpointer import Checkpointer, abstract_tree, open_step_dir
from olmax.checkpoint.weights import load_model_config, load_params, stored_arrays
from olmax.config import CheckpointConfig, to_dict
from olmax.errors import OlmaxError
from olmax.train.state import TrainState


@pytest.fixture(scope="module", params=["s3", "gs"])
def bucket(request):
    with store_bucket(request.param) as url:
        yield url


def make_state(seed: int) -> TrainState:
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"embed": jax.random.normal(k1, (64, 8)), "w": jax.random.normal(k2, (2, 8, 8))}
    tx = optax.adamw(1e-3)
    _, opt_state = tx.update(jax.tree.map(jnp.ones_like, params), tx.init(params), params)
    return TrainState(params, opt_state, jnp.asarray(0, jnp.int32))


def equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y))
               for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def save_steps(directory, steps, cfg):
    ck = Checkpointer(directory, cfg)
    states = {s: make_state(s) for s in steps}
    for s in steps:
        ck.save(s, states[s], {"data_position": s})
    ck.wait()
    return ck, states


def test_roundtrip_keep_last_k_and_permanent(bucket):
    d = f"{bucket}/keep/checkpoints"
    cfg = CheckpointConfig(interval=1, keep=2, permanent_interval=2, async_save=True)
    ck, states = save_steps(d, range(1, 5), cfg)
    assert ck.all_steps() == [2, 3, 4]
    assert sorted(int(n) for n in store.listdir(d)) == [2, 3, 4]   # step 1 deleted
    ck.close()
    ro, step = open_step_dir(f"{bucket}/keep")          # a bucket run dir resolves too
    assert step == 4 and ro.directory == d
    got, meta = ro.restore(3, abstract_tree(states[3]))
    assert equal(got.params, states[3].params) and equal(got.opt_state, states[3].opt_state)
    assert meta["step"] == 3 and int(got.step) == 3


def test_half_written_step_is_never_restored_nor_counted(bucket):
    d = f"{bucket}/half/checkpoints"
    cfg = CheckpointConfig(interval=1, keep=2, async_save=True)
    ck, states = save_steps(d, [3, 4, 5], cfg)
    ck.close()
    # what a kill before the commit leaves: every item written, no commit file
    store.delete(f"{d}/5/commit_success.txt")
    reports: list[str] = []
    ck = Checkpointer(d, cfg, report=reports.append)
    assert ck.incomplete == ["5"] and "interrupted save" in reports[0]
    assert store.listdir(d) == ["4"]          # 4 kept: 3 went with keep=2, when 5 was saved
    step, got, _ = ck.restore_latest(abstract_tree(states[4]))
    assert step == 4 and equal(got.params, states[4].params)
    ck.save(5, states[5], {"data_position": 5})   # saved again: keep-last-2 holds 4 and 5
    ck.wait()
    assert ck.all_steps() == [4, 5]
    ck.close()


def test_weights_readers_take_a_bucket_run(bucket):
    """What init.checkpoint, olmax eval, convert and parity read: the newest committed step of
    a bucket run dir, whole (load_params) or streamed array by array (stored_arrays)."""
    from olmax.model.params import init_params

    cfg = narrow_cfg(vocab_size=120, padded_vocab_size=128, window_pattern=(8, None), max_seq_len=64)
    params = init_params(cfg, jax.random.key(3))
    state = TrainState(params, {"count": jnp.zeros((), jnp.int32)}, jnp.asarray(0, jnp.int32))
    ck = Checkpointer(f"{bucket}/wrun/checkpoints", CheckpointConfig(interval=1, async_save=False))
    ck.save(7, state, {"model": to_dict(cfg), "data_position": 7})
    ck.close()
    assert load_model_config(f"{bucket}/wrun") == cfg
    got, got_cfg = load_params(f"{bucket}/wrun")
    assert got_cfg == cfg and equal(got, params)
    streamed, _ = stored_arrays(f"{bucket}/wrun/checkpoints/7")
    assert all(np.array_equal(np.asarray(a[...]), np.asarray(b))
               for a, b in zip(jax.tree.leaves(streamed, is_leaf=lambda x: hasattr(x, "name")),
                               jax.tree.leaves(params)))


def test_store_unreachable_at_a_save_is_retried_then_restartable(monkeypatch):
    monkeypatch.setattr(transport, "BACKOFF_S", 0.05)
    monkeypatch.setattr(transport, "MAX_BACKOFF_S", 0.1)
    with s3_bucket() as (url, name):
        d = f"s3://{name}/lost/checkpoints"
        ck, states = save_steps(d, [1], CheckpointConfig(interval=1, keep=3, async_save=True))
        # the store stops answering (a port nothing listens on: every connection refused)
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        with pytest.raises(OlmaxError) as e:
            ck.save(2, states[1], {"data_position": 2})
            ck.wait()
    assert e.value.exit_code == 75, e.value
    assert "checkpoint save at step 2" in str(e.value) and "\n" not in str(e.value)
