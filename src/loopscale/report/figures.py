"""Figures (matplotlib, Agg backend, PNG), one file per figure, one panel per model size.

Every figure draws a condition with its registry style (`loopscale.registry.Condition`:
a fixed colour-blind-safe Okabe–Ito colour per condition, a line style and marker per
readout), so conditions can be followed across figures. Only completed runs are drawn; seed means are lines, single seeds faint points.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Optional

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter  # noqa: E402

from ..io import atomic_write
from .groups import (Group, depth_curve, exits, final_exit, group_runs, lemma_loops, norm_histogram, norm_loops,
                        radial_loops, scale_sweep, stats, throughput_curve, training_norms)
from ..registry import READOUTS, condition
from .markdown import num
from .runs import Run, finite
from .styles import colour, linestyle, marker, readout_style


plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 8,
                     "figure.dpi": 100, "savefig.dpi": 130, "axes.grid": True, "grid.alpha": 0.3,
                     "svg.hashsalt": "loopscale", "path.simplify": False})


# ---------------------------------------------------------------------------
# plumbing
# ---------------------------------------------------------------------------
_LEGEND_W = 3.4  # inches of figure width for the legend on the right


def _int_ticks(ax) -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _panels(groups: list[Group], width: float = 5.6, height: float = 4.2, overview: bool = False):
    """One panel per size; `overview`: each panel gets a short full-range panel above it
    (`ax._overview`, filled by `_zoom`)."""
    sizes = list(dict.fromkeys(g.size for g in groups))
    n = max(1, len(sizes))
    if not overview:
        fig, axes = plt.subplots(1, n, figsize=(width * n + _LEGEND_W, height), squeeze=False, layout="constrained")
        return fig, list(axes[0]), sizes
    fig, axes = plt.subplots(2, n, figsize=(width * n + _LEGEND_W, height * 1.4), squeeze=False, sharex="col",
                             gridspec_kw={"height_ratios": [1, 2.4]}, layout="constrained")
    for top_ax, ax in zip(axes[0], axes[1]):
        ax._overview = top_ax
    return fig, list(axes[1]), sizes


def _legend(fig, groups: list[Group], extra: Optional[list] = None) -> None:
    first: dict = {}  # each condition's first group
    for g in groups:
        first.setdefault(g.cond, g)
    handles = [Line2D([], [], color=colour(c), ls=linestyle(c), marker=marker(c),
                      label=c.label + ("" if g.used else " (no completed run)")) for c, g in first.items()]
    handles += extra or []
    if handles:
        fig.legend(handles=handles, loc="outside right center", frameon=False)


NO_DATA_KEY = "loopscale-no-data"  # PNG text chunk of a figure none of whose panels has data: what is missing


def save_figure(fig, path: Path) -> Path:
    """Atomic PNG write and a PDF beside it (temp file in the same directory, then
    os.replace); no timestamps. A figure whose every panel is empty says so in its PNG's
    `NO_DATA_KEY` text chunk (`no_data`), so the report can leave it out. Returns the PNG's path."""
    _lift_titles(fig)
    panels = [ax for ax in fig.axes if ax.get_visible()]
    missing = [getattr(ax, "_no_data", None) for ax in panels]
    meta = {"Software": None}
    if panels and all(missing):
        meta[NO_DATA_KEY] = ", ".join(dict.fromkeys(missing))
    try:
        atomic_write(Path(path).with_suffix(".pdf"), lambda f: fig.savefig(
            f, format="pdf", bbox_inches="tight", metadata={"Creator": None, "Producer": None, "CreationDate": None}))
        return atomic_write(path, lambda f: fig.savefig(f, format="png", bbox_inches="tight", metadata=meta))
    finally:
        plt.close(fig)


def no_data(path: Path) -> Optional[str]:
    """What a figure written by this module lacks where none of its panels has data (e.g.
    "radial"), else None (also for a missing or foreign file)."""
    from PIL import Image
    try:
        with Image.open(path) as im:
            return getattr(im, "text", {}).get(NO_DATA_KEY)
    except (OSError, ValueError):
        return None


def _empty(ax, what: str) -> None:
    ax._no_data = what
    ax.text(0.5, 0.5, f"no data\n({what})", ha="center", va="center", transform=ax.transAxes, color="0.4")


