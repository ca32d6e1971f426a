"""``docs/reproduce.md``, checked mechanically.

Every fenced block of the guide carries a marker, an HTML comment on the line just before the fence:

    <!-- run-by-test -->         run here, in document order, in one sandbox, with small shapes
    <!-- run-by-test: tpu -->    the same, in the TPU test environment (Python >= 3.12 with libtpu)
    <!-- needs: REASON -->       not run here (a real cluster, the network, a GPU, ...)
    <!-- output -->              not a command: sample output or a file's contents

The fast tests: every block is marked; every ``olmax`` subcommand and ``--flag`` the guide names, in
any block or in inline code, appears in that command's ``--help``; every ``key=value`` override it
passes loads with the recipe it is passed to; every config key named in the prose exists; the
stage numbers it quotes (steps, tokens) follow from the packaged recipes.

The slow tests run the ``run-by-test`` blocks, each with ``bash -euo pipefail``, as written except
for this mapping (``MAPPING``; the same commands, subcommands and flags, only paths and sizes
swapped):

- ``/shared`` -> the sandbox's ``shared``, where ``shared/olmax`` is this repository.
- ``https://olmo-data.org`` -> an HTTP server on 127.0.0.1 serving a tiny token file (random dolma2
  ids in EOS-terminated documents of 16-40 tokens) at the path of every entry of the real mix files
  ``OLMo-mix-0625-official``, ``OLMo-midtraining-mix-0625-100B`` and ``v3-small-ppl-validation``
  (taken from the installed ai2-olmo-core), with ranged reads.
- In every command except ``olmax launch`` (which reads nothing and only checks the recipe and
  its fit on the named devices, so it runs with the real recipes and sizes):
  the recipes ``olmo3_7b_stage1``, ``olmo3_7b_stage1_part2``, ``olmo3_7b_stage2`` -> tiny copies
  (``tiny_recipe``: the packaged YAML with the model shrunk to 4 layers of width 32, windows of
  16 tokens, sequences of 32, batches of 16 / 8, the schedules scaled down, checkpoints every 10
  steps, in-loop evaluation every 100 with one OLMES task); the sizes ``SIZES`` (8192 -> 32,
  512 -> 16, 256 -> 8, and the token batches 4194304 -> 512, 2097152 -> 256); ``--tasks fast`` ->
  one task with ``--limit 8``; a node of 8 GPUs -> 4 CPU devices, ``CUDA_VISIBLE_DEVICES=0,1,2,3``
  -> 2; the TPU topology ``v5p:4x4x4`` -> ``v5p:2x2x1``.
- Files that blocks marked ``needs:`` would produce are stand-ins (``STAND_INS``): AI2's step-0 and
  final stage-1 weights as tiny HF ``Olmo3ForCausalLM`` directories of the tiny recipes'
  architecture, and a W&B loss export as a CSV with AI2's column names.
"""

from __future__ import annotations

import csv
import dataclasses
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
import time
from contextlib import redirect_stdout
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers.reference import require, unavailable
from helpers.xla import xla_flags

REPO = Path(__file__).resolve().parents[2]
GUIDE = REPO / "docs" / "reproduce.md"

RUN, RUN_TPU, NEEDS, OUTPUT = "run-by-test", "run-by-test: tpu", "needs", "output"
EOS, VOCAB = 100257, 100278

# ----------------------------------------------------------------------------------------------
# The guide's blocks


@dataclasses.dataclass(frozen=True)
class Block:
    line: int          # 1-based line of the opening fence
    lang: str
    text: str
    marker: str | None  # the comment's text, or None

    @property
    def kind(self) -> str | None:
        m = self.marker or ""
        if m in (RUN, RUN_TPU, OUTPUT):
            return m
        if re.fullmatch(r"needs: \S.*", m):
            return NEEDS
        return None


