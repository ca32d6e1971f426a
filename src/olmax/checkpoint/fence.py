"""A checkpoint commit fenced by the run's lock, in a temporary directory of its writer's own.

Orbax writes a step under ``<step>.orbax-checkpoint-tmp`` and renames it to ``<step>`` once every
item is on disk (in a bucket: writes in place, then ``commit_success.txt``). Two trainers of one run
directory never train at once (:mod:`olmax.train.callbacks.run_lock`), but an attempt that was
superseded while a save was in flight -- paused, or cut off from the store -- finds that save still
running when it resumes, and Orbax's default path for it is the one the newer attempt uses for the
same step. The newer attempt removes the old temporary directory and writes its own there; the old
writer's rename then commits whatever the new one has written so far, and the new one's own commit
fails, its directory gone.

:func:`temporary_path_class` gives the :class:`~olmax.checkpoint.checkpointer.Checkpointer`:

- a temporary directory per writer, ``<step>.orbax-checkpoint-tmp-<writer>`` (``writer``: a token
  every process of one checkpointer shares), so two writers of one step never write into, remove or
  rename each other's files;
- a fence: just before a save is committed, ``fence()`` is called (the run lock's check); when it
  raises, the writer's temporary directory is removed and the save fails with that error: nothing of
  a superseded attempt is committed.

In a bucket nothing is renamed, so the step directory is the only name; there the fence alone keeps
the superseded writer's ``commit_success.txt`` out.
"""

from __future__ import annotations

import asyncio
import shutil
from typing import Any, Callable

from etils import epath
from orbax.checkpoint._src.path import atomicity

Fence = Callable[[], None]

SUFFIX = atomicity.TMP_DIR_SUFFIX      # ".orbax-checkpoint-tmp"


def _unfenced() -> None:
    pass


class FencedRename(atomicity.AtomicRenameTemporaryPath):
    """Atomic rename from ``<step>.orbax-checkpoint-tmp-<writer>``, refused when the fence raises."""

    writer: str = ""
    fence: Fence = staticmethod(_unfenced)

    @classmethod
    def from_final(cls, final_path: epath.Path, **kwargs: Any) -> "FencedRename":
        tmp = epath.Path(final_path).parent / f"{epath.Path(final_path).name}{SUFFIX}-{cls.writer}"
        return cls(tmp, final_path, **kwargs)

    async def finalize(self) -> None:
        await _fenced(self, type(self).fence)
        await super().finalize()


class FencedCommitFile(atomicity.CommitFileTemporaryPath):
    """A bucket's commit file, not written when the fence raises."""

    fence: Fence = staticmethod(_unfenced)

    async def finalize(self) -> None:
        await _fenced(None, type(self).fence)
        await super().finalize()


async def _fenced(tmp: FencedRename | None, fence: Fence) -> None:
    """``fence()``; when it raises, this writer's temporary step directory is removed (an item's
    commit comes first, inside it): nobody else writes there."""
    try:
        await asyncio.to_thread(fence)
    except BaseException:
        if tmp is not None:
            where = epath.Path(tmp.get())
            step = where.parent if own_temporaries([where.parent.name], tmp.writer) else where
            await asyncio.to_thread(shutil.rmtree, str(step), True)
        raise


def temporary_path_class(*, remote: bool, writer: str, fence: Fence | None) -> type:
    """The TemporaryPath class of one checkpointer: its ``writer`` token (hex digits: what
    :func:`own_temporaries` and the log's filter read) and its ``fence``."""
    fields: dict[str, Any] = {"fence": staticmethod(fence or _unfenced)}
    if remote:
        return type("FencedCommitFile", (FencedCommitFile,), fields)
    return type("FencedRename", (FencedRename,), {**fields, "writer": writer})


def own_temporaries(names: list[str], writer: str) -> list[str]:
    """The names among ``names`` that are this writer's temporary step directories."""
    end = f"{SUFFIX}-{writer}"
    return [n for n in names if n.endswith(end) and n[:-len(end)].isdigit()]


__all__ = ["Fence", "FencedRename", "FencedCommitFile", "temporary_path_class", "own_temporaries"]
