"""Run directories in a bucket: ``s3://BUCKET/PATH`` and ``gs://BUCKET/PATH``.

Wherever olmax takes a run directory it may be a bucket path; the run's files are then objects
below it and no host needs a shared file system. This module is the objects' side of
:mod:`olmax.io`: whole-object reads and writes (a PUT is atomic: a reader sees the old object or
the new one, never half), listings, deletes, and the two conditional writes the run lock is built
on (:mod:`olmax.bucket_lock`): *create if absent* (S3 ``If-None-Match: *``, GCS
``ifGenerationMatch=0``) and *replace if unchanged* (S3 ``If-Match: ETAG``, GCS
``ifGenerationMatch=GENERATION``).

Credentials and endpoints are the ecosystem's own, as for token files read from buckets
(:mod:`olmax.data.remote`): for ``s3://`` the standard AWS environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_DEFAULT_REGION``/``AWS_REGION``,
``AWS_PROFILE``, and ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT_URL_S3`` for an S3-compatible store);
for ``gs://`` Google's application-default credentials (``GOOGLE_APPLICATION_CREDENTIALS``, the
metadata server on a TPU VM or GKE node) and ``STORAGE_EMULATOR_HOST`` for an emulator. The same
settings reach TensorStore, which writes the checkpoints' arrays (:func:`tensorstore_kvstore`).

Every request goes through :func:`olmax.transport.retried`, which decides what a failure means
for every command that reads or writes remotely: retried on what may pass (a dropped or refused
connection, a timeout, HTTP 5xx or 429), a :class:`~olmax.errors.RestartableError` (exit 75)
after the last try; one line at once for what a retry cannot cure (a bucket that does not exist,
a denied request), and a ConfigError before any request for an endpoint variable that is not a URL.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import secrets
import threading
import time
import types
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, TypeVar
from urllib.parse import quote

import fsspec

from olmax import transport
from olmax.errors import ConfigError, OlmaxError
from olmax.io import write_bytes_atomic
from olmax.transport import (BUCKET_NAME, NotFound, check_endpoints, connection_trouble, error_code,
                             final_error, http_status, url_scheme)

log = logging.getLogger(__name__)

SCHEMES = ("s3", "gs")

T = TypeVar("T")


# ----------------------------------------------------------------------------------------------
# Paths


def is_bucket(path: Any) -> bool:
    """Whether ``path`` is a bucket path (``s3://`` or ``gs://``); text that looks like a URL but
    is not one (``s3:/b/x``) is a ConfigError (:func:`olmax.transport.url_scheme`)."""
    return (isinstance(path, str) and url_scheme(path) in SCHEMES
            and path.split("://", 1)[0].lower() in SCHEMES)


def bucket_path(text: str, what: str = "--run-dir") -> str:
    """``text`` as a normalised bucket path (``scheme://bucket/key`` without a trailing slash);
    a malformed one is a ConfigError naming ``what``."""
    scheme, _, rest = text.partition("://")
    bucket, _, key = rest.partition("/")
    key = "/".join(p for p in key.split("/") if p not in ("", "."))
    if not BUCKET_NAME.fullmatch(bucket):
        raise ConfigError(f"{what} {text}: {bucket!r} is not a bucket name (expected "
                          f"{scheme.lower()}://BUCKET/PATH)")
    if ".." in key.split("/"):
        raise ConfigError(f"{what} {text}: '..' in a bucket path")
    return f"{scheme.lower()}://{bucket}" + (f"/{key}" if key else "")


def split(url: str) -> tuple[str, str, str]:
    """``s3://b/k/x`` -> ``("s3", "b", "k/x")``."""
    scheme, _, rest = url.partition("://")
    bucket, _, key = rest.partition("/")
    return scheme, bucket, key


def join(root: str | os.PathLike, *parts: str) -> Any:
    """``parts`` below ``root``: a bucket path (str) or a local :class:`~pathlib.Path`."""
    if is_bucket(root):
        tail = "/".join(p.strip("/") for p in parts if p.strip("/"))
        return str(root).rstrip("/") + ("/" + tail if tail else "")
    return Path(root).joinpath(*parts)


def run_location(run_dir: str | os.PathLike) -> Any:
    """A run directory as olmax keeps it: a normalised bucket path (str), else a Path. Text that
    looks like a URL but is not one (``s3:/bucket/run``) is refused, not made a local folder."""
    if isinstance(run_dir, str) and "://" in run_dir:
        if run_dir.split("://", 1)[0].lower() not in SCHEMES:
            raise ConfigError(f"--run-dir {run_dir}: only s3:// and gs:// bucket paths (or a local "
                              f"directory) can hold a run")
        return bucket_path(run_dir)
    url_scheme(run_dir, "--run-dir")
    return Path(run_dir)


def refuse_bucket(path: Any, what: str, why: str = "a local directory") -> None:
    """One line when a command that needs a local path is given a bucket path."""
    if is_bucket(str(path)):
        raise OlmaxError(f"{what} {path}: a bucket path; this needs {why} (copy it first, "
                         f"e.g. gcloud storage cp -r / aws s3 cp --recursive)")


# ----------------------------------------------------------------------------------------------
# Filesystems and errors (shared with olmax.data.remote)


_FS: dict[tuple[int, str, str | None], Any] = {}
_FS_LOCK = threading.Lock()


def new_filesystem(proto: str, *, one_try: bool = False):
    """A fresh fsspec filesystem for ``proto``. For GCS: gcsfs's plain ``GCSFileSystem`` (its
    default class first looks the bucket's layout up through another API, slowly when that API
    cannot be reached), with gcsfs's own retry loop off (it sleeps up to 31 s per request and
    logs a traceback when it gives up; olmax's loop retries instead). ``one_try``: s3fs's and
    botocore's retry loops off too (the run directory's requests: :func:`retried` is the loop).
    An endpoint variable that is not a URL is a ConfigError here, before any request."""
    check_endpoints(proto)
    if proto == "s3" and one_try:
        fs = fsspec.filesystem("s3", skip_instance_cache=True,
                               config_kwargs={"retries": {"max_attempts": 1, "mode": "standard"}})
        fs.retries = 1
        return fs
    if proto not in ("gs", "gcs"):
        return fsspec.filesystem(proto, skip_instance_cache=True)
    from gcsfs.core import GCSFileSystem   # the package's name is the layout-looking subclass

    fs = GCSFileSystem(skip_instance_cache=True)
    once = getattr(GCSFileSystem._request, "__wrapped__", None)
    if once is not None:
        fs._request = types.MethodType(once, fs)
    return fs


def filesystem(url: str):
    """The process's filesystem for ``url``'s scheme (one per scheme, process id and endpoint);
    the scheme's endpoint variables checked on every call, a cached filesystem or not."""
    proto = split(url)[0]
    check_endpoints(proto)
    key = (os.getpid(), proto, _endpoint(proto))
    with _FS_LOCK:
        fs = _FS.get(key)
        if fs is None:
            try:
                fs = _FS[key] = new_filesystem(proto, one_try=True)
            except ImportError as e:
                raise OlmaxError(f"{url}: {proto}:// needs {e.name} (pip install 'olmax' brings "
                                 f"it)") from None
    return fs


_LIB_FS: dict[tuple[int, str, str | None], Any] = {}


def _on_olmax_schedule(once: Callable) -> Callable:
    """gcsfs's request ``once`` (its retry loop taken off), retried where gcsfs would retry it
    (``gcsfs.retry.is_retriable``: a dropped or refused connection, HTTP 408, 429, 5xx; never a
    404), on olmax's schedule: :data:`~olmax.transport.ATTEMPTS` tries, waits from
    :data:`~olmax.transport.BACKOFF_S` doubling to :data:`~olmax.transport.MAX_BACKOFF_S`, as
    TensorStore's requests and olmax's own. gcsfs's loop makes 6 tries with waits of 1-2, 2-3,
    4-5, 8-9 and 16-17 s: on a store that is gone, each of Orbax's directory requests held a
    failed save (and the exit after it) for half a minute."""
    import asyncio

    from gcsfs.retry import is_retriable

    async def request(self, *args, **kwargs):
        delay = transport.BACKOFF_S
        for n in range(1, transport.ATTEMPTS + 1):
            try:
                return await once(self, *args, **kwargs)
            except Exception as e:
                if n == transport.ATTEMPTS or http_status(e) == 404 or not is_retriable(e):
                    raise
            await asyncio.sleep(delay)
            delay = min(2 * delay, transport.MAX_BACKOFF_S)
        raise AssertionError("unreachable")

    return request


def library_filesystem(url: str):
    """The filesystem a library's own requests use (Orbax's directory operations, through
    ``etils.epath``): one per scheme, process and endpoint, with the client's own retries (for
    GCS on olmax's schedule: :func:`_on_olmax_schedule`), and for GCS gcsfs's plain class (see
    :func:`new_filesystem`)."""
    proto = split(url)[0]
    check_endpoints(proto)
    key = (os.getpid(), proto, _endpoint(proto))
    with _FS_LOCK:
        fs = _LIB_FS.get(key)
        if fs is None:
            if proto == "s3":    # s3fs's retries (5, short sleeps), not botocore's too
                fs = fsspec.filesystem("s3", skip_instance_cache=True, config_kwargs={
                    "retries": {"max_attempts": 1, "mode": "standard"}})
            else:
                from gcsfs.core import GCSFileSystem

                fs = GCSFileSystem(skip_instance_cache=True)
                once = getattr(GCSFileSystem._request, "__wrapped__", None)
                if once is not None:
                    fs._request = types.MethodType(_on_olmax_schedule(once), fs)
            _LIB_FS[key] = fs
    return fs


def precondition_failed(e: BaseException) -> bool:
    """A conditional write the store refused because the object exists or changed (HTTP 412,
    or 409 for a concurrent create)."""
    return (http_status(e) in (409, 412) or isinstance(e, FileExistsError)
            or "PreconditionFailed" in error_code(e) or "pre-condition" in str(e).lower())


def _refused_answer(e: BaseException) -> bool:
    """A conditional write's refusal, which its caller reads as an answer (not a failure)."""
    return precondition_failed(e) and not connection_trouble(e)


def retried(url: str, what: str, attempt: Callable[[], T], *, quiet: bool = False) -> T:
    """``attempt()`` retried by :func:`olmax.transport.retried` (what a failure means is decided
    there); a conditional write's refusal is passed on to the caller as it is."""
    return transport.retried(url, what, attempt, quiet=quiet, noun="object",
                             passthrough=_refused_answer)


def _unless_absent(url: str, e: BaseException) -> None:
    """Raise what a missing object's error says beyond its absence (a missing bucket, a denied
    request); a plain missing object is an answer (None, [], nothing to delete)."""
    final = final_error(url, e)
    if final is not None and not isinstance(final, NotFound):
        raise final from None


# ----------------------------------------------------------------------------------------------
# Objects


def _mtime(info: dict) -> float | None:
    for key in ("LastModified", "updated", "mtime", "timeCreated"):
        v = info.get(key)
        if isinstance(v, datetime):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, str):
            try:
                return datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def stat(url: str) -> dict | None:
    """``{"version", "mtime", "size"}`` of an object (the store's version: S3's ETag, GCS's
    generation; mtime by the store's clock), or None when there is none."""
    fs = filesystem(url)
    scheme, bucket, key = split(url)

    def head() -> dict | None:
        try:
            if scheme == "s3":
                got = fs.call_s3("head_object", Bucket=bucket, Key=key)
                return {"version": got.get("ETag"), "mtime": _mtime(got),
                        "size": got.get("ContentLength")}
            fs.invalidate_cache(url)
            got = fs.info(url)
        except FileNotFoundError as e:
            _unless_absent(url, e)
            return None
        if got.get("type") == "directory":
            return None
        return {"version": str(got.get("generation")), "mtime": _mtime(got), "size": got.get("size")}
    return retried(url, "metadata request", head)


def read(url: str) -> bytes | None:
    """An object's bytes, or None when there is none."""
    fs = filesystem(url)

    def get() -> bytes | None:
        try:
            return bytes(fs.cat_file(url))
        except FileNotFoundError as e:
            _unless_absent(url, e)
            return None
    return retried(url, "read", get)


def write(url: str, data: bytes, *, quiet: bool = False) -> None:
    """Write an object whole (a PUT: readers see the old object or this one)."""
    fs = filesystem(url)

    def put() -> None:
        try:
            fs.pipe_file(url, bytes(data))
        except FileNotFoundError as e:    # a write finds no object missing: the bucket is
            _unless_absent(url, e)
            raise OlmaxError(f"{url}: bucket {url.split('://')[0]}://{split(url)[1]} not found") \
                from None
    retried(url, "write", put, quiet=quiet)


def _gcs_upload(fs: Any, bucket: str, key: str, data: bytes, generation: str) -> str:
    """A GCS upload on the condition ``ifGenerationMatch=generation`` (0: no object yet), as
    gcsfs's own uploads are sent (multipart); the new object's generation."""
    meta = json.dumps({"name": key})
    body = (f"--==0==\nContent-Type: application/json; charset=UTF-8\n\n{meta}\n--==0==\n"
            f"Content-Type: application/octet-stream\n\n").encode() + bytes(data) + b"\n--==0==--"
    got = fs.call("POST", f"{fs._location}/upload/storage/v1/b/{quote(bucket)}/o",
                  uploadType="multipart", ifGenerationMatch=generation, data=body, json_out=True,
                  headers={"Content-Type": 'multipart/related; boundary="==0=="'})
    return str(got.get("generation"))


def _put_if(fs: Any, scheme: str, bucket: str, key: str, data: bytes, s3_condition: dict,
            generation: str) -> str | None:
    """One conditional upload: S3's ``put_object`` with ``s3_condition``, or Cloud Storage's with
    ``ifGenerationMatch=generation``; the object's new version."""
    if scheme == "s3":
        got = fs.call_s3("put_object", Bucket=bucket, Key=key, Body=bytes(data), **s3_condition)
        return got.get("ETag")
    return _gcs_upload(fs, bucket, key, data, generation)


def create(url: str, data: bytes) -> str | None:
    """Create an object only if there is none: its version, or None when one exists."""
    fs = filesystem(url)
    scheme, bucket, key = split(url)

    def put() -> str | None:
        try:
            return _put_if(fs, scheme, bucket, key, data, {"IfNoneMatch": "*"}, "0")
        except Exception as e:
            if precondition_failed(e) and not connection_trouble(e):
                return None
            raise
    return retried(url, "conditional create", put)


def replace(url: str, data: bytes, version: str) -> str | None:
    """Replace an object only if it is still at ``version``: its new version, or None when it
    changed (or is gone)."""
    fs = filesystem(url)
    scheme, bucket, key = split(url)

    def put() -> str | None:
        try:
            return _put_if(fs, scheme, bucket, key, data, {"IfMatch": version}, str(version))
        except FileNotFoundError as e:
            _unless_absent(url, e)
            return None
        except Exception as e:
            if precondition_failed(e) and not connection_trouble(e):
                return None
            if http_status(e) == 404 or "EINVAL" in str(getattr(e, "errno", "")) or (
                    isinstance(e, OSError) and e.errno == errno.EINVAL):
                return None     # s3fs words a failed If-Match as EINVAL
            raise
    return retried(url, "conditional write", put)


def delete(url: str) -> None:
    fs = filesystem(url)

    def rm() -> None:
        try:
            fs.rm_file(url)
        except FileNotFoundError as e:
            _unless_absent(url, e)
    retried(url, "delete", rm)


def delete_tree(url: str) -> None:
    """Every object below ``url/``."""
    fs = filesystem(url)

    def rm() -> None:
        try:
            fs.rm(url.rstrip("/") + "/", recursive=True)
        except FileNotFoundError as e:
            _unless_absent(url, e)
    retried(url, "delete", rm)


def move_tree(src: str, dst: str) -> None:
    """Copy every object below ``src/`` to ``dst/``, then delete ``src/`` (an object store has
    no rename; a reader may see both for a moment)."""
    fs = filesystem(src)
    retried(src, "copy", lambda: fs.copy(src.rstrip("/") + "/", dst.rstrip("/") + "/",
                                         recursive=True))
    delete_tree(src)


def listdir(url: str) -> list[str]:
    """The names directly below ``url/`` (objects and prefixes), sorted; [] when there are none."""
    fs = filesystem(url)
    prefix = url.rstrip("/")

    def ls() -> list[str]:
        try:
            fs.invalidate_cache(prefix)
            return sorted({p.rstrip("/").rsplit("/", 1)[-1]
                           for p in fs.ls(prefix + "/", detail=False, refresh=True)})
        except FileNotFoundError as e:
            _unless_absent(url, e)
            return []
    return retried(url, "listing", ls)


def store_now(url: str) -> float:
    """The store's clock: the modification time of a probe object written beside ``url``."""
    probe = f"{url}.probe-{secrets.token_hex(6)}"
    write(probe, b"")
    try:
        got = stat(probe)
    finally:
        try:
            delete(probe)
        except OlmaxError:
            pass
    return got["mtime"] if got and got.get("mtime") is not None else time.time()


def check_bucket(url: str, what: str = "run directory") -> None:
    """That ``url``'s bucket exists and takes writes: one line naming the trouble otherwise
    (a missing bucket, a denied write: exit 2; a store that cannot be reached: exit 75)."""
    probe = f"{url.rstrip('/')}/.olmax-write-test-{secrets.token_hex(6)}"
    try:
        write(probe, b"", quiet=True)
        delete(probe)
    except OlmaxError as e:
        text = str(e).replace(probe, url)
        raise type(e)(f"{what} {text}" if not text.startswith(url) else f"{what} {text}") from None


# ----------------------------------------------------------------------------------------------
# Local path or bucket: the few operations run files need


def read_bytes(target: str | os.PathLike) -> bytes | None:
    """The bytes of a local file or an object; None when there is none."""
    if is_bucket(target):
        return read(str(target))
    try:
        return Path(target).read_bytes()
    except FileNotFoundError:
        return None


def write_bytes(target: str | os.PathLike, data: bytes) -> Any:
    """Write a local file atomically (:func:`olmax.io.write_bytes_atomic`) or an object whole."""
    if is_bucket(target):
        write(str(target), data)
        return target
    return write_bytes_atomic(target, data)


def exists(target: str | os.PathLike) -> bool:
    if is_bucket(target):
        return stat(str(target)) is not None
    return Path(target).exists()


def segment_names(prefix: str) -> list[str]:
    """The rolled JSONL segments below ``prefix`` (``NNNNNN.jsonl``), in order."""
    return sorted(n for n in listdir(prefix) if n.endswith(".jsonl") and n[:-6].isdigit())


def read_segments(prefix: str) -> str:
    """The segments below ``prefix``, in order, as one JSONL text (a run's metrics in a bucket:
    :mod:`olmax.train.run_log`)."""
    out = []
    for name in segment_names(prefix):
        text = (read(f"{prefix}/{name}") or b"").decode("utf-8", errors="replace")
        out.append(text if not text or text.endswith("\n") else text + "\n")
    return "".join(out)


# ----------------------------------------------------------------------------------------------
# TensorStore (the checkpoints' arrays)


def _endpoint(proto: str) -> str | None:
    """The endpoint ``proto``'s client takes from the environment (its own variables only: an S3
    endpoint does not tell a GCS filesystem apart, nor the other way round)."""
    if proto in ("gs", "gcs"):
        return _env("STORAGE_EMULATOR_HOST")
    return _env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def _env(*names: str) -> str | None:
    for name in names:
        if os.environ.get(name):
            return os.environ[name]
    return None


def tensorstore_kvstore(url: str) -> dict:
    """The TensorStore kvstore spec for a bucket path, with the endpoint and region of the
    environment (TensorStore reads the credentials itself: the AWS variables and profile files
    for ``s3``, application-default credentials for ``gcs``) and its retries matched to olmax's."""
    scheme, bucket, key = split(url)
    path = key.rstrip("/") + ("/" if key and url.endswith("/") else "")
    check_endpoints(scheme)
    retries = {"max_retries": transport.ATTEMPTS, "initial_delay": f"{transport.BACKOFF_S}s",
               "max_delay": f"{transport.MAX_BACKOFF_S}s"}
    if scheme == "s3":
        spec: dict[str, Any] = {"driver": "s3", "bucket": bucket, "path": path,
                                "aws_region": _env("AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1",
                                "s3_request_retries": retries}
        endpoint = _env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
        if endpoint:
            spec["endpoint"] = endpoint
        return spec
    tensorstore_env()
    return {"driver": "gcs", "bucket": bucket, "path": path, "gcs_request_retries": retries}


_MIRRORED: dict[str, str] = {}


def tensorstore_env() -> None:
    """Point TensorStore's GCS driver at an emulator when gcsfs is (``STORAGE_EMULATOR_HOST``;
    a ``TENSORSTORE_GCS_HTTP_URL`` the user set is left alone)."""
    host = os.environ.get("STORAGE_EMULATOR_HOST")
    now = os.environ.get("TENSORSTORE_GCS_HTTP_URL")
    if host and (not now or now == _MIRRORED.get("url")):
        url = host if "://" in host else f"http://{host}"
        os.environ["TENSORSTORE_GCS_HTTP_URL"] = _MIRRORED["url"] = url


__all__ = ["is_bucket", "bucket_path", "split", "join", "run_location", "refuse_bucket",
           "filesystem", "new_filesystem", "retried", "stat", "read", "write",
           "create", "replace", "delete", "delete_tree", "move_tree", "listdir", "store_now",
           "check_bucket", "segment_names", "read_segments", "read_bytes", "write_bytes", "exists", "tensorstore_kvstore",
           "tensorstore_env", "SCHEMES"]
