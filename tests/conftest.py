"""Test setup: CPU tests run on the CPU device even on a GPU machine; tests marked `gpu` run on
the GPU and are skipped without one, unless JFA_REQUIRE_GPU=1 turns the skip into a failure.
tests/multidevice needs fake CPU devices set before JAX starts: it is collected only in the
child run that tests/test_multidevice.py starts (JFA_MULTIDEVICE=1)."""
from __future__ import annotations

import functools
import os

import jax
import pytest

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