def read_blocks(text: str) -> list[Block]:
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^(```+|~~~+)\s*(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(1), m.group(2), i
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence):
            j += 1
        prev = lines[i - 1].strip() if i else ""
        c = re.fullmatch(r"<!--\s*(.*?)\s*-->", prev)
        out.append(Block(start + 1, lang, "\n".join(lines[i + 1:j]), c.group(1) if c else None))
        i = j + 1
    return out


@pytest.fixture(scope="module")
def guide() -> str:
    return GUIDE.read_text()


@pytest.fixture(scope="module")
def blocks(guide) -> list[Block]:
    return read_blocks(guide)


def shell_lines(text: str) -> list[str]:
    """A shell block's logical lines (continuations joined), without heredoc bodies."""
    out, buf, heredoc = [], "", None
    for raw in text.splitlines():
        if heredoc is not None:
            if raw.strip() == heredoc:
                heredoc = None
            continue
        if raw.rstrip().endswith("\\"):
            buf += raw.rstrip()[:-1] + " "
            continue
        line = buf + raw
        buf = ""
        m = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
        if m:
            heredoc = m.group(1)
        out.append(line)
    return out


OPERATORS = {"|", "||", "&&", ";", "&", "(", ")", ">", ">>", "<", "<<"}


def olmax_argvs(text: str) -> list[list[str]]:
    """Every ``olmax ...`` command of a shell block (in command position, after any ``VAR=value``
    assignments), as argv up to the next shell operator."""
    out = []
    for line in shell_lines(text):
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        lex.commenters = "#"
        tokens = list(lex)
        for i, tok in enumerate(tokens):
            if tok != "olmax":
                continue
            j = i - 1
            while j >= 0 and re.fullmatch(r"[A-Za-z_]\w*=.*", tokens[j]):
                j -= 1
            if j >= 0 and tokens[j] not in OPERATORS:
                continue  # an argument, not a command
            end = next((k for k in range(i + 1, len(tokens)) if tokens[k] in OPERATORS), len(tokens))
            out.append(tokens[i:end])
    return out


# ----------------------------------------------------------------------------------------------
# What `olmax ... --help` says


_HELP: dict[tuple[str, ...], str] = {}


def help_text(path: tuple[str, ...]) -> str:
    """``olmax PATH --help``, as the user sees it."""
    if path not in _HELP:
        from olmax.cli import main

        buf = io.StringIO()
        with redirect_stdout(buf), pytest.raises(SystemExit) as e:
            main([*path, "--help"])
        assert e.value.code == 0, f"olmax {' '.join(path)} --help exited {e.value.code}"
        _HELP[path] = buf.getvalue()
    return _HELP[path]


def subcommands(path: tuple[str, ...]) -> set[str]:
    """The subcommand choices ``--help`` lists under its positional arguments."""
    text = help_text(path)
    section = text.split("positional arguments:", 1)[1].split("\noptions:", 1)[0] if \
        "positional arguments:" in text else ""
    return set(re.findall(r"^ {4}([a-z][a-z0-9-]*)\b", section, re.M))


def flags(path: tuple[str, ...]) -> set[str]:
    """The options ``--help`` lists (its "options:" section, not flags its prose mentions)."""
    text = help_text(path)
    section = text.split("\noptions:\n", 1)[1] if "\noptions:\n" in text else ""
    out = set()
    for line in section.splitlines():
        m = re.match(r"^ {2}(-\S.*?)(?: {2,}|$)", line)
        if m:
            out |= set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", m.group(1)))
    return out


def resolve(argv: list[str]) -> tuple[tuple[str, ...], list[str]]:
    """(subcommand path, remaining args) of ``olmax ...``; an unknown subcommand is an error."""
    path: tuple[str, ...] = ()
    rest = argv[1:]
    while rest and (choices := subcommands(path)):
        if rest[0] not in choices:
            raise AssertionError(f"'olmax {' '.join(path + (rest[0],))}': no such subcommand "
                                 f"(olmax {' '.join(path)} --help lists {sorted(choices)})")
        path, rest = path + (rest[0],), rest[1:]
    return path, rest


def check_argv(argv: list[str], where: str) -> tuple[tuple[str, ...], list[str]]:
    path, rest = resolve(argv)
    assert path, f"{where}: '{' '.join(argv)}' names no subcommand"
    known = flags(path)
    for a in rest:
        if a.startswith("--"):
            name = a.split("=", 1)[0]
            assert name in known, f"{where}: olmax {' '.join(path)} has no option {name}"
    return path, rest


# Commands whose first positional is a recipe followed by key=value overrides.
RECIPE_COMMANDS = {("train",), ("plan",), ("bench", "train"), ("launch", "slurm"), ("launch", "k8s"),
                   ("launch", "tpu-vm")}


def recipe_and_overrides(path: tuple[str, ...], rest: list[str]) -> tuple[str, list[str]] | None:
    if path not in RECIPE_COMMANDS:
        return None
    positional, i = [], 0
    while i < len(rest):
        a = rest[i]
        if a.startswith("--"):
            takes_value = "=" not in a and not _is_switch(path, a)
            i += 2 if takes_value else 1
            continue
        positional.append(a)
        i += 1
    return positional[0], [p for p in positional[1:] if "=" in p]


def _is_switch(path: tuple[str, ...], flag: str) -> bool:
    """An option without a value: its usage line shows no metavar after it."""
    usage = help_text(path).split("\n\n", 1)[0]
    return re.search(rf"\[{re.escape(flag)}\]", usage) is not None


# ----------------------------------------------------------------------------------------------
# Fast tests: the guide's structure and names


def test_every_block_is_marked(blocks):
    assert blocks, f"{GUIDE} has no fenced blocks"
    bad = [f"line {b.line}: {b.marker!r}" for b in blocks if b.kind is None]
    assert not bad, ("blocks without a valid marker (<!-- run-by-test -->, <!-- run-by-test: tpu -->, "
                     "<!-- needs: REASON -->, <!-- output -->) on the line before the fence: " + "; ".join(bad))
    runnable = [b for b in blocks if b.kind in (RUN, RUN_TPU)]
    assert all(b.lang in ("bash", "sh") for b in runnable), "run-by-test blocks must be bash"
    assert len(runnable) >= 10


def test_olmax_commands_and_flags_exist(blocks, guide):
    n = 0
    for b in blocks:
        if b.lang not in ("bash", "sh") or b.kind == OUTPUT:
            continue
        for argv in olmax_argvs(b.text):
            check_argv(argv, f"{GUIDE.name} line {b.line}")
            n += 1
    assert n >= 20
    # Inline code in the prose: `olmax SUB ... --flag ...` and bare `--flag`s.
    prose = re.sub(r"^(```+|~~~+).*?^\1", "", guide, flags=re.S | re.M)
    spans = re.findall(r"`([^`\n]+)`", prose)
    all_flags: set[str] = set()
    for span in spans:
        if span.startswith("olmax "):
            words = span.split()
            path: tuple[str, ...] = ()
            for w in words[1:]:
                choices = subcommands(path)
                if not choices or w not in choices:
                    assert not (choices and re.fullmatch(r"[a-z][a-z0-9-]*", w)), \
                        f"inline `{span}`: olmax {' '.join(path)} has no subcommand {w}"
                    break
                path += (w,)
            for f in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", span):
                assert f in flags(path), f"inline `{span}`: olmax {' '.join(path)} has no option {f}"
    for path in _all_paths():
        all_flags |= flags(path)
    for span in spans:
        m = re.fullmatch(r"(--[a-z][a-z0-9-]*)(?:[ =].*)?", span)
        if m:
            assert m.group(1) in all_flags, f"inline `{span}`: no olmax command has {m.group(1)}"


