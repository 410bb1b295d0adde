"""The GPT-2-style Flax Linen decoder that ``jmp-lite plan`` plans without ``--model`` (and
``benchmarks/compiled.py`` compiles), with its next-token loss and its ``Workload``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jmp_lite._src.flax.linen import apply_policy
from jmp_lite._src.tools.plan import Workload

__all__ = ["fused_next_token_loss", "gpt_model", "gpt_workload", "next_token_loss"]


def gpt_model(layers: int, width: int, heads: int, context: int, vocab: int, remat: bool = False) -> Any:
    """A GPT-2-style Flax Linen decoder: pre-LayerNorm blocks of ``nn.MultiHeadDotProductAttention``
    with a causal mask and a GELU MLP, learned positions, a tied embedding (``jmp-lite plan``'s model).
    ``remat``: each block under ``nn.remat`` (the backward pass keeps its input and recomputes it)."""
    try:
        import flax.linen as nn
    except ImportError:
        raise SystemExit("jmp-lite plan: the built-in GPT needs flax: pip install 'jmp-lite[flax]'") from None

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
            x = x + nn.MultiHeadDotProductAttention(num_heads=heads)(nn.LayerNorm()(x), mask=mask)
            return x + nn.Dense(width)(nn.gelu(nn.Dense(4 * width)(nn.LayerNorm()(x))))

    class GPT(nn.Module):
        @nn.compact
        def __call__(self, tokens: jax.Array, logits: bool = True) -> jax.Array:
            embed = nn.Embed(vocab, width)
            pos = self.param("pos", nn.initializers.normal(0.02), (context, width))
            x = embed(tokens) + pos[: tokens.shape[1]]
            mask = nn.make_causal_mask(tokens)
            block = nn.remat(Block) if remat else Block
            for _ in range(layers):
                x = block()(x, mask)
            x = nn.LayerNorm()(x)
            return embed.attend(x) if logits else x  # logits=False: the last hidden states

    return GPT()


def next_token_loss(model: Any) -> Callable[..., Any]:
    """``loss(params, tokens)``: the mean cross-entropy of ``model``'s logits for each next token."""
    import optax

    def loss(p: Any, t: jax.Array) -> jax.Array:
        logits = model.apply({"params": p}, t[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, t[:, 1:]).mean()

    return loss


def fused_next_token_loss(model: Any, dtype: Any = None) -> Callable[..., Any]:
    """``next_token_loss`` from the last hidden states and the tied embedding
    (``jmp_lite.losses.fused_linear_cross_entropy``): no ``[tokens, vocabulary]`` logits."""
    from jmp_lite._src.kernels.losses import fused_linear_cross_entropy

    def loss(p: Any, t: jax.Array) -> jax.Array:
        hidden = model.apply({"params": p}, t[:, :-1], logits=False)
        table = p["Embed_0"]["embedding"]
        return fused_linear_cross_entropy(hidden, table, t[:, 1:], transposed=True, dtype=dtype).mean()

    return loss


def gpt_workload(
    layers: int, width: int, heads: int, context: int, vocab: int, batch: int, remat: bool = False
) -> Workload:
    """``gpt_model`` and its ``next_token_loss`` on ``batch`` sequences of ``context`` tokens, as abstract
    arrays, with Adam, under a policy through Flax's front-end (``jmp_lite.flax.linen.apply_policy``):
    what ``jmp-lite plan`` plans without ``--model``."""
    import optax

    model = gpt_model(layers, width, heads, context, vocab, remat)
    tokens = jax.ShapeDtypeStruct((batch, context + 1), jnp.int32)
    params = jax.eval_shape(lambda t: model.init(jax.random.key(0), t[:, :-1]), tokens)["params"]

    def under_policy(policy: Any, **options: Any) -> Callable[..., Any]:
        return next_token_loss(apply_policy(model, policy, **options))

    return Workload(next_token_loss(model), params, (tokens,), optax.adam(1e-4), under_policy)
