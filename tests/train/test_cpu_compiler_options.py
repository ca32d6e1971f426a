"""The CPU training step is compiled with XLA options the pinned jaxlib knows; an XLA without them
compiles the step with its defaults instead of failing."""

import re

import jax
import jax.numpy as jnp

import olmax.train.step as step_mod


def test_pinned_jaxlib_knows_the_cpu_options():
    step_mod.cpu_compiler_options.cache_clear()
    assert step_mod.cpu_compiler_options() == step_mod.CPU_COMPILER_OPTIONS


def test_unknown_option_falls_back_to_defaults(monkeypatch):
    monkeypatch.setattr(step_mod, "CPU_COMPILER_OPTIONS", {"xla_cpu_no_such_option_in_any_xla": "1"})
    step_mod.cpu_compiler_options.cache_clear()
    try:
        assert step_mod.cpu_compiler_options() == {}
        fn = step_mod.jit_train_step(lambda s, b, lr: (s, {"x": b * lr}))
        state, out = fn(jnp.zeros(2), jnp.ones(2), jnp.float32(2.0))
        assert float(out["x"][0]) == 2.0
    finally:
        step_mod.cpu_compiler_options.cache_clear()


def _ynn_reductions(hlo: str) -> int:
    """Reductions inside the fusions XLA hands to the YNNPACK library."""
    bodies = dict(re.findall(r"^(%[\w.-]+) .*?\{\n(.*?)^\}", hlo, re.M | re.S))
    called = re.findall(r'calls=(%[\w.-]+).*"kind":"__ynn_fusion"', hlo)
    assert called, "no YNNPACK fusion at all: the check below would prove nothing"
    return sum(" reduce(" in bodies[name] for name in called)


def _norm_then_dot(x, w):
    y = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(y * y, -1, keepdims=True) + 1e-6)
    return jnp.sum(((y * r) * w).astype(jnp.bfloat16) @ jnp.ones((64, 64), jnp.bfloat16))


def test_cpu_step_is_compiled_with_the_options():
    """The options reach the compiled program: with XLA's defaults YNNPACK also takes the norm's
    reductions, through ``jit_train_step`` it takes the dot products only."""
    assert jax.default_backend() == "cpu"
    step_mod.cpu_compiler_options.cache_clear()
    x, w = jnp.ones((128, 64), jnp.bfloat16), jnp.ones((64,), jnp.float32)
    default = jax.jit(_norm_then_dot).lower(x, w).compile().as_text()
    ours = step_mod.jit_train_step(lambda s, b, lr: (s, _norm_then_dot(b, lr)))
    compiled = ours.lower(jnp.zeros(2), x, w).compile().as_text()
    assert _ynn_reductions(default) > 0
    assert _ynn_reductions(compiled) == 0
