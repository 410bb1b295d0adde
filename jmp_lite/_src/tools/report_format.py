"""A ``PrecisionReport`` read on the host: its ranking, plain-text and ``rich`` tables, dict and JSON."""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import numpy as np

_SHORT = {"float16": "f16", "bfloat16": "bf16", "float32": "f32"}
_FIELDS = (
    "count",
    "max_abs",
    "headroom_bits",
    "overflow",
    "underflow",
    "subnormal",
    "nonfinite",
    "error",
    "onset",
    "noise",
    "abs_error",
)
# A float32 gradient that moves by this fraction of its norm or more when only the rounding of its
# backward pass changes (``precision_report`` runs that pass twice) has fewer reliable bits than either
# 16-bit format keeps (bfloat16: 8): it is rounding noise, and a relative error against it measures
# float32's rounding, not the policy's. An exact zero computed as a sum that cancels is the usual case:
# a key bias shifts a whole softmax row, so its gradient is zero; float32 returns ~1e-9 of noise.
NOISE = 2.0**-4
_COLUMNS = ("max", "room", "over", "under", "subn", "nonfin", "error")
_GRADIENT_COLUMNS = ("max", "room", "over", "under", "subn", "nonfin", "noise", "error")


def host(report: Any) -> dict[str, np.ndarray]:
    """The report's measurements as numpy arrays (a report made under ``jit`` must be returned first)."""
    try:
        out = {f"act_{f}": np.asarray(getattr(report.activations, f), np.float64) for f in _FIELDS}
        out.update({f"grad_{f}": np.asarray(getattr(report.gradients, f), np.float64) for f in _FIELDS})
    except Exception as e:  # a tracer: inside jit
        raise TypeError(
            "PrecisionReport: the table, ranking and JSON read the measured values; return the report "
            "from the jitted function (or jax.device_get it) and call them outside jit"
        ) from e
    return out


def ranked(report: Any) -> list[int]:
    """Group indices worst first (see ``PrecisionReport``): activations that overflow, then activations
    that turned non-finite (both by ``onset``: where it started first), then gradients that overflow,
    then gradients that turned non-finite (the latest ``onset`` first: the backward pass runs in
    reverse), then underflow, then relative error; last the rows with no relative error whose float32
    gradients are rounding noise (``gradients.noise``), by their absolute error."""
    h = host(report)
    under = np.maximum(h["act_underflow"], h["grad_underflow"])
    error = np.nan_to_num(np.maximum(h["act_error"], h["grad_error"]), nan=np.inf)
    absolute = np.nan_to_num(h["grad_abs_error"], nan=np.inf)

    def key(i: int) -> tuple:
        order = report.groups[i].order
        if h["act_overflow"][i] > 0:
            return (0, h["act_onset"][i], order)
        if h["act_nonfinite"][i] > 0:
            return (1, h["act_onset"][i], order)
        if h["grad_overflow"][i] > 0:
            return (2, -h["grad_onset"][i], order)
        if h["grad_nonfinite"][i] > 0:
            return (3, -h["grad_onset"][i], order)
        if under[i] > 0:
            return (4, -under[i], order)
        if error[i] > 0:
            return (5, -error[i], order)
        return (6, -absolute[i], order)  # nothing to compare relatively: float32 noise, or exact

    return sorted(range(len(report.groups)), key=key)


