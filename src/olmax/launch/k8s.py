"""Kubernetes: an Indexed Job with a headless Service (plain ``batch/v1``, no operator needed).

Pod ``i`` is ``<name>-<i>`` with ``JOB_COMPLETION_INDEX=i``; the Service gives pod 0 the name
``<name>-0.<name>``, which every pod receives as ``OLMAX_COORDINATOR`` together with
``OLMAX_NUM_PROCESSES`` (:mod:`olmax.parallel.distributed` takes the process id from the index).
Stopping and resuming: a preempted or evicted pod receives SIGTERM, every process saves a
checkpoint at the same step and exits 143; the pod failure policy does not count that (nor a
disruption) against ``backoffLimit`` and the Job starts the pods again, which resume from the
checkpoint on the shared volume. Exit status 2 (a bad config or input, a non-finite loss) fails the
Job at once: restarting cannot help.
"""

from __future__ import annotations

import posixpath
from typing import Sequence

import yaml

from olmax.config import ConfigError
from olmax.launch.job import (GPU_XLA_FLAGS, SET_ME, Fit, Job, check_label, comment, provenance,
                              train_argv)
from olmax.launch.tpu import TpuSlice


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:   # plain YAML: no &anchors for repeated labels
        return True


STOP_EXIT_CODE = 143      # 128 + SIGTERM: stopped after saving; the pod is to be started again
USER_ERROR_EXIT_CODE = 2  # olmax's exit status for a configuration or input error
CONTAINER = "olmax"


def _selectors(items: Sequence[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"--node-selector {item!r} is not of the form LABEL=VALUE")
        out[key] = value
    return out


def render(job: Job, fit: Fit, *, tpu: TpuSlice | None = None, image: str | None = None,
           namespace: str | None = None, volume_claim: str | None = None,
           mount_path: str = "/mnt/runs", node_selectors: Sequence[str] = (), port: int = 8476,
           max_restarts: int = 10) -> str:
    if not posixpath.isabs(mount_path):
        raise ConfigError(f"--mount-path {mount_path!r} must be an absolute path")
    inside = posixpath.relpath(posixpath.normpath(job.run_dir), posixpath.normpath(mount_path))
    if not posixpath.isabs(job.run_dir) or inside == ".." or inside.startswith("../"):
        raise ConfigError(f"--run-dir {job.run_dir} must lie on the shared volume mounted at "
                          f"{mount_path} (--mount-path)")
    if not 1 <= port <= 65535:
        raise ConfigError(f"--port must be 1..65535 (got {port})")
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0 (got {max_restarts})")
    if namespace is not None:
        check_label(namespace, "--namespace")
    gpus = 0 if tpu else (job.devices_per_node or 0)
    labels = {"app.kubernetes.io/name": "olmax", "app.kubernetes.io/instance": job.name}
    meta = {"name": job.name, **({"namespace": namespace} if namespace else {}), "labels": labels}

    env = {"OLMAX_COORDINATOR": f"{job.name}-0.{job.name}:{port}",
           "OLMAX_NUM_PROCESSES": str(job.nodes), "PYTHONUNBUFFERED": "1"}
    if gpus:
        env["XLA_FLAGS"] = GPU_XLA_FLAGS
    env.update(dict(job.env))
    selectors = _selectors(node_selectors)
    tolerations = []
    resources: dict = {}
    if tpu:
        selectors = {"cloud.google.com/gke-tpu-accelerator": tpu.gke_accelerator,
                     "cloud.google.com/gke-tpu-topology": tpu.topology, **selectors}
        resources = {"limits": {"google.com/tpu": tpu.chips_per_host}}
        tolerations = [{"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}]
    elif gpus:
        resources = {"limits": {"nvidia.com/gpu": gpus}}
        tolerations = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]

    container = {
        "name": CONTAINER,
        "image": image or f"{SET_ME}/image-with-olmax:tag",
        "command": train_argv(job, "--exit-code-on-stop", str(STOP_EXIT_CODE)),
        "env": [{"name": k, "value": v} for k, v in env.items()],
        "ports": [{"name": "coordinator", "containerPort": port}],
        **({"resources": resources} if resources else {}),
        "volumeMounts": [{"name": "runs", "mountPath": mount_path},
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    pod_spec = {
        "subdomain": job.name,
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": job.grace_s,
        **({"nodeSelector": selectors} if selectors else {}),
        **({"tolerations": tolerations} if tolerations else {}),
        "containers": [container],
        "volumes": [
            {"name": "runs", "persistentVolumeClaim": {
                "claimName": volume_claim or f"{SET_ME}-shared-volume-claim"}},
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        ],
    }
    service = {
        "apiVersion": "v1", "kind": "Service", "metadata": meta,
        "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": labels,
                 "ports": [{"name": "coordinator", "port": port, "targetPort": port}]},
    }
    exit_codes = [(USER_ERROR_EXIT_CODE, "FailJob"), (STOP_EXIT_CODE, "Ignore")]
    job_obj = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
        "spec": {
            "completionMode": "Indexed",
            "completions": job.nodes,
            "parallelism": job.nodes,
            # One failure takes down every process of the run: count restarts of the whole run.
            "backoffLimit": max_restarts * job.nodes,
            "podFailurePolicy": {"rules": [
                *({"action": action, "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                     "values": [code]}}
                  for code, action in exit_codes),
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
            ]},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }
    if tpu:
        hardware = f"a TPU slice {tpu.name} ({tpu.hosts} host(s) x {tpu.chips_per_host} chips)"
    elif gpus:
        hardware = f"{job.nodes} pod(s) x {gpus} GPU(s)"
    else:
        hardware = f"{job.nodes} pod(s), CPUs only"
    header = [
        comment(f"olmax: {job.recipe} on {hardware}, one training process per pod; "
                f"{fit.describe(job)}."),
        provenance(job),
        "",
        "Start with `kubectl apply -f <this file>`. To continue after the Job ended (failed, or",
        "deleted): `kubectl delete -f <this file>; kubectl apply -f <this file>` resumes the run",
        "from its last checkpoint.",
        "",
        f"Set by hand where this file says {SET_ME}:",
        "  - image: a container image with olmax installed (`olmax` on PATH);",
        "  - the volume claim: a ReadWriteMany PersistentVolumeClaim every pod mounts (NFS,",
        comment(f"    Filestore, Lustre, ...); the run directory {job.run_dir} lies on it;"),
        "  - node selectors / tolerations / namespace as your cluster requires (--node-selector,",
        "    --namespace); NCCL network settings for the fabric if needed (--env NCCL_...=...).",
        "Pods must resolve each other by name (the headless Service) and reach the coordinator port.",
    ]
    if tpu:
        header.append("GKE injects the TPU worker variables for Indexed Jobs on TPU slice node pools.")
    head = "".join(f"# {line}\n" if line else "#\n" for line in header)
    body = yaml.dump_all([service, job_obj], Dumper=_Dumper, sort_keys=False,
                         default_flow_style=False, width=100)
    return head + "---\n" + body
