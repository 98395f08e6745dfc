"""The report's two PNG plots: speedup per category per method, and acceptance by draft position.

matplotlib (the ``bench`` extra) draws them off screen with the Agg backend. Both are sized for
a page (10 inches wide at 120 dpi), with the legend below the axes, outside the data, however
many methods a report holds.
"""

from __future__ import annotations

from pathlib import Path

from verispec.bench.workloads import OVERALL

PAGE_WIDTH_IN = 10.0  # inches; 1200 pixels at DPI
AXES_HEIGHT_IN = 4.0
DPI = 120


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the bench plots need matplotlib: pip install 'verispec[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure(plt, legend_entries: int):
    """A page-wide figure with room under the axes for a legend of ``legend_entries`` rows."""
    return plt.subplots(figsize=(PAGE_WIDTH_IN, AXES_HEIGHT_IN + 0.25 * legend_entries))


def _legend_below(ax, entries: int, offset: float) -> None:
    """The legend under the axes (``offset``: axes fractions below them, clear of the x labels)."""
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -offset), ncol=1 if entries > 4 else entries,
              fontsize="small", frameon=False)


def _color(plt, i: int, n: int):
    """Matplotlib's default cycle (tab10) repeats after 10 lines; tab20 for more."""
    return plt.cm.tab20(i % 20) if n > 10 else None


def _save(fig, plt, path: Path) -> None:
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)


def plot_speedup(report: dict, path: Path) -> None:
    """Grouped bars: one group per category (and overall), one bar per method other than plain."""
    plt = _pyplot()
    cats = [*report["workload"]["categories"], OVERALL]
    methods = [label for label in report["results"] if label != "plain"]
    fig, ax = _figure(plt, len(methods))
    width = 0.8 / max(1, len(methods))
    for i, label in enumerate(methods):
        by_cat = report["results"][label]
        values = [(by_cat.get(c) or {}).get("speedup") or 0.0 for c in cats]
        ax.bar([x + (i - (len(methods) - 1) / 2) * width for x in range(len(cats))], values, width, label=label,
               color=_color(plt, i, len(methods)))
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(cats)), cats, rotation=20, ha="right")
    ax.set_xlabel("category")
    ax.set_ylabel("speedup over verispec plain (× tokens/s)")
    ax.set_title(f"{report['model']}, T = {report['settings']['temperature']:g}"
                 + (" (PARTIAL)" if report["partial"] else ""))
    if methods:
        _legend_below(ax, len(methods), 0.16)
    else:
        ax.text(0.5, 0.5, "only plain decoding was run", transform=ax.transAxes, ha="center")
    _save(fig, plt, path)


def plot_acceptance(report: dict, path: Path) -> None:
    """P(draft i accepted | proposed), i = 1..k, over all runs, for each drafting method."""
    plt = _pyplot()
    drafting = [label for label, by_cat in report["results"].items()
                if (by_cat.get(OVERALL) or {}).get("per_position_acceptance")]
    fig, ax = _figure(plt, len(drafting))
    drawn = 0
    for label, by_cat in report["results"].items():
        pos = (by_cat.get(OVERALL) or {}).get("per_position_acceptance") or []
        if pos:
            ax.plot(range(1, len(pos) + 1), pos, marker="o", label=label, color=_color(plt, drawn, len(drafting)))
            drawn += 1
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft position (1 = the first draft of a round)")
    ax.set_ylabel("P(accepted | proposed), fraction")
    ax.set_ylim(0, 1.05)
    ax.set_title("acceptance by position (all categories)" + (" (PARTIAL)" if report["partial"] else ""))
    if drawn:
        _legend_below(ax, drawn, 0.1)
    else:
        ax.text(0.5, 0.5, "no method proposed drafts", transform=ax.transAxes, ha="center")
    _save(fig, plt, path)
