"""Stage 1's join of part 1 and part 2 is AI2's, step by step.

AI2's two scripts (OLMo-core ``src/scripts/official/OLMo3/``):

- ``OLMo-3-1025-7B-pretrain-1.py``: ``CosWithWarmup(warmup_steps=2000)`` (alpha_f 0.1),
  ``max_duration=Duration.tokens(int(5e12))``, ``hard_stop=Duration.steps(597046)``.
- ``OLMo-3-1025-7B-pretrain-2.py``: ``HalfCosWithWarmup(warmup_steps=original_max_steps // 2 +
  original_warmup_steps // 2)`` with ``original_max_steps = int(5e12) // GLOBAL_BATCH_SIZE``,
  ``max_duration=Duration.tokens(int(7e12))``, ``load_path=.../OLMo25/step596047/`` with
  ``load_trainer_state=True`` and ``load_optim_state=True``.

The reference side below is OLMo-core's own code: its scheduler classes configured as the scripts
configure them, and its ``Trainer`` logic for the step counter, the tokens seen, ``max_steps`` (the
scheduler's ``t_max``, derived from ``max_duration`` at every step) and the stop. Our side is the
packaged recipes as ``olmax train`` runs them: part 1 to its ``train.max_steps`` (its final
checkpoint is saved there), then part 2 in the same run directory, resuming from that checkpoint,
each step's LR from the schedule the trainer builds from the recipe in force.
"""

import math
import re
from pathlib import Path

import pytest
from helpers.reference import require

require("olmo_core")  # the official recipes name OLMo-core's mix files

from olmo_core.optim.scheduler import CosWithWarmup, HalfCosWithWarmup  # noqa: E402
from olmo_core.train import Duration, Trainer  # noqa: E402

from olmax.train.recipes import load_recipe  # noqa: E402
from olmax.train.trainer import Trainer as OlmaxTrainer  # noqa: E402

# AI2's numbers, as the scripts write them.
GLOBAL_BATCH_SIZE = 8192 * 512
LR = 3e-4
PART1_MAX_DURATION = Duration.tokens(int(5e12))
PART1_HARD_STOP = Duration.steps(597046)
PART2_MAX_DURATION = Duration.tokens(int(7e12))
PART2_LOAD_STEP = 596047                      # load_path ".../OLMo25/step596047/"
PART2_WARMUP = int(5e12) // GLOBAL_BATCH_SIZE // 2 + 2000 // 2


def part1_scheduler():
    return CosWithWarmup(warmup=2000)


def part2_scheduler():
    return HalfCosWithWarmup(warmup=PART2_WARMUP)


class OLMoCoreTrainer:
    """The state of OLMo-core's ``Trainer`` that the LR and the stop depend on, driven by
    OLMo-core's own code: ``max_steps`` and ``_get_max_steps`` are ``Trainer``'s, the scheduler's
    ``set_lr`` reads them, and ``Duration.due`` decides the stop, as in ``Trainer._fit_epoch``
    (``global_step`` and the tokens seen advance before the batch is trained on)."""

    _get_max_steps = Trainer._get_max_steps
    max_steps = Trainer.max_steps

    def __init__(self, global_step, max_duration, hard_stop=None):
        # A trainer at a checkpoint of a constant-batch run: step and tokens from its state.
        self.global_step = global_step
        self.global_train_tokens_seen = global_step * GLOBAL_BATCH_SIZE
        self.tokens_per_batch = GLOBAL_BATCH_SIZE
        self.epoch = 1
        self.max_duration, self.hard_stop = max_duration, hard_stop

    def _due(self, duration):
        return duration.due(step=self.global_step, tokens=self.global_train_tokens_seen,
                            epoch=self.epoch)

    def fit(self, scheduler, until_step):
        """``{step: lr}`` for each step trained, until ``until_step`` or the stop."""
        group, lrs = {"lr": LR}, {}
        while self.global_step < until_step:
            self.global_step += 1
            self.global_train_tokens_seen += GLOBAL_BATCH_SIZE
            lrs[self.global_step] = scheduler.set_lr(group, self)
            if self._due(self.max_duration) or (self.hard_stop is not None
                                                 and self._due(self.hard_stop)):
                break
        return lrs


