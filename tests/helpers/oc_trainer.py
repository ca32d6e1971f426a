"""OLMo-core's own ``Trainer`` on CPU (ai2-olmo-core 3.0.0), as AI2's official OLMo 3 scripts set it up.

The data's tokenizer is OLMo-core's ``TokenizerConfig`` of ``SPEC["tokenizer"]`` (``vocab``, ``eos``,
``pad``, optionally ``bos`` and ``identifier``); ``config.json`` holds the model's and the dataset's
configs as an experiment's ``ConfigSaverCallback`` writes them.

A ``TrainerConfig`` with a ``CheckpointerCallback`` (a pre-train ``step0`` save unless a checkpoint
was loaded, then one every ``save_interval`` steps), a ``TransformerTrainModule`` with
``SkipStepAdamW`` (the embedding in a no-decay group), ``CosWithWarmup``, z-loss 1e-5, clipping at
1.0, and a ``NumpyFSLDataLoader`` over raw token files. ``Trainer.fit()`` trains; a callback records
each step's CE loss, grad norm and skip flag from the metrics the trainer collects (every step) and
the token ids of each batch it trains on.

Run as a module, one process per rank (``python -m helpers.oc_trainer SPEC.json RANK WORLD``):
world size 2 shards the model with FSDP (``fully_shard`` over gloo), so its checkpoints hold every
tensor in two chunks. Rank 0 writes ``SPEC["out"]``: ``{"steps": [...], "losses": [...],
"grad_norms": [...], "skipped": [...], "batches": [token-id lists]}``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent


def run(spec: dict[str, Any], world_size: int = 1, timeout: float = 600) -> dict[str, Any]:
    """Run OLMo-core's ``Trainer.fit`` on ``spec`` in ``world_size`` fresh processes; its record."""
    spec_path = Path(spec["out"]).with_suffix(".spec.json")
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", OLMO_SHARED_FS="1")
    Path(f"{spec['out']}.pg").unlink(missing_ok=True)   # gloo's rendezvous file
    logs = [spec_path.with_suffix(f".rank{r}.log") for r in range(world_size)]
    files = [log.open("w") for log in logs]
    procs = [subprocess.Popen([sys.executable, "-m", "helpers.oc_trainer", str(spec_path), str(r),
                               str(world_size)], env=env, stdout=f, stderr=subprocess.STDOUT)
             for r, f in enumerate(files)]
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):   # one rank failing stops the others
        if time.monotonic() > deadline or any(p.returncode for p in procs if p.poll() is not None):
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            break
        time.sleep(0.2)
    for f in files:
        f.close()
    for p, log in zip(procs, logs):
        if p.returncode != 0:
            raise RuntimeError(f"OLMo-core trainer rank failed ({p.returncode}):\n"
                               f"{log.read_text()[-6000:]}")
    return json.loads(Path(spec["out"]).read_text())


