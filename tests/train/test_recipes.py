"""The packaged OLMo 3 recipes carry the official scripts' numbers (reference olmo3.md §2)."""

import math

from helpers.reference import require

require("olmo_core")  # the official recipes name OLMo-core's mix files

from olmax.model.params import count_params  # noqa: E402 - after the reference check
from olmax.train.recipes import load_recipe, packaged_recipes  # noqa: E402


def test_all_packaged_recipes_load():
    assert {"olmo3_7b_stage1", "olmo3_7b_stage1_part2", "olmo3_7b_stage2", "olmo3_tiny",
            "olmo3_32b_stage1", "olmo3_32b_stage2_ingredient1", "olmo3_32b_stage2_ingredient2",
            "olmo3_32b_stage3"} <= set(packaged_recipes())
    for name in packaged_recipes():
        load_recipe(name)


def _common_optimizer(cfg):
    o = cfg.optim
    assert (o.name, o.betas, o.eps, o.weight_decay, o.no_decay) == (
        "skip_step_adamw", (0.9, 0.95), 1e-8, 0.1, ("embed",))
    assert (o.max_grad_norm, o.rolling_interval_length, o.sigma_factor) == (1.0, 128, 6.0)
    assert cfg.train.z_loss_multiplier == 1e-5
    assert cfg.train.compute_dtype == "bfloat16" and count_params(cfg.model) > 7.2e9


