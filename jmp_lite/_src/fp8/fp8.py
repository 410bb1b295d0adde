"""FP8 recipes and the delayed-scaling state: ``Fp8Recipe``, ``Fp8State`` and their pure update.

An fp8 contraction multiplies each operand by a per-tensor ``scale`` so that its largest magnitude
(``amax``) lands near the format's maximum, saturates (clips) what is still beyond it, and casts to
fp8 (Micikevicius et al., 2022, "FP8 Formats for Deep Learning"). The recipe says which formats and
where the scale comes from:

* ``formats="hybrid"``: E4M3 (``float8_e4m3fn``, max 448, 3 mantissa bits) for the forward operands,
  E5M2 (``float8_e5m2``, max 57344, 2 mantissa bits) for the output gradient; ``"e4m3"``: E4M3 for both.
* ``scaling="current"``: the scale comes from the tensor itself, ``fp8_max / (amax * 2**margin)``.
* ``scaling="delayed"``: the scale comes from the amaxes of earlier steps (NVIDIA TransformerEngine's
  default: a history of 1024 steps, margin 0, ``scale = fp8_max / (max(history) * 2**margin)``).
* ``scaling="block"``: current scaling per tile instead of per tensor: one scale per 1xB tile along the
  contraction of the activations and gradients and per BxB block of the weights (DeepSeek-AI, 2024,
  "DeepSeek-V3 Technical Report": B = 128); ``scaling="mxfp8"``: the OCP Microscaling format, 1x32
  tiles with power-of-two (E8M0) scales. Both live in ``fp8_blocks`` and need no state.

The state of one contraction is an explicit pytree, ``Fp8State``. A contraction never writes it: the
amaxes it observes leave the step as the cotangent (the "gradient") of the state's ``fp8_amax``
field, and ``update_fp8_state`` is the one pure function that turns them into the next state
(documented in docs/fp8.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jmp_lite._src.base import validate

__all__ = [
    "Fp8Recipe",
    "Fp8State",
    "NoFp8ContractionWarning",
    "accumulate_observed",
    "get_fp8_recipe",
    "init_fp8_state",
    "update_fp8_state",
]

FORMATS = ("hybrid", "e4m3")
SCALINGS = ("current", "delayed", "block", "mxfp8")
# Scalings with one scale per tile of the contraction (fp8_blocks) instead of one per tensor.
BLOCK_SCALINGS = ("block", "mxfp8")
BLOCK_SIZE = 128  # DeepSeek-V3's tile: 1x128 activations, 128x128 weights
MX_BLOCK_SIZE = 32  # OCP Microscaling (MX) v1.0: 32 elements share one E8M0 scale
# The tile lengths ``"block"`` accepts: powers of two from 16 to 1024. Each block of the contraction is
# one fp8 GEMM, whose contraction length fp8 tensor cores (and cuBLASLt) want a multiple of 16; powers
# of two tile the power-of-two widths of real layers evenly; past 1024 the per-block float32 promotion
# that is the point of the recipe (DeepSeek-V3: every 128 elements) is gone.
BLOCK_SIZES = (16, 32, 64, 128, 256, 512, 1024)
AMAX_REDUCES = ("max", "most_recent")
# Rows of every per-tensor array in an Fp8State: the two operands, then the output gradient.
ROWS = ("lhs", "rhs", "grad")

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)
# Scales stay within [2**-126, 2**126] so that they and their inverses are normal float32 numbers:
# XLA flushes float32 denormals to zero, which would turn a tiny inverse scale into a zero output.
MIN_SCALE = 2.0**-126
MAX_SCALE = 2.0**126
# Operand dtypes an fp8 contraction quantizes from.
COMPUTE_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16), np.dtype(jnp.float32))

_DEFAULTS: dict[str, Any] = {
    "formats": "hybrid",
    "scaling": "delayed",
    "amax_history": 1024,
    "margin": 0,
    "amax_reduce": "max",
    "block_size": None,
}


def _choice(value: Any, field: str, accepted: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value.strip().lower() not in accepted:
        raise ValueError(
            f"Fp8Recipe.{field} must be one of {', '.join(repr(a) for a in accepted)}; got {value!r}"
        )
    return value.strip().lower()


def _integer(value: Any, field: str, low: int, meaning: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"Fp8Recipe.{field} must be an int >= {low} ({meaning}); got {value!r}")
    return int(value)


def _block_size(value: Any, scaling: str) -> int | None:
    """``block_size`` normalised for ``scaling``: 128 (``"block"``) or 32 (``"mxfp8"``) when unset."""
    if value is None:
        return {"block": BLOCK_SIZE, "mxfp8": MX_BLOCK_SIZE}.get(scaling)
    size = _integer(value, "block_size", 1, "elements per tile along the contraction")
    if scaling == "mxfp8" and size != MX_BLOCK_SIZE:
        raise ValueError(
            f"Fp8Recipe.block_size must be {MX_BLOCK_SIZE} (or unset) for scaling='mxfp8': the OCP MX "
            f"format fixes its block at {MX_BLOCK_SIZE} elements; got {value!r}. Use scaling='block' "
            "for other tile sizes"
        )
    if size not in BLOCK_SIZES:
        raise ValueError(
            f"Fp8Recipe.block_size must be one of {', '.join(map(str, BLOCK_SIZES))} (a power of two from "
            f"{BLOCK_SIZES[0]} to {BLOCK_SIZES[-1]}: each block is one fp8 GEMM, whose contraction length "
            f"fp8 tensor cores want a multiple of 16); got {value!r}. DeepSeek-V3 uses 128, the default"
        )
    return size


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How fp8 contractions quantize: formats, where scales come from, and the history's length.

    A frozen dataclass: immutable, hashable (a valid static argument of ``jax.jit``) and comparable;
    ``repr`` evaluates back to an equal recipe and ``str`` is the ``get_fp8_recipe`` form.

    Args:
        formats: ``"hybrid"`` (E4M3 forward, E5M2 gradients; the usual training recipe) or ``"e4m3"``
            (E4M3 for both).
        scaling: ``"current"`` (scale from the tensor's own amax, every step), ``"delayed"`` (scale
            from the history of earlier amaxes, kept in an ``Fp8State``), ``"block"`` (current
            scaling per tile: one scale per 1 x ``block_size`` tile along the contraction of the
            activations and gradients, per ``block_size`` x ``block_size`` block of the weights;
            DeepSeek-AI, 2024, "DeepSeek-V3 Technical Report") or ``"mxfp8"`` (the OCP Microscaling
            format: 1 x 32 tiles with power-of-two scales). See docs/fp8.md, "Block scaling".
        amax_history: steps of amax history that delayed scaling keeps (TransformerEngine: 1024).
            The other scalings keep only the last amax (and need no state).
        margin: the scale leaves ``2**margin`` of headroom: ``scale = fp8_max / (amax * 2**margin)``
            (per tile under block scalings).
        amax_reduce: how delayed scaling reduces the history to one amax: ``"max"`` over the window
            (TransformerEngine's default) or ``"most_recent"``.
        block_size: the tile length B along the contraction: default 128 for ``"block"`` (a power
            of two from 16 to 1024), always 32 for ``"mxfp8"``; ``None`` (ignored, like
            ``amax_history`` under current scaling) for the per-tensor scalings unless given.

    Example:
        >>> import jmp_lite
        >>> recipe = jmp_lite.Fp8Recipe("hybrid", "delayed", amax_history=16)
        >>> str(recipe)
        'hybrid,delayed,history=16,margin=0,reduce=max'
        >>> recipe
        Fp8Recipe(formats='hybrid', scaling='delayed', amax_history=16, margin=0, amax_reduce='max')
        >>> recipe.forward_dtype, recipe.backward_dtype, recipe.backward_max
        (dtype(float8_e4m3fn), dtype(float8_e5m2), 57344.0)
        >>> jmp_lite.Fp8Recipe("hybrid", "block").block_size
        128
        >>> jmp_lite.Fp8Recipe(formats="e5m2")
        Traceback (most recent call last):
        ...
        ValueError: Fp8Recipe.formats must be one of 'hybrid', 'e4m3'; got 'e5m2'
    """

    formats: str = "hybrid"
    scaling: str = "delayed"
    amax_history: int = dataclasses.field(default=1024, kw_only=True)
    margin: int = dataclasses.field(default=0, kw_only=True)
    amax_reduce: str = dataclasses.field(default="max", kw_only=True)
    block_size: int | None = dataclasses.field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        # validated and normalized once, here; the fields are frozen after
        object.__setattr__(self, "formats", _choice(self.formats, "formats", FORMATS))
        object.__setattr__(self, "scaling", _choice(self.scaling, "scaling", SCALINGS))
        history = _integer(self.amax_history, "amax_history", 1, "steps of amax history")
        object.__setattr__(self, "amax_history", history)
        object.__setattr__(self, "margin", _integer(self.margin, "margin", 0, "doublings of headroom"))
        object.__setattr__(self, "amax_reduce", _choice(self.amax_reduce, "amax_reduce", AMAX_REDUCES))
        object.__setattr__(self, "block_size", _block_size(self.block_size, self.scaling))

    def __repr__(self) -> str:
        # block_size only where it is set, so that the per-tensor recipes read as they always have
        block = "" if self.block_size is None else f", block_size={self.block_size}"
        h, m, r = self.amax_history, self.margin, self.amax_reduce
        return (
            f"Fp8Recipe(formats={self.formats!r}, scaling={self.scaling!r}, "
            f"amax_history={h}, margin={m}, amax_reduce={r!r}{block})"
        )

    @property
    def forward_dtype(self) -> np.dtype:
        """The fp8 dtype of both operands of the forward contraction (``float8_e4m3fn``)."""
        return E4M3

    @property
    def backward_dtype(self) -> np.dtype:
        """The fp8 dtype of the output gradient (``float8_e5m2`` for hybrid, ``float8_e4m3fn`` for e4m3)."""
        return E5M2 if self.formats == "hybrid" else E4M3

    @property
    def forward_max(self) -> float:
        """The largest finite value of ``forward_dtype`` (448)."""
        return float(ml_dtypes.finfo(self.forward_dtype).max)

    @property
    def backward_max(self) -> float:
        """The largest finite value of ``backward_dtype`` (57344 for E5M2, 448 for E4M3)."""
        return float(ml_dtypes.finfo(self.backward_dtype).max)

    @property
    def stateful(self) -> bool:
        """Whether the contractions read their scales from an ``Fp8State`` and report amaxes for the next
        one (``"delayed"``); the other scalings compute each scale from the tensor itself, with no state.

        Example:
            >>> import jmp_lite
            >>> jmp_lite.Fp8Recipe("hybrid", "delayed").stateful
            True
            >>> jmp_lite.Fp8Recipe("hybrid", "block").stateful
            False
        """
        return self.scaling == "delayed"

    @property
    def power_of_two_scales(self) -> bool:
        """Whether scales are powers of two (``"mxfp8"``: the OCP Microscaling format's E8M0 scales)."""
        return self.scaling == "mxfp8"

    @property
    def history_length(self) -> int:
        """Columns of ``Fp8State.fp8_amax_history``: ``amax_history`` when delayed, else 1."""
        return self.amax_history if self.stateful else 1

    @property
    def block_scaled(self) -> bool:
        """Whether scales are per tile (``"block"``, ``"mxfp8"``) rather than per tensor."""
        return self.scaling in BLOCK_SCALINGS

    def replace(self, **changes: Any) -> Fp8Recipe:
        """A copy with some fields changed (validated like the constructor)."""
        unknown = sorted(set(changes) - set(_DEFAULTS))
        if unknown:
            raise TypeError(f"Fp8Recipe has no field(s) {unknown}; fields: {', '.join(_DEFAULTS)}")
        if "scaling" in changes and "block_size" not in changes:
            # a block size left at its scaling's default follows the new scaling's default
            if self.block_size == _block_size(None, self.scaling):
                changes["block_size"] = None
        return dataclasses.replace(self, **changes)

    def __str__(self) -> str:
        h, m, r = self.amax_history, self.margin, self.amax_reduce
        block = "" if self.block_size is None else f",block={self.block_size}"
        return f"{self.formats},{self.scaling},history={h},margin={m},reduce={r}{block}"


