"""OLMo-core mix files: ``label,path`` lines, ``{TOKENIZER}`` placeholder (``data/mixes/__init__.py``).

Blank lines and ``#`` comments are skipped; every other line is ``label,path`` and the path must
contain ``{TOKENIZER}`` (OLMo-core rejects it otherwise). OLMo 3 mixes are stored under
``allenai/dolma3-tokenizer`` (identical to dolma2), the default substitution here.

Where the files live: each path is joined to ``root`` (OLMo-core's ``base_dir``; default: the mix
file's folder), then the first matching ``OLD=NEW`` prefix rewrite of ``remap`` is applied, e.g.
``s3://ai2-llm/=/mnt/ai2-llm/``. The root (or a remapped path) may be an ``s3://``, ``gs://`` or
``http(s)://`` URL: such files are read in place (:mod:`olmax.data.remote`); local files must
exist when the mix is read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from olmax.errors import ConfigError, OlmaxError
from olmax.data.remote import is_remote
from olmax.io import read_text

DEFAULT_MIX_TOKENIZER = "allenai/dolma3-tokenizer"


@dataclass(frozen=True)
class MixEntry:
    label: str
    path: str
    line: int


def parse_remap(remap: Sequence[str]) -> list[tuple[str, str]]:
    out = []
    for item in remap:
        if "=" not in item:
            raise ConfigError(f"data.remap: expected OLD=NEW, got {item!r}")
        old, new = item.split("=", 1)
        out.append((old, new))
    return out


def apply_remap(path: str, remap: list[tuple[str, str]]) -> str:
    for old, new in remap:
        if path.startswith(old):
            return new + path[len(old):]
    return path


def read_mix_file(mix: str, *, root: str | None = None, tokenizer: str = DEFAULT_MIX_TOKENIZER,
                  remap: Sequence[str] = ()) -> list[MixEntry]:
    """Resolved entries of a mix file, in file order. Errors name the mix file and line."""
    mix_path = Path(mix)
    try:
        text = read_text(mix_path)
    except FileNotFoundError:
        raise OlmaxError(f"mix file not found: {mix}") from None
    except OSError as e:
        raise OlmaxError(f"cannot read mix file {mix}: {e.strerror}") from None
    base = root if root is not None else str(mix_path.parent)
    if not base.endswith("/"):
        base += "/"
    rules = parse_remap(remap)
    entries: list[MixEntry] = []
    for n, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(",")
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise OlmaxError(f"{mix}:{n}: expected 'label,path', got {line!r}")
        label, rel = parts
        if "{TOKENIZER}" not in rel:
            raise OlmaxError(f"{mix}:{n}: path has no {{TOKENIZER}} placeholder: {rel!r}")
        path = rel.replace("{TOKENIZER}", tokenizer)
        if not (path.startswith("/") or "://" in path):
            path = base + path
        entries.append(MixEntry(label, apply_remap(path, rules), n))
    if not entries:
        raise OlmaxError(f"mix file {mix} lists no files")
    foreign = [e for e in entries if "://" in e.path and not is_remote(e.path)]
    if foreign:
        e = foreign[0]
        raise OlmaxError(f"{mix}:{e.line}: unsupported URL scheme in {e.path} (s3://, gs://, "
                         f"http:// and https:// are read in place; or map it with data.remap)")
    missing = [e for e in entries if not is_remote(e.path) and not Path(e.path).is_file()]
    if missing:
        e = missing[0]
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise OlmaxError(f"{mix}:{e.line}: file not found: {e.path}{more} "
                         f"(set the root with --root / data.root, or data.remap)")
    return entries
