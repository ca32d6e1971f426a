"""Float8 dense layers against torchao's ``Float8Linear`` (torchao 0.18.0, ``emulate=True``, CPU)
with the configuration of OLMo 3's long-context stage, ``AOFloat8LinearConfig.recommended()``:
tensorwise dynamic scales rounded down to powers of 2, e4m3 input and weight, e5m2 gradients.

Both of olmax's forms are checked: float8 operands in the dots (the ``reference`` kernel set, what
accelerators run) and torchao's emulation (the ``cpu`` set). A dense layer's float8 values and
scales are torchao's and the de-scaling is exact, so its forward output, grad input and grad weight
differ at most by the summation order of the fp32 accumulation (XLA's dot against torch's mm). A small OLMo 3 converted by OLMo-core's ``apply_fp8`` agrees in loss to 1 fp32 ulp and in
every gradient to about 4e-7 of its largest entry: the float8 casts see the same values, and the
rest of the model (attention, RMSNorm, loss) differs by fp32 summation order, as without float8.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from olmax.config import ConfigError, TrainConfig
from olmax.config.load import from_dict
from olmax.model.kernels import float8 as f8
from olmax.model.kernels import reference
from olmax.model.params import init_params
from olmax.model.runtime import Runtime
from olmax.platforms import PROFILES
from olmax.train.loss import loss_and_sums, loss_denominator, make_labels
from helpers.reference import require

from helpers import olmo_core as ref

torch = require("torch")
require("torchao")
require("olmo_core")

FORMS = {"float8_gemm": f8.dense, "emulated": f8.dense_emulated}
TORCH_DTYPES = {jnp.float32: torch.float32, jnp.bfloat16: torch.bfloat16}


def _torchao_config():
    """The torchao config OLMo-core builds from ``AOFloat8LinearConfig.recommended()``, emulated."""
    from olmo_core.float8 import AOFloat8LinearConfig
    return AOFloat8LinearConfig.recommended(emulate=True).to_ao_type()


def _torchao_linear(w_oi: np.ndarray, dtype):
    from torchao.float8 import convert_to_float8_training
    model = torch.nn.Sequential(torch.nn.Linear(*w_oi.shape[::-1], bias=False, dtype=dtype))
    model[0].weight.data = torch.tensor(w_oi).to(dtype)
    convert_to_float8_training(model, config=_torchao_config())
    assert type(model[0]).__name__ == "Float8Linear"
    return model


def _as_np(t) -> np.ndarray:
    return t.detach().float().numpy()


def _torchao_operand(x: np.ndarray, tdt) -> np.ndarray:
    """torchao's float8 cast of ``x``, de-scaled (``q / s``), in float64."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig
    t = hp_tensor_to_float8_dynamic(torch.tensor(x), tdt, LinearMMConfig(),
                                    round_scales_to_power_of_2=True)
    return (t._data.double() / t._scale.double()).numpy()