_KEYS = {
    "formats": "formats", "format": "formats",
    "scaling": "scaling",
    "history": "amax_history", "amax_history": "amax_history",
    "margin": "margin",
    "reduce": "amax_reduce", "amax_reduce": "amax_reduce",
    "block": "block_size", "block_size": "block_size",
}  # fmt: skip
_BARE = {**{f: "formats" for f in FORMATS}, **{s: "scaling" for s in SCALINGS}}
_GRAMMAR = (
    "expected comma-separated parts: 'hybrid' or 'e4m3' (formats), 'current', 'delayed', 'block' or "
    "'mxfp8' (scaling), history=N (N >= 1), margin=N (N >= 0), reduce=max|most_recent, block=N (N one of "
    f"{', '.join(map(str, BLOCK_SIZES))}); "
    "e.g. 'hybrid,delayed,history=1024,margin=0' or 'hybrid,block,block=128' (unset fields keep their "
    "defaults: hybrid, delayed, history=1024, margin=0, reduce=max, block=128 for block scaling)"
)


def get_fp8_recipe(spec: str) -> Fp8Recipe:
    """Parses an fp8 recipe string (the form ``str(Fp8Recipe)`` prints).

    Grammar (case-insensitive, spaces ignored): comma-separated parts, each field at most once;
    bare ``hybrid``/``e4m3`` set ``formats`` and ``current``/``delayed``/``block``/``mxfp8`` set
    ``scaling``; ``key=value`` with keys ``formats``, ``scaling``, ``history`` (``amax_history``),
    ``margin``, ``reduce`` (``amax_reduce``) and ``block`` (``block_size``). Unset fields keep the
    ``Fp8Recipe`` defaults.

    Example:
        >>> import jmp_lite
        >>> jmp_lite.get_fp8_recipe("hybrid, delayed, history=16")
        Fp8Recipe(formats='hybrid', scaling='delayed', amax_history=16, margin=0, amax_reduce='max')
        >>> r = jmp_lite.get_fp8_recipe("e4m3,current,margin=1")
        >>> jmp_lite.get_fp8_recipe(str(r)) == r
        True
        >>> str(jmp_lite.get_fp8_recipe("hybrid,block,block=64"))
        'hybrid,block,history=1024,margin=0,reduce=max,block=64'

    Raises:
        TypeError: ``spec`` is not a string.
        ValueError: ``spec`` is malformed; the message names the bad part and what is accepted.
    """
    if not isinstance(spec, str):
        raise TypeError(f"get_fp8_recipe expects a str, got {type(spec).__name__}: {spec!r}")
    text = "".join(spec.split()).lower()
    if not text:
        raise ValueError(f"empty fp8 recipe string; {_GRAMMAR}")
    found: dict[str, Any] = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        if not eq:
            field, value = _BARE.get(part), part
            if field is None:
                raise ValueError(f"unknown part {part!r} in fp8 recipe {spec!r}; {_GRAMMAR}")
        else:
            field = _KEYS.get(key)
            if field is None or not value or "=" in value:
                raise ValueError(f"malformed or unknown part {part!r} in fp8 recipe {spec!r}; {_GRAMMAR}")
        if field in found:
            raise ValueError(f"{field} is given twice in fp8 recipe {spec!r}; {_GRAMMAR}")
        if field in ("amax_history", "margin", "block_size"):
            if not (value.isascii() and value.isdigit()):
                raise ValueError(f"{key} must be a non-negative integer in fp8 recipe {spec!r}; {_GRAMMAR}")
            found[field] = int(value)
        else:
            found[field] = value
    if "block_size" in found and "scaling" not in found:
        # "hybrid,block=64" reads as block scaling, but the default scaling is per tensor
        raise ValueError(
            f"fp8 recipe {spec!r} gives a tile length (block={found['block_size']}) but no scaling, and "
            f"the default scaling, {_DEFAULTS['scaling']!r}, has one scale per tensor: add 'block' (or "
            f"'mxfp8'), e.g. 'hybrid,block,block={found['block_size']}'"
        )
    fields = {**_DEFAULTS, **found}
    formats, scaling = fields.pop("formats"), fields.pop("scaling")
    return Fp8Recipe(formats, scaling, **fields)


