"""Hugging Face Flax models (transformers < 5) run through ``hf.module`` under ``apply_policy``.

The guide's own examples run in ``tests/test_docs.py`` (docs/huggingface.md); here: outputs and
gradients of tiny random-init GPT-2, Llama, ViT and Dinov2 models under 16-bit policies against
float32, what fp8 reads, the benchmark's dry run, and the architectures whose Flax code does not run on
the supported JAX at all (the T5 family, RoFormer: docs/huggingface.md says why).
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

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
B, T = 2, 16


def gpt2():
    config = transformers.GPT2Config(vocab_size=64, n_positions=T, n_embd=32, n_layer=1, n_head=4)
    return transformers.FlaxGPT2LMHeadModel(config, _do_init=False)


def inputs():
    tokens = jax.random.randint(jax.random.key(0), (B, T + 1), 0, 64)
    x = tokens[:, :-1]
    return tokens, x, jnp.ones_like(x), jnp.broadcast_to(jnp.arange(T), x.shape)


def losses_under_policies(hf, policies, tokens, x, mask, positions):
    """``((loss, logits), grads)`` of the next-token loss of a causal LM under each policy, from the same
    float32 parameters (one jitted program)."""
    models = [apply_policy(hf.module, p) for p in policies]

    @jax.jit
    def run(key):
        params = models[0].init(key, x, mask, positions)["params"]

        def loss(model, p):
            logits = model.apply({"params": p}, x, mask, positions).logits
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean(), logits

        return [jax.value_and_grad(lambda p, m=m: loss(m, p), has_aux=True)(params) for m in models]

    return run(jax.random.key(1))


def test_16_bit_policies_track_float32_outputs_and_gradients():
    hf = gpt2()
    tokens, x, mask, positions = inputs()
    policies = ("f32", "p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32")
    ((f32_loss, f32_logits), f32_grads), *others = losses_under_policies(
        hf, policies, tokens, x, mask, positions
    )
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


@pytest.mark.nightly  # benchmarks/hf_gpt2.py at a tiny size; the models themselves are tested above
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


@pytest.mark.parametrize("family", ["dinov2", "vit"])
def test_vision_transformers_with_float32_embeddings_are_within_their_own_bfloat16_modes_distance(family):
    """Issue 42: under "p=f32,c=bf16,o=f32" Dinov2 (and ViT) were 1.4 to 2 times further from float32
    than their own bfloat16 mode. The own mode keeps the residual stream in float32 (the float32
    position embedding promotes the embeddings, and every residual add stays float32); the policy
    reads the parameters in bfloat16 and rounds the stream at every add. With the embeddings module in
    float32 (docs/huggingface.md) the stream is float32 and the policy is closer than the own mode."""
    import importlib

    module = importlib.import_module(f"transformers.models.{family}.modeling_flax_{family}")
    config_class, model_class, embeddings = {
        "dinov2": ("Dinov2Config", "FlaxDinov2Model", "FlaxDinov2Embeddings"),
        "vit": ("ViTConfig", "FlaxViTModel", "FlaxViTEmbeddings"),
    }[family]
    config = getattr(transformers, config_class)(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=128,
        image_size=32,
        patch_size=8,
    )
    model_class = getattr(transformers, model_class)
    f32 = model_class(config, _do_init=False).module
    own = model_class(config, dtype=jnp.bfloat16, _do_init=False).module
    ruled = apply_policy(f32, "p=f32,c=bf16,o=f32", {getattr(module, embeddings): "float32"})
    runs = (f32, own, apply_policy(f32, "p=f32,c=bf16,o=f32"), ruled)
    pixels = jax.random.normal(jax.random.key(0), (4, 32, 32, 3))

    @jax.jit
    def measure(key):
        params = f32.init(key, pixels)["params"]

        def loss(model, p):
            h = model.apply({"params": p}, pixels).last_hidden_state.astype(jnp.float32)
            return jnp.mean(h**2 * jnp.linspace(-1.0, 1.0, h.shape[-1])), h

        return [jax.value_and_grad(lambda p, m=m: loss(m, p), has_aux=True)(params) for m in runs]

    def distance(a, b):
        a, b = (jnp.concatenate([x.ravel() for x in jax.tree_util.tree_leaves(t)]) for t in (a, b))
        return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))

    ((_, ref_h), ref_g), *rest = measure(jax.random.key(1))
    (own_h, own_g), (plain_h, plain_g), (ruled_h, ruled_g) = [(h, g) for (_, h), g in rest]
    for what, ref, own_d, plain_d, ruled_d in (
        ("output", ref_h, own_h, plain_h, ruled_h),
        ("gradients", ref_g, own_g, plain_g, ruled_g),
    ):
        own_distance = distance(own_d, ref)
        assert distance(plain_d, ref) > 1.3 * own_distance, what  # the bfloat16 residual stream
        assert distance(ruled_d, ref) < own_distance, what  # the float32 one


def llama():
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        max_position_embeddings=T,
    )
    return transformers.FlaxLlamaForCausalLM(config, _do_init=False)


def distance(a, b):
    """The relative distance of two pytrees, over all their leaves together (a parameter whose exact
    gradient is zero, a key bias, has no relative error of its own)."""
    a, b = (jnp.concatenate([x.ravel() for x in jax.tree_util.tree_leaves(t)]) for t in (a, b))
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def test_llama_16_bit_policies_track_float32_and_fp8_reads_every_projection():
    """Llama (RMSNorm, rotary positions, grouped-query attention, SwiGLU): logits and gradients under
    the bfloat16 and float16 policies against float32, and the weights fp8 reads: the seven
    projections of the layer and the head, not the embedding (a lookup)."""
    hf = llama()
    tokens, x, mask, positions = inputs()
    every = apply_policy(hf.module, "p=f32,c=bf16,o=f32", fp8="hybrid,delayed,history=4")
    states = jax.eval_shape(every.init, jax.random.key(0), x, mask, positions)["fp8"]
    assert sorted(states) == ["lm_head", "model"] and sorted(states["model"]) == ["layers"]
    layer = states["model"]["layers"]["0"]
    assert sorted(layer["self_attn"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert sorted(layer["mlp"]) == ["down_proj", "gate_proj", "up_proj"]

    policies = ("f32", "p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32")
    ((f32_loss, f32_logits), f32_grads), *others = losses_under_policies(
        hf, policies, tokens, x, mask, positions
    )
    distances = {}
    for policy, ((loss, logits), grads) in zip(policies[1:], others):
        assert logits.dtype == jnp.float32, policy
        assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads)), policy
        assert abs(float(loss - f32_loss)) < 0.01, (policy, float(loss), float(f32_loss))
        distances[policy] = (distance(logits, f32_logits), distance(grads, f32_grads))
        assert max(distances[policy]) < 0.03, (policy, distances[policy])
    # float16 keeps 3 more mantissa bits than bfloat16: closer to float32, outputs and gradients
    bf16, f16 = distances[policies[1]], distances[policies[2]]
    assert f16[0] < bf16[0] and f16[1] < bf16[1], distances


def test_vit_image_classifier_under_16_bit_policies_and_fp8_skips_the_patch_convolution():
    """ViT for image classification (patch embedding by a convolution, a pre-norm layer, a classifier
    on the class token): logits and gradients under the bfloat16 and float16 policies within the
    distance of ViT's own bfloat16 mode, and fp8 reads every Dense but not the patch convolution."""
    config = transformers.ViTConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
        num_labels=3,
    )
    hf = transformers.FlaxViTForImageClassification(config, _do_init=False)
    own = transformers.FlaxViTForImageClassification(config, dtype=jnp.bfloat16, _do_init=False).module
    pixels = jax.random.normal(jax.random.key(0), (2, 16, 16, 3))
    labels = jnp.array([0, 2])
    every = apply_policy(hf.module, "p=f32,c=bf16,o=f32", fp8="hybrid,delayed,history=4")
    states = jax.eval_shape(every.init, jax.random.key(0), pixels)["fp8"]
    assert sorted(states) == ["classifier", "vit"] and sorted(states["vit"]) == ["encoder"]  # no embeddings
    layer = states["vit"]["encoder"]["layer"]["0"]
    assert sorted(layer["attention"]["attention"]) == ["key", "query", "value"]
    assert sorted(layer) == ["attention", "intermediate", "output"]

    policies = ("f32", "p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32")
    models = [apply_policy(hf.module, p) for p in policies] + [own]

    @jax.jit
    def run(key):
        params = models[0].init(key, pixels)["params"]

        def loss(model, p):
            logits = model.apply({"params": p}, pixels).logits.astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits

        return [jax.value_and_grad(lambda p, m=m: loss(m, p), has_aux=True)(params) for m in models]

    ((_, f32_logits), f32_grads), *others = run(jax.random.key(1))
    (own_logits, own_grads) = others[-1][0][1], others[-1][1]
    own_distance = max(distance(own_logits, f32_logits), distance(own_grads, f32_grads))
    for policy, ((_, logits), grads) in zip(policies[1:], others):
        assert all(g.dtype == jnp.float32 for g in jax.tree_util.tree_leaves(grads)), policy
        d = max(distance(logits, f32_logits), distance(grads, f32_grads))
        assert d < 1.5 * own_distance, (policy, d, own_distance)