def _k_mean(g: Group, getter: Callable[[Run], Optional[list]], key: str) -> tuple[list, list, list]:
    """k, seed mean, per-seed points [(k, v)] of rows [{k, key}] from the completed runs."""
    per: dict = {}
    for r in g.used:
        for row in getter(r) or []:
            v = row.get(key)
            if row.get("k") is not None and finite(v):
                per.setdefault(int(row["k"]), []).append(v)
    ks = sorted(per)
    return ks, [stats(per[k])[0] for k in ks], [(k, v) for k in ks for v in per[k]]


def _positive(v) -> bool:
    return finite(v) and v > 0


def _tick_plain(v: float, _pos=None) -> str:
    return f"{v:g}" if 1e-3 <= v < 1e6 else _tick_power(v)


def _tick_power(v: float, _pos=None) -> str:
    if v <= 0:
        return ""
    e = math.floor(math.log10(v) + 1e-9)
    m = v / 10 ** e
    return f"$10^{{{e}}}$" if abs(m - 1) < 1e-6 else f"${m:g}\\times10^{{{e}}}$"


def _log(ax, axis: str, values=None) -> None:
    """Log scale with readable ticks: 1-2-5 steps with plain labels when the data span few
    decades, powers of ten otherwise; minor ticks unlabelled."""
    (ax.set_yscale if axis == "y" else ax.set_xscale)("log")
    a = ax.yaxis if axis == "y" else ax.xaxis
    v = [x for x in (values or []) if _positive(x)]
    span = math.log10(max(v) / min(v)) if v else 99
    if span <= 2.5:
        a.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        a.set_major_formatter(FuncFormatter(_tick_plain))
    else:
        a.set_major_locator(LogLocator(base=10, numticks=9))
        a.set_major_formatter(FuncFormatter(_tick_power))
    a.set_minor_formatter(NullFormatter())


def _set_log(ax, axis: str, values) -> None:
    """Log scale when the positive values span more than one decade."""
    v = [x for x in values if _positive(x)]
    if v and max(v) / min(v) > 10:
        _log(ax, axis, v)


def _zoom(ax, band: list, values: list) -> None:
    """Zoom the y axis to the band where the conditions differ: from the lowest value to
    the highest of `band` (the values at K_train); linear, or log where the band spans more
    than a factor 3. The axes above (`_panels(...,
    overview=True)`) repeat every line over the full range on a log scale with the zoomed
    band shaded, so the extreme exits and depths stay visible (a broken axis)."""
    band = [v for v in band if _positive(v)]
    allv = [v for v in values if _positive(v)]
    top_ax = getattr(ax, "_overview", None)
    if not band or not allv:
        _set_log(ax, "y", allv)
        if top_ax is not None:
            top_ax.set_visible(False)
        return
    lo, hi = min(allv), max(band)
    if hi / lo > 3:  # the band itself spans a factor > 3: a log axis reads better
        bottom, top = lo / 1.1, hi * 1.25
        _log(ax, "y", [bottom, top])
        scale = "log"
    else:
        span = max(hi - lo, 0.02 * hi)
        bottom, top = lo - 0.08 * span, hi + 0.15 * span
        scale = "linear"
    ax.set_ylim(bottom, top)
    ax.text(0.01, 0.01, f"{scale}, zoomed to the band of the values at K_train", transform=ax.transAxes, fontsize=7,
            color="0.35", va="bottom")
    if top_ax is None:
        return
    for line in ax.get_lines():
        x = list(line.get_xdata())
        if line.get_transform() != ax.transData:  # axvline: drawn in axes coordinates
            top_ax.axvline(x[0], color=line.get_color(), ls=line.get_linestyle(), lw=line.get_linewidth())
            continue
        top_ax.plot(x, line.get_ydata(), color=line.get_color(), ls=line.get_linestyle(), marker=line.get_marker(),
                    ms=3, mfc=line.get_markerfacecolor(), lw=1.1)
    _log(top_ax, "y", allv)
    top_ax.axhspan(bottom, top, color="0.5", alpha=0.2, lw=0)
    top_ax.text(0.99, 0.95, "every value, log scale; shaded: the zoomed band below", transform=top_ax.transAxes,
                ha="right", va="top", fontsize=7, color="0.35")
    top_ax.tick_params(labelbottom=False)


