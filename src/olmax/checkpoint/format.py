"""The olmax checkpoint format: one layout, one version rule, one way to find a step.

A *step directory* holds Orbax items::

    <step_dir>/params/     the parameter pytree (``ocp.args.StandardSave``; each process writes its shards)
    <step_dir>/opt_state/  the optimizer state pytree (training checkpoints only)
    <step_dir>/meta/       JSON (``ocp.args.JsonSave``): ``format_version`` and what the writer adds

Training writes ``RUN_DIR/checkpoints/<step>/`` (:class:`olmax.checkpoint.checkpointer.Checkpointer`,
meta ``step``, ``data_position``, ``seed``, ``model``, ``config``, ...); conversion and export write a
single step directory with ``params`` and ``meta`` (``model`` and ``source``;
:mod:`olmax.checkpoint.weights`). Both read the other's.

The version rule: ``format_version`` must be an integer from 1 up to :data:`FORMAT_VERSION`; a
newer one (written by a later olmax: :class:`NewerFormat`) or none at all is refused with one line
naming the step. A newer checkpoint is never taken for a corrupt one: it is left where it is.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from olmax import store
from olmax.errors import OlmaxError
from olmax.io import require_utf8_name

# Why a checkpoint's path must be UTF-8 text (olmax.io.require_utf8_name).
CHECKPOINT_LIBRARY = "the checkpoint library (TensorStore)"

FORMAT_VERSION = 1
PARAMS_ITEM = "params"
OPT_STATE_ITEM = "opt_state"
META_ITEM = "meta"
ARRAY_ITEMS = (PARAMS_ITEM, OPT_STATE_ITEM)

STEP_RE = re.compile(r"^\d+$")
TMP_RE = re.compile(r"^\d+\.orbax-checkpoint-tmp")   # an Orbax save in flight (or interrupted)


def is_step_dir(p: Path) -> bool:
    return (p / PARAMS_ITEM).is_dir() and (p / META_ITEM).is_dir()


def resolve_step_dir(path: str | os.PathLike) -> Path:
    """A step dir, a run dir (``<run>/checkpoints/``) or a ``checkpoints/`` dir -> the step dir
    (for the latter two: the highest-numbered complete step). A bucket path (``s3://``,
    ``gs://``) gives a bucket path (a str) to a committed step."""
    if store.is_bucket(str(path)):
        return _resolve_in_bucket(store.bucket_path(str(path), "checkpoint"))
    p = Path(path).absolute()   # orbax refuses relative paths
    require_utf8_name(p, "checkpoint", CHECKPOINT_LIBRARY)
    if not p.exists():
        raise OlmaxError(f"checkpoint not found: {path}")
    if not p.is_dir():
        raise OlmaxError(f"{path} is a file, not an olmax checkpoint (a step dir, a run dir or a "
                         f"checkpoints/ dir)")
    if is_step_dir(p):
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    steps = sorted((int(c.name), c) for c in root.iterdir()
                   if c.is_dir() and STEP_RE.match(c.name) and is_step_dir(c))
    if not steps:
        raise OlmaxError(f"no olmax checkpoint in {p} (expected a step dir with params/ and meta/, "
                         f"a run dir, or a checkpoints/ dir with complete steps)")
    return steps[-1][1]


def _resolve_in_bucket(url: str) -> Any:
    names = store.listdir(url)
    if not names:
        raise OlmaxError(f"checkpoint not found: {url}")
    if PARAMS_ITEM in names and META_ITEM in names:
        return url
    root = store.join(url, "checkpoints") if "checkpoints" in names else url
    steps = sorted(int(n) for n in store.listdir(root) if STEP_RE.match(n))
    for step in reversed(steps):    # committed: Orbax's commit file (olmax.checkpoint.buckets)
        if store.stat(store.join(root, str(step), "commit_success.txt")) is not None:
            return store.join(root, str(step))
    raise OlmaxError(f"no olmax checkpoint in {url} (expected a step dir with params/ and meta/, "
                     f"a run dir, or a checkpoints/ dir with committed steps)")


class NewerFormat(OlmaxError):
    """A checkpoint written in a newer format than this olmax reads (by a later olmax)."""


def check_meta(meta: Any, where: str | os.PathLike, step: int | None = None) -> dict:
    """``meta`` if it is an olmax checkpoint's meta this olmax reads (the version rule above);
    with ``step``, its ``step`` entry must agree."""
    if not isinstance(meta, dict) or "format_version" not in meta:
        raise OlmaxError(f"checkpoint {where}: meta has no format_version (not an olmax checkpoint)")
    version = meta["format_version"]
    if isinstance(version, int) and not isinstance(version, bool) and version > FORMAT_VERSION:
        raise NewerFormat(f"checkpoint {where}: format_version {version} is newer than this olmax "
                          f"reads (1..{FORMAT_VERSION}): a later olmax wrote it; run that olmax, "
                          f"or another --run-dir (the checkpoint was left as it is)")
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= FORMAT_VERSION:
        raise OlmaxError(f"checkpoint {where}: format_version {version!r} is not one this olmax "
                         f"reads (1..{FORMAT_VERSION}; a newer olmax wrote it?)")
    if step is not None and meta.get("step") != step:
        raise OlmaxError(f"checkpoint {where}: meta says step {meta.get('step')}")
    return meta


def stamp_meta(meta: dict, **fields: Any) -> dict:
    """``meta`` with the format version (and ``fields``) written in."""
    return {**meta, "format_version": FORMAT_VERSION, **fields}
