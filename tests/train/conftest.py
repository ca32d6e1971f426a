import numpy as np
import pytest


@pytest.fixture
def token_files(tmp_path):
    """Two raw uint32 token files (ids < 1000, EOS-separated 'documents') and a recipe for a tiny
    OLMo 3 with a 1024-row vocabulary over them."""
    rng = np.random.default_rng(0)
    paths = []
    for i, n in enumerate((3000, 2200)):
        toks = np.minimum(rng.geometric(0.02, size=n), 999).astype(np.uint32)
        toks[rng.integers(0, n, size=n // 200)] = 0
        p = tmp_path / f"part-{i}.npy"
        toks.tofile(p)
        paths.append(str(p))
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(f"""
model:
  preset: olmo3-tiny
  vocab_size: 1000
  padded_vocab_size: 1024
  window_pattern: [16, 16, 16, null]
  max_seq_len: 64
seed: 11
data:
  paths: {paths}
train:
  seq_len: 32
  global_batch_size: 8
  max_steps: 6
optim:
  lr: 3.0e-3
scheduler:
  name: cos_with_warmup
  warmup_steps: 2
checkpoint:
  interval: 100
logging:
  progress: false
""")
    return paths, recipe