def _lift_titles(fig) -> None:
    """A panel with an overview above it shows its title on the overview."""
    for ax in fig.axes:
        top_ax = getattr(ax, "_overview", None)
        if top_ax is not None and not top_ax.get_lines():  # no data: no overview
            top_ax.set_visible(False)
        if top_ax is not None and top_ax.get_visible() and ax.get_title():
            top_ax.set_title(ax.get_title())
            ax.set_title("")


# ---------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------
def fig_norm_per_loop(groups: list[Group], path: Path) -> Path:
    headline = condition("rmsnorm", "per_loop")  # the paper's drifting model: drawn on top, its ‖H_K‖ labelled
    fig, axes, sizes = _panels(groups)
    for ax, size in zip(axes, sizes):
        vals, top = [], None
        for g in sorted((g for g in groups if g.size == size), key=lambda g: g.cond.base == headline.base):
            ks, m, pts = _k_mean(g, norm_loops, "norm")
            if ks:
                is_top = g.cond.base == headline.base
                ax.plot(ks, m, color=colour(g.cond), ls=linestyle(g.cond), marker=marker(g.cond),
                        lw=2.6 if is_top else 1.8, zorder=4 if is_top else 2)
                ax.scatter([p[0] for p in pts], [p[1] for p in pts], color=colour(g.cond), s=10, alpha=0.35)
                vals += m
                if is_top and _positive(m[-1]):
                    top = (ks[-1], m[-1], g.cond)
        if vals:
            _log(ax, "y", vals)
            if top is not None:
                k, v, cond = top
                ax.annotate(f"{cond.label}: ‖H_K‖ = {num(v)}", (k, v), xytext=(-6, 8), textcoords="offset points",
                            ha="right", fontsize=8, color=colour(cond), fontweight="bold")
                ax.axhline(v, color=colour(cond), lw=0.6, ls=":", zorder=1)
                lo, hi = ax.get_ylim()
                ax.set_ylim(lo, max(hi, v * 1.8))  # room for the label
            ax.set_xticks(range(1, size.n_loops + 1)) if size.n_loops <= 16 else _int_ticks(ax)
        else:
            _empty(ax, "norms")
        ax.set_title(f"‖H_k‖ per loop — {size.label}")
        ax.set_xlabel("loop k")
        ax.set_ylabel("mean per-token ‖H_k‖ (L2, log scale)")
    _legend(fig, groups)
    return save_figure(fig, path)


def fig_norm_training(groups: list[Group], path: Path) -> Path:
    fig, axes, sizes = _panels(groups)
    for ax, size in zip(axes, sizes):
        allv = []
        for g in (g for g in groups if g.size == size):
            for r in g.runs:  # diverged runs are drawn too: their curve is informative
                tr = [(s, v) for s, v in training_norms(r) if _positive(v)]
                if not tr:
                    continue
                allv += [t[1] for t in tr]
                ax.plot([t[0] for t in tr], [t[1] for t in tr], color=colour(g.cond), ls=linestyle(g.cond), lw=1.3,
                        alpha=0.9 if r.completed else 0.5)
                if not r.completed:
                    ax.plot([tr[-1][0]], [tr[-1][1]], marker="x", color=colour(g.cond), ms=8, mew=2)
        if allv:
            _log(ax, "y", allv)
        else:
            _empty(ax, "metrics.jsonl")
        ax.set_title(f"‖H_K‖ during training — {size.label}")
        ax.set_xlabel("training step")
        ax.set_ylabel("‖H_K‖ on the training batch (log scale)")
    stopped = any(training_norms(r) for g in groups for r in g.excluded)
    _legend(fig, groups, [Line2D([], [], color="0.3", marker="x", ls="", label="run diverged / failed here")]
            if stopped else None)
    return save_figure(fig, path)


