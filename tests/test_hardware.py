"""The hardware table (:mod:`olmax.hardware`) is the one source of accelerator and vendor facts:
every other table is derived from it, its rows are reachable, and a new vendor (ROCm) is its rows
plus a profile row: a ROCm job pins the ROCm platform, asks for AMD GPUs and counts the GPUs
Slurm gives it, and the ROCm profile is what ``train.profile=auto`` means on AMD devices."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import yaml

from olmax import hardware
from olmax.cli import main
from olmax.model.flops import peak_flops
from olmax.model.runtime import Runtime
from olmax.parallel.distributed import slurm_local_device_ids
from olmax.perf import targets
from olmax.platforms import compiler_options, float8_matmuls
from olmax.topology import GENERATIONS, parse_tpu


def device(kind: str, platform: str, **kw):
    return SimpleNamespace(device_kind=kind, platform=platform, process_index=0, **kw)


def test_every_row_is_reachable_by_its_own_kinds():
    """Matching is by the first row whose kind is in the device kind: a row listed after a more
    general one would never be found."""
    for a in hardware.ACCELERATORS:
        for kind in a.kinds:
            assert hardware.accelerator_of(kind) is a, (a.name, kind)
    names = [a.name for a in hardware.ACCELERATORS]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("kind, name, peak", [
    ("NVIDIA H100 80GB HBM3", "h100", 989e12), ("NVIDIA H100 PCIe", "h100-pcie", 756e12),
    ("NVIDIA GH200 480GB", "gh200", 989e12), ("NVIDIA H200", "h200", 989e12),
    ("NVIDIA L40S", "l40s", 362e12), ("NVIDIA L4", "l4", 121e12),
    ("AMD Instinct MI300X", "mi300x", 1307.4e12), ("TPU v5 lite", "v5e", 197e12),
    ("TPU v5", "v5p", 459e12), ("TPU7x", "tpu7x", 2307e12 / 2),
])
def test_device_kinds_name_their_rows_and_peaks(kind, name, peak):
    assert hardware.accelerator_of(kind).name == name
    assert peak_flops(kind) == peak
    assert peak_flops(device(kind, "tpu" if "TPU" in kind else "gpu")) == peak
    assert peak_flops(device("cpu", "cpu")) is None and peak_flops("Quantum Q1") is None


def test_other_tables_derive_from_it():
    # TPU slices: Ironwood's two devices per chip are the table's, written once
    for g in GENERATIONS:
        assert g.devices_per_chip == hardware.BY_NAME[g.libtpu].devices_per_chip
    assert parse_tpu("tpu7x-128").devices == 128 and parse_tpu("v5p-128").devices == 64
    # what olmax plan compiles for: every TPU generation and every GPU with a compile target
    assert {a.name for a in targets.ACCELERATORS} == {"v2", "v3", "v4", "v5e", "v5p", "v6e", "tpu7x",
                                                      "h100", "h200"}
    assert targets.TPU_GENERATIONS == ("v2", "v3", "v4", "v5e", "v5p", "v6e", "tpu7x")
    assert dict(targets.HBM_BYTES)["tpu7x"] == hardware.BY_NAME["tpu7x"].hbm == 101_723_287_552
    # compiler options by generation: Ironwood's and v5e's scoped VMEM, none for v5p or a GPU
    assert compiler_options("tpu", [device("TPU7x", "tpu")]) == {"xla_tpu_scoped_vmem_limit_kib": "65536"}
    assert compiler_options("tpu", [device("TPU v5 lite", "tpu")]) == {"xla_tpu_scoped_vmem_limit_kib": "32768"}
    assert compiler_options("tpu", [device("TPU v5", "tpu")]) is None
    assert compiler_options("gpu", [device("NVIDIA H100 80GB HBM3", "cuda")]) is None


def test_float8_from_the_table_and_for_unlisted_nvidia_gpus_by_compute_capability():
    assert float8_matmuls([device("TPU7x", "tpu")]) and not float8_matmuls([device("TPU v5", "tpu")])
    assert float8_matmuls([device("NVIDIA H100 80GB HBM3", "cuda", compute_capability="9.0")])
    assert not float8_matmuls([device("NVIDIA A100-SXM4-80GB", "cuda", compute_capability="8.0")])
    assert float8_matmuls([device("NVIDIA GeForce RTX 4090", "cuda", compute_capability="8.9")])
    assert not float8_matmuls([device("AMD Instinct MI300X", "rocm")])   # fnuz float8 only
    assert float8_matmuls([device("AMD Instinct MI355X", "rocm")])


def test_auto_profile_on_amd_gpus_is_rocm_with_chunked_attention():
    rt = Runtime.resolve(devices=[device("AMD Instinct MI300X", "rocm")])
    assert (rt.profile.name, rt.backend, rt.attn_impl) == ("rocm", "gpu", "chunked")
    nvidia = Runtime.resolve(devices=[device("NVIDIA H100 80GB HBM3", "cuda")])
    assert (nvidia.profile.name, nvidia.backend, nvidia.attn_impl) == ("gpu", "gpu", "cudnn")
    # devices given as an iterator (the evaluator's) are read once for the backend and the profile
    rt = Runtime.resolve(devices=(d for d in [device("AMD Instinct MI300X", "rocm")]))
    assert (rt.profile.name, rt.backend) == ("rocm", "gpu")


def _launch(*argv) -> int:
    try:
        return main(["launch", *map(str, argv)])
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("vendor, platform, resource", [("nvidia", "cuda", "nvidia.com/gpu"),
                                                         ("amd", "rocm", "amd.com/gpu")])
def test_a_gpu_job_exports_its_vendors_platform_and_asks_for_its_resource(tmp_path, vendor, platform,
                                                                         resource):
    out = tmp_path / "job.yaml"
    assert _launch("k8s", "olmo3_tiny", "train.global_batch_size=16", "--nodes", 2, "--gpus-per-node", 8,
                   "--gpu-vendor", vendor, "--controller", "job", "--out", out) == 0
    job = next(d for d in yaml.safe_load_all(out.read_text()) if d and d["kind"] == "Job")
    pod = job["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["JAX_PLATFORMS"] == platform
    assert c["resources"]["limits"] == {resource: 8}
    assert [t["key"] for t in pod["tolerations"]] == [resource]
    script = tmp_path / "job.sbatch"
    assert _launch("slurm", "olmo3_tiny", "train.global_batch_size=16", "--nodes", 2,
                   "--gpu-vendor", vendor, "--run-dir", tmp_path / "run", "--out", script) == 0
    assert f"JAX_PLATFORMS={platform}" in script.read_text()
    assert f"JAX_PLATFORMS={'rocm' if platform == 'cuda' else 'cuda'}" not in script.read_text()


def test_slurm_gpus_are_counted_from_either_vendors_visible_devices():
    step = {"SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2"}
    assert slurm_local_device_ids({**step, "CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == [0, 1, 2, 3]
    assert slurm_local_device_ids({**step, "ROCR_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}) == list(range(8))
    assert slurm_local_device_ids({**step, "SLURM_GPUS_ON_NODE": "2"}) == [0, 1]