def _all_paths() -> list[tuple[str, ...]]:
    out, todo = [], [()]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += [p + (c,) for c in subcommands(p)]
    return out


def test_overrides_load_with_their_recipes(blocks, tmp_path):
    """Every ``key=value`` the guide passes to a recipe is a config key of the right type:
    ``olmax launch`` validates recipe + overrides exactly as ``olmax train`` loads them."""
    from olmax.cli import main

    seen = set()
    for b in blocks:
        if b.lang not in ("bash", "sh") or b.kind == OUTPUT:
            continue
        for argv in olmax_argvs(b.text):
            path, rest = check_argv(argv, f"line {b.line}")
            ro = recipe_and_overrides(path, rest)
            if ro is None or (ro[0], tuple(ro[1])) in seen:
                continue
            seen.add((ro[0], tuple(ro[1])))
            # one CPU device, or a node of as many GPUs as the mesh the overrides give needs
            sizes = [int(o.split("=", 1)[1]) for o in ro[1]
                     if re.fullmatch(r"mesh\.(data|fsdp|tensor|context)=\d+", o)]
            gpus = str(np.prod(sizes)) if sizes else "0"
            # only a run needs the start its recipe declares (init.required), not a plan or a bench
            start = [] if path[0] in ("train", "launch") else ["init.required=none"]
            rc = main(["launch", "slurm", ro[0], *ro[1], *start, "--nodes", "1", "--gpus-per-node", gpus,
                       "--out", str(tmp_path / "check.sbatch"), "--force"])
            assert rc == 0, f"line {b.line}: {ro[0]} {' '.join(ro[1])} does not load"
    assert len(seen) >= 5


