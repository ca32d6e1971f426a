"""``maybe_initialize``: what reaches ``jax.distributed.initialize`` from the config, the
``OLMAX_*`` variables, a Kubernetes Indexed Job pod, SLURM and a Cloud TPU VM (recorded, not run;
the real multi-process runs are in tests/fault/)."""

from __future__ import annotations

import jax
import pytest

from olmax.config import DistributedConfig
from olmax.errors import ConfigError
from olmax.parallel.distributed import (check_devices, maybe_initialize, parse_expected_devices,
                                        slurm_local_device_ids)

SLURM_STEP = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "gpu[001-002]", "SLURM_NTASKS": "2",
              "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2", "SLURM_NNODES": "2",
              "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}


class Calls(list):
    detected = False     # whether JAX's cluster detection would supply what is unset

    def __init__(self):
        super().__init__()
        self.timeouts = []


@pytest.fixture
def calls(monkeypatch):
    seen = Calls()

    def initialize(coordinator_address=None, num_processes=None, process_id=None,
                   local_device_ids=None, cluster_detection_method=None,
                   initialization_timeout=300):
        seen.append(dict(coordinator=coordinator_address, num_processes=num_processes,
                         process_id=process_id, local_device_ids=local_device_ids,
                         detection=cluster_detection_method))
        seen.timeouts.append(initialization_timeout)
        if None in (coordinator_address, num_processes, process_id) and not seen.detected:
            raise ValueError("coordinator_address should be defined.")  # JAX's message

    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    return seen


def test_single_process_needs_nothing(calls):
    assert not maybe_initialize(DistributedConfig(), {})
    assert not maybe_initialize(DistributedConfig(), {"JOB_COMPLETION_INDEX": "3"})
    assert not maybe_initialize(DistributedConfig(num_processes=1), {})
    assert calls == []


