"""Unit tests of :mod:`olmax.checkpoint.checkpointer` on plain pytrees (single device, in-process).

Multi-device resharding, real kills and multi-process runs are in the other files of this folder.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from olmax.config import CheckpointConfig
from olmax.errors import OlmaxError
from olmax.checkpoint.checkpointer import Checkpointer, abstract_tree, open_step_dir
from olmax.checkpoint.weights import load_params
from olmax.train.callbacks.saver import StopSignal
from olmax.train.run_log import rewind_jsonl
from olmax.train.state import TrainState


def make_state(seed: int = 0, n: int = 64) -> TrainState:
    k1, k2 = jax.random.split(jax.random.key(seed))
    params = {"embed": jax.random.normal(k1, (n, 8)), "layers": {"w": jax.random.normal(k2, (2, 8, 8))}}
    tx = optax.adamw(1e-3)
    opt_state = tx.init(params)
    grads = jax.tree.map(jnp.ones_like, params)
    _, opt_state = tx.update(grads, opt_state, params)  # non-trivial moments and count
    return TrainState(params, opt_state, jnp.asarray(0, jnp.int32))


def abstract(state: TrainState, dtype=None) -> TrainState:
    return abstract_tree(state, dtype=dtype)


def assert_trees_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def meta_for(step: int) -> dict:
    return {"data_position": step, "seed": 7, "model": {"d_model": 8}}


def saved(tmp_path: Path, steps, cfg: CheckpointConfig | None = None, reports=None):
    cfg = cfg or CheckpointConfig(interval=1, keep=10, async_save=True)
    ck = Checkpointer(tmp_path / "checkpoints", cfg, report=(reports.append if reports is not None else None))
    states = {}
    for s in steps:
        states[s] = make_state(s)
        ck.save(s, states[s], meta_for(s))
    ck.wait()
    return ck, states


def test_roundtrip_meta_and_step(tmp_path):
    ck, states = saved(tmp_path, [2, 4])
    assert ck.all_steps() == [2, 4] and ck.latest_step() == 4
    st, meta = ck.restore(2, abstract(states[2]))
    assert_trees_equal(st.params, states[2].params)
    assert_trees_equal(st.opt_state, states[2].opt_state)
    assert int(st.step) == 2 and st.step.dtype == jnp.int32
    assert meta == {**meta_for(2), "format_version": 1, "step": 2}
    ck.close()
    # the layout olmax.checkpoint.weights reads: <step>/{params,opt_state,meta}
    assert {p.name for p in (tmp_path / "checkpoints" / "4").iterdir()} >= {"params", "opt_state", "meta"}
    ro, step = open_step_dir(tmp_path)
    assert step == 4 and ro.directory == tmp_path / "checkpoints"
    st, _ = ro.restore(2, abstract(states[2]), items=("params",))
    assert_trees_equal(st.params, states[2].params)


def test_interval_force_and_existing_step(tmp_path):
    ck = Checkpointer(tmp_path / "c", CheckpointConfig(interval=5, keep=3, async_save=False))
    st = make_state()
    assert not ck.save(3, st, meta_for(3))
    assert ck.save(5, st, meta_for(5))
    assert ck.save(7, st, meta_for(7), force=True)
    assert not ck.save(7, st, meta_for(7), force=True)  # already there: no error, no rewrite
    ck.wait()
    assert ck.all_steps() == [5, 7]


def test_keep_last_k_plus_permanent(tmp_path):
    cfg = CheckpointConfig(interval=1, keep=2, permanent_interval=4, async_save=True)
    ck, _ = saved(tmp_path, range(1, 11), cfg)
    assert ck.all_steps() == [4, 8, 9, 10]
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir()) == [4, 8, 9, 10]


def test_restore_dtype_policy_and_subset(tmp_path):
    ck, states = saved(tmp_path, [1])
    st, _ = ck.restore(1, abstract(states[1], dtype=jnp.bfloat16), items=("params",))
    assert st.params["embed"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(st.params["embed"]),
                                  np.asarray(states[1].params["embed"].astype(jnp.bfloat16)))
    # items not restored come back as given (here: abstract)
    assert isinstance(jax.tree.leaves(st.opt_state)[0], jax.ShapeDtypeStruct)


def _truncate_arrays(d: Path):
    files = glob.glob(str(d / "params" / "**" / "d" / "*"), recursive=True)
    assert files
    for f in files:
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)


def _zero_arrays(d: Path):
    for f in glob.glob(str(d / "opt_state" / "**" / "d" / "*"), recursive=True):
        with open(f, "r+b") as fh:
            fh.write(b"\0" * 16)


CORRUPTIONS = {
    "truncated-array-files": _truncate_arrays,
    "zeroed-optimizer-files": _zero_arrays,
    "missing-meta": lambda d: shutil.rmtree(d / "meta"),
    "truncated-meta": lambda d: (d / "meta" / "metadata").write_text('{"format_ver'),
    "meta-without-version": lambda d: (d / "meta" / "metadata").write_text('{"step": 3}'),
    "missing-params": lambda d: shutil.rmtree(d / "params"),
    "truncated-tree-metadata": lambda d: (d / "params" / "_METADATA").write_text('{"tree_m'),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_latest_falls_back_to_previous(tmp_path, kind):
    ck, states = saved(tmp_path, [1, 2, 3])
    ck.close()
    CORRUPTIONS[kind](tmp_path / "checkpoints" / "3")
    reports: list[str] = []
    ck = Checkpointer(tmp_path / "checkpoints", CheckpointConfig(interval=1), report=reports.append)
    assert ck.latest_step() == 3  # not detected until read
    step, st, meta = ck.restore_latest(abstract(states[3]))
    assert step == 2 and meta["step"] == 2
    assert_trees_equal(st.params, states[2].params)
    assert_trees_equal(st.opt_state, states[2].opt_state)
    assert len(reports) == 1 and str(tmp_path / "checkpoints" / "3") in reports[0]
    assert "corrupt" in reports[0]
    assert ck.all_steps() == [1, 2]
    assert (tmp_path / "checkpoints" / "3.corrupt").is_dir()
    # training goes on and writes step 3 again
    assert ck.save(3, states[3], meta_for(3))
    ck.wait()
    assert ck.all_steps() == [1, 2, 3]


def test_every_checkpoint_unreadable_is_an_error_and_moves_nothing(tmp_path):
    ck, states = saved(tmp_path, [1, 2])
    ck.close()
    ck = Checkpointer(tmp_path / "checkpoints", CheckpointConfig(interval=1))
    wrong = abstract(make_state(0, n=32))  # a different model: every checkpoint mismatches
    with pytest.raises(OlmaxError, match=r"no readable checkpoint .*checkpoints/2"):
        ck.restore_latest(wrong)
    assert ck.all_steps() == [1, 2]


def test_newer_format_is_refused_by_name_and_never_moved(tmp_path):
    """A newest checkpoint written by a later olmax is not corrupt: resuming from the step before
    it would undo its progress silently. It is refused naming it, and nothing is renamed."""
    from olmax.checkpoint.format import NewerFormat

    ck, states = saved(tmp_path, [1, 2])
    ck.close()
    meta_file = tmp_path / "checkpoints" / "2" / "meta" / "metadata"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, "format_version": meta["format_version"] + 1}))
    before = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    ck = Checkpointer(tmp_path / "checkpoints", CheckpointConfig(interval=1))
    with pytest.raises(NewerFormat, match=rf"^checkpoint {tmp_path / 'checkpoints' / '2'}: "
                                          r"format_version 2 is newer than this olmax reads \(1\.\.1\)"):
        ck.restore_latest(abstract(states[2]))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == before == ["1", "2"]
    assert ck.corrupt == []


def test_empty_directory_restores_nothing(tmp_path):
    ck = Checkpointer(tmp_path / "checkpoints", CheckpointConfig())
    assert ck.latest_step() is None
    assert ck.restore_latest(abstract(make_state())) is None


def test_incomplete_save_is_reported_and_removed(tmp_path):
    ck, states = saved(tmp_path, [1])
    ck.close()
    partial = tmp_path / "checkpoints" / "2.orbax-checkpoint-tmp-1234567"
    (partial / "params").mkdir(parents=True)
    reports: list[str] = []
    ck = Checkpointer(tmp_path / "checkpoints", CheckpointConfig(), report=reports.append)
    assert ck.incomplete == [partial.name]
    assert any(partial.name in r for r in reports)
    assert ck.all_steps() == [1]
    ck.wait()
    ck.close()
    assert not partial.exists()


def held_at_commit(then=None):
    """A fence that holds a save at its commit until released, then calls ``then`` (which may
    raise: the lock was lost). Returns the fence and the two events (reached, release)."""
    import threading

    reached, release = threading.Event(), threading.Event()

    def fence():
        reached.set()
        assert release.wait(60)
        if then is not None:
            then()
    return fence, reached, release


def test_a_superseded_save_commits_nothing_and_leaves_the_newer_save_alone(tmp_path):
    """Attempt A's save of step 6 is in flight, its files written, its commit not yet made, when
    the newer attempt B opens the directory (removing A's temporary directory) and saves step 6
    too. A's commit comes while B's save is still in flight: A's fence (its run lock) says the run
    is B's, so A commits nothing -- it would otherwise have renamed a directory holding B's half
    -written save to ``6`` and left B's commit without its files -- and B's save commits intact."""
    from olmax.train.callbacks.run_lock import RunDirLockLost

    def lost():
        raise RunDirLockLost("stopping: run directory was taken over by pid 2 (attempt 9.1)")

    d = tmp_path / "checkpoints"
    cfg = CheckpointConfig(interval=1, keep=10, async_save=True)
    fence_a, a_waits, a_lost = held_at_commit(then=lost)
    fence_b, b_waits, b_go = held_at_commit()
    a = Checkpointer(d, cfg, fence=fence_a)
    a.save(6, make_state(1), meta_for(6))
    assert a_waits.wait(60)
    reports: list[str] = []
    b = Checkpointer(d, cfg, fence=fence_b, report=reports.append)
    assert b.incomplete == [f"6.orbax-checkpoint-tmp-{a.writer}"] and a.writer != b.writer
    b.save(6, make_state(2), meta_for(6))
    assert b_waits.wait(60)
    assert sorted(p.name for p in d.iterdir()) == [f"6.orbax-checkpoint-tmp-{b.writer}"]
    a_lost.set()
    with pytest.raises(OlmaxError, match=r"checkpoint save at step 6 .*taken over by pid 2"):
        a.wait()
    a.close()
    assert sorted(p.name for p in d.iterdir()) == [f"6.orbax-checkpoint-tmp-{b.writer}"]
    b_go.set()
    b.wait()
    assert sorted(p.name for p in d.iterdir()) == ["6"]
    state, _ = b.restore(6, abstract(make_state(2)))
    assert_trees_equal(state.params, make_state(2).params)
    assert_trees_equal(state.opt_state, make_state(2).opt_state)
    assert not b.save(6, make_state(3), meta_for(6), force=True)   # committed: not again
    b.close()


def test_a_step_committed_by_another_writer_meanwhile_is_a_restart_not_an_error(tmp_path):
    """The window the fence leaves: a superseded writer's fence passed just before the takeover
    and its commit of step 6 lands while this writer's save of step 6 is in flight. This writer's
    rename is refused (nothing is overwritten): exit 75 with one line, so that the restart resumes
    from the step on disk; nothing of this writer's is left."""
    from olmax.errors import RestartableError

    d, other = tmp_path / "checkpoints", tmp_path / "other"
    cfg = CheckpointConfig(interval=1, keep=10, async_save=True)
    fence, at_fence, go = held_at_commit()
    mine = Checkpointer(d, cfg, fence=fence)
    mine.save(6, make_state(1), meta_for(6))
    assert at_fence.wait(60)
    theirs, _ = saved(other, [6])
    theirs.close()
    shutil.copytree(other / "checkpoints" / "6", d / "6")     # committed by the other writer
    go.set()
    with pytest.raises(RestartableError, match=r"^checkpoint save at step 6 to .* found the step "
                       r"committed meanwhile by another writer of this run .*a restart resumes "
                       r"from it; previous checkpoints intact: \[6\]$"):
        mine.wait()
    mine.close()
    assert sorted(p.name for p in d.iterdir()) == ["6"]
    state, _ = Checkpointer(d, cfg, read_only=True).restore(6, abstract(make_state(6)))
    assert_trees_equal(state.params, make_state(6).params)


def test_a_save_the_fence_refuses_leaves_nothing(tmp_path):
    """A writer whose run was taken over: its save (in the background) is dropped whole; the
    previous checkpoint is the latest; a save before it commits as usual."""
    d = tmp_path / "checkpoints"
    lost: list[str] = []

    def fence():
        if lost:
            raise OlmaxError(lost[0])

    ck = Checkpointer(d, CheckpointConfig(interval=1, keep=10, async_save=True), fence=fence)
    ck.save(2, make_state(2), meta_for(2))
    ck.wait()
    lost.append("stopping: run directory was taken over")
    ck.save(4, make_state(4), meta_for(4))
    with pytest.raises(OlmaxError, match=r"at step 4 .*was taken over\); previous checkpoints intact: \[2\]"):
        ck.close()
    assert sorted(p.name for p in d.iterdir()) == ["2"]
    assert Checkpointer(d, CheckpointConfig(), read_only=True).all_steps() == [2]


def test_unwritable_directory_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(OlmaxError, match=r"checkpoint directory .*file/checkpoints is not writable"):
        Checkpointer(blocker / "checkpoints", CheckpointConfig())


DISK_FULL = textwrap.dedent("""
    import resource, signal, sys
    import jax, jax.numpy as jnp, numpy as np
    from olmax.config import CheckpointConfig
    from olmax.errors import OlmaxError
    from olmax.checkpoint.checkpointer import Checkpointer, abstract_tree
    d = sys.argv[1]
    small = {"params": {"w": jnp.ones((4,))}, "opt_state": {"m": jnp.zeros((4,))}}
    big = {"params": {"w": jax.random.normal(jax.random.key(0), (256, 1024))},
           "opt_state": {"m": jnp.zeros((4,))}}
    ck = Checkpointer(d, CheckpointConfig(interval=1, keep=1, async_save=True))
    ck.save(1, small, {"x": 1}); ck.wait()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)          # writes past the limit fail with EFBIG,
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (65536, hard))  # like a full disk
    try:
        ck.save(2, big, {"x": 2}); ck.wait()
    except OlmaxError as e:
        print("ERROR:", e)
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
    ck2 = Checkpointer(d, CheckpointConfig(interval=1, keep=1))
    step, st, meta = ck2.restore_latest(abstract_tree(small))
    print("RESTORED", step, ck2.all_steps(), float(st["params"]["w"].sum()), meta["x"])
""")


def test_disk_full_is_a_clear_error_and_keeps_previous(tmp_path):
    out = subprocess.run([sys.executable, "-c", DISK_FULL, str(tmp_path / "c")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    err = [line for line in lines if line.startswith("ERROR:")]
    assert err and "checkpoint save" in err[0] and "previous checkpoints intact: [1]" in err[0], lines
    assert "RESTORED 1 [1] 4.0 1" in lines


def test_rewind_jsonl(tmp_path):
    p = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 1.0 / s} for s in range(1, 8)]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 8, "lo')
    assert rewind_jsonl(p, 4) == 4
    assert [json.loads(line)["step"] for line in p.read_text().splitlines()] == [1, 2, 3, 4]
    assert rewind_jsonl(p, 4) == 0
    assert rewind_jsonl(tmp_path / "none.jsonl", 1) == 0


def test_stop_signal_turns_sigterm_into_a_flag():
    with StopSignal() as stop:
        assert not stop.requested()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested() and stop.received == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_load_params_reads_a_training_step_dir(tmp_path):
    from olmax.config import to_dict
    from olmax.model.params import init_params
    from olmax.model.presets import get_preset

    cfg = get_preset("olmo3-tiny").replace(vocab_size=96, padded_vocab_size=128)
    params = init_params(cfg, jax.random.key(1))
    tx = optax.adam(1e-3)
    ck = Checkpointer(tmp_path / "checkpoints", CheckpointConfig(interval=1))
    ck.save(3, TrainState(params, tx.init(params), jnp.int32(3)), {"model": to_dict(cfg)})
    ck.wait()
    loaded, loaded_cfg = load_params(tmp_path, dtype=jnp.bfloat16)
    assert loaded_cfg == cfg
    assert_trees_equal(loaded, jax.tree.map(lambda x: x.astype(jnp.bfloat16), params))