def token_files(root: Path, *, eos: int, top: int, sizes: tuple[int, ...] = (3000, 2200),
                seed: int = 0, spike: tuple[int, ...] = (), seq_len: int = 32) -> list[str]:
    """Raw uint32 token files under ``root`` for both trainers: ids 1..``top`` (skewed: a model
    learns them within a few steps), ``eos`` separating documents. ``spike``: instances (of
    ``seq_len`` tokens, numbered over the files in order, as OLMo-core's FSL dataset numbers
    them) made of the rarest 100 ids: a batch of them is a loss spike."""
    rng = np.random.default_rng(seed)
    paths = []
    first = 0
    for i, n in enumerate(sizes):
        toks = np.minimum(rng.geometric(0.02, size=n), top).astype(np.uint32)
        toks[rng.integers(0, n, size=n // 200)] = eos
        for instance in spike:
            if first <= instance < first + n // seq_len:
                at = (instance - first) * seq_len
                toks[at:at + seq_len] = rng.integers(top - 99, top + 1, size=seq_len)
        first += n // seq_len
        p = root / f"part-{i}.npy"
        toks.tofile(p)
        paths.append(str(p))
    return paths


def olmax_train(recipe: Path, run: Path, *overrides: str) -> list[dict]:
    """``olmax train RECIPE --run-dir RUN OVERRIDES``, in process; its metrics lines."""
    from olmax.cli import main

    assert main(["train", str(recipe), "--run-dir", str(run), "--quiet", *overrides]) == 0
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r and "step" in r]


def same_steps(ours: list[dict], theirs: dict[str, Any], steps: list[int]) -> None:
    """olmax's metrics lines are OLMo-core's record, step for step: the same steps and batches
    (sha256 of the token ids), CE loss within 1e-5 relative (fp32 sums in another order), grad
    norm within 1e-4 relative, the same skipped steps."""
    from olmax.data.loader import batch_hash

    assert [r["step"] for r in ours] == steps
    assert theirs["steps"] == steps
    for r, loss, norm, skipped, batch in zip(ours, theirs["losses"], theirs["grad_norms"],
                                             theirs["skipped"], theirs["batches"]):
        where = f"step {r['step']}"
        assert r["batch_hash"] == batch_hash(np.asarray(batch)), where
        assert abs(r["loss"] / loss - 1) <= 1e-5, (where, r["loss"], loss)
        assert abs(r["grad_norm"] / norm - 1) <= 1e-4, (where, r["grad_norm"], norm)
        assert r["skipped"] == skipped, where


def _main(spec_path: str, rank: int, world_size: int) -> None:
    import torch
    import torch.distributed as dist
    from olmo_core.config import DType
    from olmo_core.data import collator, data_loader, numpy_dataset
    from olmo_core.data.tokenizer import TokenizerConfig
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.optim import CosWithWarmup, OptimGroupOverride, SkipStepAdamWConfig
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.callbacks import Callback, CheckpointerCallback, ConfigSaverCallback
    from olmo_core.train.train_module import (TransformerDataParallelConfig,
                                              TransformerTrainModuleConfig)

    from helpers import olmo_core as ref
    from olmax.config import ModelConfig

    spec = json.loads(Path(spec_path).read_text())
    torch.manual_seed(0)
    dist.init_process_group("gloo", init_method=f"file://{spec['out']}.pg", rank=rank,
                            world_size=world_size)
    cfg = ModelConfig(**spec["model"])
    T, B = spec["seq_len"], spec["global_batch_size"]
    model = ref.oc_config(cfg).build(init_device="cpu")
    dp = (TransformerDataParallelConfig(name=DataParallelType.fsdp, param_dtype=DType.float32,
                                        reduce_dtype=DType.float32) if world_size > 1 else None)
    o = spec["optim"]
    module_cfg = TransformerTrainModuleConfig(
        rank_microbatch_size=spec["micro_batch_size"] * T, max_sequence_length=T,
        optim=SkipStepAdamWConfig(
            lr=o["lr"], betas=tuple(o["betas"]), eps=o["eps"], weight_decay=o["weight_decay"],
            rolling_interval_length=o["rolling_interval_length"], sigma_factor=int(o["sigma_factor"]),
            group_overrides=[OptimGroupOverride(params=["embeddings.weight"],
                                                opts=dict(weight_decay=0.0))], foreach=True,
            step_increment_bugfix=o.get("step_increment_bugfix", True)),
        scheduler=CosWithWarmup(warmup=spec["warmup"], alpha_f=spec["alpha_f"]),
        z_loss_multiplier=1e-5, max_grad_norm=o["max_grad_norm"], dp_config=dp)
    module = module_cfg.build(model, device=torch.device("cpu"))
    t = spec["tokenizer"]
    tokenizer = TokenizerConfig(vocab_size=t["vocab"], eos_token_id=t["eos"], pad_token_id=t["pad"],
                                bos_token_id=t.get("bos"), identifier=t.get("identifier"))
    ds = numpy_dataset.NumpyFSLDataset(*spec["paths"], sequence_length=T, pad_token_id=t["pad"],
                                       eos_token_id=t["eos"], vocab_size=t["vocab"],
                                       bos_token_id=t.get("bos"), dtype=np.uint32)
    ds.prepare()
    loader = data_loader.NumpyFSLDataLoader(
        ds, collator=collator.DataCollator(pad_token_id=t["pad"]), global_batch_size=B * T,
        work_dir=spec["work_dir"], seed=spec["seed"], shuffle=True, dp_world_size=world_size,
        dp_rank=rank, fs_local_rank=rank)
    record: dict[str, list] = {"steps": [], "losses": [], "grad_norms": [], "skipped": [],
                               "lrs": [], "batches": []}

    class Record(Callback):
        def pre_step(self, batch):
            ids = batch["input_ids"]
            if world_size > 1:
                parts = [torch.empty_like(ids) for _ in range(world_size)]
                dist.all_gather(parts, ids)   # rank r holds rows r, r + world, ... of the batch
                ids = torch.stack(parts, dim=1).reshape(-1, ids.shape[-1])
            if rank == 0:
                record["batches"].append(ids.tolist())

        def log_metrics(self, step, metrics):
            if rank == 0 and "train/CE loss" in metrics:
                record["steps"].append(step)
                record["losses"].append(float(metrics["train/CE loss"]))
                record["grad_norms"].append(float(metrics["optim/total grad norm"]))
                record["skipped"].append(float(metrics["optim/step skipped"]))
                record["lrs"].append(float(metrics["optim/LR (group 1)"]))

    trainer_cfg = TrainerConfig(
        save_folder=spec["save_folder"], work_dir=spec["work_dir"], device="cpu",
        save_overwrite=True, metrics_collect_interval=1, cancel_check_interval=1,
        max_duration=Duration.steps(spec["max_steps"]),
        hard_stop=Duration.steps(spec["hard_stop"]) if spec.get("hard_stop") else None,
        load_path=spec.get("load_path"), load_trainer_state=spec.get("load_trainer_state"),
        load_optim_state=spec.get("load_optim_state"),
    ).with_callback("checkpointer", CheckpointerCallback(save_interval=spec["save_interval"],
                                                         ephemeral_save_interval=None,
                                                         save_async=False)
    ).with_callback("record", Record()).with_callback("config_saver", ConfigSaverCallback())
    trainer = trainer_cfg.build(module, loader)
    saver = trainer.callbacks["config_saver"]
    assert isinstance(saver, ConfigSaverCallback)
    dataset = numpy_dataset.NumpyFSLDatasetConfig(tokenizer=tokenizer, paths=spec["paths"],
                                                  sequence_length=T, work_dir=spec["work_dir"])
    saver.config = {"model": ref.oc_config(cfg).as_config_dict(),
                    "dataset": dataset.as_config_dict(),
                    "train_module": module_cfg.as_config_dict(),
                    "trainer": trainer_cfg.as_config_dict()}
    trainer.fit()
    if rank == 0:
        Path(spec["out"]).write_text(json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