def as_fp8_recipe(value: Any, what: str = "fp8") -> Fp8Recipe:
    """An ``Fp8Recipe`` from a recipe or its string form; anything else is a clear ``TypeError``."""
    if isinstance(value, Fp8Recipe):
        return value
    if isinstance(value, str):
        return get_fp8_recipe(value)
    raise TypeError(
        f"{what} must be a jmp_lite.Fp8Recipe or a recipe string such as 'hybrid,delayed'; "
        f"got {type(value).__name__}: {value!r}"
    )


def check_compute_dtype(dtype: Any, what: str = "fp8 contraction", result: bool = False) -> np.dtype:
    """The dtype an fp8 contraction quantizes from (or, ``result``, returns); float64 and anything else
    non-16/32-bit refused."""
    dtype = np.dtype(dtype)
    if dtype not in COMPUTE_DTYPES:
        hint = (
            " (fp8 cannot serve a float64 program: turn fp8 off or compute in float32)"
            if dtype == np.dtype(np.float64)
            else ""
        )
        if result:
            why = "the result is the float32 accumulator's, descaled, in a 16- or 32-bit float"
            raise ValueError(f"{what}: must be float32, bfloat16 or float16, got {dtype.name}{hint}; {why}")
        raise ValueError(
            f"{what}: operands must be float32, bfloat16 or float16, got {dtype.name}{hint}; "
            "the contraction quantizes them to fp8 itself"
        )
    return dtype


