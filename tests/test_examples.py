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
