"""The rules of olmax.io for what is already there: outputs a user names, names that come from
data, text a user gives, environment numbers, and a write that fails (a full disk)."""

from __future__ import annotations

import os
import resource
import signal
import stat
import subprocess
import sys

import pytest

from olmax.errors import OlmaxError
from olmax.io import (as_inputs, atomic_output_dir, contained, env_int, read_text, refuse_existing,
                      write_text_atomic)


def test_an_output_replaces_only_a_regular_file_and_only_with_force(tmp_path):
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model: {}")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "sub").mkdir()
    assert refuse_existing(tmp_path / "new.json", flag="--json") == tmp_path / "new.json"
    assert refuse_existing(notes, True, flag="--out") == notes
    refusals = {
        (notes, False): f"--out {notes} already exists (remove it or pass --force)",
        (tmp_path / "dangling", False): f"--out {tmp_path / 'dangling'} already exists",
        (recipe, True): f"--out {recipe} is the recipe this command reads; write to another file",
        (tmp_path / "sub" / ".." / "r.yaml", True): "/sub/../r.yaml is the recipe this command reads",
        (fifo, True): f"--out {fifo} exists and is not a regular file (a FIFO, socket or device)",
        (tmp_path, True): f"--out {tmp_path} is a directory",
    }
    for (path, force), message in refusals.items():
        with pytest.raises(OlmaxError) as e:
            refuse_existing(path, force, flag="--out", inputs=[(recipe, "the recipe")])
        assert message in str(e.value) and str(e.value).startswith("--out "), str(e.value)
    assert notes.read_text() == "mine" and recipe.read_text() == "model: {}"
    # inputs as commands name them: LABEL=PATH,PATH entries split, only local files kept
    assert as_inputs([f"set={notes},{tmp_path / 'gone.npy'}", "embedded", str(recipe)], "an input") == [
        (str(notes), "an input"), (str(recipe), "an input")]


def test_names_from_data_stay_below_their_folder(tmp_path):
    assert contained(tmp_path, "a/./b//c.npy") == tmp_path / "a" / "b" / "c.npy"
    for name, why in (("../x.npy", "'..' segments"), ("a/../../x.npy", "'..' segments"),
                      ("a\\..\\..\\x.npy", "'..' segments"), ("/etc/passwd", "an absolute path")):
        with pytest.raises(OlmaxError, match=rf"^mix.txt:3: {name!r} would be written outside "
                                             rf"{tmp_path} \({why}\); nothing was written$".replace(
                                                 "\\\\", "\\\\\\\\")):
            contained(tmp_path, name, what="mix.txt:3")
    with pytest.raises(OlmaxError, match="names no file below"):
        contained(tmp_path, "./")


def test_text_and_environment_numbers_are_named(tmp_path, monkeypatch):
    latin = tmp_path / "notes.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(OlmaxError, match=rf"^{latin}: not UTF-8 text \(unexpected end of data at byte 3\)$"):
        read_text(latin)
    monkeypatch.setenv("OLMAX_X", "8MiB")
    with pytest.raises(OlmaxError, match=r"^OLMAX_X='8MiB': expected a whole number of bytes >= 1$"):
        env_int("OLMAX_X", 5, unit="bytes")
    monkeypatch.setenv("OLMAX_X", "0")
    with pytest.raises(OlmaxError, match=r"^OLMAX_X='0'"):
        env_int("OLMAX_X", 5)
    monkeypatch.setenv("OLMAX_X", " 4096 ")
    assert env_int("OLMAX_X", 5) == 4096
    monkeypatch.delenv("OLMAX_X")
    assert env_int("OLMAX_X", 5) == 5


def _small_files():
    """In the child: files may grow to 2 KiB (a full disk as a program sees it: a write fails)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))


def test_a_write_that_fails_names_the_file_and_leaves_nothing(tmp_path):
    """`olmax launch` with no room for its script: one line naming the script, not a temporary,
    and no half-written file (the same path every atomic write of olmax takes)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTHONDONTWRITEBYTECODE="1")
    proc = subprocess.run([sys.executable, "-m", "olmax.cli", "launch", "slurm", "olmo3_tiny",
                           "--nodes", "2", "--gpus-per-node", "0", "--run-dir", "/shared/r",
                           "--out", "job.sh"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120, preexec_fn=_small_files)
    assert proc.returncode == 75, proc.stderr     # the storage's trouble, not the input's
    assert proc.stderr == "olmax launch: error: cannot write job.sh: File too large\n", proc.stderr
    assert list(tmp_path.iterdir()) == []
    # in this process (no limit) the same write succeeds
    write_text_atomic(tmp_path / "job.sh", "#!/bin/bash\n" * 1000)
    assert (tmp_path / "job.sh").stat().st_size == 12000


@pytest.mark.parametrize("mask,mode", [(0o022, 0o755), (0o027, 0o750), (0o077, 0o700)])
def test_an_output_folder_gets_the_umask_mode_not_the_temporarys(tmp_path, mask, mode):
    """``olmax convert`` writes its folders through atomic_output_dir: a converted HF folder was
    left 0700 (mkdtemp's mode), unreadable to the group that shares the models."""
    old = os.umask(mask)
    try:
        with atomic_output_dir(tmp_path / "hf") as tmp:
            (tmp / "config.json").write_text("{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "hf").stat().st_mode) == mode
