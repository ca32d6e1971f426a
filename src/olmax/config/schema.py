"""The run configuration's schema: one frozen dataclass per section.

Every section checks its own values when it is built (``__post_init__``; choices are ``Literal``
types), so a bad recipe or override fails at load time, before any JAX work. What depends on
several sections is checked by :class:`RunConfig` itself; what depends on the machine (a mesh that
does not divide the devices) where the two meet, the mesh. Recipes are resolved into a RunConfig
by :mod:`olmax.train.recipes`.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from olmax.config.load import build, check_choices, check_number, check_positive, shown, typed_fields
from olmax.errors import ConfigError




@dataclass(frozen=True)
class YarnConfig:
    """YaRN RoPE scaling (OLMo 3 long-context stage; OLMo-core ``YaRNRoPEScalingConfig``)."""

    factor: float = 8.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 8192
    # None: 0.1 * ln(factor) + 1, as OLMo-core and HF compute it.
    attention_factor: float | None = None
    # OLMo 3 applies YaRN to the full-attention layers only.
    full_attention_only: bool = True

    def __post_init__(self) -> None:
        # HF's rules (transformers _validate_yarn_parameters): the factor stretches the context
        # (>= 1), and beta_fast is the larger rotation count; both are divided into and logged.
        where = "model.rope_scaling"
        check_number(self, where, "factor", low=1)
        check_number(self, where, "beta_slow", low=0, low_open=True)
        check_number(self, where, "beta_fast", low=0, low_open=True)
        if self.beta_fast < self.beta_slow:
            raise ConfigError(f"{where}.beta_fast ({self.beta_fast}) must be >= beta_slow "
                              f"({self.beta_slow})")
        check_number(self, where, "original_max_position_embeddings", low=1)
        if not isinstance(self.original_max_position_embeddings, int):
            raise ConfigError(f"{where}.original_max_position_embeddings must be an integer "
                              f"(got {shown(self.original_max_position_embeddings)})")
        check_number(self, where, "attention_factor", low=0, low_open=True, optional=True)


QkNorm = Literal["full", "head", "none"]
BlockType = Literal["reordered_norm", "prenorm"]
QK_NORM_SCOPES = typing.get_args(QkNorm)
BLOCK_TYPES = typing.get_args(BlockType)


@dataclass(frozen=True)
class ModelConfig:
    """Every architectural choice of an OLMo-family decoder, as data.

    ``window_pattern`` repeats over the layers; an int W means sliding-window attention where a
    query sees W keys including itself, ``None`` means full causal attention.
    """

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    mlp_hidden: int
    vocab_size: int = 100278
    padded_vocab_size: int = 100352
    rope_theta: float = 500_000.0
    rope_scaling: YarnConfig | None = None
    norm_eps: float = 1e-6
    qk_norm: QkNorm = "full"
    block_type: BlockType = "reordered_norm"
    window_pattern: tuple[int | None, ...] = (4096, 4096, 4096, None)
    tie_embeddings: bool = False
    init_std: float = 0.02
    max_seq_len: int = 8192

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ConfigError(f"model: {msg}")

        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "mlp_hidden",
                     "vocab_size", "padded_vocab_size"):
            if getattr(self, name) <= 0:
                bad(f"{name} must be positive (got {getattr(self, name)})")
        if self.n_heads % self.n_kv_heads:
            bad(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.padded_vocab_size < self.vocab_size:
            bad(f"padded_vocab_size ({self.padded_vocab_size}) < vocab_size ({self.vocab_size})")
        check_choices(self, "model")
        if not self.window_pattern:
            bad("window_pattern must not be empty")
        if self.n_layers % len(self.window_pattern):
            bad(f"n_layers ({self.n_layers}) must be a multiple of len(window_pattern) "
                f"({len(self.window_pattern)})")
        for w in self.window_pattern:
            if w is not None and w <= 0:
                bad(f"window sizes must be positive or null (got {w})")
        if self.head_dim % 2:
            bad(f"head_dim must be even for RoPE (got {self.head_dim})")
        check_number(self, "model", "rope_theta", low=1, low_open=True)   # log(theta) divides
        check_number(self, "model", "norm_eps", low=0, low_open=True)
        check_number(self, "model", "init_std", low=0, low_open=True)
        check_positive(self, "model", "max_seq_len")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    def layer_windows(self) -> tuple[int | None, ...]:
        """The attention window of every layer (None = full attention)."""
        p = self.window_pattern
        return tuple(p[i % len(p)] for i in range(self.n_layers))

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)





@dataclass(frozen=True)
class MixtureSourceConfig:
    """One source of a run-time mixture (OLMo-core ``SourceMixtureConfig``)."""

    name: str
    target_ratio: float
    paths: tuple[str, ...]               # token files; globs allowed (sorted)
    max_repetition_ratio: float = 1.0
    max_source_fraction: float = 1.0

    def __post_init__(self) -> None:
        where = f"data.mixture source {self.name!r}"
        if not 0 < self.target_ratio <= 1:
            raise ConfigError(f"{where}: target_ratio must be in (0, 1]")
        if not 0 < self.max_source_fraction <= 1:
            raise ConfigError(f"{where}: max_source_fraction must be in (0, 1]")
        if self.max_repetition_ratio < 1:
            raise ConfigError(f"{where}: max_repetition_ratio must be >= 1")
        if not self.paths:
            raise ConfigError(f"{where}: paths must not be empty")


@dataclass(frozen=True)
class SourceMixtureConfig:
    """Run-time source mixture (OLMo-core ``SourceMixtureDatasetConfig``); global batch and seq_len
    come from the train section."""

    sources: tuple[MixtureSourceConfig, ...] = ()
    requested_tokens: int = 0
    seed: int = 42

    def __post_init__(self) -> None:
        if not self.sources:
            raise ConfigError("data.mixture.sources must not be empty")
        if self.requested_tokens <= 0:
            raise ConfigError("data.mixture.requested_tokens must be > 0")
        total = sum(s.target_ratio for s in self.sources)
        if abs(total - 1.0) > 1e-8 + 1e-5:   # numpy.allclose(total, 1.0), as OLMo-core checks
            raise ConfigError(f"data.mixture: the sources' target_ratio values must sum to 1.0, "
                              f"got {total}")


@dataclass(frozen=True)
class TokenizerConfig:
    """The token ids a dataset's files are written in: OLMo-core's ``TokenizerConfig`` (its
    fields; :data:`olmax.data.tokenizer.PRESETS` holds its named presets). Only the ids matter to
    training from token files; ``identifier`` names a tokenizer that encodes text (``dolma2``'s
    identifiers or a ``tokenizer.json``), for what does (evaluation tasks)."""

    vocab_size: int
    eos_token_id: int
    pad_token_id: int
    bos_token_id: int | None = None
    identifier: str | None = None

    def __post_init__(self) -> None:
        check_positive(self, "data.tokenizer", "vocab_size")
        for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ConfigError(f"data.tokenizer.{name} must be an id below vocab_size "
                                  f"{self.vocab_size} (got {value})")

    def ids(self) -> dict[str, int | None]:
        """The ids OLMo-core's dataset fingerprint hashes, by name."""
        return {name: getattr(self, name) for name in TOKEN_ID_FIELDS}