SECTIONS = ("model", "seed", "data", "train", "optim", "scheduler", "checkpoint", "init", "distributed",
            "mesh", "eval", "logging")


def config_key_exists(key: str) -> bool:
    """``a.b.c`` names a field of the run configuration (``model.preset`` included)."""
    import typing

    from olmax import config as C

    cls, names = C.RunConfig, key.split(".")
    for i, name in enumerate(names):
        last = i == len(names) - 1
        if cls is C.ModelConfig and name == "preset":
            return last
        hints = typing.get_type_hints(cls)
        if name not in hints:
            return False
        if last:          # a field, or a section (data.tokenizer: a name or its fields)
            return True
        options = [a for a in typing.get_args(hints[name]) if a is not type(None)] or [hints[name]]
        cls = next((a for a in options if dataclasses.is_dataclass(a)), None)
        if cls is None:
            return False
    return False


def test_config_keys_in_prose_exist(guide):
    keys = set(re.findall(r"`((?:%s)\.[a-z_]+(?:\.[a-z_]+)*)(?:=[^`]*)?`" % "|".join(SECTIONS), guide))
    assert len(keys) >= 10
    missing = sorted(k for k in keys if not config_key_exists(k))
    assert not missing, f"config keys named in {GUIDE.name} that do not exist: {missing}"


def test_stage_numbers_follow_from_the_recipes(guide):
    """The steps and token counts the guide quotes are the packaged recipes' (and AI2's)."""
    r = {n: yaml.safe_load((REPO / "src" / "olmax" / "recipes" / f"{n}.yaml").read_text())
         for n in ("olmo3_7b_stage1", "olmo3_7b_stage1_part2", "olmo3_7b_stage2")}
    for name, recipe in r.items():
        t = recipe["train"]
        assert f"{t['max_steps']:,}" in guide, f"{name}: {t['max_steps']:,} steps not in the guide"
        tokens = t["max_steps"] * t["global_batch_size"] * t["seq_len"]
        assert f"{tokens:,}" in guide, f"{name}: {tokens:,} tokens not in the guide"
        assert f"{t['global_batch_size'] * t['seq_len']:,}" in guide
    # AI2's final stage-1 checkpoint (OLMo-3-1025-7B.csv) is the end of part 2.
    assert r["olmo3_7b_stage1_part2"]["train"]["max_steps"] * 4_194_304 == 5_929_965_715_456
    # The 32B: stage 1 stops at its hard stop; stages 2 and 3 are lengths in tokens.
    from olmax.train.recipes import load_recipe

    s1 = load_recipe("olmo3_32b_stage1", find_mix=False).train
    assert f"{s1.hard_stop:,}" in guide and f"{s1.hard_stop * s1.global_batch_size * s1.seq_len:,}" in guide
    for name in ("olmo3_32b_stage2_ingredient1", "olmo3_32b_stage3"):
        t = load_recipe(name, find_mix=False).train
        steps = t.steps_for(batches_per_epoch=1)
        assert f"{steps:,}" in guide and f"{t.global_batch_size * t.seq_len:,}" in guide, name
        assert f"{steps * t.global_batch_size * t.seq_len:,}" in guide, name


# ----------------------------------------------------------------------------------------------
# The sandbox: tiny recipes, a loopback "olmo-data.org", stand-ins


