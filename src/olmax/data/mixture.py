"""Run-time source mixtures with OLMo-core ``SourceMixtureDatasetConfig`` semantics.

(``data/source_mixture.py`` and ``NumpyFSLDatasetMixture`` in ``data/numpy_dataset.py``.) OLMo 3's
stages 1 and 2 used realised file lists instead; this is for users who mix at run time.

Allocation, per source in config order:

1. ``population`` = tokens in its files; ``needed = int(requested_tokens * target_ratio)``;
   ``int(population * max_source_fraction * max_repetition_ratio) < needed`` is an error.
2. ``take = needed / population``, cut into chunks of at most 1.0 (``remaining -= chunk`` until
   ``remaining <= 0``); for each chunk, each file in order becomes one entry asking for
   ``ceil(file_tokens * chunk)`` tokens, capped at ``file_tokens`` (so a source with take > 1 lists
   its files again: repetition).
3. Over all entries: ``requested_instances = ceil(requested_tokens / batch_tokens) * B``. Each entry
   first gets ``min(tokens // L, file_tokens // L)`` instances; the shortfall is spread evenly over
   entries with spare capacity (``divmod``), then one more each to the largest fractional remainders
   (Hamilton's method; ties broken by the larger entry index, as OLMo-core's reverse tuple sort does).

Entry k then contributes the *first* ``n_k`` instances of its file (``NumpyFSLDatasetMixture``
chunks each file from its start, as ``NumpyFSLDataset`` does), and the usual epoch shuffle applies.
OLMo-core's mixture ``seed`` only samples per-document instance indices that its FSL mixture
dataset never reads (its ``_read_chunk_from_array`` override is commented out in 3.0.0), so it
does not change the data; it is kept for configuration compatibility.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from olmax.config import SourceMixtureConfig
from olmax.errors import ConfigError
from olmax.data.sources import expand_globs
from olmax.data.token_files import file_num_tokens, prefetch_sizes


@dataclass(frozen=True)
class MixtureEntry:
    source: str
    path: str
    tokens: int        # allocated tokens, a multiple of seq_len
    file_tokens: int


def allocate(cfg: SourceMixtureConfig, *, seq_len: int, global_batch_size: int,
             dtype: np.dtype) -> list[MixtureEntry]:
    """Per-entry token allocation, identical to ``SourceMixtureDatasetConfig.build``.

    ``global_batch_size`` counts sequences (OLMo-core's counts tokens: ``B * seq_len``). The
    config checked its ratios when it was built; here each source's token count is checked.
    """
    # (source, path, asked tokens, file tokens) in OLMo-core's order.
    asked: list[tuple[str, str, int, int]] = []
    for src in cfg.sources:
        paths = expand_globs(src.paths, f"data.mixture source {src.name!r}")
        prefetch_sizes(paths)
        counts = [file_num_tokens(p, dtype) for p in paths]
        population = sum(counts)
        needed = int(cfg.requested_tokens * src.target_ratio)
        cap = int((population * src.max_source_fraction) * src.max_repetition_ratio)
        if cap < needed:
            raise ConfigError(f"data.mixture source {src.name!r}: not enough tokens for target ratio "
                              f"{src.target_ratio}: at most {cap} < {needed} needed")
        take = needed / population
        chunks = [take]
        if take > 1:
            chunks, remaining = [], take
            while remaining > 0:
                chunk = min(1.0, remaining)
                chunks.append(chunk)
                remaining -= chunk
        for chunk in chunks:
            for p, n in zip(paths, counts):
                asked.append((src.name, p, int(math.ceil(n * chunk)), n))

    L = seq_len
    steps = math.ceil(cfg.requested_tokens / (global_batch_size * L))
    requested_instances = steps * global_batch_size
    capacity = [n // L for _, _, _, n in asked]
    instances = [min(t // L, c) for (_, _, t, _), c in zip(asked, capacity)]
    remainders = [(t % L) / L if k < c else 0.0 for (_, _, t, _), k, c in zip(asked, instances, capacity)]
    shortfall = requested_instances - sum(instances)
    if shortfall > 0:
        eligible = [i for i in range(len(asked)) if instances[i] < capacity[i]]
        if eligible:
            base, _ = divmod(shortfall, len(eligible))
            if base:
                for i in eligible:
                    instances[i] += min(base, capacity[i] - instances[i])
            shortfall = requested_instances - sum(instances)
            if shortfall > 0:
                ranked = sorted(((remainders[i], i) for i in eligible if instances[i] < capacity[i]),
                                reverse=True)
                for _, i in ranked[:shortfall]:
                    instances[i] += 1
    return [MixtureEntry(s, p, k * L, n) for (s, p, _, n), k in zip(asked, instances)]


def source_proportions(entries: list[MixtureEntry]) -> dict[str, float]:
    """Realised token fraction of each source."""
    per_source: dict[str, int] = {}
    for e in entries:
        per_source[e.source] = per_source.get(e.source, 0) + e.tokens
    total = sum(per_source.values())
    return {name: tokens / total for name, tokens in per_source.items()}
