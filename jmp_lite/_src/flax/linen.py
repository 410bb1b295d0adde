"""Apply a ``Policy`` to an existing Flax Linen model without editing its code.

``apply_policy(model, policy, rules)`` returns an object with ``init`` and
``apply`` like the model's. Each enters a Linen method interceptor (inside
whatever ``jax.jit`` traces it, so the policy is part of the traced program,
never a stale cache entry) that, for every module call,

* sets the module's ``param_dtype`` to the rule's ``param`` (parameters are
  created, stored, and differentiated in it) and its ``dtype`` to the rule's
  ``compute`` (Flax casts inputs and parameters to it before each matmul or
  convolution),
* keeps attention softmax in float32 (``force_fp32_for_softmax``) and casts
  the weights back to the compute dtype for the weights-times-values matmul
  (Flax leaves that matmul in float32 otherwise),
* casts the outputs of rule-matched modules to the rule's ``output``, and the
  model's final outputs to ``policy.output``.

Rules map a module class (``isinstance``) or a module path regex (``re.fullmatch``
against ``"Encoder_0/Dense_1"``) to a ``Policy`` (or policy string). Path rules
win over class rules, class rules over the defaults; a module matched by two
path rules, or by two unrelated classes, is an error. The defaults keep
normalization layers entirely in float32 (statistics, scale and bias), so
their output is cast back to the compute dtype for the next layer.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

from jmp_lite._src import accumulate as _accumulate
from jmp_lite._src.flax import attention as _attention
from jmp_lite._src.flax import module_rules as _rules
from jmp_lite._src.flax.module_rules import RuleKey
from jmp_lite._src.policy import Policy

DEFAULT_FLOAT32_MODULES: tuple[type, ...] = (nn.BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
"""Module classes the default rules keep in float32 (params, statistics and arithmetic)."""


def _weights_times_values(einsum: Callable) -> Callable:
    def weights_times_values(subscripts: str, weights: Any, value: Any) -> Any:
        # Softmax ran in float32; the weights @ values matmul runs in the compute dtype.
        return einsum(subscripts, weights.astype(value.dtype), value)

    return weights_times_values


def _attention_fn(accumulated: bool) -> Callable:
    """``nn.dot_product_attention`` with float32 softmax, and fused kernels where they apply."""
    einsum = _accumulate.einsum if accumulated else jnp.einsum

    @functools.wraps(nn.dot_product_attention)  # Flax passes only the kwargs this signature names
    def attention(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, **kwargs: Any) -> Any:
        dropout = not kwargs.get("deterministic", False) and kwargs.get("dropout_rate", 0.0) > 0.0
        hooks = [kwargs.get(k) for k in ("einsum_dot_general", "qk_attn_weights_einsum")]
        dtype = kwargs.get("dtype")
        if dtype is not None:
            query, key, value = (a.astype(dtype) for a in (query, key, value))
        extra = {"dropout": dropout, "module": kwargs.get("module"), "precision": kwargs.get("precision")}
        if _attention.fused_ok(query, key, value, None, hooks=any(hooks), **extra):
            return _attention.fused(query, key, value, bias, mask)
        if not any(hooks) and kwargs.get("attn_weights_value_einsum") is None:
            # Flax takes the einsum hooks or `precision`, not both: fold the precision in.
            qk = functools.partial(einsum, precision=kwargs.pop("precision", None))
            kwargs["qk_attn_weights_einsum"] = qk
            kwargs["attn_weights_value_einsum"] = _weights_times_values(qk)
        return nn.dot_product_attention(query, key, value, bias, mask, **kwargs)

    return attention


_ATTENTION = {True: _attention_fn(True), False: _attention_fn(False)}


_ACCUMULATING = {
    "dot_general": _accumulate.dot_general,
    "conv_general_dilated": _accumulate.conv_general_dilated,
}


class PolicyApplied:
    """A Linen model whose ``init``/``apply`` run under a mixed-precision policy.

    Build it with ``apply_policy``. Hashable, so it can be a static argument.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite.flax
        >>> model = jmp_lite.flax.linen.apply_policy(nn.Dense(3), "p=f32,c=bf16,o=f32")
        >>> variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
        >>> variables["params"]["kernel"].dtype, jax.jit(model.apply)(variables, jnp.ones((2, 4))).dtype
        (dtype('float32'), dtype('float32'))
    """

    def __init__(
        self, module: nn.Module, policy: Policy, rules: tuple, defaults: bool, accumulate: bool = True
    ) -> None:
        self.module = module
        self.policy = policy
        self._rules = rules
        self._defaults = defaults
        self._accumulate = accumulate

    def __repr__(self) -> str:
        return f"PolicyApplied({type(self.module).__name__}, {self.policy})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PolicyApplied) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple:
        rules = tuple((k.pattern if isinstance(k, re.Pattern) else k, p) for k, p in self._rules)
        return (id(self.module), self.policy, rules, self._defaults, self._accumulate)

    def policy_of(self, module: nn.Module) -> Policy:
        """The policy a module instance runs under (the rule that matches it, or the default)."""
        path = "/".join(str(p) for p in (module.scope.path if module.scope else ()))
        defaults = DEFAULT_FLOAT32_MODULES if self._defaults else None
        return _rules.match(self._rules, path, module, self.policy, defaults)

    def _interceptor(self, next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
        module = context.module
        name = context.method_name
        if name.startswith("_") and name != "__call__":
            return next_fun(*args, **kwargs)  # dtypes apply to setup, __call__, public methods (attend)
        policy = self.policy_of(module)
        accumulated = self._accumulate and _accumulate.is_accumulated(policy.compute, policy.compute)
        new = {}
        if hasattr(module, "param_dtype"):
            new["param_dtype"] = policy.param
        if hasattr(module, "dtype"):
            new["dtype"] = policy.compute
        # 16-bit matmuls and convolutions accumulate in float32 (unless the model chose its own).
        for hook, accumulating in _ACCUMULATING.items():
            own_cls = getattr(module, f"{hook}_cls", None) is not None
            if accumulated and getattr(module, hook, False) is None and not own_cls:
                new[hook] = accumulating
        if hasattr(module, "force_fp32_for_softmax"):
            new["force_fp32_for_softmax"] = True
            if getattr(module, "attention_fn", None) is nn.dot_product_attention:
                new["attention_fn"] = _ATTENTION[accumulated]
        saved = {k: getattr(module, k) for k in new}
        # Linen modules are frozen dataclasses; the attributes are restored right after.
        for k, v in new.items():
            object.__setattr__(module, k, v)
        try:
            out = next_fun(*args, **kwargs)
        finally:
            for k, v in saved.items():
                object.__setattr__(module, k, v)
        if context.method_name == "__call__" and policy is not self.policy:
            out = policy.cast_to_output(out)
        return out

    def _run(self, fn: Callable, *args: Any, **kwargs: Any) -> Any:
        with nn.intercept_methods(self._interceptor):
            return fn(*args, **kwargs)

    def init(self, *args: Any, **kwargs: Any) -> Any:
        """``module.init`` under the policy: parameters are created in their policy's ``param`` dtype."""
        return self._run(self.module.init, *args, **kwargs)

    def init_with_output(self, *args: Any, **kwargs: Any) -> Any:
        """``module.init_with_output`` under the policy."""
        out, variables = self._run(self.module.init_with_output, *args, **kwargs)
        return self.policy.cast_to_output(out), variables

    def apply(self, *args: Any, **kwargs: Any) -> Any:
        """``module.apply`` under the policy; the model's outputs are cast to ``policy.output``.

        With ``mutable=...`` the output is ``(outputs, updated_collections)`` as in
        Flax, and only ``outputs`` is cast.
        """
        out = self._run(self.module.apply, *args, **kwargs)
        if kwargs.get("mutable", False) is not False:
            return self.policy.cast_to_output(out[0]), out[1]
        return self.policy.cast_to_output(out)