class NoFp8ContractionWarning(UserWarning):
    """``fp8=`` was asked for, but no contraction of the model reads a weight: nothing runs in fp8.

    Example:
        >>> import warnings, jax.numpy as jnp, jmp_lite
        >>> f = jmp_lite.autocast(jnp.tanh, "compute=bf16", fp8="hybrid,delayed")
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     states = f.init_fp8_state(jnp.ones(3))
        >>> states, caught[0].category is jmp_lite.fp8.NoFp8ContractionWarning
        ({}, True)
    """


class Fp8State(NamedTuple):
    """The state of one fp8 contraction; rows are ``("lhs", "rhs", "grad")`` in every field.

    Attributes:
        fp8_scale: ``(..., 3)`` float32: the multipliers the next step quantizes with
            (``fp8 = saturate(x * scale)``, TransformerEngine's convention; Flax stores the inverse).
            Used by delayed scaling; current scaling records the scale of the last observed amax.
            Block scalings (``"block"``, ``"mxfp8"``) take their per-tile scales from the tiles
            themselves at every step; a state, if given, observes the per-tensor amaxes.
        fp8_amax_history: ``(..., 3, H)`` float32: observed amaxes, newest first (column 0),
            ``H = recipe.history_length``.
        fp8_amax: ``(..., 3)`` float32: the amaxes of the last update. Its cotangent is how a
            contraction reports what it observed (see ``update_fp8_state``).

    Leading ``...`` axes stack the states of several contractions (e.g. the layers of a
    ``lax.scan``). All fields are float32 arrays, so a state saves and restores with orbax and
    ``flax.serialization`` under its field names (the layout of docs/fp8.md).

    A restored state is checked where it is used: fields of another dtype or shape are refused
    (statically, so under ``jax.jit`` too). A scale that is not positive and finite (0, NaN, inf or
    negative: a corrupted checkpoint) is not refused but repaired on use, by the contractions as by
    ``update_fp8_state``: replaced by the scale the row's amax history gives (1 for an empty
    history). Repaired, not refused, because the state usually reaches the contraction traced (inside
    ``autocast``'s and the Flax front-ends' trace, under ``jax.jit``), where Python cannot read its
    values; repairing gives the same output eagerly and jitted, and the same scale the next update
    stores, so the run recovers instead of computing NaN at every step.

    Example:
        >>> import jmp_lite
        >>> state = jmp_lite.fp8.init_fp8_state(jmp_lite.Fp8Recipe(amax_history=4))
        >>> state.fp8_scale.shape, state.fp8_amax_history.shape, state.fp8_amax.shape
        ((3,), (3, 4), (3,))
    """

    fp8_scale: jax.Array
    fp8_amax_history: jax.Array
    fp8_amax: jax.Array


