"""Tokenize text into OLMo token files: each document's tokens then one EOS, raw little-endian uint32.

Inputs (files, or folders searched recursively for these suffixes, sorted):

* ``.jsonl`` / ``.jsonl.gz`` / ``.jsonl.zst`` (also ``.json.gz``/``.json.zst``): one JSON object per
  line, the document in a string field (``text`` by default);
* ``.parquet``: the document column (``text`` by default);
* anything else: a plain UTF-8 text file, one document.

Documents with empty text are skipped (counted in the manifest); an input without any document, an
unreadable line, a missing field, invalid UTF-8 or a token id >= the vocab size is an
:class:`OlmaxError` naming the file (and line).

Work is cut into *groups* of consecutive inputs (about ``group_bytes`` of input each; a larger plain
JSONL file is cut into byte ranges at line starts, so one big file still uses every worker). Group g writes
``part-GGGGG-JJJJ.npy`` files of at most ``max_file_tokens`` tokens (split at document boundaries;
a longer single document gets a file of its own) into a temporary folder, then moves them into place
and records ``.progress/GGGGG.json``; groups run in worker processes. An interrupted run resumes
group by group (same inputs and settings required); every file is complete or absent. When all
groups are done, ``manifest.json`` lists every file (documents, tokens, sha256) in order with the
tokenizer identity; it is written last, atomically.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import multiprocessing as mp
import os
import shutil
import time
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence


import zstandard
from tqdm import tqdm

from olmax.errors import ConfigError, OlmaxError
from olmax.data.token_files import DocumentWriter
from olmax.data.tokenizer import get_tokenizer, token_dtype
from olmax.io import write_bytes_atomic

_log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
PROGRESS_DIR = ".progress"
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")
_BATCH_DOCS = 256


@dataclass(frozen=True)
class TokenizeSettings:
    tokenizer: str = "dolma2"
    text_field: str = "text"
    max_file_tokens: int = 1 << 28   # 1 GiB of uint32 per output file
    group_bytes: int = 32 << 20      # input bytes per unit of work


@dataclass
class GroupResult:
    group: int
    files: list[dict[str, Any]] = field(default_factory=list)
    documents: int = 0
    tokens: int = 0
    skipped_empty: int = 0
    input_bytes: int = 0
    range_documents: dict[str, int] = field(default_factory=dict)  # per split input, this range's count


# -- inputs -------------------------------------------------------------------------------------

def _kind(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(PARQUET_SUFFIXES):
        return "parquet"
    return "text"


def expand_inputs(inputs: Sequence[str]) -> list[Path]:
    """Files as given; folders expanded to their supported files (sorted). Errors name the path."""
    if not inputs:
        raise ConfigError("tokenize: no input given")
    out: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(q for q in p.rglob("*") if q.is_file() and not q.name.startswith(".")
                           and q.name.lower().endswith(JSONL_SUFFIXES + PARQUET_SUFFIXES + TEXT_SUFFIXES))
            if not found:
                raise OlmaxError(f"{p}: folder holds no .jsonl[.gz|.zst], .parquet or text files")
            out.extend(found)
        elif p.is_file():
            out.append(p)
        else:
            raise OlmaxError(f"input not found: {p}")
    return out


def _open_lines(path: Path) -> io.BufferedIOBase:
    name = path.name.lower()
    if name.endswith(".gz"):
        return gzip.open(path, "rb")
    if name.endswith(".zst"):
        return io.BufferedReader(zstandard.open(path, "rb"))  # the raw reader cannot iterate lines
    return open(path, "rb")


def _splittable(path: Path) -> bool:
    """Uncompressed JSONL can be cut into byte ranges at line starts."""
    return path.name.lower().endswith((".jsonl", ".ndjson"))


def _line_number(path: Path, pos: int) -> int:
    """1-based number of the line starting at byte ``pos`` (only computed for error messages)."""
    count = 0
    with open(path, "rb") as f:
        remaining = pos
        while remaining > 0:
            chunk = f.read(min(remaining, 1 << 22))
            if not chunk:
                break
            count += chunk.count(b"\n")
            remaining -= len(chunk)
    return count + 1


def _jsonl_lines(path: Path, start: int, end: int | None) -> Iterator[tuple[int | None, int, bytes]]:
    """(line number or None, byte offset, raw line) of the lines that *start* in [start, end)."""
    if start == 0 and end is None:
        with _open_lines(path) as f:
            for n, raw in enumerate(f, start=1):
                yield n, -1, raw
        return
    with open(path, "rb") as f:
        if start > 0:
            f.seek(start - 1)
            f.readline()  # the rest of a line that started before this range
        pos = f.tell()
        while end is None or pos < end:
            raw = f.readline()
            if not raw:
                break
            yield None, pos, raw
            pos += len(raw)


def iter_documents(path: Path, text_field: str, start: int = 0,
                   end: int | None = None) -> Iterator[str]:
    """Document texts of one input, in order (empty ones included).

    ``start``/``end`` (plain JSONL only) restrict it to the lines starting in that byte range.
    """
    kind = _kind(path)
    if kind == "text":
        try:
            yield path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise OlmaxError(f"{path}: not valid UTF-8 at byte {e.start}") from None
        return
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as e:
            raise OlmaxError(f"{path}: cannot read Parquet: {e}") from None
        if text_field not in pf.schema_arrow.names:
            raise OlmaxError(f"{path}: no column {text_field!r} (columns: {', '.join(pf.schema_arrow.names)})")
        row = 0
        for batch in pf.iter_batches(columns=[text_field], batch_size=1024):
            for value in batch.column(0).to_pylist():
                row += 1
                if not isinstance(value, str):
                    raise OlmaxError(f"{path}: row {row}: column {text_field!r} is not a string")
                yield value
        return
    try:
        for n, pos, raw in _jsonl_lines(path, start, end):
            if not raw.strip():
                continue
            where = lambda n=n, pos=pos: f"{path}:{n if n is not None else _line_number(path, pos)}"  # noqa: E731
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise OlmaxError(f"{where()}: unreadable JSON line ({e})") from None
            if not isinstance(obj, dict) or text_field not in obj:
                raise OlmaxError(f"{where()}: no {text_field!r} field")
            text = obj[text_field]
            if not isinstance(text, str):
                raise OlmaxError(f"{where()}: field {text_field!r} is not a string")
            yield text
    except (OSError, EOFError, zlib.error) as e:  # truncated/corrupt compressed input
        if isinstance(e, FileNotFoundError):
            raise OlmaxError(f"input not found: {path}") from None
        raise OlmaxError(f"{path}: cannot read ({'corrupt compressed data: ' if isinstance(e, zlib.error) else ''}"
                         f"{e})") from None
    except Exception as e:
        if type(e).__module__.startswith("zstandard"):
            raise OlmaxError(f"{path}: cannot read: {e}") from None
        raise


def plan_groups(paths: Sequence[Path], group_bytes: int) -> list[list[list]]:
    """Units of work: lists of segments ``[input index, start byte, end byte or None]``.

    Consecutive small inputs share a group of about ``group_bytes``; a plain JSONL file larger than
    that is cut into byte ranges (a line belongs to the range it starts in), one group each.
    """
    groups: list[list[list]] = []
    current: list[list] = []
    size = 0
    for i, p in enumerate(paths):
        n = p.stat().st_size
        if n > group_bytes and _splittable(p):
            if current:
                groups.append(current)
                current, size = [], 0
            for start in range(0, n, group_bytes):
                end = start + group_bytes
                groups.append([[i, start, end if end < n else None]])
            continue
        current.append([i, 0, None])
        size += n
        if size >= group_bytes:
            groups.append(current)
            current, size = [], 0
    if current:
        groups.append(current)
    return groups


# -- workers ------------------------------------------------------------------------------------

_WORKER_TOKENIZER: Any = None


def _worker_init(tokenizer: str) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = get_tokenizer(tokenizer)


def _tokenize_group(task: tuple[int, list[tuple[str, int, int | None]], str, TokenizeSettings]) -> GroupResult:
    """Tokenize one group of input segments into ``out/part-GGGGG-JJJJ.npy``; returns what it wrote."""
    group, segments, out_dir, settings = task
    tok = _WORKER_TOKENIZER
    if tok is None:
        _worker_init(settings.tokenizer)
        tok = _WORKER_TOKENIZER
    out = Path(out_dir)
    tmp = out / f".tmp-group-{group:05d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    result = GroupResult(group)
    writer = DocumentWriter(tmp, lambda k: f"part-{group:05d}-{k:04d}.npy",
                            max_tokens=settings.max_file_tokens, dtype=token_dtype(tok.vocab_size),
                            eos_token_id=tok.eos_token_id, vocab_size=tok.vocab_size)

    def add(path: str, texts: list[str]) -> None:
        for ids in tok.encode_batch(texts):
            writer.add(ids, path)

    try:
        for path, start, end in segments:
            p = Path(path)
            whole = start == 0 and end is None
            result.input_bytes += (p.stat().st_size if end is None else end) - start
            texts: list[str] = []
            kept = 0
            for text in iter_documents(p, settings.text_field, start, end):
                if not text:
                    result.skipped_empty += 1
                    continue
                texts.append(text)
                kept += 1
                if len(texts) >= _BATCH_DOCS:
                    add(path, texts)
                    texts = []
            if texts:
                add(path, texts)
            if whole and kept == 0:
                raise OlmaxError(f"{p}: empty input (no non-empty document)")
            if not whole:
                result.range_documents[path] = kept  # emptiness is judged over all its ranges
        writer.flush()
        result.files, result.documents, result.tokens = writer.files, writer.documents, writer.tokens
        for f in result.files:  # every file is complete: move them into place
            os.replace(tmp / f["path"], out / f["path"])
        write_bytes_atomic(out / PROGRESS_DIR / f"{group:05d}.json",
                           json.dumps(asdict(result)).encode())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


# -- driver -------------------------------------------------------------------------------------

def _input_record(p: Path) -> dict[str, Any]:
    st = p.stat()
    return {"path": str(p), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def tokenize_files(inputs: Sequence[str], out_dir: str, settings: TokenizeSettings = TokenizeSettings(),
                   *, workers: int = 1, progress: bool = True,
                   log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Tokenize ``inputs`` into ``out_dir``; returns the manifest. Resumes an interrupted run.
    Status lines go to ``log`` (default: this module's logger)."""
    log = log or _log.info
    if settings.max_file_tokens <= 0:
        raise ConfigError("tokenize: the file size limit must be positive")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise OlmaxError(f"output folder {out} exists and is not a folder")
    paths = expand_inputs(inputs)
    tok = get_tokenizer(settings.tokenizer)
    records = [_input_record(p) for p in paths]
    groups = plan_groups(paths, settings.group_bytes)
    _start_or_resume(out, {"settings": asdict(settings), "tokenizer": tok.identity, "inputs": records,
                           "groups": groups})
    done: dict[int, GroupResult] = {}
    for g in range(len(groups)):
        marker = out / PROGRESS_DIR / f"{g:05d}.json"
        if marker.is_file():
            done[g] = GroupResult(**json.loads(marker.read_text()))
    todo = [(g, [(str(paths[i]), start, end) for i, start, end in groups[g]], str(out), settings)
            for g in range(len(groups)) if g not in done]
    if done:
        log(f"resuming: {len(done)} of {len(groups)} groups already done")
    t0 = time.perf_counter()
    new_tokens = _run_groups(todo, done, settings, workers,
                             total_bytes=sum(r["bytes"] for r in records) if progress else None)
    seconds = time.perf_counter() - t0
    manifest = _manifest([done[g] for g in range(len(groups))], tok, settings, records)
    write_bytes_atomic(out / MANIFEST, json.dumps(manifest, indent=1).encode())
    shutil.rmtree(out / PROGRESS_DIR, ignore_errors=True)
    manifest["_seconds"] = seconds
    manifest["_new_tokens"] = new_tokens
    return manifest