def test_kubernetes_indexed_job_pod(calls):
    env = {"OLMAX_COORDINATOR": "run-0.run:8476", "OLMAX_NUM_PROCESSES": "4",
           "JOB_COMPLETION_INDEX": "2", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert maybe_initialize(DistributedConfig(), env)
    assert calls == [dict(coordinator="run-0.run:8476", num_processes=4, process_id=2,
                          local_device_ids=None, detection="deactivate")]


def test_config_wins_over_environment(calls):
    env = {"OLMAX_COORDINATOR": "a:1", "OLMAX_NUM_PROCESSES": "4", "OLMAX_PROCESS_ID": "3",
           "JOB_COMPLETION_INDEX": "2"}
    assert maybe_initialize(DistributedConfig(coordinator="b:2", process_id=1), env)
    assert calls[0] == dict(coordinator="b:2", num_processes=4, process_id=1,
                           local_device_ids=None, detection="deactivate")


def test_tpu_vm_count_only_leaves_the_rest_to_jax(calls):
    # olmax launch tpu-vm sets the count; JAX's Cloud TPU detection supplies the rest (not here)
    with pytest.raises(ConfigError, match="distributed.coordinator is not set"):
        maybe_initialize(DistributedConfig(), {"OLMAX_NUM_PROCESSES": "8"})
    assert calls == [dict(coordinator=None, num_processes=8, process_id=None,
                          local_device_ids=None, detection=None)]


def test_bad_integer_is_one_line(calls):
    with pytest.raises(ConfigError, match="JOB_COMPLETION_INDEX"):
        maybe_initialize(DistributedConfig(), {"OLMAX_COORDINATOR": "a:1",
                                               "OLMAX_NUM_PROCESSES": "2",
                                               "JOB_COMPLETION_INDEX": "x"})


def test_slurm_one_process_per_node_drives_every_gpu(calls):
    env = {**SLURM_STEP, "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
    assert slurm_local_device_ids(env) == list(range(8))
    calls.detected = True     # JAX's SLURM detection: coordinator, count and id from SLURM_*
    assert maybe_initialize(DistributedConfig(), env)
    assert calls[-1] == dict(coordinator=None, num_processes=None, process_id=None,
                             local_device_ids=list(range(8)), detection=None)
    assert slurm_local_device_ids({**SLURM_STEP, "SLURM_GPUS_ON_NODE": "4"}) == [0, 1, 2, 3]
    assert slurm_local_device_ids(SLURM_STEP) is None                      # CPU nodes
    assert slurm_local_device_ids({**env, "JAX_LOCAL_DEVICE_IDS": "0"}) is None
    # one process per GPU: JAX's own choice (GPU SLURM_LOCALID) stands
    per_gpu = {**env, "SLURM_NTASKS": "16", "SLURM_STEP_NUM_TASKS": "16"}
    assert slurm_local_device_ids(per_gpu) is None


def test_jax_waits_a_minute_longer_than_olmax_for_the_peers(calls):
    """olmax's own deadline (distributed.init_timeout_s; a line and exit 75) must come first:
    JAX aborts the process at its own (tests/fault/test_startup.py runs a lone process)."""
    env = {"OLMAX_COORDINATOR": "a:1", "OLMAX_NUM_PROCESSES": "2", "OLMAX_PROCESS_ID": "0"}
    assert maybe_initialize(DistributedConfig(init_timeout_s=1800), env)
    assert maybe_initialize(DistributedConfig(), env)
    assert calls.timeouts == [1860, 360]


def test_a_pod_of_a_later_tpu_slice_counts_after_the_earlier_slices(calls):
    """Multi-slice JobSet: JOB_COMPLETION_INDEX counts within the slice (4 hosts each)."""
    env = {"OLMAX_COORDINATOR": "r-slice-0-0.r:8476", "OLMAX_NUM_PROCESSES": "12",
           "JOB_COMPLETION_INDEX": "1", "MEGASCALE_NUM_SLICES": "3", "MEGASCALE_SLICE_ID": "2"}
    assert maybe_initialize(DistributedConfig(), env)
    assert calls[-1]["process_id"] == 2 * 4 + 1
    assert maybe_initialize(DistributedConfig(), {**env, "MEGASCALE_NUM_SLICES": "1",
                                                  "MEGASCALE_SLICE_ID": "0"})
    assert calls[-1]["process_id"] == 1


def test_the_job_refuses_another_platform_or_device_count():
    assert parse_expected_devices("gpu:512") == ("gpu", 512)
    for bad in ("gpu", "cuda:8", "gpu:0", "gpu:x", ":8"):
        with pytest.raises(ConfigError, match="expected PLATFORM:N"):
            parse_expected_devices(bad)
    n = jax.device_count()
    check_devices(("cpu", n))
    with pytest.raises(ConfigError) as e:
        check_devices(("gpu", 512))
    assert str(e.value).startswith(f"the job was written for 512 gpu devices, but this process "
                                   f"sees {n} cpu device(s) in all (JAX_PLATFORMS=")
    with pytest.raises(ConfigError, match=f"written for {n + 1} cpu devices, but this process sees {n} cpu"):
        check_devices(("cpu", n + 1))



ONE_WORKER = [{"TPU_WORKER_HOSTNAMES": "localhost"},          # a one-host TPU VM or container
              {"TPU_PROCESS_ADDRESSES": "10.0.0.2:8476"},
              {"SLURM_NTASKS": "1"}, {"SLURM_NTASKS": "1", "SLURM_STEP_NUM_TASKS": "1"},
              {"OMPI_COMM_WORLD_SIZE": "1"},
              {"TPU_WORKER_HOSTNAMES": "localhost", "MEGASCALE_NUM_SLICES": "1"}]

# One fresh process (JAX's distributed runtime starts only before its backends do) runs
# maybe_initialize with JAX's real cluster detection as on a Cloud TPU VM (JAX sets this flag
# when it finds TPU chips at import), its metadata server at GCE_METADATA_IP, for each case.
_PROBE = r"""
import json, os, sys
from jax._src.clusters import cloud_tpu_cluster
cloud_tpu_cluster.running_in_cloud_tpu_vm = True
from olmax.config import DistributedConfig
from olmax.parallel.distributed import maybe_initialize
out = []
for env in json.loads(sys.argv[1]):
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        out.append(["started" if maybe_initialize(DistributedConfig(), env) else "one process", ""])
    except Exception as e:
        out.append([type(e).__name__, str(e)])
    os.environ.clear(); os.environ.update(saved)
print(json.dumps(out))
"""


def _probe(cases: list[dict]) -> list[list[str]]:
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("TPU_", "SLURM_", "OMPI_"))}
    out = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(cases)], env=env, text=True,
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cluster_of_one_worker_starts_no_distributed_runtime_and_a_failed_detection_is_one_line():
    """A hint that names one worker is one process: JAX's detection would ask the metadata
    server, which a host without one (a container, a VM outside Google Cloud) does not answer.
    Two TPU workers: JAX's real detection runs and asks the metadata server for the slice's
    coordinator. A server name that does not resolve is a configuration error; a server that
    refuses may answer a restart."""
    nowhere = "127.0.0.1:9"     # nothing listens there
    cases = ([{**env, "GCE_METADATA_IP": nowhere} for env in ONE_WORKER]
             + [{"TPU_WORKER_HOSTNAMES": "w-0,w-1", "GCE_METADATA_IP": server}
                for server in ("olmax-no-metadata.invalid", nowhere)])
    results = _probe(cases)
    assert [r[0] for r in results[:len(ONE_WORKER)]] == ["one process"] * len(ONE_WORKER)
    for (kind, line), server, expected in zip(results[len(ONE_WORKER):],
                                              ("olmax-no-metadata.invalid", "127.0.0.1"),
                                              ("ConfigError", "RestartableError")):
        assert kind == expected and "\n" not in line, (kind, line)
        assert line.startswith("distributed: 2 processes by TPU_WORKER_HOSTNAMES=w-0,w-1, but JAX's "
                               f"cluster detection failed: it asked http://{server}")
        assert "/computeMetadata/v1/instance/attributes/" in line
        assert line.endswith("set distributed.coordinator, distributed.num_processes and "
                             "distributed.process_id (or OLMAX_COORDINATOR, OLMAX_NUM_PROCESSES, "
                             "OLMAX_PROCESS_ID), or OLMAX_NUM_PROCESSES=1 for one process")
