"""The GPU benchmark suite's CPU dry run: lm.py and resnet.py at their smallest size, skip_sync.py."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    env = dict(os.environ, PYTHON=sys.executable, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)  # one device, as on a GPU machine
    done = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--dry-run", str(out)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out


@pytest.mark.nightly  # every benchmark script at its tiny size (about 7 minutes of one core)
def test_dry_run_writes_every_table(dry_run):
    summary = (dry_run / "summary.md").read_text()
    for heading in [
        "GPT-2 architecture, size tiny",
        "ResNet (tiny) on 32x32 images",
        "issued without blocking",
    ]:
        assert heading in summary
    lm = json.loads((dry_run / "lm.json").read_text())
    assert set(lm["rows"]) == {"f32", "bf16", "f16-dyn-cond", "fp8-current", "fp8-delayed"}
    resnet = json.loads((dry_run / "resnet.json").read_text())
    assert set(resnet["rows"]) == {"f32", "f16-dyn-cond"}
    for result in (lm, resnet):
        assert result["environment"]["jax"] and result["command"]
        for name, row in result["rows"].items():
            assert row["step_ms"] > 0 and math.isfinite(row["held_out"]), (name, row)
            assert 0 < row["mfu"] < 1 and row["compiled_bytes"] > 0
            assert row["peak_bytes"] is None  # GPU only
    # every variant trained on the same data from the same init: the losses agree closely
    losses = [r["held_out"] for r in lm["rows"].values()]
    assert max(losses) - min(losses) < 0.05, losses
    # a 16-bit step keeps float32 params and Adam state but 16-bit activations: less compiled memory
    assert lm["rows"]["bf16"]["compiled_bytes"] < lm["rows"]["f32"]["compiled_bytes"]
    # --memory: the bytes kept for the backward pass per variant, by tracing only
    assert "| variant | residuals MB | ratio to f32 |" in (dry_run / "memory.md").read_text()
    # FSDP on 8 CPU devices: 16-bit gathers move half the float32 policy's bytes, reductions stay float32
    fsdp = json.loads((dry_run / "fsdp.json").read_text())["rows"]
    assert fsdp["f32"]["collectives"]["all_gather"]["dtypes"] == ["f32"]
    assert fsdp["bf16"]["collectives"]["all_gather"]["dtypes"] == ["bf16"]
    assert fsdp["bf16"]["gathered_bytes"] / fsdp["f32"]["gathered_bytes"] <= 0.51
    assert fsdp["bf16"]["collectives"]["reduce_scatter"]["dtypes"] == ["f32"]
    for name in ("memory_lm", "memory_resnet"):
        rows = json.loads((dry_run / f"{name}.json").read_text())["memory"]
        assert set(rows) == {"f32", "bf16"} and rows["f32"]["ratio"] == 1.0
        assert 0 < rows["bf16"]["ratio"] < 1 and rows["bf16"]["residual_by_dtype"]["bfloat16"] > 0
        assert abs(rows["f32"]["bytes_per_param"] - 12.0) < 0.01 and rows["f32"]["peak_bytes"] is None
    sync = json.loads((dry_run / "skip_sync.json").read_text())
    assert set(sync["rows"]) == {"no loss scaling", "skip=cond", "skip=select"}


def test_unknown_variant_is_refused_with_the_list():
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "lm.py"), "--variants", "f32,bf8"],
        capture_output=True,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert (
        done.returncode == 2 and "unknown variants ['bf8']" in done.stderr and "f16-dyn-cond" in done.stderr
    )
