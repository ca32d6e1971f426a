"""Training steps of a sharded training (``olmax.train.step.build_sharded_training``) over host
batches, for the tests that compare meshes (run in subprocesses with several CPU devices)."""

from __future__ import annotations

import jax
import numpy as np


def run_steps(st, batches, schedule, state=None):
    """``st``'s step over ``batches`` (each a dict of host arrays: ``tokens``, ``instance_mask``,
    optionally ``doc_lens``; placed by ``st.batch_shardings``), step s (from 1) at LR
    ``schedule(s)``, from ``state`` (default: a fresh one). Returns the final state and the
    ``loss``, ``grad_norm`` and ``skipped`` of every step."""
    state = st.fresh_state() if state is None else state
    out = {"loss": [], "grad_norm": [], "skipped": []}
    for s, host in enumerate(batches, start=1):
        batch = {k: jax.device_put(v, st.batch_shardings[k]) for k, v in host.items()}
        state, m = st.step_fn(state, batch, np.float32(schedule(s)))
        for k in out:
            out[k].append(float(m[k]))
    return state, out