def fig_ppl_depth(groups: list[Group], path: Path) -> Path:
    fig, axes, sizes = _panels(groups, overview=True)
    for ax, size in zip(axes, sizes):
        vals, at_k = [], []
        for g in (g for g in groups if g.size == size):
            ks, m, _ = _k_mean(g, depth_curve, "ppl")
            if ks:
                ax.plot(ks, m, color=colour(g.cond), ls=linestyle(g.cond), marker=marker(g.cond), ms=4, lw=1.6)
                vals += m
                at_k += [v for k, v in zip(ks, m) if k == size.n_loops]
            ke, me, _ = _k_mean(g, exit_ppl_curve, "ppl")
            spec = g.cond.readout_spec
            if ke and spec is not None and spec.exits_differ:  # its exits k<K use another readout
                ax.plot(ke, me, color=colour(g.cond), ls=":", marker=marker(g.cond), ms=4, mfc="none", lw=1.2)
                vals += me
            elif ke and not ks:
                ax.plot(ke, me, color=colour(g.cond), ls=linestyle(g.cond), marker=marker(g.cond), ms=4, lw=1.6)
                vals += me
        if vals:
            ax.axvline(size.n_loops, color="0.2", ls=":", lw=1.2)
            ax.annotate(f"K_train = {size.n_loops}", (size.n_loops, 1.0), xycoords=("data", "axes fraction"),
                        xytext=(4, -12), textcoords="offset points", fontsize=8, color="0.2")
            _zoom(ax, at_k, vals)
        else:
            _empty(ax, "depth")
        _int_ticks(ax)
        ax.set_title(f"Validation PPL vs depth — {size.label}")
        ax.set_xlabel("loops k (final readout; k > K_train extrapolated)")
        ax.set_ylabel("validation perplexity")
    differ = dict.fromkeys(g.cond.readout for g in groups
                           if g.used and g.cond.readout_spec is not None and g.cond.readout_spec.exits_differ)
    extra = [Line2D([], [], color="0.3", ls=":", marker=readout_style(r)[1], mfc="none",
                    label=f"{READOUTS[r].label}: exits k<K ({_exit_readout_label(READOUTS[r])})") for r in differ]
    _legend(fig, groups, extra)
    return save_figure(fig, path)


def _exit_readout_label(spec) -> str:
    """What a readout whose exits differ applies at the exits k < K, in words."""
    name = spec.norm_at(1, 2)
    return READOUTS[name].label if name in READOUTS else name


def _frontier(groups: list[Group], path: Path, ppl_curve, exits_only: bool, title: str, xlabel: str,
              ylabel: str) -> Path:
    """PPL at depth k (from `ppl_curve`) against the evaluation throughput of k loops, a line
    per condition, k = K_train starred; `exits_only` keeps k ≤ K_train and labels each k."""
    fig, axes, sizes = _panels(groups, overview=True)
    labels = []
    for ax, size in zip(axes, sizes):
        xs, ys, at_k = [], [], []
        for g in (g for g in groups if g.size == size):
            kp, mp, _ = _k_mean(g, ppl_curve, "ppl")
            kt, mt, _ = _k_mean(g, throughput_curve, "tokens_per_s")
            tp = dict(zip(kt, mt))
            pts = [(tp[k], p, k) for k, p in zip(kp, mp) if k in tp and (not exits_only or k <= size.n_loops)]
            if not pts:
                continue
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=colour(g.cond), ls=linestyle(g.cond),
                    marker=marker(g.cond), ms=4, lw=1.4)
            for x, y, k in pts:
                if exits_only:
                    labels.append((ax, x, y, f"k={k}", colour(g.cond)))
                if k == size.n_loops:
                    at_k.append(y)
                    ax.plot([x], [y], marker="*", color=colour(g.cond), ms=13, mec="k", mew=0.6)
            xs += [p[0] for p in pts]
            ys += [p[1] for p in pts]
        if xs:
            _set_log(ax, "x", xs)
            _zoom(ax, at_k, ys)
        else:
            _empty(ax, "depth + throughput")
        ax.set_title(f"{title} — {size.label}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
    _legend(fig, groups, [Line2D([], [], color="0.3", marker="*", ms=11, ls="", mec="k", label="k = K_train")])
    if labels:
        _place_labels(fig, labels)
    return save_figure(fig, path)


# where a point's label may go, in points from the point: right below first, then around it
_LABEL_OFFSETS = ((4, -10), (4, 3), (-4, 3), (-4, -10), (6, -4), (-6, -4), (0, 7), (0, -13))


def _place_labels(fig, labels: list) -> None:
    """Annotate each (ax, x, y, text, colour) at the first offset (`_LABEL_OFFSETS`) where it
    overlaps no label already placed and stays inside its panel; a label with no free place
    is left out (the points stay, and their values are in the tables)."""
    fig.canvas.draw()  # the final layout (constrained): text extents in display units
    renderer = fig.canvas.get_renderer()
    placed = [t.get_window_extent(renderer) for ax in fig.axes if ax.get_visible() for t in ax.texts]  # notes
    for ax, x, y, text, col in labels:
        if not (ax.get_visible() and np.isfinite(x) and np.isfinite(y)):
            continue
        box_ax = ax.get_window_extent(renderer)
        for dx, dy in _LABEL_OFFSETS:
            t = ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=7, color=col,
                            ha="left" if dx >= 0 else "right", annotation_clip=True)
            bb = t.get_window_extent(renderer).expanded(1.05, 1.1)
            inside = (bb.x0 >= box_ax.x0 and bb.x1 <= box_ax.x1 and bb.y0 >= box_ax.y0 and bb.y1 <= box_ax.y1)
            if inside and not any(bb.overlaps(o) for o in placed):
                placed.append(bb)
                break
            t.remove()


