"""``autocast``: the engine's front-end for plain JAX functions (Equinox models, hand-written code)."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from jmp_lite._src.base.policy import Policy
from jmp_lite._src.engine import engine
from jmp_lite._src.fp8.fp8 import Fp8Recipe
from jmp_lite._src.fp8.fp8 import init_fp8_state as _fresh_state
from jmp_lite._src.frontends import fp8_weights
from jmp_lite._src.frontends.options import Options, front_end_options
from jmp_lite._src.parallel import fsdp as _fsdp

__all__ = ["autocast", "float32_region"]


@contextlib.contextmanager
def float32_region() -> Iterator[None]:
    """Keeps the ops traced inside the ``with`` block in float32 under ``autocast``.

    Contractions inside run in float32 too. Outside a function that ``autocast``
    (or ``apply_policy``) is tracing it changes nothing, so it warns.

    Example:
        >>> import jax, jax.numpy as jnp, jmp_lite
        >>> def f(x, w):
        ...     with jmp_lite.float32_region():
        ...         return x @ w
        >>> x = jnp.ones((2, 3))
        >>> jmp_lite.autocast(f, "p=f32,c=bf16,o=bf16")(x, x.T).dtype
        dtype(bfloat16)
        >>> "bf16" in str(jax.make_jaxpr(jmp_lite.autocast(f, "p=f32,c=bf16,o=f32"))(x, x.T))
        False
    """
    if not engine.context().tracing:
        warnings.warn(
            "jmp_lite.float32_region() is used outside jmp_lite.autocast, where it changes "
            "nothing: call the function through autocast(fun, policy) (or @autocast(policy)).",
            stacklevel=3,  # the user's `with` line (this generator, contextlib, the caller)
        )
    with jax.named_scope(engine.FLOAT32_SCOPE):
        yield


class _Decorator:
    """What ``autocast(policy)`` returns: applied to a function, that function under autocast (its
    options were checked when the decorator was made, and are not checked again)."""

    def __init__(self, opts: Options, rules: dict[str, str]) -> None:
        self._options, self._rules = opts, rules

    def __call__(self, fun: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(fun):
            raise TypeError(f"autocast(policy) decorates a callable, got {type(fun).__name__}")
        return _autocast(fun, self._options, self._rules)

    def __enter__(self) -> None:
        raise TypeError(
            "jmp_lite.autocast is a function transformation, not a context manager: it has to "
            "trace the whole function. Write autocast(fun, policy) or decorate the function with "
            "@jmp_lite.autocast(policy); inside it, `with jmp_lite.float32_region():` keeps a "
            "block in float32."
        )

    def __exit__(self, *exc: object) -> None:
        return None

    def __repr__(self) -> str:
        return f"jmp_lite.autocast({self._options.policy!r}) decorator"


def autocast(
    fun: Callable[..., Any] | Policy | str,
    policy: Policy | str | None = None,
    *,
    rules: Mapping[str, str] | None = None,
    remat_float32: bool = True,
    recompute: str | None = None,
    attention: bool = True,
    fp8: Fp8Recipe | str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    fsdp_axis: str | None = None,
    reduce_dtype: Any = None,
    reduce_scatter: str | None = None,
) -> Callable[..., Any]:
    """Returns ``fun`` evaluated under mixed-precision dtype rules.

    ``autocast(fun, policy)`` traces ``fun`` for the shapes and dtypes of its
    array arguments (non-array leaves such as Python numbers and strings are
    static: a new value retraces), rewrites the program with the rules below
    and caches the traced program per input signature. ``autocast(policy)``
    is the decorator form.

    Rules (``rules`` maps a primitive name, or ``"scope:<named scope>"``, to a
    mode and overrides the defaults; modes: ``"compute"``,
    ``"compute_no_accumulate"`` (16-bit contractions without float32
    accumulation, forward mode works), ``"float32"``, ``"follow"``,
    ``"as_written"``):

    * ``dot_general``/``conv_general_dilated``: operands in ``policy.compute``;
      with a 16-bit compute dtype the product accumulates in float32 and is
      rounded once to the compute dtype, ``y = round_c(sum_k x_ik w_kj)``
      (forward and backward, ``jmp_lite.accumulate``).
    * exp, log, log1p, expm1, logistic, sqrt, rsqrt, pow, erf, erf_inv,
      reduce_sum/prod, cumsum/cumprod/cumlogsumexp, ...: float32.
    * listed elementwise and data-movement ops: the dtype the operands arrive
      in, the widest winning (weak Python scalars never widen).
    * anything else, and integer/boolean/key/float64 values: as written.
    * floating outputs (not float64) are cast to ``policy.output``.

    Under ``jax.grad`` the table holds in the backward pass too: contractions
    accumulate in float32, and the sums that derivative rules add (the transpose
    of a broadcast, of ``reduce_max``, of a gather) run in float32. An explicit
    ``precision=jax.lax.Precision.HIGHEST`` (or ``"highest"``/``"float32"``) on a
    contraction is honoured: it runs in float32; an explicit dot algorithm runs
    as written.

    Memory: with a 16-bit compute dtype, what ``jax.grad`` keeps for the backward pass is
    16-bit (plus per-row float32 statistics): float32 activations (the math inside norms and
    softmax) and boolean masks are rebuilt from the 16-bit values in the backward pass
    (``jax.checkpoint``). ``remat_float32=False`` keeps them instead (more memory, no
    recomputation). ``recompute="wide_contractions"`` also rebuilds the results of
    contractions wider than their operands (an MLP's up-projection) and the elementwise math
    that reads them, one layer at a time: less memory, one more run of those contractions
    (docs/memory.md). A program with checkpoints of its own (``jax.checkpoint``, Flax's
    ``nn.remat``) keeps what they say instead (docs/memory.md).

    Attention: with a 16-bit compute dtype, attention written as matmul, softmax, matmul
    (``jax.nn.dot_product_attention``, Flax's, Equinox's or by hand; causal, masked, biased)
    runs as ``jmp_lite.attention.dot_product_attention``, which keeps no T x T array: blockwise
    on CPU, cuDNN on GPU. Chains with dropout on the weights, or whose weights are used
    elsewhere, run as written. ``attention=False`` runs every chain as written.

    ``autocast`` is not a context manager (it must trace the whole function):
    ``with autocast(policy):`` raises a ``TypeError`` naming the two forms.

    Higher-order primitives are rewritten inside: nested ``jit`` (without
    explicit shardings), ``scan``, ``while``, ``cond``, ``checkpoint`` and
    ``shard_map``. A ``custom_jvp``/``custom_vjp`` function's primal body is
    rewritten; its derivative rule is the user's own, evaluated at the dtypes
    it was traced with, with casts at its boundary.

    ``fp8=`` (a ``jmp_lite.Fp8Recipe`` or its string form) runs every
    ``dot_general`` that reads an array argument of ``fun`` (moved, reshaped or
    cast, not computed from) as ``jmp_lite.fp8.dot_general``: ``x @ w`` with
    both arguments reads ``w``; a product of two computed values (attention
    scores) and convolutions stay 16-bit. With delayed scaling the states go in
    and out explicitly: ``f.init_fp8_state(*args, **kwargs)`` traces ``fun``
    once and returns the states in the shape every front-end keeps them in:
    nested dicts by parameter path, here the argument's position (as a string)
    or keyword, then the keys inside (``states["0"]["w1"]`` for
    ``f({"w1": ...}, x)``, as Linen's ``variables["fp8"]["Dense_0"]["kernel"]``).
    The function takes them as ``f(*args, fp8_state=states)``, and the observed
    amaxes are their gradient, for ``jmp_lite.fp8.update_fp8_state``
    (docs/fp8.md). Current scaling needs no state.

    ``mesh=`` and ``fsdp_axis=`` run ``fun(params, *batch)`` sharded, as
    ``jmp_lite.distributed.fsdp`` does: the first argument's parameters sharded
    along the mesh axis and each gathered where first read, in the dtype these
    rules read it in; the other arguments split along their leading dimension;
    gradients reduce-scattered in ``reduce_dtype`` (default float32), by the
    compiler's collective or, with ``reduce_scatter="ring"``, by the ring
    algorithm written out (docs/distributed.md).

    Example:
        >>> import jax, jax.numpy as jnp, jmp_lite
        >>> @jmp_lite.autocast("params=float32,compute=bfloat16,output=float32")
        ... def loss(w, x):
        ...     return jnp.mean(jnp.exp(jnp.tanh(x @ w)))
        >>> w, x = jnp.ones((4, 3)), jnp.ones((2, 4))
        >>> loss(w, x).dtype, jax.grad(loss)(w, x).dtype
        (dtype('float32'), dtype('float32'))
        >>> program = str(jax.make_jaxpr(loss)(w, x))
        >>> "bf16[2,4] = convert_element_type" in program  # x cast for the matmul
        True
        >>> def precise(w, x):
        ...     return jnp.matmul(x, w, precision="highest")
        >>> precise = jmp_lite.autocast(precise, "p=f32,c=bf16,o=f32")
        >>> "bf16" in str(jax.make_jaxpr(precise)(w, x))  # precision=HIGHEST is honoured
        False
        >>> recipe = "hybrid,delayed,history=4"
        >>> f = jmp_lite.autocast(lambda p, x: x @ p["w"], "p=f32,c=bf16,o=f32", fp8=recipe)
        >>> states = f.init_fp8_state({"w": w}, x)
        >>> jax.tree.map(jnp.shape, states)  # one state per weight an fp8 contraction reads
        {'0': {'w': Fp8State(fp8_scale=(3,), fp8_amax_history=(3, 4), fp8_amax=(3,))}}
        >>> observed = jax.grad(lambda s: f({"w": w}, x, fp8_state=s).sum())(states)
        >>> observed["0"]["w"].fp8_amax  # |x|, |w|, |d out|
        Array([1., 1., 1.], dtype=float32)
    """
    keywords = {
        "fp8": fp8,
        "remat_float32": remat_float32,
        "recompute": recompute,
        "attention": attention,
        "mesh": mesh,
        "fsdp_axis": fsdp_axis,
        "reduce_dtype": reduce_dtype,
        "reduce_scatter": reduce_scatter,
    }
    if policy is None:
        if callable(fun) and not isinstance(fun, (Policy, str)):
            raise TypeError("autocast(fun, policy): a policy is required")
        opts = front_end_options("autocast", fun, **keywords)
        return _Decorator(opts, engine.check_rules(rules))
    if not callable(fun):
        raise TypeError(f"autocast expects a callable as its first argument, got {type(fun).__name__}")
    opts = front_end_options("autocast", policy, **keywords)
    return _autocast(fun, opts, engine.check_rules(rules))


def _autocast(fun: Callable[..., Any], opts: Options, rules: dict[str, str]) -> Callable[..., Any]:
    """``autocast(fun, ...)`` of checked options and rules."""
    if opts.fp8 is None:
        run = functools.wraps(fun)(engine.transform(fun, opts.root, rules=rules, **opts.engine_options()))
    else:
        run = _fp8_autocast(fun, opts, rules)
    if opts.sharding is None:
        return run
    # the first argument (the parameters) sharded along the axis and gathered where read; the rest split
    return functools.wraps(fun)(_fsdp.sharded_by(run, opts.sharding))


def _argument_names(args: tuple, kwargs: dict) -> Any:
    """``(args, kwargs)`` with each leaf replaced by its name: its argument's position (or keyword), then
    the keys inside it (``"0/w1"``)."""
    return jax.tree_util.tree_map_with_path(lambda p, _: fp8_weights.path_name(p[1:]), (args, kwargs))


def _fp8_roles(states: dict, args: tuple, kwargs: dict) -> tuple:
    """Every array argument of ``fun`` is a weight; ``states[name]`` is the state of the argument ``name``
    (``fp8_weights.by_name`` of what the caller passed)."""
    names = _argument_names(args, kwargs)
    leaves = zip(jax.tree_util.tree_leaves(names), jax.tree_util.tree_leaves((args, kwargs)))
    arrays = [name for name, x in leaves if fp8_weights.is_array(x)]
    unknown = sorted(set(map(str, states)) - set(arrays))
    if unknown:
        raise ValueError(
            f"autocast: fp8_state has states for {unknown}, which name no array argument of this call; "
            f"its array arguments are {sorted(arrays)}. Build the states with f.init_fp8_state(*args)"
        )
    params = jax.tree_util.tree_map(lambda name: engine.Param(None, name), names)
    return (({k: fp8_weights.state_roles(str(k)) for k in states}, *params), None)


def _fp8_autocast(fun: Callable[..., Any], opts: Options, rules: dict[str, str]) -> Callable[..., Any]:
    recipe = opts.fp8
    assert recipe is not None

    def traced(states: dict, args: tuple, kwargs: dict) -> Any:
        del states  # read by the engine (Inputs.fp8_states), not by fun
        return fun(*args, **kwargs)

    keywords = {"rules": rules, "inputs": _fp8_roles, **opts.engine_options()}
    run = engine.transform(traced, opts.root, **keywords)
    # the weights fp8 reads, found by tracing once; current scaling runs without states
    discovery = engine.transform(traced, opts.discovering().root, **keywords)

    @functools.wraps(fun)
    def wrapped(*args: Any, fp8_state: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        if fp8_state is None and recipe.stateful:
            raise ValueError(
                f"autocast(fp8={str(recipe)!r}): delayed scaling reads each weight's scale from its state; "
                "call f(*args, fp8_state=states) with states = f.init_fp8_state(*args) (kept and updated "
                "with jmp_lite.fp8.update_fp8_state), or use current scaling"
            )
        if fp8_state is not None and not isinstance(fp8_state, Mapping):
            raise TypeError(
                "autocast: fp8_state must be the dict f.init_fp8_state returns (nested by argument path, "
                f"an Fp8State at each weight), got {type(fp8_state).__name__}"
            )
        states = fp8_weights.by_name(fp8_state or {}, "autocast: fp8_state")
        fp8_weights.refuse_float64((args, kwargs), "autocast(fp8=...)")
        return run(states, args, kwargs)

    def init_fp8_state(*args: Any, **kwargs: Any) -> dict[str, Any]:
        """A fresh ``Fp8State`` for each weight fp8 contractions read in ``fun(*args, **kwargs)``, nested
        by argument path (delayed scaling; ``{}`` for current scaling)."""
        if not recipe.stateful:
            return {}
        (_, *counts), _ = fp8_weights.discover(discovery, {}, args, kwargs)
        paths = {p[1:]: n for p, n in fp8_weights.used(tuple(counts)).items()}
        fp8_weights.check_one_use({fp8_weights.path_name(p): n for p, n in paths.items()}, "autocast")
        return fp8_weights.nest({tuple(map(str, p)): _fresh_state(recipe) for p in sorted(paths, key=str)})

    wrapped.init_fp8_state = init_fp8_state  # type: ignore[attr-defined]
    wrapped.fp8_recipe = recipe  # type: ignore[attr-defined]
    return wrapped
