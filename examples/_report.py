"""Shared by the Flax examples: progress bars, seeds' statistics and the results table."""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable
from pathlib import Path

try:
    from tqdm.auto import tqdm
except ImportError:  # the progress bar is a nicety; training does not need it
    tqdm = None


def progress(steps: int, desc: str) -> Iterable[int]:
    if tqdm is None:
        return range(steps)
    return tqdm(range(steps), desc=desc, leave=False, dynamic_ncols=True, mininterval=0.5)


def set_postfix(bar: object, **values: object) -> None:
    if hasattr(bar, "set_postfix"):
        bar.set_postfix(values, refresh=False)


def mean_spread(values: list[float], digits: int = 2) -> str:
    """``mean ± sample standard deviation`` (just the value for one seed)."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def table(rows: list[dict], columns: list[tuple[str, str]]) -> str:
    """A plain-text table; ``columns`` are (header, key) pairs."""
    cells = [[h for h, _ in columns]] + [[str(r[k]) for _, k in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2))
        print(f"results written to {path}")
