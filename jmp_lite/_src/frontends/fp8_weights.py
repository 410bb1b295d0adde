"""What the front-ends share for fp8: the ``fp8=`` argument, and the weights fp8 contractions read.

``autocast``, Linen's and NNX's ``apply_policy`` take ``fp8=`` (a ``jmp_lite.Fp8Recipe`` or its string
form) and give it to the engine as the recipe of their root ``Scope`` (module rules open scopes without
one: a rule opts a module out). Delayed scaling needs one ``Fp8State`` per weight an fp8 contraction
reads; ``discover`` finds those weights by tracing the model once, abstractly, with
``engine.Context.fp8_weights`` set, and counts how many contractions read each (a state drives one).
"""

from __future__ import annotations

import collections
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_lite._src.engine import engine
from jmp_lite._src.fp8.fp8 import Fp8Recipe, Fp8State, NoFp8ContractionWarning, as_fp8_recipe

KeyPath = tuple[Any, ...]
_F64 = np.dtype(np.float64)


def check_fp8(fp8: Any, what: str, accumulate: bool = True) -> Fp8Recipe | None:
    """The recipe of an ``fp8=`` argument (``None``: fp8 off); refuses ``accumulate=False`` (an fp8
    contraction always accumulates in float32)."""
    if fp8 is None:
        return None
    recipe = as_fp8_recipe(fp8, f"{what}'s fp8")
    if not accumulate:
        raise ValueError(
            f"{what}: fp8 contractions always accumulate in float32, so fp8={str(recipe)!r} cannot be "
            "combined with accumulate=False; drop one of the two"
        )
    return recipe


def refuse_float64(tree: Any, what: str) -> None:
    """A clear error for a float64 array in ``tree``: the engine leaves float64 values alone, so a
    contraction reading one would silently not run in fp8."""
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and np.dtype(x.dtype) == _F64:
            raise ValueError(
                f"{what}: the argument at {jax.tree_util.keystr(path) or 'the top'} is float64; fp8 "
                "contractions have no place in a float64 program: pass float32 (or 16-bit) arrays, "
                "or turn fp8 off"
            )


def is_state(x: Any) -> bool:
    return isinstance(x, Fp8State)


def is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))  # what the engine traces


class _Uses(set):
    """The set ``engine.Context.fp8_weights`` takes, also counting how many contractions read each weight."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def add(self, index: Any) -> None:
        self.counts[index] += 1
        super().add(index)


def discover(run: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with each array replaced by the number of fp8 contractions reading it in
    ``run(*args, **kwargs)`` (an ``engine.transform``'ed function whose fp8 recipe uses current
    scaling), and every other leaf by ``None``.

    Traced once with ``jax.eval_shape`` (nothing runs); the array leaves become the trace's arguments,
    as the engine sees them, so a program the engine has cached is evaluated (and counted) again.
    """
    leaves, treedef = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(leaves) if is_array(x)]

    def call(*xs: Any) -> Any:
        full = list(leaves)
        for i, x in zip(dynamic, xs):
            full[i] = x
        a, k = jax.tree_util.tree_unflatten(treedef, full)
        return run(*a, **k)

    uses = _Uses()
    with engine.entering(fp8_weights=uses):
        jax.eval_shape(call, *[leaves[i] for i in dynamic])
    counts = [None] * len(leaves)
    for k, i in enumerate(dynamic):
        counts[i] = uses.counts.get(k, 0)
    return jax.tree_util.tree_unflatten(treedef, counts)


def warn_if_unused(uses: Mapping[Any, int], what: str, stacklevel: int = 1) -> None:
    """Warns when discovery found no weight an fp8 contraction reads (``uses`` is empty): the model
    then runs exactly as without ``fp8=`` (a convolution-only network), which the user should hear
    of rather than believe their model trains in fp8. The model still runs: it is not wrong, and a
    model with an optional attention head may have no contraction in one configuration.
    ``stacklevel``: the frame the warning names, counted from this function's caller (1)."""
    if not uses:
        warnings.warn(
            f"{what}(fp8=...): no contraction of this model reads a weight, so nothing runs in fp8: "
            "only dot_general/einsum contractions with a parameter operand do (Dense, Einsum, attention "
            "projections); convolutions and products of two activations stay 16-bit (docs/fp8.md). "
            "The model runs as it would without fp8= (delayed scaling keeps no state that changes)",
            NoFp8ContractionWarning,
            stacklevel=stacklevel + 1,
        )


