"""side_by_side.py's PNGs: each plan's throughput over the best uniform plan's, and predicted against measured."""

import statistics
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

MIB = 2**20


def png_ratios(rows: list[dict[str, Any]], path: Path) -> None:
    worlds = sorted({r["world"] for r in rows})
    fig, axes = plt.subplots(len(worlds), 1, figsize=(11, 3.5 * len(worlds)), squeeze=False)
    for ax, world in zip(axes[:, 0], worlds, strict=True):
        mine = [r for r in rows if r["world"] == world]
        cells = list(dict.fromkeys((r["shape"], r["budget"]) for r in mine))
        planners = list(dict.fromkeys(r["planner"] for r in mine))
        for i, p in enumerate(planners):
            ys = [
                next(
                    (
                        r["ratio"] or 0
                        for r in mine
                        if (r["shape"], r["budget"]) == c and r["planner"] == p and r["fits"]
                    ),
                    0,
                )
                for c in cells
            ]
            ax.bar([j + i * 0.16 for j in range(len(cells))], ys, width=0.16, label=p)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks([j + 0.32 for j in range(len(cells))], [f"{s}\n{b}" for s, b in cells], fontsize=7)
        ax.set_ylabel("throughput / best uniform")
        ax.set_title(f"{world} gloo workers (0 = does not fit)")
        ax.legend(fontsize=7, ncol=5)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def png_fidelity(rows: list[dict[str, Any]], path: Path) -> None:
    fit = [r for r in rows if r["fits"]]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4.5))
    for ax, pred, meas, unit, scale in (
        (a, "pred_step_s", "step_s", "step ms", 1e3),
        (b, "pred_peak", "peak", "peak MiB", 1 / MIB),
    ):
        xs = [r[pred] * scale for r in fit]
        ys = [(statistics.median(r[meas]) if isinstance(r[meas], list) else r[meas]) * scale for r in fit]
        ax.scatter(xs, ys, s=12)
        top = max(xs + ys)
        ax.plot([0, top], [0, top], "k--", lw=0.8)
        ax.set_xlabel(f"predicted {unit}")
        ax.set_ylabel(f"measured {unit}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
