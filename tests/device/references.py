"""The references the device tests compare against, computed on a CPU with the reference
implementations (torch, transformers, ai2-olmo-core), written as files that travel to a machine
without them (a TPU host):

- ``parity/CASE/``: a tiny random HF ``Olmo3ForCausalLM`` directory, and ``parity/CASE.npz``:
  HF's fp32 logits for seeded token ids (``olmax parity --save-reference``);
- ``olmo_core.npz``: the 24-step OLMo-core trajectory of ``tests/train/test_oc_parity.py`` (the
  initial weights, the batches, OLMo-core's losses, gradient norms, skipped steps and final
  weights);
- ``manifest.json``: what was made, with which versions.

    PYTHONPATH=src:tests python tests/device/references.py DIR     (scripts/test --device-references)
"""

from __future__ import annotations

import json
import os
import platform
import sys
from pathlib import Path

import numpy as np

# (HF model kwargs, seq_len, batch): a sequence several windows long, GQA, both layer kinds
PARITY = {"gqa-windows": (dict(heads=4, kv_heads=2, window=8, layers=4), 32, 2),
          "mha-head64": (dict(heads=2, kv_heads=2, head_dim=64, hidden=128, window=16), 64, 1)}


def flat(tree) -> dict[str, np.ndarray]:
    import jax

    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def make(dest: Path) -> dict:
    import jax
    import torch
    import transformers

    from helpers.hf_models import make_hf_model
    from helpers.olmo_core import CFG, make_batches, run_olmo_core
    from olmax.interop.parity import run_parity
    from olmax.model.params import init_params

    dest.mkdir(parents=True, exist_ok=True)
    made = {"parity": {}, "versions": {"torch": torch.__version__,
                                       "transformers": transformers.__version__,
                                       "jax": jax.__version__, "python": platform.python_version()}}
    for name, (kw, seq_len, batch) in PARITY.items():
        make_hf_model(dest / "parity" / name, **kw)
        report = run_parity(dest / "parity" / name, seq_len=seq_len, batch=batch, seed=1,
                            save_reference=dest / "parity" / f"{name}.npz")
        made["parity"][name] = {"seq_len": seq_len, "batch": batch, "cpu_kl_max": report["kl_max"]}

    params = init_params(CFG, jax.random.key(3))
    batches = make_batches()
    losses, skipped, norms, final = run_olmo_core(params, batches)
    arrays = {f"params{k}": v for k, v in flat(params).items()}
    arrays.update({f"final{k}": v for k, v in flat(final).items()})
    arrays.update(tokens=np.stack([t for t, _ in batches]), masks=np.stack([m for _, m in batches]),
                  losses=np.asarray(losses), skipped=np.asarray(skipped), norms=np.asarray(norms))
    np.savez(dest / "olmo_core.npz", **arrays)
    made["olmo_core"] = {"steps": len(batches), "ai2-olmo-core": _version("ai2-olmo-core")}
    (dest / "manifest.json").write_text(json.dumps(made, indent=2) + "\n")
    return made


def _version(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: references.py DIR")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    print(json.dumps(make(Path(sys.argv[1])), indent=2))
