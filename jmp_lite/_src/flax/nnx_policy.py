"""Apply a ``Policy`` to an existing ``flax.nnx`` model.

``apply_policy(model, policy, rules)`` returns a *view* of the model: new module
objects that share the model's ``Variable`` objects (no parameter is copied when
it is already in the policy's ``param`` dtype; training the view trains the
model). On each module of the view it sets

* ``param_dtype`` to the rule's ``param``; existing parameters in another
  floating dtype are cast once, into new variables that only the view holds
  (a weight tied between modules must get one dtype from all its holders' rules),
* ``dtype`` to the rule's ``compute`` (Flax casts inputs and parameters to it
  before each matmul or convolution),
* for attention, an ``attention_fn`` that keeps the softmax in float32 on every
  path (Flax's fused path already does; its dropout path would not),

and casts the ``__call__`` outputs of rule-matched modules to the rule's
``output`` and the root's to ``policy.output``. That cast is done by giving
those view objects a cached subclass of their own class whose ``__call__``
casts; ``isinstance`` checks, ``nnx.split``/``nnx.merge``, ``nnx.jit`` and
checkpoints of ``nnx.state`` are unaffected, and the original model is untouched.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jmp_lite._src import accumulate as _accumulate
from jmp_lite._src.flax import attention as _attention
from jmp_lite._src.flax import module_rules as _rules
from jmp_lite._src.flax.module_rules import RuleKey
from jmp_lite._src.policy import Policy

DEFAULT_FLOAT32_MODULES: tuple[type, ...] = (nnx.BatchNorm, nnx.LayerNorm, nnx.GroupNorm, nnx.RMSNorm)
"""NNX module classes the default rules keep in float32 (params, statistics and arithmetic)."""

__all__ = [
    "DEFAULT_FLOAT32_MODULES",
    "apply_policy",
    "attention",
    "policy_of",
]

M = TypeVar("M", bound=nnx.Module)
_POLICY_ATTR = "_jmp_lite_policy"
_CAST_ATTR = "_jmp_lite_cast_output"


def attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: jax.Array | None = None,
    mask: jax.Array | None = None,
    broadcast_dropout: bool = True,
    dropout_rng: jax.Array | None = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: nnx.Module | None = None,
    promote_dtype: Any = nnx.nn.dtypes.promote_dtype,
    is_causal: bool = False,
    *,
    accumulate: bool = True,
    fused: bool | None = None,
) -> jax.Array:
    """``nnx.dot_product_attention`` with the softmax always in float32.

    Same arguments, plus:

    * ``fused``: run ``jax.nn.dot_product_attention`` (cuDNN / fused kernels on
      GPU; logits accumulate and softmax runs in float32 there). ``None`` (the
      default) takes it on GPU and TPU whenever the call has no dropout, no sown
      weights and no explicit ``precision``, and the hand-written path otherwise.
      On XLA:CPU there is no fused kernel, and the XLA fallback of that function
      hands the backward matmuls a float32 cotangent (float32 speed) and
      rejects float16 operands with float32 logits, so CPU takes the
      hand-written path.
    * ``accumulate``: on the hand-written path, 16-bit matmuls accumulate in
      float32 forward and backward (``jmp_lite.accumulate``).

    On the hand-written path both matmuls, forward and backward, take
    compute-dtype operands; the logits are cast to float32 for the mask, softmax
    and dropout, and the weights back to the compute dtype for the
    weights-times-values matmul (the same as Linen's ``force_fp32_for_softmax``;
    Flax's own NNX function runs the softmax in the compute dtype on its dropout
    path). ``apply_policy`` installs it on ``nnx.MultiHeadAttention``.

    Example:
        >>> import jax.numpy as jnp, jmp_lite.flax.nnx as jnnx
        >>> q = jnp.ones((1, 4, 2, 8), jnp.bfloat16)  # batch, length, heads, depth
        >>> jnnx.attention(q, q, q, dropout_rate=0.1, deterministic=True).dtype
        dtype(bfloat16)
    """
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    dtype = query.dtype
    dropout = not deterministic and dropout_rate > 0.0
    plain = {"dropout": dropout, "module": module is not None, "precision": precision is not None}
    if _attention.fused_ok(query, key, value, fused, **plain):
        return _attention.fused(query, key, value, bias, mask, is_causal)
    einsum = _accumulate.einsum if accumulate else jnp.einsum
    if key.shape[-2] != query.shape[-2]:  # grouped-query attention: share each k/v head
        if query.shape[-2] % key.shape[-2]:
            raise ValueError(
                f"query heads ({query.shape[-2]}) must be a multiple of key heads ({key.shape[-2]})"
            )
        repeat = query.shape[-2] // key.shape[-2]
        key, value = jnp.repeat(key, repeat, axis=-2), jnp.repeat(value, repeat, axis=-2)
    query = query / jnp.sqrt(query.shape[-1]).astype(dtype)
    # Logits leave the matmul in the compute dtype (as Linen's force_fp32_for_softmax does), so the
    # backward matmuls get a compute-dtype cotangent; the softmax itself runs in float32.
    logits = einsum("...qhd,...khd->...hqk", query, key, precision=precision).astype(jnp.float32)
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)
    keep = None if mask is None else mask.astype(bool)
    if is_causal:
        causal = jnp.tril(jnp.ones(logits.shape[-2:], bool))
        keep = causal if keep is None else keep & causal
    if keep is not None:
        logits = jnp.where(keep, logits, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(logits)
    if module is not None:
        module.sow(nnx.Intermediate, "attention_weights", weights.astype(dtype))
    if dropout:
        shape = (1,) * (weights.ndim - 2) + weights.shape[-2:] if broadcast_dropout else weights.shape
        if dropout_rng is None:
            raise ValueError("attention dropout needs dropout_rng (or deterministic=True)")
        keep_mask = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, shape)
        weights = jnp.where(keep_mask, weights / (1.0 - dropout_rate), 0.0)
    return einsum("...hqk,...khd->...qhd", weights.astype(dtype), value, precision=precision)


_PLAIN_ATTENTION = functools.partial(attention, accumulate=False)


@functools.cache
def _casting_class(cls: type) -> type:
    """A subclass of ``cls`` whose ``__call__`` casts its outputs per the module's policy."""

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = super(sub, self).__call__(*args, **kwargs)
        policy = getattr(self, _POLICY_ATTR)
        return policy.cast_to_output(out)

    def __reduce_ex__(self: Any, protocol: Any) -> Any:
        # Pickle as the original class, re-wrapped on load (the subclass is not importable by name).
        return (_unpickle_casting, (cls, self.__dict__.copy()))

    namespace = {
        "__call__": __call__,
        "__reduce_ex__": __reduce_ex__,
        "__module__": cls.__module__,
        _CAST_ATTR: True,
    }
    # Flax reads `pytree=` as a class keyword; a subclass must keep the parent's choice.
    sub = type(cls.__name__, (cls,), namespace, pytree=getattr(cls, "_pytree__is_pytree", True))
    sub.__qualname__ = cls.__qualname__
    return sub


