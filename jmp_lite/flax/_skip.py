"""What a skipped step keeps, shared by the Linen ``TrainState`` and the NNX optimizer."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jmp_lite.optax_transform import LossScalingState


def keep_optimizer_state(new: Any, old: Any, finite: jax.Array) -> Any:
    """``new`` after an applied step; after a skipped one ``old`` everywhere but the loss-scaling state.

    ``loss_scaling`` keeps its own inner state on a skipped step; transformations
    chained around it (a schedule's count, ``MultiSteps``' counters) would otherwise
    still advance.
    """
    kept = jax.tree_util.tree_map(lambda n, o: jnp.where(finite, n, o), new, old)
    is_ls = lambda x: isinstance(x, LossScalingState)  # noqa: E731
    return jax.tree_util.tree_map(lambda k, n: n if is_ls(n) else k, kept, new, is_leaf=is_ls)
