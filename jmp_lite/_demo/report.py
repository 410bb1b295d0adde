"""The demo's table: one row per configuration and per trivial baseline, like the tables of Micikevicius
et al., 2018, "Mixed Precision Training"."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any


def _mean_spread(values: Sequence[float], digits: int) -> str:
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def _bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


COLUMNS = (
    ("configuration", "config"),
    ("test acc %", "accuracy"),
    ("test loss", "test_loss"),
    ("final loss", "final_loss"),
    ("skipped", "skipped"),
    ("loss scale", "scale"),
    ("grad underflow", "underflow"),
    ("step time", "time"),
    ("params", "params"),
    ("params+optimizer", "state"),
    ("kept for backward", "backward"),
    ("checkpoint", "checkpoint"),
)


def _step_time(runs: list[dict], base: list[dict] | None) -> str:
    if not base:
        return f"{1e3 * statistics.median(r['step_seconds'] for r in runs):.1f} ms"
    # Median of paired ratios: round i of a configuration against round i of fp32, same seed.
    ratios = [t / b for r, rb in zip(runs, base) for t, b in zip(r["round_seconds"], rb["round_seconds"])]
    return f"{statistics.median(ratios):.2f}x"


def baseline_rows(baselines: dict[str, dict[str, float]]) -> list[dict[str, str]]:
    """Cells of the context-free guesses: accuracy (and a loss where one is defined), ``-`` elsewhere."""
    out = []
    for name, b in baselines.items():
        row = {key: "-" for _, key in COLUMNS}
        row["config"] = f"({name})"
        row["accuracy"] = f"{b['test_accuracy']:.2f}"
        if "test_loss" in b:
            row["test_loss"] = f"{b['test_loss']:.4f}"
        out.append(row)
    return out


def rows(results: dict[str, list[dict]]) -> list[dict[str, str]]:
    """Table cells per configuration; ``results`` maps a configuration to its runs (one per seed)."""
    base = results.get("fp32")
    out = []
    for name, runs in results.items():
        diverged = sum(r["diverged"] for r in runs)
        out.append(
            {
                "config": name,
                "accuracy": _mean_spread([r["test_accuracy"] for r in runs], 2),
                "test_loss": _mean_spread([r["test_loss"] for r in runs], 4),
                "final_loss": "diverged" if diverged else _mean_spread([r["final_loss"] for r in runs], 3),
                "skipped": str(sum(r["skipped_steps"] for r in runs)),
                "scale": f"{runs[-1]['final_loss_scale']:g}",
                "underflow": "-"
                if name == "fp32"
                else f"{100 * statistics.mean(r['underflow_fraction'] for r in runs):.1f}%",
                "time": _step_time(runs, base),
                "params": _bytes(runs[-1]["param_bytes"]),
                "state": f"{runs[-1]['state_bytes_per_param']:.2f} B/param"
                if "state_bytes_per_param" in runs[-1]
                else "-",
                "backward": _bytes(runs[-1]["backward_bytes"]) if "backward_bytes" in runs[-1] else "-",
                "checkpoint": _bytes(runs[-1]["checkpoint_bytes"]),
            }
        )
    return out


def table(results: dict[str, list[dict]], baselines: dict[str, dict[str, float]] | None = None) -> str:
    """The plain-text table: the configurations, then the baselines in parentheses."""
    body = rows(results) + baseline_rows(baselines or {})
    cells = [[h for h, _ in COLUMNS]] + [[r[k] for _, k in COLUMNS] for r in body]
    widths = [max(len(row[i]) for row in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def underflow_lines(report: Any, top: int = 5) -> str:
    """The groups of a ``jmp_lite.precision_report`` whose gradients underflow most (the demo's float16
    run without loss scaling, at initialization), and the loss scale range it suggests."""
    from jmp_lite.doctor import suggest_rules

    groups = report.to_dict()["groups"]
    hit = [g for g in groups if g["gradients"]["underflow"] > 0]
    hit.sort(key=lambda g: (-g["gradients"]["underflow"], -g["gradients"]["subnormal"]))
    lines = [
        f"Gradients that underflow in {report.source.policy} without loss scaling, per layer (at step 0):"
    ]
    width = max((len(g["name"]) for g in hit[:top]), default=0)
    for g in hit[:top]:
        grads = g["gradients"]
        lines.append(
            f"  {g['name']:<{width}}  {_percent(grads['underflow'])} flush to zero, "
            f"{_percent(grads['subnormal'])} subnormal"
        )
    if not hit:
        lines.append("  none")
    scale = suggest_rules(report).loss_scale
    if scale is not None:
        lines.append(
            f"  a loss scale between {scale[0]:g} and {scale[1]:g} keeps them (jmp-lite doctor explains)"
        )
    return "\n".join(lines)


def _percent(fraction: float) -> str:
    return f"{100 * fraction:5.1f}%" if fraction >= 1e-3 or fraction == 0 else " <0.1%"
