"""``Policy``: which dtype parameters are stored in, computed in and returned in."""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src.base import dtypes as _dtypes
from jmp_lite._src.base.dtypes import half_dtype

T = TypeVar("T")

_KEYS = {
    "p": "param", "param": "param", "params": "param",
    "c": "compute", "compute": "compute",
    "o": "output", "out": "output", "output": "output",
}  # fmt: skip

# Keras policy names: variables in f32, layers compute and return in half.
_KERAS = {
    "mixed_float16": ("float32", "float16", "float16"),
    "mixed_bfloat16": ("float32", "bfloat16", "bfloat16"),
}


def _cast_floating(tree: T, dtype: np.dtype) -> T:
    def cast(x: Any) -> Any:
        # Same-dtype leaves are returned as-is so no convert op is emitted.
        if _dtypes.is_floating_array(x) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree_util.tree_map(cast, tree)


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class Policy:
    """An immutable (param, compute, output) dtype triple.

    ``param`` is the dtype parameters are stored in (the fp32 "master weights"
    of mixed precision), ``compute`` the dtype a layer's inputs and parameters
    are cast to before its arithmetic, and ``output`` the dtype its results are
    cast to. Casts touch floating numpy/jax arrays only; integers, booleans,
    PRNG keys, ``None``, strings and Python scalars pass through unchanged.

    Example:
        >>> import jax.numpy as jnp, jmp_lite
        >>> policy = jmp_lite.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
        >>> policy.cast_to_compute({"x": jnp.ones(2), "n": 3})["x"].dtype
        dtype(bfloat16)
        >>> str(policy)
        'p=f32,c=bf16,o=f32'

    jmp's names (``param_dtype``, ``compute_dtype``, ``output_dtype`` and
    ``with_output_dtype``) are accepted as aliases, so jmp code runs unchanged.
    """

    param: np.dtype  # dtype parameters are stored in
    compute: np.dtype  # dtype arithmetic runs in
    output: np.dtype  # dtype results are returned in

    def __init__(
        self,
        param: Any = None,
        compute: Any = None,
        output: Any = None,
        *,
        param_dtype: Any = None,
        compute_dtype: Any = None,
        output_dtype: Any = None,
    ) -> None:
        # a custom __init__ for jmp's keyword aliases and dtype parsing; fields stay frozen
        for name, new, old in (
            ("param", param, param_dtype),
            ("compute", compute, compute_dtype),
            ("output", output, output_dtype),
        ):
            if new is not None and old is not None:
                raise TypeError(f"Policy got both {name}= and {name}_dtype=; pass one")
            value = new if new is not None else old
            if value is None:
                raise TypeError(f"Policy is missing the {name} dtype; accepted: {_dtypes.accepted_names()}")
            object.__setattr__(self, name, _dtypes.as_floating_dtype(value, f"Policy.{name}"))
        if self.compute in _dtypes.FP8_DTYPES:
            raise ValueError(
                f"Policy.compute: {self.compute.name} is a storage format; compute must be "
                "one of f16, bf16, f32, f64 (fp8 is accepted for param and output)"
            )

    # jmp spellings.
    param_dtype = property(lambda self: self.param, doc="Alias of ``param`` (jmp).")
    compute_dtype = property(lambda self: self.compute, doc="Alias of ``compute`` (jmp).")
    output_dtype = property(lambda self: self.output, doc="Alias of ``output`` (jmp).")

    def __repr__(self) -> str:
        p, c, o = (_dtypes.dtype_name(d) for d in (self.param, self.compute, self.output))
        return f"Policy(param={p}, compute={c}, output={o})"

    def __str__(self) -> str:
        p, c, o = (_dtypes.dtype_name(d) for d in (self.param, self.compute, self.output))
        return f"p={p},c={c},o={o}"

    def cast_to_param(self, tree: T) -> T:
        """Casts the floating arrays in ``tree`` to ``self.param``."""
        return _cast_floating(tree, self.param)

    def cast_to_compute(self, tree: T) -> T:
        """Casts the floating arrays in ``tree`` to ``self.compute``."""
        return _cast_floating(tree, self.compute)

    def cast_to_output(self, tree: T) -> T:
        """Casts the floating arrays in ``tree`` to ``self.output``."""
        return _cast_floating(tree, self.output)

    def with_param(self, dtype: Any) -> Policy:
        """A copy with a different param dtype."""
        return Policy(dtype, self.compute, self.output)

    def with_compute(self, dtype: Any) -> Policy:
        """A copy with a different compute dtype."""
        return Policy(self.param, dtype, self.output)

    def with_output(self, dtype: Any) -> Policy:
        """A copy with a different output dtype."""
        return Policy(self.param, self.compute, dtype)

    with_param_dtype = with_param
    with_compute_dtype = with_compute
    with_output_dtype = with_output


