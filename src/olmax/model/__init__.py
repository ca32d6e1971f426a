"""The OLMo 3 model: configuration presets, forward pass, attention, RoPE, FLOPs."""

from olmax.model.olmo3 import (  # noqa: F401
    Params, abstract_params, count_params, forward, hidden_states, init_params, lm_head_weight,
    logits_from_hidden, param_axes, param_shapes,
)
from olmax.model.presets import PRESETS, get_preset  # noqa: F401
