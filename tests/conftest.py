"""Test setup: CPU tests run on the CPU device even on a GPU machine; tests marked `gpu` run on
the GPU and are skipped without one, unless JFA_REQUIRE_GPU=1 turns the skip into a failure.
tests/multidevice needs fake CPU devices set before JAX starts: it is collected only in the
child run that tests/test_multidevice.py starts (JFA_MULTIDEVICE=1).

Two settings for runs cut into time-limited calls (the GPU machine's scripts use them):
JFA_TEST_SHARD=i/N keeps every N-th selected test starting at the i-th (1-based), so that N
calls or GPUs share the suite evenly; JFA_REPORT_FAILURES=1 prints each failure the moment it
is known, so that a run stopped by a time limit still names what failed.

README's test command runs pytest-xdist workers (`-n auto`: one per core, at most 8 here). On a
GPU each worker's JAX would take three quarters of the GPU's memory at start, so workers allocate
as they go instead (set before JAX starts its backends)."""
from __future__ import annotations

import functools
import os
import sys

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax
import pytest

MAX_AUTO_WORKERS = 8


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: unknown where xdist is not installed
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core, at most MAX_AUTO_WORKERS (each holds a JAX runtime, and on a
    GPU machine a context on every visible GPU)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_AUTO_WORKERS))

collect_ignore = [] if os.environ.get("JFA_MULTIDEVICE") == "1" else ["multidevice"]


@functools.cache
def gpu_unavailable_reason():
    import jax_flashattn as jfa
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        return "no GPU visible to JAX"
    if not jfa.build_info()["cuda"]:
        return "jax_flashattn was built without its CUDA kernels"
    return None


@pytest.fixture(autouse=True)
def _device_for_test(request):
    """CPU tests compute on the CPU device; gpu tests on the first GPU (or skip/fail)."""
    if "gpu" in request.keywords:
        reason = gpu_unavailable_reason()
        if reason is not None:
            if os.environ.get("JFA_REQUIRE_GPU") == "1":
                pytest.fail(f"JFA_REQUIRE_GPU=1 but {reason}")
            pytest.skip(reason)
        device = jax.devices("gpu")[0]
    else:
        device = jax.devices("cpu")[0]
    with jax.default_device(device):
        yield


def _shard(value):
    try:
        index, count = (int(part) for part in value.split("/"))
    except ValueError:
        index = count = 0
    if not 1 <= index <= count:
        raise pytest.UsageError(f"JFA_TEST_SHARD must be i/N with 1 <= i <= N, got {value!r}")
    return index, count


def pytest_configure(config):
    # Checked here too: pytest-xdist's controller runs this, so a bad value is reported as such
    # rather than as the workers' internal errors.
    if os.environ.get("JFA_TEST_SHARD"):
        _shard(os.environ["JFA_TEST_SHARD"])


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """JFA_TEST_SHARD=i/N: round robin over the tests left after -k and -m, so that each shard
    gets a share of every parametrized family (their costs differ more than their counts)."""
    value = os.environ.get("JFA_TEST_SHARD")
    if not value:
        return
    index, count = _shard(value)
    kept = [item for position, item in enumerate(items) if position % count == index - 1]
    dropped = [item for position, item in enumerate(items) if position % count != index - 1]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = kept


def pytest_runtest_logreport(report):
    """JFA_REPORT_FAILURES=1: a failure's test id and the end of its traceback, at once. Under
    pytest-xdist only the controller prints (it receives every worker's reports; a worker's own
    print would repeat it)."""
    if report.failed and os.environ.get("JFA_REPORT_FAILURES") == "1" and not os.environ.get("PYTEST_XDIST_WORKER"):
        sys.stderr.write(f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
        sys.stderr.flush()