def get_policy(spec: str) -> Policy:
    """Parses a policy string.

    Grammar (case-insensitive, spaces ignored):

    * ``"params=float32,compute=bfloat16,output=float32"``; keys ``p``/``param``/
      ``params``, ``c``/``compute``, ``o``/``out``/``output``, each at most once.
      Missing keys follow jmp: params default to f32, compute follows params and
      output follows compute (``"c=bf16"`` is ``p=f32,c=bf16,o=bf16``).
    * a bare dtype name (``"bf16"``, ``"half"``, ``"full"``...) sets all three.
    * Keras names ``"mixed_float16"`` and ``"mixed_bfloat16"``: f32 params,
      half compute *and half outputs*, as in Keras, whose mixed-precision layers
      return 16-bit tensors. For float32 logits and losses write the output
      dtype: ``"p=f32,c=bf16,o=f32"``.

    Example:
        >>> import jmp_lite
        >>> jmp_lite.get_policy("params=float32, compute=BF16")
        Policy(param=f32, compute=bf16, output=bf16)
        >>> jmp_lite.get_policy("mixed_bfloat16")  # outputs stay 16-bit, as in Keras
        Policy(param=f32, compute=bf16, output=bf16)
        >>> jmp_lite.get_policy("p=f32,c=bf16,o=f32")  # the same with float32 outputs
        Policy(param=f32, compute=bf16, output=f32)

    Raises:
        TypeError: ``spec`` is not a string.
        ValueError: ``spec`` is malformed; the message names the bad part and
            lists what is accepted.
    """
    if not isinstance(spec, str):
        raise TypeError(f"get_policy expects a str, got {type(spec).__name__}: {spec!r}")
    text = "".join(spec.split()).lower()
    if not text:
        raise ValueError(f"empty policy string; {_GRAMMAR}")
    if text in _KERAS:
        return Policy(*_KERAS[text])
    if "=" not in text:
        try:
            dtype = _dtypes.parse_dtype(text)
        except ValueError:
            raise ValueError(
                f"Unknown dtype {spec!r}: the policy is neither a dtype name nor key=value pairs; {_GRAMMAR}"
            ) from None
        return Policy(dtype, dtype, dtype)
    found: dict[str, np.dtype] = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        if not eq or not key or not value or "=" in value:
            raise ValueError(f"malformed part {part!r} in policy {spec!r}; {_GRAMMAR}")
        field = _KEYS.get(key)
        if field is None:
            raise ValueError(f"unknown key {key!r} in policy {spec!r}; {_GRAMMAR}")
        if field in found:
            raise ValueError(f"{field} is given twice in policy {spec!r}; {_GRAMMAR}")
        try:
            found[field] = _dtypes.parse_dtype(value)
        except ValueError as e:
            raise ValueError(f"unknown dtype for {key} in policy {spec!r}: {e}") from None
    param = found.get("param", np.dtype(jnp.float32))
    compute = found.get("compute", param)
    output = found.get("output", compute)
    return Policy(param, compute, output)


_GRAMMAR = (
    "expected comma-separated key=dtype pairs with keys p/params, c/compute, "
    "o/output (e.g. 'params=float32,compute=bfloat16,output=float32'), a bare "
    "dtype, or one of 'mixed_float16', 'mixed_bfloat16'; dtypes: " + _dtypes.accepted_names()
)


# jmp's map from a floating dtype to its names (documented on the class).
dtype_to_names = _dtypes.DTYPE_TO_NAMES


def cast_to_full(tree: T) -> T:
    """Casts the floating arrays in ``tree`` to float32 (as jmp).

    Example:
        >>> import jax.numpy as jnp, jmp_lite
        >>> jmp_lite.cast_to_full({"x": jnp.ones(2, jnp.bfloat16), "n": 3})["x"].dtype
        dtype('float32')
    """
    return _cast_floating(tree, np.dtype(jnp.float32))


def cast_to_half(tree: T) -> T:
    """Casts the floating arrays in ``tree`` to ``half_dtype()`` (as jmp).

    Example:
        >>> import jax.numpy as jnp, jmp_lite
        >>> jmp_lite.cast_to_half(jnp.ones(2)).dtype == jmp_lite.half_dtype()
        True
    """
    return _cast_floating(tree, np.dtype(half_dtype()))