@pytest.mark.parametrize(
    "name, config, error",
    [
        ("FlaxT5Model", "T5Config", "got an unexpected keyword argument 'a_max'"),
        ("FlaxMT5Model", "MT5Config", "got an unexpected keyword argument 'a_max'"),
        ("FlaxLongT5Model", "LongT5Config", "got an unexpected keyword argument 'a_max'"),
        ("FlaxRoFormerModel", "RoFormerConfig", "has no attribute split"),
    ],
)
def test_architectures_whose_flax_code_calls_jax_apis_removed_by_jax_0_10_do_not_build(name, config, error):
    """docs/huggingface.md's list of the models that cannot run, checked: transformers 4.49's Flax T5
    (and MT5, LongT5, which share its relative position buckets) calls ``jnp.clip(x, a_max=...)``, and
    RoFormer calls ``Array.split``; jax 0.10 removed both, so building the plain model, without
    jmp_lite, fails. When a transformers release fixes one, this test fails: move it to the tested list."""
    small = {"vocab_size": 64, "num_layers": 1, "num_heads": 2, "d_model": 16, "d_kv": 8, "d_ff": 32}
    if config == "RoFormerConfig":
        small = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
                 "intermediate_size": 32, "embedding_size": 16}  # fmt: skip
    with pytest.raises((TypeError, AttributeError), match=error):
        getattr(transformers, name)(getattr(transformers, config)(**small), _do_init=False)
