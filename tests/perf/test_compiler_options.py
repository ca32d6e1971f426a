"""``train.compiler_options``: XLA options of the training step, per program. They reach the
compiler of the step itself (its compiled program changes with them), so two legs of ``olmax
bench ab`` compare compiler settings in one process; one the compiler refuses, or one that is
not NAME=VALUE, is one line and exit 2."""

from __future__ import annotations

import pytest

from olmax.cli import main
from olmax.train.recipes import load_recipe

TINY = ["model.vocab_size=120", "model.padded_vocab_size=128", "train.global_batch_size=2",
        "train.seq_len=96", "train.attn_impl=chunked"]
# XLA's CPU backend: which fusions it hands to the YNNPACK library (olmax's own default: dots
# alone, olmax.platforms.CPU_COMPILER_OPTIONS); elementwise fusions too is another program.
ELTWISE = "xla_cpu_experimental_ynn_fusion_type=LIBRARY_FUSION_TYPE_ELTWISE"


def _library_fusions(cfg) -> int:
    from olmax.perf.bench import TrainStepRunner

    return TrainStepRunner(cfg).compiled.as_text().count('"__ynn_fusion"')


@pytest.mark.slow
def test_the_run_s_option_is_the_step_s_own():
    """The step ``olmax bench ab`` times for a leg (and ``olmax train`` runs) compiles with the
    leg's option: another program."""
    one_layer = [*TINY, "model.n_layers=1", "model.window_pattern=[null]"]
    base = load_recipe("olmo3_tiny", one_layer)
    other = load_recipe("olmo3_tiny", [*one_layer, f"train.compiler_options=[{ELTWISE}]"])
    assert other.train.compiler_options_dict() == {
        "xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_ELTWISE"}
    n_base, n_other = _library_fusions(base), _library_fusions(other)
    assert 0 < n_base < n_other, (n_base, n_other)


def test_the_platform_s_options_and_the_run_s():
    """The run's options go over the platform's (CPU: olmax's own; TPU: the generation's table,
    less what LIBTPU_INIT_ARGS sets); true/false are booleans, which is how XLA reads them."""
    import jax

    from olmax.platforms import CPU_COMPILER_OPTIONS, compiler_options

    cpu = jax.devices("cpu")
    assert compiler_options("cpu", cpu, {"xla_cpu_enable_fast_math": "true"}) == {
        **CPU_COMPILER_OPTIONS, "xla_cpu_enable_fast_math": True}
    assert compiler_options("cpu", cpu, {"xla_cpu_experimental_ynn_fusion_type": "X"}) == {
        "xla_cpu_experimental_ynn_fusion_type": "X"}
    assert compiler_options("cuda", None, {"xla_gpu_enable_latency_hiding_scheduler": "FALSE"}) \
        == {"xla_gpu_enable_latency_hiding_scheduler": False}
    assert compiler_options("cuda", None) is None


@pytest.mark.parametrize("options,needle", [
    ("[xla_no_such_option=1]", "train.compiler_options: xla_no_such_option=1 is refused by the "
                               "compiler (this XLA has no such option)"),
    ("[xla_cpu_enable_fast_math=maybe]", "train.compiler_options: xla_cpu_enable_fast_math=maybe "
                                         "is refused by the compiler ('maybe' is not a valid bool "
                                         "value)"),
    ("[fast]", "train.compiler_options: 'fast' is not NAME=VALUE"),
    ("[a=1, a=2]", "train.compiler_options: 'a' is given twice"),
])
def test_a_refused_option_is_one_line(capsys, options, needle):
    assert main(["bench", "train", "olmo3_tiny", *TINY, f"train.compiler_options={options}",
                 "--steps", "1", "--no-ceiling"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err
