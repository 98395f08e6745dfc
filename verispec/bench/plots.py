"""The report's two PNG plots: speedup per category per method, and acceptance by draft position.

matplotlib (the ``bench`` extra) draws them off screen with the Agg backend.
"""

from __future__ import annotations

from pathlib import Path

from verispec.bench.report import OVERALL


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("the bench plots need matplotlib: pip install 'verispec[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(report: dict, path: Path) -> None:
    """Grouped bars: one group per category (and overall), one bar per method other than plain."""
    plt = _pyplot()
    cats = [*report["workload"]["categories"], OVERALL]
    methods = [label for label in report["results"] if label != "plain"]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(cats) * max(1, len(methods)) / 3), 4.5))
    width = 0.8 / max(1, len(methods))
    for i, label in enumerate(methods):
        by_cat = report["results"][label]
        values = [(by_cat.get(c) or {}).get("speedup") or 0.0 for c in cats]
        ax.bar([x + (i - (len(methods) - 1) / 2) * width for x in range(len(cats))], values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(cats)), cats, rotation=20, ha="right")
    ax.set_ylabel("speedup over verispec plain (tok/s ratio)")
    ax.set_title(f"{report['model']}, T = {report['settings']['temperature']:g}"
                 + (" (PARTIAL)" if report["partial"] else ""))
    if methods:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "only plain decoding was run", transform=ax.transAxes, ha="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_acceptance(report: dict, path: Path) -> None:
    """P(draft i accepted | proposed), i = 1..k, over all runs, for each drafting method."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    drawn = 0
    for label, by_cat in report["results"].items():
        pos = (by_cat.get(OVERALL) or {}).get("per_position_acceptance") or []
        if pos:
            ax.plot(range(1, len(pos) + 1), pos, marker="o", label=label)
            drawn += 1
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate at position")
    ax.set_ylim(0, 1.05)
    ax.set_title("acceptance by position (all categories)" + (" (PARTIAL)" if report["partial"] else ""))
    if drawn:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no method proposed drafts", transform=ax.transAxes, ha="center")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
