"""Hugging Face Flax models (transformers < 5) run through ``hf.module`` under ``apply_policy``.

The guide's own examples run in ``tests/test_docs.py`` (docs/huggingface.md); here: outputs and
gradients of a tiny random-init GPT-2 under 16-bit policies against float32, what fp8 reads, and the
benchmark's dry run.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
if not hasattr(transformers, "FlaxGPT2LMHeadModel"):
    pytest.skip(
        f"transformers {transformers.__version__} has no Flax models (transformers<5 has)",
        allow_module_level=True,
    )

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from jmp_lite.flax.linen import apply_policy  # noqa: E402

pytestmark = pytest.mark.slow  # each test compiles a transformer for several seconds

ROOT = Path(__file__).resolve().parents[1]
B, T = 2, 16


def gpt2():
    config = transformers.GPT2Config(vocab_size=64, n_positions=T, n_embd=32, n_layer=1, n_head=4)
    return transformers.FlaxGPT2LMHeadModel(config, _do_init=False)


def inputs():
    tokens = jax.random.randint(jax.random.key(0), (B, T + 1), 0, 64)
    x = tokens[:, :-1]
    return tokens, x, jnp.ones_like(x), jnp.broadcast_to(jnp.arange(T), x.shape)


def test_16_bit_policies_track_float32_outputs_and_gradients():
    hf = gpt2()
    tokens, x, mask, positions = inputs()
    policies = ("f32", "p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32")
    models = [apply_policy(hf.module, p) for p in policies]

    @jax.jit
    def run(key):
        params = models[0].init(key, x, mask, positions)["params"]

        def loss(model, p):
            logits = model.apply({"params": p}, x, mask, positions).logits
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(), logits

        return [jax.value_and_grad(lambda p, m=m: loss(m, p), has_aux=True)(params) for m in models]

    ((f32_loss, f32_logits), f32_grads), *others = run(jax.random.key(1))
    for policy, ((loss, logits), grads) in zip(policies[1:], others):
        assert logits.dtype == jnp.float32, policy
        assert abs(float(loss - f32_loss)) < 0.02, (policy, float(loss), float(f32_loss))
        assert float(jnp.abs(logits - f32_logits).max()) < 0.05, policy
        flat, ref = jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(f32_grads)
        for g, r in zip(flat, ref):
            assert g.dtype == jnp.float32  # float32 parameters: float32 gradients
            err = float(jnp.linalg.norm((g - r).ravel()) / (jnp.linalg.norm(r.ravel()) + 1e-12))
            assert err < 0.05, (policy, err)


# GPT-2 calls its tied head as lm_head.apply(...): the rule reaches it, with no "match no module" warning
@pytest.mark.filterwarnings("error:apply_policy rules")
def test_fp8_reads_the_tied_embedding_and_a_class_rule_opts_the_head_out():
    import flax.linen as nn

    hf = gpt2()
    _, x, mask, positions = inputs()
    policy, recipe = "p=f32,c=bf16,o=f32", "hybrid,delayed,history=4"
    every = apply_policy(hf.module, policy, fp8=recipe)
    states = jax.eval_shape(every.init, jax.random.key(0), x, mask, positions)["fp8"]
    # the four projections of the block, and the embedding the tied output layer reads (lm_head.apply)
    assert sorted(states["transformer"]) == ["h", "wte"]
    opted_out = apply_policy(hf.module, policy, {nn.Dense: policy}, fp8=recipe)
    states = jax.eval_shape(opted_out.init, jax.random.key(0), x, mask, positions)["fp8"]
    assert sorted(states["transformer"]) == ["h"]


def test_benchmark_dry_run(tmp_path):
    out = tmp_path / "hf_gpt2.json"
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one device, as the benchmark runs
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "hf_gpt2.py"), "--dry-run", "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["environment"]["transformers"] == transformers.__version__ and result["command"]
    rows = result["rows"]
    assert list(rows) == ["f32", "bf16", "f16-dyn-cond", "fp8-delayed"]
    for name, row in rows.items():
        assert len(row["held_out"]) == 1 and np.isfinite(row["held_out"]).all(), name
        assert row["residual_bytes"] > 0, name
    losses = [r["held_out"][0] for r in rows.values()]  # same data, same init, 3 steps: close
    assert max(losses) - min(losses) < 0.05, losses
    assert rows["bf16"]["residual_bytes"] < rows["f32"]["residual_bytes"]
    assert "| variant | held-out loss" in done.stdout
