"""Linen front-end: run an existing Flax Linen model under a ``Policy`` without editing its code.

``apply_policy(model, policy, rules)`` returns an object with ``init`` and
``apply`` like the model's. ``apply`` traces the model through the engine
(``jmp_lite._src.engine.engine``) inside a Linen method interceptor
(``nn.intercept_methods``, inside whatever ``jax.jit`` traces it) that opens one
named scope per module call, so the engine knows which module every op belongs to:

* a module matched by a rule (or by the float32 defaults for normalization
  layers) opens a scope with that rule's policy; everything it calls runs
  under it unless a rule inside says otherwise, and its ``__call__`` outputs
  are cast to the rule's ``output``;
* parameters enter the computation in the compute dtype of the module that owns
  them (Flax's ``dtype`` does the same), and are stored in its ``param`` dtype
  (``init`` casts them);
* the model's final outputs are cast to ``policy.output``;
* with ``fp8=`` (a recipe), every contraction that reads a parameter runs as
  ``jmp_lite.fp8.dot_general`` (Dense, DenseGeneral, Einsum, the attention
  projections), except inside modules a rule matches; with delayed scaling,
  ``init`` adds the ``"fp8"`` collection: one ``Fp8State`` per parameter an fp8
  contraction reads, at that parameter's path, found by tracing the model once.

The module itself is never changed: no attribute of it is written. Rules map a
module class (``isinstance``) or a module path regex (``re.fullmatch`` against
``"Encoder_0/Dense_1"``) to a ``Policy`` (or policy string). Path rules win over
class rules, class rules over the defaults; a module matched by two path rules,
or by two unrelated classes, is an error.
"""

from __future__ import annotations

import contextlib
import copy
import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import flax.linen as nn
import jax

from jmp_lite._src.base.policy import Policy
from jmp_lite._src.engine import engine
from jmp_lite._src.flax import module_rules as _rules
from jmp_lite._src.flax.module_rules import RuleKey
from jmp_lite._src.fp8.fp8 import Fp8Recipe, init_fp8_state
from jmp_lite._src.frontends import fp8_weights
from jmp_lite._src.frontends.options import Configured, Options, front_end_options
from jmp_lite._src.parallel import fsdp as _fsdp

DEFAULT_FLOAT32_MODULES: tuple[type, ...] = (nn.BatchNorm, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)
"""Module classes the default rules keep in float32 (params, statistics and arithmetic)."""

FP8_COLLECTION = "fp8"
"""The variable collection of the delayed-scaling fp8 states: ``variables["fp8"][path] = Fp8State``."""


def _path(module: nn.Module) -> str:
    return "/".join(str(p) for p in (module.scope.path if module.scope else ()))


class _Paths(NamedTuple):
    """Linen's record of a trace (``engine.Context.frontend``)."""

    # id(root scope) -> (that scope, the path of its modules' tree in the model, None where it has none)
    trees: dict[int, tuple[Any, str | None]] | None = None
    # the module calls running, innermost last: (path, its tree's prefix)
    callers: tuple[tuple[str | None, str | None], ...] = ()


def _paths() -> _Paths:
    current = engine.context().frontend
    return current if isinstance(current, _Paths) else _Paths()


@contextlib.contextmanager
def _tracing_paths() -> Iterator[None]:
    with engine.entering(frontend=_paths()._replace(trees={})):
        yield


def _join(*parts: str) -> str:
    return "/".join(p for p in parts if p)


def _traced_path(module: nn.Module) -> tuple[str | None, str | None]:
    """The module's path in the model being traced and the path its scope's root stands for (``None``:
    it has none).

    A module's scope path starts at its scope's root. That is the model's root, or a lifted
    transform's (``nn.scan``, ``nn.remat``: its root keeps the full path), or the fresh root of
    ``module.apply(...)`` called inside the model (Hugging Face GPT-2's and BERT's head tied to the
    embedding: ``self.lm_head.apply({"params": {"kernel": embedding.T}}, h)``). Flax names that one
    as if called plainly (the attribute ``lm_head``), so its modules' paths continue the caller's
    path with that name: ``"lm_head"``, as a user would write it.
    """
    (trees, callers), rel = _paths(), _path(module)
    if trees is None or module.scope is None:
        return rel, ""
    root = module.scope.root
    if id(root) not in trees:
        if not callers:  # the model itself
            prefix = ""
        elif root.path:  # a lifted transform: its paths are those of the caller's tree
            prefix = callers[-1][1]
        else:  # module.apply(...) inside a running module: the top module's name there, if any
            top = module
            while isinstance(top.parent, nn.Module):
                top = top.parent
            caller = callers[-1][0]
            prefix = None if caller is None or top.name is None else _join(caller, top.name)
        trees[id(root)] = (root, prefix)
    prefix = trees[id(root)][1]
    return (None, None) if prefix is None else (_join(prefix, rel), prefix)