SIZES = {"8192": "32", "512": "16", "256": "8", "4194304": "512", "2097152": "256"}
TINY_MODEL = {"preset": "olmo3-7b", "d_model": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4,
              "head_dim": 8, "mlp_hidden": 64, "window_pattern": [16, 16, 16, None], "max_seq_len": 32}
TINY_TASK = "arc_easy_test_bpb_5shot"
RECIPES = ("olmo3_7b_stage1", "olmo3_7b_stage1_part2", "olmo3_7b_stage2")
# The same schedule shapes, scaled: part 1 stops short of halfway through its cosine, before part
# 2's warmup ends (AI2's join: step 596,047, warmup end 597,046; here 10 and 11), part 2 continues
# on its warmup line and then the half cosine, stage 2 decays linearly.
TINY_SCHEDULE = {
    "olmo3_7b_stage1": {"max_steps": 10, "warmup_steps": 2, "t_max": 21},
    "olmo3_7b_stage1_part2": {"max_steps": 26, "warmup_steps": 11, "t_max": 29},
    "olmo3_7b_stage2": {"max_steps": 20, "warmup_steps": 0, "t_max": 20},
}


def tiny_recipe(name: str) -> dict:
    """The packaged recipe with only sizes changed (see the module docstring)."""
    r = yaml.safe_load((REPO / "src" / "olmax" / "recipes" / f"{name}.yaml").read_text())
    r["model"] = dict(TINY_MODEL)
    t = r["train"]
    t["seq_len"] = int(SIZES[str(t["seq_len"])])
    t["global_batch_size"] = int(SIZES[str(t["global_batch_size"])])
    s = TINY_SCHEDULE[name]
    t["max_steps"] = s["max_steps"]
    r["scheduler"]["warmup_steps"], r["scheduler"]["t_max"] = s["warmup_steps"], s["t_max"]
    r["data"]["max_target_seq_len"] = int(SIZES[str(r["data"]["max_target_seq_len"])])
    r["checkpoint"]["interval"] = 10
    if "eval" in r:
        r["eval"].update(interval=100, tasks=[TINY_TASK], limit=8)
    return r


def in_sandbox(text: str, sandbox: Path) -> str:
    return re.sub(r"(?<![\w./-])/shared(?![\w.-])", f"{sandbox}/shared", text)


def map_block(text: str, sandbox: Path, data_url: str, recipes: dict[str, Path]) -> str:
    """``MAPPING``: the block as the test runs it."""
    out, in_launch = [], False
    for line in text.splitlines():
        line = in_sandbox(line, sandbox).replace("https://olmo-data.org", data_url)
        starts_launch = line.lstrip().startswith("olmax launch")
        launch = in_launch or starts_launch
        in_launch = launch and line.rstrip().endswith("\\")
        if not launch:
            for name, path in recipes.items():
                line = re.sub(rf"(?<![\w/.-]){name}(?![\w-])", str(path), line)
            line = re.sub(r"(?<![\w.:/-])(%s)(?![\w.:-])" % "|".join(SIZES), lambda m: SIZES[m.group(1)], line)
            line = line.replace("--tasks fast", f"--tasks {TINY_TASK} --limit 8")
            line = line.replace("CUDA_VISIBLE_DEVICES=0,1,2,3",
                                f"XLA_FLAGS={shlex.quote(xla_flags(2))}")
            line = line.replace("v5p:4x4x4", "v5p:2x2x1")
        out.append(line)
    return "\n".join(out) + "\n"


def mix_files() -> dict[str, Path]:
    spec = importlib.util.find_spec("olmo_core")
    if spec is None:
        unavailable("ai2-olmo-core (the `test` extra) provides AI2's mix files")
    root = Path(spec.submodule_search_locations[0]) / "data" / "mixes"
    return {m: root / f"{m}.txt" for m in
            ("OLMo-mix-0625-official", "OLMo-midtraining-mix-0625-100B", "v3-small-ppl-validation")}