def init_fp8_state(recipe: Fp8Recipe | str, shape: Sequence[int] = ()) -> Fp8State:
    """A fresh ``Fp8State``: scales 1, empty (zero) history, for ``shape`` stacked contractions.

    Example:
        >>> import jmp_lite
        >>> state = jmp_lite.fp8.init_fp8_state("hybrid,delayed,history=8", shape=(2,))
        >>> state.fp8_amax_history.shape
        (2, 3, 8)
    """
    recipe = as_fp8_recipe(recipe, "init_fp8_state's recipe")
    if isinstance(shape, (str, bytes)) or not isinstance(shape, Sequence):
        raise TypeError(
            f"init_fp8_state's shape must be a tuple of whole numbers (the stacked contractions' axes), "
            f"got {shape!r}"
        )
    shape = tuple(
        validate.whole_number(n, f"init_fp8_state's shape[{i}]", low=0) for i, n in enumerate(shape)
    )
    rows = (*shape, len(ROWS))
    return Fp8State(
        fp8_scale=jnp.ones(rows, jnp.float32),
        fp8_amax_history=jnp.zeros((*rows, recipe.history_length), jnp.float32),
        fp8_amax=jnp.zeros(rows, jnp.float32),
    )


def row_maxima(recipe: Fp8Recipe) -> np.ndarray:
    """The format maximum of each row (lhs, rhs, grad) as float32."""
    return np.array([recipe.forward_max, recipe.forward_max, recipe.backward_max], np.float32)