def _start_or_resume(out: Path, plan: dict[str, Any]) -> None:
    """Write the plan into a new (or empty) ``out``; a run of the same plan resumes, one of another
    plan with groups done (or a finished tokenization) is refused."""
    plan_path = out / PROGRESS_DIR / "plan.json"
    if (out / MANIFEST).exists():
        raise OlmaxError(f"{out / MANIFEST} exists: {out} already holds a finished tokenization "
                         f"(choose another --out)")
    if plan_path.exists():
        started = list((out / PROGRESS_DIR).glob("[0-9]*.json"))
        if json.loads(plan_path.read_text()) != plan:
            if started:
                raise OlmaxError(f"{out} holds an unfinished tokenization of other inputs or settings "
                                 f"(resume with the same ones, or delete the folder)")
            write_bytes_atomic(plan_path, json.dumps(plan, indent=1).encode())  # nothing done yet
    else:
        if out.exists() and any(p for p in out.iterdir()):
            raise OlmaxError(f"{out} is not empty; refusing to write into it")
        write_bytes_atomic(plan_path, json.dumps(plan, indent=1).encode())


def _run_groups(todo: list, done: dict[int, GroupResult], settings: TokenizeSettings, workers: int,
                total_bytes: int | None) -> int:
    """Tokenize the groups of ``todo`` (in worker processes when ``workers > 1``), recording each
    in ``done``; a progress bar over ``total_bytes`` when given. Returns the tokens written."""
    bar = None
    if total_bytes is not None:
        bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="tokenize",
                   initial=sum(r.input_bytes for r in done.values()))
    new_tokens = 0

    def record(res: GroupResult) -> None:
        nonlocal new_tokens
        done[res.group] = res
        new_tokens += res.tokens
        if bar is not None:
            bar.update(res.input_bytes)
            bar.set_postfix(tokens=f"{new_tokens:.3g}")

    ok = False
    try:
        if workers > 1 and len(todo) > 1:
            ctx = mp.get_context("spawn")
            with ctx.Pool(min(workers, len(todo)), initializer=_worker_init,
                          initargs=(settings.tokenizer,)) as pool:
                for res in pool.imap_unordered(_tokenize_group, todo):
                    record(res)
        else:
            for task in todo:
                record(_tokenize_group(task))
        ok = True
    finally:
        if bar is not None:
            bar.leave = ok    # a failed run's bar is cleared: its error line stands alone
            bar.close()
    return new_tokens


def _manifest(results: list[GroupResult], tok: Any, settings: TokenizeSettings,
              records: list[dict]) -> dict[str, Any]:
    """The manifest of a finished tokenization (groups in order); an empty input is an error."""
    split_docs: dict[str, int] = {}
    for r in results:
        for path, n in r.range_documents.items():
            split_docs[path] = split_docs.get(path, 0) + n
    for path, n in split_docs.items():
        if n == 0:
            raise OlmaxError(f"{path}: empty input (no non-empty document)")
    manifest = {
        "format": "olmo raw token files: headerless little-endian, each document + one EOS",
        "dtype": token_dtype(tok.vocab_size).name,
        "tokenizer": tok.identity,
        "text_field": settings.text_field,
        "max_file_tokens": settings.max_file_tokens,
        "documents": sum(r.documents for r in results),
        "tokens": sum(r.tokens for r in results),
        "skipped_empty": sum(r.skipped_empty for r in results),
        "inputs": records,
        "files": [f for r in results for f in r.files],
    }
    if manifest["documents"] == 0:
        raise OlmaxError("tokenize: the inputs hold no non-empty document")
    return manifest
