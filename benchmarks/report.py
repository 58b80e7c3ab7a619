"""Plain-text tables of the results (stdout and benchmarks/README.md)."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any


def number(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 1:
        return f"{value:.2f}"
    return f"{value:.3f}"


def render_case(data: dict[str, Any]) -> str:
    header = (
        f"\n== {data['title']}  [{data['case']}, {data.get('seconds', '?')} s, other processes "
        f"used {data.get('foreign_cpu_pct', '?')}% CPU of {(os.cpu_count() or 1) * 100}%]"
    )
    lines = [header]
    for note in data.get("notes", []):
        lines.append(f"   note: {note}")
    rows = [("variant", "median", "min - max", "spread", "n", "unit")]
    for variant, fig in data.get("figures", {}).items():
        rows.append(
            (
                variant,
                number(fig["median"]),
                f"{number(fig['min'])} - {number(fig['max'])}",
                f"{fig['spread_pct']:.0f}%",
                str(fig["n"]),
                fig["unit"],
            )
        )
    for name, ratio in data.get("ratios", {}).items():
        rows.append(
            (
                f"ratio {name}",
                number(ratio["median"]),
                f"{number(ratio['min'])} - {number(ratio['max'])}",
                f"{ratio['spread_pct']:.0f}%",
                str(ratio["n"]),
                "x",
            )
        )
    lines += _table(rows, indent="   ", left=frozenset({0, 5}))
    return "\n".join(lines)


def render_targets(results: dict[str, Any]) -> str:
    rows = [("case", "target", "measured", "goal", "met")]
    for name, data in results.items():
        for target in data.get("targets", []):
            rows.append(
                (
                    name,
                    target["target"],
                    number(target["measured"]),
                    target["goal"],
                    "yes" if target["met"] else "NO",
                )
            )
        if "error" in data:
            rows.append((name, "(case failed)", "-", "-", "NO"))
    return "\n== Targets (issues 6, 13 and 16)\n" + "\n".join(
        _table(rows, indent="   ", left=frozenset({0, 1, 3, 4}))
    )


def _table(
    rows: Sequence[tuple[str, ...]], indent: str = "", left: frozenset[int] = frozenset({0})
) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for row in rows:
        cells = [
            cell.ljust(widths[i]) if i in left else cell.rjust(widths[i])
            for i, cell in enumerate(row)
        ]
        out.append(indent + "  ".join(cells).rstrip())
    return out


def markdown_targets(results: dict[str, Any]) -> str:
    """The targets as a Markdown table (pasted into benchmarks/README.md)."""
    lines = ["| case | target | measured | goal | met |", "| --- | --- | ---: | --- | --- |"]
    for name, data in results.items():
        for target in data.get("targets", []):
            lines.append(
                f"| {name} | {target['target']} | {number(target['measured'])} | "
                f"{target['goal']} | {'yes' if target['met'] else '**no**'} |"
            )
    return "\n".join(lines)