def scale_from_amax(amax: jax.Array, fp8_max: Any, margin: int, fallback: Any) -> jax.Array:
    """``fp8_max / (amax * 2**margin)`` in float32, clipped to ``[2**-126, 2**126]``.

    A zero or non-finite ``amax`` (an all-zero tensor, an overflow) gives ``fallback`` instead.
    """
    amax = jnp.asarray(amax, jnp.float32)
    fp8_max = jnp.asarray(fp8_max, jnp.float32)
    usable = jnp.isfinite(amax) & (amax > 0)
    safe = jnp.where(usable, amax, 1.0)
    # ldexp by -margin is exact, so margin=0 is bit-for-bit fp8_max / amax.
    scale = jnp.ldexp(fp8_max / safe, jnp.int32(-margin))
    scale = jnp.clip(scale, MIN_SCALE, MAX_SCALE)
    return jnp.where(usable, scale, jnp.asarray(fallback, jnp.float32))


def _is_state(x: Any) -> bool:
    return isinstance(x, Fp8State)


def _states(tree: Any, what: str) -> tuple[list[Fp8State], Any]:
    leaves, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_is_state)
    bad = [type(x).__name__ for x in leaves if not _is_state(x)]
    # An empty dict (or list, tuple) is the states of a model that no fp8 contraction reads a weight of
    # (a convolution-only network: init_fp8_state returns {}); None is no states at all.
    if bad or (not leaves and not isinstance(tree, (Mapping, list, tuple))):
        raise TypeError(
            f"{what} must be an Fp8State or a pytree of them (init_fp8_state); "
            + (f"found leaves of type {sorted(set(bad))}" if bad else f"found {tree!r}")
        )
    return leaves, treedef


def _check_shapes(state: Fp8State, observed: Fp8State, recipe: Fp8Recipe, where: str) -> None:
    scale = jnp.shape(state.fp8_scale)
    history = jnp.shape(state.fp8_amax_history)
    if not scale or scale[-1] != len(ROWS) or history[:-1] != scale or jnp.shape(state.fp8_amax) != scale:
        raise ValueError(
            f"update_fp8_state: the state{where} has fields of shapes fp8_scale {scale}, "
            f"fp8_amax_history {history}, fp8_amax {jnp.shape(state.fp8_amax)}; expected (..., 3), "
            "(..., 3, H) and (..., 3) as init_fp8_state makes them"
        )
    if history[-1] != recipe.history_length:
        raise ValueError(
            f"update_fp8_state: the state{where} keeps {history[-1]} step(s) of amax history but the "
            f"recipe {str(recipe)!r} keeps {recipe.history_length}; build the state with this recipe "
            "(init_fp8_state) or restore it with the recipe it was trained with"
        )
    check_field_dtypes(state, f"update_fp8_state: the state{where}")
    if jnp.shape(observed.fp8_amax) != scale:
        raise ValueError(
            f"update_fp8_state: observed{where}.fp8_amax has shape {jnp.shape(observed.fp8_amax)}, the "
            f"state's {scale}; pass the cotangent of this very state (jax.grad with respect to it)"
        )


def _window(history: jax.Array, recipe: Fp8Recipe) -> jax.Array:
    return jnp.max(history, axis=-1) if recipe.amax_reduce == "max" else history[..., 0]


