"""Storage errors exit 75 (a restart can help), in one line naming the path, without the
tracebacks Orbax logs from its writer threads: a checkpoint save that runs out of space (a file
size limit standing for a full disk; a real tmpfs of a few MB in the slow tier, where a mount
namespace can be had)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
ENV.pop("OLMAX_DEBUG", None)

FULL = textwrap.dedent("""
    import resource, signal, sys
    import jax, jax.numpy as jnp
    from olmax.checkpoint.checkpointer import Checkpointer
    from olmax.config import CheckpointConfig
    from olmax.reporting import quiet_libraries, run_reporting

    quiet_libraries()
    ck = Checkpointer(sys.argv[1], CheckpointConfig(interval=1, keep=2, async_save=True))
    small = {"params": {"w": jnp.ones((4,))}, "opt_state": {"m": jnp.zeros((4,))}}
    big = {"params": {"w": jax.random.normal(jax.random.key(0), (256, 1024))},
           "opt_state": {"m": jnp.zeros((256, 1024))}}
    ck.save(1, small, {"x": 1}); ck.wait()
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)         # writes past the limit fail (EFBIG)
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (65536, hard))

    def save():
        ck.save(2, big, {"x": 2})
        ck.save(3, big, {"x": 3})                          # finds step 2's failure
        ck.wait()

    sys.exit(run_reporting("train", save, debug=False))
""")


def test_a_checkpoint_save_out_of_space_exits_75_in_one_line(tmp_path):
    out = subprocess.run([sys.executable, "-c", FULL, str(tmp_path / "ck")], env=ENV,
                         capture_output=True, text=True, timeout=120)
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 75, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and len(lines) == 1, out.stderr[-3000:]
    assert lines[0] == (f"olmax train: error: checkpoint save at step 2 to {tmp_path / 'ck'} failed: "
                        f"File too large; previous checkpoints intact: [1]"), lines


def _tmpfs_prefix(mount: Path) -> list[str] | None:
    """A command prefix that runs in a mount namespace with a 24 MB tmpfs at ``mount`` (as root,
    or in a user namespace), or None where neither is allowed."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return None
    flags = ["--mount"] if os.geteuid() == 0 else ["--user", "--map-root-user", "--mount"]
    probe = subprocess.run([unshare, *flags, "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {mount}"],
                           capture_output=True)
    if probe.returncode != 0:
        return None
    return [unshare, *flags, "sh", "-c", f'mount -t tmpfs -o size=24m tmpfs {mount} && exec "$@"',
            "sh"]


@pytest.mark.slow
def test_olmax_train_on_a_full_tmpfs_exits_75_naming_the_checkpoints(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    prefix = _tmpfs_prefix(mount)
    if prefix is None:
        pytest.skip("no mount namespace for a tmpfs here (needs root or user namespaces)")
    run = mount / "run"
    out = subprocess.run([*prefix, sys.executable, "-m", "olmax.cli", "train", "olmo3_tiny",
                          "--run-dir", str(run), "train.max_steps=2", "checkpoint.interval=1",
                          "eval.interval=null", "eval.on_end=false"], env=ENV, cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 75, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    last = [ln for ln in out.stderr.splitlines() if ln.strip()][-1]
    assert last == (f"olmax train: error: checkpoint save at step 1 to {run / 'checkpoints'} failed: "
                    f"No space left on device; previous checkpoints intact: none"), last
