"""NNX front-end: run an existing ``flax.nnx`` model under a ``Policy``.

``apply_policy(model, policy, rules)`` returns a ``PolicyView``: an ``nnx.Module``
whose only child is the model itself (``view.model``; attribute reads such as
``view.layers`` go to it). Training the view trains the model: they share every
``Variable``, and nothing is copied. Calling the view splits the model
(``nnx.split``), merges it again inside the engine's trace (``nnx.merge``) and
runs it there, then writes the updated state back (``nnx.update``).

While the engine traces the call, each module call opens a named scope with the
policy of its rule (or of its caller), exactly as the Linen front-end does. NNX
has no method interceptor, so, as Flax's own ``nnx.capture(method_outputs=...)``
does, the front-end wraps ``__call__`` of the module classes in the model for the
duration of that trace only, and restores them right after; calls of modules
outside the traced view pass straight through.

Parameters are the model's own storage, so a policy whose ``param`` dtype
differs from a parameter's dtype is refused (``"compute=bf16"`` keeps float32
parameters); see ``apply_policy``.

With ``fp8=`` the contractions that read a parameter run in fp8 (modules a rule
matches opt out). Delayed scaling keeps one ``Fp8State`` per floating parameter of
the modules fp8 applies to (which ones a contraction reads is only known once the
model runs; the others keep their fresh state) in ``Fp8Variable``s that the view
holds (``view.fp8_state``, at the parameter's path), never the model: they are not
``nnx.Param``s, so no optimizer sees them.
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx

from jmp_lite._src.base import caches
from jmp_lite._src.base.policy import Policy
from jmp_lite._src.engine import engine
from jmp_lite._src.flax import module_rules as _rules
from jmp_lite._src.flax.module_rules import RuleKey
from jmp_lite._src.fp8.fp8 import Fp8Recipe, init_fp8_state
from jmp_lite._src.frontends import fp8_weights
from jmp_lite._src.frontends.options import Configured, Options, front_end_options
from jmp_lite._src.parallel import fsdp as _fsdp

DEFAULT_FLOAT32_MODULES: tuple[type, ...] = (nnx.BatchNorm, nnx.LayerNorm, nnx.GroupNorm, nnx.RMSNorm)
"""NNX module classes the default rules keep in float32 (params, statistics and arithmetic)."""

__all__ = ["DEFAULT_FLOAT32_MODULES", "Fp8Variable", "PolicyView", "apply_policy", "policy_of"]


class Fp8Variable(nnx.Variable):
    """The delayed-scaling state of one fp8 contraction: a ``Variable`` whose value is an ``Fp8State``.

    A ``PolicyView`` built with delayed fp8 scaling holds one per weight, in ``view.fp8_state`` at the
    weight's path. It is not an ``nnx.Param``: ``nnx.Optimizer(..., wrt=nnx.Param)`` never updates it.
    Its "gradient" (``jmp_lite.value_and_grad`` takes it along) holds the amaxes a step observed,
    which ``LossScaledOptimizer.update`` turns into the next state (docs/fp8.md).

    Example:
        >>> from flax import nnx
        >>> import jmp_lite.flax.nnx as jnnx
        >>> view = jnnx.apply_policy(nnx.Linear(4, 2, rngs=nnx.Rngs(0)), "compute=bf16", fp8="hybrid,delayed")
        >>> state = view.fp8_state["kernel"]
        >>> type(state).__name__, state.get_value().fp8_amax_history.shape
        ('Fp8Variable', (3, 1024))
    """


class _Config(NamedTuple):
    """What ``apply_policy`` was given: hashable, a static attribute of the view."""

    options: Options
    rules: _rules.Rules
    defaults: bool

    def own(self, path: str, module: nnx.Module) -> engine.Scope | None:
        float32 = DEFAULT_FLOAT32_MODULES if self.defaults else None
        own = _rules.own_policy(self.rules, path, module, self.options.policy, float32)
        return None if own is None else engine.Scope(own, self.options.accumulate)  # a rule opts out of fp8

    @property
    def root(self) -> engine.Scope:
        return self.options.root

    def with_options(self, **changes: Any) -> _Config:
        return self._replace(options=self.options._replace(**changes))


def _modules(model: nnx.Module) -> Iterator[tuple[str, nnx.Module]]:
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            yield "/".join(str(p) for p in path), node


def _static_scopes(model: nnx.Module, config: _Config) -> dict[str, engine.Scope]:
    """Module path -> the scope it runs under when called by its parent (rules inherit)."""
    root = config.root
    scopes: dict[str, engine.Scope] = {}
    for path, module in sorted(_modules(model), key=lambda pm: pm[0].count("/") if pm[0] else -1):
        parent = path.rsplit("/", 1)[0] if "/" in path else ""
        inherited = scopes.get(parent, root) if path else root
        scopes[path] = config.own(path, module) or inherited
    return scopes


class _Calls(NamedTuple):
    """NNX's record of a trace (``engine.Context.frontend``)."""

    # id(module) -> (path, own scope, root scope) for the modules of the view being traced
    active: dict[int, tuple] | None = None
    calling: frozenset[int] = frozenset()  # the modules whose __call__ runs
    params: frozenset[tuple] = frozenset()  # the paths of the view's nnx.Param variables