def tiny_store(mixes: dict[str, Path]) -> dict[str, bytes]:
    """A tiny token file at the path of every mix entry, as olmo-data.org lays them out: random
    dolma2 ids in EOS-terminated documents of 16-40 tokens (long enough never to repeat)."""
    tokenizer = {"v3-small-ppl-validation": "dolma2-tokenizer"}
    rng = np.random.default_rng(0)
    files = {}
    for mix, path in mixes.items():
        for line in path.read_text().splitlines():
            if not line.strip() or line.startswith("#"):
                continue
            rel = line.split(",")[1].replace("{TOKENIZER}", tokenizer.get(mix, "allenai/dolma3-tokenizer"))
            docs, n = [], 0
            while n < 64:
                doc = rng.integers(0, EOS, int(rng.integers(16, 41))).astype("<u4")
                doc[-1] = EOS
                docs.append(doc)
                n += doc.size
            files["/" + rel] = np.concatenate(docs).tobytes()
    return files


class QuietFileServer:
    """The remote-data tests' HTTP server, without a traceback for each client that hangs up."""

    def __init__(self, files: dict[str, bytes]) -> None:
        import threading

        from helpers.remote_servers import FileServer

        class Server(FileServer):
            def handle_error(self, request, client_address):
                if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
                    super().handle_error(request, client_address)

        self.srv = Server(files)
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self.srv

    def __exit__(self, *exc):
        self.srv.shutdown()
        self.srv.server_close()


def write_shims(bindir: Path) -> None:
    """``olmax`` and ``python`` on PATH run this repository's code with this interpreter."""
    bindir.mkdir(parents=True, exist_ok=True)
    for name, body in (("olmax", f'exec {shlex.quote(sys.executable)} -m olmax.cli "$@"'),
                       ("python", f'exec {shlex.quote(sys.executable)} "$@"')):
        p = bindir / name
        p.write_text(f"#!/bin/sh\n{body}\n")
        p.chmod(0o755)


def sandbox_env(sandbox: Path) -> dict:
    env = dict(os.environ)
    env.update(
        PATH=f"{sandbox / 'bin'}{os.pathsep}{env.get('PATH', '')}",
        PYTHONPATH=str(REPO / "src"),
        XLA_FLAGS=xla_flags(4),   # one "node"
        JAX_PLATFORMS="cpu",
        OLMAX_CACHE=str(sandbox / "cache"),
        JAX_COMPILATION_CACHE_DIR=str(sandbox / "jax-cache"),
        JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
        HF_HUB_OFFLINE="1",
        TF_CPP_MIN_LOG_LEVEL="3",
    )
    return env


STAND_INS = {
    "olmo3/step0-hf": "AI2's stage1/step0 weights (converted to HF): a tiny random Olmo3ForCausalLM",
    "olmo3/ai2-stage1-final-hf": "AI2's stage1/step1413814 weights: a tiny random Olmo3ForCausalLM",
    "olmo3/ai2-stage1-loss.csv": "AI2's W&B stage-1 loss export: _step, train/CE loss",
}


