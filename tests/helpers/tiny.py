"""The tests' tiny OLMo 3 shapes, written once. Each keeps what OLMo 3 has (GQA, QK-norm, sliding
windows with full layers between them) at a size a CPU trains in seconds; a test gives what its
check needs (vocabulary, windows, sequence length) as keyword arguments.

- :func:`tiny_cfg`: 2 layers of 32, a window shorter than the text (evaluation tests);
- :func:`small_cfg`: 4 layers of 32 (4 query heads, 2 key heads of 8): the training, mesh and
  interop tests; the rest of :class:`~olmax.config.ModelConfig` at its defaults unless given;
- :func:`narrow_cfg`: 2 layers of 16 with one key head (checkpoint files, weights checks);
- :func:`random_params`: random fp32 weights of a config.
"""

import jax
import jax.numpy as jnp
import numpy as np

from olmax.config import ModelConfig

SMALL = dict(d_model=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=8, mlp_hidden=64)
NARROW = dict(d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8, mlp_hidden=32)


def tiny_cfg(**kw) -> ModelConfig:
    return small_cfg(**{"n_layers": 2, "vocab_size": 100, "padded_vocab_size": 128,
                        "window_pattern": (8, None), "max_seq_len": 256, **kw})


def small_cfg(**kw) -> ModelConfig:
    return ModelConfig(**{**SMALL, **kw})


def narrow_cfg(**kw) -> ModelConfig:
    return ModelConfig(**{**NARROW, **kw})


def random_params(cfg: ModelConfig, rng: np.random.Generator) -> dict:
    """Random fp32 weights of ``cfg`` drawn from ``rng``: norms around 1, and every weight
    different per layer, so that a wrong pairing of layers and weights shows."""
    from olmax.model.params import param_shapes

    return jax.tree_util.tree_map_with_path(
        lambda kp, s: jnp.asarray((1.0 if "norm" in jax.tree_util.keystr(kp) else 0.0)
                                  + 0.2 * rng.standard_normal(s), jnp.float32),
        param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