def fig_frontier(groups: list[Group], path: Path) -> Path:
    """Depth k = 1..3·K (truncated or extended loop, the final readout) against throughput."""
    return _frontier(groups, path, depth_curve, False, "Compute–quality frontier",
                     "evaluation throughput (tokens/s; more loops → left)",
                     "validation perplexity (final readout)")


def exit_ppl_curve(run: Run) -> Optional[list]:
    """[{k, ppl}] of the exits k = 1..K, each read through its exit readout (the paper's Table 5)."""
    return exits(run)[0]


def fig_frontier_exits(groups: list[Group], path: Path) -> Path:
    """The paper's compute-quality frontier (Table 5, Figure 4; official plot_pareto_compute_quality.py):
    depth k = 1..K read through exit k's readout (what a model stopped after k loops would
    emit), against the evaluation throughput of k loops."""
    return _frontier(groups, path, exit_ppl_curve, True, "Compute–quality frontier, exit readouts",
                     "evaluation throughput at depth k (tokens/s; more loops → left)",
                     "validation perplexity of exit k (its own readout)")


def fig_radial_vs_norm(groups: list[Group], path: Path) -> Path:
    fig, axes, sizes = _panels(groups)
    floor = 1e-12
    for ax, size in zip(axes, sizes):
        allx = []
        for g in (g for g in groups if g.size == size):
            xs, ys = [], []
            for r in g.used:
                rad = radial_loops(r) or []
                last = max(rad, key=lambda x: x.get("k", 0)) if rad else None
                nk = final_exit(r)["norm"]
                if last is None or not _positive(nk) or not finite(last.get("radial_fraction")):
                    continue
                xs.append(nk)
                ys.append(max(last["radial_fraction"], floor))
            if xs:
                allx += xs
                ax.scatter(xs, ys, color=colour(g.cond), marker=marker(g.cond), s=45, edgecolors="k",
                           linewidths=0.5, zorder=3)
        if allx:
            _log(ax, "x", allx)
            _log(ax, "y")
            ax.axhline(1e-6, color="0.3", ls=":", lw=1)
            ax.annotate("1e-6: claim (d) bound", (1.0, 1e-6), xycoords=("axes fraction", "data"), xytext=(-4, 3),
                        textcoords="offset points", ha="right", fontsize=8, color="0.3")
        else:
            _empty(ax, "radial")
        ax.set_title(f"Radial gradient fraction vs ‖H_K‖ — {size.label}")
        ax.set_xlabel("‖H_K‖ (mean per-token L2, log scale)")
        ax.set_ylabel(f"radial fraction cos²(∂CE_K/∂H_K, H_K) at exit K\n(log scale, floored at {floor:.0e})")
    _legend(fig, groups, [Line2D([], [], color="0.3", ls="", marker="o", label="one point per seed")])
    return save_figure(fig, path)