def repaired_scale(state: Fp8State, recipe: Fp8Recipe) -> jax.Array:
    """``state.fp8_scale`` with each scale that is not positive and finite (a corrupted restore) replaced
    by the one its amax history gives (1 where the history is empty or not finite either); a good
    scale comes back bit for bit. Such a scale makes every step non-finite; kept by the skipped steps,
    it would never recover. ``update_fp8_state`` stores the repaired scale, and the contractions
    (``dot_general``, ``fp8_report``) quantize with it, so that a step reading a corrupted state
    computes with the scale the next update will store, eager or traced alike."""
    scale = state.fp8_scale
    usable = jnp.isfinite(scale) & (scale > 0)
    fresh = scale_from_amax(_window(state.fp8_amax_history, recipe), row_maxima(recipe), recipe.margin, 1.0)
    return jnp.where(usable, scale, fresh)


def _repaired(state: Fp8State, recipe: Fp8Recipe) -> Fp8State:
    return state._replace(fp8_scale=repaired_scale(state, recipe))


def check_field_dtypes(state: Fp8State, what: str) -> None:
    """Every field of ``state`` is a float32 array (the dtype ``init_fp8_state`` makes); shapes are
    checked by the caller, with its own message."""
    expected = Fp8State(*(jax.ShapeDtypeStruct(jnp.shape(f), jnp.float32) for f in state))
    fix = "an Fp8State holds float32 arrays (init_fp8_state); restore it without casting its fields"
    validate.arrays_like(state, expected, what, fix=fix)


def _roll(state: Fp8State, amax: jax.Array, recipe: Fp8Recipe) -> Fp8State:
    history = jnp.concatenate([amax[..., None], state.fp8_amax_history[..., :-1]], axis=-1)
    window = _window(history, recipe)
    scale = scale_from_amax(window, row_maxima(recipe), recipe.margin, state.fp8_scale)
    new = Fp8State(fp8_scale=scale, fp8_amax_history=history, fp8_amax=amax)
    # A non-finite amax (an overflowing step) never enters the history: that row keeps its state.
    ok = jnp.isfinite(amax)
    return Fp8State(
        fp8_scale=jnp.where(ok, new.fp8_scale, state.fp8_scale),
        fp8_amax_history=jnp.where(ok[..., None], new.fp8_amax_history, state.fp8_amax_history),
        fp8_amax=jnp.where(ok, new.fp8_amax, state.fp8_amax),
    )


