"""Token files on object storage and HTTP, against real servers on 127.0.0.1: moto's S3 server
(endpoint and credentials from the standard AWS environment) and a threaded HTTP server with
Range support. Remote files give the same batches as their local copies; dropped connections are
retried; a truncated file is one error naming it; ``olmax data fetch`` resumes after ``kill -9``;
the read-through cache only ever serves verified copies."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from helpers.datahelp import DOLMA2, EOS, VOCAB, write_tokens
from olmax.cli import main
from olmax.errors import OlmaxError
from olmax import transport
from olmax.data import remote
from olmax.data.loader import TrainData
from helpers.remote_servers import file_server, refused_port, s3_server

pytest.importorskip("s3fs")
pytest.importorskip("moto")

SEQ, BATCH, SEED = 32, 4, 7
BUCKET = "tokens"


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setattr(transport, "BACKOFF_S", 0.01)
    monkeypatch.setattr(remote, "_INFO", {})
    monkeypatch.setattr(remote, "_DEFAULT", {})


@pytest.fixture
def corpus(tmp_path):
    """Three token files (documents ending in EOS) under local/, relative names and bytes."""
    rng = np.random.default_rng(3)
    names, blobs = [], {}
    for i, n in enumerate([700, 450, 1300]):
        tokens = rng.integers(0, VOCAB - 100, n)
        tokens[rng.integers(0, n, n // 40)] = EOS
        tokens[-1] = EOS
        name = f"src{i % 2}/part-{i}.npy"
        path = tmp_path / "local" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        write_tokens(path, tokens)
        names.append(name)
        blobs[name] = path.read_bytes()
    return tmp_path / "local", names, blobs


@pytest.fixture
def http(corpus):
    _, _, blobs = corpus
    with file_server({f"/data/{k}": v for k, v in blobs.items()}) as srv:
        yield srv


@pytest.fixture
def s3(corpus, monkeypatch):
    _, _, blobs = corpus
    with s3_server() as endpoint:
        for key, value in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing",
                           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            monkeypatch.setenv(key, value)
        import boto3

        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket=BUCKET)
        for name, data in blobs.items():
            client.put_object(Bucket=BUCKET, Key=f"mix/{name}", Body=data)
        yield client


def _inspect(capsys, *args) -> list[dict]:
    capsys.readouterr()
    assert main(["data", "inspect", *args, "--seq-len", str(SEQ), "--global-batch-size",
                 str(BATCH), "--seed", str(SEED), "--batches", "0:12", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _inspect_fails(capsys, paths: list[str], batches: str) -> str:
    """``data inspect`` of ``paths`` exits 2 with one line on stderr; that line."""
    capsys.readouterr()
    rc = main(["data", "inspect", "--paths", *paths, "--seq-len", str(SEQ), "--global-batch-size",
               str(BATCH), "--seed", str(SEED), "--batches", batches, "--json"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    return err


def test_same_batches_from_s3_http_and_local(tmp_path, corpus, http, s3, capsys):
    local, names, _ = corpus
    want = _inspect(capsys, "--paths", *[str(local / n) for n in names])
    assert len(want) == 12 and len({r["sha256"] for r in want}) == 12
    assert _inspect(capsys, "--paths", *names, "--root", f"s3://{BUCKET}/mix") == want
    assert _inspect(capsys, "--paths", *[f"{http.url}/data/{n}" for n in names]) == want
    mix = tmp_path / "mix.txt"
    mix.write_text("".join(f"{n.split('/')[0]},{{TOKENIZER}}/{n}\n" for n in names))
    (tmp_path / "tok").symlink_to(local)
    assert _inspect(capsys, "--mix", str(mix), "--mix-tokenizer", "tok", "--root", str(tmp_path)) == want
    assert _inspect(capsys, "--mix", str(mix), "--mix-tokenizer", "mix",
                    "--root", f"s3://{BUCKET}") == want
    # Only ranged reads of whole instances: never a whole file.
    gets = [r for m, _, r in http.log if m == "GET"]
    assert gets and all(r and r.startswith("bytes=") for r in gets)
    sizes = {int(r.split("-")[1]) - int(r[6:].split("-")[0]) + 1 for r in gets}
    assert sizes == {SEQ * 4}, sizes


def test_each_process_reads_only_its_rows(corpus, http):
    local, names, _ = corpus
    urls = [f"{http.url}/data/{n}" for n in names]
    kw = dict(seq_len=SEQ, global_batch_size=BATCH, seed=SEED, tokenizer=DOLMA2)
    want = TrainData([str(local / n) for n in names], **kw).global_batch(3)["tokens"]
    data = TrainData(urls, **kw)
    http.log.clear()
    rows = [data.host_batch(3, p, 2)["tokens"] for p in range(2)]
    assert np.array_equal(np.concatenate(rows), want)
    assert len([1 for m, _, _ in http.log if m == "GET"]) == BATCH


def test_dropped_connections_are_retried(corpus, http):
    local, names, _ = corpus
    kw = dict(seq_len=SEQ, global_batch_size=BATCH, seed=SEED, tokenizer=DOLMA2)
    ref = TrainData([str(local / n) for n in names], **kw)
    data = TrainData([f"{http.url}/data/{n}" for n in names], **kw)
    http.drop = 5
    for b in range(4):
        assert np.array_equal(data.global_batch(b)["tokens"], ref.global_batch(b)["tokens"])
    assert http.dropped == 5


def test_truncated_remote_file_is_one_error_naming_it(corpus, http, capsys):
    _, names, blobs = corpus
    victim = f"/data/{names[2]}"
    http.truncated[victim] = len(blobs[names[2]]) // 2       # listed whole, half there
    err = _inspect_fails(capsys, [f"{http.url}/data/{n}" for n in names], "0:20")
    assert f"{http.url}{victim}: truncated" in err, err
    # A size that is no whole number of tokens is named too.
    http.files["/odd.npy"] = b"\0" * 10
    with pytest.raises(OlmaxError, match=r"/odd\.npy: size 10 bytes is not a multiple of 4"):
        TrainData([f"{http.url}/odd.npy"], seq_len=2, global_batch_size=1, seed=0, tokenizer=DOLMA2)
    with pytest.raises(OlmaxError, match=r"token file not found: .*/missing\.npy"):
        TrainData([f"{http.url}/missing.npy"], seq_len=2, global_batch_size=1, seed=0,
                  tokenizer=DOLMA2)


def test_read_through_cache_serves_only_verified_copies(tmp_path, corpus, s3):
    local, names, blobs = corpus
    kw = dict(seq_len=SEQ, global_batch_size=BATCH, seed=SEED, tokenizer=DOLMA2)
    urls = [f"s3://{BUCKET}/mix/{n}" for n in names]
    ref = TrainData([str(local / n) for n in names], **kw)
    cache = tmp_path / "cache"
    data = TrainData(urls, cache_dir=str(cache), **kw)
    for b in range(3):
        assert np.array_equal(data.global_batch(b)["tokens"], ref.global_batch(b)["tokens"])
    files = remote.remote_files(str(cache))
    deadline = time.time() + 30
    while time.time() < deadline and not all(files.cache.entry(u) for u in urls):
        time.sleep(0.05)
    for u, n in zip(urls, names):
        entry = files.cache.entry(u)
        assert entry == cache / "remote" / "s3" / BUCKET / "mix" / n
        assert entry.read_bytes() == blobs[n]
    assert np.array_equal(data.global_batch(5)["tokens"], ref.global_batch(5)["tokens"])
    # A truncated entry is detected (size), dropped and not read.
    victim = files.cache.entry(urls[1])
    victim.write_bytes(blobs[names[1]][:100])
    files.cache._ready.clear()
    assert files.cache.entry(urls[1]) is None and not victim.exists()
    assert np.array_equal(data.global_batch(6)["tokens"], ref.global_batch(6)["tokens"])
    # A copy whose bytes differ from the store's MD5 (S3 ETag) never becomes an entry.
    s3.put_object(Bucket=BUCKET, Key="mix/other.npy", Body=blobs[names[0]])
    url = f"s3://{BUCKET}/mix/other.npy"
    assert files.info(url)["md5"] == hashlib.md5(blobs[names[0]]).hexdigest()
    part = remote.cache_path(cache, url).with_name("other.npy.part")
    part.parent.mkdir(parents=True, exist_ok=True)
    part.write_bytes(b"\1" * 64)                   # a corrupt partial copy from an earlier run
    with pytest.raises(OlmaxError, match="fails verification .*MD5"):
        remote.download(files, url, remote.cache_path(cache, url))
    assert not part.exists() and files.cache.entry(url) is None
    assert remote.download(files, url, remote.cache_path(cache, url)) == len(blobs[names[0]])
    assert files.cache.entry(url).read_bytes() == blobs[names[0]]


def test_heldout_and_overlap_read_remote_files(corpus, http, s3):
    from olmax.data.heldout import padded_instances
    from olmax.data.sources import heldout_sets
    from olmax.eval.contamination import documents_from_token_files, overlap

    local, names, _ = corpus
    sets = heldout_sets([f"remote=s3://{BUCKET}/mix/{names[0]},{http.url}/data/{names[1]}",
                          f"s3://{BUCKET}/mix/src*/part-2.npy"])
    assert sets == {"remote": [f"s3://{BUCKET}/mix/{names[0]}", f"{http.url}/data/{names[1]}"],
                    "src0": [f"s3://{BUCKET}/mix/{names[2]}"]}
    want = padded_instances([str(local / n) for n in names[:2]], 16, eos_token_id=EOS, pad_token_id=0)
    got = padded_instances(sets["remote"], 16, eos_token_id=EOS, pad_token_id=0)
    assert all(np.array_equal(a, b) for a, b in zip(got, want)) and len(want[0]) > 10
    docs = documents_from_token_files(sets["src0"], eos_token_id=EOS)
    report = overlap([f"{http.url}/data/{n}" for n in names], {"src0": docs}, eos_token_id=EOS,
                     chunk_tokens=256)
    local_report = overlap([str(local / n) for n in names], {"src0": docs}, eos_token_id=EOS)
    assert report.to_dict() == local_report.to_dict() and report.sets[0].exact_documents > 0
    # The command line: remote training files and a remote held-out set (part of them: overlap).
    assert main(["data", "overlap", "--train", *[f"{http.url}/data/{n}" for n in names[:2]],
                 "--eval", f"s3://{BUCKET}/mix/{names[0]}"]) == 1
    assert main(["data", "overlap", "--train", *[f"{http.url}/data/{n}" for n in names[:2]],
                 "--eval", f"s3://{BUCKET}/mix/{names[2]}"]) == 0


def _fetch_cmd(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), OLMAX_COPY_CHUNK_BYTES=str(1 << 18))
    return [sys.executable, "-m", "olmax.cli", "data", "fetch", *args], env


def test_killed_fetch_resumes_and_verifies(tmp_path, corpus):
    """A real ``olmax data fetch`` is killed with SIGKILL mid-copy; the rerun resumes the partial
    files from their length and the copies equal the originals."""
    _, names, blobs = corpus
    big = {f"/d/big-{i}.npy": np.random.default_rng(i).integers(0, VOCAB, 300_000).astype("<u4").tobytes()
           for i in range(2)}
    with file_server(big) as srv:
        srv.delay = 0.05                                     # ~1.3 MB/s per connection
        out = tmp_path / "copy"
        cmd, env = _fetch_cmd("big-0.npy", "big-1.npy", "--root", f"{srv.url}/d", "--to", str(out),
                              "--workers", "2", "--no-progress")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        parts = [out / "big-0.npy.part", out / "big-1.npy.part"]
        deadline = time.time() + 60
        while time.time() < deadline and not all(p.exists() and p.stat().st_size >= (1 << 18)
                                                 for p in parts):
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        done = {p: p.stat().st_size for p in parts}
        assert all(0 < n < 1_200_000 for n in done.values()), done
        assert not (out / "big-0.npy").exists()
        srv.delay = 0.0
        srv.log.clear()
        cmd, env = _fetch_cmd("big-0.npy", "big-1.npy", "--root", f"{srv.url}/d", "--to", str(out),
                              "--workers", "2", "--no-progress", "--json")
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        summary = json.loads(proc.stdout)
        assert summary["files"] == 2 and summary["copied"] == 2 and summary["tokens"] == 600_000
        assert summary["bytes_transferred"] == 2_400_000 - sum(done.values())
        for name, data in big.items():
            assert (out / name.split("/")[-1]).read_bytes() == data
        first = {p: min(int(r[6:].split("-")[0]) for m, q, r in srv.log if m == "GET" and q == p)
                 for p in big}
        assert sorted(first.values()) == sorted(done.values())   # resumed where each part ended
        assert not list(out.glob("*.part")) and not list(out.glob("*.lock"))
        # A rerun finds everything present and transfers nothing.
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert json.loads(proc.stdout)["already_present"] == 2


def test_fetch_a_mix_from_s3(tmp_path, corpus, s3, capsys):
    local, names, blobs = corpus
    mix = tmp_path / "mix.txt"
    mix.write_text("".join(f"{n.split('/')[0]},{{TOKENIZER}}/{n}\n" for n in names))
    capsys.readouterr()
    assert main(["data", "fetch", str(mix), "--root", f"s3://{BUCKET}", "--mix-tokenizer", "mix",
                 "--to", str(tmp_path / "copy"), "--workers", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    total = sum(len(b) for b in blobs.values())
    assert f"3 files in {tmp_path / 'copy'}: 3 copied" in out and f"{total // 4:,} tokens" in out
    for n in names:
        assert (tmp_path / "copy" / "mix" / n).read_bytes() == blobs[n]
    # The copy reads like the original.
    assert (_inspect(capsys, "--mix", str(mix), "--mix-tokenizer", "mix", "--root", str(tmp_path / "copy"))
            == _inspect(capsys, "--mix", str(mix), "--mix-tokenizer", "mix", "--root", f"s3://{BUCKET}"))
    # A truncated object on the store fails verification, names the file and keeps nothing.
    s3.put_object(Bucket=BUCKET, Key="mix/odd.npy", Body=b"\0" * 6)
    capsys.readouterr()
    assert main(["data", "fetch", "mix/odd.npy", "--root", f"s3://{BUCKET}", "--to",
                 str(tmp_path / "copy2"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"s3://{BUCKET}/mix/odd.npy: size 6 bytes is not a multiple of 4" in err
    assert not (tmp_path / "copy2").exists()


# ----------------------------------------------------------------------------------------------
# What retrying can and cannot fix; what counts as a verified copy; where a fetch may write


def test_size_requests_retry_5xx_and_refused_connections(corpus, http):
    _, names, blobs = corpus
    files = remote.remote_files()
    url = f"{http.url}/data/{names[0]}"
    http.fail[f"/data/{names[0]}"] = 2          # attempt 1: HEAD 500, GET 500; attempt 2: HEAD 200
    assert files.size(url) == len(blobs[names[0]])
    stats = [m for m, p, _ in http.log if p == f"/data/{names[0]}"]
    assert stats == ["HEAD", "GET", "HEAD"], stats
    always = f"/data/{names[1]}"
    http.fail[always] = -1
    with pytest.raises(OlmaxError, match=rf"^{http.url}{always}: size request failed after 5 "
                                         r"attempts: HTTP 500 Internal Server Error$"):
        files.size(f"{http.url}{always}")
    # HEAD and GET per attempt: fsspec falls back to GET when HEAD fails
    assert [m for m, p, _ in http.log if p == always] == ["HEAD", "GET"] * transport.ATTEMPTS
    with refused_port() as port, pytest.raises(
            OlmaxError, match=rf"size request failed after 5 attempts: connection refused "
                              rf"\(127\.0\.0\.1:{port}\)$"):
        files.size(f"http://127.0.0.1:{port}/x.npy")
    http.log.clear()
    with pytest.raises(OlmaxError, match=r"^token file not found: .*/data/gone\.npy$"):
        files.size(f"{http.url}/data/gone.npy")
    assert [m for m, _, _ in http.log] == ["HEAD", "GET"]   # a 404 is not retried
    http.fail["/data/denied.npy"], http.fail_status = -1, 403
    with pytest.raises(OlmaxError, match=r"/data/denied\.npy: access denied \(HTTP 403 Forbidden\)"):
        files.size(f"{http.url}/data/denied.npy")


def test_a_server_ignoring_range_is_named_as_such(corpus, http, capsys):
    _, names, _ = corpus
    http.ignore_range = True
    err = _inspect_fails(capsys, [f"{http.url}/data/{n}" for n in names], "0:2")
    assert "the server ignores byte ranges (asked for 128 bytes at" in err and "truncated" not in err
    assert len([1 for m, _, _ in http.log if m == "GET"]) == BATCH   # no retries: one read each


def test_cache_never_serves_a_copy_by_its_size(tmp_path, corpus, http, s3):
    """A zero-filled file of the right size where the cache keeps a file is never read: with an
    MD5 on the store (S3) it fails the hash; without one (HTTP) it has no verification record."""
    local, names, blobs = corpus
    kw = dict(seq_len=SEQ, global_batch_size=BATCH, seed=SEED, tokenizer=DOLMA2)
    ref = TrainData([str(local / n) for n in names], **kw)
    cache = tmp_path / "cache"
    for urls in ([f"s3://{BUCKET}/mix/{n}" for n in names], [f"{http.url}/data/{n}" for n in names]):
        for u, n in zip(urls, names):
            fake = remote.cache_path(cache, u)
            fake.parent.mkdir(parents=True, exist_ok=True)
            fake.write_bytes(b"\0" * len(blobs[n]))
        data = TrainData(urls, cache_dir=str(cache), **kw)
        for b in range(4):
            assert np.array_equal(data.global_batch(b)["tokens"], ref.global_batch(b)["tokens"])
        files = remote.remote_files(str(cache))
        deadline = time.time() + 30   # the background copies replace the fakes, verified
        while time.time() < deadline and not all(files.cache.entry(u) for u in urls):
            time.sleep(0.05)
        assert all(files.cache.entry(u).read_bytes() == blobs[n] for u, n in zip(urls, names))
    # A verified entry altered in place afterwards (same size) is caught by its record.
    u = f"{http.url}/data/{names[0]}"
    entry = files.cache.entry(u)
    time.sleep(0.01)
    entry.write_bytes(b"\0" * len(blobs[names[0]]))
    files.cache._ready.clear()
    assert files.cache.entry(u) is None and not entry.exists()


def test_fetch_keeps_only_verified_copies(tmp_path, corpus, http, s3, capsys):
    _, names, blobs = corpus
    for root in (f"s3://{BUCKET}/mix", f"{http.url}/data"):
        out = tmp_path / root.split(":")[0]
        zeroed = out / names[1]
        zeroed.parent.mkdir(parents=True)
        zeroed.write_bytes(b"\0" * len(blobs[names[1]]))        # right size, wrong bytes
        capsys.readouterr()
        assert main(["data", "fetch", *names, "--root", root, "--to", str(out), "--no-progress",
                     "--json"]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert (summary["copied"], summary["already_present"], summary["replaced"]) == (3, 0, 1)
        assert all((out / n).read_bytes() == blobs[n] for n in names)
        assert main(["data", "fetch", *names, "--root", root, "--to", str(out), "--no-progress",
                     "--json"]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["already_present"] == 3 and summary["bytes_transferred"] == 0


def test_fetch_never_writes_outside_its_destination(tmp_path, corpus, http, capsys):
    _, names, blobs = corpus
    http.files["/escaped.npy"] = b"\1" * 64
    victim = tmp_path / "escaped.npy"
    victim.write_bytes(b"the user's own file")
    mix = tmp_path / "mix" / "evil.txt"
    mix.parent.mkdir()
    mix.write_text(f"ok,{{TOKENIZER}}/{names[0]}\nx,{{TOKENIZER}}/../../../../escaped.npy\n")
    out = tmp_path / "deep" / "a" / "b" / "copy"
    for args, where in (([str(mix), "--mix-tokenizer", "data"], f"{mix}:2: 'data/../../../../"),
                        (["../../escaped.npy"], "../../escaped.npy: '../../")):
        capsys.readouterr()
        rc = main(["data", "fetch", *args, "--root", f"{http.url}/data", "--to", str(out),
                   "--no-progress"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and len(err.splitlines()) == 1, err
        assert err == (f"olmax data: error: {where}escaped.npy' would be written outside {out} "
                       f"('..' segments); nothing was written"), err
    assert victim.read_bytes() == b"the user's own file"
    assert not (tmp_path / "deep").exists()                  # nothing at all was written
    assert not [m for m, p, _ in http.log if p == "/escaped.npy"]


# tgkill(2): a signal to one thread of a process, as the kernel may deliver a Ctrl-C
_TGKILL = {"x86_64": 234, "aarch64": 131}.get(platform.machine())


def _signal_a_worker_thread(pid: int, sig: int) -> None:
    """``sig`` to one of ``pid``'s threads other than its main thread (a process-directed signal
    goes to any thread that does not block it: the main thread only when it is free to take it)."""
    import ctypes

    tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    assert tids, "the copy runs no thread besides the main one"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(_TGKILL, pid, tids[-1], sig) == 0, ctypes.get_errno()


@pytest.mark.parametrize("to", ["process", "worker thread"])
def test_ctrl_c_stops_a_fetch_at_once_and_the_rerun_resumes(tmp_path, to, ctrl_c_reaches_children):
    """Ctrl-C during ``olmax data fetch``: exit 130 within a chunk's time, no file finished, the
    rerun resumes. Delivered to the process (the kernel picks the thread) and to a thread other
    than the main one, which Python's handler does not wake."""
    if to == "worker thread" and (_TGKILL is None or not sys.platform.startswith("linux")):
        pytest.skip("tgkill(2) is Linux's")
    big = {f"/d/big-{i}.npy": np.random.default_rng(i).integers(0, VOCAB, 300_000).astype("<u4").tobytes()
           for i in range(6)}
    with file_server(big) as srv:
        # ~130 KB/s per connection: about 9 s a file, so the copy is still running when the test
        # sends Ctrl-C however late the first .part appears on a loaded machine
        srv.delay = 0.5
        out = tmp_path / "copy"
        names = [k.split("/")[-1] for k in big]
        cmd, env = _fetch_cmd(*names, "--root", f"{srv.url}/d", "--to", str(out), "--workers", "2",
                              "--no-progress")
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 60
        while time.time() < deadline and not list(out.glob("*.part")):
            time.sleep(0.02)
        time.sleep(0.3)
        t0 = time.time()
        if to == "process":
            proc.send_signal(signal.SIGINT)
        else:
            _signal_a_worker_thread(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        assert time.time() - t0 < 8, "Ctrl-C waited for the queued files"
        assert proc.returncode == 130 and err.strip() == "olmax data: interrupted", err
        parts = sorted(p.name for p in out.glob("*.part"))
        assert 1 <= len(parts) <= 2 and not [p for p in out.glob("*.npy")]
        if to != "process":
            return
        srv.delay = 0.0
        proc = subprocess.run(cmd[:-1] + ["--no-progress", "--json"], env=env, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["copied"] == 6
        assert all((out / n).read_bytes() == big[f"/d/{n}"] for n in names)


def test_gcs_without_a_network_is_one_line_within_seconds(tmp_path):
    """gs:// with the GCS endpoint at a closed loopback port (gcsfs honours STORAGE_EMULATOR_HOST):
    five attempts, one line naming the file and the cause, no tracebacks, well under a minute, and
    the exit status of a failure a restart may cure."""
    pytest.importorskip("gcsfs")
    with refused_port() as port:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path),
                   STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{port}")
        t0 = time.time()
        proc = subprocess.run([sys.executable, "-m", "olmax.cli", "data", "inspect", "--paths",
                               "gs://bucket/tokens.npy", "--seq-len", "8", "--global-batch-size",
                               "1", "--seed", "0", "--batches", "0:1"], env=env,
                              capture_output=True, text=True, timeout=120)
    assert time.time() - t0 < 40
    # a store out of reach is a failure a restart may cure: exit status 75
    assert proc.returncode == 75 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("olmax data: error: gs://bucket/tokens.npy: size request failed "
                                  "after 5 attempts: connection refused"), proc.stderr


def _settled(files, urls, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline and not all(files.cache.entry(u) for u in urls):
        time.sleep(0.05)


def test_a_changed_file_of_the_same_size_is_never_read_from_the_cache(tmp_path, corpus, http):
    """The server states no MD5, only an ETag: a verified copy records it, and once the file on the
    server changes (same size, new bytes, new ETag) the copy is no longer served."""
    local, names, blobs = corpus
    kw = dict(seq_len=SEQ, global_batch_size=BATCH, seed=SEED, tokenizer=DOLMA2)
    urls = [f"{http.url}/data/{n}" for n in names]
    cache = tmp_path / "cache"
    data = TrainData(urls, cache_dir=str(cache), **kw)
    for b in range(4):
        data.global_batch(b)
    files = remote.remote_files(str(cache))
    _settled(files, urls)
    assert all(files.info(u)["version"] and files.info(u)["md5"] is None for u in urls)
    assert all(files.cache.entry(u) is not None for u in urls)
    changed = bytearray(blobs[names[0]])
    changed[8:12] = changed[12:16]                 # same size, other tokens
    http.files[f"/data/{names[0]}"] = bytes(changed)
    remote._INFO.clear()                           # a new process asks the server again
    files.cache._ready.clear()
    assert files.cache.entry(urls[0]) is None      # the copy of the old bytes is not served
    assert files.cache.entry(urls[1]) is not None
    assert files.read(urls[0], 0, len(changed)) == bytes(changed)


def test_a_server_stating_no_version_is_read_but_never_cached(tmp_path, corpus, http, caplog):
    """No ETag, Last-Modified or MD5: nothing could tell a changed file of the same size from a
    copy, so no copy is kept (said once) and every read goes to the server."""
    local, names, blobs = corpus
    http.etag = False
    kw = dict(seq_len=SEQ, global_batch_size=BATCH, seed=SEED, tokenizer=DOLMA2)
    ref = TrainData([str(local / n) for n in names], **kw)
    urls = [f"{http.url}/data/{n}" for n in names]
    cache = tmp_path / "cache"
    with caplog.at_level("WARNING"):
        data = TrainData(urls, cache_dir=str(cache), **kw)
        for b in range(2):
            assert np.array_equal(data.global_batch(b)["tokens"], ref.global_batch(b)["tokens"])
    files = remote.remote_files(str(cache))
    time.sleep(0.5)
    assert not any(remote.cache_path(cache, u).exists() for u in urls)
    assert all(files.cache.entry(u) is None for u in urls)
    assert any("not cached: the store states neither an MD5 nor a version" in r.getMessage()
               for r in caplog.records)