TOKEN_ID_FIELDS = ("vocab_size", "eos_token_id", "pad_token_id", "bos_token_id")
TokenDtype = Literal["uint8", "uint16", "uint32", "uint64"]
InstanceKind = Literal["fsl", "packed"]          # olmax.data.instances | olmax.data.packed
LongDocStrategy = Literal["truncate", "fragment"]
DataSource = Literal["paths", "mix", "embedded", "mixture"]   # the exclusive ways to name training data
DATA_SOURCES: tuple[DataSource, ...] = typing.get_args(DataSource)


@dataclass(frozen=True)
class DataConfig:
    """Training data: one source (explicit ``paths``, an OLMo-core ``mix`` file, the ``embedded``
    corpus or a run-time ``mixture``) and how to read it. More than one source is an error here;
    none is an error when the data is resolved (:mod:`olmax.data.sources`)."""

    paths: tuple[str, ...] = ()          # raw uint32 token files, in mix order (paths or s3/gs/http(s) URLs)
    mix: str | None = None               # OLMo-core mix file (label,path lines with {TOKENIZER})
    root: str | None = None              # where the mix's relative paths live (a folder or a URL)
    # The tokenizer of the token files: a name (dolma2, OLMo-core's TokenizerConfig presets),
    # a tokenizer.json, or OLMo-core TokenizerConfig fields (vocab_size, eos_token_id, ...).
    # None: the tokenizer of the checkpoint the run starts from (init.checkpoint), else dolma2.
    tokenizer: str | TokenizerConfig | None = None
    dtype: TokenDtype = "uint32"
    epoch: int = 1                       # OLMo-core's trainer starts at epoch 1
    repetition_filter: bool = False      # OLMo 3 7B ran without it
    num_workers: int = 0
    prefetch: int = 2
    ignore_fingerprint_mismatch: bool = False
    embedded: bool = False               # use the embedded corpus (stdlib sources + pydoc topics)
    mix_tokenizer: str = "allenai/dolma3-tokenizer"  # substituted for {TOKENIZER} in mix files
    remap: tuple[str, ...] = ()          # "OLD=NEW" path-prefix rewrites for mix entries
    repetition_max_period: int = 13      # OLMo-core InstanceFilterConfig defaults
    repetition_min_period: int = 1
    repetition_max_count: int = 32
    cache_dir: str | None = None         # index/embedded caches (None: $OLMAX_CACHE or ~/.cache/olmax);
    #                                      when set, also a read-through cache of remote token files
    mixture: SourceMixtureConfig | None = None  # run-time source mixture instead of paths/mix
    max_target_seq_len: int | None = None  # OLMo-core max_target_sequence_length (OLMo 3 scripts: 8192)
    # How token files become instances: "fsl" concatenates and chunks (NumpyFSLDataset, stages 1
    # and 2); "packed" packs whole documents, padded (NumpyPackedFSLDataset, the long-context stage).
    instances: InstanceKind = "fsl"
    source_group_size: int = 1           # packed: consecutive files packed together (OLMo 3: 8)
    long_doc_strategy: LongDocStrategy = "truncate"  # packed: documents longer than seq_len
    doc_lens: bool = False               # packed: batches carry doc_lens (intra-document masking)
    source_permutation_seed: int | None = None  # shuffle the file order first (OLMo 3 long context: 123)

    def __post_init__(self) -> None:
        check_choices(self, "data")
        if len(self.sources_set()) > 1:
            raise ConfigError("set exactly one of data.paths, data.mix, data.embedded, data.mixture "
                              f"(got {', '.join(self.sources_set())})")
        for item in self.remap:
            if "=" not in item:
                raise ConfigError(f"data.remap: expected OLD=NEW, got {item!r}")
        check_positive(self, "data", "max_target_seq_len", optional=True)
        if self.epoch < 1:
            raise ConfigError(f"data.epoch must be >= 1 (OLMo-core starts at epoch 1), "
                              f"got {self.epoch}")
        check_positive(self, "data", "repetition_max_period", "repetition_min_period",
                       "repetition_max_count")
        if self.repetition_min_period > self.repetition_max_period:
            raise ConfigError(f"data.repetition_min_period ({self.repetition_min_period}) must be "
                              f"<= data.repetition_max_period ({self.repetition_max_period})")
        if self.num_workers < 0 or self.prefetch < 0:
            raise ConfigError("data.num_workers and data.prefetch must be >= 0")
        self._check_packing()

    def _check_packing(self) -> None:
        check_positive(self, "data", "source_group_size")
        check_seed(self.source_permutation_seed, "data.source_permutation_seed")
        if self.source_permutation_seed is not None and self.mixture is not None:
            raise ConfigError("data.source_permutation_seed orders files; a data.mixture has none")
        if self.instances == "packed":
            if self.mixture is not None or self.max_target_seq_len is not None:
                raise ConfigError("data.instances=packed takes neither data.mixture nor "
                                  "data.max_target_seq_len")
            return
        for name, default in (("source_group_size", 1), ("long_doc_strategy", "truncate"),
                              ("doc_lens", False)):
            if getattr(self, name) != default:
                raise ConfigError(f"data.{name} needs data.instances=packed "
                                  f"(got data.instances={self.instances})")

    def sources_set(self) -> list[str]:
        """The data sources this section names (``data.paths``, ...): exactly one for training."""
        on = {"paths": bool(self.paths), "mix": bool(self.mix), "embedded": self.embedded,
              "mixture": self.mixture is not None}
        return [f"data.{name}" for name in DATA_SOURCES if on[name]]

    def source(self) -> DataSource:
        """The one source this section names (a tagged view of the four fields); ConfigError
        when it names none."""
        named = self.sources_set()
        if not named:
            raise ConfigError("set exactly one of data.paths, data.mix, data.embedded, data.mixture "
                              "(got none)")
        return named[0].removeprefix("data.")  # type: ignore[return-value]