def test_stage1():
    for name in ("olmo3_7b_stage1", "olmo3_7b_stage1_part2"):
        c = load_recipe(name)
        _common_optimizer(c)
        assert (c.train.seq_len, c.train.global_batch_size) == (8192, 512)
        # AI2's 2 sequences per GPU per micro-step wherever the per-device batch allows it
        assert (c.train.micro_batch_size, c.train.micro_batch_max) == ("auto", 2)
        assert c.train.seq_len * c.train.global_batch_size == 4_194_304
        assert (c.seed, c.optim.lr, c.data.repetition_filter) == (34521, 3e-4, False)
        assert c.data.mix.endswith("OLMo-mix-0625-official.txt")
        with open(c.data.mix) as f:
            assert sum(1 for _ in f) == 1016
        assert c.checkpoint.interval == 1000 and c.eval.interval == 10_000
    p1, p2 = load_recipe("olmo3_7b_stage1"), load_recipe("olmo3_7b_stage1_part2")
    # AI2's checkpointer saved step 0 before the first update: Adam's count starts at 1
    assert (p1.optim.initial_adam_count, p1.optim.step_increment_bugfix) == (1, True)
    assert (p1.scheduler.name, p1.scheduler.warmup_steps, p1.scheduler.alpha_f) == ("cos_with_warmup", 2000, 0.1)
    # Part 1 ends on the checkpoint AI2's part 2 loads (step596047), not on the script's hard stop
    # (597,046): tests/train/test_part2_start.py holds the join to OLMo-core's schedulers.
    assert p1.scheduler.t_max == math.ceil(5e12 / 4194304) and p1.train.max_steps == 596047
    assert (p2.scheduler.name, p2.scheduler.warmup_steps) == ("half_cos_with_warmup", 1192092 // 2 + 2000 // 2)
    # part 1 starts fresh; part 2 continues part 1's run (its checkpoint, optimizer and trainer state)
    assert (p1.init.required, p2.init.required) == ("none", "resume")
    assert p2.scheduler.t_max == math.ceil(7e12 / 4194304) and p2.train.max_steps == 1_413_814


def test_stage2():
    c = load_recipe("olmo3_7b_stage2")
    _common_optimizer(c)
    assert (c.train.seq_len, c.train.global_batch_size) == (8192, 256)
    assert c.train.seq_len * c.train.global_batch_size == 2**21
    assert (c.seed, c.init.seed, c.optim.lr) == (1337, 1337, 0.00020712352850360292)
    assert (c.scheduler.name, c.scheduler.warmup_steps, c.scheduler.alpha_f) == ("linear_with_warmup", 0, 0.0)
    assert c.scheduler.t_max == c.train.max_steps == math.ceil(1e11 / 2**21) == 47684
    assert c.data.mix.endswith("OLMo-midtraining-mix-0625-100B.txt") and c.init.load_optimizer is True


def test_recipe_without_resolving_data():
    """Commands that read no data (``olmax plan``) load a recipe whose mix is only a name."""
    from olmax.train.recipes import load_recipe as load

    cfg = load("olmo3_7b_stage1", ["data.mix=No-Such-Mix"], find_mix=False)
    assert cfg.data.mix == "No-Such-Mix" and cfg.train.attn_impl == "auto"


def test_stage3():
    """AI2's long-context script, with its 50B-token length (the CSV's last stage-3 step)."""
    c = load_recipe("olmo3_7b_stage3")
    _common_optimizer(c)
    assert (c.train.seq_len, c.train.global_batch_size) == (65536, 64)
    assert c.train.seq_len * c.train.global_batch_size == 4_194_304
    y = c.model.rope_scaling
    assert (y.factor, y.beta_fast, y.beta_slow, y.original_max_position_embeddings) == (8, 32, 1, 8192)
    assert y.full_attention_only and y.attention_factor is None   # 0.1 ln 8 + 1, as OLMo-core
    assert (c.seed, c.optim.lr) == (34521, 0.00020712352850360292)
    assert (c.scheduler.name, c.scheduler.warmup_steps, c.scheduler.alpha_f) == ("linear_with_warmup", 200, 0.0)
    assert c.scheduler.t_max == c.train.max_steps == math.ceil(50e9 / 4194304) == 11921
    d = c.data
    assert d.mix.endswith("OLMo-longmino-mix-0625.txt") and d.repetition_filter is False
    assert (d.instances, d.source_group_size, d.source_permutation_seed, d.doc_lens) == ("packed", 8, 123, True)
    assert c.init.load_optimizer is True and c.init.allow_architecture_override is True
    assert c.checkpoint.interval == 1000


def _32b_model(c):
    """The OLMo 3 32B (the parameter count is OLMo-core's, tests/model/test_presets.py)."""
    assert count_params(c.model) == 32_234_279_936
    assert (c.model.n_layers, c.model.d_model, c.model.n_heads, c.model.n_kv_heads) == (64, 5120, 40, 8)


def _instance_filter(d):
    """OLMo-core's InstanceFilterConfig(repetition_max_period=13, min_period=1, max_count=32)."""
    assert d.repetition_filter is True
    assert (d.repetition_max_period, d.repetition_min_period, d.repetition_max_count) == (13, 1, 32)


def test_32b_stage1():
    """AI2's 32B pre-training script: one epoch of OLMo-mix-0925-official (the instance filter on),
    stopped at step 656,000, the checkpoint both mid-training scripts load."""
    c = load_recipe("olmo3_32b_stage1")
    _common_optimizer(c)
    assert (c.optim.initial_adam_count, c.optim.step_increment_bugfix) == (1, True)
    _32b_model(c)
    assert (c.train.seq_len, c.train.global_batch_size) == (8192, 1024)
    assert c.train.seq_len * c.train.global_batch_size == 8 * 1024 * 1024
    assert (c.train.micro_batch_size, c.train.micro_batch_max) == ("auto", 1)
    assert (c.seed, c.init.seed, c.optim.lr) == (34521, 12536, 6e-4)
    assert (c.scheduler.name, c.scheduler.warmup_steps, c.scheduler.alpha_f) == ("cos_with_warmup", 2000, 0.1)
    assert (c.train.max_steps, c.train.max_epochs, c.scheduler.t_max) == (None, 1, None)
    assert c.train.hard_stop == 656_000 and 656_000 * 2**23 == 5_502_926_848_000   # README: 5.50 T
    assert c.data.mix.endswith("OLMo-mix-0925-official.txt") and c.data.max_target_seq_len == 8192
    _instance_filter(c.data)
    assert c.checkpoint.interval == 1000 and c.eval.interval == 1000 and c.eval.tasks == ("fast",)
    assert c.init.checkpoint is None and c.init.required == "none"


def test_32b_stage2_ingredients():
    """AI2's two 32B mid-training scripts: the same run on two mixes, from stage 1's step 656,000."""
    for i in (1, 2):
        c = load_recipe(f"olmo3_32b_stage2_ingredient{i}")
        _common_optimizer(c)
        _32b_model(c)
        assert (c.train.seq_len, c.train.global_batch_size) == (8192, 512)
        assert c.train.seq_len * c.train.global_batch_size == 4 * 1024 * 1024
        assert (c.seed, c.optim.lr) == (42069, 0.0002071235285)
        assert (c.scheduler.name, c.scheduler.warmup_steps, c.scheduler.alpha_f) == ("linear_with_warmup", 0, 0.0)
        # Duration.tokens(100e9): ceil(1e11 / 2^22) steps, the horizon and the end
        assert (c.scheduler.t_max, c.train.max_steps, c.train.max_tokens) == (None, None, 100_000_000_000)
        assert c.train.steps_for(batches_per_epoch=1) == math.ceil(1e11 / 2**22) == 23842
        assert c.data.mix.endswith(f"OLMo-midtraining-mix-0925-ingredient{i}-100B.txt")
        assert c.data.max_target_seq_len == 8192
        _instance_filter(c.data)
        assert c.init.load_optimizer is True and not c.init.load_trainer_state
        assert c.model.rope_scaling is None and c.checkpoint.interval == 1000 and c.eval.interval is None


def test_32b_stage3():
    """AI2's 32B long-context script: 100B tokens of packed longmino at 65,536, YaRN 8, CP 8."""
    c = load_recipe("olmo3_32b_stage3")
    _common_optimizer(c)
    _32b_model(c)
    assert (c.train.seq_len, c.train.global_batch_size) == (65536, 128)
    assert c.train.seq_len * c.train.global_batch_size == 8 * 1024 * 1024
    y = c.model.rope_scaling
    assert (y.factor, y.beta_fast, y.beta_slow, y.original_max_position_embeddings) == (8, 32, 1, 8192)
    assert y.full_attention_only and y.attention_factor is None
    assert (c.seed, c.optim.lr) == (34521, 0.0002071235285)
    assert (c.scheduler.name, c.scheduler.warmup_steps, c.scheduler.alpha_f) == ("linear_with_warmup", 200, 0.0)
    assert (c.scheduler.t_max, c.train.max_steps, c.train.max_tokens) == (None, None, 100_000_000_000)
    assert c.train.steps_for(batches_per_epoch=1) == math.ceil(1e11 / 2**23) == 11921
    d = c.data
    assert d.mix.endswith("OLMo-longmino-mix-0925.txt")
    assert (d.instances, d.source_group_size, d.source_permutation_seed, d.doc_lens) == ("packed", 8, 123, True)
    _instance_filter(d)
    assert (c.mesh.context, c.train.context_head_stride, c.train.float8) == (8, 4, False)
    assert c.init.load_optimizer is True and c.init.allow_architecture_override is True
    assert c.init.required == "optimizer"