def ai2_lineage(first, last):
    """AI2's LR of every step in [first, last] of the released model's stage 1: part 1's steps up
    to the checkpoint part 2 loads, part 2's after it."""
    part1 = OLMoCoreTrainer(first - 1, PART1_MAX_DURATION, PART1_HARD_STOP)
    lrs = part1.fit(part1_scheduler(), PART2_LOAD_STEP)
    part2 = OLMoCoreTrainer(PART2_LOAD_STEP, PART2_MAX_DURATION)
    lrs.update(part2.fit(part2_scheduler(), last))
    return lrs


def olmax_run(first, last, run_dir="/nonexistent/olmo3-7b-stage1"):
    """Our LR of every step in [first, last]: part 1's recipe to its max_steps, then part 2's
    recipe from the step after part 1's last checkpoint (the trainer resumes from the newest).
    Building a trainer reads and writes nothing: its schedule is the one the run would use."""
    p1, p2 = load_recipe("olmo3_7b_stage1"), load_recipe("olmo3_7b_stage1_part2")
    f1 = OlmaxTrainer(p1, run_dir, quiet=True).schedule
    f2 = OlmaxTrainer(p2, run_dir, quiet=True).schedule
    end1 = p1.train.max_steps
    return {s: (f1(s) if s <= end1 else f2(s)) for s in range(first, last + 1)}


def test_scheduler_inputs_are_the_scripts():
    p1, p2 = load_recipe("olmo3_7b_stage1"), load_recipe("olmo3_7b_stage1_part2")
    # t_max as OLMo-core's trainer derives it: from part 1's start, and after part 2's load.
    assert OLMoCoreTrainer(0, PART1_MAX_DURATION).max_steps == p1.scheduler.t_max == 1_192_093
    assert OLMoCoreTrainer(PART2_LOAD_STEP, PART2_MAX_DURATION).max_steps == p2.scheduler.t_max
    assert p2.scheduler.t_max == math.ceil(7e12 / GLOBAL_BATCH_SIZE) == 1_668_931
    assert (p1.scheduler.warmup_steps, p1.scheduler.alpha_f) == (2000, part1_scheduler().alpha_f)
    assert (p2.scheduler.warmup_steps, p2.scheduler.alpha_f) == (PART2_WARMUP,
                                                               part2_scheduler().alpha_f)
    assert PART2_WARMUP == 597_046
    assert p1.optim.lr == p2.optim.lr == LR
    assert p1.train.global_batch_size * p1.train.seq_len == GLOBAL_BATCH_SIZE


def test_part2_starts_after_the_checkpoint_ai2_loads():
    p1, p2 = load_recipe("olmo3_7b_stage1"), load_recipe("olmo3_7b_stage1_part2")
    # Part 1 ends on the step whose checkpoint part 2 loads; part 2's first step follows it.
    assert p1.train.max_steps == PART2_LOAD_STEP
    first_part2 = OLMoCoreTrainer(PART2_LOAD_STEP, PART2_MAX_DURATION).fit(part2_scheduler(),
                                                                         PART2_LOAD_STEP + 1)
    assert list(first_part2) == [p1.train.max_steps + 1] == [596_048]
    assert p2.train.max_steps == 1_413_814          # OLMo-3-1025-7B.csv: stage1/step1413814
    # Part 1 as scripted would have run on to its hard stop: 999 steps that part 2 replaced.
    part1 = OLMoCoreTrainer(596_900, PART1_MAX_DURATION, PART1_HARD_STOP)
    assert max(part1.fit(part1_scheduler(), 10**7)) == 597_046


def test_lr_around_the_join_equals_olmo_core():
    first, last = 595_000, 598_200
    ours, ai2 = olmax_run(first, last), ai2_lineage(first, last)
    assert sorted(ours) == sorted(ai2) == list(range(first, last + 1))
    diff = [s for s in ours if ours[s] != ai2[s]]
    assert not diff, f"{len(diff)} steps differ from OLMo-core, first {diff[0]}: " \
                     f"{ours[diff[0]]!r} vs {ai2[diff[0]]!r}"


