"""The one protocol of jmp_lite's reports: ``table()`` (the readable text), ``to_dict()`` (the same facts
as JSON-ready values) and ``str()`` (the table).

Every report follows it: ``SkipReport``, ``GradientReport``, ``Fp8Report``, ``ResidualBytes``,
``StateBytes``, ``Explanation``, ``PrecisionReport``, ``CompiledReport`` and ``Plan``, so a script can
print, log or save any of them the same way (``json.dumps(report.to_dict())``).

Example:
    >>> import json, jmp_lite
    >>> from jmp_lite._src.base.reports import Report
    >>> report = jmp_lite.SkipReport(("dense/kernel",), 1, 1, False)
    >>> isinstance(report, Report), json.dumps(report.to_dict()["paths"])
    (True, '["dense/kernel"]')
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

__all__ = ["Report", "plain"]


@runtime_checkable
class Report(Protocol):
    """A report: its readable table, its facts as JSON-ready values, and ``str()`` of the table."""

    def table(self) -> str: ...

    def to_dict(self) -> dict[str, Any]: ...

    def __str__(self) -> str: ...


def plain(value: Any) -> Any:
    """``value`` as JSON-ready values: arrays and NumPy scalars as Python numbers (lists for arrays of
    more than one element), named tuples and dataclasses as dicts, tuples as lists, keys as strings, and
    other objects (a policy, a recipe, a dtype) by their ``str``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return {k: plain(v) for k, v in value._asdict().items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "dtype") and hasattr(value, "shape"):  # a jax or numpy array, or a numpy scalar
        array = np.asarray(value)
        return array.item() if array.size == 1 else array.tolist()
    return str(value)
