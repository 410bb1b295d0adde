"""What holds the memory of a compiled program: the temporaries live at the peak of XLA's heap.

``memory_analysis()`` gives one number for a program's temporaries. Which values make it up is in XLA's
own account of the program, written when it compiles with ``xla_dump_to``: the buffer assignment (each
temporary's size and which heap allocation holds it) and the live ranges (each value's first and last
step in the schedule). ``live_at_peak`` reads the two, finds the step where the live temporaries sum
highest, and returns those values, largest first, each with the JAX operation that made it. XLA:TPU,
XLA:GPU and XLA:CPU write both files.
"""

from __future__ import annotations

import collections
import glob
import os
import re
from typing import NamedTuple

__all__ = ["LiveValue", "by_operation", "live_at_peak"]


class LiveValue(NamedTuple):
    """One temporary live at the peak.

    Attributes:
        bytes: its size in the heap.
        shape: XLA's dtype and dimensions (``"bf16[8,1024,50257]"``).
        where: the JAX operation that made it (its ``op_name`` with the named scopes), ``""`` where XLA
            made it (a copy, a buffer of its own).
        name: the HLO value (``"fusion.3597{2}"``).
    """

    bytes: int
    shape: str
    where: str
    name: str


_ALLOCATION = re.compile(r"^allocation (\d+): size \d+, (.*)$")
_VALUE = re.compile(r"^ value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")
_RANGE = re.compile(r"^\s+(\S+\{[\d,]*\}):(\d+)-(\d+)$", re.M)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*$", re.M)
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FIRST_OPERAND = re.compile(r" [\w\-]+\(%([\w.\-]+)")


def _origins(hlo: str) -> dict[str, str]:
    """Each instruction's ``op_name``; one without (a copy XLA inserted, a memory-space prefetch)
    takes its first operand's, a few hops up."""
    named, first = {}, {}
    for m in _INSTRUCTION.finditer(hlo):
        line = m.group(0)
        op = _OP_NAME.search(line)
        if op:
            named[m.group(1)] = op.group(1)
        operand = _FIRST_OPERAND.search(line.split(" = ", 1)[1])
        if operand:
            first[m.group(1)] = operand.group(1)
    out = {}
    for name in first.keys() | named.keys():
        hop = name
        for _ in range(4):
            if hop in named or hop not in first:
                break
            hop = first[hop]
        out[name] = named.get(hop, "")
    return out


_ASSIGNMENT = "after_optimizations-buffer-assignment.txt"


def _dumped(directory: str) -> str:
    """The file prefix of the program in ``directory`` (where XLA dumped several, the largest)."""
    found = glob.glob(os.path.join(directory, f"*{_ASSIGNMENT}"))
    if not found:
        raise FileNotFoundError(
            f"live_at_peak: no '*{_ASSIGNMENT}' in {directory}: compile with "
            "compiler_options={'xla_dump_to': directory}"
        )
    return max(found, key=os.path.getsize)[: -len(_ASSIGNMENT)]


def _temporaries(text: str) -> list[tuple[str, int, str, tuple[int, int]]]:
    """(value, bytes, shape, (allocation, offset)) of every value in the main memory's heaps of
    temporaries."""
    out, inside, allocation = [], False, 0
    for line in text.splitlines():
        header = _ALLOCATION.match(line)
        if header:
            inside = "preallocated-temp" in header.group(2) and "color" not in header.group(2)
            allocation = int(header.group(1))
            continue
        value = _VALUE.match(line) if inside else None
        if value:
            name = value.group(1) if "{" in value.group(1) else value.group(1) + "{}"
            shape = value.group(4)
            shape = "tuple" if shape.startswith("(") else shape.split("{")[0]
            out.append((name, int(value.group(2)), shape, (allocation, int(value.group(3)))))
    return out


def live_at_peak(directory: str) -> tuple[LiveValue, ...]:
    """The temporaries live at the peak of the heap of the program XLA dumped into ``directory``
    (``compiler_options={"xla_dump_to": directory}``; where it holds several programs, the largest),
    largest first. Their sum is at most the heap XLA allocates (``temp_bytes``): the rest is
    fragmentation.
    """
    prefix = _dumped(directory)
    with open(prefix + _ASSIGNMENT) as f:
        temporaries = _temporaries(f.read())
    with open(prefix + "after_optimizations-live-range.txt") as f:
        ranges = {m.group(1): (int(m.group(2)), int(m.group(3))) for m in _RANGE.finditer(f.read())}
    with open(prefix + "after_optimizations.txt") as f:
        where = _origins(f.read())
    # Values at one offset of one heap whose lives overlap are one buffer under several names (an
    # in-place update, a bitcast): counted once, for as long as any of them lives.
    at_offset: dict[tuple[int, int], list] = collections.defaultdict(list)
    for name, size, shape, place in temporaries:
        if name in ranges:
            at_offset[place].append((*ranges[name], size, name, shape))
    buffers: list[list] = []  # [start, end, bytes, the values (start, end, bytes, name, shape)]
    for spans in at_offset.values():
        spans.sort()
        current = None
        for span in spans:
            if current is not None and span[0] <= current[1]:
                current[1], current[2] = max(current[1], span[1]), max(current[2], span[2])
                current[3].append(span)
            else:
                current = [span[0], span[1], span[2], [span]]
                buffers.append(current)
    change: dict[int, int] = collections.defaultdict(int)
    for start, end, size, _ in buffers:
        change[start] += size
        change[end + 1] -= size
    live, peak, at = 0, -1, 0
    for step in sorted(change):
        live += change[step]
        if live > peak:
            peak, at = live, step
    values = []
    for start, end, size, spans in buffers:
        if start <= at <= end:
            # named after the value that holds the buffer at the peak (the latest to start)
            holding = max((s for s in spans if s[0] <= at <= s[1]), default=spans[-1])
            values.append(LiveValue(size, holding[4], where.get(holding[3].split("{")[0], ""), holding[3]))
    return tuple(sorted(values, key=lambda v: (-v.bytes, v.name)))


def by_operation(values: tuple[LiveValue, ...]) -> list[tuple[int, int, str, str]]:
    """``values`` grouped by shape and operation: ``(bytes, count, shape, where)``, largest first. Numbered
    module names match any number (a model's layers repeat: the twelve blocks' ``bf16[8,1024,3072]``
    MLP activations are one line, ``Block_*/Dense_*``)."""
    groups: dict[tuple[str, str], list[int]] = collections.defaultdict(lambda: [0, 0])
    for v in values:
        where = re.sub(r"_\d+/", "_*/", v.where)  # Block_3/... and Block_7/...: one line
        group = groups[(v.shape, where)]
        group[0] += v.bytes
        group[1] += 1
    return sorted(((b, n, s, w) for (s, w), (b, n) in groups.items()), key=lambda g: (-g[0], g[2], g[3]))
