"""Parameter checkpoints: the olmax step-directory layout, written and read with orbax.

A *step directory* holds orbax items (the layout orbax ``CheckpointManager`` writes under
``RUN_DIR/checkpoints/<step>/``)::

    <step_dir>/params/   the parameter pytree (``ocp.args.StandardSave``)
    <step_dir>/meta/     JSON (``ocp.args.JsonSave``): {"format_version": 1, "model": <ModelConfig>, ...}

Training step dirs additionally hold ``opt_state/`` and a richer ``meta``; this module reads only
``params`` and ``meta`` so it loads both kinds.

``save_params`` is for single-process writers (conversion, export); training writes through its
own orbax ``CheckpointManager``. Output directories are written atomically: a hidden temp dir next
to the target is filled and then renamed; an existing non-empty target is refused.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Mapping

import jax
import numpy as np

from olmax.config import ConfigError, ModelConfig, OlmaxError, from_dict, to_dict

FORMAT_VERSION = 1
PARAMS_ITEM = "params"
META_ITEM = "meta"


# ----------------------------------------------------------------------------------------------
# Atomic output directories


def check_output_dir(path: str | os.PathLike) -> Path:
    """Refuse an existing non-empty directory (or a file) at ``path``; return it as a Path."""
    out = Path(path)
    if out.exists():
        if not out.is_dir():
            raise OlmaxError(f"output path exists and is not a directory: {out}")
        if any(out.iterdir()):
            raise OlmaxError(f"output directory exists and is not empty: {out}")
    return out


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temp directory beside ``path``; on success rename it to ``path``.

    On any error the temp directory (and any parent directories this call created) is removed,
    so nothing half-written is left behind. An existing empty directory at ``path`` is replaced;
    a non-empty one is refused before anything is written.
    """
    out = check_output_dir(path).absolute()
    created = []
    parent = out.parent
    while not parent.exists():
        created.append(parent)
        parent = parent.parent
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        check_output_dir(out)  # still free (nobody wrote it meanwhile)
        if out.exists():
            out.rmdir()
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in created:  # innermost first
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


# ----------------------------------------------------------------------------------------------
# Saving


def _checkpointer(restore_concurrent_gb: int | None = None):
    """Composite checkpointer for the params + meta items. ``restore_concurrent_gb`` bounds the
    bytes orbax reads at once (its default, 96 GB, lets a restore briefly hold about twice the
    model); it must be at least the largest single array."""
    import orbax.checkpoint as ocp

    kw = {} if restore_concurrent_gb is None else {"restore_concurrent_gb": restore_concurrent_gb}
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler(
        **{PARAMS_ITEM: ocp.StandardCheckpointHandler(**kw),
           META_ITEM: ocp.JsonCheckpointHandler()}))


def save_params(directory: str | os.PathLike, params: Any, model_cfg: ModelConfig, *,
                extra_meta: Mapping[str, Any] | None = None) -> Path:
    """Write ``params`` (arrays in any dtype; numpy or jax) and the model config as a step dir.

    ``extra_meta`` is merged into the meta JSON (it may not override ``model`` or
    ``format_version``). Atomic; refuses an existing non-empty ``directory``.
    """
    import orbax.checkpoint as ocp

    meta = dict(extra_meta or {})
    for key in ("model", "format_version"):
        if key in meta:
            raise ValueError(f"extra_meta may not set '{key}'")
    meta.update(format_version=FORMAT_VERSION, model=to_dict(model_cfg))
    with atomic_output_dir(directory) as tmp:
        _checkpointer().save(
            tmp, args=ocp.args.Composite(**{PARAMS_ITEM: ocp.args.StandardSave(params),
                                            META_ITEM: ocp.args.JsonSave(meta)}),
            force=True)
    return Path(directory)


# ----------------------------------------------------------------------------------------------
# Locating and loading


def _is_step_dir(p: Path) -> bool:
    return (p / PARAMS_ITEM).is_dir() and (p / META_ITEM).is_dir()


def resolve_step_dir(path: str | os.PathLike) -> Path:
    """A step dir, a run dir (``<run>/checkpoints/``) or a ``checkpoints/`` dir -> the step dir
    (for the latter two: the highest-numbered complete step)."""
    p = Path(path)
    if not p.exists():
        raise OlmaxError(f"checkpoint not found: {p}")
    if _is_step_dir(p):
        return p
    root = p / "checkpoints" if (p / "checkpoints").is_dir() else p
    steps = sorted((int(c.name), c) for c in root.iterdir()
                   if c.is_dir() and re.fullmatch(r"\d+", c.name) and _is_step_dir(c))
    if not steps:
        raise OlmaxError(f"no olmax checkpoint in {p} (expected a step dir with params/ and meta/, "
                         f"a run dir, or a checkpoints/ dir with complete steps)")
    return steps[-1][1]


