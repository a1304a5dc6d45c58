"""Runs `tests/multidevice` in a process with 4 simulated CPU devices.

XLA fixes the number of host devices at start-up, and every other test runs on one device.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent


def test_sharded_models_on_four_devices():
    # The child's `conftest` adds the flags that compile faster. It runs its files in one
    # process (`-n 0`): the suite's two workers already take both cores, and in one process the
    # files share the models' compiled steps and an interpreter's start.
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            str(TESTS / "multidevice"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-20000:] + result.stderr[-5000:]
    assert "skipped" not in result.stdout and " passed" in result.stdout, result.stdout
