"""Reading a compiled XLA program (``compiled.as_text()``, HLO text): its instructions with their
result types, operands, called computations and attributes, and the sizes of those types.

Only what the compiled-program report needs; the text is XLA's and stable enough for that: one
instruction per line, ``%name = TYPE opcode(operands), attribute=..., ...``, inside computation blocks.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator

__all__ = ["Instruction", "Shape", "instructions", "shapes_of"]

# bits per element of XLA's primitive types (sub-byte types round up per element here, as XLA stores them)
_BITS = {
    "pred": 8, "s2": 8, "u2": 8, "s4": 8, "u4": 8, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "s32": 32,
    "u32": 32, "s64": 64, "u64": 64, "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f4e2m1fn": 8, "f8e3m4": 8, "f8e4m3": 8, "f8e4m3fn": 8, "f8e4m3fnuz": 8, "f8e4m3b11fnuz": 8,
    "f8e5m2": 8, "f8e5m2fnuz": 8, "f8e8m0fnu": 8, "token": 0,
}  # fmt: skip
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_LINE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition|branch_computations)=\{?([%\w.\-, ]+)\}?")


@dataclasses.dataclass(frozen=True)
class Shape:
    """One array of an HLO type: ``dtype`` (XLA's name: ``bf16``, ``f32``, ``f8e4m3fn``) and ``dims``."""

    dtype: str
    dims: tuple[int, ...]

    @property
    def bytes(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        return n * _BITS.get(self.dtype, 32) // 8


def shapes_of(type_text: str) -> tuple[Shape, ...]:
    """The arrays of an HLO type (a tuple type gives each of its elements), layouts ignored.

    Example:
        >>> from jmp_lite._src.tools.hlo_text import shapes_of
        >>> [(s.dtype, s.dims, s.bytes) for s in shapes_of("(bf16[8,128]{1,0}, u32[]{:S(2)})")]
        [('bf16', (8, 128), 2048), ('u32', (), 4)]
    """
    # layouts ("{1,0:T(8,128)}") hold no brackets of the form dtype[...], so every match is an array
    return tuple(
        Shape(m.group(1), tuple(int(d) for d in m.group(2).split(",") if d))
        for m in _ARRAY.finditer(type_text)
        if m.group(1) in _BITS
    )


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One instruction of the compiled program.

    Attributes:
        name: its name (unique in the module).
        opcode: XLA's opcode (``dot``, ``convolution``, ``all-gather``, ``custom-call``, ``fusion``...).
        shapes: the arrays of its result type.
        operands: the names of its operands.
        attributes: the rest of the line after the operands (``dim_labels=...``, ``metadata={...}``).
        computation: the computation it belongs to.
    """

    name: str
    opcode: str
    shapes: tuple[Shape, ...]
    operands: tuple[str, ...]
    attributes: str
    computation: str

    def attribute(self, key: str) -> str | None:
        """The text of ``key=...`` (up to its closing brace or the next comma), or ``None``."""
        at = re.search(rf"(?:^|[ ,]){re.escape(key)}=", self.attributes)
        if at is None:
            return None
        rest = self.attributes[at.end() :]
        if rest.startswith("{"):
            return rest[1 : _closing(rest, 0, "{", "}")]
        if rest.startswith('"'):
            end = rest.find('"', 1)
            return rest[1:end]
        return re.split(r",\s", rest, maxsplit=1)[0]

    @property
    def op_name(self) -> str:
        """The JAX operation it came from (``metadata={op_name=...}``), or ``""``."""
        meta = re.search(r'op_name="([^"]*)"', self.attributes)
        return meta.group(1) if meta else ""

    @property
    def called(self) -> tuple[str, ...]:
        """The computations it calls (a fusion's, a loop's body, a reduction's)."""
        found = []
        for group in _CALLS.findall(self.attributes):
            found += [c.strip().lstrip("%") for c in group.split(",") if c.strip()]
        return tuple(found)


def _closing(text: str, start: int, open_: str, close: str) -> int:
    depth = 0
    for i in range(start, len(text)):
        if text[i] == open_:
            depth += 1
        elif text[i] == close:
            depth -= 1
            if depth == 0:
                return i
    return len(text)


def _parse(line: str, computation: str) -> Instruction | None:
    head = _LINE.match(line)
    if head is None:
        return None
    rest = line[head.end() :]
    if rest.startswith("("):  # a tuple type
        end = _closing(rest, 0, "(", ")")
        type_text, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        type_text, _, rest = rest.partition(" ")
    opcode = re.match(r"([\w\-]+)\(", rest)
    if opcode is None:
        return None
    open_at = opcode.end() - 1
    close_at = _closing(rest, open_at, "(", ")")
    operands = tuple(_OPERAND.findall(rest[open_at + 1 : close_at]))
    attributes = rest[close_at + 1 :].lstrip(", ")
    return Instruction(
        head.group(1), opcode.group(1), shapes_of(type_text), operands, attributes, computation
    )


def instructions(hlo: str) -> Iterator[Instruction]:
    """Every instruction of an HLO module's text, computation by computation.

    Example:
        >>> from jmp_lite._src.tools.hlo_text import instructions
        >>> text = '''ENTRY %main (a: bf16[2,3], b: bf16[3,4]) -> f32[2,4] {
        ...   %a = bf16[2,3]{1,0} parameter(0)
        ...   %b = bf16[3,4]{1,0} parameter(1)
        ...   ROOT %dot = f32[2,4]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
        ... }'''
        >>> [(i.opcode, i.operands, i.attribute("lhs_contracting_dims")) for i in instructions(text)][-1]
        ('dot', ('a', 'b'), '1')
    """
    computation = ""
    for line in hlo.splitlines():
        stripped = line.strip()
        if (
            stripped.endswith("{")
            and (stripped.startswith("%") or stripped.startswith("ENTRY"))
            and " = " not in stripped
        ):
            computation = stripped.removeprefix("ENTRY").strip().split(" ")[0].lstrip("%")
            continue
        if stripped == "}" or not stripped:
            continue
        found = _parse(line, computation)
        if found is not None:
            yield found
