"""Multi-device tests on fake CPU devices.

The number of CPU devices must be set before JAX starts, so the main test run does not collect
this directory (tests/conftest.py): tests/test_multidevice.py runs it in a child pytest process
with 8 devices. To run it directly: `JFA_MULTIDEVICE=1 python -m pytest -q tests/multidevice`.
A test that needs more devices than there are skips, unless JFA_REQUIRE_DEVICES=1 makes that a
failure.
"""
from __future__ import annotations

import contextlib
import math
import os
import pathlib
import re
import sys

import jax
import numpy as np
import pytest

DEVICES = 8
COLLECTIVE = re.compile(r"all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))  # tests/util.py

try:
    jax.config.update("jax_num_cpu_devices", DEVICES)
except RuntimeError:  # JAX already started: XLA_FLAGS (as the child run sets them) decide
    pass


def cpu_mesh(shape, names, axis_type=jax.sharding.AxisType.Auto):
    """A mesh of the first prod(shape) CPU devices, or skip/fail without them."""
    shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
    names = tuple(names) if isinstance(names, (tuple, list)) else (names,)
    count = math.prod(shape)
    devices = jax.devices("cpu")
    if len(devices) < count:
        reason = (f"needs {count} CPU devices, JAX has {len(devices)} (run through "
                  "tests/test_multidevice.py, which asks for 8)")
        if os.environ.get("JFA_REQUIRE_DEVICES") == "1":
            pytest.fail(f"JFA_REQUIRE_DEVICES=1 but this test {reason}")
        pytest.skip(reason)
    return jax.sharding.Mesh(np.array(devices[:count]).reshape(shape), names,
                             axis_types=(axis_type,) * len(names))


def collectives(fn, *args):
    """The kinds of collective in fn's compiled program for these (sharded) arguments."""
    return sorted(set(COLLECTIVE.findall(jax.jit(fn).lower(*args).compile().as_text())))


@contextlib.contextmanager
def partitioner(shardy: bool):
    """Partitions with Shardy (JAX's default) or, with shardy=False, with GSPMD."""
    old = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", shardy)
    try:
        yield
    finally:
        jax.config.update("jax_use_shardy_partitioner", old)