ComputeDtype = Literal["float32", "bfloat16"]
AttnImpl = Literal["auto", "xla", "chunked", "dot_product", "cudnn", "splash"]   # olmax.model.attention
PlatformProfile = Literal["auto", "cpu", "tpu", "gpu", "rocm"]   # olmax.platforms.PROFILE_NAMES
KernelSet = Literal["reference", "cpu", "norm"]   # olmax.model.kernels.KERNELS
AutoChoice = Literal["estimate", "memory"]   # olmax.train.fit
# olmax.model.runtime.REMAT_POLICIES; "auto": the least recomputation that fits (olmax.train.fit)
Remat = Literal["auto", "none", "full", "dots", "dots_no_batch", "save_outputs", "save_attn",
                "save_proj", "save_kernels"]


LENGTH_KEYS = ("max_steps", "max_epochs", "max_tokens")   # TrainConfig: one of them, the run's length
DEFAULT_MAX_STEPS = 100


@dataclass(frozen=True)
class TrainConfig:
    seq_len: int = 8192
    global_batch_size: int = 512         # sequences
    # Sequences per device per micro-step (None: the whole per-device batch, no accumulation);
    # "auto": the largest divisor of the per-device batch that is at most micro_batch_max and
    # whose compiled step fits the device (olmax.train.fit), so a recipe runs at every device
    # count dividing its batch and on every device it fits; a smaller one where auto_choice
    # says so.
    micro_batch_size: int | Literal["auto"] | None = None
    micro_batch_max: int | None = None   # the limit of micro_batch_size=auto (None: none); a number ignores it
    # How micro_batch_size=auto and remat=auto choose among the steps that fit (olmax.train.fit):
    # "estimate": where a table of rates measured on the device's own kind prices the compiled
    # step (v5e, H100, H200), the candidate with the least estimated step time (the memory rule's
    # choice unless another is estimated more than 1 % faster; smaller micro-batches of its
    # policy compiled while each is estimated faster); elsewhere as "memory". "memory": the
    # lightest policy and the largest micro-batch that fit. On a v5e chip a larger micro-batch can
    # be slower (olmo3-190m, 16 x 4096, no remat: micro-batch 4 1.038x the step time of 2; its
    # compiled program moves 12.9 % more bytes for the same FLOPs).
    auto_choice: AutoChoice = "estimate"
    # Device memory (GiB) a step may use: what auto fits into and every step is checked against
    # before it runs. None: what the device gives a program (TPU, GPU); nothing on the CPU.
    memory_limit_gib: float | None = None
    # The run's length, OLMo-core's max_duration: one of a step count, epochs of the data (epoch
    # numbers count as data.epoch does, from 1: 1 is the first epoch's end) or tokens (ceil of
    # tokens / (global_batch_size x seq_len) steps). None of them: 100 steps. The scheduler's
    # horizon is the resolved step count unless scheduler.t_max says otherwise; the trainer
    # resolves epochs and tokens when it has read the data (:meth:`TrainConfig.resolved`) and
    # writes the step count into the run's config.yaml.
    max_steps: int | None = None
    max_epochs: int | None = None
    max_tokens: int | None = None
    # OLMo-core's hard_stop: the run ends after this step even if its length (and the schedule's
    # horizon) is longer. None: at the end of its length.
    hard_stop: int | None = None
    compute_dtype: ComputeDtype = "float32"   # params and Adam state stay fp32
    attn_impl: AttnImpl = "xla"
    # Splash attention's block, for queries and keys in every pass: a multiple of 128. Larger
    # blocks run fewer kernel steps and compute more of the masked work at the causal diagonal
    # and the window's edge (OLMo 3 7B at 8,192: 1.06/1.12x the kept pairs at 512, 1.25/1.50x at
    # 2,048, full/windowed layers). MaxText's OLMo 3 launcher runs 2,048. Measured on a v5e chip,
    # steps interleaved, 1,024 against 512: 0.957x the step time (olmo3-600m, 8 x 4096, full remat),
    # 0.981x (olmo3-370m, 16 x 4096, save_proj), 0.987x (the 7B's layer shapes, 4 x 4096); 2,048
    # overflows libtpu's default scoped VMEM on v5e (16 MiB) at heads of 64, and fits olmax's 32.
    splash_block: int = 1024
    # Splash's backward in one kernel (dq computed in the dk/dv kernel, the probabilities
    # recomputed once instead of twice) instead of two; context parallelism keeps two. Measured on
    # a v5e chip, steps interleaved: 0.956x the two kernels' step time (olmo3-600m, 8 x 4096).
    splash_fused_bwd: bool = True
    # The layer scan unrolled into straight-line code (every layer's residuals in buffers of their
    # own) or one compiled body that stacks them; None: the platform profile's choice (unrolled on
    # the CPU and the TPU, rolled on GPUs). Unrolled, compile time grows with depth (about 1.8x
    # for 12-16 layers on a v5e chip).
    unroll_layers: bool | None = None
    # With micro-batches and the layers unrolled: the gradients taken with respect to each layer's
    # weights apart and summed into one accumulator per layer, stacked after the last micro-batch
    # (olmax.train.step.accumulate_gradients): the same sums (on one device bit for bit). On a v5e
    # chip, steps interleaved: 0.968x the stacked accumulation's step time (olmo3-370m, 16 x 4096,
    # micro-batch 2), and olmo3-600m at micro-batch 1 without remat fits and takes 0.845x its best
    # step before (8 x 4096, micro-batch 8, save_kernels); on a CPU 0.958x (olmo3_tiny).
    accumulate_by_layer: bool = True
    # Where accumulate_by_layer applies and the embeddings are untied: each micro-batch's
    # embedding gradient added to the table's fp32 accumulator row by row (a scatter-add of its
    # positions' rows) instead of as a whole table written per micro-batch and then added to the
    # accumulator whole (olmax.train.step.accumulate_gradients). The same sums in another order, a
    # repeated token's rows summed in fp32 rather than in the compute dtype. On a v5e chip, steps
    # interleaved: 0.986x the whole table's step time (olmo3-370m, 16 x 4096, micro-batch 1) and
    # 0.986x (olmo3-600m, 8 x 4096, micro-batch 1, 2,048-row loss chunks).
    accumulate_embedding_by_row: bool = True
    # What the backward pass recomputes instead of storing (olmax.model.runtime.REMAT_POLICIES);
    # "auto": the policy of olmax.train.fit.REMAT_LADDER with the least recomputation that fits.
    remat: Remat = "none"
    # How the model is computed (kernels, layer scan, RoPE tables, attn_impl=auto, loss chunks):
    # "auto" follows the devices; "cpu", "tpu", "gpu" force that platform's code path anywhere.
    profile: PlatformProfile = "auto"
    # The model's kernel set (olmax.model.kernels): "reference" (autodiff of the plain JAX
    # functions), "cpu" (backward passes written out for XLA's CPU backend), "norm" (reference
    # but for RMSNorm's written-out backward, which keeps the norm's input in the compute dtype
    # instead of an fp32 copy; on a v5e chip 1.008x and 1.059x the step time of reference, on
    # olmo3-370m and olmo3-600m); None: the platform profile's. The values are the same up to
    # fp32 summation order.
    kernels: KernelSet | None = None
    # The blocks' dense layers in float8 as OLMo 3's long-context stage (torchao's tensorwise
    # recipe; olmax.model.kernels.float8); only on devices with float8 matmuls.
    float8: bool = False
    z_loss_multiplier: float = 1e-5
    log_interval: int = 1
    # Seconds without a completed step (the first step, which compiles, excluded) after which
    # every thread's stack goes to RUN_DIR/hangs/ and the process exits 75 (None: no watchdog).
    watchdog_s: float | None = None
    # Context parallelism (mesh.context > 1) with split attention: gather the keys and values of
    # this many key heads at a time, one group after the other, to bound the gathered buffers
    # (AI2's llama3 head_stride). None, or a stride that does not divide a device's key heads: all
    # heads at once.
    context_head_stride: int | None = None
    # Rows of logits (positions x the micro-batch's sequences on a device) in one chunk of the
    # fused LM head and loss (olmax.train.loss); None: the platform profile's rule
    # (olmax.platforms.Profile.loss_chunk). The chunk's positions are the largest divisor of the
    # sequence at most rows / sequences.
    loss_chunk_rows: int | None = None
    # XLA compile options of the training step, "NAME=VALUE" (e.g.
    # "xla_tpu_scoped_vmem_limit_kib=98304"), over the platform's own
    # (olmax.platforms.compiler_options). They are per program, so `olmax bench ab` compares
    # compiler settings in one process, which LIBTPU_INIT_ARGS (read once, at start) cannot.
    compiler_options: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_choices(self, "train")
        check_positive(self, "train", "global_batch_size")
        lengths = [k for k in LENGTH_KEYS if getattr(self, k) is not None]
        for name in lengths + ["hard_stop"] * (self.hard_stop is not None):
            if not getattr(self, name) > 0:
                raise ConfigError(f"train.{name} must be positive (got {getattr(self, name)})")
        if len(lengths) > 1:
            raise ConfigError("set one of train.max_steps, train.max_epochs, train.max_tokens "
                              "(got " + ", ".join(f"train.{k}={getattr(self, k)}" for k in lengths)
                              + ")")
        if not lengths:
            object.__setattr__(self, "max_steps", DEFAULT_MAX_STEPS)
        check_positive(self, "train", "micro_batch_max", "watchdog_s", "context_head_stride", "loss_chunk_rows",
                       optional=True)
        check_number(self, "train", "memory_limit_gib", low=0, low_open=True, optional=True)
        if self.micro_batch_size != "auto":
            check_positive(self, "train", "micro_batch_size", optional=True)
        if self.seq_len <= 1:
            raise ConfigError(f"train.seq_len must be at least 2 (got {self.seq_len})")
        check_number(self, "train", "z_loss_multiplier", low=0)
        check_positive(self, "train", "log_interval")
        if self.splash_block < 128 or self.splash_block % 128:
            raise ConfigError(f"train.splash_block must be a positive multiple of 128 (got {self.splash_block})")
        self.compiler_options_dict()     # refused here, before anything compiles

    def compiler_options_dict(self) -> dict[str, str]:
        """``compiler_options`` as a dict; one that is not NAME=VALUE, or names an option twice,
        is a ConfigError."""
        out: dict[str, str] = {}
        for item in self.compiler_options:
            name, eq, value = str(item).partition("=")
            if not (eq and value and re.fullmatch(r"[a-z][a-z0-9_]*", name)):
                raise ConfigError(f"train.compiler_options: '{item}' is not NAME=VALUE (an XLA "
                                  "option, e.g. xla_tpu_scoped_vmem_limit_kib=98304; a value with "
                                  "commas is quoted: ['NAME=A,B'])")
            if name in out:
                raise ConfigError(f"train.compiler_options: '{name}' is given twice")
            out[name] = value
        return out

    @property
    def length(self) -> str:
        """The length as given: ``train.max_epochs=1``, ``train.max_tokens=100000000000``, ..."""
        key = next(k for k in LENGTH_KEYS if getattr(self, k) is not None)
        return f"train.{key}={getattr(self, key)}"

    def steps_for(self, batches_per_epoch: int, first_epoch: int = 1) -> int:
        """The step count of the run's length, as OLMo-core's trainer derives it from its
        max_duration on a fresh start: steps as given; epochs: ``batches_per_epoch`` for each
        epoch from ``first_epoch`` (data.epoch) to ``max_epochs``; tokens: ceil(tokens / tokens
        per step)."""
        if self.max_steps is not None:
            return self.max_steps
        if self.max_epochs is not None:
            return (self.max_epochs - first_epoch + 1) * batches_per_epoch
        assert self.max_tokens is not None
        return -(-self.max_tokens // (self.global_batch_size * self.seq_len))

    def resolved(self, batches_per_epoch: int, first_epoch: int = 1) -> "TrainConfig":
        """This section with its length as a step count (:meth:`steps_for`)."""
        return dataclasses.replace(self, max_steps=self.steps_for(batches_per_epoch, first_epoch),
                                   max_epochs=None, max_tokens=None)

    @property
    def last_step(self) -> int | None:
        """The step the run ends on (its length, or the hard stop before it); None while the
        length is in epochs or tokens."""
        if self.max_steps is None:
            return None
        return min(self.max_steps, self.hard_stop) if self.hard_stop else self.max_steps


@dataclass(frozen=True)
class OptimConfig:
    name: Literal["skip_step_adamw", "adamw"] = "skip_step_adamw"
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    no_decay: tuple[str, ...] = ("embed",)     # parameter names excluded from weight decay
    max_grad_norm: float = 1.0
    skip_steps: bool = True
    rolling_interval_length: int = 128
    sigma_factor: float = 6.0
    # Adam's step count before the first update. 1 is what OLMo-core's trainer leaves when its
    # checkpointer saves step 0 before training (AI2's official scripts): building the optimizer
    # state for that save runs a zero-gradient, zero-lr step that raises every parameter's count to 1.
    initial_adam_count: int = 0
    # OLMo-core's flag of the same name: false keeps Adam's step count where it starts (the
    # SkipStepAdamW bug before OLMo-core 2025-06-30: bias correction never advances).
    step_increment_bugfix: bool = True

    def __post_init__(self) -> None:
        check_choices(self, "optim")
        check_number(self, "optim", "lr", low=0)
        for i, beta in enumerate(self.betas):
            if not (isinstance(beta, (int, float)) and 0 <= beta < 1):
                raise ConfigError(f"optim.betas[{i}] must be in [0, 1) (got {shown(beta)})")
        check_number(self, "optim", "eps", low=0, low_open=True)
        check_number(self, "optim", "weight_decay", low=0)
        check_number(self, "optim", "max_grad_norm", low=0)   # 0: no clipping
        check_positive(self, "optim", "rolling_interval_length")
        check_number(self, "optim", "sigma_factor", low=0, low_open=True)
        if not 0 <= self.initial_adam_count < 2**31:
            raise ConfigError(f"optim.initial_adam_count must be an integer in [0, 2^31) "
                              f"(got {self.initial_adam_count})")


@dataclass(frozen=True)
class SchedulerConfig:
    name: Literal["constant", "cos_with_warmup", "half_cos_with_warmup",
                  "linear_with_warmup"] = "cos_with_warmup"
    warmup_steps: int = 2000
    alpha_f: float = 0.1
    t_max: int | None = None        # None: train.max_steps
    warmup_min_lr: float = 0.0

    def __post_init__(self) -> None:
        check_choices(self, "scheduler")
        if self.name != "constant" and self.warmup_steps < 0:
            raise ConfigError(f"scheduler.warmup_steps must be >= 0 (got {self.warmup_steps})")
        check_positive(self, "scheduler", "t_max", optional=True)
        check_number(self, "scheduler", "alpha_f", low=0)
        check_number(self, "scheduler", "warmup_min_lr", low=0)


@dataclass(frozen=True)
class CheckpointConfig:
    interval: int = 1000
    keep: int = 3
    permanent_interval: int | None = None
    async_save: bool = True

    def __post_init__(self) -> None:
        check_positive(self, "checkpoint", "interval", "keep")
        check_positive(self, "checkpoint", "permanent_interval", optional=True)


StartKind = Literal["none", "weights", "checkpoint", "optimizer", "resume"]
SEED_LIMIT = 2**63     # seeds are int64 for jax.random.key and non-negative for numpy's PCG64


def check_seed(value: int | None, key: str) -> None:
    if value is not None and not 0 <= value < SEED_LIMIT:
        raise ConfigError(f"{key} must be an integer in [0, 2^63) (got {value})")


@dataclass(frozen=True)
class InitConfig:
    seed: int | None = None          # model init seed (None: the run seed)
    hf_dir: str | None = None        # start from HF Olmo3ForCausalLM weights
    checkpoint: str | None = None    # start from an olmax or OLMo-core checkpoint (path or URL)
    load_optimizer: bool = False     # with checkpoint: carry Adam moments and step count
    # With checkpoint, as OLMo-core's flag: continue the checkpoint's run (its step + 1, its data
    # position, seed and schedule); false restarts step, data and schedule (a warm start).
    load_trainer_state: bool = False
    # The model comes from the checkpoint's config (olmax.interop.architecture): true lets the
    # recipe's model fields win where they differ (shapes must still agree).
    allow_architecture_override: bool = False
    # What the recipe must start from (checked by ``olmax train`` and ``olmax launch``,
    # :func:`check_start`): "weights" (init.checkpoint or init.hf_dir), "checkpoint"
    # (init.checkpoint), "optimizer" (init.checkpoint with init.load_optimizer), "resume" (the
    # run directory holds the checkpoint the recipe continues, or init.checkpoint with
    # init.load_optimizer and init.load_trainer_state); "none" overrides.
    required: StartKind = "none"

    def __post_init__(self) -> None:
        check_seed(self.seed, "init.seed")
        check_choices(self, "init")
        if self.load_trainer_state and not self.checkpoint:
            raise ConfigError("init.load_trainer_state=true needs init.checkpoint")

    def missing(self, resumes: bool | None = None) -> str | None:
        """What the start this section requires lacks, as one line, or None. ``resumes``: whether
        the run directory holds a checkpoint (None: not known here, as for ``olmax launch``)."""
        if self.required == "none":
            return None
        if self.required == "resume":
            if resumes is not False or (self.checkpoint and self.load_optimizer
                                        and self.load_trainer_state):
                return None
            return ("--run-dir must hold the checkpoint this recipe continues (init.required="
                    "resume): the run directory of the run it extends, or init.checkpoint with "
                    "init.load_optimizer=true and init.load_trainer_state=true; init.required=none "
                    "trains it from fresh weights instead")
        if self.required == "weights" and not (self.checkpoint or self.hf_dir):
            key, what = "init.checkpoint or init.hf_dir must be set", "trained weights"
        elif self.required != "weights" and not self.checkpoint:
            key, what = "init.checkpoint must be set", {
                "checkpoint": "a checkpoint",
                "optimizer": "a checkpoint with its optimizer state"}[self.required]
        elif self.required == "optimizer" and not self.load_optimizer:
            key, what = "init.load_optimizer must be true", "a checkpoint with its optimizer state"
        else:
            return None
        return (f"{key}: this recipe (init.required={self.required}) starts from {what}; "
                f"init.required=none trains it from fresh weights instead")


def check_start(cfg: "RunConfig", resumes: bool | None = None) -> None:
    """Refuse a run that lacks the start its recipe declares (``init.required``): ConfigError.
    ``resumes``: whether the run directory holds a checkpoint (None: not known)."""
    problem = cfg.init.missing(resumes)
    if problem is not None:
        raise ConfigError(problem)


@dataclass(frozen=True)
class DistributedConfig:
    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    # Seconds every process waits for the others to join (None: JAX's 300); a process whose peers
    # have not all come by then exits 75. ``olmax launch`` jobs set 1800.
    init_timeout_s: int | None = None

    def __post_init__(self) -> None:
        check_positive(self, "distributed", "init_timeout_s", "num_processes", optional=True)
        if self.coordinator is not None:
            check_coordinator(self.coordinator, "distributed.coordinator")
        if self.process_id is not None:
            if self.process_id < 0:
                raise ConfigError(f"distributed.process_id must be >= 0 (got {self.process_id})")
            if self.num_processes is not None and self.process_id >= self.num_processes:
                raise ConfigError(f"distributed.process_id ({self.process_id}) must be below "
                                  f"distributed.num_processes ({self.num_processes})")


def check_coordinator(address: str, key: str) -> str:
    """``HOST:PORT`` (``[IPv6]:PORT``), a port in 1..65535: what ``jax.distributed`` dials.
    Anything else is a ConfigError naming ``key`` (a config key or an environment variable)."""
    text = address.strip()
    if "://" in text or "/" in text:
        raise ConfigError(f"{key}: expected HOST:PORT, not a URL (got {shown(address)})")
    host, sep, port = text.rpartition(":")
    if not sep or not host.strip("[]"):
        raise ConfigError(f"{key}: expected HOST:PORT, got {shown(address)} (no "
                          f"{'port' if not sep else 'host'})")
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ConfigError(f"{key}: expected HOST:PORT with an IPv6 host in brackets "
                          f"([::1]:8476), got {shown(address)}")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(f"{key}: the port must be a number in 1..65535 (got {shown(address)})")
    return text


@dataclass(frozen=True)
class MeshConfig:
    data: int = 1
    fsdp: int = -1                  # -1: all remaining devices
    tensor: int = 1
    # Context parallelism: the sequence of every row split over this many devices
    # (olmax.parallel.mesh; parameters are sharded over fsdp x context).
    context: int = 1

    def __post_init__(self) -> None:
        sizes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor,
                 "context": self.context}
        if sum(s == -1 for s in sizes.values()) > 1:
            raise ConfigError("mesh: at most one of data/fsdp/tensor/context may be -1")
        for name, s in sizes.items():
            if s == 0 or s < -1:
                raise ConfigError(f"mesh.{name} must be a positive size or -1 (got {s})")


