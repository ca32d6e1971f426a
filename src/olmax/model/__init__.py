"""The OLMo 3 model: the parameter table, forward pass, attention, RoPE, presets, FLOPs."""

from olmax.model.olmo3 import forward, hidden_states, lm_head_weight, logits_from_hidden  # noqa: F401
from olmax.model.params import (  # noqa: F401
    PARAMS, Params, abstract_params, count_params, init_params, param_axes, param_shapes,
)
from olmax.model.presets import PRESETS, get_preset  # noqa: F401
from olmax.model.runtime import Runtime  # noqa: F401
