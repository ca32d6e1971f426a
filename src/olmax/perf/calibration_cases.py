"""The calibration cases' file format (``benchmarks/calibration/NAME.yaml``): one peer's published
run per file, checked field by field before ``benchmarks/calibrate.py`` compiles and estimates it.
A new case is one file; nothing here is specific to a model."""

from __future__ import annotations

from pathlib import Path

import yaml

from olmax.hardware import BY_NAME

CONVENTIONS = {
    "maxtext": "MaxText's calculate_tflops_training_per_device per device and step over the dense bf16 "
               "peak per device: 6 x params x tokens + causal attention (a sliding-window layer counted "
               "as full causal attention)",
    "causal": "olmax.model.flops, convention causal, per device and step over the dense bf16 peak per "
              "device: 6 x params x tokens + the (query, key) pairs the causal or sliding-window mask "
              "keeps",
}
PROGRAMS = {
    "maxtext": "compiled here ahead of time in MaxText's environment (maxtext_compile.py)",
    "olmax": "olmax's own step: on a GPU compiled where it was measured, its optimized HLO stored "
             "(peer.hlo); on a TPU, olmax plan of its recipe and overrides (peer.recipe, peer.args)",
}

# field -> (types, required, what it is); nested mappings have their own schemas below
SCHEMA: dict = {
    "name": ((str,), True, "the case's name: the file's name without .yaml"),
    "accelerator": ((str,), True, "olmax.hardware accelerator name (tpu7x, v5p, h100, ...)"),
    "topology": ((str,), True, "olmax's topology name (tpu7x:4x8x8, h100:8): the collectives' torus"),
    "devices": ((int,), True, "JAX devices the measured run used"),
    "peer": ((dict,), True, "the peer's program"),
    "parts": ((dict,), False, "where the one-device parts compile (TPU cases)"),
    "measured": ((dict,), True, "the published measurement"),
    "assumptions": ((list,), False, "what the case assumes beyond its source"),
}
PEER_SCHEMA: dict = {
    "program": ((str,), True, f"one of {sorted(PROGRAMS)}"),
    "version": ((str,), True, "the peer's version compiled (its environment's)"),
    "launcher": ((str,), True, "the launcher or page whose settings these are"),
    "topology": ((str,), True, "the peer's own topology name (MaxText: tpu7x-128, cores)"),
    "args": ((list,), True, "the peer's configuration overrides, key=value (model_name= among them)"),
    "libtpu_init_args": ((list,), False, "LIBTPU_INIT_ARGS flags its launcher exported"),
    "xla_flags": ((list,), False, "XLA_FLAGS its launcher exported (GPU)"),
    "hlo": ((str,), False, "olmax GPU cases: the measured step's optimized HLO, stored (a path under "
                           "benchmarks/, gzip if .gz)"),
    "recipe": ((str,), False, "olmax TPU cases: the recipe peer.args override (olmax plan plans it)"),
}
PARTS_SCHEMA: dict = {
    "topology": ((str,), True, "the peer's topology name whose first device compiles the parts"),
    "layers": ((list,), True, "decoder layers of the two unscanned parts, [fewer, more]"),
}
MEASURED_SCHEMA: dict = {
    "step_s": ((float, int, type(None)), False, "measured seconds per step"),
    "mfu": ((float, type(None)), False, "measured MFU (a fraction) in the case's convention"),
    "relative_to": ((str, type(None)), False, "a ratio case: the case whose measured step this one's is relative to"),
    "speedup": ((float, type(None)), False, "a ratio case: measured throughput over relative_to's"),
    "convention": ((str,), True, f"the MFU's convention: one of {sorted(CONVENTIONS)}"),
    "source": ((str,), True, "the publication or page (title) the figure is from"),
    "note": ((str,), False, "how the figure is read"),
}


class CaseError(ValueError):
    pass


def _check(obj: dict, schema: dict, where: str) -> None:
    if not isinstance(obj, dict):
        raise CaseError(f"{where}: a mapping expected")
    unknown = sorted(set(obj) - set(schema))
    if unknown:
        raise CaseError(f"{where}: unknown field(s) {unknown} (known: {sorted(schema)})")
    for key, (types, required, _what) in schema.items():
        if key not in obj:
            if required:
                raise CaseError(f"{where}: missing field {key!r}")
            continue
        if not isinstance(obj[key], types) or (isinstance(obj[key], bool) and bool not in types):
            raise CaseError(f"{where}.{key}: {type(obj[key]).__name__} where "
                            f"{'/'.join(t.__name__ for t in types)} is expected")