def _describe(callers: tuple) -> str:
    caller = callers[-1][0] if callers else None
    if caller is None:
        return "a module without a path"
    return f"the module at {caller!r}" if caller else "the model's top module"


def _split_outputs(out: tuple) -> tuple:
    # the model's outputs take policy.output; updated collections keep their dtypes
    return jax.tree_util.tree_map(lambda _: True, out[0]), jax.tree_util.tree_map(lambda _: False, out[1])


def _apply_roles(variables: Any, *args: Any, **kwargs: Any) -> tuple | None:
    """The roles of ``apply``'s arguments as tools see them: each parameter named by its path, the
    ``"fp8"`` collection's leaves its fp8 scaling state."""
    if not isinstance(variables, Mapping):
        return None

    def role(name: str, tree: Any) -> Any:
        if name == "params":
            return jax.tree_util.tree_map_with_path(
                lambda p, _: engine.Param(name=fp8_weights.path_name(p)), tree
            )
        if name == FP8_COLLECTION:
            return jax.tree_util.tree_map(lambda _: engine.Fp8StateField("", ""), tree)
        return None

    return ((type(variables)({k: role(k, v) for k, v in variables.items()}), *(None for _ in args)), None)


def _typed_key(key: Any) -> Any:
    if jax.dtypes.issubdtype(getattr(key, "dtype", None), jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(key)


class PolicyApplied(Configured):
    """A Linen model whose ``init``/``apply`` run under a mixed-precision policy.

    Build it with ``apply_policy``. Hashable, so it can be a static argument.

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite.flax
        >>> model = jmp_lite.flax.linen.apply_policy(nn.Dense(3), "p=f32,c=bf16,o=f32")
        >>> variables = model.init(jax.random.key(0), jnp.ones((2, 4)))
        >>> variables["params"]["kernel"].dtype, jax.jit(model.apply)(variables, jnp.ones((2, 4))).dtype
        (dtype('float32'), dtype('float32'))
    """

    def __init__(self, module: nn.Module, opts: Options, rules: tuple, defaults: bool) -> None:
        self.module = module
        self.options = opts
        self._rules = rules
        self._defaults = defaults
        self._root = opts.root
        self._warned = False
        keywords = {"inputs": self._roles, "outputs": _split_outputs, **opts.engine_options()}
        self._run = engine.transform(self._traced_apply, self._root, **keywords)
        if opts.fp8 is not None:  # finds the weights fp8 reads (init): their states, or that there are none
            self._discover = engine.transform(self._traced_apply, opts.discovering().root, **keywords)

    def _front_end_options(self) -> Options:
        return self.options

    def __repr__(self) -> str:
        return f"PolicyApplied({type(self.module).__name__}, {self.policy})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PolicyApplied) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def _key(self) -> tuple:
        rules = tuple((k.pattern if isinstance(k, re.Pattern) else k, p) for k, p in self._rules)
        return (id(self.module), self.options, rules, self._defaults)

    def _own_policy(self, module: nn.Module, path: str | None) -> Policy | None:
        defaults = DEFAULT_FLOAT32_MODULES if self._defaults else None
        return _rules.own_policy(self._rules, path, module, self.policy, defaults)

    def policy_of(self, module: nn.Module) -> Policy:
        """The policy a module instance runs under: its own rule's, else its parent's, else the model's."""
        while isinstance(module, nn.Module):
            own = self._own_policy(module, _path(module))
            if own is not None:
                return own
            module = module.parent
        return self.policy

    def _interceptor(self, next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
        module, name = context.module, context.method_name
        if name.startswith("_") and name != "__call__":
            return next_fun(*args, **kwargs)  # policies apply to setup, __call__, public methods (attend)
        path, tree = _traced_path(module)
        own = self._own_policy(module, path)
        scope = None if own is None else engine.Scope(own, self.options.accumulate)
        paths = _paths()
        callers = paths.callers

        def call() -> Any:
            with engine.entering(frontend=paths._replace(callers=(*callers, (path, tree)))):
                return next_fun(*args, **kwargs)

        where = f"applied with .apply() inside {_describe(callers)}"
        # Flax already opens a named scope per module call: ours only carries the policy
        return _rules.call_module(module, path, scope, self._root, call, name == "__call__", "", where)

    def _traced_apply(self, states: Any, *args: Any, **kwargs: Any) -> tuple:
        del states  # the fp8 states, read by the engine (roles from _roles)
        with _tracing_paths(), nn.intercept_methods(self._interceptor):
            out = self.module.apply(*args, **kwargs)
        return out if kwargs.get("mutable", False) is not False else (out, {})

    def _check_rules_matched(self, trace: _rules.Trace) -> None:
        # Linen modules exist only while a model runs, and which ones may depend on its inputs: warn.
        missing = _rules.unmatched(self._rules, trace.classes, trace.unpathed)
        if missing and not self._warned:
            self._warned = True
            model = type(self.module).__name__
            message = _rules.unmatched_message(missing, trace.classes, model, trace.unpathed)
            warnings.warn(message + " (in this trace)", stacklevel=4)

    def _roles(self, states: Any, variables: Any, *args: Any, **kwargs: Any) -> tuple:
        """The engine roles of ``_traced_apply``'s arguments: each parameter read in its module's compute
        dtype, and the fields of its fp8 state (``states``, nested by parameter path)."""
        if not isinstance(variables, Mapping) or "params" not in variables:
            return None
        owners = _rules.recorded()

        def param(path: tuple, _: Any) -> engine.Param | None:
            keys = [str(fp8_weights.key_name(k)) for k in path]  # module path / name
            found = _rules.owner(owners, keys)
            return None if found is None else engine.Param(found.policy.compute, "/".join(keys))

        params = jax.tree_util.tree_map_with_path(param, variables["params"])
        found = fp8_weights.names(states, fp8_weights.is_state)
        unknown = sorted(set(found) - set(fp8_weights.names(variables["params"])))
        if unknown:
            raise ValueError(
                f"the {FP8_COLLECTION!r} collection has states for {unknown}, which are no parameters"
            )
        fp8 = jax.tree_util.tree_map_with_path(
            lambda p, _: fp8_weights.state_roles(fp8_weights.path_name(p)),
            states,
            is_leaf=fp8_weights.is_state,
        )
        roles = type(variables)({**{k: None for k in variables}, "params": params})
        return ((fp8, roles, *(None for _ in args)), None)

    def _fp8_states(self, variables: Any, args: tuple, kwargs: dict) -> dict:
        """The ``"fp8"`` collection for delayed scaling: a fresh state per parameter fp8 reads (``{}``
        for any other recipe). Any recipe: a warning when fp8 reads no parameter at all."""
        rngs = args[0] if args else kwargs.pop("rngs")
        rngs = rngs if isinstance(rngs, Mapping) else {"params": rngs}
        kwargs = {k: v for k, v in kwargs.items() if k != "mutable"}
        with _rules.recording():  # the parameters' owners, for _roles
            (_, counts, *_), _ = fp8_weights.discover(
                self._discover, {}, variables, *args[1:], rngs=rngs, mutable=True, **kwargs
            )
        paths = fp8_weights.used(counts["params"])
        uses = {"/".join(map(str, p)): n for p, n in paths.items()}
        if not self.fp8_recipe.stateful:  # no states, so a weight may drive several contractions
            fp8_weights.warn_if_unused(uses, "apply_policy", stacklevel=4)  # names the caller of init
            return {}
        fp8_weights.check_one_use(uses, "apply_policy", stacklevel=4)
        return fp8_weights.nest({p: init_fp8_state(self.fp8_recipe) for p in sorted(paths)})

    def _init(self, fn: Callable, *args: Any, **kwargs: Any) -> tuple:
        """Runs ``fn`` (init or init_with_output); its parameters stored in their modules' param dtypes."""
        with _rules.recording() as trace, _tracing_paths(), nn.intercept_methods(self._interceptor):
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
            if self.fp8_recipe is not None:
                states = self._fp8_states({"params": params}, args, dict(kwargs))
                if self.fp8_recipe.stateful:  # empty for a model fp8 reads no weight of
                    variables = type(variables)({**variables, FP8_COLLECTION: states})
        return (out[0], variables) if isinstance(out, tuple) else variables

    def init(self, *args: Any, **kwargs: Any) -> Any:
        """``module.init``; each parameter is stored in its module's ``param`` dtype.

        With delayed fp8 scaling the variables also hold the ``"fp8"`` collection (``FP8_COLLECTION``):
        ``{parameter path: Fp8State}`` for each parameter an fp8 contraction reads.
        """
        return self._init(self.module.init, *args, **kwargs)

    def init_with_output(self, *args: Any, **kwargs: Any) -> Any:
        """``module.init_with_output``: the model's output (cast to ``policy.output``) and its variables."""
        out, variables = self._init(self.module.init_with_output, *args, **kwargs)
        return self.policy.cast_to_output(out), variables

    def apply(self, *args: Any, **kwargs: Any) -> Any:
        """``module.apply`` under the policy; the model's outputs are cast to ``policy.output``.

        With ``mutable=...`` the output is ``(outputs, updated_collections)`` as in
        Flax, and only ``outputs`` is cast. The ``"fp8"`` collection, if any, is read (the
        scales of delayed scaling) and never returned: ``jmp_lite.fp8.update_fp8_state`` (or
        ``jmp_lite.flax.TrainState``) makes the next one from its gradient.
        """
        if not args:
            raise TypeError("apply(variables, *args, **kwargs): the variables come first")
        if self.sharding is not None:
            return self._sharded_apply(*args, **kwargs)
        return self._apply(*args, **kwargs)

    def _sharded_apply(self, variables: Any, *args: Any, **kwargs: Any) -> Any:
        """``apply`` with ``mesh=``/``fsdp_axis=``: the variables sharded and each parameter gathered where
        its module reads it, in its module's compute dtype; the arguments split along their leading
        dimension; ``rngs`` replicated, each device folding in its index."""
        if kwargs.get("mutable", False) is not False:
            raise ValueError(
                "apply_policy(mesh=...): apply(mutable=...) is not supported in sharded training: the "
                "collections it returns (batch statistics, sown values) differ between devices; run such "
                "layers in inference mode"
            )
        rngs = kwargs.pop("rngs", None)
        if rngs is not None:  # typed, so that each device folds its index into them (raw: same bits)
            rngs = rngs if isinstance(rngs, Mapping) else {"params": rngs}
            rngs = {name: _typed_key(key) for name, key in rngs.items()}
        _fsdp.check_keywords(kwargs, "apply_policy")

        def local(tree: tuple, *batch: Any) -> Any:
            local_variables, local_rngs = tree
            if local_rngs is not None:
                return self._apply(local_variables, *batch, rngs=local_rngs, **kwargs)
            return self._apply(local_variables, *batch, **kwargs)

        return _fsdp.sharded_by(local, self.sharding)((variables, rngs), *args)

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        variables, *rest = args
        states = {}
        given = isinstance(variables, Mapping) and FP8_COLLECTION in variables
        if given:
            states = variables[FP8_COLLECTION]
            variables = {k: v for k, v in variables.items() if k != FP8_COLLECTION}
        if self.fp8_recipe is not None:
            # an empty collection is the one init makes for a model fp8 reads no weight of (a conv net)
            if self.fp8_recipe.stateful and not given:
                raise ValueError(
                    f"apply_policy(fp8={str(self.fp8_recipe)!r}): delayed scaling reads the scales from the "
                    f"{FP8_COLLECTION!r} collection, which these variables lack; create them with this "
                    "model's init (PolicyApplied.init), not the bare module's"
                )
            fp8_weights.refuse_float64((variables, rest, kwargs), "apply_policy(fp8=...)")
        with _rules.recording() as trace:
            out, collections = self._run(states, variables, *rest, **kwargs)
        if trace.classes or trace.unpathed:  # traced now (not a cached program)
            self._check_rules_matched(trace)
        return (out, collections) if kwargs.get("mutable", False) is not False else out

    def __jmp_lite_model__(self) -> engine.ModelUnderPolicy:
        """The model as tools that re-run it see it (``engine.ModelUnderPolicy``)."""
        rules = tuple((k.pattern if isinstance(k, re.Pattern) else k, p) for k, p in self._rules)

        def variant(policy: Policy | None = None, **options: Any) -> Callable[..., Any]:
            return self._variant(policy, **options).apply

        return engine.ModelUnderPolicy(
            "linen", type(self.module).__name__, self.policy, rules, self.fp8_recipe, variant, _apply_roles
        )

    def _variant(self, policy: Policy | None = None, **options: Any) -> PolicyApplied:
        """A copy for ``jmp_lite.precision_report``: every module under ``policy`` when given (its float32
        reference: rules keep their modules, so the program is the same) and its engine program built
        with extra ``engine.transform`` options (an observer)."""
        other = copy.copy(self)
        other.options = self.options._replace(sharding=None)  # a report measures precision on one device
        if policy is not None:
            other.options = other.options._replace(policy=policy)
            other._root = engine.Scope(policy, self.options.accumulate)
            other._rules = tuple((key, policy) for key, _ in self._rules)
        other._run = engine.transform(
            other._traced_apply,
            other._root,
            inputs=other._roles,
            outputs=_split_outputs,
            **{**self.options.engine_options(), **options},
        )
        return other


def apply_policy(
    module: nn.Module,
    policy: Policy | str,
    rules: Mapping[RuleKey, Policy | str] | None = None,
    *,
    defaults: bool = True,
    accumulate: bool = True,
    fp8: Fp8Recipe | str | None = None,
    remat_float32: bool = True,
    recompute: str | None = None,
    attention: bool = True,
    mesh: jax.sharding.Mesh | None = None,
    fsdp_axis: str | None = None,
    reduce_dtype: Any = None,
    reduce_scatter: str | None = None,
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
        fp8: a ``jmp_lite.Fp8Recipe`` or its string form: contractions that read a
            parameter (Dense, DenseGeneral, Einsum, attention projections) run in fp8,
            except in modules a rule matches (a rule opts a module out: first and last
            layers); attention scores and convolutions stay 16-bit. Delayed scaling keeps
            its state in the ``"fp8"`` collection that ``init`` creates (docs/fp8.md).
        remat_float32: under a 16-bit compute dtype, the backward pass keeps 16-bit
            activations and rebuilds float32 values (norms, softmax) from them
            (``jax.checkpoint``; docs/memory.md). ``False`` keeps what JAX would keep. A model
            with checkpoints of its own (``nn.remat``) keeps what they say instead.
        recompute: ``"wide_contractions"``: the backward pass also rebuilds the results of
            contractions wider than their operands (the MLP's up-projection) from their input,
            one layer at a time, instead of keeping them (docs/memory.md). ``None``: kept.
        attention: under a 16-bit compute dtype, ``softmax(q k^T) v`` chains run as the
            blockwise kernel of ``jmp_lite.attention``, which keeps no T x T array
            (docs/attention.md). ``False`` runs them as written.
        mesh: with ``fsdp_axis``, sharded training (FSDP, ``jmp_lite.distributed.fsdp``):
            ``apply(variables, *batch)`` takes the variables sharded along the mesh axis
            (``jmp_lite.distributed.shard_params``) and splits each batch argument along
            its leading dimension; each parameter is all-gathered where its module reads
            it, in that module's compute dtype (float32 under a float32 rule), and its
            gradient is reduce-scattered in ``reduce_dtype``. The outputs come back
            sharded along the axis. ``rngs=`` are replicated, each device folding in its
            index; ``mutable=`` is refused. Delayed fp8 scaling is refused (current is fine).
        fsdp_axis: the name of the mesh axis to shard along.
        reduce_dtype: the dtype of the gradient reductions (default float32).
        reduce_scatter: how a sharded gradient is reduce-scattered, ``"collective"`` (the default) or
            ``"ring"`` (``jmp_lite.distributed.fsdp``).

    Example:
        >>> import jax, jax.numpy as jnp, flax.linen as nn, jmp_lite.flax
        >>> mlp = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])
        >>> model = jmp_lite.flax.linen.apply_policy(mlp, "p=f32,c=f16,o=f32", {r"layers_2": "f32"})
        >>> variables = model.init(jax.random.key(0), jnp.ones((1, 4)))
        >>> model.policy_of(mlp.bind(variables).layers[1]).compute  # LayerNorm: float32 by default
        dtype('float32')
        >>> policy, recipe = "p=f32,c=bf16,o=f32", "hybrid,delayed,history=16"
        >>> fp8 = jmp_lite.flax.linen.apply_policy(mlp, policy, {"layers_2": policy}, fp8=recipe)
        >>> variables = fp8.init(jax.random.key(0), jnp.ones((1, 4)))
        >>> jax.tree_util.tree_map(jnp.shape, variables["fp8"])  # layers_2 is opted out by its rule
        {'layers_0': {'kernel': Fp8State(fp8_scale=(3,), fp8_amax_history=(3, 16), fp8_amax=(3,))}}
    """
    if not isinstance(module, nn.Module):
        raise TypeError(
            f"apply_policy expects a flax.linen Module, got {type(module).__name__}; "
            "for flax.nnx modules use jmp_lite.flax.nnx.apply_policy"
        )
    opts = front_end_options(
        "apply_policy",
        policy,
        accumulate=accumulate,
        fp8=fp8,
        remat_float32=remat_float32,
        recompute=recompute,
        attention=attention,
        mesh=mesh,
        fsdp_axis=fsdp_axis,
        reduce_dtype=reduce_dtype,
        reduce_scatter=reduce_scatter,
    )
    return PolicyApplied(module, opts, _rules.parse_rules(rules, nn.Module, "Linen"), defaults)
