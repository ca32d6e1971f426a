"""``olmax merge``: the average of checkpoints, weights and Adam's state, against numbers computed
by hand and against OLMo-core's ``merge_core_checkpoints.py`` (reimplemented from its code in
``helpers.olmo_core.merge_core_checkpoints``: the script lives in OLMo-core's repository,
``src/scripts/``, and is not in the ai2-olmo-core package)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from helpers.cli import refused_in_one_line
from helpers.tiny import tiny_cfg
from olmax.checkpoint.format import OPT_STATE_ITEM
from olmax.checkpoint.merge import ADAM
from olmax.checkpoint.weights import (load_meta, load_params, save_params, save_train_state,
                                      stored_array, stored_arrays)
from olmax.cli import main
from olmax.config import OptimConfig, to_dict
from olmax.interop.olmo_core.convert import olmax_opt_state
from olmax.model.params import param_shapes
from olmax.train.optim import skip_step_adamw

CFG = tiny_cfg()


def _params(cfg, seed: int) -> dict:
    """Weights of every sign in the model's shapes (numpy: no compilation)."""
    rng = np.random.default_rng(100 + seed)
    return jax.tree.map(lambda s: rng.normal(0, 0.02, s).astype(np.float32), param_shapes(cfg),
                        is_leaf=lambda x: isinstance(x, tuple))


def _state(seed: int):
    """Weights and Adam moments of one input (fp32, every sign, moments of their own)."""
    params = _params(CFG, seed)
    rng = np.random.default_rng(seed)
    mu = jax.tree.map(lambda p: rng.normal(0, 1e-3, p.shape).astype(np.float32), params)
    nu = jax.tree.map(lambda p: rng.uniform(0, 1e-6, p.shape).astype(np.float32), params)
    return params, mu, nu


def _write(path, seed: int, step: int, count: int):
    params, mu, nu = _state(seed)
    opt = olmax_opt_state(skip_step_adamw(OptimConfig()), mu, nu, count)
    meta = {"optim": to_dict(OptimConfig()), "data_position": step, "seed": seed,
            "config": {"train": {"global_batch_size": 2, "seq_len": 8}}}
    return save_train_state(path, step, params, opt, CFG, extra_meta=meta), (params, mu, nu)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    a, sa = _write(root / "a", seed=1, step=30, count=29)
    b, sb = _write(root / "b", seed=2, step=40, count=33)
    return root, a, b, sa, sb


def _merged(out):
    params, _ = load_params(out, check_finite=False)
    mu, _ = stored_arrays(out, OPT_STATE_ITEM, ADAM + "mu.")
    nu, _ = stored_arrays(out, OPT_STATE_ITEM, ADAM + "nu.")
    count = int(stored_array(out, OPT_STATE_ITEM, ADAM + "count")[()])
    read = lambda tree: jax.tree.map(lambda x: np.asarray(x[...]), tree,  # noqa: E731
                                     is_leaf=lambda x: hasattr(x, "shape"))
    return jax.tree.map(np.asarray, params), read(mu), read(nu), count


def test_two_checkpoints_average_to_the_hand_computed_mean(two, capsys):
    root, a, b, sa, sb = two
    out = root / "soup"
    assert main(["merge", str(a), str(b), "--out", str(out)]) == 0
    assert "the average of 2 checkpoints" in capsys.readouterr().out
    got = _merged(out)
    for kind, mine, x, y in zip(("params", "mu", "nu"), got[:3], sa, sb):
        for m, p, q in zip(jax.tree.leaves(mine), jax.tree.leaves(x), jax.tree.leaves(y)):
            exact = (p.astype(np.float64) + q.astype(np.float64)) / 2
            assert m.dtype == np.float32
            # halving is exact in fp32, so the fp32 sum is the exact mean rounded once: half an
            # ulp, below 6e-8 of it, everywhere
            np.testing.assert_allclose(m, exact, rtol=1e-7, atol=0, err_msg=kind)
    assert got[3] == 31                                   # (29 + 33) / 2
    meta = load_meta(out)                                 # the first input's step, data, seed
    assert (meta["step"], meta["data_position"], meta["seed"]) == (30, 30, 1)
    assert meta["merge"]["adam_count_mean"] == 31.0 and meta["merge"]["coefficients"] == [0.5, 0.5]


def test_weights_and_weights_only(two):
    root, a, b, sa, sb = two
    out = root / "weighted"
    assert main(["merge", str(b), str(a), "--out", str(out), "--weights", "3", "1"]) == 0
    params, mu, _, count = _merged(out)
    for mine, x, y in ((params, sb[0], sa[0]), (mu, sb[1], sa[1])):
        for m, p, q in zip(jax.tree.leaves(mine), jax.tree.leaves(x), jax.tree.leaves(y)):
            p64, q64 = 0.75 * p.astype(np.float64), 0.25 * q.astype(np.float64)
            # 0.75 x rounds once and the sum once: within 2^-23 of the terms' magnitudes
            assert np.all(np.abs(m - (p64 + q64)) <= 2.0**-23 * (np.abs(p64) + np.abs(q64)))
    assert count == 32                                    # 0.75 x 33 + 0.25 x 29 = 32
    assert load_meta(out)["step"] == 40
    only = root / "weights-only"
    assert main(["merge", str(a), str(b), "--out", str(only), "--weights-only"]) == 0
    assert not (only / OPT_STATE_ITEM).exists()
    params, _ = load_params(only)
    for m, p, q in zip(jax.tree.leaves(params), jax.tree.leaves(sa[0]), jax.tree.leaves(sb[0])):
        np.testing.assert_allclose(np.asarray(m), (p.astype(np.float64) + q) / 2, rtol=1e-7, atol=0)