def test_lr_at_the_join_by_hand():
    """The key steps against the formulas written out (reference olmo3.md §2.1)."""
    lrs = olmax_run(596_046, 597_048)
    peak, eta_min = LR, 0.1 * LR
    mid = eta_min + (peak - eta_min) / 2                       # 1.65e-4
    t1, t2, w2 = 1_192_093, 1_668_931, 597_046

    def cosine(c):
        return eta_min + (peak - eta_min) * (1 + math.cos(math.pi * (c - 2000) / (t1 - 2000))) / 2

    def half_cosine(c):
        t = t2 - w2
        return eta_min + (peak - eta_min) * (1 + math.cos(math.pi * (c - w2 + t) / (2 * t))) / 2

    assert lrs[596_046] == pytest.approx(cosine(596_046), rel=1e-13)
    assert lrs[596_047] == pytest.approx(cosine(596_047), rel=1e-13)
    assert lrs[596_047] == pytest.approx(1.6535619272e-4, rel=1e-10)
    for c in (596_048, 596_049, 596_500, 597_000, 597_045):          # part 2's "warmup"
        assert lrs[c] == pytest.approx(mid * c / w2, rel=1e-13)
    assert lrs[596_048] == pytest.approx(1.6472419211e-4, rel=1e-10)
    assert lrs[597_046] == pytest.approx(mid, rel=1e-13) == half_cosine(597_046)
    assert lrs[597_047] == pytest.approx(half_cosine(597_047), rel=1e-13)
    assert lrs[597_047] == pytest.approx(1.6499980216e-4, rel=1e-10)


def test_part2_ramp_replaces_part1_cosine():
    """Steps 596,048..597,046: part 2 ramps up linearly from below part 1's last LR; part 1's
    cosine (had it continued to its hard stop) would have gone on falling, above it throughout."""
    first, last = PART2_LOAD_STEP + 1, 597_046
    part2 = OLMoCoreTrainer(PART2_LOAD_STEP, PART2_MAX_DURATION).fit(part2_scheduler(), last)
    part1 = OLMoCoreTrainer(PART2_LOAD_STEP - 1, PART1_MAX_DURATION, PART1_HARD_STOP).fit(
        part1_scheduler(), 10**7)
    assert min(part1) == PART2_LOAD_STEP and max(part1) == last
    ours = olmax_run(first, last)
    assert all(ours[s] == part2[s] for s in range(first, last + 1))
    assert all(part2[s] < part2[s + 1] for s in range(first, last))
    assert all(part1[s] > part1[s + 1] for s in range(PART2_LOAD_STEP, last))
    assert all(part2[s] < part1[s] for s in range(first, last + 1))
    assert part2[first] < part1[PART2_LOAD_STEP]                  # the drop at the join
    assert (part2[first] / part1[PART2_LOAD_STEP] - 1) == pytest.approx(-3.822e-3, abs=1e-6)
    assert (part2[first] / part1[first] - 1) == pytest.approx(-3.820e-3, abs=1e-6)


def test_the_guides_join_table_is_olmo_cores():
    """docs/reproduce.md ("Part 2") quotes the LR at the join: each number is OLMo-core's."""
    guide = (Path(__file__).resolve().parents[2] / "docs" / "reproduce.md").read_text()
    section = guide[guide.index("### Part 2"):guide.index("## 9. Stage 2")]
    rows = [[cell.strip() for cell in line.split("|")[1:4]]
            for line in section.splitlines() if re.match(r"\| [\d,]+ \|", line)]
    assert len(rows) >= 5

    def quoted(value):
        return f"{value:.7e}".replace("e-0", "e-")

    def lr_at(scheduler, max_duration, step):
        return OLMoCoreTrainer(step - 1, max_duration).fit(scheduler, step)[step]

    for step_text, part1, part2 in rows:
        step = int(step_text.replace(",", ""))
        if part1:
            ref = lr_at(part1_scheduler(), PART1_MAX_DURATION, step)
            assert part1.strip("()") == quoted(ref), step
        if part2:
            assert part2 == quoted(lr_at(part2_scheduler(), PART2_MAX_DURATION, step)), step
