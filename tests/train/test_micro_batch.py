"""``train.micro_batch_size``: a number that must divide the per-device batch, or ``auto``: the
largest divisor of the per-device batch up to ``train.micro_batch_max`` -- what the 7B recipes
use, so that they run on every device count that divides their batch (512 devices: one sequence
per device) and keep AI2's 2 wherever it divides."""

from __future__ import annotations

import math

import jax
import pytest

from olmax.config import TrainConfig
from olmax.errors import ConfigError
from olmax.launch.job import Job, check_job
from olmax.parallel.mesh import make_mesh
from olmax.train.optim import build_optimizer
from olmax.train.recipes import load_recipe
from olmax.train.step import build_sharded_training, micro_batch_size, num_micro_batches


def auto(batch: int, cap: int | None) -> TrainConfig:
    return TrainConfig(global_batch_size=batch, micro_batch_size="auto", micro_batch_max=cap)


@pytest.mark.parametrize("batch, dp, cap, expected", [
    (512, 16, 2, 2), (512, 128, 2, 2), (512, 256, 2, 2), (512, 512, 2, 1),   # the recipes
    (48, 8, 4, 3), (48, 8, 2, 2), (24, 8, 2, 1), (35, 5, 6, 1), (48, 4, None, 12), (64, 8, 100, 8),
])
def test_auto_is_the_largest_divisor_up_to_the_cap(batch, dp, cap, expected):
    per_device = batch // dp
    assert micro_batch_size(auto(batch, cap), dp) == expected
    assert num_micro_batches(auto(batch, cap), dp) == per_device // expected
    # ... which is the brute-force answer
    assert expected == max(d for d in range(1, per_device + 1)
                           if per_device % d == 0 and (cap is None or d <= cap))


def test_a_number_is_kept_or_refused():
    assert micro_batch_size(TrainConfig(global_batch_size=512, micro_batch_size=2), 16) == 2
    assert micro_batch_size(TrainConfig(global_batch_size=512), 16) == 32
    with pytest.raises(ConfigError, match=r"^train.micro_batch_size \(2\) must divide the per-device "
                       r"batch \(1 = 512 / 512\); train.micro_batch_size=auto "
                       r"train.micro_batch_max=2 takes the largest divisor up to 2$"):
        micro_batch_size(TrainConfig(global_batch_size=512, micro_batch_size=2), 512)


def test_nothing_divides_a_batch_the_devices_do_not_divide():
    with pytest.raises(ConfigError, match=r"^train.global_batch_size \(512\) must be divisible by "
                       r"the data-parallel size \(384 = mesh data x fsdp\)$"):
        micro_batch_size(auto(512, 2), 384)


def test_micro_batch_max_bounds_auto_only():
    """A number given over a recipe's auto (``train.micro_batch_size=1``) is taken as it is."""
    number = TrainConfig(global_batch_size=512, micro_batch_size=1, micro_batch_max=2)
    assert micro_batch_size(number, 16) == 1
    with pytest.raises(ConfigError, match="train.micro_batch_max must be positive"):
        auto(512, 0)
    with pytest.raises(ConfigError, match="micro_batch_size"):
        load_recipe("olmo3_tiny", ["train.micro_batch_size=most"])


def test_auto_where_the_old_value_divides_is_the_same_program():
    """Existing runs keep their losses bit for bit: the step auto builds where 2 divides is the
    program micro_batch_size=2 builds (olmo3_tiny, 8 sequences on one device: 4 micro-batches)."""
    texts = []
    for overrides in (["train.micro_batch_size=2"],
                      ["train.micro_batch_size=auto", "train.micro_batch_max=2"]):
        cfg = load_recipe("olmo3_tiny", overrides)
        mesh = make_mesh(cfg.mesh, jax.devices()[:1])
        st = build_sharded_training(cfg.model, cfg.train, build_optimizer(cfg.optim), mesh,
                                    jax.random.key(0))
        assert st.n_micro == 4
        b, t = cfg.train.global_batch_size, cfg.train.seq_len
        batch = {"tokens": jax.ShapeDtypeStruct((b, t), "int32", sharding=st.batch_shardings["tokens"]),
                 "instance_mask": jax.ShapeDtypeStruct((b,), "bool",
                                                       sharding=st.batch_shardings["instance_mask"])}
        lowered = st.step_fn.lower(st.abstract_state, batch, jax.ShapeDtypeStruct((), "float32"))
        texts.append(lowered.as_text())
    assert texts[0] == texts[1]


@pytest.mark.parametrize("recipe", ["olmo3_7b_stage1", "olmo3_7b_stage1_part2", "olmo3_7b_stage2"])
def test_packaged_recipes_launch_on_every_device_count_dividing_the_batch(recipe):
    """``olmax launch``'s check: one TPU slice of 4 devices per host, from 8 devices up to one
    sequence per device (256 or 512), FSDP over all of them."""
    batch = load_recipe(recipe).train.global_batch_size
    for devices in (8, 16, 32, 64, 128, 256, 512):
        if batch % devices:
            continue
        # the device counts alone: the start stage 2 declares (init.required) is not the point
        job = Job(recipe=recipe, overrides=("init.required=none",), run_dir="/runs/r", nodes=devices // 4,
                  devices_per_node=4, name="olmax-r", platform="tpu")
        fit = check_job(job)
        per_device = batch // devices
        assert fit.cfg.train.micro_batch_size == "auto"
        assert fit.micro_batches == per_device // min(2, per_device), devices
        assert fit.mesh[:2] == (1, devices) and math.prod(fit.mesh) == devices   # FSDP over all