def load_meta(path: str | os.PathLike) -> dict:
    """The meta JSON of the step dir ``path`` resolves to (format version checked)."""
    import orbax.checkpoint as ocp

    step = resolve_step_dir(path)
    try:
        meta = _checkpointer().restore(step, args=ocp.args.Composite(
            **{META_ITEM: ocp.args.JsonRestore()}))[META_ITEM]
    except Exception as e:  # orbax raises assorted types for unreadable items
        raise OlmaxError(f"cannot read checkpoint meta in {step}: {str(e).splitlines()[0]}") from None
    if not isinstance(meta, dict) or "model" not in meta:
        raise OlmaxError(f"{step}/{META_ITEM}: not an olmax checkpoint (no 'model' entry)")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise OlmaxError(f"{step}/{META_ITEM}: unsupported format_version {version!r} "
                         f"(this olmax reads {FORMAT_VERSION})")
    return meta


def load_model_config(path: str | os.PathLike) -> ModelConfig:
    """The ModelConfig stored with a checkpoint (step dir, run dir or checkpoints dir)."""
    meta = load_meta(path)
    try:
        return from_dict(ModelConfig, meta["model"], "meta.model")
    except ConfigError as e:
        raise OlmaxError(f"{resolve_step_dir(path)}: bad model config in meta: {e}") from None


def stored_param_shapes(path: str | os.PathLike) -> dict:
    """{dotted name: (shape, dtype)} of the stored params, from orbax metadata (no array reads)."""
    step = resolve_step_dir(path)
    try:
        tree = _checkpointer().metadata(step).item_metadata[PARAMS_ITEM]
    except Exception as e:
        raise OlmaxError(f"cannot read params metadata in {step}: {str(e).splitlines()[0]}") from None
    tree = getattr(tree, "tree", tree)
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {_dotted(kp): (tuple(m.shape), np.dtype(m.dtype)) for kp, m in flat}


def _dotted(keypath) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath)


def load_params(path: str | os.PathLike, *, dtype=None, shardings: Any = None):
    """Restore ``(params, ModelConfig)`` from a step dir, a run dir or a ``checkpoints/`` dir.

    ``dtype``: cast every array on restore (None keeps the stored dtype). ``shardings``: a pytree
    of ``jax.sharding.Sharding`` matching the params (restore onto any device layout); None puts
    everything on the default device. The stored tree must match the config's parameter shapes.
    """
    import orbax.checkpoint as ocp

    from olmax.model.olmo3 import param_shapes

    step = resolve_step_dir(path)
    cfg = load_model_config(step)
    stored = stored_param_shapes(step)
    expected = {_dotted(kp): s for kp, s in jax.tree_util.tree_flatten_with_path(
        param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))[0]}
    for name in sorted(set(stored) | set(expected)):
        if name not in stored:
            raise OlmaxError(f"{step}: checkpoint has no parameter '{name}' required by its model config")
        if name not in expected:
            raise OlmaxError(f"{step}: unexpected parameter '{name}' for its model config")
        if stored[name][0] != tuple(expected[name]):
            raise OlmaxError(f"{step}: parameter '{name}' has shape {list(stored[name][0])}, "
                             f"the model config implies {list(expected[name])}")

    if shardings is None:
        default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shardings = jax.tree.map(lambda _: default, param_shapes(cfg),
                                 is_leaf=lambda x: isinstance(x, tuple))
    shapes = param_shapes(cfg)
    flat_shapes, treedef = jax.tree_util.tree_flatten_with_path(
        shapes, is_leaf=lambda x: isinstance(x, tuple))
    flat_shard = treedef.flatten_up_to(shardings)
    target = [jax.ShapeDtypeStruct(tuple(s), dtype or stored[_dotted(kp)][1], sharding=sh)
              for (kp, s), sh in zip(flat_shapes, flat_shard)]
    target = jax.tree_util.tree_unflatten(treedef, target)
    largest = max(math.prod(t.shape) * np.dtype(t.dtype).itemsize for t in jax.tree.leaves(target))
    try:
        restored = _checkpointer(max(1, math.ceil(largest / 1e9))).restore(step, args=ocp.args.Composite(
            **{PARAMS_ITEM: ocp.args.StandardRestore(target)}))[PARAMS_ITEM]
    except Exception as e:
        raise OlmaxError(f"cannot restore params from {step}: {str(e).splitlines()[0]}") from None
    return restored, cfg


__all__ = ["FORMAT_VERSION", "save_params", "load_params", "load_model_config", "load_meta",
           "resolve_step_dir", "stored_param_shapes", "atomic_output_dir", "check_output_dir"]
