"""Remote locations and failures mean one thing everywhere (:mod:`olmax.transport`).

Locations that look like URLs but are not are refused, never made local folders; an endpoint
variable that is not a URL is a configuration error at once (no retries); a store that cannot be
reached is exit 75 naming the URL and the connection error for every command that reads
remotely (``data``, ``convert``, ``merge``), and a missing file at once, exit 2. The run
directories' layer (:mod:`olmax.store`) and the token files' (:mod:`olmax.data.remote`) read a
failure by the same function.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from helpers.cli import refused_in_one_line
from helpers.remote_servers import file_server, refused_port
from olmax import store, transport
from olmax.cli import main
from olmax.data import remote
from olmax.errors import ConfigError, OlmaxError, RestartableError
from olmax.interop.olmo_core.dcp import Files


@pytest.fixture(autouse=True)
def fast_retries(monkeypatch):
    monkeypatch.setattr(transport, "BACKOFF_S", 0.01)
    monkeypatch.setattr(remote, "_INFO", {})
    monkeypatch.setattr(remote, "_DEFAULT", {})


@pytest.mark.parametrize("text,scheme", [
    ("s3://bucket/run", "s3"), ("GS://bucket/x", "gs"), ("gcs://bucket/x", "gs"),
    ("https://host:8080/a/b.npy", "https"), ("http://127.0.0.1/x", "http"),
    ("runs/a", None), ("./s3:/bucket/run", None), ("run:1", None), ("a/b:c", None),
])
def test_locations_olmax_reads(text, scheme):
    assert transport.url_scheme(text) == scheme


@pytest.mark.parametrize("text,needle", [
    ("s3:/bucket/run", "not a URL (s3: is followed by '//': s3://BUCKET/PATH)"),
    ("gs:x", "not a URL (gs: is followed by '//'"),
    ("https:/host/x", "not a URL (https: is followed by '//'"),
    ("hdfs://nn/x", "unknown scheme hdfs://"),
    ("file:///tmp/x", "unknown scheme file://"),
    ("s3:///x", "'' is not a bucket name"),
    ("http://host:99999/x", "out of range"),
    ("http:///x", "no host"),
])
def test_locations_that_look_like_urls_but_are_not(text, needle):
    with pytest.raises(ConfigError) as e:
        transport.url_scheme(text, "--run-dir")
    assert str(e.value).startswith(f"--run-dir {text}: ") and needle in str(e.value), e.value
    with pytest.raises(ConfigError):
        remote.is_remote(text)       # the token files' layer asks the same question
    with pytest.raises(ConfigError):
        store.is_bucket(text)        # and the run directories'


def test_a_run_directory_that_is_no_url_is_refused_not_made_local(tmp_path, capsys, monkeypatch):
    """Every folder a command writes, named by the option that gave it: never a folder ``s3:``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("text")
    for argv, needle in (
            (["train", "olmo3_tiny", "--run-dir", "s3:/bucket/run"], "--run-dir s3:/bucket/run: not a URL"),
            (["quickstart", "--run-dir", "gs:q"], "--run-dir gs:q: not a URL"),
            (["convert", "hf-to-olmax", "hf", "gs:out"], "output directory gs:out: not a URL"),
            (["tokenize", "docs", "--out", "gs:tok"], "--out gs:tok: not a URL"),
            (["data", "fetch", "t.npy", "--root", "http://127.0.0.1:9", "--to", "s3:/x"],
             "--to s3:/x: not a URL"),
            (["launch", "slurm", "olmo3_tiny", "--nodes", "1", "--gpus-per-node", "0", "--run-dir",
              "s3:/b/r", "--out", "job.sh"], "--run-dir s3:/b/r: not a URL"),
            (["train", "olmo3_tiny", "--run-dir", "run", "data.embedded=true", "data.cache_dir=s3:/c"],
             "data.cache_dir s3:/c: not a URL"),
            (["train", "olmo3_tiny", "--run-dir", "run", "init.checkpoint=gs:x"],
             "init.checkpoint gs:x: not a URL")):
        refused_in_one_line(capsys, argv, needle)
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "run") == ["docs"]


