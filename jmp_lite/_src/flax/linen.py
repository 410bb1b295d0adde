"""Linen front-end: run an existing Flax Linen model under a ``Policy`` without editing its code.

``apply_policy(model, policy, rules)`` returns an object with ``init`` and
``apply`` like the model's. ``apply`` traces the model through the engine
(``jmp_lite._src.engine``) inside a Linen method interceptor
(``nn.intercept_methods``, inside whatever ``jax.jit`` traces it) that opens one
named scope per module call, so the engine knows which module every op belongs to:

* a module matched by a rule (or by the float32 defaults for normalization
  layers) opens a scope with that rule's policy; everything it calls runs
  under it unless a rule inside says otherwise, and its ``__call__`` outputs
  are cast to the rule's ``output``;
* parameters enter the computation in the compute dtype of the module that owns
  them (Flax's ``dtype`` does the same), and are stored in its ``param`` dtype
  (``init`` casts them);
* the model's final outputs are cast to ``policy.output``.

The module itself is never changed: no attribute of it is written. Rules map a
module class (``isinstance``) or a module path regex (``re.fullmatch`` against
``"Encoder_0/Dense_1"``) to a ``Policy`` (or policy string). Path rules win over
class rules, class rules over the defaults; a module matched by two path rules,
or by two unrelated classes, is an error.
"""

from __future__ import annotations

import copy
import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax

from jmp_lite._src import engine
from jmp_lite._src.flax import module_rules as _rules
from jmp_lite._src.flax.module_rules import RuleKey
from jmp_lite._src.policy import Policy