def _order_bound(a: np.ndarray, b: np.ndarray, out: np.ndarray, dtype) -> np.ndarray:
    """How far two fp32 sums of the products ``a @ b`` in different orders can be apart:
    each is within ``(k-1) 2^-24 sum|a_i b_i|`` of the exact sum (k terms); a bf16 result adds
    one rounding each (``2^-8 |out|``)."""
    k = a.shape[-1]
    bound = 2 * (k - 1) * 2.0 ** -24 * (np.abs(a) @ np.abs(b))
    return bound + (2 * 2.0 ** -8 * np.abs(out) if dtype == jnp.bfloat16 else 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("form", FORMS)
def test_dense_layer_matches_torchao_float8_linear(form, dtype):
    """The three GEMMs see the same float8 operands as torchao's; their fp32 sums of 512 (output,
    grad weight: 128) products differ by summation order only (XLA's CPU dot against torch's mm):
    measured in fp32, 95.5% of the outputs equal and the largest difference 4.8e-7, grad input and
    grad weight equal; in bf16 all three equal. Checked against the order bound of every element
    (:func:`_order_bound`); the same layer without float8 is outside it."""
    rng = np.random.default_rng(0)
    b, t, i, o = 2, 64, 512, 192
    x = (rng.standard_normal((b, t, i)) * 3).astype(np.float32)
    w = (rng.standard_normal((o, i)) * 0.02).astype(np.float32)
    g = (rng.standard_normal((b, t, o)) * 1e-4).astype(np.float32)
    x[0, 3, 7] = 40.0          # an outlier: the input's scale follows its amax

    tdt = TORCH_DTYPES[dtype]
    model = _torchao_linear(w, tdt)
    xt = torch.tensor(x).to(tdt).requires_grad_(True)
    y_ref = model(xt)
    y_ref.backward(torch.tensor(g).to(tdt))
    refs = _as_np(y_ref), _as_np(xt.grad), _as_np(model[0].weight.grad).T

    xj, wj, gj = (jnp.asarray(a, dtype) for a in (x, w.T, g))
    y, vjp = jax.vjp(FORMS[form], xj, wj)
    dx, dw = vjp(gj)
    assert y.dtype == dx.dtype == dw.dtype == dtype
    ours = tuple(np.asarray(a, np.float32) for a in (y, dx, dw))

    # the operands torchao casts (in its dtype: a bf16 input is rounded before its cast)
    xq = _torchao_operand(_as_np(xt), torch.float8_e4m3fn).reshape(-1, i)
    wq = _torchao_operand(_as_np(torch.tensor(w).to(tdt)).T, torch.float8_e4m3fn)
    gq = _torchao_operand(_as_np(torch.tensor(g).to(tdt)), torch.float8_e5m2).reshape(-1, o)
    products = (xq, wq), (gq, wq.T), (xq.T, gq)
    for mine, theirs, (a, bb) in zip(ours, refs, products):
        bound = _order_bound(a, bb, theirs.reshape(a.shape[0], -1), dtype).reshape(theirs.shape)
        assert (np.abs(mine - theirs) <= bound).all()
    assert (ours[0] == refs[0]).mean() > 0.9
    high_precision = np.asarray(reference.dense(xj, wj), np.float32)
    bound = _order_bound(xq, wq, refs[0].reshape(-1, o), dtype).reshape(refs[0].shape)
    assert (np.abs(high_precision - refs[0]) > bound).mean() > 0.5


def test_scales_are_torchao_powers_of_two():
    from torchao.float8.float8_utils import tensor_to_scale
    rng = np.random.default_rng(1)
    for dtype, tdt in ((f8.E4M3, torch.float8_e4m3fn), (f8.E5M2, torch.float8_e5m2)):
        for magnitude in (1e-30, 1e-9, 3e-3, 1.0, 448.0, 7e4, 1e20):
            x = (rng.standard_normal(1000) * magnitude).astype(np.float32)
            s = float(f8.scale_of(jnp.asarray(x), dtype))
            mantissa, _ = np.frexp(s)
            assert mantissa == 0.5, s                                       # a power of 2
            exact = float(jnp.finfo(dtype).max) / max(float(np.abs(x).max()), 1e-12)
            assert s <= exact < 2 * s                                       # rounded down
            assert s == tensor_to_scale(torch.tensor(x), tdt, round_scales_to_power_of_2=True).item()


@pytest.mark.parametrize("fill", [0.0, np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("dtype", [f8.E4M3, f8.E5M2])
def test_amax_zero_inf_nan_as_torchao(fill, dtype):
    """amax 0: the scale of amax 1e-12 (``2^48`` for e4m3) and zeros; inf: scale 0, the inf
    cast to NaN (``inf * 0``), the rest to 0, and NaN everywhere once de-scaled (``0 / 0``);
    NaN: NaN -- torchao's values."""
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    from torchao.float8.float8_training_tensor import LinearMMConfig
    tdt = {f8.E4M3: torch.float8_e4m3fn, f8.E5M2: torch.float8_e5m2}[dtype]
    x = np.zeros(64, np.float32) if fill == 0 else np.linspace(-2, 2, 64, dtype=np.float32)
    x[5] = fill
    t = hp_tensor_to_float8_dynamic(torch.tensor(x), tdt, LinearMMConfig(),
                                    round_scales_to_power_of_2=True)
    q, s = f8.quantize(jnp.asarray(x), dtype)
    np.testing.assert_array_equal(float(s), t._scale.item())
    np.testing.assert_array_equal(np.asarray(q, np.float32), t._data.float().numpy())
    values = np.asarray(f8.dequantize(q, s))
    if fill == 0:
        assert float(s) == {f8.E4M3: 2.0 ** 48, f8.E5M2: 2.0 ** 55}[dtype]
        assert (values == 0).all()
    else:
        assert np.isnan(values).all()


def test_power_of_two_rounding_where_torchao_rounds_up():
    """torchao rounds with ``exp2(floor(log2(s)))`` in fp32: a scale one fp32 step below ``2^k``
    has ``log2`` rounded to ``k``, so torchao takes ``2^k`` (the input then saturates by up to
    one float8 step); olmax takes ``2^(k-1)``. Only amaxes within ~1e-7 (relative) above
    ``fp8_max 2^-k`` fall in that band."""
    from torchao.float8.float8_utils import tensor_to_scale
    amax = np.nextafter(np.float32(448 * 2.0 ** -20), np.float32(1))   # s = 2^20 (1 - 2^-23)
    s_ref = tensor_to_scale(torch.tensor([amax]), torch.float8_e4m3fn,
                            round_scales_to_power_of_2=True).item()
    assert (s_ref, float(f8.scale_of(jnp.asarray([amax]), f8.E4M3))) == (2.0 ** 20, 2.0 ** 19)


def test_only_layers_olmo_core_converts():
    """OLMo-core converts a Linear only if both its dimensions divide by 16: others stay in the
    kernel set's high-precision dense; the LM head never goes through ``dense``."""
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((1, 4, 24)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((24, 32)), jnp.float32)
    dense = Runtime(float8=True).kernels.dense
    np.testing.assert_array_equal(dense(x, w), reference.dense(x, w))
    x = jnp.concatenate([x, x[..., :8]], axis=-1)
    w = jnp.concatenate([w, w[:8]], axis=0)
    np.testing.assert_array_equal(dense(x, w), f8.dense(x, w))
    assert Runtime(float8=False).kernels.dense is reference.dense


def test_train_float8_is_a_strict_bool_refused_without_float8_matmuls():
    with pytest.raises(ConfigError, match="expected bool"):
        from_dict(TrainConfig, {"float8": "yes"})
    train = from_dict(TrainConfig, {"float8": True, "profile": "cpu"})
    with pytest.raises(ConfigError, match=r"^train.float8: the cpu devices .* have no float8 "
                                          r"matmuls .*; set train.float8: false$"):
        Runtime.of(train, jax.devices("cpu"))
    assert Runtime.of(from_dict(TrainConfig, {}), jax.devices("cpu")).float8 is False


def _olmo_core_loss_and_grads(params, tokens, fp8: bool):
    from olmo_core.data.utils import get_labels
    from olmo_core.float8 import AOFloat8LinearConfig, Float8Config
    model = ref.oc_model(params)
    if fp8:     # as OLMo-core's train module applies float8_config (the stage-3 script's)
        model.apply_fp8(Float8Config(enabled=True, ao=AOFloat8LinearConfig.recommended(emulate=True)))
        kinds = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        assert kinds.pop("lm_head.w_out") == "Linear"
        assert set(kinds.values()) == {"Float8Linear"} and len(kinds) == 7 * ref.CFG.n_layers
    ids = torch.tensor(tokens, dtype=torch.long)
    labels = get_labels({"input_ids": ids})
    out = model(ids, labels=labels, loss_reduction="sum", z_loss_multiplier=1e-5,
                loss_div_factor=(labels != -100).sum(), return_logits=False)
    out.loss.backward()
    grads = ref.to_olmax_layout(model, {k: p.grad.numpy() for k, p in model.named_parameters()})
    return out.loss.item(), grads


def _olmax_loss_and_grads(params, tokens, runtime):
    labels = make_labels(jnp.asarray(tokens))
    den = loss_denominator(labels)
    loss = lambda p: loss_and_sums(p, jnp.asarray(tokens), labels, den, ref.CFG, runtime,  # noqa: E731
                                   z_loss_multiplier=1e-5, chunk_size=8)[0]
    value, grads = jax.value_and_grad(loss)(params)
    return float(value), jax.tree.map(np.asarray, grads)


def _max_relative(ours, theirs) -> float:
    """The largest difference of any gradient tensor, relative to that tensor's largest entry."""
    return max(jax.tree.leaves(jax.tree.map(
        lambda a, b: float(np.abs(a - b).max() / np.abs(b).max()), ours, theirs)))


@pytest.mark.slow
@pytest.mark.parametrize("profile", [None, "cpu"])
def test_small_olmo3_loss_and_grads_match_olmo_core_float8(profile):
    """fp32 master weights, every block Linear in float8. Measured: loss 4.8e-7 apart (1 ulp),
    gradients at most 4.2e-7 of each tensor's largest entry apart (most projections' exactly
    equal). The tolerance, 1e-5, is the fp32 summation-order difference of the same model without
    float8 (6.8e-6); a float8 value rounded differently anywhere would move a gradient by about
    a float8 step (>= 1e-2 relative). Float8 itself moves the loss by 2.4e-3 and gradients by up
    to 1.35 of a tensor's largest entry, so the comparison also tells float8 from fp32."""
    params = init_params(ref.CFG, jax.random.key(0))
    tokens = np.random.default_rng(1).integers(0, ref.CFG.vocab_size, size=(ref.B, ref.T))
    runtime = Runtime(float8=True) if profile is None else \
        Runtime(profile=PROFILES[profile], attn_impl="chunked", float8=True)
    loss_ref, grads_ref = _olmo_core_loss_and_grads(params, tokens, fp8=True)
    loss, grads = _olmax_loss_and_grads(params, tokens, runtime)
    assert abs(loss - loss_ref) <= 1e-5 * abs(loss_ref)
    assert _max_relative(grads, grads_ref) <= 1e-5
    loss_hp, grads_hp = _olmax_loss_and_grads(params, tokens, Runtime())
    assert abs(loss_hp - loss_ref) > 10 * 1e-5 * abs(loss_ref)
    assert _max_relative(grads_hp, grads_ref) > 10 * 1e-5


@pytest.mark.slow
def test_remat_recomputes_the_same_float8_values():
    """Rematerialised layers cast their recomputed inputs again, to the same float8 values: in
    fp32 the gradients under ``full`` and ``save_proj`` remat are those without remat up to fp32
    summation order (measured: 2e-6 of a tensor's largest entry, in the norms), far below the
    float8 step (>= 1e-2) a differently rounded cast would move them by."""
    params = init_params(ref.CFG, jax.random.key(0))
    tokens = np.random.default_rng(1).integers(0, ref.CFG.vocab_size, size=(ref.B, ref.T))
    _, base = _olmax_loss_and_grads(params, tokens, Runtime(float8=True))
    for remat in ("full", "save_proj"):
        _, grads = _olmax_loss_and_grads(params, tokens, Runtime(float8=True, remat=remat))
        assert _max_relative(grads, base) <= 1e-5