def update_fp8_state(
    state: Any,
    observed: Any,
    recipe: Fp8Recipe | str,
    *,
    axis_name: Any = None,
    finite: Any = None,
) -> Any:
    """The next fp8 state: roll the observed amaxes into the history, compute the next scales.

    ``observed`` is the cotangent of ``state`` from the same step (``jax.grad`` with respect to the
    state, which is what the contractions report their amaxes through; only its ``fp8_amax`` field is
    read), or the ``accumulate_observed`` of several microbatches. It is never a gradient for an
    optimizer. For each state and each row (lhs, rhs, grad):

    1. ``amax = observed.fp8_amax``, max-reduced over ``axis_name`` (``pmap``/``shard_map`` replicas)
       when given, so that every replica computes the same new state;
    2. the history shifts by one column and ``amax`` becomes column 0 (newest first; the oldest
       falls off);
    3. ``scale = fp8_max / (reduce(history) * 2**margin)``, ``reduce`` being the max over the window
       or the newest entry (``recipe.amax_reduce``); a zero or non-finite result keeps the old scale,
       and scales stay within ``[2**-126, 2**126]``;
    4. a non-finite ``amax`` leaves that row unchanged, and ``finite=False`` (for example
       ``LossScalingState.last_grads_finite``, a step that ``loss_scaling`` skipped) leaves every
       state unchanged bit for bit;
    5. except a scale that is not positive and finite (a corrupted checkpoint): it is replaced by the
       scale its amax history gives (1 for an empty history), skipped step or not, so that the run
       recovers instead of skipping every step.

    Args:
        state: an ``Fp8State`` or a pytree of them.
        observed: the matching cotangent tree (same structure).
        recipe: the recipe the contractions ran with (its history length must match the state's).
        axis_name: a ``pmap``/``shard_map`` axis name (or tuple) to max-reduce the amaxes over.
        finite: optional boolean scalar; ``False`` returns ``state`` unchanged.

    Example:
        >>> import jax, jax.numpy as jnp, jmp_lite
        >>> from jmp_lite import fp8
        >>> recipe = jmp_lite.Fp8Recipe("hybrid", "delayed", amax_history=4)
        >>> state = fp8.init_fp8_state(recipe)
        >>> x, w = jnp.full((2, 8), 2.0), jnp.full((8, 3), 0.5)
        >>> loss = lambda w, s: fp8.dot_general(x, w, (((1,), (0,)), ((), ())), recipe=recipe, state=s).sum()
        >>> grads, observed = jax.grad(loss, argnums=(0, 1))(w, state)
        >>> observed.fp8_amax  # |x|, |w| and |d loss / d y| of this step
        Array([2. , 0.5, 1. ], dtype=float32)
        >>> state = fp8.update_fp8_state(state, observed, recipe)
        >>> state.fp8_scale  # 448 / 2, 448 / 0.5, 57344 / 1
        Array([  224.,   896., 57344.], dtype=float32)
    """
    recipe = as_fp8_recipe(recipe, "update_fp8_state's recipe")
    states, treedef = _states(state, "update_fp8_state's state")
    seen, obs_treedef = _states(observed, "update_fp8_state's observed")
    if obs_treedef != treedef:
        raise ValueError(
            "update_fp8_state: observed has a different structure from state; pass the cotangent of "
            f"this very state tree. state: {treedef}, observed: {obs_treedef}"
        )
    for i, (s, o) in enumerate(zip(states, seen)):
        _check_shapes(s, o, recipe, f" #{i}" if len(states) > 1 else "")
    amaxes = [jnp.asarray(o.fp8_amax, jnp.float32) for o in seen]
    if axis_name is not None:
        amaxes = jax.lax.pmax(amaxes, axis_name)  # one all-reduce for the whole tree
    new = [_roll(s, a, recipe) for s, a in zip(states, amaxes)]
    if finite is not None:
        finite = jnp.asarray(finite)
        if finite.shape != () or finite.dtype != jnp.bool_:
            raise TypeError(
                f"update_fp8_state: finite must be a boolean scalar, got {finite.dtype}{list(finite.shape)}"
            )
        new = [
            jax.tree_util.tree_map(lambda n, o: jax.lax.select(finite, n, o), n, s)
            for n, s in zip(new, states)
        ]
    return jax.tree_util.tree_unflatten(treedef, [_repaired(n, recipe) for n in new])


def accumulate_observed(accumulated: Any, observed: Any) -> Any:
    """Combines the observed amaxes of two microbatches: an elementwise max, never a sum.

    Gradient accumulation (``optax.MultiSteps``, a loop over microbatches) sums gradients; the fp8
    observations of those microbatches must be max-combined instead, so that ``k`` microbatches give
    the history one batch of all their examples would. ``accumulated=None`` starts a new
    accumulation. A NaN in either propagates (and ``update_fp8_state`` then keeps that row).

    Example:
        >>> import jax.numpy as jnp
        >>> from jmp_lite import fp8
        >>> a = fp8.init_fp8_state("hybrid,current")._replace(fp8_amax=jnp.array([1.0, 2.0, 3.0]))
        >>> b = a._replace(fp8_amax=jnp.array([4.0, 0.5, 3.0]))
        >>> fp8.accumulate_observed(fp8.accumulate_observed(None, a), b).fp8_amax
        Array([4., 2., 3.], dtype=float32)
    """
    if accumulated is None:
        return observed
    _states(accumulated, "accumulate_observed's accumulated")
    _states(observed, "accumulate_observed's observed")
    if jax.tree_util.tree_structure(accumulated) != jax.tree_util.tree_structure(observed):
        raise ValueError("accumulate_observed: the two observations have different structures")
    expected = jax.tree_util.tree_map(
        lambda a: jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)), accumulated
    )
    validate.arrays_like(
        observed,
        expected,
        "accumulate_observed's observed",
        fix="the expected shapes are accumulated's: combine observations of states built with one "
        "recipe (the last axis of fp8_amax_history is the recipe's amax history length)",
    )
    return jax.tree_util.tree_map(jnp.maximum, accumulated, observed)