@dataclass(frozen=True)
class EvalConfig:
    """In-loop evaluation (``olmax.train.callbacks.evaluator``; OLMo-core LM + downstream evaluators)."""

    interval: int | None = None      # steps between in-loop evaluations (None: off)
    heldout: tuple[str, ...] = ()    # LABEL=PATH[,PATH] | PATH/glob | mix .txt | "embedded"
    tasks: tuple[str, ...] = ()      # OLMES task names or suites ("fast": OLMo 3 stage 1)
    limit: int | None = None         # first N documents of each downstream task (None: all)
    batch_size: int = 8
    heldout_max_docs: int | None = None   # first N documents of each held-out set (None: all)
    seq_len: int | None = None       # held-out instance length and request context (None: train.seq_len)
    on_start: bool = False           # also evaluate before the first step
    on_end: bool = True              # evaluate after the last step when it is not an eval step
    overlap_check: bool = True       # refuse held-out sets that overlap the training files
    allow_overlap: bool = False      # ... or only warn
    drop_overlapping: bool = False   # ... or evaluate without the overlapping documents
    overlap_max_train_tokens: int | None = 1_000_000_000   # scan budget (None: every token)

    def __post_init__(self) -> None:
        check_positive(self, "eval", "interval", "limit", "heldout_max_docs", "seq_len",
                  "overlap_max_train_tokens", optional=True)
        check_positive(self, "eval", "batch_size")


