"""Kubernetes: a JobSet (default) or an Indexed Job with a headless Service.

**JobSet** (``--controller jobset``; the JobSet controller must be installed): one replicated job
per TPU slice (GPUs: one), each an Indexed Job of one pod per host. ``backoffLimit: 0`` makes any
failed pod fail its Job, and the JobSet then restarts *every* pod together, up to
``--max-restarts`` times (``failurePolicy.maxRestarts``). TPU slices are placed one per node pool
(``alpha.jobset.sigs.k8s.io/exclusive-topology: cloud.google.com/gke-nodepool``), so the hosts of
a slice are the hosts of one physical slice. Several slices (``--num-slices``) form one job over
the data-center network (``MEGASCALE_*``; the launcher's mesh puts the data axis across them).
Pod ``p`` of slice ``s`` is ``<name>-slice-<s>-<p>`` (GPUs: ``<name>-node-0-<p>``) in the JobSet's
own headless Service; pod 0 of slice 0 is the coordinator.

**Job** (``--controller job``, plain ``batch/v1``): an Indexed Job and a headless Service; the Job
controller replaces failed pods one by one (``backoffLimit`` = ``--max-restarts`` x pods).

Either way: every pod gets ``OLMAX_COORDINATOR`` and ``OLMAX_NUM_PROCESSES`` (the process id is the
pod's ``JOB_COMPLETION_INDEX``, plus the slice's offset; :mod:`olmax.parallel.distributed`) and the
attempt (``--attempt <uid>.<restart attempt>``: a restarted JobSet takes over the run directory at
once). What the pod failure policy does with an exit status:

- 2 (configuration or input error) or 3 (needs a person): the Job fails and the JobSet stops for
  good (rule ``onJobFailureReasons: [PodFailurePolicy]`` -> ``FailJobSet``); a restart cannot help;
- 143 (a preempted or evicted pod: every process saved a checkpoint at the same step and stopped)
  and disruptions: ignored: the pods are started again without counting a failure;
- anything else (75, a signal): a failure, restarted as above.

``--queue`` adds Kueue's queue label (the whole JobSet is admitted at once), ``--cpu``/``--memory``
requests keep the pods out of the BestEffort class, and for GPU fabrics ``--resource``,
``--annotation``, ``--host-network`` and ``--patch FILE`` (a strategic-merge patch of the pod
template, e.g. TCPX/TCPXO sidecars and their volumes) add what the cluster's network needs.
"""

from __future__ import annotations

import copy
import os
import posixpath
import re
from typing import Any, Mapping, Sequence

import yaml

from olmax.config import MAX_YAML_BYTES, check_yaml_size, safe_load_strict
from olmax.errors import EXIT_STOPPED, NO_RESTART, ConfigError
from olmax.io import read_text
from olmax.store import is_bucket
from olmax.launch.job import SET_ME, Fit, Job, check_label, comment, provenance, train_argv
from olmax.topology import TpuSlice


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data) -> bool:   # plain YAML: no &anchors for repeated labels
        return True


STOP_EXIT_CODE = EXIT_STOPPED               # stopped after saving; the pod is to be started again
STOP_FOR_GOOD_EXIT_CODES = tuple(NO_RESTART)  # configuration or input error; needs a person
CONTAINER = "olmax"
CONTROLLERS = ("jobset", "job")
JOBSET_NAME_MAX = 48        # <name>-slice-<s>-<p> must stay a 63-character host name
_QUANTITY = re.compile(r"\d+(\.\d+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?")
_RESOURCE = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_ANNOTATION = re.compile(r"([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
JOBSET_LABEL = "jobset.sigs.k8s.io/"
EXCLUSIVE_TOPOLOGY = {"alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"}
KUEUE_QUEUE = "kueue.x-k8s.io/queue-name"


def literal(text: str) -> str:
    """``text`` as Kubernetes passes it on: ``$(NAME)`` in a command or an env value is a
    reference and ``$$`` one dollar, so every ``$`` followed by ``(`` or ``$`` is doubled."""
    return re.sub(r"\$(?=[($])", "$$", text)


def _pairs(items: Sequence[str], flag: str, key_re: re.Pattern | None = None,
           value_re: re.Pattern | None = None) -> dict[str, str]:
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key or (key_re is not None and not key_re.fullmatch(key)) \
                or (value_re is not None and not value_re.fullmatch(value)):
            what = "NAME=QUANTITY (e.g. rdma/ib=1)" if flag == "--resource" else "KEY=VALUE"
            raise ConfigError(f"{flag} {item!r} is not of the form {what}")
        out[key] = value
    return out


def _quantity(value: str | None, flag: str) -> str | None:
    if value is not None and not _QUANTITY.fullmatch(value):
        raise ConfigError(f"{flag} {value!r}: a Kubernetes quantity, e.g. 8, 500m, 64Gi")
    return value


# Lists of a pod template that a strategic-merge patch merges by a key (as the API server does);
# other lists are replaced.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "env": "name",
              "volumeMounts": "mountPath", "ports": "containerPort", "imagePullSecrets": "name"}


