"""``autocast``: the engine's front-end for plain JAX functions (Equinox models, hand-written code)."""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from jmp_lite._src import engine
from jmp_lite._src.policy import Policy, get_policy

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
    if not engine.TRACING.get():
        warnings.warn(
            "jmp_lite.float32_region() is used outside jmp_lite.autocast, where it changes "
            "nothing: call the function through autocast(fun, policy) (or @autocast(policy)).",
            stacklevel=3,  # the user's `with` line (this generator, contextlib, the caller)
        )
    with jax.named_scope(engine.FLOAT32_SCOPE):
        yield


def _to_policy(policy: Any) -> Policy:
    if isinstance(policy, Policy):
        return policy
    if isinstance(policy, str):
        return get_policy(policy)
    raise TypeError(
        f"autocast needs a jmp_lite.Policy or a policy string such as 'p=f32,c=bf16,o=f32', "
        f"got {type(policy).__name__}: {policy!r}"
    )


class _Decorator:
    """What ``autocast(policy)`` returns: applied to a function, that function under autocast."""

    def __init__(self, policy: Policy, rules: dict[str, str], remat_float32: bool, attention: bool) -> None:
        self._policy, self._rules, self._remat, self._attention = policy, rules, remat_float32, attention

    def __call__(self, fun: Callable[..., Any]) -> Callable[..., Any]:
        return autocast(
            fun, self._policy, rules=self._rules, remat_float32=self._remat, attention=self._attention
        )

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
        return f"jmp_lite.autocast({self._policy!r}) decorator"


def autocast(
    fun: Callable[..., Any] | Policy | str,
    policy: Policy | str | None = None,
    *,
    rules: Mapping[str, str] | None = None,
    remat_float32: bool = True,
    attention: bool = True,
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
    recomputation).

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
    """
    if policy is None:
        if callable(fun) and not isinstance(fun, (Policy, str)):
            raise TypeError("autocast(fun, policy): a policy is required")
        return _Decorator(_to_policy(fun), engine.check_rules(rules), remat_float32, attention)
    if not callable(fun):
        raise TypeError(f"autocast expects a callable as its first argument, got {type(fun).__name__}")
    for name, flag in (("remat_float32", remat_float32), ("attention", attention)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be True or False, got {flag!r}")
    scope = engine.Scope(_to_policy(policy))
    run = engine.transform(
        fun, scope, rules=engine.check_rules(rules), remat_float32=remat_float32, attention=attention
    )
    return functools.wraps(fun)(run)
