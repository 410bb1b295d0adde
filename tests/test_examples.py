"""The README's main job runs and prints what it promises."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_runs_and_reports():
    env = {**os.environ, "XLA_FLAGS": ""}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py"), "--steps", "30"],
        capture_output=True, text=True, timeout=300, env=env, check=True,
    ).stdout  # fmt: skip
    assert "loss scale" in out and "skipped" in out
    assert out.count("%") == 3  # one accuracy per configuration


def test_data_parallel_example_modes_agree():
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    lines = []
    for mode in ("pmap", "shard_map", "jit"):
        out = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "data_parallel.py"), "--mode", mode, "--steps", "15"],
            capture_output=True, text=True, timeout=300, env=env, check=True,
        ).stdout  # fmt: skip
        assert "on 8 cpu devices" in out
        lines.append(out.strip().splitlines()[-1].split("(")[0])  # drop the timing
    assert lines[0] == lines[1] == lines[2], lines