def _unpickle_casting(cls: type, state: dict) -> Any:
    obj = object.__new__(_casting_class(cls))
    obj.__dict__.update(state)
    return obj


def _cast_params(module: nnx.Module, dtype: Any, path: str, decided: dict[int, tuple]) -> None:
    """Re-creates ``module``'s floating params that are not in ``dtype`` (into the view only)."""
    for name, var in list(vars(module).items()):
        if not isinstance(var, nnx.Param) or not jnp.issubdtype(var.get_value().dtype, jnp.floating):
            continue
        where = f"{path or '<root>'}.{name}"
        if id(var) in decided:  # a tied weight: every holder must ask for the same dtype
            want, first, new = decided[id(var)]
            if np.dtype(want) != np.dtype(dtype):
                raise ValueError(
                    f"the parameter shared by {first} and {where} would be {np.dtype(want)} under one rule "
                    f"and {np.dtype(dtype)} under the other; give both holders the same param dtype"
                )
        else:
            value = var.get_value()
            new = var if value.dtype == dtype else var.replace(value.astype(dtype))
            decided[id(var)] = (dtype, where, new)
        if new is not var:
            setattr(module, name, new)


def apply_policy(
    model: M,
    policy: Policy | str,
    rules: Mapping[RuleKey, Policy | str] | None = None,
    *,
    defaults: bool = True,
    accumulate: bool = True,
) -> M:
    """A view of an NNX model that runs under ``policy``, with per-class and per-path exceptions.

    Args:
        model: any ``nnx.Module``; it is not modified.
        policy: the model-wide ``Policy`` or policy string.
        rules: ``{nnx.LayerNorm: "f32", r"blocks/\\d+/mlp/.*": "p=f32,c=f16,o=f16", ...}``.
            Keys are module classes or regexes matched in full against the module
            path (attribute names and list indices joined by ``/``).
        defaults: keep ``DEFAULT_FLOAT32_MODULES`` (normalization layers) in float32.
        accumulate: 16-bit matmuls and convolutions (``Linear``, ``LinearGeneral``,
            ``Einsum``, ``Conv``, attention) accumulate in float32, forward and
            backward (``jmp_lite.accumulate``); ``False`` leaves Flax's own
            contraction. Modules given their own contraction function keep it.

    Returns:
        The view: same structure as ``model``, sharing its ``Variable`` objects
        (except parameters cast to another dtype, which the view holds alone).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jmp_lite.flax.nnx as jnnx
        >>> mlp = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.LayerNorm(8, rngs=nnx.Rngs(0)))
        >>> view = jnnx.apply_policy(mlp, "p=f32,c=bf16,o=f32")
        >>> view.layers[0].kernel is mlp.layers[0].kernel, view(jnp.ones((2, 4))).dtype
        (True, dtype('float32'))
        >>> jnnx.policy_of(view.layers[1])  # LayerNorm: float32 inside, output for the next layer
        Policy(param=f32, compute=f32, output=bf16)
    """
    policy = _rules.as_policy(policy, "policy")
    if policy is None:
        raise TypeError("policy must be a Policy or a policy string, not None")
    if isinstance(model, nnx.Module) and getattr(model, _POLICY_ATTR, None) is not None:
        raise ValueError("model is already a policy view; apply the policy to the original model")
    if not isinstance(model, nnx.Module):
        raise TypeError(f"apply_policy expects a flax.nnx Module, got {type(model).__name__}")
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate must be True or False, got {accumulate!r}")
    parsed = _rules.parse_rules(rules, nnx.Module, "NNX")
    float32_classes = DEFAULT_FLOAT32_MODULES if defaults else None
    decided: dict[int, tuple] = {}
    _check_shared_modules(model, parsed, policy, float32_classes)

    def visit(path: tuple, node: Any) -> Any:
        if not isinstance(node, nnx.Module):
            return node
        where = "/".join(str(p) for p in path)
        rule = _rules.match(parsed, where, node, policy, float32_classes)
        if hasattr(node, "param_dtype"):
            node.param_dtype = rule.param
        _cast_params(node, rule.param, where, decided)
        if hasattr(node, "dtype"):
            node.dtype = rule.compute
        accumulated = accumulate and _accumulate.is_accumulated(rule.compute, rule.compute)
        if accumulated:
            _accumulate_contractions(node)
        if getattr(node, "attention_fn", None) is nnx.dot_product_attention:
            node.attention_fn = attention if accumulated else _PLAIN_ATTENTION
        if not path and _rules.match(parsed, where, node, policy, None) == policy:
            rule = Policy(rule.param, rule.compute, policy.output)  # no user rule for the root: policy.output
        object.__setattr__(node, _POLICY_ATTR, rule)
        if (rule != policy or not path) and callable(node):
            node.__class__ = _casting_class(type(node))
        return node

    return nnx.recursive_map(visit, model, graph=True)


