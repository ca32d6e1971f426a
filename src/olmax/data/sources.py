"""Where token files come from: one resolver for training data, held-out sets and overlap checks.

**Training data** (the run's ``data`` section) names exactly one source, ``DataConfig.source()``:

==============  =============================================================================
``paths``       token files in order (joined to ``data.root`` when relative)
``mix``         an OLMo-core mix file, or a mix *name* shipped with ai2-olmo-core
                (``OLMo-mix-0625-official``), read with ``data.root`` / ``data.remap``
``embedded``    the embedded corpus's training split (tokenized once, cached)
``mixture``     a run-time source mixture: the files of its sources (globs expanded); which
                instances each contributes is :func:`olmax.data.mixture.allocate`'s business
==============  =============================================================================

A new kind of source is one resolver in :data:`RESOLVERS` plus its field in ``DataConfig``.

**Held-out sets** (``eval.heldout``, ``olmax eval --heldout``, ``olmax data overlap --eval``) are
entries: ``embedded`` (the embedded corpus's held-out split), ``LABEL=PATH[,PATH...]``, an OLMo-core
mix file (``*.txt``: its ``label,path`` lines, labels kept), or a path/glob (label: the file's stem,
or its folder's name when the stem is generic, e.g. ``c4_en/val/part-0-00000.npy`` -> ``c4_en``).

Paths, roots and globs may be ``s3://``, ``gs://`` or ``http(s)://`` URLs (read in place,
:mod:`olmax.data.remote`). Globs are expanded in one place, :func:`expand_globs` (sorted; a pattern
matching nothing is an error naming it).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import random
from pathlib import Path
from typing import Callable, NamedTuple, Sequence

from olmax.config import DataConfig, DataSource
from olmax.errors import ConfigError, OlmaxError
from olmax.data.embedded import embedded_token_files
from olmax.data.manifests import directory_hint
from olmax.data.mixfile import read_mix_file
from olmax.data.remote import is_pattern, is_remote, join, remote_files
from olmax.transport import check_location

class TokenFiles(NamedTuple):
    """A data section's token files, in order, and their labels (a mix's or a mixture's source
    names; None for plain paths and the embedded corpus)."""

    paths: list[str]
    labels: list[str] | None


def expand_globs(patterns: Sequence[str], where: str) -> list[str]:
    """Each pattern's matches, sorted (a plain path is kept as given); a pattern that matches no
    file is an OlmaxError starting with ``where``."""
    out: list[str] = []
    for pattern in patterns:
        if is_pattern(pattern):
            matches = remote_files().glob(pattern) if is_remote(pattern) else sorted(glob.glob(pattern))
            if not matches:
                raise OlmaxError(f"{where}: {pattern!r} matches no file")
            out.extend(matches)
        else:
            out.append(pattern)
    return out


# ----------------------------------------------------------------------------------------------
# Training data


def _paths(cfg: DataConfig) -> TokenFiles:
    check_location(cfg.root, "data.root")
    for p in cfg.paths:
        check_location(p, "data.paths")
    return TokenFiles([join(cfg.root, p) for p in cfg.paths], None)


def _mix(cfg: DataConfig) -> TokenFiles:
    check_location(cfg.root, "data.root")
    check_location(cfg.mix, "data.mix")
    entries = read_mix_file(resolve_mix(cfg.mix), root=cfg.root, tokenizer=cfg.mix_tokenizer,
                            remap=cfg.remap)
    return TokenFiles([e.path for e in entries], [e.label for e in entries])


def _embedded(cfg: DataConfig) -> TokenFiles:
    return TokenFiles(embedded_token_files("train", cfg.cache_dir), None)


def _mixture(cfg: DataConfig) -> TokenFiles:
    pairs = [(p, s.name) for s in cfg.mixture.sources
             for p in expand_globs(s.paths, f"data.mixture source {s.name!r}")]
    return TokenFiles([p for p, _ in pairs], [name for _, name in pairs])


RESOLVERS: dict[DataSource, Callable[[DataConfig], TokenFiles]] = {
    "paths": _paths, "mix": _mix, "embedded": _embedded, "mixture": _mixture,
}


def resolve_paths(cfg: DataConfig) -> TokenFiles:
    """The training token files of a data section, in order, with labels for a mix file or a
    mixture (else None). For a mixture these are all the files its sources may draw from. With
    ``data.source_permutation_seed``, in OLMo-core's permuted order (:func:`permute_sources`)."""
    files = RESOLVERS[cfg.source()](cfg)
    if cfg.source_permutation_seed is None:
        return files
    return TokenFiles(*permute_sources(files.paths, files.labels, cfg.source_permutation_seed))


