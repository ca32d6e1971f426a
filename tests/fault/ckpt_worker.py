"""Subprocess worker for the checkpoint fault tests (run as a script, never imported by pytest).

``python ckpt_worker.py MODE DIR [--devices N] [--process-id I --num-processes P --port PORT]``

The state at step ``s`` is a pure function of ``s`` (numpy, seeded), so any process layout can
check what it restored. Modes:

- ``save STEP``: write the state of STEP (sharded over an ``fsdp`` mesh of all devices).
- ``check``: restore_latest onto this layout with explicit target shardings; print
  ``RESTORED step ok`` where ok says every leaf equals the expected state bit for bit.
- ``loop``: from the latest step + 1, save every step (async) forever, printing
  ``SAVING s`` before each save (which first waits for the previous async save to commit).
"""

from __future__ import annotations

import argparse
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["save", "check", "loop"])
    ap.add_argument("dir")
    ap.add_argument("step", nargs="?", type=int)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--num-processes", type=int, default=1)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--rows", type=int, default=256)
    a = ap.parse_args()
    # the run's XLA flags (its compile level) with this worker's device count
    kept = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join([*kept, f"--xla_force_host_platform_device_count={a.devices}"])
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if a.num_processes > 1:
        jax.distributed.initialize(f"localhost:{a.port}", num_processes=a.num_processes,
                                   process_id=a.process_id)
    import numpy as np
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from olmax.config import CheckpointConfig
    from olmax.checkpoint.checkpointer import Checkpointer, abstract_tree
    from olmax.train.state import TrainState

    n = jax.device_count()
    mesh = jax.make_mesh((n,), ("fsdp",), axis_types=(AxisType.Auto,))
    rows = a.rows

    def expected(step: int) -> dict:
        rng = np.random.default_rng(step)
        return {"params": {"embed": rng.standard_normal((rows, 64), np.float32),
                           "norm": rng.standard_normal((64,), np.float32)},
                "opt_state": {"mu": {"embed": rng.standard_normal((rows, 64), np.float32),
                                     "norm": rng.standard_normal((64,), np.float32)},
                              "count": np.asarray(step, np.int32)}}

    spec = {"embed": P("fsdp"), "norm": P()}
    shard = {"params": spec, "opt_state": {"mu": spec, "count": P()}}
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), shard,
                             is_leaf=lambda x: isinstance(x, P))

    def state_of(step: int) -> TrainState:
        e = expected(step)
        arrays = jax.tree.map(
            lambda x, s: jax.make_array_from_callback(x.shape, s, lambda idx: x[idx]), e, shardings)
        return TrainState(arrays["params"], arrays["opt_state"], np.int32(step))

    cfg = CheckpointConfig(interval=1, keep=3, async_save=True)
    ck = Checkpointer(a.dir, cfg)
    if a.mode == "save":
        ck.save(a.step, state_of(a.step), {"data_position": a.step, "writer_devices": n,
                                           "writer_processes": jax.process_count()})
        ck.wait()
        ck.close()
        print("SAVED", a.step, flush=True)
    elif a.mode == "check":
        target = TrainState(*abstract_tree((expected(0)["params"], expected(0)["opt_state"]),
                                           (shardings["params"], shardings["opt_state"])),
                            jax.ShapeDtypeStruct((), np.int32))
        got = ck.restore_latest(target)
        if got is None:
            print("RESTORED none", flush=True)
            return 0
        step, st, meta = got
        want = expected(step)
        ok = int(st.step) == step and meta["data_position"] == step
        for name in ("params", "opt_state"):
            for x, y, s in zip(jax.tree.leaves(getattr(st, name)), jax.tree.leaves(want[name]),
                               jax.tree.leaves(shardings[name])):
                ok &= x.sharding == s
                for shard_ in x.addressable_shards:  # each process checks its own shards
                    ok &= bool(np.array_equal(np.asarray(shard_.data), y[shard_.index]))
        print("RESTORED", step, ok, meta.get("writer_devices"), meta.get("writer_processes"),
              "incomplete=" + ",".join(ck.incomplete), flush=True)
        ck.close()
    else:
        step = (ck.latest_step() or 0) + 1
        while True:
            print("SAVING", step, flush=True)
            ck.save(step, state_of(step), {"data_position": step})
            step += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