def fig_norm_histogram(groups: list[Group], path: Path) -> Path:
    fig, axes, sizes = _panels(groups)
    for ax, size in zip(axes, sizes):
        lo, hi = math.inf, 0.0
        for g in (g for g in groups if g.size == size):
            for i, r in enumerate(g.used):
                h = norm_histogram(r)
                if not h:
                    continue
                edges, counts = h["edges"], h["counts"]
                total = sum(counts) or 1
                ax.stairs([c / total for c in counts], edges, color=colour(g.cond), lw=1.4,
                          ls=linestyle(g.cond), alpha=0.9 if i == 0 else 0.45)
                lo, hi = min(lo, edges[0]), max(hi, edges[-1])
        if hi <= 0:
            _empty(ax, "norms histogram")
        elif lo > 0:
            _log(ax, "x", [lo, hi])
        ax.set_title(f"Per-token ‖H_K‖ distribution — {size.label}")
        ax.set_xlabel("per-token ‖H_K‖ (L2 over channels, log scale)")
        ax.set_ylabel("fraction of validation tokens per bin")
    _legend(fig, groups, [Line2D([], [], color="0.3", label="one line per seed (log-spaced bins)")])
    return save_figure(fig, path)


def fig_lemma(groups: list[Group], path: Path) -> Path:
    sizes = list(dict.fromkeys(g.size for g in groups))
    n = max(1, len(sizes))
    fig, axes = plt.subplots(n, 3, figsize=(15.5 + _LEGEND_W, 4.2 * n), squeeze=False, layout="constrained")
    panels = (("scale", "scale s_k = ‖H_k‖ (grows)", "mean per-token s_k (log scale)"),  # key, title, y label
              ("angular_update", "angular update ‖u_(k+1) − u_k‖ (falls ~1/s)",
               "mean ‖u_(k+1) − u_k‖ (log scale)"),
              ("angular_times_scale", "angular update × scale (flat = Lemma 2)",
               "mean ‖u_(k+1) − u_k‖ · s_k (log scale)"))
    for row, size in zip(axes, sizes or [None]):
        any_ = False
        for g in (g for g in groups if g.size == size):
            for ax, (key, _, _) in zip(row, panels):
                ks, m, _ = _k_mean(g, lemma_loops, key)
                if ks:
                    any_ = True
                    ax.plot(ks, m, color=colour(g.cond), ls=linestyle(g.cond), marker=marker(g.cond), ms=3, lw=1.5)
        lab = size.label if size else ""
        for ax, (_, title, ylabel) in zip(row, panels):
            if any_:
                _log(ax, "y", [y for line in ax.get_lines() for y in line.get_ydata()])
                if size is not None:
                    ax.axvline(size.n_loops, color="0.2", ls=":", lw=1)
            else:
                _empty(ax, "lemma")
            ax.set_title(f"{lab}\n{title}")
            ax.set_ylabel(ylabel)
            ax.set_xlabel("loop k (dotted: K_train)")
            _int_ticks(ax)
    _legend(fig, groups)
    return save_figure(fig, path)


def fig_scale(groups: list[Group], path: Path) -> Path:
    """CE of the final readout of α·H_K against α (the official scale-sensitivity figure)."""
    fig, axes, sizes = _panels(groups)
    for ax, size in zip(axes, sizes):
        any_ = False
        for g in (g for g in groups if g.size == size):
            per: dict = {}
            for r in g.used:
                for row in scale_sweep(r) or []:
                    if _positive(row.get("alpha")) and finite(row.get("ce")):
                        per.setdefault(float(row["alpha"]), []).append(row["ce"])
            if per:
                any_ = True
                al = sorted(per)
                ax.plot(al, [stats(per[a])[0] for a in al], color=colour(g.cond), ls=linestyle(g.cond),
                        marker=marker(g.cond), ms=4, lw=1.8)
        if any_:
            ax.set_xscale("log")
            ax.axvline(1.0, color="0.2", ls=":", lw=1)
        else:
            _empty(ax, "scale")
        ax.set_title(f"Scale sensitivity — {size.label}")
        ax.set_xlabel("scale factor α of H_K before the readout (log scale; dotted: α = 1)")
        ax.set_ylabel("validation CE of the final readout (nats)")
    _legend(fig, groups)
    return save_figure(fig, path)


def _exit_curves(g: Group) -> tuple[list, list]:
    """Training steps and, per exit k, the seed-mean training CE at those steps (steps
    logged by every completed seed)."""
    per_seed = [{int(m["step"]): m["ce"] for m in r.metrics
                 if finite(m.get("step")) and isinstance(m.get("ce"), list) and m["ce"]} for r in g.used]
    if not per_seed:
        return [], []
    steps = sorted(set.intersection(*(set(d) for d in per_seed)))
    K = min(len(d[s]) for d in per_seed for s in steps) if steps else 0
    curves = [[stats(d[s][k] for d in per_seed)[0] for s in steps] for k in range(K)]
    return steps, curves


