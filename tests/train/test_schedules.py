"""LR schedules equal OLMo-core's ``optim/scheduler.py`` at every step that matters."""

import math

import pytest

from olmax.config import SchedulerConfig
from olmax.errors import ConfigError
from olmax.train.schedules import build_schedule
from helpers.reference import require

sched = require("olmo_core.optim.scheduler")


def _steps(t_max, warmup):
    pts = {1, 2, 3, warmup - 1, warmup, warmup + 1, t_max // 3, t_max // 2, t_max - 1, t_max,
           t_max + 1, t_max + 5}
    pts |= set(range(1, t_max + 5, max(1, t_max // 97)))
    return sorted(p for p in pts if p >= 1)


@pytest.mark.parametrize("name,oc_cls,warmup,alpha_f,t_max,min_lr", [
    ("cos_with_warmup", "CosWithWarmup", 20, 0.1, 300, 0.0),
    ("cos_with_warmup", "CosWithWarmup", 7, 0.0, 50, 1e-5),
    ("half_cos_with_warmup", "HalfCosWithWarmup", 40, 0.1, 200, 0.0),
    ("linear_with_warmup", "LinearWithWarmup", 0, 0.0, 120, 0.0),
    ("linear_with_warmup", "LinearWithWarmup", 10, 0.1, 120, 0.0),
])
def test_small_schedules_match_olmo_core(name, oc_cls, warmup, alpha_f, t_max, min_lr):
    peak = 3e-4
    ours = build_schedule(SchedulerConfig(name=name, warmup_steps=warmup, alpha_f=alpha_f,
                                          t_max=t_max, warmup_min_lr=min_lr), peak, max_steps=10**9)
    ref = getattr(sched, oc_cls)(warmup=warmup, alpha_f=alpha_f, warmup_min_lr=min_lr)
    for c in _steps(t_max, max(warmup, 2)):
        assert ours(c) == ref.get_lr(peak, c, t_max), (name, c)


def test_constant_matches_olmo_core():
    ours = build_schedule(SchedulerConfig(name="constant"), 1e-3, max_steps=10)
    ref = sched.ConstantScheduler()
    assert [ours(c) for c in range(1, 20)] == [ref.get_lr(1e-3, c, 10) for c in range(1, 20)]


def test_olmo3_stage1_part1_part2_and_stage2_schedules():
    """The official OLMo 3 7B schedules (reference §2.1, §2.3) at the published checkpoints."""
    from olmax.train.recipes import load_recipe

    s1 = load_recipe("olmo3_7b_stage1")
    s1b = load_recipe("olmo3_7b_stage1_part2")
    s2 = load_recipe("olmo3_7b_stage2")
    f1 = build_schedule(s1.scheduler, s1.optim.lr, s1.train.max_steps)
    f1b = build_schedule(s1b.scheduler, s1b.optim.lr, s1b.train.max_steps)
    f2 = build_schedule(s2.scheduler, s2.optim.lr, s2.train.max_steps)
    t1 = math.ceil(5e12 / 4194304)
    t1b = math.ceil(7e12 / 4194304)
    t2 = math.ceil(1e11 / 2**21)
    assert (t1, t1b, t2) == (1192093, 1668931, 47684)
    r1 = sched.CosWithWarmup(warmup=2000, alpha_f=0.1)
    r1b = sched.HalfCosWithWarmup(warmup=1192092 // 2 + 2000 // 2, alpha_f=0.1)
    r2 = sched.LinearWithWarmup(warmup=0, alpha_f=0.0)
    for c in [1, 2, 1000, 1999, 2000, 2001, 100_000, 596_047, 596_048, 597_045, 597_046, 597_047,
              1_000_000, 1_192_093, 1_413_814, 1_668_930, 1_668_931]:
        assert f1(c) == r1.get_lr(3e-4, c, t1)
        assert f1b(c) == r1b.get_lr(3e-4, c, t1b)
    for c in [1, 2, 100, 23_842, 47_683, 47_684]:
        assert f2(c) == r2.get_lr(0.00020712352850360292, c, t2)
    assert f1(1) == pytest.approx(1.5e-7)
    assert f1(597_046) == pytest.approx(1.65e-4, rel=1e-3)
    assert f1b(597_046) == pytest.approx(1.65e-4, rel=1e-3)
    # part 2 takes over after step 596,047 (tests/train/test_part2_start.py): its linear ramp starts
    # 0.38 % below part 1's last LR and reaches the cosine's midpoint, 1.65e-4, at step 597,046
    assert f1b(596_048) / f1(596_047) - 1 == pytest.approx(-3.822e-3, abs=1e-6)
    assert f1b(1_413_814) == pytest.approx(3.93e-5, rel=2e-3)
    assert f2(47_684) == 0.0


def test_bad_schedule_is_a_config_error():
    with pytest.raises(ConfigError, match="scheduler.name"):
        build_schedule(SchedulerConfig(name="cosine"), 1e-3, 10)
    with pytest.raises(ConfigError, match="warmup_steps"):
        build_schedule(SchedulerConfig(name="cos_with_warmup", warmup_steps=-1), 1e-3, 10)
    # a warmup longer than the run is fine, as in OLMo-core (the run ends inside the warmup)
    short = build_schedule(SchedulerConfig(name="cos_with_warmup", warmup_steps=10), 1e-3, 5)
    assert [short(c) for c in (1, 5)] == [sched.CosWithWarmup(warmup=10).get_lr(1e-3, c, 5)
                                          for c in (1, 5)]


def test_olmo3_32b_stage1_schedule():
    """AI2's 32B stage 1: CosWithWarmup(warmup_steps=2000) over Duration.epochs(1), whose steps
    OLMo-core's loader counts as instances // (global batch tokens // sequence length). The epoch's
    size depends on the data: an epoch of 733,184,700 instances here (716,000 batches of 1024, the
    last 700 instances dropped; longer than the 679,000 steps AI2's CSV lists), stopped at step
    656,000, where AI2's stage 2 took the run's checkpoint."""
    from olmax.train.recipes import load_recipe

    c = load_recipe("olmo3_32b_stage1")
    instances = 733_184_700
    batches = instances // (8 * 1024 * 1024 // 8192)
    assert batches == 716_000
    train = c.train.resolved(batches_per_epoch=batches)
    assert (train.max_steps, train.last_step) == (716_000, 656_000)
    ours = build_schedule(c.scheduler, c.optim.lr, train.max_steps)
    ref = sched.CosWithWarmup(warmup=2000, alpha_f=0.1)
    for s in (1, 2, 1999, 2000, 2001, 100_000, 655_999, 656_000, 715_999, 716_000, 716_001):
        assert ours(s) == ref.get_lr(6e-4, s, 716_000), s
    assert ours(1) == pytest.approx(3e-7) and ours(716_000) == pytest.approx(6e-5)


def test_olmo3_32b_stage2_and_stage3_schedules():
    """AI2's 32B mid-training and long-context schedules: OLMo-core's LinearWithWarmup over the
    step count its trainer derives from Duration.tokens(100e9) (ceil(tokens / batch tokens))."""
    from olmax.train.recipes import load_recipe

    peak = 0.0002071235285
    for name, batch_tokens, warmup in (("olmo3_32b_stage2_ingredient1", 512 * 8192, 0),
                                       ("olmo3_32b_stage2_ingredient2", 512 * 8192, 0),
                                       ("olmo3_32b_stage3", 128 * 65536, 200)):
        c = load_recipe(name)
        assert c.train.global_batch_size * c.train.seq_len == batch_tokens
        t_max = math.ceil(100_000_000_000 / batch_tokens)
        train = c.train.resolved(batches_per_epoch=1)    # a length in tokens reads no epoch
        assert c.optim.lr == peak and train.max_steps == train.last_step == t_max
        ours = build_schedule(c.scheduler, c.optim.lr, train.max_steps)
        ref = sched.LinearWithWarmup(warmup=warmup, alpha_f=0.0)
        for s in (1, 2, 199, 200, 201, 1000, t_max // 2, t_max - 1, t_max):
            assert ours(s) == ref.get_lr(peak, s, t_max), (name, s)
        assert ours(t_max) == 0.0
    assert math.ceil(1e11 / (512 * 8192)) == 23842 and math.ceil(1e11 / (128 * 65536)) == 11921