@dataclass(frozen=True)
class LoggingConfig:
    tensorboard: bool = True
    dashboard: bool = True           # RUN_DIR/dashboard.png at the end (matplotlib: ~2 s)
    wandb: bool = False
    wandb_project: str | None = None
    progress: bool = True
    # A run directory in a bucket: seconds between uploads of the metrics segment and the
    # TensorBoard events (also flushed at every checkpoint save and at the end)
    flush_s: float = 30.0

    def __post_init__(self) -> None:
        if isinstance(self.flush_s, bool) or not isinstance(self.flush_s, (int, float)) \
                or not self.flush_s > 0:
            raise ConfigError(f"logging.flush_s must be a positive number of seconds "
                              f"(got {self.flush_s!r})")


@dataclass(frozen=True)
class RunConfig:
    model: ModelConfig
    seed: int = 34521
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    init: InitConfig = field(default_factory=InitConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def __post_init__(self) -> None:
        """The rules between sections (each section checked its own values when it was built)."""
        check_seed(self.seed, "seed")
        t, model = self.train, self.model
        if t.seq_len > model.max_seq_len and model.rope_scaling is None:
            raise ConfigError(f"train.seq_len {t.seq_len} exceeds model.max_seq_len {model.max_seq_len}")
        sch = self.scheduler
        if (sch.name != "constant" and sch.warmup_steps > 0
                and not sch.warmup_min_lr < self.optim.lr):
            raise ConfigError(f"scheduler.warmup_min_lr ({sch.warmup_min_lr}) must be in "
                              f"[0, optim.lr) (optim.lr is {self.optim.lr})")
        if t.max_epochs is not None and t.max_epochs < self.data.epoch:
            raise ConfigError(f"train.max_epochs ({t.max_epochs}) is before data.epoch "
                              f"({self.data.epoch}), where the run starts: epochs count from 1, "
                              "as OLMo-core's")
        if t.seq_len % self.mesh.context:
            raise ConfigError(f"train.seq_len {t.seq_len} must be divisible by mesh.context "
                              f"{self.mesh.context} (each device holds an equal block of positions)")


# Tagged sections: an override of one of these keys replaces what the section held
# (olmax.config.load.apply_overrides): a data source, the run's length.
ONE_OF: dict[tuple[str, ...], tuple[str, ...]] = {("data",): DATA_SOURCES, ("train",): LENGTH_KEYS}


@dataclass(frozen=True)
class ModelSpec:
    """A recipe's ``model`` section as written: a preset name and the fields given, each already
    checked against :class:`ModelConfig`'s types (a field left out is not in ``fields``; a preset
    stands for all of its fields). :func:`olmax.model.presets.resolve_model` turns it, with the
    weights' own config when there are weights, into the ModelConfig."""

    preset: str | None = None
    fields: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, section: Any, path: str = "model") -> "ModelSpec":
        if section is None:
            return cls()
        if not isinstance(section, Mapping):
            raise ConfigError(f"{path}: expected a mapping (a preset and fields), got "
                              f"{type(section).__name__} {shown(section)}")
        fields = typed_fields(ModelConfig, section, path, also=("preset",))
        preset = fields.pop("preset", None)
        if preset is not None and not isinstance(preset, str):
            raise ConfigError(f"{path}.preset: expected str, got {shown(preset)}")
        return cls(preset, fields)

    @classmethod
    def of(cls, model: ModelConfig) -> "ModelSpec":
        """Every field of ``model`` given."""
        return cls(None, {f.name: getattr(model, f.name) for f in dataclasses.fields(model)})

    def __bool__(self) -> bool:
        return self.preset is not None or bool(self.fields)