def apply_policy(
    module: nn.Module,
    policy: Policy | str,
    rules: Mapping[RuleKey, Policy | str] | None = None,
    *,
    defaults: bool = True,
    accumulate: bool = True,
) -> PolicyApplied:
    """Runs a Linen model under ``policy``, with per-class and per-path exceptions.

    Args:
        module: any Linen module (compact or setup-style; scan/remat inside are fine).
        policy: the model-wide ``Policy`` or policy string.
        rules: ``{nn.LayerNorm: "f32", r"decoder/.*": "p=f32,c=f16,o=f16", ...}``.
            Keys are module classes or path regexes (``str`` or compiled).
        defaults: keep ``DEFAULT_FLOAT32_MODULES`` (normalization layers) in float32.
            Rules override the defaults.
        accumulate: 16-bit matmuls and convolutions (``Dense``, ``DenseGeneral``,
            ``Conv``, attention) accumulate in float32, forward and backward
            (``jmp_lite.accumulate``); ``False`` leaves Flax's own contraction.
            Modules given their own ``dot_general``/``conv_general_dilated`` keep it.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite.flax
        >>> mlp = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])
        >>> model = jmp_lite.flax.linen.apply_policy(mlp, "p=f32,c=f16,o=f32", {r"layers_2": "f32"})
        >>> variables = model.init(jax.random.key(0), jnp.ones((1, 4)))
        >>> model.policy_of(mlp.bind(variables).layers[1]).compute  # LayerNorm: float32 by default
        dtype('float32')
    """
    policy = _rules.as_policy(policy, "policy")
    if policy is None:
        raise TypeError("policy must be a Policy or a policy string, not None")
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"apply_policy expects a flax.linen Module, got {type(module).__name__}; "
            "for flax.nnx modules use jmp_lite.flax.nnx.apply_policy"
        )
    if not isinstance(accumulate, bool):
        raise TypeError(f"accumulate must be True or False, got {accumulate!r}")
    parsed = _rules.parse_rules(rules, nn.Module, "Linen")
    return PolicyApplied(module, policy, parsed, defaults, accumulate)
