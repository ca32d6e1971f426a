"""Run-time source mixtures: allocations, proportions and instances identical to ai2-olmo-core."""

from __future__ import annotations

import numpy as np
import pytest

from helpers.datahelp import DOLMA2, EOS, PAD, VOCAB
from olmax.config import DataConfig, MixtureSourceConfig, SourceMixtureConfig
from olmax.errors import ConfigError
from olmax.data.loader import build_train_data
from olmax.data.mixture import allocate, source_proportions
from helpers.reference import require



def olmo_core():
    """The OLMo-core modules these reference tests compare with (skip when not installed)."""
    require("torch")
    return (require("olmo_core.data.source_mixture"),
            require("olmo_core.data.numpy_dataset"),
            require("olmo_core.data.data_loader"),
            require("olmo_core.data.collator"))


def oc_build(cfg: SourceMixtureConfig, seq_len, batch):
    sm = olmo_core()[0]
    oc_cfg = sm.SourceMixtureDatasetConfig(
        source_list=sm.SourceMixtureList(sources=[
            sm.SourceMixtureConfig(source_name=s.name, target_ratio=s.target_ratio, paths=list(s.paths),
                                   max_repetition_ratio=s.max_repetition_ratio,
                                   max_source_fraction=s.max_source_fraction)
            for s in cfg.sources]),
        requested_tokens=cfg.requested_tokens, global_batch_size=batch * seq_len, seed=cfg.seed,
        render_tables=False, quiet=True)
    return oc_cfg.build(npdtype=np.uint32, sequence_length=seq_len)


def random_sources(make_files, rng, n_sources):
    sources = []
    ratios = rng.dirichlet(np.ones(n_sources))
    ratios = np.round(ratios / ratios.sum(), 6)
    ratios[-1] = 1.0 - ratios[:-1].sum()
    for s in range(n_sources):
        sizes = rng.integers(50, 3000, int(rng.integers(1, 4))).tolist()
        renamed = make_files(sizes, seed=int(rng.integers(1 << 30)), prefix=f"src{s}")
        sources.append(MixtureSourceConfig(
            name=f"src{s}", target_ratio=float(ratios[s]), paths=tuple(renamed),
            max_repetition_ratio=float(rng.choice([1.0, 2.0, 3.5])),
            max_source_fraction=float(rng.choice([1.0, 0.8]))))
    return sources


@pytest.mark.reference
@pytest.mark.parametrize("seed", range(16))
def test_allocation_and_proportions_match(make_files, seed):
    rng = np.random.default_rng(seed)
    seq_len, batch = int(rng.choice([16, 32, 64])), int(rng.integers(1, 6))
    sources = random_sources(make_files, rng, int(rng.integers(1, 4)))
    population = sum(np.fromfile(p, dtype="<u4").size for s in sources for p in s.paths)
    cfg = SourceMixtureConfig(sources=tuple(sources), seed=seed,
                              requested_tokens=int(population * rng.uniform(0.2, 0.9)))
    try:
        ref = oc_build(cfg, seq_len, batch)
    except Exception as e:  # OLMo-core rejects it: we must too
        with pytest.raises(ConfigError):
            allocate(cfg, seq_len=seq_len, global_batch_size=batch, dtype=np.dtype("<u4"))
        assert "Insufficient tokens" in str(e)
        return  # both reject it
    ours = allocate(cfg, seq_len=seq_len, global_batch_size=batch, dtype=np.dtype("<u4"))
    assert [(e.path, e.tokens) for e in ours] == [(p, t) for (p, _), t in ref.to_index().items()]
    oc_props = {o.name: sum(p.tokens for p in o.path_tokens) for o in ref.sources}
    total = sum(oc_props.values())
    assert source_proportions(ours) == pytest.approx({k: v / total for k, v in oc_props.items()}, abs=0)


