"""Platform profiles (:mod:`olmax.platforms`): resolved once, from the devices or forced by name;
the CPU step compiled with XLA options the pinned jaxlib knows (an XLA without them compiles the
step with its defaults instead of failing), and only where XLA's CPU backend compiles."""

import re
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

import olmax.platforms as platforms
import olmax.train.step as step_mod
from olmax.config import TrainConfig
from olmax.errors import ConfigError
from olmax.model.runtime import Runtime


def _devices(platform):
    return [SimpleNamespace(platform=platform)]


def test_auto_follows_the_devices_and_a_name_forces_a_profile():
    assert platforms.backend_of(_devices("cuda")) == platforms.backend_of(_devices("rocm")) == "gpu"
    assert platforms.backend_of() == "cpu"                      # this machine
    for backend in ("cpu", "tpu", "gpu"):
        assert platforms.profile_for("auto", backend) is platforms.PROFILES[backend]
        assert platforms.profile_for(backend, "cpu").name == backend
    with pytest.raises(ConfigError, match="no platform profile for the 'METAL' backend"):
        platforms.profile_for("auto", "METAL")
    with pytest.raises(ConfigError, match="unknown platform profile 'npu'"):
        platforms.profile_for("npu", "cpu")
    with pytest.raises(ConfigError, match="train.profile"):
        TrainConfig(profile="npu")


def test_runtime_of_a_config_resolves_the_profile_for_its_devices():
    rt = Runtime.of(TrainConfig(attn_impl="auto", profile="tpu"))
    assert (rt.profile_name, rt.backend, rt.attn_impl, rt.kernels.name) == ("tpu", "cpu", "splash", "reference")
    assert rt.unroll_layers and not rt.rope_tables_at_trace
    assert not Runtime.of(TrainConfig(profile="gpu")).unroll_layers
    assert not Runtime.of(TrainConfig(profile="tpu", unroll_layers=False)).unroll_layers
    rt = Runtime.of(TrainConfig(attn_impl="auto"), _devices("tpu"))
    assert (rt.profile_name, rt.backend, rt.attn_impl) == ("tpu", "tpu", "splash")
    rt = Runtime.of(TrainConfig(attn_impl="auto"))
    assert (rt.profile_name, rt.attn_impl, rt.kernels.name) == ("cpu", "chunked", "cpu")
    assert rt.unroll_layers and rt.rope_tables_at_trace
    bare = Runtime()           # the plain JAX path
    assert (bare.profile_name, bare.kernels.name, bare.unroll_layers) == ("reference", "reference", False)


def test_pinned_jaxlib_knows_the_cpu_options():
    platforms._cpu_compiler_options.cache_clear()
    assert platforms.compiler_options("cpu") == platforms.CPU_COMPILER_OPTIONS
    assert platforms.compiler_options("tpu") is None and platforms.compiler_options("gpu") is None


def test_tpu_options_follow_the_generation_and_yield_to_the_user(monkeypatch):
    """Ironwood's step is compiled with 64 MiB of scoped VMEM and v5e's with 32 MiB (their
    ``compiler_options`` in ``olmax.hardware``; their effect on the compiled program:
    tests/parallel/test_layout_tpu.py, tests/perf/test_plan_tpu.py); other generations keep
    libtpu's defaults; a value the user gives libtpu in ``LIBTPU_INIT_ARGS`` is left to libtpu,
    and the run's own ``train.compiler_options`` win over the table's."""
    monkeypatch.delenv("LIBTPU_INIT_ARGS", raising=False)
    assert platforms.compiler_options("tpu", ["TPU7x"]) == {"xla_tpu_scoped_vmem_limit_kib": "65536"}
    assert platforms.compiler_options("tpu", ["TPU v5 lite"]) == {"xla_tpu_scoped_vmem_limit_kib": "32768"}
    assert platforms.compiler_options("tpu", ["TPU v5 lite"], {"xla_tpu_scoped_vmem_limit_kib": "16384"}) == {
        "xla_tpu_scoped_vmem_limit_kib": "16384"}
    assert platforms.compiler_options("tpu", ["TPU v5"]) is None
    assert platforms.compiler_options("tpu", ["TPU v6 lite"]) is None
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_dvfs_p_state=7 --xla_tpu_scoped_vmem_limit_kib=32768")
    assert platforms.compiler_options("tpu", ["TPU7x"]) is None
    monkeypatch.setenv("LIBTPU_INIT_ARGS", "--xla_tpu_dvfs_p_state=7")
    assert platforms.compiler_options("tpu", ["TPU7x"]) == {"xla_tpu_scoped_vmem_limit_kib": "65536"}


def test_unknown_option_falls_back_to_defaults(monkeypatch):
    monkeypatch.setattr(platforms, "CPU_COMPILER_OPTIONS", {"xla_cpu_no_such_option_in_any_xla": "1"})
    platforms._cpu_compiler_options.cache_clear()
    try:
        assert platforms.compiler_options("cpu") == {}
        fn = step_mod.jit_train_step(lambda s, b, lr: (s, {"x": b * lr}))
        state, out = fn(jnp.zeros(2), jnp.ones(2), jnp.float32(2.0))
        assert float(out["x"][0]) == 2.0
    finally:
        platforms._cpu_compiler_options.cache_clear()


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
    platforms._cpu_compiler_options.cache_clear()
    x, w = jnp.ones((128, 64), jnp.bfloat16), jnp.ones((64,), jnp.float32)
    default = jax.jit(_norm_then_dot).lower(x, w).compile().as_text()
    ours = step_mod.jit_train_step(lambda s, b, lr: (s, _norm_then_dot(b, lr)))
    compiled = ours.lower(jnp.zeros(2), x, w).compile().as_text()
    assert _ynn_reductions(default) > 0
    assert _ynn_reductions(compiled) == 0
