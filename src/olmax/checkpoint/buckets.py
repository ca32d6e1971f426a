"""Checkpoints straight to a bucket: Orbax's object-store protocol, TensorStore's S3 and GCS drivers.

A checkpoint directory in a bucket (``s3://`` or ``gs://``, :mod:`olmax.store`) is written in place
by every process, each its own shards (TensorStore's ``s3`` / ``gcs`` kvstore under OCDBT), and
committed by Orbax's commit-file protocol (``AtomicityMode.COMMIT_FILE``): once every process has
written every item, process 0 writes ``<step>/commit_success.txt``. A step without it is not a
checkpoint: Orbax does not list it, so it is never restored, and keep-last-K never counts it (it
never deletes a complete step for it). :class:`~olmax.checkpoint.checkpointer.Checkpointer`
removes such leftovers of an interrupted save when it opens the directory. An object store cannot
rename, so nothing is renamed.

Orbax 0.12 builds TensorStore specs for ``gs://`` only; :func:`enable` teaches its spec builder
``s3://`` (the endpoint and region of the AWS environment) and sets both drivers' retries to olmax's
(:func:`olmax.store.tensorstore_kvstore`). The directory operations (listing, metadata files,
deleting old steps) go through ``etils.epath`` on fsspec: :func:`enable` gives it olmax's
filesystems (:func:`olmax.store.library_filesystem`: gcsfs's plain class, which does not first look
the bucket's layout up through another API, and the endpoint the environment names now).
"""

from __future__ import annotations

import os
import threading

import orbax.checkpoint as ocp
from etils import epath

from olmax import store

COMMIT_FILE = "commit_success.txt"
_ENABLED = threading.Lock()
_done = False


def enable() -> None:
    """Install the ``s3://`` spec builder in Orbax (once per process)."""
    global _done
    with _ENABLED:
        if _done:
            return
        store.tensorstore_env()
        from orbax.checkpoint._src.serialization import tensorstore_utils as tsu

        normalize, use_gcs = tsu._normalize_path, tsu._use_gcs_driver
        for_gcs = tsu.gcs_utils.get_kvstore_for_gcs

        def _normalize_path(path: str) -> str:
            text = normalize(path)
            return text.replace("s3:/", "s3://", 1) if text.startswith("s3:/") \
                and not text.startswith("s3://") else text

        def _use_gcs_driver(directory: str) -> bool:   # "remote": gs:// or s3://
            return use_gcs(directory) or str(directory).startswith("s3://")

        def get_kvstore_for_gcs(path: str) -> dict:
            if str(path).startswith(("s3://", "gs://")):
                return store.tensorstore_kvstore(str(path))
            return for_gcs(path)

        from etils.epath import backend as epath_backend

        epath_fs = epath_backend._FileSystemSpecBackend.fs

        def fs(self, path):     # gcsfs's plain class, and the endpoint of the environment now
            text = os.fspath(path)
            if store.is_bucket(text):
                return store.library_filesystem(text)
            return epath_fs(self, path)

        epath_backend._FileSystemSpecBackend.fs = fs
        tsu._normalize_path = _normalize_path
        tsu._use_gcs_driver = _use_gcs_driver
        tsu.gcs_utils.get_kvstore_for_gcs = get_kvstore_for_gcs
        _done = True


def orbax_path(directory: str) -> epath.Path:
    enable()
    return epath.Path(directory)


def atomicity() -> ocp.options.AtomicityOptions:
    return ocp.options.AtomicityOptions(mode=ocp.options.AtomicityMode.COMMIT_FILE)


def committed(step_dir: str) -> bool:
    """Whether a step directory in a bucket was committed (its ``commit_success.txt``)."""
    return store.stat(f"{step_dir.rstrip('/')}/{COMMIT_FILE}") is not None


__all__ = ["enable", "orbax_path", "atomicity", "committed", "COMMIT_FILE"]