def _number(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return "0" if x == 0 else f"{x:.2g}" if 1e-2 <= abs(x) < 1e4 else f"{x:.1e}"


def percent(x: float) -> str:
    if x == 0:
        return "0"
    return "<0.1%" if x < 1e-3 else f"{100 * x:.1f}%"


def _room(x: float) -> str:
    return "-" if math.isinf(x) and x > 0 else f"{x:+.1f}"


def _error(h: dict[str, np.ndarray], prefix: str, i: int) -> str:
    """The relative error; where every value's float32 reference is noise, ``abs`` and the absolute one."""
    if prefix == "grad" and h["grad_noise"][i] >= 1:
        return f"abs {_number(h['grad_abs_error'][i])}"
    return _number(h[f"{prefix}_error"][i])


def _cells(h: dict[str, np.ndarray], prefix: str, i: int) -> list[str]:
    columns = _GRADIENT_COLUMNS if prefix == "grad" else _COLUMNS
    if h[f"{prefix}_count"][i] == 0:
        return ["-"] * len(columns)
    cells = [
        _number(h[f"{prefix}_max_abs"][i]),
        _room(h[f"{prefix}_headroom_bits"][i]),
        percent(h[f"{prefix}_overflow"][i]),
        percent(h[f"{prefix}_underflow"][i]),
        percent(h[f"{prefix}_subnormal"][i]),
        percent(h[f"{prefix}_nonfinite"][i]),
    ]
    if prefix == "grad":
        cells.append(percent(h["grad_noise"][i]))
    return [*cells, _error(h, prefix, i)]


def short_dtype(names: str) -> str:
    return "+".join(_SHORT.get(n, n) for n in names.split("+"))


def _rows(report: Any, top: int | None) -> tuple[list[list[str]], int]:
    h = host(report)
    order = ranked(report)
    shown = order if top is None else order[:top]
    rows = []
    for rank, i in enumerate(shown, 1):
        g = report.groups[i]
        rows.append([str(rank), g.name, short_dtype(g.dtypes), *_cells(h, "act", i), *_cells(h, "grad", i)])
    return rows, len(order) - len(shown)


def _summary(report: Any) -> list[str]:
    src = report.source
    loss = np.asarray(report.loss, np.float64)
    scale = float(np.asarray(report.loss_scale))
    noise_bound = f"2^{int(math.log2(NOISE))}"
    lines = [
        f"precision report: {src.front_end}, policy {src.policy}"
        + (f", fp8 {src.fp8}" if src.fp8 else "")
        + (f", rules {dict(src.rules)}" if src.rules else ""),
        f"loss: float32 {_number(loss[0])}, checked {_number(loss[1])}; gradients measured x loss scale "
        f"{scale:g}",
        "max: largest |value| in float32; room: doublings left before the dtype's largest value; over/"
        "under/subn: fractions that overflow, flush to zero, turn subnormal in that dtype; nonfin: inf/NaN "
        "in the checked run where float32 is finite; error: relative to float32; noise: gradients whose "
        "float32 value is rounding noise (a second float32 backward pass, rounded differently, moves it by "
        f"{noise_bound} of its norm or more): left out of under, subn and error; where all are, error is "
        "their absolute error (abs) and the row ranks after those with a relative error",
    ]
    unmeasured = getattr(src, "unmeasured", ())
    if unmeasured:
        lines.append(
            f"not measured: {len(unmeasured)} floating arrays closed over inside a loop, branch or "
            f"custom-derivative body ({', '.join(unmeasured[:3])}{', ...' if unmeasured[3:] else ''}): pass "
            "them as arguments to measure their gradients"
        )
    if getattr(src, "fp8_states", 0):
        lines.append(
            f"fp8 scaling state ({src.fp8_states} arrays: amax histories, scales, last amaxes) not measured: "
            "not values a 16-bit run rounds, and their cotangents are the observed amaxes, not gradients"
        )
    return lines


def plain_table(report: Any, top: int | None = 20) -> str:
    """The ranked table as plain text, under a short summary."""
    rows, hidden = _rows(report, top)
    header = ["#", "group", "dtype", *_COLUMNS, *_GRADIENT_COLUMNS]
    cells = [header, *rows]
    widths = [max(len(r[c]) for r in cells) for c in range(len(header))]
    act_start = sum(widths[:3]) + 3 * 2
    act_width = sum(widths[3:10]) + 6 * 2
    band = " " * act_start + "activations".center(act_width) + "  " + "gradients (x loss scale)"
    lines = [*_summary(report), "", band]
    for k, row in enumerate(cells):
        lines.append(
            "  ".join(
                c.rjust(w) if j not in (1, 2) else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))
            ).rstrip()
        )
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    if hidden:
        lines.append(f"... {hidden} more groups (table(top=None) shows all)")
    return "\n".join(lines)


def show(report: Any, top: int | None = 20) -> None:
    """Prints the table: ``rich`` in a terminal when installed, plain text otherwise."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        Console = None  # noqa: N806
    if Console is None or not sys.stdout.isatty():
        print(plain_table(report, top))
        return
    console = Console()
    for line in _summary(report):
        console.print(line, highlight=False)
    table = Table(show_lines=False)
    for name in ("#", "group", "dtype"):
        table.add_column(name, justify="right" if name == "#" else "left")
    for prefix, columns in (("act", _COLUMNS), ("grad", _GRADIENT_COLUMNS)):
        for name in columns:
            table.add_column(f"{prefix} {name}", justify="right")
    rows, hidden = _rows(report, top)
    for row in rows:
        styled = [
            f"[red]{c}[/red]" if c not in ("0", "-") and j in (5, 8, 12, 15) else c for j, c in enumerate(row)
        ]
        styled = [
            f"[yellow]{c}[/yellow]" if c not in ("0", "-") and j in (6, 13) else c
            for j, c in enumerate(styled)
        ]
        table.add_row(*styled)
    console.print(table)
    if hidden:
        console.print(f"... {hidden} more groups (table(top=None) shows all)")


def _plain(x: float) -> float | str:
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else ("inf" if x > 0 else "-inf"))


def to_dict(report: Any) -> dict[str, Any]:
    """The report as plain Python values; groups worst first."""
    h = host(report)
    src = report.source
    loss = np.asarray(report.loss, np.float64)
    groups = []
    for rank, i in enumerate(ranked(report), 1):
        g = report.groups[i]
        entry: dict[str, Any] = {
            "rank": rank,
            "name": g.name,
            "path": g.path,
            "kind": g.kind,
            "instance": getattr(g, "instance", ""),
            "dtypes": g.dtypes,
        }
        for prefix, title in (("act", "activations"), ("grad", "gradients")):
            entry[title] = {f: _plain(float(h[f"{prefix}_{f}"][i])) for f in _FIELDS}
        groups.append(entry)
    hist = np.asarray(report.gradient_histogram)
    bins = np.asarray(report.log2_bins)
    return {
        "front_end": src.front_end,
        "policy": str(src.policy),
        "rules": {getattr(k, "__name__", str(k)): str(v) for k, v in src.rules},
        "fp8": src.fp8,
        "fp8_states": getattr(src, "fp8_states", 0),
        "unmeasured": list(getattr(src, "unmeasured", ())),
        "loss": {"float32": _plain(float(loss[0])), "checked": _plain(float(loss[1]))},
        "loss_scale": _plain(float(np.asarray(report.loss_scale))),
        "gradient_max": _plain(float(np.asarray(report.gradient_max))),
        "recommended_scale": _plain(float(np.asarray(report.recommended_scale))),
        "gradient_log2_histogram": {int(b): float(c) for b, c in zip(bins, hist) if c},
        "groups": groups,
    }


def to_json(report: Any) -> str:
    return json.dumps(to_dict(report), indent=1)