def fig_exit_training(groups: list[Group], path: Path) -> Path:
    panels = [(g, *_exit_curves(g)) for g in groups if g.used]
    ncols = 3
    nrows = max(1, math.ceil(len(panels) / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.1 * nrows), squeeze=False, layout="constrained")
    cmap = plt.get_cmap("viridis")
    Kmax = max([len(c) for _, _, c in panels] + [1])

    def col(k):
        return cmap(0.9 * k / max(Kmax - 1, 1))
    flat = [ax for row in axes for ax in row]
    multi = len({g.size for g, _, _ in panels}) > 1
    for ax, (g, steps, curves) in zip(flat, panels):
        if not steps:
            _empty(ax, "metrics.jsonl")
        late = [v for c in curves for s, v in zip(steps, c) if s >= 0.2 * steps[-1] and finite(v)]
        for k, c in enumerate(curves):
            ax.plot(steps, c, color=col(k), lw=1.4)
        if late:
            lo, hi = min(late), max(late)
            span = max(hi - lo, 0.02 * abs(hi), 1e-3)
            ax.set_ylim(lo - 0.05 * span, hi + 0.15 * span)
        ax.set_title(g.cond.label + (f"\n{g.size.label}" if multi else ""), fontsize=8.5)
        ax.tick_params(labelsize=7.5)
        ax.set_xlabel("training step", fontsize=8)
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    if not panels:
        flat[0].set_visible(True)
        _empty(flat[0], "no completed run")
    for row in axes:
        row[0].set_ylabel("training CE (nats)")
    handles = [Line2D([], [], color=col(k), lw=1.6, label=f"exit k={k + 1}") for k in range(Kmax)]
    fig.legend(handles=handles, loc="outside upper center", ncols=Kmax, frameon=False,
               title="training CE of every exit on the training batch (seed mean; y zoomed to the last 80% of steps)")
    return save_figure(fig, path)


def fig_drift(groups: list[Group], path: Path) -> Path:
    from . import paper
    from .extrapolation import drift_results, paper_steps
    fig, axes, sizes = _panels(groups, width=6.4)
    results = drift_results(groups)
    T44, T129 = paper_steps(), paper_steps(batch_size=32)
    for ax, size in zip(axes, sizes):
        any_ = False
        for res in (r for r in results if r.group.size == size):
            g = res.group
            if len(res.steps):
                ax.scatter(res.steps, res.norms, color=colour(g.cond), s=6, alpha=0.3, lw=0)
            if not res.ok:
                continue
            any_ = True
            last = float(res.steps.max())
            t_in = np.geomspace(res.steps.min(), last, 50)
            t_out = np.geomspace(last, res.target, 50)
            ax.plot(t_in, res.chosen.predict(t_in), color=colour(g.cond), ls=linestyle(g.cond), lw=1.8)
            ax.plot(t_out, res.chosen.predict(t_out), color=colour(g.cond), ls=":", lw=1.3)
            lo, hi = res.ci
            if finite(lo) and finite(hi) and lo > 0:
                ax.errorbar([res.target], [res.at_target], yerr=[[res.at_target - lo], [hi - res.at_target]],
                            color=colour(g.cond), marker=marker(g.cond), ms=5, capsize=3, lw=1.2)
        if any_:
            for t, (name, v), (dx, dy, ha) in zip((T44, T129), paper.NORM_K_PER_LOOP_RMSNORM.items(),
                                                  ((-9, -3, "right"), (0, 9, "center"))):
                ax.plot([t], [v], marker="*", ms=14, color="k", mfc="w", mew=1.2, ls="")
                ax.annotate(f"paper {name}: {v:,}", (t, v), xytext=(dx, dy), textcoords="offset points",
                            ha=ha, fontsize=7.5)
            ax.axvline(T44, color="0.3", ls=":", lw=1)
            ax.set_xscale("log")
            _log(ax, "y", [y for line in ax.get_lines() for y in line.get_ydata() if _positive(y)])
            lo, hi = ax.get_ylim()
            ax.set_ylim(lo, hi * 2.5)  # room for the paper's labels
        else:
            _empty(ax, "too few training log records")
        ax.set_title(f"Drift law of ‖H_K‖ (extrapolation) — {size.label}")
        ax.set_xlabel(f"training step (log; dotted line: the paper's 44M run, {T44:,} steps)")
        ax.set_ylabel("‖H_K‖ on the training batch (log scale)")
    _legend(fig, groups, [
        Line2D([], [], color="0.3", lw=1.8, label="fitted law (chosen by R², drift.md)"),
        Line2D([], [], color="0.3", ls=":", lw=1.3, marker="o", label="extrapolated, 95% bootstrap interval"),
        Line2D([], [], color="k", marker="*", mfc="w", ms=11, ls="",
               label="paper: per-loop CE + RMSNorm readout (44M, 129M)")])
    return save_figure(fig, path)