DEFAULT_FLOAT32_MODULES: tuple[type, ...] = (nn.BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
"""Module classes the default rules keep in float32 (params, statistics and arithmetic)."""


def _path(module: nn.Module) -> str:
    return "/".join(str(p) for p in (module.scope.path if module.scope else ()))


def _split_outputs(out: tuple) -> tuple:
    # the model's outputs take policy.output; updated collections keep their dtypes
    return jax.tree_util.tree_map(lambda _: True, out[0]), jax.tree_util.tree_map(lambda _: False, out[1])


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
        self._root = engine.Scope(policy, accumulate)
        self._warned = False
        self._run = engine.transform(
            self._traced_apply, self._root, inputs=self._param_dtypes, outputs=_split_outputs
        )

    def __repr__(self) -> str:
        return f"PolicyApplied({type(self.module).__name__}, {self.policy})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PolicyApplied) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple:
        rules = tuple((k.pattern if isinstance(k, re.Pattern) else k, p) for k, p in self._rules)
        return (id(self.module), self.policy, rules, self._defaults, self._accumulate)

    def _own_policy(self, module: nn.Module) -> Policy | None:
        defaults = DEFAULT_FLOAT32_MODULES if self._defaults else None
        return _rules.own_policy(self._rules, _path(module), module, self.policy, defaults)

    def policy_of(self, module: nn.Module) -> Policy:
        """The policy a module instance runs under: its own rule's, else its parent's, else the model's."""
        while isinstance(module, nn.Module):
            own = self._own_policy(module)
            if own is not None:
                return own
            module = module.parent
        return self.policy

    def _interceptor(self, next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
        module, name = context.module, context.method_name
        if name.startswith("_") and name != "__call__":
            return next_fun(*args, **kwargs)  # policies apply to setup, __call__, public methods (attend)
        own = self._own_policy(module)
        scope = None if own is None else engine.Scope(own, self._accumulate)
        call = lambda: next_fun(*args, **kwargs)  # noqa: E731
        # Flax already opens a named scope per module call: ours only carries the policy
        return _rules.call_module(module, _path(module), scope, self._root, call, name == "__call__", "")

    def _traced_apply(self, *args: Any, **kwargs: Any) -> tuple:
        with nn.intercept_methods(self._interceptor):
            out = self.module.apply(*args, **kwargs)
        return out if kwargs.get("mutable", False) is not False else (out, {})

    def _check_rules_matched(self, trace: _rules.Trace) -> None:
        # Linen modules exist only while a model runs, and which ones may depend on its inputs: warn.
        missing = _rules.unmatched(self._rules, trace.classes)
        if missing and not self._warned:
            self._warned = True
            message = _rules.unmatched_message(missing, trace.classes, type(self.module).__name__)
            warnings.warn(message + " (in this trace)", stacklevel=4)

    def _param_dtypes(self, paths: Sequence[tuple]) -> list:
        """Per array argument: a parameter's compute dtype (its module's), else None."""
        owners = _rules.recorded()
        dtypes = []
        for path in paths:
            keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
            # (args, kwargs) / variables / "params" / module path / name
            found = _rules.owner(owners, [str(k) for k in keys[3:]]) if keys[:3] == [0, 0, "params"] else None
            dtypes.append(None if found is None else found.policy.compute)
        return dtypes

    def _init(self, fn: Callable, *args: Any, **kwargs: Any) -> tuple:
        """Runs ``fn`` (init or init_with_output); its parameters stored in their modules' param dtypes."""
        with _rules.recording() as trace, nn.intercept_methods(self._interceptor):
            out = fn(*args, **kwargs)
        self._check_rules_matched(trace)
        owners = trace.scopes
        variables = out[1] if isinstance(out, tuple) else out
        if "params" in variables:

            def cast(path: tuple, x: Any) -> Any:
                found = _rules.owner(owners, [str(getattr(k, "key", k)) for k in path]) or self._root
                return found.policy.cast_to_param(x)

            params = jax.tree_util.tree_map_with_path(cast, variables["params"])
            variables = type(variables)({**variables, "params": params})
        return (out[0], variables) if isinstance(out, tuple) else variables

    def init(self, *args: Any, **kwargs: Any) -> Any:
        """``module.init``; each parameter is stored in its module's ``param`` dtype."""
        return self._init(self.module.init, *args, **kwargs)

    def init_with_output(self, *args: Any, **kwargs: Any) -> Any:
        """``module.init_with_output``: the model's output (cast to ``policy.output``) and its variables."""
        out, variables = self._init(self.module.init_with_output, *args, **kwargs)
        return self.policy.cast_to_output(out), variables

    def apply(self, *args: Any, **kwargs: Any) -> Any:
        """``module.apply`` under the policy; the model's outputs are cast to ``policy.output``.

        With ``mutable=...`` the output is ``(outputs, updated_collections)`` as in
        Flax, and only ``outputs`` is cast.
        """
        with _rules.recording() as trace:
            out, collections = self._run(*args, **kwargs)
        if trace.classes:  # traced now (not a cached program)
            self._check_rules_matched(trace)
        return (out, collections) if kwargs.get("mutable", False) is not False else out

    def _variant(self, policy: Policy | None = None, **options: Any) -> PolicyApplied:
        """A copy for ``jmp_lite.precision_report``: every module under ``policy`` when given (its float32
        reference: rules keep their modules, so the program is the same) and its engine program built
        with extra ``engine.transform`` options (an observer)."""
        other = copy.copy(self)
        if policy is not None:
            other.policy, other._root = policy, engine.Scope(policy, self._accumulate)
            other._rules = tuple((key, policy) for key, _ in self._rules)
        other._run = engine.transform(
            other._traced_apply, other._root, inputs=other._param_dtypes, outputs=_split_outputs, **options
        )
        return other


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
            Keys are module classes or path regexes (``str`` or compiled). A rule
            applies to the module it matches and to everything that module calls,
            unless a rule matches inside.
        defaults: keep ``DEFAULT_FLOAT32_MODULES`` (normalization layers) in float32.
            Rules override the defaults.
        accumulate: 16-bit matmuls and convolutions accumulate in float32, forward and
            backward (``jmp_lite.accumulate``); ``False`` runs them as ``jax.lax`` does.

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