def validate(case: dict, stem: str | None = None) -> dict:
    """``case`` checked against :data:`SCHEMA` and the rules between its fields; returned."""
    _check(case, SCHEMA, stem or "case")
    where = case["name"]
    if stem is not None and case["name"] != stem:
        raise CaseError(f"{stem}.yaml: name {case['name']!r} is not the file's name")
    if case["accelerator"] not in BY_NAME:
        raise CaseError(f"{where}: accelerator {case['accelerator']!r} is not one of {sorted(BY_NAME)}")
    if not case["topology"].startswith(case["accelerator"] + ":"):
        raise CaseError(f"{where}: topology {case['topology']!r} is not of {case['accelerator']}")
    _check(case["peer"], PEER_SCHEMA, f"{where}.peer")
    peer = case["peer"]
    if peer["program"] not in PROGRAMS:
        raise CaseError(f"{where}.peer.program: one of {sorted(PROGRAMS)}")
    olmax = peer["program"] == "olmax"
    on_tpu = BY_NAME[case["accelerator"]].platform == "tpu"
    if (olmax and not on_tpu) != ("hlo" in peer):
        raise CaseError(f"{where}.peer.hlo: an olmax GPU case, and only one, names its stored program")
    if (olmax and on_tpu) != ("recipe" in peer):
        raise CaseError(f"{where}.peer.recipe: an olmax TPU case, and only one, names its recipe")
    for key in ("args", "libtpu_init_args", "xla_flags"):
        if not all(isinstance(x, str) for x in peer.get(key, [])):
            raise CaseError(f"{where}.peer.{key}: strings expected")
    if not all("=" in x for x in peer["args"]):
        raise CaseError(f"{where}.peer.args: key=value expected")
    named = "model.preset=" if olmax else "model_name="
    if not any(x.startswith(named) for x in peer["args"]):
        raise CaseError(f"{where}.peer.args: the model must be named ({named}...)")
    tpu = on_tpu and not olmax
    if tpu and "parts" not in case:
        raise CaseError(f"{where}: a TPU case needs parts (where its one-device parts compile)")
    if "parts" in case:
        _check(case["parts"], PARTS_SCHEMA, f"{where}.parts")
        layers = case["parts"]["layers"]
        if len(layers) != 2 or not all(isinstance(x, int) and x > 0 for x in layers) or layers[0] >= layers[1]:
            raise CaseError(f"{where}.parts.layers: two layer counts, fewer first")
    m = case["measured"]
    _check(m, MEASURED_SCHEMA, f"{where}.measured")
    if m["convention"] not in CONVENTIONS:
        raise CaseError(f"{where}.measured.convention: one of {sorted(CONVENTIONS)}")
    relative = m.get("relative_to") is not None
    if relative != (m.get("speedup") is not None):
        raise CaseError(f"{where}.measured: relative_to and speedup go together")
    if not relative and m.get("step_s") is None and m.get("mfu") is None:
        raise CaseError(f"{where}.measured: a step time, an MFU or a relative_to/speedup pair")
    if m.get("mfu") is not None and not 0 < m["mfu"] < 1:
        raise CaseError(f"{where}.measured.mfu: a fraction")
    return case


def load_cases(folder: Path, names: list[str] | None = None) -> dict[str, dict]:
    """Every case file of ``folder`` validated (:func:`validate`), their references checked;
    ``names``: only those."""
    out = {}
    for path in sorted(folder.glob("*.yaml")):
        out[path.stem] = validate(yaml.safe_load(path.read_text()), path.stem)
    for name, case in out.items():
        rel = case["measured"].get("relative_to")
        if rel is not None and rel not in out:
            raise CaseError(f"{name}.measured.relative_to: no case {rel!r}")
    if names:
        missing = sorted(set(names) - set(out))
        if missing:
            raise CaseError(f"no such case(s) {missing}; known: {sorted(out)}")
        return {n: out[n] for n in out if n in names}
    return out


def visited_pairs(t: int, window: int | None, bq: int, bk: int) -> int:
    """(query block, key block) pairs a splash kernel computes for one head of one sequence of
    ``t`` tokens, blocks of ``bq`` queries and ``bk`` keys: those the causal (and window) mask
    leaves any entry of (:func:`olmax.model.splash.visited_blocks`, rectangular blocks)."""
    nq, nk = -(-t // bq), -(-t // bk)
    count = 0
    for i in range(nq):
        q0, q1 = i * bq, min(t, (i + 1) * bq) - 1
        for j in range(nk):
            k0, k1 = j * bk, min(t, (j + 1) * bk) - 1
            if k0 <= q1 and (window is None or window >= t or k1 > q0 - window):
                count += 1
    return count