def fig_story(groups: list[Group], path: Path) -> Path:
    """The quadrant figure: CE gap (symlog) vs log10 ‖H_K‖, one point per run, official thresholds."""
    from .endpoint_scale import GAP_USABLE, LOG10_NORM_CONTROLLED, story_point
    fig, axes, sizes = _panels(groups)
    for ax, size in zip(axes, sizes):
        pts = [(g, p) for g in groups if g.size == size for r in g.used if (p := story_point(r)) is not None]
        if not pts:
            _empty(ax, "depth")
        for g, p in pts:
            ax.scatter([p["ce_gap"]], [p["log10_norm_K"]], color=colour(g.cond), marker=marker(g.cond), s=55,
                       edgecolors="k", linewidths=0.5, zorder=3)
        ax.set_xscale("symlog", linthresh=1.0)
        hi = max([p["ce_gap"] for _, p in pts] + [GAP_USABLE])
        ticks = [t for t in (-1, 0, 1, 2, 5, 10, 20, 50, 100) if t <= 2 * hi and (t >= 0 or any(
            p["ce_gap"] < 0 for _, p in pts))]
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.axvline(GAP_USABLE, color="0.4", ls="--", lw=0.9)
        ax.axhline(LOG10_NORM_CONTROLLED, color="0.4", ls="--", lw=0.9)
        ax.text(0.02, 0.02, "usable exits + controlled scale", transform=ax.transAxes, fontsize=8, color="#166534")
        ax.set_title(f"Loss placement × scale visibility — {size.label}")
        ax.set_xlabel("early-exit failure: CE(1) − CE(K) (nats, symlog)")
        ax.set_ylabel("norm drift: log10 ‖H_K‖")
    _legend(fig, groups)
    return save_figure(fig, path)


FIGURES = {
    "norm_per_loop": (fig_norm_per_loop, "‖H_k‖ vs loop k per condition"),
    "norm_training": (fig_norm_training, "‖H_K‖ over training steps"),
    "ppl_depth": (fig_ppl_depth, "Validation PPL vs depth (exits and extrapolated depth; K_train marked)"),
    "frontier": (fig_frontier, "Compute-quality frontier: PPL vs tokens/s (final readout at every depth)"),
    "frontier_exits": (fig_frontier_exits, "Compute-quality frontier as in the paper (Table 5): PPL of exit k "
                                           "(its exit readout) vs tokens/s at depth k"),
    "radial_vs_norm": (fig_radial_vs_norm, "Radial gradient fraction vs ‖H_K‖"),
    "norm_histogram": (fig_norm_histogram, "Per-token ‖H_K‖ distribution"),
    "lemma": (fig_lemma, "Lemma-2 check: scale, angular update and their product vs loop"),
    "scale": (fig_scale, "Scale sensitivity: CE of the readout of α·H_K vs α"),
    "exit_training": (fig_exit_training, "Training CE of every exit over training steps, one panel per condition"),
    "drift": (fig_drift, "Drift law: ‖H_K‖ vs training step, fitted and extrapolated to the paper's step count"),
    "story_quadrant": (fig_story, "Loss placement × scale visibility: CE(1) − CE(K) vs log10 ‖H_K‖, one point per run"),
}


def write_figures(runs: list[Run], out_dir: Path) -> list[Path]:
    """Every figure as `<out_dir>/<name>.png` and `.pdf` (written even without data: an empty
    panel says so); returns the PNG paths."""
    groups = group_runs(runs)
    return [fn(groups, Path(out_dir) / f"{name}.png") for name, (fn, _) in FIGURES.items()]