_DEFAULT_CONTRACTIONS = {
    "dot_general": (None, lax.dot_general, _accumulate.dot_general),
    "conv_general_dilated": (None, lax.conv_general_dilated, _accumulate.conv_general_dilated),
    "einsum_op": (None, jnp.einsum, _accumulate.einsum),
}


def _accumulate_contractions(node: nnx.Module) -> None:
    # Only Flax's defaults are replaced: a contraction the model chose (quantized, fp8) stays.
    for name, (unset, default, accumulating) in _DEFAULT_CONTRACTIONS.items():
        own_cls = getattr(node, f"{name}_cls", None) is not None
        if getattr(node, name, False) in (unset, default) and not own_cls:
            setattr(node, name, accumulating)


def _check_shared_modules(
    model: nnx.Module, parsed: _rules.Rules, policy: Policy, float32_classes: tuple[type, ...] | None
) -> None:
    # A module reachable by several paths gets one view object: its rules must agree on all paths.
    for paths in nnx.find_duplicates(model):
        node = model
        for part in paths[0]:
            node = node[part] if isinstance(node, (nnx.List, nnx.Dict)) else getattr(node, str(part))
        if not isinstance(node, nnx.Module):
            continue
        names = ["/".join(str(p) for p in path) for path in paths]
        got = [_rules.match(parsed, n, node, policy, float32_classes) for n in names]
        if len(set(got)) > 1:
            raise ValueError(
                f"the module shared at paths {names} matches different rules ({', '.join(map(str, got))}); "
                "a shared module has one dtype: make the rules agree"
            )


def policy_of(module: nnx.Module) -> Policy:
    """The policy a module of an ``apply_policy`` view runs under.

    Example:
        >>> from flax import nnx
        >>> import jmp_lite.flax.nnx as jnnx
        >>> view = jnnx.apply_policy(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "p=f32,c=f16,o=f32")
        >>> jnnx.policy_of(view).compute
        dtype('float16')
    """
    policy = getattr(module, _POLICY_ATTR, None)
    if policy is None:
        raise ValueError(f"{type(module).__name__} is not part of a jmp_lite.flax.nnx.apply_policy view")
    return policy