def strategic_merge(base: Any, patch: Any, key: str = "") -> Any:
    """``patch`` merged into ``base`` as ``kubectl patch --type strategic`` merges a pod template:
    mappings key by key (``null`` deletes), the lists of :data:`MERGE_KEYS` item by item, other
    values replaced. ``$patch: replace`` in a mapping replaces it; ``$patch: delete`` in a list
    item removes the item with that key."""
    if isinstance(base, dict) and isinstance(patch, dict):
        if patch.get("$patch") == "replace":
            return {k: v for k, v in patch.items() if k != "$patch"}
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = strategic_merge(out[k], v, k)
            else:
                out[k] = strategic_merge({}, v, k) if isinstance(v, dict) else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and key in MERGE_KEYS:
        by = MERGE_KEYS[key]
        out = [copy.deepcopy(x) for x in base]
        for item in patch:
            if not isinstance(item, dict) or by not in item:
                raise ConfigError(f"--patch: every item of {key} needs its '{by}'")
            at = next((i for i, x in enumerate(out) if isinstance(x, dict) and x.get(by) == item[by]), None)
            if item.get("$patch") == "delete":
                if at is not None:
                    out.pop(at)
            elif at is None:
                out.append({k: v for k, v in item.items() if k != "$patch"})
            else:
                out[at] = strategic_merge(out[at], item, key)
        return out
    return copy.deepcopy(patch)


def read_patch(path: str) -> dict:
    """A strategic-merge patch of the pod template: YAML with ``metadata`` and/or ``spec``, read
    with a recipe's limits (its size, and the values its aliases expand to)."""
    try:
        size = os.stat(path).st_size
        if size > MAX_YAML_BYTES:
            raise ConfigError(f"--patch {path}: {size:,} bytes, more than a patch may hold "
                              f"({MAX_YAML_BYTES:,})")
        data = safe_load_strict(read_text(path))
    except OSError as e:
        raise ConfigError(f"--patch {path}: cannot read it ({e.strerror or e})") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"--patch {path}: invalid YAML ({str(e).splitlines()[0]})") from None
    check_yaml_size(data, f"--patch {path}")
    if not isinstance(data, dict) or not data or set(data) - {"metadata", "spec"}:
        raise ConfigError(f"--patch {path}: expected a mapping of the pod template's metadata "
                          "and/or spec (a strategic-merge patch)")
    for k, v in data.items():
        if not isinstance(v, dict):
            raise ConfigError(f"--patch {path}: {k} must be a mapping")
    return data


def check_template(template: Any, devices: Mapping[str, Any]) -> None:
    """The pod template after ``--patch``, checked against what the API server and olmax need
    (ConfigError naming ``--patch``): the training container is still there with its command,
    the restart policy is ``Never`` (a pod failure policy, which acts on olmax's exit statuses,
    requires it), and the container's device limits are the ones the job was written for."""
    spec = template.get("spec") if isinstance(template, dict) else None
    containers = spec.get("containers") if isinstance(spec, dict) else None
    mine = [c for c in containers or () if isinstance(c, dict) and c.get("name") == CONTAINER]
    if not mine:
        raise ConfigError(f"--patch removes the training container '{CONTAINER}' from the pod "
                          f"template")
    if not mine[0].get("command"):
        raise ConfigError(f"--patch removes the command of the training container '{CONTAINER}'")
    policy = spec.get("restartPolicy")
    if policy != "Never":
        raise ConfigError(f"--patch sets restartPolicy {policy!r}; the job's pod failure policy "
                          f"(olmax's exit statuses) needs restartPolicy Never")
    resources = mine[0].get("resources")
    limits = resources.get("limits") if isinstance(resources, dict) else None
    limits = limits if isinstance(limits, dict) else {}
    for name, want in devices.items():
        if str(limits.get(name)) != str(want):
            raise ConfigError(f"--patch sets the training container's {name} limit to "
                              f"{limits.get(name)!r}, but the job was written for {want} per pod")


