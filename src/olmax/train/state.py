"""What a training checkpoint holds: parameters, optimizer state and the last completed step."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class TrainState(NamedTuple):
    """``params`` (fp32 master weights), ``opt_state`` (the optimizer's, fp32 moments), ``step``
    (int32 scalar: the number of completed trainer steps; step s consumes data batch s-1)."""

    params: Any
    opt_state: Any
    step: jax.Array


def init_train_state(params: Any, tx) -> TrainState:
    return TrainState(params=params, opt_state=tx.init(params), step=jnp.zeros((), jnp.int32))
