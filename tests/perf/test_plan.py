"""``olmax plan`` on this machine's CPU devices (no topology), and the HLO reading it relies on."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import pytest

from olmax.cli import main
from olmax.errors import OlmaxError
from olmax.model.flops import flops_per_token
from olmax.model.params import count_params
from olmax.perf import hlo
from olmax.device_memory import parse_oom
from olmax.train.recipes import load_recipe


def test_plan_on_local_cpu(tmp_path, capsys):
    out = tmp_path / "plan.json"
    # A small vocabulary, so that the layers (not the LM head) dominate the FLOPs.
    overrides = ["train.global_batch_size=4", "train.micro_batch_size=2", "train.remat=full",
                 "model.vocab_size=256", "model.padded_vocab_size=256"]
    assert main(["plan", "olmo3_tiny", *overrides, "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "peak vs HBM" in table and "collectives" in table
    p = json.loads(out.read_text())
    assert p["topology"] is None and p["num_devices"] == 1 and p["attn_impl"] == "xla"
    assert p["profile"] == "cpu"
    assert p["remat"] == "full" and p["details"]["n_micro"] == 2
    m = p["memory"]
    assert m["fits"] is True and 0 < m["peak_bytes"] < m["hbm_bytes"]
    cfg = load_recipe("olmo3_tiny", overrides)
    assert m["argument_bytes"] >= 12 * count_params(cfg.model)   # fp32 params + Adam mu, nu
    f = p["flops_per_step"]
    assert f["causal"] == pytest.approx(flops_per_token(cfg.model, 128, "causal") * 4 * 128)
    # Full remat recomputes the forward (8N instead of 6N on the layers) and xla attention is
    # computed densely (T x T scores): XLA's count lies above the model FLOPs by more than the
    # remat factor 8/6. Counting the two micro-batches' loop body once gives about half.
    assert 8 / 6 < f["xla"] / f["causal"] < 1.8
    assert f["xla"] > 1.8 * p["details"]["xla_whole_program_flops"]
    assert p["details"]["loops_with_unknown_trip_count"] == 0
    # XLA's CPU backend has no cost model: no invented estimate.
    assert p["estimate"]["step_s"] is None and p["estimate"]["method"].startswith("unavailable")
    # no calibration case for a CPU: said so, beside the (absent) estimate
    assert p["estimate"]["calibration"] == "uncalibrated"
    assert "uncalibrated" in table


def test_plan_of_packed_rows_compiles_the_masked_step(tmp_path):
    """A recipe of packed rows with document lengths is planned with the inputs its step takes:
    the label mask and the documents (segment ids in the attention), which change the program."""
    out, plain = tmp_path / "packed.json", tmp_path / "plain.json"
    base = ["train.global_batch_size=2", "model.vocab_size=256", "model.padded_vocab_size=256",
            "train.attn_impl=chunked", "--no-parts"]
    assert main(["plan", "olmo3_tiny", *base, "--json", str(plain)]) == 0
    assert main(["plan", "olmo3_tiny", *base, "data.instances=packed", "data.doc_lens=true",
                 "--hlo", str(tmp_path / "packed.hlo"), "--json", str(out)]) == 0
    p, q = json.loads(out.read_text()), json.loads(plain.read_text())
    assert p["details"]["batch_keys"] == ["doc_lens", "instance_mask", "label_mask", "tokens"]
    assert q["details"]["batch_keys"] == ["instance_mask", "tokens"]
    assert p["memory"]["fits"] and p["memory"]["argument_bytes"] > q["memory"]["argument_bytes"]


def test_topology_without_libtpu_is_one_line(capsys):
    pytest.importorskip("jax")
    import importlib.util

    if importlib.util.find_spec("libtpu") is not None:
        pytest.skip("libtpu is installed here")
    assert main(["plan", "olmo3_tiny", "--topology", "v5e:2x2"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "needs libtpu" in err


def test_topology_while_another_process_holds_the_tpu_is_one_line(capsys, monkeypatch):
    """On a host with TPUs, libtpu loads in one process at a time: a plan while a run holds the
    chip is told so in one line, not libtpu's advice to remove the lock file of a running job."""
    pytest.importorskip("jax")
    from jax.experimental import topologies

    def held(**kwargs):
        raise RuntimeError('ABORTED: Internal error when accessing libtpu multi-process lockfile. '
                           'Run "$ sudo rm /tmp/libtpu_lockfile".\nmore')

    monkeypatch.setattr(topologies, "get_topology_desc", held)
    assert main(["plan", "olmo3_tiny", "--topology", "v5e:1x1", "--no-parts"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "held by another process" in err and "rm " not in err


def test_a_slice_smaller_than_a_host_gives_libtpu_its_bounds(monkeypatch):
    """On a TPU host libtpu reads the host's chip bounds from its environment (a v5e host: 2x2x1)
    and refuses a smaller slice; the plan gives it the slice's own shape where the slice has fewer
    than 4 chips (checked on a v5e chip, libtpu 0.0.42.1: v5e:1x1 refused without, compiled with
    (1, 1, 1)), and nothing for whole hosts."""
    pytest.importorskip("jax")
    from jax.experimental import topologies

    from olmax.perf import targets

    assert targets.host_bounds("v5e:1x1") == {"chips_per_host_bounds": (1, 1, 1)}
    assert targets.host_bounds("v5e:2x1") == {"chips_per_host_bounds": (2, 1, 1)}
    assert targets.host_bounds("v5p:1x1x1") == {"chips_per_host_bounds": (1, 1, 1)}
    assert targets.host_bounds("tpu7x:1x1x1") == {"chips_per_host_bounds": (1, 1, 1)}
    assert targets.host_bounds("v5e:2x2") == targets.host_bounds("v5p:2x2x1") == {}
    assert targets.host_bounds("v5p:4x4x4") == targets.host_bounds("v5e") == {}
    seen = []

    class Desc:
        devices = ["d0"]

    def desc(**kwargs):
        seen.append(kwargs)
        return Desc()

    monkeypatch.setattr(topologies, "get_topology_desc", desc)
    assert targets.topology_devices("v5e:1x1") == ["d0"] and targets.topology_devices("v5e:2x2") == ["d0"]
    assert seen[0] == {"platform": "tpu", "topology_name": "v5e:1x1", "chips_per_host_bounds": (1, 1, 1)}
    assert seen[1] == {"platform": "tpu", "topology_name": "v5e:2x2"}


def test_loop_trip_counts_and_multipliers():
    """A scan of 7 inside a scan of 3: the inner body runs 21 times per program run."""
    def f(x):
        def outer(c, _):
            def inner(c2, _):
                return jnp.tanh(c2 @ c2), None
            return jax.lax.scan(inner, c, None, length=7)[0], None
        return jax.lax.scan(outer, x, None, length=3)[0]

    text = jax.jit(f).lower(jax.ShapeDtypeStruct((16, 16), jnp.float32)).compile().as_text()
    prog = hlo.analyse(text)
    assert prog.unknown_loops == 0
    dots = [(ins, m) for ins, m in prog.instructions() if ins.opcode in ("dot", "convolution")]
    assert dots and all(m == 21 for _, m in dots)


def test_shape_bytes_and_oom_message():
    assert hlo.shape_bytes("bf16[8,128]{1,0}") == 2048
    assert hlo.shape_bytes("(f32[4], s32[], pred[2,2])") == 16 + 4 + 4
    msg = ("RESOURCE_EXHAUSTED: E1000: CompileTimeHbmOom: Ran out of memory on HBM, the total memory "
           "required for HLO temporaries (17.18G) exceeds available HBM (15.75G). HLO module: jit_step.")
    oom = parse_oom(msg)
    assert (oom.needed, oom.available) == (int(17.18 * 2 ** 30), int(15.75 * 2 ** 30))
    oom = parse_oom("Used 139.38G of 94.74G hbm. Exceeded hbm capacity by 44.64G.")
    assert (oom.needed, oom.available) == (int(139.38 * 2 ** 30), int(94.74 * 2 ** 30))
    assert parse_oom("INVALID_ARGUMENT: something else") is None


def test_gpu_target_names_and_missing_plugin(capsys):
    from olmax.perf import targets
    from olmax.perf.targets import cuda_plugin_installed

    assert targets.parse_gpu("h100:8") == ("h100", 8) and targets.parse_gpu("H200") == ("h200", 1)
    assert targets.parse_gpu("h100:64x8") == ("h100", 512)
    assert targets.parse_gpu("v5p:4x4x4") is None
    for bad in ("h100:x", "h100:0", "h200:-1"):
        with pytest.raises(OlmaxError, match=rf"--topology {bad}: the GPU count must be a positive"):
            targets.parse_gpu(bad)
    assert 'device_description_str: "NVIDIA H200"' in targets.GPU_TARGETS["h200"]
    if cuda_plugin_installed():
        pytest.skip("JAX's CUDA plugin is installed here")
    assert main(["plan", "olmo3_tiny", "--topology", "h100:8"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "needs JAX's CUDA plugin" in err


def test_mistyped_topology_is_named_before_any_plugin(capsys):
    """A name that is no TPU topology or GPU target is refused by its spelling: not answered with
    "install libtpu" or "install the CUDA plugin", whichever of them is installed."""
    cases = {"banana:2x2": "no TPU generation 'banana'; known: v2, v3, v4, v5e, v5p, v6e, tpu7x",
             "v5e:2x2x2x2": "the shape '2x2x2x2' is not AxB or AxBxC",
             "tpu7x:0x2": "the shape '0x2' is not AxB or AxBxC",
             "v5p": "the shape '' is not AxB or AxBxC",
             # spelt right, but no slice Cloud TPU offers
             "tpu7x:3x3x3": "3x3x3 is no tpu7x slice",
             "v5e:4x4x4": "a v5e shape has 2 dimensions",
             "h100:eight": "--topology h100:eight: the GPU count must be a positive whole number",
             "h100:0": "--topology h100:0: the GPU count must be a positive whole number"}
    for name, why in cases.items():
        assert main(["plan", "olmo3_tiny", "--topology", name]) == 2, name
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and why in err, err
        assert "libtpu" not in err and "plugin" not in err, err


def test_local_plan_that_does_not_fit_exits_1(tmp_path, capsys):
    """On the local devices a step larger than the memory compiles (XLA's CPU backend has no
    limit) but is the same one line and exit status as a topology's compile-time OOM."""
    out = tmp_path / "plan.json"
    overrides = ["model.mlp_hidden=1073741824"]       # 4 layers x 3 x 32 x 2^30 fp32: 1.5 TiB
    assert main(["plan", "olmo3_tiny", *overrides, "--no-parts", "--json", str(out)]) == 1
    line = capsys.readouterr().out.strip()
    assert "\n" not in line and line.startswith("olmax plan: does not fit: the step (cpu x1, batch")
    memory = json.loads(out.read_text())["memory"]
    need, have = memory["peak_bytes"], memory["hbm_bytes"]
    assert memory["fits"] is False
    assert need > 4 * 3 * 32 * 2 ** 30 * 4 > have
    assert f"needs {need / 2 ** 30:.2f} GiB of device memory per device" in line and f"{have / 2 ** 30:.2f} GiB available" in line


def test_hlo_and_json_refuse_to_replace(tmp_path, capsys):
    recipe = tmp_path / "my.yaml"
    recipe.write_text("model: {preset: olmo3-tiny}\ndata: {embedded: true}\n"
                      "train: {seq_len: 32, global_batch_size: 2, max_steps: 1}\n")
    notes = tmp_path / "notes.txt"
    notes.write_text("mine\n")
    cases = [(["--hlo", str(notes)], f"--hlo {notes} already exists (remove it or pass --force)"),
             (["--hlo", str(recipe), "--force"],
              f"--hlo {recipe} is the recipe this command reads; write to another file"),
             (["--json", str(recipe), "--force"],
              f"--json {recipe} is the recipe this command reads; write to another file")]
    for options, line in cases:
        assert main(["plan", str(recipe), "--no-parts", *options]) == 2
        assert capsys.readouterr().err.strip() == f"olmax plan: error: {line}"
    assert notes.read_text() == "mine\n" and "olmo3-tiny" in recipe.read_text()
    assert main(["plan", str(recipe), "--no-parts", "--hlo", str(notes), "--force"]) == 0
    assert notes.read_text().startswith("HloModule")


def test_a_gpu_step_fits_against_the_share_of_memory_jax_takes():
    """The 7B recipe at 2 x 8192 per device on h100:8 peaks at 66.6 GiB: within the 72 GiB JAX may
    take in a launched job (0.90 of 80 GiB), not within the 60 GiB of JAX's default 0.75."""
    from olmax.perf.targets import MEM_FRACTION
    from olmax.hardware import GiB
    from olmax.perf.targets import usable_hbm

    peak = int(66.6 * GiB)
    hbm, fraction, source = usable_hbm("gpu", 80 * GiB, "table", environ={})
    assert (hbm, fraction, MEM_FRACTION) == (72 * GiB, 0.90, 0.90) and peak <= hbm
    assert source == "table x XLA_PYTHON_CLIENT_MEM_FRACTION 0.9"
    hbm, fraction, _ = usable_hbm("gpu", 80 * GiB, "table",
                                  environ={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.75"})
    assert (hbm, fraction) == (60 * GiB, 0.75) and not peak <= hbm
    # a real GPU's runtime limit is already the allocator's share; TPUs and CPUs use everything
    assert usable_hbm("gpu", 70 * GiB, "runtime", environ={}) == (70 * GiB, 0.90, "runtime")
    assert usable_hbm("tpu", 95 * GiB, "table", environ={}) == (95 * GiB, 1.0, "table")
    with pytest.raises(OlmaxError, match="XLA_PYTHON_CLIENT_MEM_FRACTION='1.5'"):
        usable_hbm("gpu", 80 * GiB, "table", environ={"XLA_PYTHON_CLIENT_MEM_FRACTION": "1.5"})


def test_a_step_is_priced_only_where_a_measured_table_prices_the_devices():
    """``train.auto_choice=estimate`` needs a price: the CPU has no rates table measured on it, so
    there ``auto`` chooses by memory (the v5e's price: tests/perf/test_plan_tpu.py)."""
    import jax

    from olmax.config import MeshConfig
    from olmax.parallel.mesh import make_mesh
    from olmax.perf.step_price import step_pricer

    assert step_pricer(make_mesh(MeshConfig(), jax.devices()[:1])) is None