def make_stand_ins(shared: Path) -> None:
    require("torch")
    require("transformers")
    from helpers.hf_models import make_hf_model

    m = TINY_MODEL
    for i, name in enumerate(("step0-hf", "ai2-stage1-final-hf")):
        make_hf_model(shared / "olmo3" / name, vocab=VOCAB, hidden=m["d_model"], inter=m["mlp_hidden"],
                      layers=m["n_layers"], heads=m["n_heads"], kv_heads=m["n_kv_heads"],
                      window=m["window_pattern"][0], rope_theta=500_000.0, max_pos=m["max_seq_len"],
                      seed=i)
    with open(shared / "olmo3" / "ai2-stage1-loss.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["_step", "train/CE loss"])
        for step in range(1, 41):
            w.writerow([step, 11.6 - 0.05 * step])


def new_sandbox(root: Path) -> tuple[Path, dict[str, Path]]:
    shared = root / "shared"
    (shared / "olmo3").mkdir(parents=True)
    (shared / "runs").mkdir()
    (shared / "olmax").symlink_to(REPO)
    (root / "work").mkdir()
    write_shims(root / "bin")
    recipes = {}
    for name in RECIPES:
        recipes[name] = root / "recipes" / f"{name}.yaml"
        recipes[name].parent.mkdir(exist_ok=True)
        recipes[name].write_text(yaml.safe_dump(tiny_recipe(name), sort_keys=False))
    return shared, recipes


def run_block(block: Block, sandbox: Path, data_url: str, recipes: dict[str, Path]) -> float:
    script = sandbox / "blocks" / f"line{block.line:04d}.sh"
    script.parent.mkdir(exist_ok=True)
    script.write_text(map_block(block.text, sandbox, data_url, recipes))
    t0 = time.time()
    p = subprocess.run(["bash", "-euo", "pipefail", str(script)], cwd=sandbox / "work",
                       env=sandbox_env(sandbox), capture_output=True, text=True, timeout=1200)
    took = time.time() - t0
    assert p.returncode == 0, (f"{GUIDE.name} block at line {block.line} exited {p.returncode} "
                               f"({script}):\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    tail = "\n    ".join((p.stdout.strip() or "(no output)").splitlines()[-4:])
    print(f"line {block.line}: {took:.1f} s\n    {tail}")
    return took


def training_argv(job_file: Path) -> list[str]:
    """The ``olmax train`` command a generated job runs on every node."""
    text = job_file.read_text()
    if job_file.suffix == ".yaml":
        for doc in yaml.safe_load_all(text):
            if doc and doc.get("kind") == "Job":
                return doc["spec"]["template"]["spec"]["containers"][0]["command"]
            if doc and doc.get("kind") == "JobSet":
                job = doc["spec"]["replicatedJobs"][0]["template"]["spec"]
                return job["template"]["spec"]["containers"][0]["command"]
    text = text.replace("'\"'\"'", "'")   # the TPU VM script holds its command in single quotes
    line = next(x for x in text.splitlines()
                if "olmax train " in x and not x.lstrip().startswith(("#", "echo")))
    command = line[line.index("olmax train"):].split(">>")[0].strip().removesuffix(")")
    return shlex.split(command)


def check_generated_jobs(blocks: list[Block], sandbox: Path) -> None:
    """Each job file ``olmax launch`` wrote runs ``olmax train RECIPE --run-dir DIR ... OVERRIDES``
    with the guide's recipe, run directory and overrides, unchanged."""
    n = 0
    for b in blocks:
        if b.kind != RUN:
            continue
        for argv in olmax_argvs(b.text):
            path, rest = resolve(argv)
            if path[:1] != ("launch",):
                continue
            opts = dict(re.findall(r"(--[a-z-]+)[= ](\S+)", " ".join(rest)))
            recipe, overrides = recipe_and_overrides(path, rest)
            out = Path(in_sandbox(opts["--out"], sandbox))
            got = training_argv(out)
            want = ["olmax", "train", recipe, "--run-dir", in_sandbox(opts["--run-dir"], sandbox)]
            assert got[:5] == want, f"{out}: runs {got[:5]}, not {want}"
            tail = [in_sandbox(o, sandbox) for o in overrides]
            assert got[len(got) - len(tail):] == tail, f"{out}: overrides {got[5:]}, not {tail}"
            n += 1
    assert n >= 6


@pytest.mark.reference
@pytest.mark.slow
def test_guide_commands_run(blocks, tmp_path_factory):
    mixes = mix_files()
    sandbox = tmp_path_factory.mktemp("guide")
    shared, recipes = new_sandbox(sandbox)
    make_stand_ins(shared)
    run = [b for b in blocks if b.kind == RUN]
    total = 0.0
    with QuietFileServer(tiny_store(mixes)) as srv:
        for b in run:
            total += run_block(b, sandbox, srv.url, recipes)
    check_generated_jobs(blocks, sandbox)
    print(f"{len(run)} blocks in {total:.0f} s")


@pytest.mark.tpu
@pytest.mark.slow
def test_guide_tpu_commands_run(blocks, tmp_path_factory):
    sandbox = tmp_path_factory.mktemp("guide-tpu")
    _, recipes = new_sandbox(sandbox)
    run = [b for b in blocks if b.kind == RUN_TPU]
    assert run
    for b in run:
        run_block(b, sandbox, "http://127.0.0.1:9", recipes)