def render(job: Job, fit: Fit, *, tpu: TpuSlice | None = None, controller: str = "jobset",
           image: str | None = None, namespace: str | None = None,
           volume_claim: str | None = None, mount_path: str = "/mnt/runs",
           node_selectors: Sequence[str] = (), port: int = 8476, queue: str | None = None,
           cpu: str | None = None, memory: str | None = None, resources: Sequence[str] = (),
           annotations: Sequence[str] = (), host_network: bool = False,
           patch: dict | None = None) -> str:
    if controller not in CONTROLLERS:
        raise ConfigError(f"--controller {controller!r}: one of {', '.join(CONTROLLERS)}")
    if not posixpath.isabs(mount_path):
        raise ConfigError(f"--mount-path {mount_path!r} must be an absolute path")
    bucket = is_bucket(job.run_dir)      # a bucket run dir: no shared volume, unless one is named
    volume = not bucket or volume_claim is not None     # (for the inputs: data, weights)
    inside = posixpath.relpath(posixpath.normpath(job.run_dir), posixpath.normpath(mount_path))
    if not bucket and (not posixpath.isabs(job.run_dir) or inside == ".."
                       or inside.startswith("../")):
        raise ConfigError(f"--run-dir {job.run_dir} must lie on the shared volume mounted at "
                          f"{mount_path} (--mount-path)")
    if not 1 <= port <= 65535:
        raise ConfigError(f"--port must be 1..65535 (got {port})")
    if namespace is not None:
        check_label(namespace, "--namespace")
    if queue is not None:
        check_label(queue, "--queue")
    if controller == "jobset":
        check_label(job.name, "--name", JOBSET_NAME_MAX)
    if job.num_slices > 1 and controller != "jobset":
        raise ConfigError("--num-slices needs --controller jobset (one replicated job per slice)")
    requests = {k: v for k, v in (("cpu", _quantity(cpu, "--cpu")),
                                  ("memory", _quantity(memory, "--memory"))) if v}
    extra_limits = _pairs(resources, "--resource", _RESOURCE, _QUANTITY)
    pod_annotations = _pairs(annotations, "--annotation", _ANNOTATION)

    gpus = job.devices_per_node if job.platform == "gpu" else 0
    labels = {"app.kubernetes.io/name": "olmax", "app.kubernetes.io/instance": job.name}
    meta = {"name": job.name, **({"namespace": namespace} if namespace else {}), "labels": labels}
    rjob = "slice" if tpu else "node"
    hosts_per_slice = job.nodes // job.num_slices
    if controller == "jobset":
        coordinator_host = f"{job.name}-{rjob}-0-0.{job.name}"
        attempt = "$(OLMAX_JOB_UID).$(OLMAX_RESTART_ATTEMPT)"
        downward = {"OLMAX_JOB_UID": f"metadata.labels['{JOBSET_LABEL}jobset-uid']",
                    "OLMAX_RESTART_ATTEMPT": f"metadata.labels['{JOBSET_LABEL}restart-attempt']"}
    else:
        coordinator_host = f"{job.name}-0.{job.name}"
        attempt = "$(OLMAX_JOB_UID).0"   # one Job: a replaced pod waits out a dead holder's lock
        downward = {"OLMAX_JOB_UID": "metadata.labels['batch.kubernetes.io/controller-uid']"}
    env: list[dict] = [{"name": k, "valueFrom": {"fieldRef": {"fieldPath": v}}}
                       for k, v in downward.items()]
    plain = {"OLMAX_COORDINATOR": f"{coordinator_host}:{port}",
             "OLMAX_NUM_PROCESSES": str(job.processes)}
    if job.num_slices > 1:
        plain.update({"MEGASCALE_COORDINATOR_ADDRESS": coordinator_host,
                      "MEGASCALE_NUM_SLICES": str(job.num_slices)})
        env.append({"name": "MEGASCALE_SLICE_ID",
                    "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{JOBSET_LABEL}job-index']"}}})
    plain.update(job.environment())
    env += [{"name": k, "value": literal(v)} for k, v in plain.items()]

    selectors = _pairs(node_selectors, "--node-selector")
    tolerations = []
    limits: dict = {}
    if tpu:
        selectors = {"cloud.google.com/gke-tpu-accelerator": tpu.gke_accelerator,
                     "cloud.google.com/gke-tpu-topology": tpu.topology, **selectors}
    if (tpu or gpus) and job.vendor is not None:
        resource = job.vendor.k8s_resource      # a TPU's counts chips, a GPU's devices
        limits = {resource: tpu.chips_per_host if tpu else gpus}
        tolerations = [{"key": resource, "operator": "Exists", "effect": "NoSchedule"}]
    for name in set(extra_limits) & set(limits):   # the devices the job was written for
        if str(extra_limits[name]) != str(limits[name]):
            raise ConfigError(f"--resource {name}={extra_limits[name]} would replace the "
                              f"{limits[name]} the job was written for (--gpus-per-node, "
                              f"--topology); change those instead")
    devices = dict(limits)
    limits.update({k: (int(v) if v.isdigit() else v) for k, v in extra_limits.items()})
    resources_spec = {**({"requests": requests} if requests else {}),
                      **({"limits": limits} if limits else {})}

    argv = train_argv(job, fit, "--exit-code-on-stop", str(STOP_EXIT_CODE), "--attempt", attempt)
    command = [literal(a) for a in argv]
    command[argv.index("--attempt") + 1] = attempt    # a reference Kubernetes expands
    container = {
        "name": CONTAINER,
        "image": image or f"{SET_ME}/image-with-olmax:tag",
        "command": command,
        "env": env,
        "ports": [{"name": "coordinator", "containerPort": port}],
        **({"resources": resources_spec} if resources_spec else {}),
        "volumeMounts": [*([{"name": "runs", "mountPath": mount_path}] if volume else []),
                         {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    pod_spec = {
        **({"subdomain": job.name} if controller == "job" else {}),
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": job.grace_s,
        **({"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"} if host_network else {}),
        **({"nodeSelector": selectors} if selectors else {}),
        **({"tolerations": tolerations} if tolerations else {}),
        "containers": [container],
        "volumes": [
            *([{"name": "runs", "persistentVolumeClaim": {
                "claimName": volume_claim or f"{SET_ME}-shared-volume-claim"}}] if volume else []),
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        ],
    }
    template: dict = {"metadata": {"labels": dict(labels),
                                   **({"annotations": pod_annotations} if pod_annotations else {})},
                      "spec": pod_spec}
    if patch:
        template = strategic_merge(template, patch)
        check_template(template, devices)
    pod_policy = {"rules": [
        {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                              "values": list(STOP_FOR_GOOD_EXIT_CODES)}},
        {"action": "Ignore", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                             "values": [STOP_EXIT_CODE]}},
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget"}]},
    ]}
    job_spec = {
        "completionMode": "Indexed",
        "completions": hosts_per_slice,
        "parallelism": hosts_per_slice,
        # JobSet: any failed pod fails its Job and the JobSet restarts every pod together. Job:
        # one failure takes down every process of the run, so count restarts of the whole run.
        "backoffLimit": 0 if controller == "jobset" else job.max_restarts * job.nodes,
        "podFailurePolicy": pod_policy,
        "template": template,
    }
    if queue:
        meta["labels"] = {**labels, KUEUE_QUEUE: queue}
    if controller == "jobset":
        docs = [{
            "apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
            "metadata": {**meta, **({"annotations": dict(EXCLUSIVE_TOPOLOGY)} if tpu else {})},
            "spec": {
                "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                "failurePolicy": {
                    "maxRestarts": job.max_restarts,
                    "rules": [{"name": "stopForGood", "action": "FailJobSet",
                               "onJobFailureReasons": ["PodFailurePolicy"]}],
                },
                "replicatedJobs": [{"name": rjob, "replicas": job.num_slices,
                                    "template": {"spec": job_spec}}],
            },
        }]
    else:
        service_meta = {k: v for k, v in meta.items() if k != "labels"} | {"labels": labels}
        docs = [
            {"apiVersion": "v1", "kind": "Service", "metadata": service_meta,
             "spec": {"clusterIP": "None", "publishNotReadyAddresses": True, "selector": labels,
                      "ports": [{"name": "coordinator", "port": port, "targetPort": port}]}},
            {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta, "spec": job_spec},
        ]
    return _header(job, fit, tpu, controller, gpus) + "---\n" + yaml.dump_all(
        docs, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)


