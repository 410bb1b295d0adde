"""The roles of a transformed function's arguments (``engine.transform(inputs=)``): parameters and the
fields of their fp8 states; and the protocol through which a front-end's model describes itself to the
tools (``ModelUnderPolicy``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax

from jmp_lite._src.base.policy import Policy


class ModelUnderPolicy(NamedTuple):
    """What a front-end's model says of itself to the tools that run it again under other engine options
    (``precision_report``, ``explain``): the protocol is a method ``__jmp_lite_model__()`` returning this.
    The tools read nothing else of the model: no private attribute, no front-end module."""

    kind: str  # "linen" or "nnx": the front-end's name
    name: str  # the model class's name, the root of its module paths
    policy: Policy
    rules: tuple  # ((regex pattern or module class, Policy), ...), as apply_policy was given them
    fp8: Any  # its Fp8Recipe, or None
    # variant(policy=None, **engine options) -> the model's call under them (every module under
    # ``policy`` when given: a float32 reference keeps the same program)
    variant: Callable[..., Callable[..., Any]]
    # roles(*args, **kwargs) -> the call's argument roles, a pytree prefix of (args, kwargs):
    # Param(name=<parameter path>) for a parameter, Fp8StateField for fp8 scaling state, None otherwise
    roles: Callable[..., Any] | None = None


def model_under_policy(obj: Any) -> ModelUnderPolicy | None:
    """The protocol's answer for a front-end model, or for its bound ``apply``; None for anything else."""
    owner = getattr(obj, "__self__", obj)
    describe = getattr(type(owner), "__jmp_lite_model__", None)
    return None if describe is None else describe(owner)


class Param(NamedTuple):
    """The role of a parameter argument (``transform(inputs=)``): its uses read it in ``dtype`` (its
    module's compute dtype; ``None``: as it is) and fp8 contractions may read it; ``name`` ties it to
    its fp8 state (``Fp8StateField``)."""

    dtype: Any = None
    name: str | None = None


class Fp8StateField(NamedTuple):
    """The role of one field (``"fp8_scale"``, ...) of the ``Fp8State`` of the parameter ``name``."""

    name: str
    field: str


def _is_role(x: Any) -> bool:
    return x is None or isinstance(x, (Param, Fp8StateField))


class Inputs(NamedTuple):
    """The roles of the array arguments, one per argument, as the engine reads them."""

    casts: tuple  # per argument: the dtype a parameter's uses read (its module's compute dtype), or None
    weights: tuple  # per argument: a parameter an fp8 contraction may read
    fp8_states: Mapping[int, tuple[int, ...]] = {}  # parameter -> the arguments of its Fp8State fields


def spread_roles(roles: Any, arguments: tuple) -> list:
    """The role of each leaf of ``arguments`` (``(args, kwargs)``), from a pytree of roles that is a
    prefix of it: a role holds for every leaf below it; ``None`` is a plain argument."""
    try:
        spread = jax.tree_util.tree_map(
            lambda role, sub: [role] * len(jax.tree_util.tree_leaves(sub)), roles, arguments, is_leaf=_is_role
        )
    except ValueError as e:
        raise ValueError(f"jmp_lite: the input roles do not match the arguments' structure: {e}") from None
    lists = jax.tree_util.tree_leaves(spread, is_leaf=lambda x: isinstance(x, list))
    return [r for rs in lists for r in rs]


def inputs_of(roles: Any, arguments: tuple, dynamic: Sequence[int]) -> Inputs:
    """``Inputs`` of the array leaves ``dynamic`` of ``arguments`` from their roles (``spread_roles``)."""
    per_leaf = spread_roles(roles, arguments)
    found = [per_leaf[i] for i in dynamic]
    params = {r.name: i for i, r in enumerate(found) if isinstance(r, Param) and r.name is not None}
    fields: dict[str, dict[str, int]] = {}
    for i, r in enumerate(found):
        if isinstance(r, Fp8StateField):
            fields.setdefault(r.name, {})[r.field] = i
    states = {}
    if fields:
        from jmp_lite._src.fp8.fp8 import (
            Fp8State,  # fp8 pulls in ml_dtypes' fp8 tables: only when states come
        )
    for name, f in fields.items():
        if name in params:  # a state of a parameter this call never reads is not needed
            if set(f) != set(Fp8State._fields):
                raise ValueError(f"jmp_lite: the fp8 state of {name!r} has the fields {sorted(f)}")
            states[params[name]] = tuple(f[k] for k in Fp8State._fields)
    return Inputs(
        tuple(r.dtype if isinstance(r, Param) else None for r in found),
        tuple(isinstance(r, Param) for r in found),
        states,
    )
