"""The CPU benchmark shapes, read from their recipes (``benchmarks/shapes/<name>.yaml``), for the
scripts that compare olmax with a peer and give the peer the same widths.

All are OLMo 3 blocks (reordered post-norm, full-width QK-norm, SwiGLU, RoPE 5e5), windows
[W, W, W, full], n_kv_heads = n_heads, head_dim = d_model / n_heads, untied head, fp32 parameters.
MLP widths are what OLMo-core's ``llama_like`` gives (8d/3 rounded up to a multiple of 256).
Each YAML's comment says what the shape is for. A new shape is one more YAML file.
"""

from __future__ import annotations

from pathlib import Path

import yaml

FOLDER = Path(__file__).resolve().parent / "shapes"


def _shape(path: Path) -> dict:
    raw = yaml.safe_load(path.read_text())
    m, t = raw["model"], raw["train"]
    w = m["window_pattern"][0]
    s = dict(d_model=m["d_model"], n_layers=m["n_layers"], n_heads=m["n_heads"],
             mlp_hidden=m["mlp_hidden"], vocab=m["padded_vocab_size"], window=w,
             batch=t["global_batch_size"], seq=t["seq_len"], model=m)
    s["label"] = (f"d{s['d_model']}, {s['n_layers']} layers, {s['n_heads']} heads, MLP "
                  f"{s['mlp_hidden']}, vocab {s['vocab']}, window {w}")
    return s


SHAPES: dict[str, dict] = {p.stem: _shape(p) for p in sorted(FOLDER.glob("*.yaml"))}


def model_overrides(name: str) -> dict:
    """The shape's model section (preset ``olmo3-190m`` with the shape's widths), for
    ``resolve_model``."""
    return dict(SHAPES[name]["model"])