def _header(job: Job, fit: Fit, tpu: TpuSlice | None, controller: str, gpus: int) -> str:
    if tpu:
        slices = f"{job.num_slices} x " if job.num_slices > 1 else "a "
        hardware = (f"{slices}TPU slice {tpu.name} ({job.nodes // job.num_slices} host(s) x "
                    f"{tpu.chips_per_host} chips each)")
    elif gpus:
        hardware = f"{job.nodes} pod(s) x {gpus} GPU(s)"
    else:
        hardware = f"{job.nodes} pod(s) x {job.devices_per_node} CPU device(s)"
    zero = ("-l jobset.sigs.k8s.io/jobset-name=NAME,jobset.sigs.k8s.io/job-index=0,"
            "batch.kubernetes.io/job-completion-index=0" if controller == "jobset" else
            "-l batch.kubernetes.io/job-name=NAME,batch.kubernetes.io/job-completion-index=0")
    kind = "JobSet" if controller == "jobset" else "Job"
    lines = [
        comment(f"olmax: {job.recipe} on {hardware}, one training process per pod; "
                f"{fit.describe(job)}."),
        provenance(job),
        "",
        "Start with `kubectl apply -f <this file>`; follow process 0 with",
        comment(f"`kubectl logs -f {zero.replace('NAME', job.name)}`."),
        f"To continue after the {kind} ended (failed, or deleted): `kubectl delete -f <this file>;",
        "kubectl apply -f <this file>` resumes the run from its last checkpoint.",
        "",
        comment(f"Restarts: every pod together after a failure, up to {job.max_restarts} times; never "
                "after exit status 2 or 3 (a configuration"),
        "or input error, or a run that needs a person); a preemption (143) is restarted uncounted.",
        "",
        f"Set by hand where this file says {SET_ME}:",
        "  - image: a container image with olmax installed (`olmax` on PATH);",
        *(["  - the run directory is a bucket path: no shared volume is needed (checkpoints,",
           comment(f"    metrics and the run lock go straight to {job.run_dir}); every pod needs"),
           "    credentials for it (GKE Workload Identity for gs://, the AWS_* variables or an",
           "    IAM role for s3://; --env AWS_ENDPOINT_URL=... for an S3-compatible store);"]
          if is_bucket(job.run_dir) else
          ["  - the volume claim: a ReadWriteMany PersistentVolumeClaim every pod mounts (NFS,",
           comment(f"    Filestore, Lustre, ...); the run directory {job.run_dir} lies on it;")]),
        "  - node selectors / tolerations / namespace / queue as your cluster requires",
        "    (--node-selector, --namespace, --queue); the GPU fabric (--resource, --annotation,",
        "    --host-network, --patch, --env NCCL_...=...).",
        "Pods must resolve each other by name (the headless Service) and reach the coordinator port.",
    ]
    if controller == "jobset":
        lines.append("Needs the JobSet controller (jobset.x-k8s.io) in the cluster.")
    if tpu:
        lines.append("GKE injects the TPU worker variables for Indexed Jobs on TPU slice node pools.")
    return "".join(f"# {line}\n" if line else "#\n" for line in lines)


__all__ = ["render", "strategic_merge", "read_patch", "literal", "CONTROLLERS"]