@dataclass(frozen=True)
class RunSpec:
    """A recipe (overrides applied), every section typed and checked once, before the model is
    resolved: :class:`RunConfig`'s sections, with the model as a :class:`ModelSpec`."""

    model: ModelSpec
    sections: Mapping[str, Any]      # RunConfig's other fields that the recipe gives, typed

    @classmethod
    def parse(cls, raw: Any) -> "RunSpec":
        if not isinstance(raw, Mapping):
            raise ConfigError(f"a run configuration is a mapping of sections, got "
                              f"{type(raw).__name__} {shown(raw)}")
        sections = typed_fields(RunConfig, raw, also=("model",))
        return cls(ModelSpec.parse(sections.pop("model", None)), sections)

    @property
    def init(self) -> InitConfig:
        return self.sections.get("init") or InitConfig()

    def finish(self, model: ModelConfig, **replaced: Any) -> RunConfig:
        """The RunConfig with ``model`` (its own checks hold the rules between sections);
        ``replaced``: sections the resolution changed (a mix name found on disk)."""
        return build(RunConfig, {**self.sections, **replaced, "model": model})


__all__ = [
    "ModelConfig", "YarnConfig", "QkNorm", "BlockType", "QK_NORM_SCOPES", "BLOCK_TYPES",
    "RunConfig", "DataConfig", "TokenizerConfig", "TOKEN_ID_FIELDS", "SourceMixtureConfig",
    "MixtureSourceConfig", "TokenDtype",
    "DataSource", "DATA_SOURCES", "TrainConfig", "LENGTH_KEYS", "ComputeDtype", "AttnImpl", "PlatformProfile", "KernelSet", "AutoChoice",
    "Remat", "OptimConfig", "SchedulerConfig", "CheckpointConfig", "InitConfig", "SEED_LIMIT",
    "check_seed", "check_coordinator", "check_start", "StartKind", "DistributedConfig",
    "MeshConfig", "EvalConfig", "LoggingConfig", "ONE_OF",
    "ModelSpec", "RunSpec",
]
