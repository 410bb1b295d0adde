"""The demo's dataset: Python's own standard-library sources as bytes (offline, no download)."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np


def stdlib_bytes(max_bytes: int) -> np.ndarray:
    """Up to ``max_bytes`` of the standard library's ``.py`` files, in sorted order, as int32."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        chunks.append(path.read_bytes())
        total += len(chunks[-1])
        if total >= max_bytes:
            break
    if total < 50_000:
        raise RuntimeError(f"found only {total} bytes of Python sources under {root}; the demo needs 50 kB")
    return np.frombuffer(b"".join(chunks)[:max_bytes], np.uint8).astype(np.int32)


def pairs(data: np.ndarray, starts: np.ndarray, context: int, ahead: int) -> tuple[np.ndarray, np.ndarray]:
    """``context`` bytes before each start and the ``ahead`` bytes from it: (context, continuation)."""
    before = data[starts[:, None] + np.arange(-context, 0)]
    after = data[starts[:, None] + np.arange(0, ahead)]
    return before, after