def permute_sources(paths: Sequence[str], labels: Sequence[str] | None,
                    seed: int) -> tuple[list[str], list[str] | None]:
    """OLMo-core's ``source_permutation_seed``: ``random.Random(seed).shuffle`` of the file order."""
    order = list(range(len(paths)))
    random.Random(seed).shuffle(order)
    return [paths[i] for i in order], None if labels is None else [labels[i] for i in order]


def resolve_mix(mix: str) -> str:
    """A mix file path as given, or an OLMo-core mix *name* (``OLMo-mix-0625-official``) resolved
    to the mix file shipped with ai2-olmo-core (``olmo_core/data/mixes/<name>.txt``) when that
    package is installed (located without importing it)."""
    if Path(mix).exists() or "/" in mix or mix.endswith(".txt"):
        return mix
    spec = importlib.util.find_spec("olmo_core")
    for root in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(root) / "data" / "mixes" / f"{mix}.txt"
        if candidate.is_file():
            return str(candidate)
    raise ConfigError(f"data.mix '{mix}' is neither a file nor an OLMo-core mix name found in an "
                      "installed ai2-olmo-core; pass data.mix=PATH to the mix file")


def data_config_for(entries: Sequence[str], root: str | None = None) -> DataConfig:
    """A data section for command-line training entries: ``embedded``, one mix (a ``.txt`` file or
    a mix name), or token files."""
    if list(entries) == ["embedded"]:
        return DataConfig(embedded=True)
    if len(entries) == 1 and not is_remote(entries[0]) and (
            entries[0].endswith(".txt") or "/" not in entries[0] and not os.path.exists(entries[0])):
        return DataConfig(mix=entries[0], root=root)
    return DataConfig(paths=tuple(entries), root=root)


# ----------------------------------------------------------------------------------------------
# Held-out sets


def is_heldout_entry(entry: str) -> bool:
    """Whether a command-line evaluation entry names token files (else: an OLMES task or suite)."""
    return (entry == "embedded" or "=" in entry or entry.endswith(".txt") or is_remote(entry)
            or os.path.exists(entry) or any(c in entry for c in "*?[/"))


def token_file_exists(path: str) -> bool:
    """Whether a (local or remote) token file exists."""
    return remote_files().exists(path) if is_remote(path) else os.path.isfile(path)


def heldout_sets(entries: Sequence[str], *, cache_dir: str | None = None) -> dict[str, list[str]]:
    """Held-out entries (see the module docstring) -> {label: [token files]}; every file exists."""
    sets: dict[str, list[str]] = {}
    for entry in entries:
        entry = entry.strip()
        if not entry:
            continue
        if entry == "embedded":
            sets.setdefault("embedded-heldout", []).extend(embedded_token_files("heldout", cache_dir))
        elif "=" in entry:
            label, paths = entry.split("=", 1)
            files = expand_globs([p for p in paths.split(",") if p], "held-out pattern")
            sets.setdefault(label.strip(), []).extend(files)
        elif entry.endswith(".txt"):
            for e in read_mix_file(entry):
                sets.setdefault(e.label, []).append(e.path)
        else:
            for f in expand_globs([entry], "held-out pattern"):
                sets.setdefault(_label_of(f), []).append(f)
    for label, files in sets.items():
        for f in files:
            if not is_remote(f) and os.path.isdir(f):
                raise OlmaxError(f"held-out set '{label}': {f} is a directory, not a token file"
                                 f"{directory_hint(f)}")
            if not token_file_exists(f):
                raise OlmaxError(f"held-out set '{label}': token file not found: {f}")
    return sets


def _label_of(path: str) -> str:
    p = Path(path)
    generic = p.stem.startswith("part-") or p.stem in ("val", "validation", "test", "data")
    if generic:
        parents = [q.name for q in p.parents if q.name and q.name not in ("val", "validation", "test")]
        if parents:
            return parents[0]
    return p.stem
