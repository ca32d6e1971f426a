"""Compile the real training step on 1 and on N devices at the same per-device batch and report,
from the compiled programs, per-device temporaries and every array that carries the global batch.

:func:`probe` runs in the process that asks (the 8 CPU devices of the mesh tier), or as a script
that prints one JSON object: ``python batch_sharding_probe.py PLATFORM MICRO IMPL...`` where
PLATFORM is ``cpu`` (8 host devices, ``XLA_FLAGS=--xla_force_host_platform_device_count=8``) or a
TPU topology name such as ``tpu7x:2x2x1`` (ahead-of-time compilation, needs libtpu); MICRO is the
micro-batch size in sequences or ``none``; ``PROBE_SEQ`` the positions per sequence.
"""

from __future__ import annotations

import json
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh

from olmax.config import ModelConfig, OptimConfig, TrainConfig
from olmax.model.olmo3 import seq_chunks
from olmax.train.optim import build_optimizer
from olmax.train.step import build_sharded_training, loss_chunk, num_micro_batches

# Every model dimension differs from the global batches used below (24 rows on 8 devices) and
# from their products with the sequence length, so a dimension equal to one of them is a batch. So
# do the rows of one loss chunk on a device (its rows x the chunk's positions; checked below): at
# 256 positions the CPU chunk on 8 devices is 3 x 8 = 24 rows, hence 320 (3 x 10 = 30).
MODEL = ModelConfig(d_model=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, mlp_hidden=160,
                    vocab_size=1000, padded_vocab_size=1024, window_pattern=(32, 32, 32, None),
                    max_seq_len=4096)
SEQ = int(os.environ.get("PROBE_SEQ", 320))
PER_DEVICE = 3
MESHES = {"fsdp": lambda n: (1, n, 1), "data_fsdp_tensor": lambda n: (2, n // 4, 2)}

_ARRAY = re.compile(r"\b(pred|s8|s16|s32|s64|u8|u16|u32|u64|f16|bf16|f32|f64)\[([0-9,]*)\]")


def arrays(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    out = set()
    for dtype, dims in _ARRAY.findall(hlo):
        out.add((dtype, tuple(int(d) for d in dims.split(",")) if dims else ()))
    return sorted(out)


def compile_step(devices, mesh_shape, per_device: int, impl: str, micro: int | None,
                 seq: int = SEQ):
    mesh = Mesh(np.asarray(devices).reshape(mesh_shape), ("data", "fsdp", "tensor"),
                axis_types=(AxisType.Auto,) * 3)
    dp = mesh_shape[0] * mesh_shape[1]
    b = per_device * dp
    # Splash's two-kernel backward: the program the 4 % of test_tpu_topology was measured on. The
    # fused kernel runs inside each device's batch shard as well (8 devices add 486 MB where 1 adds
    # 461 at 4096 positions: 5 %, where unsharded work would add 8x); that 5 % is not yet traced
    # to a buffer, and the two-kernel program keeps the 4 % bound meaningful.
    train = TrainConfig(seq_len=seq, global_batch_size=b, micro_batch_size=micro, max_steps=1,
                        attn_impl=impl, remat="none", splash_fused_bwd=False)
    st = build_sharded_training(MODEL, train, build_optimizer(OptimConfig()), mesh, jax.random.key(0))
    n_micro = num_micro_batches(train, dp)
    rows = b // (n_micro * dp)
    c = seq_chunks(jnp.zeros((1, seq)), loss_chunk(train, n_micro, mesh, st.runtime)).shape[2]
    if dp > 1 and rows * c in (b, b * seq):
        sys.exit(f"probe: a loss chunk holds {rows} x {c} rows per device, equal to the global "
                 f"batch {b}: choose another PROBE_SEQ")
    batch = {"tokens": jax.ShapeDtypeStruct((b, seq), jnp.int32, sharding=st.batch_shardings["tokens"]),
             "instance_mask": jax.ShapeDtypeStruct((b,), jnp.bool_,
                                                   sharding=st.batch_shardings["instance_mask"])}
    compiled = st.step_fn.lower(st.abstract_state, batch, jax.ShapeDtypeStruct((), jnp.float32)).compile()
    return b, compiled


def probe(devices, impls, meshes=("fsdp",), micro: int | None = None, seq: int = SEQ) -> dict:
    """Per implementation and mesh: temporaries on all devices vs on one device at the same
    per-device batch, and the arrays of the partitioned program that carry the global batch."""
    out = {}
    for impl in impls:
        _, single = compile_step(devices[:1], (1, 1, 1), PER_DEVICE, impl, micro, seq)
        for mesh_name in meshes:
            shape = MESHES[mesh_name](len(devices))
            b, many = compile_step(devices, shape, PER_DEVICE, impl, micro, seq)
            shapes = arrays(many.as_text())
            out[f"{impl}/{mesh_name}"] = {
                "global_batch": b,
                "temp_many": many.memory_analysis().temp_size_in_bytes,
                "temp_one": single.memory_analysis().temp_size_in_bytes,
                "carrying_global_batch": [[dt, list(d)] for dt, d in shapes
                                          if b in d or b * seq in d],
                "per_device_batch_seen": any(PER_DEVICE in d for _, d in shapes),
            }
    return out


def main() -> None:
    platform, micro, impls = sys.argv[1], sys.argv[2], sys.argv[3:]
    if platform == "cpu":
        devices = jax.devices()
        meshes = ("fsdp", "data_fsdp_tensor")
    else:
        from jax.experimental import topologies

        devices = topologies.get_topology_desc(platform="tpu", topology_name=platform).devices
        meshes = ("fsdp",)
    json.dump(probe(list(devices), impls, meshes, None if micro == "none" else int(micro)), sys.stdout)


if __name__ == "__main__":
    main()
