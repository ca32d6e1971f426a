"""MaxText's ahead-of-time compile of its training step, recorded (runs in MaxText's environment).

MaxText cannot share a process with olmax (other jax pins, its own libtpu flags), so this file
imports only MaxText and jax and is run with MaxText's interpreter by ``tpu_plan.py maxtext``:

    python benchmarks/maxtext_compile.py step --topology tpu7x-16 --json OUT [--hlo FILE] -- key=value ...
    python benchmarks/maxtext_compile.py parts --topology tpu7x-16 --layers 4 --json OUT [--hlo FILE] -- key=value ...
    python benchmarks/maxtext_compile.py step --topology a3 --gpu-target TARGET.txt --gpu-count 8 --json OUT ...

A GPU step (``--gpu-target``: a ``GpuTargetConfig`` text, as ``olmax.hardware`` holds for H100 and
H200) is compiled for that many compile-only GPUs of one node, through JAX's CUDA plugin (it must
be installed in MaxText's environment: ``pip install "jax[cuda12]==JAX_VERSION"``); no GPU is needed.

The overrides name the model (``model_name=...``, required: nothing here is pinned to one model).

``step`` runs ``maxtext.trainers.pre_train.train_compile``'s ``main`` unchanged -- its ``base.yml``,
``compile_topology=TOPOLOGY compile_topology_num_slices=1`` and the given overrides; it prints its
own ``Cost analysis`` and ``Memory analysis`` lines -- and records the compiled object main builds
(``train_compile.jit_and_compile`` is wrapped to keep it): memory and cost analyses, the compile
time (lowering included) and, with ``--hlo``, the optimized HLO text. It also records what an
estimate of the step needs from MaxText's own configuration (``model``: widths, layers, each
layer's attention type and window, splash blocks, remat policy; ``num_params``, counted from the
abstract state), MaxText's own FLOP count per device and step (``maxtext_tflops``:
``calculate_tflops_training_per_device``, the count behind its logged TFLOP/s/device and so behind
an MFU quoted from its logs) and ``optimizer``: the cost analysis of MaxText's optimizer update
(``optimizers.get_optimizer`` of the same configuration) over one device's share of the parameters
as one flat vector, compiled for that device alone (the update is elementwise).

``parts`` compiles the pieces olmax's estimate is made of, so that both frameworks go through the
same method: the same step, but for one device of the topology (its first; ``per_device_batch_size``
sequences in all), with ``LAYERS`` decoder layers unscanned (``scan_layers=false``), without gradient
clipping or skip-step, and with the optimizer update replaced by storing the gradients in the
parameters: forward + backward of the embedding, LAYERS layers and the LM head + loss. Two such
compiles (4 and 8 layers) give one layer group (the difference) and the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _base_yml() -> str:
    import maxtext

    return os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=("step", "parts"))
    p.add_argument("--topology", required=True, help="MaxText topology name, e.g. tpu7x-16")
    p.add_argument("--layers", type=int, default=4, help="parts: decoder layers (unscanned)")
    p.add_argument("--json", dest="json_out", required=True)
    p.add_argument("--hlo", dest="hlo_out")
    p.add_argument("--gpu-target", help="step for GPUs: a GpuTargetConfig text file (no GPU needed)")
    p.add_argument("--gpu-count", type=int, default=8, help="with --gpu-target: GPUs of one node")
    args = sys.argv[1:]
    cut = args.index("--") if "--" in args else len(args)
    a = p.parse_args(args[:cut])
    a.overrides = args[cut + 1:]

    import jax
    from absl import app

    from maxtext.trainers.pre_train import train_compile as tc
    from maxtext.utils import accelerator_to_spec_map

    if not any(o.startswith("model_name=") for o in a.overrides):
        p.error("the overrides must name the model (model_name=...)")
    argv = ["train_compile", _base_yml(), "run_name=aot",
            "base_output_directory=/tmp/maxtext_aot", f"compile_topology={a.topology}",
            "compile_topology_num_slices=1"]
    if a.mode == "parts":
        name = accelerator_to_spec_map.get_system_characteristics(a.topology).topology_name
        argv = argv[:-2] + [f"compile_topology={name}", "compile_topology_num_slices=1", "internal_compile=true",
                            "internal_compile_num_devices=1", "scan_layers=false",
                            f"base_num_decoder_layers={a.layers}", "gradient_clipping_threshold=0",
                            "skip_step_on_spikes=false", "override_model_config=true"]
        real_desc = tc.get_topology_desc

        class _One:
            def __init__(self, desc):
                self.devices = list(desc.devices)[:1]

        tc.get_topology_desc = lambda **kw: _One(real_desc(**kw))

        from flax import nnx
        from maxtext.common import train_state_nnx

        def store_gradients(self, grads, **kwargs):
            nnx.update(self.model, grads)
        train_state_nnx.TrainStateNNX.apply_gradients = store_gradients
        # the parts carry no clipping or skip-step (the optimizer part is costed separately)
        a.overrides = [o for o in a.overrides
                       if o.split("=")[0] not in ("gradient_clipping_threshold", "skip_step_on_spikes")]
    argv += a.overrides
    if a.gpu_target:
        if a.mode != "step":
            p.error("--gpu-target compiles the step only")
        _compile_only_gpus(tc, a.gpu_target, a.gpu_count)

    captured: dict = {}
    real_compile = tc.jit_and_compile
    real_init = tc.pyconfig.initialize

    def keep_config(*args, **kwargs):
        captured["config"] = real_init(*args, **kwargs)
        return captured["config"]
    tc.pyconfig.initialize = keep_config

    def recording(func, func_input_args, func_input_kwargs, mesh, *args, **kwargs):
        t0 = time.perf_counter()
        compiled = real_compile(func, func_input_args, func_input_kwargs, mesh, *args, **kwargs)
        captured["compile_s"] = time.perf_counter() - t0
        captured["compiled"] = compiled
        captured["state"], captured["mesh"] = func_input_args[0], mesh
        return compiled
    tc.jit_and_compile = recording

    t0 = time.perf_counter()
    try:
        app.run(tc.main, argv=argv)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    wall = time.perf_counter() - t0
    compiled = captured.get("compiled")
    if compiled is None:
        print("maxtext_compile: train_compile ended without compiling", file=sys.stderr)
        return 1
    ma = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = dict((cost[0] if isinstance(cost, (list, tuple)) else cost) or {})
    memory = {k: int(getattr(ma, k)) for k in (
        "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes", "alias_size_in_bytes",
        "generated_code_size_in_bytes", "peak_memory_in_bytes") if hasattr(ma, k)}
    text = compiled.as_text()
    if a.hlo_out:
        with open(a.hlo_out, "w") as f:
            f.write(text)
    from importlib.metadata import PackageNotFoundError, version

    def _version(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    out = {"mode": a.mode, "topology": a.topology, "layers": a.layers if a.mode == "parts" else None,
           "argv": argv[1:], "compile_s": captured["compile_s"], "wall_s": wall, "memory": memory,
           "cost": {k: cost.get(k) for k in ("flops", "bytes accessed", "optimal_seconds", "transcendentals")},
           "versions": {"maxtext": version("maxtext"), "jax": jax.__version__, "libtpu": _version("libtpu"),
                        "jax_cuda12_plugin": _version("jax-cuda12-plugin"),
                        "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", ""),
                        "xla_flags": os.environ.get("XLA_FLAGS", "")},
           "custom_calls": _custom_calls(text)}
    config = captured.get("config")
    if config is not None:
        out.update(_described(config, captured.get("state"), captured.get("mesh"), a.mode))
    with open(a.json_out, "w") as f:
        json.dump(out, f, indent=2)
    return 0


def _compile_only_gpus(tc, target_file: str, count: int) -> None:
    """Make ``train_compile`` build its mesh from ``count`` compile-only GPUs of one node described
    by a ``GpuTargetConfig`` (JAX's CUDA plugin, no GPU or driver needed). MaxText 0.2.5's
    ``get_topology_mesh`` takes ``jax.devices()`` for a GPU topology -- the host's own GPUs --
    so it is given these devices in their place while it builds the mesh; the rest of the
    function (MaxText's device mesh and axis types) runs unchanged."""
    import jax
    from jax.experimental import topologies

    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    with open(target_file) as f:
        target = f.read()
    devices = list(topologies.get_topology_desc(platform="cuda", target_config=target,
                                                topology=f"1x1x{count}").devices)
    real = tc.get_topology_mesh

    def on_target_gpus(config):
        local = jax.devices
        jax.devices = lambda *args, **kwargs: devices
        try:
            return real(config)
        finally:
            jax.devices = local
    tc.get_topology_mesh = on_target_gpus


MODEL_FIELDS = ("model_name", "decoder_block", "emb_dim", "num_query_heads", "num_kv_heads", "head_dim",
                "mlp_dim", "num_decoder_layers", "vocab_size", "sliding_window_size",
                "inhomogeneous_layer_cycle_interval", "per_device_batch_size", "max_target_length",
                "remat_policy", "attention", "dtype", "weight_dtype", "opt_type", "mu_dtype",
                "scan_layers", "sa_block_q", "sa_block_kv", "sa_block_kv_compute", "sa_block_q_dkv",
                "sa_block_kv_dkv", "sa_block_kv_dkv_compute", "sa_use_fused_bwd_kernel",
                "use_tokamax_splash", "ici_fsdp_parallelism", "ici_tensor_parallelism")


def _plain(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return str(getattr(v, "value", v))


def _layer_attention(config) -> list[dict]:
    """Each decoder layer's attention type and window, as the model's own module assigns them
    (``maxtext.models.<decoder_block>.get_attention_type`` where the module has one, cycling over
    ``inhomogeneous_layer_cycle_interval``); other models: causal attention over the whole
    sequence in every layer."""
    import importlib

    block = _plain(config.decoder_block)
    try:
        get_type = importlib.import_module(f"maxtext.models.{block}").get_attention_type
    except (ImportError, AttributeError):
        get_type = None
    out = []
    for layer in range(int(config.num_decoder_layers)):
        kind = _plain(get_type(layer)) if get_type else "global"
        window = int(config.sliding_window_size) if kind == "local_sliding" else None
        out.append({"type": kind, "window": window})
    return out


def _described(config, state, mesh, mode: str) -> dict:
    """What an estimate of the step needs from MaxText's configuration (see the module)."""
    import jax

    out: dict = {"model": {k: _plain(getattr(config, k, None)) for k in MODEL_FIELDS},
                 "layer_attention": _layer_attention(config)}
    try:
        from maxtext.utils import maxtext_utils

        total, weights, attention = maxtext_utils.calculate_tflops_training_per_device(config, log=False)
        out["maxtext_tflops"] = {"total": float(total), "learnable_weights": float(weights),
                                 "attention": float(attention),
                                 "per": "device and step (calculate_tflops_training_per_device)"}
    except Exception as e:                       # recorded, not fatal: the compile is the point
        out["maxtext_tflops"] = {"error": repr(e)[:300]}
    n_params = None
    try:
        n_params = int(sum(x.size for x in jax.tree.leaves(state["model"])))
    except Exception as e:
        out["num_params_error"] = repr(e)[:300]
    out["num_params"] = n_params
    if mode == "step" and n_params and mesh is not None:
        out["optimizer"] = _optimizer_part(config, n_params, mesh)
    return out


def _optimizer_part(config, n_params: int, mesh) -> dict:
    """Cost analysis of MaxText's optimizer update over one device's share of the parameters (one
    flat vector of ceil(params / devices) elements in ``weight_dtype``), for that device alone."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from maxtext.optimizers import optimizers
    from maxtext.utils import maxtext_utils

    try:
        devices = list(mesh.devices.flat)
        share = -(-n_params // len(devices))
        one = NamedSharding(Mesh(np.asarray(devices[:1]), ("x",)), P())
        tx = optimizers.get_optimizer(config, maxtext_utils.create_learning_rate_schedule(config))
        dtype = jax.numpy.dtype(_plain(config.weight_dtype))
        flat = jax.ShapeDtypeStruct((share,), dtype)
        spec = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one)  # noqa: E731
        opt = jax.tree.map(spec, jax.eval_shape(tx.init, flat))

        def update(g, o, p):
            u, o = tx.update(g, o, p)
            return optax.apply_updates(p, u), o
        compiled = jax.jit(update).lower(spec(flat), opt, spec(flat)).compile()
        cost = compiled.cost_analysis()
        cost = dict((cost[0] if isinstance(cost, (list, tuple)) else cost) or {})
        return {"elements": share, "dtype": str(dtype),
                "cost": {k: cost.get(k) for k in ("flops", "bytes accessed", "optimal_seconds")},
                "custom_calls": _custom_calls(compiled.as_text())}
    except Exception as e:                       # recorded: the estimate then says it lacks it
        return {"error": repr(e)[:500]}


def _custom_calls(text: str) -> dict:
    import re

    counts: dict[str, int] = {}
    for m in re.finditer(r'custom_call_target="([^"]+)"', text):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


if __name__ == "__main__":
    sys.exit(main())
