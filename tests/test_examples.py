"""The README's main job runs and prints what it promises."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _processes import one_device_flags

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
# One CPU device, as a user runs the examples, compiled as the rest of the suite (conftest.py): the
# examples' small programs spend their time compiling, and the tests assert results, not speed.
O1 = one_device_flags()


def test_quickstart_runs_and_reports():
    env = {**os.environ, "XLA_FLAGS": O1}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--steps", "30"],
        capture_output=True, text=True, timeout=300, env=env, check=True,
    ).stdout  # fmt: skip
    names = ("float32", "float16 + dynamic loss scale", "bfloat16")
    table = out[out.index("test accuracy") :].splitlines()[1:]
    acc = {line[:32].strip(): float(line[32:].split("%")[0]) for line in table if "%" in line}
    assert set(acc) == set(names), out
    # 10 digit classes (about 10% each): 30 steps already classify most test digits, in every precision
    assert all(a > 80 for a in acc.values()), acc
    assert abs(acc["float16 + dynamic loss scale"] - acc["float32"]) < 3, acc
    assert abs(acc["bfloat16"] - acc["float32"]) < 3, acc
    # each configuration's printed training loss falls; float16 runs at a dynamic scale above 1
    sections = out.split("  (p=")[1:]
    for section in sections:
        losses = [float(line.split("loss ")[1].split()[0]) for line in section.splitlines() if "step" in line]
        assert losses[-1] < 0.5 * losses[0], section
    assert " loss scale    32768" in sections[1] and "loss scale        1" in sections[0]


def test_data_parallel_example_modes_agree():
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count=8 {O1}"}
    lines = []
    for mode in ("pmap", "shard_map", "jit"):
        out = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "data_parallel.py"), "--mode", mode, "--steps", "15"],
            capture_output=True, text=True, timeout=300, env=env, check=True,
        ).stdout  # fmt: skip
        assert "on 8 cpu devices" in out
        lines.append(out.strip().splitlines()[-1].split("(")[0])  # drop the timing
    assert lines[0] == lines[1] == lines[2], lines


def run_example(name, *args):
    env = {**os.environ, "XLA_FLAGS": O1}
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        capture_output=True, text=True, timeout=600, env=env, check=True,
    ).stdout  # fmt: skip


def test_flax_linen_cnn_example_trains_and_tabulates(tmp_path):
    out = run_example("flax_linen_cnn.py", "--steps", "60", "--json", str(tmp_path / "cnn.json"))
    for name in ("float32", "bfloat16", "float16 + dynamic loss scale"):
        assert f"\n{name} " in out
    runs = json.loads((tmp_path / "cnn.json").read_text())["runs"]
    assert set(runs) == {"float32", "bfloat16", "float16 + dynamic loss scale"}
    assert all(r[0]["accuracy"] > 50 for r in runs.values())  # 60 steps already learn the digits


def test_flax_nnx_lm_example_trains_and_tabulates(tmp_path):
    out = run_example(
        "flax_nnx_lm.py", "--steps", "30", "--width", "32", "--corpus-bytes", "200000", "--val-batches", "2",
        "--json", str(tmp_path / "lm.json"),
    )  # fmt: skip
    assert "stdlib sources" in out and "vs fp32" in out
    runs = json.loads((tmp_path / "lm.json").read_text())["runs"]
    assert set(runs) == {"float32", "bfloat16", "float16 + dynamic loss scale"}
    # 30 steps move well below the uniform-bytes loss, ln(256) = 5.55 nats
    assert all(r[0]["val_loss"] < 4.5 for r in runs.values()), runs


@pytest.mark.parametrize("policy", ["p=f32,c=bf16,o=f32", "p=f32,c=f16,o=f32"], ids=["bf16", "f16"])
def test_equinox_autocast_example_trains_in_both_half_dtypes(policy, capsys):
    # bfloat16 crashed XLA:CPU without AMX ("Unsupported element type for DotThunk::Execute")
    pytest.importorskip("equinox")
    path = ROOT / "examples" / "equinox_autocast.py"
    spec = importlib.util.spec_from_file_location("equinox_autocast", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)  # in this process: the jmp_lite under test
    example.main(["--steps", "40", "--policy", policy])
    out = capsys.readouterr().out
    first, last = (float(v) for v in out.split("loss ")[1].split(" after")[0].split(" -> "))
    assert np.isfinite(last) and last < 0.5 * first, out


def test_doctor_walkthrough_fails_finds_the_cause_and_fixes_it():
    # case (b) only: tests/test_report.py runs both cases with the same models and checks (a) there
    out = run_example("doctor_walkthrough.py", "--steps", "2", "--case", "b")  # docs/doctor.md: 20 steps
    assert "case (a)" not in out
    assert out.count("skipped 5 of 5") == 3  # case (b): no loss scale helps
    assert "suggested rules for apply_policy(model, policy, rules=...): {'block_0': 'float32'}" in out
    assert out.count(", skipped 0; loss at step 1") == 1  # the fixed run applies every step


def test_fsdp_gpt_example_moves_half_the_bytes_in_bf16_and_trains():
    out = run_example("fsdp_gpt.py", "--steps", "12")  # the example asks XLA for 8 CPU devices itself
    assert "sharded over 8 cpu devices" in out
    sections = {s.split(" ")[0]: s for s in out.split("\n\n")[1:]}
    gathered = {}
    for name in ("float32", "bf16"):
        line = sections[name].splitlines()[0]
        gathered[name] = float(line.split("all_gather ")[1].split(" MB")[0])
        assert "reduce_scatter" in line and line.split("reduce_scatter ")[1].split("(")[1].startswith("f32")
        losses = [float(x.split("loss ")[1]) for x in sections[name].splitlines() if "loss " in x]
        assert losses[-1] < losses[0] - 1.0, sections[name]  # from ln(256) = 5.55 down
        assert "sharded as P('data', None)" in sections[name]
    assert "(bf16)" in sections["bf16"].splitlines()[0]  # every gather in bf16
    assert gathered["bf16"] / gathered["float32"] <= 0.51, gathered
