"""The precision report's ranking trusts only float32 references that are not rounding noise (issue 42):
a key bias's exact gradient is zero (it shifts a whole softmax row), float32 computes ~1e-9 of rounding
for it, and a relative error against that is noise over noise; it was ranked first."""

import json

import jax
import jax.numpy as jnp
import pytest

import jmp_lite

pytestmark = pytest.mark.unit

F16, BF16 = "p=f32,c=f16,o=f32", "p=f32,c=bf16,o=f32"


def _attention_loss(wq, wk, bk, wv, x):
    """One attention head with a key bias ``bk``: ``q . (k + bk)`` adds ``q . bk`` to a whole softmax row."""
    with jax.named_scope("attn"):
        q, k, v = x @ wq, x @ wk + bk, x @ wv
        p = jax.nn.softmax(jnp.einsum("bqd,bkd->bqk", q, k) / 4.0, axis=-1)
        out = jnp.einsum("bqk,bkd->bqd", p, v)
    return jnp.mean(jnp.tanh(out) ** 2)


def _arguments():
    keys = jax.random.split(jax.random.key(1), 5)
    wq, wk, wv = (jax.random.normal(k, (16, 16), jnp.float32) / 4.0 for k in keys[:3])
    bk = 0.1 * jax.random.normal(keys[3], (16,), jnp.float32)
    return wq, wk, bk, wv, jax.random.normal(keys[4], (4, 8, 16), jnp.float32)


@pytest.mark.numerics
@pytest.mark.parametrize("policy", [F16, BF16])
def test_a_key_bias_gradient_is_float32_noise_and_ranks_after_every_real_error(policy):
    args = _arguments()
    report = jmp_lite.precision_report(_attention_loss, policy)(*args)
    bias = report.names.index("arg2 [argument]")
    ranking = report.ranking()
    assert ranking[0] != "arg2 [argument]"
    # the exact gradient is zero: what float32 computes is rounding, and a second pass rounds elsewhere
    assert float(report.gradients.noise[bias]) == 1.0
    assert float(report.gradients.error[bias]) == 0.0 and float(report.gradients.underflow[bias]) == 0.0
    real = [report.names.index(f"arg{i} [argument]") for i in (0, 1, 3)]  # the kernels: real gradients
    largest = max(float(report.gradients.max_abs[i]) for i in real)
    assert float(report.gradients.max_abs[bias]) < 1e-6 * largest  # float32's answer: ~1e-9
    assert 0 < float(report.gradients.abs_error[bias]) < 1e-2 * largest  # ranked by this instead
    assert all(float(report.gradients.noise[i]) == 0 and float(report.gradients.error[i]) > 0 for i in real)
    # its row ranks by what is left: the error of reading the bias in 16 bits, the smallest here
    assert ranking[-1] == "arg2 [argument]"
    row = next(line for line in report.table(top=None).splitlines() if "arg2 [argument]" in line)
    assert " abs " in row and "100.0%" in row  # the table marks it and shows its absolute error
    logged = {g["name"]: g for g in json.loads(report.to_json())["groups"]}
    assert logged["arg2 [argument]"]["gradients"]["noise"] == 1.0
    assert logged["arg0 [argument]"]["gradients"]["noise"] == 0.0
    assert jmp_lite.suggest_rules(report).added == {}


_LINEN_TRANSFORMER = """
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        x = x + nn.MultiHeadDotProductAttention(num_heads=4)(h, h, mask=mask)  # query/key/value biases
        h = nn.Dense(128)(nn.LayerNorm()(x))
        return x + nn.Dense(32)(nn.gelu(h))


class Decoder(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(64, 32)(tokens)
        for _ in range(2):
            x = Block()(x)
        return nn.Dense(64)(nn.LayerNorm()(x))


MODEL = Decoder()
PARAMS = MODEL.init(jax.random.key(0), jnp.zeros((2, 16), jnp.int32))


def loss(tokens):
    logits = MODEL.apply(PARAMS, tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
"""


@pytest.mark.e2e
def test_doctor_on_a_linen_transformer_with_key_biases_ranks_a_real_offender_first(
    tmp_path, monkeypatch, capsys
):
    """``jmp-lite doctor --target``: the key biases' rows are marked as float32 noise and ranked after
    every row with a relative error (they were first: "error 1.6e+03", or float16 underflow of noise)."""
    (tmp_path / "key_bias_model.py").write_text(_LINEN_TRANSFORMER)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "report.json"
    argv = ["--target", "key_bias_model:loss", "--shape", "16,17", "--dtype", "int32", "--high", "64"]
    assert jmp_lite.doctor.main([*argv, "--top", "0", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    groups = json.loads(out.read_text())["groups"]
    table = [line for line in text.splitlines() if line.lstrip()[:2].strip().isdigit()]
    first = groups[0]
    assert "key/bias" not in first["name"] and "key/bias" not in table[0]
    biases = [g for g in groups if g["name"].endswith("key/bias [closed over]")]
    assert len(biases) == 2 and all(g["gradients"]["noise"] == 1.0 for g in biases)
    assert first["gradients"]["noise"] == 0.0
    assert (
        first["gradients"]["underflow"] > 0
        or max(first["activations"]["error"], first["gradients"]["error"]) > 0
    )
    with_error = [g for g in groups if max(g["activations"]["error"], g["gradients"]["error"]) > 0]
    assert all(g["rank"] > len(with_error) for g in biases)
    assert all(" abs " in line for line in table if "key/bias" in line)


def test_load_target_imports_a_module_written_in_a_new_directory_after_another(tmp_path, monkeypatch):
    """``--target MODULE:FUNCTION`` reads the current directory as it is now: a second directory (same
    mtime as the first, as in a test run) with a module written after the first import is found."""
    import os

    from jmp_lite._src.tools.doctor import load_target

    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    (first / "first_model_mod.py").write_text("def f():\n    return 1\n")
    monkeypatch.chdir(first)
    assert load_target("first_model_mod:f")() == 1
    (second / "second_model_mod.py").write_text("def g():\n    return 2\n")
    stamp = os.stat(first).st_mtime_ns
    os.utime(second, ns=(stamp, stamp))  # the cached listing of "." would look current
    monkeypatch.chdir(second)
    assert load_target("second_model_mod:g")() == 2
    with pytest.raises(SystemExit, match="cannot import 'no_such_mod'"):
        load_target("no_such_mod:h")
