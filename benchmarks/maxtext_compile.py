"""MaxText's ahead-of-time compile of its training step, recorded (runs in MaxText's environment).

MaxText cannot share a process with olmax (other jax pins, its own libtpu flags), so this file
imports only MaxText and jax and is run with MaxText's interpreter by ``tpu_plan.py maxtext``:

    python benchmarks/maxtext_compile.py step --topology tpu7x-16 --json OUT [--hlo FILE] -- key=value ...
    python benchmarks/maxtext_compile.py parts --topology tpu7x-16 --layers 4 --json OUT [--hlo FILE] -- key=value ...

``step`` runs ``maxtext.trainers.pre_train.train_compile``'s ``main`` unchanged -- its ``base.yml``,
``model_name=olmo3-7b-pt``, ``compile_topology=TOPOLOGY compile_topology_num_slices=1`` and the
given overrides; it prints its own ``Cost analysis`` and ``Memory analysis`` lines -- and records the
compiled object main builds (``train_compile.jit_and_compile`` is wrapped to keep it): memory and
cost analyses, the compile time (lowering included) and, with ``--hlo``, the optimized HLO text.

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
    args = sys.argv[1:]
    cut = args.index("--") if "--" in args else len(args)
    a = p.parse_args(args[:cut])
    a.overrides = args[cut + 1:]

    import jax
    from absl import app

    from maxtext.trainers.pre_train import train_compile as tc
    from maxtext.utils import accelerator_to_spec_map

    argv = ["train_compile", _base_yml(), "model_name=olmo3-7b-pt", "run_name=aot",
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

    captured: dict = {}
    real_compile = tc.jit_and_compile

    def recording(*args, **kwargs):
        t0 = time.perf_counter()
        compiled = real_compile(*args, **kwargs)
        captured["compile_s"] = time.perf_counter() - t0
        captured["compiled"] = compiled
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
    from importlib.metadata import version

    out = {"mode": a.mode, "topology": a.topology, "layers": a.layers if a.mode == "parts" else None,
           "argv": argv[1:], "compile_s": captured["compile_s"], "wall_s": wall, "memory": memory,
           "cost": {k: cost.get(k) for k in ("flops", "bytes accessed", "optimal_seconds", "transcendentals")},
           "versions": {"maxtext": version("maxtext"), "jax": jax.__version__, "libtpu": version("libtpu"),
                        "libtpu_init_args": os.environ.get("LIBTPU_INIT_ARGS", "")},
           "custom_calls": _custom_calls(text)}
    with open(a.json_out, "w") as f:
        json.dump(out, f, indent=2)
    return 0


def _custom_calls(text: str) -> dict:
    import re

    counts: dict[str, int] = {}
    for m in re.finditer(r'custom_call_target="([^"]+)"', text):
        counts[m.group(1)] = counts.get(m.group(1), 0) + 1
    return counts


if __name__ == "__main__":
    sys.exit(main())
