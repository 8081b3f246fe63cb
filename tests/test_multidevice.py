"""Runs tests/multidevice in a child pytest process with 8 fake CPU devices: the device count must
be set before JAX starts, and this process keeps one device so the rest of the suite runs as
users run it. The child turns "not enough devices" skips into failures (JFA_REQUIRE_DEVICES=1)."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys

from util import child_pytest_env

HERE = pathlib.Path(__file__).resolve().parent


def test_multidevice_suite():
    flags = os.environ.get("XLA_FLAGS", "")
    env = child_pytest_env(JFA_MULTIDEVICE="1", JFA_REQUIRE_DEVICES="1",
                           XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8".strip())
    env.pop("JFA_TEST_SHARD", None)  # this test is one shard's; the child runs all of its suite
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(HERE / "multidevice")], cwd=HERE.parent, env=env,
                         capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, f"multi-device tests failed:\n{run.stdout[-30000:]}\n{run.stderr[-5000:]}"