def test_refusals_are_one_line(two, tmp_path, capsys):
    root, a, b, _, _ = two
    out = tmp_path / "out"
    deeper = tiny_cfg(n_layers=4)
    other = save_params(tmp_path / "deeper", _params(deeper, 0), deeper)
    refused_in_one_line(capsys, ["merge", str(a), str(other), "--out", str(out), "--weights-only"],
                        "are different models: model.n_layers is 4 in")
    bare = save_params(tmp_path / "bare", _params(CFG, 3), CFG)
    refused_in_one_line(capsys, ["merge", str(a), str(bare), "--out", str(out)],
                        "holds no optimizer state: merge the weights alone (--weights-only)")
    refused_in_one_line(capsys, ["merge", str(a), str(b), "--out", str(out), "--weights", "1"],
                        "--weights: 1 weights for 2 checkpoints")
    refused_in_one_line(capsys, ["merge", str(a), str(b), "--out", str(out), "--weights", "1", "0"],
                        "every weight must be a positive number (got 0.0)")
    refused_in_one_line(capsys, ["merge", str(a), "--out", str(out)],
                        "averages two or more checkpoints (got 1)")
    refused_in_one_line(capsys, ["merge", str(a), str(b), "--out", str(a)],
                        "output directory exists and is not empty")
    assert not out.exists() and not list(tmp_path.glob(".out.tmp-*"))


@pytest.mark.slow
@pytest.mark.reference
def test_olmo_core_checkpoints_merge_as_olmo_core_merges_them(two, tmp_path):
    """OLMo-core's merge (the script's ``merge_checkpoints``, step for step with the ai2-olmo-core
    functions it calls; its output read back by olmax's reader) of two OLMo-core checkpoints,
    against ``olmax merge`` of the same folders: every weight, moment and Adam ``step`` equal."""
    from helpers.olmo_core import merge_core_checkpoints
    from helpers.reference import require

    require("torch")
    require("olmo_core.distributed.checkpoint")
    from olmax.interop.olmo_core.dcp import DcpReader, Files

    _, a, b, _, _ = two
    for name, src in (("oc-a", a), ("oc-b", b)):
        assert main(["convert", "olmax-to-olmo-core", str(src), str(tmp_path / name)]) == 0
    merge_core_checkpoints([tmp_path / "oc-a", tmp_path / "oc-b"], tmp_path / "script")
    theirs = DcpReader(Files(str(tmp_path / "script" / "model_and_optim")))
    merged = {k: theirs.tensor(k) for k in theirs.meta.tensors}
    out = tmp_path / "soup"
    assert main(["merge", str(tmp_path / "oc-a"), str(tmp_path / "oc-b"), "--out", str(out)]) == 0
    back = tmp_path / "soup-oc"
    assert main(["convert", "olmax-to-olmo-core", str(out), str(back)]) == 0
    ours = DcpReader(Files(str(back / "model_and_optim")))
    tensors = [k for k in merged if k.startswith(("model.", "optim.state."))]
    assert len(tensors) == len(merged) and any(k.endswith(".exp_avg_sq") for k in tensors)
    for k in tensors:
        want = merged[k]
        got = ours.tensor(k)
        assert got.dtype == np.float32 and got.shape == want.shape, k
        # the same fp32 operations in the same order: equal bit for bit
        assert got.tobytes() == want.tobytes(), k


def test_weights_are_numbers_whose_shares_float32_holds():
    """``--weights`` as they enter: finite and positive, summed without overflow (normalised by
    the largest first where the sum would overflow), no share that float32 rounds to zero."""
    from olmax.checkpoint.merge import check_weights
    from olmax.errors import OlmaxError

    assert check_weights([1e308, 1e308], 2) == [0.5, 0.5]          # fsum overflowed: an error
    assert check_weights([1e308] * 3, 3) == pytest.approx([1 / 3] * 3, rel=1e-15)
    assert check_weights([3.0, 1.0], 2) == [0.75, 0.25]             # as before, exactly
    for weights, needle in (([1.0, float("nan")], "positive number (got nan)"),
                            ([1.0, float("inf")], "positive number (got inf)"),
                            ([1.0, -1.0], "positive number (got -1.0)"),
                            ([1.0, 1e-60], "weight 1e-60 is 1e-60 of the total, which rounds to 0 "
                                           "in float32")):
        with pytest.raises(OlmaxError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            check_weights(weights, 2)


def test_an_average_past_float32_is_refused_by_name(tmp_path, capsys):
    """Ten inputs whose embedding is at float32's largest value: ten float32(1/10) sum above 1,
    so that tensor's average (accumulated in float32, input by input) leaves float32's range;
    refused naming it, nothing written. Only the embedding is that large, so the name does not
    depend on the order the writer reads the tensors in. The inputs are finite (one with NaN is
    refused as it is read)."""
    big = dict(_params(CFG, 0))
    big["embed"] = np.full(big["embed"].shape, np.finfo(np.float32).max, np.float32)
    ins = [save_params(tmp_path / f"in{i}", big, CFG) for i in range(10)]
    out = tmp_path / "out"
    refused_in_one_line(capsys, ["merge", *map(str, ins), "--out", str(out), "--weights-only"],
                        "the average: non-finite weights in 1 tensor(s): embed (")
    assert not out.exists() and not list(tmp_path.glob(".out*"))
