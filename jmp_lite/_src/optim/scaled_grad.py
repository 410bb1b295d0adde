"""``value_and_grad``: the loss-scaled backward pass that reads its scale from the optimizer.

``loss_scaling`` divides the gradients by its current scale whether or not the
loss was multiplied by it. Forgetting the multiplication is silent: the update
is the true one divided by the scale (2**15 for the usual float16 start), and
with SGD training stalls without an error. Taking the scale from the same
optimizer state that will unscale makes the pair impossible to split.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jmp_lite._src.base import validate
from jmp_lite._src.optim.loss_scale import LossScale
from jmp_lite._src.optim.loss_scaling import _find_states, get_loss_scaling_state
from jmp_lite._src.optim.step import _scaled_loss_fn

_NEEDS_LOSS_SCALING = (
    "jmp_lite.value_and_grad(fun)(state, *args): state must be the optimizer state of a tx that contains "
    "jmp_lite.loss_scaling (e.g. opt_state = "
    "jmp_lite.loss_scaling(optax.adam(1e-3), jmp_lite.DynamicLossScale(2.0**15)).init(params)), "
    "or a jmp_lite.flax.TrainState or jmp_lite.flax.nnx.LossScaledOptimizer (with any tx)"
)


def _nnx() -> Any:
    """``flax.nnx`` if the program has imported it, else ``None`` (no NNX object can exist then)."""
    return sys.modules.get("flax.nnx")


def _loss_scale_of(state: Any) -> LossScale:
    """The scale of the one ``loss_scaling`` state in ``state``; ``TypeError`` naming what is accepted."""
    own = getattr(type(state), "__jmp_lite_loss_scale__", None)
    if own is not None:  # a front-end's training state (Linen TrainState, NNX LossScaledOptimizer)
        # a plain tx gives NoOpLossScale: the same step code runs in every precision
        return own(state)
    what = type(state).__name__
    nnx = _nnx()
    if nnx is not None and isinstance(state, nnx.Optimizer):
        # NNX keeps the optimizer state in Variables; read it as plain arrays.
        state = nnx.as_pure(state.opt_state)
    if isinstance(state, LossScale):
        raise TypeError(
            f"{_NEEDS_LOSS_SCALING}; got a bare {type(state).__name__}: pass the state that holds it, so the "
            "scale that multiplies the loss is the one loss_scaling divides by"
        )
    if not _find_states(state):
        raise TypeError(f"{_NEEDS_LOSS_SCALING}; got {what} with no loss_scaling state in it")
    return get_loss_scaling_state(state).loss_scale


def _is_diff_state(n: Any) -> bool:
    nnx = _nnx()
    return nnx is not None and isinstance(n, nnx.DiffState)


def _differentiates_nnx(args: Sequence[Any], argnums: Any) -> bool:
    nnx = _nnx()
    if nnx is None:
        return False
    nums = tuple(argnums) if isinstance(argnums, Sequence) else (argnums,)
    if any(_is_diff_state(n) for n in nums):  # nnx.DiffState(argnum, filter): NNX's own argnums
        return True
    return any(-len(args) <= n < len(args) and nnx.graphlib.is_graph_node(args[n]) for n in nums)


def _with_fp8_states(args: Sequence[Any], argnums: Any) -> Any:
    """``argnums`` where each NNX module argument that holds fp8 states (``Fp8Variable``, a
    ``PolicyView`` with delayed scaling) is differentiated for them too: their gradient is the amaxes
    the step observed, which ``LossScaledOptimizer.update`` needs; without it they never move."""
    nnx = _nnx()
    if nnx is None or isinstance(argnums, nnx.DiffState):
        return argnums
    single = not isinstance(argnums, Sequence)
    nums = [argnums] if single else list(argnums)
    for i, n in enumerate(nums):
        if isinstance(n, int) and -len(args) <= n < len(args):
            # a front-end module says which of its variables a gradient must reach (a PolicyView: fp8 states)
            differentiated = getattr(type(args[n]), "__jmp_lite_differentiated__", None)
            wanted = None if differentiated is None else differentiated(args[n])
            if wanted is not None:
                nums[i] = nnx.DiffState(n, wanted)
    return nums[0] if single else tuple(nums)


def value_and_grad(fun: Callable[..., Any], argnums: Any = 0, has_aux: bool = False) -> Callable[..., Any]:
    """``jax.value_and_grad`` of a loss scaled by the optimizer's own loss scale.

    Returns ``vg(state, *args, **kwargs)``. ``state`` is the optimizer state of a
    ``tx`` containing ``jmp_lite.loss_scaling`` (or a ``jmp_lite.flax.TrainState``,
    or an NNX ``LossScaledOptimizer``); ``args`` and ``kwargs`` are ``fun``'s.
    ``vg`` reads the current scale ``S = get_loss_scale(state)``, differentiates
    ``S.scale(fun(*args))`` with respect to ``args[argnums]`` and returns, like
    ``jax.value_and_grad``, ``(loss, grads)``, or ``((loss, aux), grads)`` with
    ``has_aux``:

    * ``loss`` (and ``aux``) exactly as ``fun`` computed them, *not* scaled;
    * ``grads`` the gradients of the *scaled* loss, which is what
      ``loss_scaling`` (``tx.update``, ``apply_scaled_gradients``,
      ``TrainState.apply_gradients``, ``LossScaledOptimizer.update``) expects:
      it divides them by ``S``, checks them and skips non-finite steps.

    Scaling and unscaling thus read the same scale (Micikevicius et al., 2018,
    "Mixed Precision Training"), and the step cannot be half done (gradients of
    an unscaled loss handed to ``loss_scaling`` would come out divided by ``S``).
    With ``NoOpLossScale`` the scale is 1 and ``vg`` is a plain
    ``jax.value_and_grad``. When an argument in ``argnums`` is a Flax NNX module,
    the derivative is ``nnx.value_and_grad``'s: gradients of the ``nnx.Param``
    variables as an ``nnx.State`` (``nnx.DiffState(0, filter)`` in ``argnums``
    chooses other variables, as for ``nnx.value_and_grad``). An NNX ``PolicyView`` with
    delayed fp8 scaling is differentiated for its ``Fp8Variable``s too (their gradient is
    the amaxes the step observed, for ``LossScaledOptimizer.update``; docs/fp8.md); Linen's
    fp8 states are differentiated when they are part of the differentiated argument
    (``state.params = {"params": ..., "fp8": ...}``). Works under ``jit``,
    ``pmap`` (give ``loss_scaling`` ``axis_name=`` and ``reduce="mean"`` to
    average the gradients over replicas), ``vmap`` and ``scan``.

    Args:
        fun: the loss function; returns a scalar loss, or ``(loss, aux)`` with ``has_aux``.
        argnums: which positional arguments of ``fun`` to differentiate, as in
            ``jax.value_and_grad`` (``state`` is not counted): an int, a sequence of
            ints, or NNX's ``nnx.DiffState``.
        has_aux: whether ``fun`` returns ``(loss, aux)``.

    Returns:
        ``vg(state, *args, **kwargs) -> (loss, grads)`` or ``((loss, aux), grads)``.

    Raises:
        TypeError: ``state`` holds no ``loss_scaling`` state (e.g. params, or a
            plain optax state, were passed first), or is a bare ``LossScale``.
        ValueError: ``state`` holds more than one ``loss_scaling`` state.

    Example:
        >>> import jax, jax.numpy as jnp, optax, jmp_lite
        >>> tx = jmp_lite.loss_scaling(optax.sgd(0.1), jmp_lite.StaticLossScale(1024.0))
        >>> params = {"w": jnp.ones(2)}
        >>> opt_state = tx.init(params)
        >>> loss_fn = lambda p, x: jnp.sum((p["w"] * x) ** 2)
        >>> loss, grads = jax.jit(jmp_lite.value_and_grad(loss_fn))(opt_state, params, jnp.ones(2))
        >>> float(loss), grads["w"]  # the loss unscaled, the gradients scaled by 1024
        (2.0, Array([2048., 2048.], dtype=float32))
        >>> updates, opt_state = tx.update(grads, opt_state, params)  # loss_scaling unscales
        >>> updates["w"]
        Array([-0.2, -0.2], dtype=float32)
    """
    validate.function(fun, "value_and_grad.fun")
    has_aux = validate.flag(has_aux, "value_and_grad.has_aux")
    nums = argnums if isinstance(argnums, Sequence) and not isinstance(argnums, str) else (argnums,)
    if (
        isinstance(argnums, bool)
        or not isinstance(nums, Sequence)
        or not nums
        or not all((isinstance(n, int) and not isinstance(n, bool)) or _is_diff_state(n) for n in nums)
    ):
        raise TypeError(
            "argnums must be an int or a non-empty sequence of ints, as for jax.value_and_grad "
            f"(or nnx.DiffState for NNX filters); got {argnums!r}"
        )

    @functools.wraps(fun)
    def vg(state: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        if not args:
            raise TypeError(
                "jmp_lite.value_and_grad(fun)(state, *args): no arguments for fun after state; "
                "call it as vg(opt_state, params, ...)"
            )
        scaled = _scaled_loss_fn(fun, _loss_scale_of(state), has_aux)
        if _differentiates_nnx(args, argnums):
            grad_fn = _nnx().value_and_grad(scaled, argnums=_with_fp8_states(args, argnums), has_aux=True)
        else:
            grad_fn = jax.value_and_grad(scaled, argnums=argnums, has_aux=True)
        # scale_loss_fn's aux output is the unscaled loss, or (loss, aux) with has_aux.
        (_, unscaled), grads = grad_fn(*args, **kwargs)
        return unscaled, grads

    return vg
