"""Loss-curve comparison and the run dashboard.

Sources: an olmax run directory (its ``metrics.jsonl``: one JSON object per logged step), a
``.jsonl`` file of the same shape, or a ``.csv`` exported from W&B / OLMo-core with a column mapping
(``{"step": "_step", "loss": "train/CE loss"}``: our name -> the file's column). Rows logged twice
for the same x (a resumed run) keep the last value; rows without the metric are skipped.

Comparison (every run against the first, the reference): the curves are aligned on the x values
both have (step or tokens); when they share none, the other run is linearly interpolated onto the
reference's x inside the common range (reported as ``interpolated``). Optional smoothing is an EMA
with TensorBoard's convention (``s_t = a * s_{t-1} + (1 - a) * y_t``, ``a`` = the weight of the past),
applied to both runs on the aligned points (so both have the same lag) for the difference measures.
Reported: mean/max absolute and relative difference overall and over ``windows`` equal slices of
the aligned range, and the first x where the (smoothed) difference exceeds ``threshold`` (relative to
the reference's value unless ``relative=False``).

A NaN or infinite value (a loss that blew up; ``metrics.jsonl`` holds it as the string "nan" or
"inf") is kept, never skipped: the first aligned x where
either run's value is not finite is a divergence whatever the threshold (``first_divergence``,
with ``divergence_reason`` "non-finite"), each run reports its non-finite points, and the
difference measures and the smoothing cover the points where both runs are finite (a measure
with no such point is null, so the summary stays valid JSON).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from olmax import store
from olmax.config.load import shown
from olmax.errors import OlmaxError
from olmax.io import read_text, write_bytes_atomic


@dataclass
class Curve:
    name: str
    x: np.ndarray
    y: np.ndarray
    source: str


def metrics_file(path: Any) -> Any:
    """The metrics file a source names: a run directory's ``metrics.jsonl``, else the file. A
    bucket run directory (``s3://``, ``gs://``) names its metrics segments' prefix (a str)."""
    if store.is_bucket(str(path)):
        url = store.bucket_path(str(path), "run directory")
        if url.endswith((".jsonl", ".csv")):
            if store.stat(url) is None:
                raise OlmaxError(f"metrics file not found: {url}")
            return url
        prefix = store.join(url, "metrics")
        if not store.segment_names(prefix):
            raise OlmaxError(f"{url}: run directory has no metrics (no {prefix}/NNNNNN.jsonl)")
        return prefix
    path = Path(path)
    if path.is_dir():
        f = path / "metrics.jsonl"
        if not f.is_file():
            raise OlmaxError(f"{path}: run directory has no metrics.jsonl")
        return f
    if not path.is_file():
        raise OlmaxError(f"metrics file not found: {path}")
    return path


def read_rows(path: str | os.PathLike, columns: Mapping[str, str] | None = None, *,
              lines: list[int] | None = None) -> list[dict[str, Any]]:
    """Rows of a run dir / ``.jsonl`` / ``.csv`` with ``columns`` (ours -> theirs) renamed to ours;
    ``lines``, when given, receives each row's line number. A JSONL line that is not a JSON
    object, or a CSV row whose fields do not match the header, is an OlmaxError naming its line
    (a UTF-8 byte-order mark is skipped)."""
    f = metrics_file(path)
    rename = {theirs: ours for ours, theirs in (columns or {}).items()}
    rows: list[dict[str, Any]] = []
    if store.is_bucket(f):
        text = (store.read_segments(f) if not f.endswith((".jsonl", ".csv")) else
                (store.read(f) or b"").decode("utf-8", errors="replace"))
    else:
        text = read_text(f)
    text = text.removeprefix("\ufeff")
    if str(f).endswith(".csv"):
        with io.StringIO(text, newline="") as fh:
            reader = csv.DictReader(fh)
            header = reader.fieldnames or []
            missing = [theirs for theirs in rename if theirs not in header]
            if missing:
                raise OlmaxError(f"{f}: no column '{missing[0]}' (columns: {', '.join(header)})")
            try:
                for r in reader:
                    if None in r or None in r.values():
                        got = (len(header) + len(r[None]) if None in r
                               else sum(v is not None for v in r.values()))
                        raise OlmaxError(f"{f}: line {reader.line_num} has {got} fields, the header "
                                         f"{len(header)}")
                    rows.append({rename.get(k, k): _number(v) for k, v in r.items()})
                    if lines is not None:
                        lines.append(reader.line_num)
            except csv.Error as e:
                raise OlmaxError(f"{f}: line {reader.line_num} is not CSV ({e})") from None
        return rows
    with io.StringIO(text) as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except (ValueError, RecursionError):    # ValueError: a number of > 4300 digits too
                raise OlmaxError(f"{f}: line {lineno} is not JSON") from None
            if not isinstance(r, dict):
                raise OlmaxError(f"{f}: line {lineno} is not a JSON object "
                                 f"(a {type(r).__name__.replace('dict', 'object')})")
            rows.append({rename.get(k, k): v for k, v in r.items()})
            if lines is not None:
                lines.append(lineno)
    return rows


def _number(v: str | None) -> Any:
    if v is None or v == "":
        return None
    try:
        return float(v)
    except ValueError:
        return v


_NON_FINITE_WORDS = ("nan", "inf", "-inf", "infinity", "-infinity")


def _non_finite_word(v: Any) -> Any:
    """``v``, or the float it spells when it is "nan" / "inf" (how ``metrics.jsonl`` stores a
    non-finite value: JSON has no literal for them)."""
    if isinstance(v, str) and v.strip().lower() in _NON_FINITE_WORDS:
        return float(v)
    return v


def load_curve(path: str | os.PathLike, metric: str = "loss", x: str = "step", *,
               columns: Mapping[str, str] | None = None, name: str | None = None) -> Curve:
    lines: list[int] = []
    rows = read_rows(path, columns, lines=lines)
    have = {k for r in rows for k in r}
    for key in (x, metric):
        if key not in have:
            raise OlmaxError(f"{path}: no '{key}' values (available: {', '.join(sorted(have)[:20])}"
                             f"{', ...' if len(have) > 20 else ''}); map a column with --map {key}=COLUMN")
    points: dict[float, float] = {}
    for r, line in zip(rows, lines):
        xv, yv = r.get(x), _non_finite_word(r.get(metric))
        for key, v in ((x, xv), (metric, yv)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
                raise OlmaxError(f"{metrics_file(path)}: line {line}: {key} {shown(v)} is not "
                                 f"a number")
            if isinstance(v, int) and abs(v) > sys.float_info.max:
                raise OlmaxError(f"{metrics_file(path)}: line {line}: {key} {shown(v)} is "
                                 f"beyond the range of a float")
        if xv is not None and not math.isfinite(xv):
            raise OlmaxError(f"{metrics_file(path)}: line {line}: {x} {xv} is not finite")
        if xv is not None and yv is not None:
            points[float(xv)] = float(yv)
    if not points:
        raise OlmaxError(f"{path}: no rows with numeric '{x}' and '{metric}'")
    xs = np.array(sorted(points))
    p = Path(path)
    default = p.stem if p.is_file() and p.stem != "metrics" else (p.parent.name if p.is_file() else p.name)
    # the name is for people (printed, plotted): a byte that is not UTF-8 shows as U+FFFD
    return Curve(_display(name or default), xs, np.array([points[v] for v in xs]), str(path))


def ema(y: np.ndarray, alpha: float | None) -> np.ndarray:
    """TensorBoard-style EMA (``alpha`` = weight of the past, 0 or None = no smoothing)."""
    if not alpha or not len(y):
        return np.asarray(y, float)
    if not 0 <= alpha < 1:
        raise OlmaxError(f"smoothing must be in [0, 1) (got {alpha})")
    out = np.empty(len(y))
    s = float(y[0])
    for i, v in enumerate(y):
        s = alpha * s + (1 - alpha) * float(v) if i else float(v)
        out[i] = s
    return out


def align(ref: Curve, other: Curve) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
    """(x, y_ref, y_other, interpolated) on the x values both curves share."""
    common, ia, ib = np.intersect1d(ref.x, other.x, return_indices=True)
    if len(common):
        return common, ref.y[ia], other.y[ib], False
    lo, hi = max(ref.x[0], other.x[0]), min(ref.x[-1], other.x[-1])
    keep = (ref.x >= lo) & (ref.x <= hi)
    if not keep.any():
        raise OlmaxError(f"{ref.name} and {other.name} have no overlapping x range")
    return ref.x[keep], ref.y[keep], np.interp(ref.x[keep], other.x, other.y), True


def _finite_or_none(values: np.ndarray, reduce) -> float | None:
    values = values[np.isfinite(values)]
    return float(reduce(values)) if len(values) else None


def _stats(a: np.ndarray, b: np.ndarray) -> dict[str, float | None]:
    """Mean/max absolute and relative differences over the points where both are finite."""
    both = np.isfinite(a) & np.isfinite(b)
    d = np.abs(b[both] - a[both])
    with np.errstate(divide="ignore", invalid="ignore"):
        r = d / np.abs(a[both])
    return {"mean_abs_diff": _finite_or_none(d, np.mean), "max_abs_diff": _finite_or_none(d, np.max),
            "mean_rel_diff": _finite_or_none(r, np.mean), "max_rel_diff": _finite_or_none(r, np.max)}


def non_finite(c: Curve) -> dict[str, Any] | None:
    """Where ``c`` holds NaN or infinite values: how many, the first x and its value; else None."""
    bad = np.flatnonzero(~np.isfinite(c.y))
    if not len(bad):
        return None
    return {"points": int(len(bad)), "first_x": float(c.x[bad[0]]), "first_value": str(c.y[bad[0]])}


def compare(ref: Curve, other: Curve, *, smooth: float | None = None, threshold: float = 0.01,
            relative: bool = True, windows: int = 10) -> dict[str, Any]:
    """Differences of ``other`` against ``ref`` (see the module docstring)."""
    x, a, b, interpolated = align(ref, other)
    both = np.isfinite(a) & np.isfinite(b)
    out: dict[str, Any] = {"run": other.name, "reference": ref.name, "aligned_points": int(len(x)),
                           "x_range": [float(x[0]), float(x[-1])], "interpolated": interpolated,
                           **_stats(a, b)}
    # smoothed on the aligned points where both are finite: the same lag for both runs
    sa, sb = ema(a[both], smooth), ema(b[both], smooth)
    d = np.abs(sb - sa)
    with np.errstate(divide="ignore", invalid="ignore"):
        measure = d / np.abs(sa) if relative else d
    beyond = x[both][np.flatnonzero(measure > threshold)]
    blown = x[~both]
    first = min([float(v[0]) for v in (beyond, blown) if len(v)], default=None)
    out["threshold"] = {"value": threshold, "relative": relative, "smoothed": bool(smooth)}
    out["first_divergence"] = first
    out["divergence_reason"] = (None if first is None else
                                "non-finite" if len(blown) and first == blown[0] else "threshold")
    out["non_finite_points"] = int(len(blown))
    parts = np.array_split(np.arange(len(x)), min(windows, len(x)))
    out["windows"] = [{"x_start": float(x[p[0]]), "x_end": float(x[p[-1]]), **_stats(a[p], b[p])}
                      for p in parts if len(p)]
    return out


def compare_runs(curves: Sequence[Curve], **kw: Any) -> dict[str, Any]:
    if len(curves) < 1:
        raise OlmaxError("no runs to compare")
    return {"metric": kw.pop("metric", None), "x": kw.pop("x", None),
            "runs": [{"name": c.name, "source": c.source, "points": int(len(c.x)),
                      "final": float(c.y[-1]) if np.isfinite(c.y[-1]) else None,
                      "min": _finite_or_none(c.y, np.min), "non_finite": non_finite(c)}
                     for c in curves],
            "comparisons": [compare(curves[0], c, **kw) for c in curves[1:]]}


# ----------------------------------------------------------------------------------------------
# Output


def _figure_bytes(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    return buf.getvalue()


def _display(name: str) -> str:
    """A run's name as a plot can draw it: a name that is not UTF-8 (a folder's bytes, held by
    Python as lone surrogates) with each such byte shown as U+FFFD."""
    return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def plot_comparison(curves: Sequence[Curve], summary: Mapping[str, Any], out: str | os.PathLike, *,
                    metric: str = "loss", x: str = "step", smooth: float | None = None,
                    overwrite: bool = False) -> Path:
    """Overlay (top) and relative difference to the first run (bottom) as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bot) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=[2, 1])
    for c in curves:
        line, = top.plot(c.x, c.y, lw=0.8, alpha=0.35 if smooth else 1.0)
        if smooth:
            top.plot(c.x, ema(c.y, smooth), lw=1.4, color=line.get_color(), label=_display(c.name))
        else:
            line.set_label(_display(c.name))
    top.set_ylabel(metric)
    top.legend(loc="upper right", fontsize=8)
    top.grid(alpha=0.3)
    thr = summary["comparisons"][0]["threshold"] if summary.get("comparisons") else None
    for comp, c in zip(summary.get("comparisons", []), curves[1:]):
        xa, a, b, _ = align(curves[0], c)
        a, b = ema(a, smooth), ema(b, smooth)
        with np.errstate(divide="ignore", invalid="ignore"):
            diff = (b - a) / np.abs(a) if comp["threshold"]["relative"] else b - a
        line, = bot.plot(xa, diff, lw=1.0, label=_display(f"{c.name} - {curves[0].name}"))
        if comp["first_divergence"] is not None:
            bot.axvline(comp["first_divergence"], color=line.get_color(), ls=":", lw=1)
            top.axvline(comp["first_divergence"], color=line.get_color(), ls=":", lw=1)
    if thr:
        for s in (1, -1):
            bot.axhline(s * thr["value"], color="gray", ls="--", lw=0.8)
        bot.set_ylabel("relative diff" if thr["relative"] else "diff")
        bot.legend(loc="upper right", fontsize=8)
    bot.grid(alpha=0.3)
    bot.set_xlabel(x)
    fig.suptitle(f"{metric} by {x}" + (f" (EMA {smooth})" if smooth else ""))
    data = _figure_bytes(fig)
    plt.close(fig)
    return write_bytes_atomic(out, data, overwrite=overwrite)


# ----------------------------------------------------------------------------------------------
# Run dashboard

_PANELS: list[tuple[str, tuple[str, ...]]] = [
    ("loss", ("loss",)),
    ("z-loss", ("z_loss",)),
    ("learning rate", ("lr",)),
    ("grad norm", ("grad_norm",)),
    ("tokens / s", ("tokens_per_sec",)),
    ("MFU", ("mfu",)),
]


def _series(rows: Iterable[Mapping[str, Any]], key: str, x: str = "step") -> tuple[np.ndarray, np.ndarray]:
    pts = {}
    for r in rows:
        v, s = r.get(key), r.get(x)
        if isinstance(v, (int, float)) and isinstance(s, (int, float)) and math.isfinite(float(v)):
            pts[float(s)] = float(v)
    xs = np.array(sorted(pts))
    return xs, np.array([pts[v] for v in xs])


def write_dashboard(run_dir: str | os.PathLike, out: str | os.PathLike | None = None) -> Path | None:
    """One PNG with the run's loss, LR, grad norm, tokens/s, MFU and eval metrics.

    Written atomically to ``RUN_DIR/dashboard.png`` (replacing an older dashboard of the same run);
    returns None when the run has logged nothing yet.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_rows(run_dir)
    if not rows:
        return None
    # Only metrics with at least one finite number (e.g. no MFU panel on a CPU without a peak).
    keys = {k for r in rows for k, v in r.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    panels = [(title, [k for k in ks if k in keys]) for title, ks in _PANELS]
    panels = [(t, ks) for t, ks in panels if ks]
    ppl = sorted(k for k in keys if k.startswith("eval/") and k.endswith("/CE loss"))
    if ppl:
        panels.append(("held-out CE loss", ppl))
    for title, suffixes in (("downstream BPB (v2)", ("(BPB v2)",)),
                            ("downstream accuracy", ("(accuracy)", "(length-normalized accuracy)"))):
        ks = sorted(k for k in keys if k.startswith("eval/downstream/") and k.endswith(suffixes))
        if ks:
            panels.append((title, ks))
    if not panels:
        return None
    cols = 2 if len(panels) > 1 else 1
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(6 * cols, 3.2 * nrows), squeeze=False,
                             layout="constrained")
    for ax, (title, ks) in zip(axes.flat, panels):
        for k in ks:
            xs, ys = _series(rows, k)
            marker = "o" if len(xs) < 30 else None
            ax.plot(xs, ys, lw=1, marker=marker, ms=3,
                    label=k.replace("eval/downstream/", "").replace("eval/lm/", "").replace("eval/", ""))
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if len(ks) > 1 or title.startswith(("held-out", "downstream")):
            ax.legend(fontsize=6)
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(str(run_dir).rstrip("/").rsplit("/", 1)[-1], fontsize=11)
    data = _figure_bytes(fig)
    plt.close(fig)
    return store.write_bytes(out or store.join(run_dir, "dashboard.png"), data)