def check_one_use(uses: Mapping[str, int], what: str, stacklevel: int = 2) -> None:
    """Checks the weights delayed-scaling discovery found: refuses a weight read by several fp8
    contractions (JAX adds the cotangents of a value used twice, so one state would observe the sum
    of their amaxes), and warns when there is none (``warn_if_unused``; ``stacklevel`` counts from
    this function's caller, whose own caller it names by default)."""
    warn_if_unused(uses, what, stacklevel + 1)
    shared = {name: n for name, n in uses.items() if n > 1}
    if shared:
        listed = ", ".join(f"{name!r} ({n} contractions)" for name, n in sorted(shared.items()))
        raise ValueError(
            f"{what}: with delayed fp8 scaling each weight drives one fp8 contraction (one Fp8State), but "
            f"{listed} is read by several (a tied or reused weight). Opt the module of all but one use "
            "out of fp8 with a rule (rules={'<its path>': policy}), or use current scaling"
        )


def key_name(key: Any) -> Any:
    """A ``jax.tree_util`` path entry as the dict key or attribute name it stands for."""
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return getattr(key, attr)
    return key


def used(counts: Any) -> dict[KeyPath, int]:
    """``{path: n}`` of the leaves of a ``discover`` count tree that fp8 contractions read (``n > 0``)."""
    found = jax.tree_util.tree_flatten_with_path(counts)[0]
    return {tuple(key_name(k) for k in path): n for path, n in found if n}


def path_name(path: KeyPath) -> str:
    """A ``jax.tree_util`` key path as a parameter name: ``"Dense_0/kernel"``."""
    return "/".join(str(key_name(k)) for k in path)


def names(tree: Any, leaf: Callable[[Any], bool] | None = None) -> list[str]:
    """The ``path_name`` of every leaf of ``tree`` (``leaf`` says what a leaf is)."""
    return [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=leaf)[0]]


def state_roles(name: str) -> Any:
    """The engine roles of the fields of the ``Fp8State`` of the parameter ``name``."""
    return Fp8State(*(engine.Fp8StateField(name, field) for field in Fp8State._fields))


def by_name(states: Any, what: str) -> dict[str, Fp8State]:
    """``{"Dense_0/kernel": Fp8State}`` of a tree of fp8 states in the one shape all front-ends use:
    nested mappings by parameter path, an ``Fp8State`` at each weight an fp8 contraction reads
    (``{"Dense_0": {"kernel": state}}``). A key holding ``/`` names a path too (``{"0/w1": state}``, the
    flat form autocast used to return), so both give the same names. Any other leaf is refused."""
    found: dict[str, Fp8State] = {}
    for path, node in flat(states, lambda x: is_state(x) or not isinstance(x, Mapping)):
        where = "/".join(map(str, path))
        if not is_state(node):
            raise TypeError(
                f"{what}: fp8 states are nested dicts by parameter path with an Fp8State at each weight "
                f"(as init_fp8_state makes them); found {type(node).__name__} at {where or 'the top'!r}"
            )
        found[where] = node
    return found


def nest(items: Mapping[KeyPath, Any]) -> dict:
    """``{("a", "b"): x}`` as ``{"a": {"b": x}}``."""
    out: dict = {}
    for path, value in items.items():
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def flat(tree: Any, leaf: Callable[[Any], bool] = is_state, prefix: KeyPath = ()) -> Iterator[tuple]:
    """``(path, value)`` of the leaves of nested mappings, in sorted key order."""
    if leaf(tree):
        yield prefix, tree
    elif isinstance(tree, Mapping):
        for key in sorted(tree, key=str):
            yield from flat(tree[key], leaf, (*prefix, key))