def _calls() -> _Calls:
    current = engine.context().frontend
    return current if isinstance(current, _Calls) else _Calls()


_PATCH_LOCK = threading.Lock()
_PATCHED: dict[type, list] = {}  # class -> [original __call__, number of traces using it]


def _scoped(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls = _calls()
        active, calling = calls.active, calls.calling
        entry = None if active is None else active.get(id(self))
        if entry is None or id(self) in calling:  # not ours, or super().__call__ of a module already in
            return original(self, *args, **kwargs)
        path, own, root = entry
        with engine.entering(frontend=calls._replace(calling=calling | {id(self)})):
            call = lambda: original(self, *args, **kwargs)  # noqa: E731
            # the path below the calling module ("blocks/0" when the model calls self.blocks[0]): scope names
            # then spell module paths, which a precision report's suggested rules need
            caller = max((active[i][0] for i in calling if i in active), key=len, default="")
            label = (path[len(caller) + 1 :] if caller else path) or type(self).__name__
            return _rules.call_module(self, path, own, root, call, True, label)

    return __call__


@contextlib.contextmanager
def _module_calls(model: nnx.Module, config: _Config) -> Iterator[None]:
    """Module calls of ``model`` open their engine scopes while the block runs."""
    root = config.root
    entries = {}
    owners: set[type] = set()
    for path, module in _modules(model):
        entries[id(module)] = (path, config.own(path, module), root)
        for cls in type(module).__mro__:  # the class whose __call__ runs
            if "__call__" in vars(cls):
                owners.add(cls)
                break
    owners.discard(nnx.Module)
    with _PATCH_LOCK:
        for cls in owners:
            if cls not in _PATCHED:
                _PATCHED[cls] = [vars(cls)["__call__"], 0]
                cls.__call__ = _scoped(_PATCHED[cls][0])
            _PATCHED[cls][1] += 1
    try:
        with engine.entering(frontend=_calls()._replace(active=entries)):
            yield
    finally:
        with _PATCH_LOCK:
            for cls in owners:
                _PATCHED[cls][1] -= 1
                if not _PATCHED[cls][1]:
                    cls.__call__ = _PATCHED.pop(cls)[0]


def _split_outputs(out: tuple) -> tuple:
    # the model's outputs take policy.output; its updated state keeps its dtypes
    return jax.tree_util.tree_map(lambda _: True, out[0]), jax.tree_util.tree_map(lambda _: False, out[1])


def _param_paths(state: nnx.State) -> frozenset[tuple]:
    return frozenset(
        tuple(str(k) for k in path) for path, var in nnx.to_flat_state(state) if isinstance(var, nnx.Param)
    )


def _roles(graphdef: Any, state: nnx.State, fp8_states: dict, *args: Any, **kwargs: Any) -> tuple:
    """The engine roles of ``traced_call``'s arguments: each ``nnx.Param`` read in its module's compute
    dtype, and the fields of its fp8 state (``fp8_states``: ``{"path/of/kernel": Fp8State}``)."""
    params, owners = _calls().params, _rules.recorded()

    def role(path: tuple, _: Any) -> engine.Param | None:
        names = tuple(str(fp8_weights.key_name(k)) for k in path)
        found = _rules.owner(owners, list(names)) if names in params else None
        return None if found is None else engine.Param(found.policy.compute, "/".join(names))

    variables = jax.tree_util.tree_map_with_path(role, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    states = {name: fp8_weights.state_roles(name) for name in fp8_states}
    return ((None, variables, states, *(None for _ in args)), None)


@caches.lru_cache("nnx.runners", 64)
def _runner(config: _Config, options: tuple = ()) -> Callable[..., Any]:
    def traced_call(graphdef: Any, state: Any, fp8_states: Any, *args: Any, **kwargs: Any) -> tuple:
        del fp8_states  # read by the engine (roles from _roles)
        model = nnx.merge(graphdef, state)
        with _module_calls(model, config):
            out = model(*args, **kwargs)
        return out, nnx.state(model)

    def traced_changes(graphdef: Any, state: Any, fp8_states: Any, *args: Any, **kwargs: Any) -> tuple:
        # sharded calls return only the state the call replaced (told by identity while traced here,
        # before the engine re-emits the program); parameters and RNG keys never
        model = nnx.merge(graphdef, state)
        before = {p: v.get_value() for p, v in nnx.to_flat_state(nnx.state(model))}
        with _module_calls(model, config):
            out = model(*args, **kwargs)
        changed = {
            "/".join(map(str, p)): v.get_value()
            for p, v in nnx.to_flat_state(nnx.state(model))
            if before.get(p) is not v.get_value() and not isinstance(v, (nnx.Param, nnx.RngKey))
        }
        return out, changed

    options = {**config.options.engine_options(), **dict(options)}
    traced = traced_call if config.options.sharding is None else traced_changes
    return engine.transform(traced, config.root, inputs=_roles, outputs=_split_outputs, **options)


# (config, graphdef) of the views whose model was checked for a contraction fp8 reads
_FP8_CHECKED = caches.BoundedCache("nnx.fp8_checked", 64)


def _check_fp8_reads_a_weight(
    config: _Config, graphdef: Any, state: nnx.State, args: tuple, kwargs: dict
) -> None:
    """Warns when no contraction of the model reads a weight, so that fp8 changes nothing (a
    convolution-only network): found by tracing the model once more, abstractly, on its first call
    (per model structure and config; a view is built before its model runs)."""
    key = (config, graphdef)
    if key in _FP8_CHECKED:
        return
    current = config._replace(options=config.options.discovering())
    counts = fp8_weights.discover(_runner(current), graphdef, state, {}, *args, **kwargs)
    fp8_weights.warn_if_unused(fp8_weights.used(counts), "apply_policy", stacklevel=3)
    _FP8_CHECKED[key] = True


def fp8_variables(node: nnx.Module, name: str = "fp8_state", kind: type = Fp8Variable) -> dict[tuple, Any]:
    """``{parameter path: variable}`` of the ``kind`` variables nested under ``node.<name>`` (a view's
    fp8 states; empty without delayed fp8 scaling)."""
    found = vars(node).get(name, {})
    return dict(fp8_weights.flat(found, lambda x: isinstance(x, kind)))


def _fp8_candidates(model: nnx.Module, config: _Config) -> dict:
    """A fresh ``Fp8Variable`` per floating parameter whose module fp8 applies to, nested by the
    parameter's path (``nnx.Param`` paths, list indices included)."""
    scopes = _static_scopes(model, config)
    found = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = var.get_value()
        scope = _rules.owner(scopes, [str(p) for p in path]) or scopes[""]
        if scope.fp8 is not None and jax.numpy.issubdtype(value.dtype, jax.numpy.floating):
            found[tuple(path)] = Fp8Variable(init_fp8_state(config.options.fp8))
    return fp8_weights.nest(found)


def _sharded_call(
    sharding: _fsdp.FsdpOptions,
    run: Callable[..., Any],
    graphdef: Any,
    state: nnx.State,
    args: tuple,
    kwargs: dict,
) -> tuple:
    """``run`` with ``mesh=``/``fsdp_axis=``: the model's variables sharded, each parameter gathered where
    its module reads it; the arguments split along their leading dimension. Returns the outputs and the
    model's state with what the call changed (RNG counts), which every device must agree on."""
    _fsdp.check_keywords(kwargs, "apply_policy")

    def local(local_state: nnx.State, *batch: Any) -> tuple:
        return run(graphdef, local_state, {}, *batch, **kwargs)  # (outputs, {path: changed state})

    def state_outputs(outs: tuple) -> tuple:
        return jax.tree_util.tree_map(lambda _: False, outs[0]), jax.tree_util.tree_map(
            lambda _: True, outs[1]
        )

    out, changed = _fsdp.sharded_by(local, sharding, state_outputs)(state, *args)
    flat = nnx.to_flat_state(state)
    new = [(p, v.replace(changed.get("/".join(map(str, p)), v.get_value()))) for p, v in flat]
    return out, nnx.from_flat_state(new)


class PolicyView(Configured, nnx.Module):
    """An NNX model running under a mixed-precision policy; build it with ``apply_policy``.

    ``view(...)`` calls the model under the policy; ``view.model`` is the model itself, and
    other attributes are read from it (``view.layers[0]``).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jmp_lite.flax.nnx as jnnx
        >>> model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
        >>> view = jnnx.apply_policy(model, "p=f32,c=bf16,o=f32")
        >>> view.model is model, view.kernel is model.kernel, view(jnp.ones((1, 4))).dtype
        (True, True, dtype('float32'))
    """

    _jmp_lite_options: tuple = ()  # extra engine.transform options: a precision report's observer
    # False on a precision report's variants: they run inside the report's own jit and vjp, where NNX
    # refuses to write back to the model (TraceContextError), and the two runs must see the same dropout.
    _jmp_lite_write_back: bool = True

    def __init__(self, model: nnx.Module, config: _Config) -> None:
        self.model = model
        self._jmp_lite_config = config
        if config.options.fp8 is not None and config.options.fp8.stateful:
            self.fp8_state = nnx.data(_fp8_candidates(model, config))

    def _front_end_options(self) -> Options:
        return self._jmp_lite_config.options

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or "model" not in vars(self):
            raise AttributeError(name)
        return getattr(vars(self)["model"], name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        graphdef, state = nnx.split(self.model)
        fp8_states = {"/".join(map(str, p)): var.get_value() for p, var in fp8_variables(self).items()}
        if self.fp8_recipe is not None:
            fp8_weights.refuse_float64((state, args, kwargs), "apply_policy(fp8=...)")
        with engine.entering(frontend=_calls()._replace(params=_param_paths(state))), _rules.recording():
            if self.fp8_recipe is not None and self._jmp_lite_write_back:  # not a report's variant
                _check_fp8_reads_a_weight(self._jmp_lite_config, graphdef, state, args, kwargs)
            run = _runner(self._jmp_lite_config, self._jmp_lite_options)
            if self._jmp_lite_config.options.sharding is None:
                out, new_state = run(graphdef, state, fp8_states, *args, **kwargs)
            else:
                out, new_state = _sharded_call(
                    self._jmp_lite_config.options.sharding, run, graphdef, state, args, kwargs
                )
        before = {path: var.get_value() for path, var in nnx.to_flat_state(state)}
        changed = [(p, v) for p, v in nnx.to_flat_state(new_state) if before.get(p) is not v.get_value()]
        if changed and self._jmp_lite_write_back:  # batch statistics, RNG counts, sown values; not params
            nnx.update(self.model, nnx.from_flat_state(changed))
        return out

    def __jmp_lite_differentiated__(self) -> Any:
        """The variables a gradient of this view must reach (``jmp_lite.value_and_grad`` reads it): its
        fp8 states as well as the parameters under delayed fp8 scaling, else None (the caller's)."""
        return (nnx.Param, Fp8Variable) if fp8_variables(self) else None

    def __jmp_lite_model__(self) -> engine.ModelUnderPolicy:
        """The model as tools that re-run it see it (``engine.ModelUnderPolicy``)."""
        config = self._jmp_lite_config
        rules = tuple((k.pattern if isinstance(k, re.Pattern) else k, p) for k, p in config.rules)
        return engine.ModelUnderPolicy(
            "nnx", type(self.model).__name__, config.options.policy, rules, config.options.fp8, self._variant
        )

    def _variant(self, policy: Policy | None = None, **options: Any) -> PolicyView:
        """A view for ``jmp_lite.precision_report``: every module under ``policy`` when given (its float32
        reference: rules keep their modules, so the program is the same), its engine program built with
        extra ``engine.transform`` options (an observer)."""
        config = self._jmp_lite_config.with_options(sharding=None)  # a report measures on one device
        if policy is not None:
            config = config.with_options(policy=policy)
            config = config._replace(rules=tuple((key, policy) for key, _ in config.rules))
        other = PolicyView(self.model, config)
        other._jmp_lite_options = tuple(options.items())
        other._jmp_lite_write_back = False
        return other

    def policy_of(self, module: nnx.Module) -> Policy:
        """The policy ``module`` (a module of the model) runs under: its rule's, else its parent's.

        Example:
            >>> from flax import nnx
            >>> import jmp_lite.flax.nnx as jnnx
            >>> seq = nnx.Sequential(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), nnx.LayerNorm(2, rngs=nnx.Rngs(0)))
            >>> view = jnnx.apply_policy(seq, "p=f32,c=bf16,o=f32")
            >>> view.policy_of(seq.layers[1])  # LayerNorm: float32 inside, bfloat16 out
            Policy(param=f32, compute=f32, output=bf16)
        """
        scopes = _static_scopes(self.model, self._jmp_lite_config)
        for path, node in _modules(self.model):
            if node is module:
                return scopes[path].policy
        raise ValueError(f"{type(module).__name__} is not a module of this view's model")


def policy_of(view: PolicyView, module: nnx.Module | None = None) -> Policy:
    """``view.policy_of(module)`` (the model-wide policy without ``module``).

    Example:
        >>> from flax import nnx
        >>> import jmp_lite.flax.nnx as jnnx
        >>> view = jnnx.apply_policy(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), "p=f32,c=f16,o=f32")
        >>> jnnx.policy_of(view).compute, jnnx.policy_of(view, view.model).compute
        (dtype('float16'), dtype('float16'))
    """
    if not isinstance(view, PolicyView):
        raise TypeError(
            f"policy_of takes the view apply_policy returned (and optionally one of its model's "
            f"modules): policy_of(view, module) or view.policy_of(module); got {type(view).__name__}"
        )
    return view.policy if module is None else view.policy_of(module)


def _check_storage(model: nnx.Module, config: _Config, spec: str) -> None:
    # NNX parameters are the model's own storage: a view never holds copies of its own.
    scopes = _static_scopes(model, config)
    offenders: dict[str, dict] = {}  # module path -> what its rule stores, what the model does, which params
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        names = [str(p) for p in path]
        value = var.get_value()
        if not jax.numpy.issubdtype(value.dtype, jax.numpy.floating):
            continue
        wanted = np.dtype((_rules.owner(scopes, names) or scopes[""]).policy.param)
        if np.dtype(value.dtype) == wanted:
            continue
        where, stored = "/".join(names), np.dtype(value.dtype).name
        rule = _deciding_rule(model, config, names)
        if rule is None:
            raise ValueError(
                f"the model stores {where} in {stored} but the policy {spec!r} stores "
                f"parameters in {wanted.name}. NNX parameters are the model's own storage, so "
                "apply_policy does not copy them: use a policy with that param dtype, e.g. "
                "'compute=bf16' (float32 parameters, bfloat16 compute and output) or "
                "'p=f32,c=bf16,o=f32' (float32 outputs too), or create the model with "
                f"param_dtype={wanted.name} to train in {wanted.name}."
            )
        at, module, own = rule
        found = offenders.setdefault(at, {"module": module, "own": own, "stored": stored, "params": []})
        found["params"].append(where)
    if offenders:
        raise ValueError(_storage_message(offenders, config, spec))


def _rule_key(key: Any) -> str:
    """A rule key as the user would write it: ``nnx.LayerNorm``, ``MyNorm`` or ``'blocks/0'``."""
    if isinstance(key, re.Pattern):
        return repr(key.pattern)
    return f"nnx.{key.__name__}" if getattr(nnx, key.__name__, None) is key else key.__name__


def _storage_message(offenders: dict[str, dict], config: _Config, spec: str) -> str:
    """Every module whose rule stores parameters in another dtype than the model does (grouped by rule),
    and one ``rules=`` dict that fits them all: the user's rules, those at fault with the model's
    storage, and a class rule per class the built-in float32 rule put there."""
    groups: dict[tuple, list[str]] = {}  # (why, the rule's policy, stored dtype) -> module paths
    fixes, wanted, builtin = {}, set(), False
    for at, found in offenders.items():
        module, own = found["module"], found["own"]
        cls, policy = type(module).__name__, config.own(at, module).policy
        fix = Policy(np.dtype(found["stored"]), policy.compute, policy.output)  # the rule, with this storage
        wanted.add(np.dtype(policy.param).name)
        if own is None:
            builtin = True
            why = f"the built-in float32 rule for {cls} (DEFAULT_FLOAT32_MODULES: normalization layers)"
            key = _rule_key(type(module))
            if fixes.get(key, fix) != fix:  # another instance of the class stores another dtype
                key = repr(re.escape(at))
        else:
            key = _rule_key(_rules.own_rule(config.rules, at, module)[0])
            why = f"your rule for {at!r} ({cls})" if len(offenders) == 1 else f"your rule {key} ({cls})"
        fixes.setdefault(key, fix)
        groups.setdefault((why, policy, found["stored"]), []).append(at)
    lines = []
    for (why, policy, stored), paths in groups.items():
        rule = f"{why}, whose policy {str(policy)!r} stores parameters in {np.dtype(policy.param).name}"
        if len(paths) == 1:
            params = ", ".join(offenders[paths[0]]["params"])
            lines.append(f"the model stores {params} in {stored}, but {paths[0]!r} runs under {rule}")
        else:
            names = ", ".join(map(repr, paths))
            lines.append(f"the model stores the parameters of {names} in {stored}, but they run under {rule}")
    # the user's rules first, in their order (those at fault fixed), then the new class rules
    suggested = {_rule_key(k): str(p) for k, p in config.rules}
    suggested.update({key: str(fix) for key, fix in fixes.items()})
    rules = "{" + ", ".join(f"{k}: {v!r}" for k, v in suggested.items()) + "}"
    those = "that module" if len(offenders) == 1 else "those modules"
    dtype = next(iter(wanted)) if len(wanted) == 1 else "the dtype its rule stores"
    if len(lines) == 1:
        head = f"{lines[0]} (not the model-wide policy {spec!r}). "
    else:
        head = (
            f"{len(offenders)} modules run under rules that store parameters in another dtype than the model"
        )
        head += (
            f" does (the model-wide policy is {spec!r}):" + "".join(f"\n- {line}" for line in lines) + "\n"
        )
    fixed = f"rules={rules}" + (", or defaults=False" if builtin else "")
    return (
        f"{head}NNX parameters are the model's own storage, so apply_policy does not copy them: pass "
        f"{fixed}, or create {those} with param_dtype={dtype}."
    )


def _deciding_rule(
    model: nnx.Module, config: _Config, names: list[str]
) -> tuple[str, nnx.Module, Any] | None:
    """The nearest module on a parameter's path with a rule of its own: (path, module, the user's
    rule's policy or ``None`` for a built-in default); ``None`` when the model-wide policy decides."""
    modules = dict(_modules(model))
    for k in range(len(names) - 1, -1, -1):
        at = "/".join(names[:k])
        module = modules.get(at)
        if module is not None and config.own(at, module) is not None:
            return at, module, _rules.own_policy(config.rules, at, module, config.options.policy, None)
    return None


def _check_shared_modules(model: nnx.Module, config: _Config) -> None:
    # A module reachable by several paths has one scope: its rules must agree on all paths.
    for paths in nnx.find_duplicates(model):
        node = model
        for part in paths[0]:
            node = node[part] if isinstance(node, (nnx.List, nnx.Dict)) else getattr(node, str(part))
        if not isinstance(node, nnx.Module):
            continue
        names = ["/".join(str(p) for p in path) for path in paths]
        got = [config.own(n, node) for n in names]
        if len(set(got)) > 1:
            policies = ", ".join(str(g.policy) if g else "the caller's" for g in got)
            raise ValueError(
                f"the module shared at paths {names} matches different rules ({policies}); "
                "a shared module has one dtype: make the rules agree"
            )


def apply_policy(
    model: nnx.Module,
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
) -> PolicyView:
    """A view of an NNX model that runs under ``policy``, with per-class and per-path exceptions.

    Args:
        model: any ``nnx.Module``; it is not modified (the view shares its variables).
        policy: the model-wide ``Policy`` or policy string. Its ``param`` dtype must be the
            dtype the model stores its parameters in: ``"p=f32,c=bf16,o=f32"`` (float32
            parameters and outputs, bfloat16 compute) or ``"compute=bf16"`` (outputs in
            bfloat16 too) for a float32 model. A bare
            ``"bfloat16"`` means bfloat16 parameters too, and is refused for a float32 model.
        rules: ``{nnx.LayerNorm: "f32", r"blocks/\\d+/mlp": "p=f32,c=f16,o=f16", ...}``.
            Keys are module classes or regexes matched in full against the module path
            (attribute names and list indices joined by ``/``). A rule applies to the
            module it matches and to everything that module calls, unless a rule matches inside.
        defaults: keep ``DEFAULT_FLOAT32_MODULES`` (normalization layers) in float32.
        accumulate: 16-bit matmuls and convolutions accumulate in float32, forward and
            backward (``jmp_lite.accumulate``); ``False`` runs them as ``jax.lax`` does.
        fp8: a ``jmp_lite.Fp8Recipe`` or its string form: contractions that read a
            parameter (Linear, LinearGeneral, Einsum, attention projections) run in fp8,
            except in modules a rule matches (a rule opts a module out); attention scores
            and convolutions stay 16-bit. Delayed scaling keeps its states in the view's
            ``Fp8Variable``s (``view.fp8_state``; docs/fp8.md).
        remat_float32: under a 16-bit compute dtype, the backward pass keeps 16-bit
            activations and rebuilds float32 values (norms, softmax) from them
            (``jax.checkpoint``; docs/memory.md). ``False`` keeps what JAX would keep. A model
            with checkpoints of its own (``nnx.remat``) keeps what they say instead.
        recompute: ``"wide_contractions"``: the backward pass also rebuilds the results of
            contractions wider than their operands (the MLP's up-projection) from their input,
            one layer at a time, instead of keeping them (docs/memory.md). ``None``: kept.
        attention: under a 16-bit compute dtype, ``softmax(q k^T) v`` chains run as the
            blockwise kernel of ``jmp_lite.attention``, which keeps no T x T array
            (docs/attention.md). ``False`` runs them as written.
        mesh: with ``fsdp_axis``, sharded training (FSDP, ``jmp_lite.distributed.fsdp``):
            the model's variables stay sharded along the mesh axis (place them with
            ``nnx.update(model, jmp_lite.distributed.shard_params(nnx.state(model), mesh,
            axis))``), each call splits its arguments along their leading dimension, each
            parameter is all-gathered where its module reads it, in that module's compute
            dtype, and its gradient is reduce-scattered in ``reduce_dtype``. Outputs come
            back sharded along the axis; state every device agrees on (RNG counts) is
            written back, state that differs (BatchNorm statistics in training) is refused.
            Delayed fp8 scaling is refused (current is fine).
        fsdp_axis: the name of the mesh axis to shard along.
        reduce_dtype: the dtype of the gradient reductions (default float32).
        reduce_scatter: how a sharded gradient is reduce-scattered, ``"collective"`` (the default) or
            ``"ring"`` (``jmp_lite.distributed.fsdp``).

    Example:
        >>> import jax.numpy as jnp
        >>> from flax import nnx
        >>> import jmp_lite.flax.nnx as jnnx
        >>> mlp = nnx.Sequential(nnx.Linear(4, 8, rngs=nnx.Rngs(0)), nnx.LayerNorm(8, rngs=nnx.Rngs(0)))
        >>> view = jnnx.apply_policy(mlp, "p=f32,c=bf16,o=f32")
        >>> view.model is mlp, view(jnp.ones((2, 4))).dtype
        (True, dtype('float32'))
        >>> jnnx.apply_policy(mlp, "bfloat16")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ValueError: the model stores layers/0/bias in float32 but the policy 'bfloat16' stores parameters ...
    """
    spec = policy if isinstance(policy, str) else str(policy)
    if isinstance(model, PolicyView):
        raise ValueError(
            "model is already a policy view; apply the policy to the original model (view.model)"
        )
    if not isinstance(model, nnx.Module):
        raise TypeError(f"apply_policy expects a flax.nnx Module, got {type(model).__name__}")
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
    config = _Config(opts, _rules.parse_rules(rules, nnx.Module, "NNX"), bool(defaults))
    classes = {path: type(module) for path, module in _modules(model)}
    missing = _rules.unmatched(config.rules, classes)
    if missing:  # an NNX model's modules are all there before it runs
        raise ValueError(_rules.unmatched_message(missing, classes, type(model).__name__))
    _check_shared_modules(model, config)
    _check_storage(model, config, spec)
    return PolicyView(model, config)