@pytest.mark.reference
def test_upsampled_mixture_instances_and_order_match(make_files, tmp_path, monkeypatch):
    """A mixture that repeats one source (take ratio > 1): same instances, same epoch order."""
    _, numpy_dataset, data_loader, collator_mod = olmo_core()
    monkeypatch.setenv("OLMO_DATA_PREP_WORKERS", "1")
    a = make_files([900, 700], seed=1, prefix="web", high=EOS)
    b = make_files([400], seed=2, prefix="code", high=EOS)
    for p in a + b:  # OLMo-core's mixture prep samples documents: end one every 50 tokens
        tokens = np.fromfile(p, dtype="<u4")
        tokens[49::50] = EOS
        tokens.tofile(p)
    cfg = SourceMixtureConfig(requested_tokens=2400, seed=7, sources=(
        MixtureSourceConfig("web", 0.6, tuple(a)),
        MixtureSourceConfig("code", 0.4, tuple(b), max_repetition_ratio=3.0)))
    seq_len, batch = 32, 4
    mixture = oc_build(cfg, seq_len, batch)
    paths = mixture.to_paths()
    assert paths.count(b[0]) == 3  # repeated source
    ds = numpy_dataset.NumpyFSLDatasetMixture(
        *paths, path_offset_index=mixture.to_index(), seed=7, sequence_length=seq_len, pad_token_id=PAD,
        eos_token_id=EOS, vocab_size=VOCAB, dtype=np.uint32)
    ds.work_dir = tmp_path / "work"
    ds.prepare()
    loader = data_loader.NumpyFSLDataLoader(ds, collator=collator_mod.DataCollator(pad_token_id=PAD),
                                            global_batch_size=batch * seq_len, work_dir=tmp_path / "work",
                                            seed=11, shuffle=True)
    loader.reshuffle(epoch=1, in_memory=True)
    td = build_train_data(DataConfig(mixture=cfg), seq_len=seq_len, global_batch_size=batch, seed=11)
    assert td.num_instances == len(ds) and td.labels.count("code") == 3
    assert td.fingerprint["olmo_core_sha256"] == ds.fingerprint
    for i, ref in enumerate(loader):
        got = td.global_batch(i)
        np.testing.assert_array_equal(got["instance_ids"], ref["index"].numpy())
        np.testing.assert_array_equal(got["tokens"], ref["input_ids"].numpy())
    assert i + 1 == td.batches_per_epoch


def test_mixture_validation(make_files):
    paths = tuple(make_files([100], seed=0))
    # ratios and counts are checked when the config is built, token counts when it is allocated
    bad = [
        lambda: SourceMixtureConfig(requested_tokens=50, sources=(MixtureSourceConfig("x", 0.5, paths),)),
        lambda: SourceMixtureConfig(requested_tokens=0, sources=(MixtureSourceConfig("x", 1.0, paths),)),
        lambda: SourceMixtureConfig(requested_tokens=500, sources=(MixtureSourceConfig("x", 1.0, paths),)),
        lambda: SourceMixtureConfig(requested_tokens=50, sources=(MixtureSourceConfig("x", 1.0, paths, 0.5),)),
    ]
    for make in bad:
        with pytest.raises(ConfigError):
            allocate(make(), seq_len=8, global_batch_size=1, dtype=np.dtype("<u4"))
    ok = allocate(SourceMixtureConfig(requested_tokens=64, sources=bad[2]().sources), seq_len=8,
                  global_batch_size=2, dtype=np.dtype("<u4"))
    assert sum(e.tokens for e in ok) == 64
    assert DOLMA2["vocab_size"] == VOCAB


def test_resolve_paths_lists_mixture_files(make_files):
    from olmax.data.sources import resolve_paths

    a, b = make_files([100], prefix="a"), make_files([100, 50], prefix="b")
    cfg = DataConfig(mixture=SourceMixtureConfig(requested_tokens=64, sources=(
        MixtureSourceConfig("a", 0.5, tuple(a)), MixtureSourceConfig("b", 0.5, (b[0].replace("000", "*"),)))))
    assert resolve_paths(cfg) == (a + b, ["a", "b", "b"])
    with pytest.raises(ConfigError, match="exactly one"):
        build_train_data(DataConfig(paths=tuple(a), mixture=cfg.mixture), seq_len=8, global_batch_size=1, seed=0)