@pytest.mark.parametrize("name,value", [
    ("AWS_ENDPOINT_URL", "notaurl"), ("AWS_ENDPOINT_URL_S3", "ftp://host"),
    ("AWS_ENDPOINT_URL", "http://host:70000"), ("STORAGE_EMULATOR_HOST", "host:port"),
])
def test_an_endpoint_that_is_no_url_is_a_configuration_error_at_once(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    scheme = "gs" if name == "STORAGE_EMULATOR_HOST" else "s3"
    waits: list[float] = []
    monkeypatch.setattr(transport.time, "sleep", waits.append)
    with pytest.raises(ConfigError, match=rf"^{name}={value!r}: "):
        store.check_bucket(f"{scheme}://bucket/run")
    with pytest.raises(ConfigError, match=rf"^{name}="):
        remote.remote_files().size(f"{scheme}://bucket/tokens.npy")
    assert waits == []           # not retried: nothing a retry could change


def test_endpoints_that_are_urls_pass(monkeypatch):
    for name, value in (("AWS_ENDPOINT_URL", "http://127.0.0.1:9000"),
                        ("STORAGE_EMULATOR_HOST", "127.0.0.1:4443"),
                        ("STORAGE_EMULATOR_HOST", "https://gcs.example")):
        monkeypatch.setenv(name, value)
    transport.check_endpoints()


def test_what_a_failure_means_is_decided_in_one_place():
    """The classifications both layers rely on."""
    url = "s3://bucket/x"
    assert isinstance(transport.final_error(url, FileNotFoundError("x")), transport.NotFound)
    assert transport.final_error(url, ConnectionRefusedError(111, "refused")) is None
    assert transport.final_error(url, TimeoutError()) is None
    denied = transport.final_error(url, PermissionError(13, "denied"))
    assert "access to bucket s3://bucket denied" in str(denied)
    setup = transport.final_error(url, type("NoCredentialsError", (Exception,), {})(
        "Unable to locate credentials"))
    assert "the client cannot be set up (Unable to locate credentials)" in str(setup)
    assert "http://h/x: access denied" in str(transport.final_error("http://h/x", PermissionError()))


def test_an_unreachable_store_is_exit_75_for_every_command_that_reads_remotely(tmp_path, capsys):
    """convert and merge of an http:// checkpoint on a closed port: the connection error and the
    URL, exit 75 (a restart may cure it), not "not an OLMo-core checkpoint" (exit 2)."""
    with refused_port() as port:
        url = f"http://127.0.0.1:{port}/ck"
        for argv in (["convert", "olmo-core-to-olmax", url, str(tmp_path / "o")],
                     ["merge", url, url, "--out", str(tmp_path / "m"), "--weights-only"],
                     ["data", "inspect", "--paths", f"{url}/t.npy", "--seq-len", "8",
                      "--global-batch-size", "1", "--seed", "0", "--batches", "0:1"]):
            capsys.readouterr()
            assert main(argv) == 75, argv
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and url in err, err
            assert "failed after 5 attempts: connection refused (127.0.0.1:" in err, err
        assert not list(tmp_path.iterdir())
        with pytest.raises(RestartableError):
            Files(url).exists(".metadata")        # unreachable is not "missing"


def test_a_missing_remote_file_is_at_once_and_names_what_it_is(tmp_path, capsys):
    with file_server({"/x/other": b"0"}) as srv:
        files = Files(f"{srv.url}/ck")
        assert files.exists(".metadata") is False
        with pytest.raises(OlmaxError, match=r"^checkpoint file not found: .*/ck/config.json$"):
            files.read_all("config.json")
        refused_in_one_line(capsys, ["convert", "olmo-core-to-olmax", f"{srv.url}/ck",
                                     str(tmp_path / "o")], "not an OLMo-core checkpoint")
        asked = [m for m, _, _ in srv.log]
    assert len(asked) <= 8                    # a 404 is not retried (HEAD, GET per question)


def test_the_gcs_and_s3_sides_share_the_loop_and_its_numbers():
    """One retry policy: the store's requests and the token files' go through
    transport.retried (no second loop with other numbers)."""
    assert not hasattr(store, "ATTEMPTS") and not hasattr(remote, "ATTEMPTS")
    calls = []

    def attempt():
        calls.append(1)
        raise ConnectionResetError("dropped")

    with pytest.raises(RestartableError, match=r"^s3://b/k: read failed after 5 attempts: dropped"):
        store.retried("s3://b/k", "read", attempt)
    assert len(calls) == transport.ATTEMPTS


def test_the_cli_exit_status_for_a_bad_endpoint_is_2(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), AWS_ENDPOINT_URL="notaurl",
               AWS_ACCESS_KEY_ID="x", AWS_SECRET_ACCESS_KEY="x", AWS_DEFAULT_REGION="us-east-1")
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "olmax.cli", "data", "inspect", "--paths",
                           "s3://bucket/tokens.npy", "--seq-len", "8", "--global-batch-size", "1",
                           "--seed", "0", "--batches", "0:1"], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert "AWS_ENDPOINT_URL='notaurl': not an http:// or https:// URL" in proc.stderr
    assert time.time() - t0 < 30


def test_urls_where_olmax_reads_local_folders_only_say_so(tmp_path, capsys, monkeypatch):
    """An HF directory at a URL (olmax reads them from disk) is refused as one, its "//" intact
    (not folded into a "not a URL" of a path); eval of a URL with no OLMo-core checkpoint says
    what it looked for."""
    monkeypatch.chdir(tmp_path)
    with file_server({"/x/other": b"0"}) as srv:
        url = f"{srv.url}/hf"
        for argv, needle in ((["convert", "hf-to-olmax", url, "out"], f"{url}: a URL; olmax reads "
                                                                       "Hugging Face directories"),
                             (["train", "olmo3_tiny", "--run-dir", "run", f"init.hf_dir={url}"],
                              f"init.hf_dir {url}: a URL"),
                             (["eval", url, "--heldout", "embedded", "--json", "o.json"],
                              f"{url}: no OLMo-core checkpoint there")):
            refused_in_one_line(capsys, argv, needle)
    assert list(tmp_path.iterdir()) == []
