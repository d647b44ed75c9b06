"""RESULTS.md sections rendered from the planner-only benchmarks' JSON: the paper's setups
(paper_setups.py), the search at 70B (search_70b.py) and search time against units (search_scaling.py).
A section whose JSON is absent is left out."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def _load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.is_file() else None


def _f(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def paper_md(results_dir: Path) -> list[str]:
    rows = _load(results_dir / "paper_setups.json")
    if not rows:
        return []
    out = [
        "## The OSDP paper's setups, predicted (nothing run)",
        "",
        "Command: `python benchmarks/paper_setups.py` (plans only, meta device). `FSDP as the paper wrapped it`: "
        "the paper's FSDP baseline wrapped every operator of at least 1M parameters (fairscale auto_wrap), finer "
        "than our uniform ZeRO-3, whose units are blocks; the nearest plan in our space is ZeRO-3 with every "
        "Linear split k ways (best k shown). Published: OSDP / FSDP throughput from the research code's README, "
        "measured on 8 x RTX TITAN. Gap: what the default search proved for its plan.",
        "",
        "| setup | OSDP plan | micro batch | OSDP samples/s (peak GiB) | gap proved | best uniform (samples/s) "
        "| OSDP / best uniform | FSDP as the paper wrapped it (samples/s) | OSDP / it | published |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        best = r["best_uniform_throughput"]
        fsdp = r["fsdp_like"]
        fsdp_name = f"ZeRO-3 split {fsdp['split']}" if fsdp else "none fits"
        out.append(
            f"| {r['setup']} | {', '.join(r['osdp_mix'])} | {r['micro_batch']} | {r['osdp_throughput']:.2f} "
            f"({r['osdp_peak_gib']:.2f}) | {_f(r['optimality_gap'], '{:.2%}')} | "
            f"{r['best_uniform'] or 'none fits'} ({_f(best)}) | "
            f"{_f(r['osdp_throughput'] / best if best else None, '{:.2f}x')} | "
            f"{fsdp_name} ({_f(fsdp['throughput'] if fsdp else None)}) | "
            f"{_f(r['osdp_throughput'] / fsdp['throughput'] if fsdp else None, '{:.2f}x')} | "
            f"{_f(r['published_ratio'], '{:.2f}x')} |"
        )
    notes = [r for r in rows if r.get("explanation")]
    if notes:
        out += ["", "Where our prediction and the paper disagree:", ""]
        out += [f"- **{r['setup']}**: {r['explanation']}" for r in notes]
    return [*out, ""]


def search_md(results_dir: Path) -> list[str]:
    out: list[str] = []
    big = _load(results_dir / "search_70b.json")
    if big:
        out += [
            "## The default search at 70B",
            "",
            "Command: `python benchmarks/search_70b.py` (recipes/llama-70b.yaml, global batch 512; plans only). "
            "auto is the default `planner.search` (relax and fix, then HiGHS on the whole program only where the "
            "plan is not yet proven within 0.5%); milp solves the exact program toward optimality and stops at "
            "TIME_LIMIT_S (20 s) per micro batch, its gap being what it proved by then. Gap: 1 - the best plan's "
            "samples/s over the bound the search proved; auto / milp: the fastest plan each found. Timings are "
            "wall clock on the shared 2-core machine and move with its load: `load` is the 1-minute load average "
            "as auto started (profiling: the first setup profiles, the others reuse its cache).",
            "",
            "| setup | profiling s | auto s (load) | auto samples/s (peak GiB) | auto gap | milp s | milp samples/s "
            "| milp gap | auto / milp |",
            "|" + "---|" * 9,
        ]
        for r in big:
            a, m = r["auto"], r.get("milp") or {}
            auto_s = f"{a['seconds']:.2f} ({_f(a.get('load_average'), '{:.1f}')})"
            if not a.get("fits"):
                out.append(
                    f"| {r['setup']} | {r['profiling_s']:.1f} | {auto_s} | no plan fits (proven) | - | "
                    f"{_f(m.get('seconds'))} | - | - | - |"
                )
                continue
            out.append(
                f"| {r['setup']} | {r['profiling_s']:.1f} | {auto_s} | {a['throughput']:.2f} "
                f"({a['peak_gib']:.1f}) | {_f(a['optimality_gap'], '{:.2%}')} | {_f(m.get('seconds'))} | "
                f"{_f(m.get('fastest_found'))} | {_f(m.get('optimality_gap'), '{:.2%}')} | "
                f"{_f(r.get('auto_vs_milp'), '{:.4f}')} |"
            )
        out.append("")
    scaling = _load(results_dir / "search_scaling.json")
    if scaling:
        out += [
            "## Search time and memory against units",
            "",
            "Command: `python benchmarks/search_scaling.py` (GPT at hidden 1536, 8 x A100-80GB, seq 1024, bf16, "
            "8 samples per rank, micro batches 1-8, the full option space). Memory: the peak of Python and numpy "
            "allocations during the search (tracemalloc; HiGHS's own is not seen).",
            "",
            "| layers | units | search | seconds | memory MiB | samples/s | gap proved |",
            "|" + "---|" * 7,
        ]
        for r in scaling["rows"]:
            out.append(
                f"| {r['layers']} | {r['units']} | {r['mode']} | {r['seconds']:.2f} | {r['python_peak_mib']:.0f} | "
                f"{_f(r['throughput'])} | {_f(r['optimality_gap'], '{:.2%}')} |"
            )
        out.append("")
    return out
