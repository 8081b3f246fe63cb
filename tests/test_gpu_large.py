"""Operands of more than 2^31 elements on a GPU, forward and backward: every offset into Q, K, V, O,
dO, the gradients and the float32 dQ accumulator must be 64-bit. The batch is long and the
sequences short, so that the last batch element lies wholly past element 2^31 of every operand and
the attention itself stays cheap; the first and the last batch elements are checked against the
float32 reference (a 32-bit offset would wrap there: a fault or another element's values).

About 42 GiB of GPU memory (JAX's peak, both paths); skipped where JAX may use less than 48 GiB."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import jax_flashattn as jfa
from util import BOUNDS, fresh_seed, reference_with_grads, rel_err

pytestmark = pytest.mark.gpu

B, T, N, H = 32769, 256, 2, 128  # 2^31 + 2^16 elements per operand; batch element 32768 starts at 2^31
NEEDED_BYTES = 48 * 2**30  # the peak of the docstring and a margin, under an 80 GB GPU's default JAX limit


def _memory_limit() -> int:
    stats = jax.devices("gpu")[0].memory_stats() or {}
    return int(stats.get("bytes_limit", 0))


@pytest.mark.parametrize("path,is_causal", [("default", False), ("portable", True)])
def test_operands_past_2_31_elements(path, is_causal, monkeypatch):
    assert B * T * N * H > 2**31 and (B - 1) * T * N * H >= 2**31
    limit = _memory_limit()
    if limit and limit < NEEDED_BYTES:
        pytest.skip(f"needs about {NEEDED_BYTES / 2**30:.0f} GiB of GPU memory, this GPU has {limit / 2**30:.0f}")
    if path == "portable":
        monkeypatch.setenv("JFA_FORCE_SM80", "1")  # read when the call is lowered
    seed = fresh_seed()
    dtype = jnp.bfloat16
    keys = jax.random.split(jax.random.key(seed), 5)
    q, k, v, do = (jax.random.normal(key, (B, T, N, H), dtype) for key in keys[:4])
    dlse = jax.random.normal(keys[4], (B, T, N), jnp.float32)
    picked = jnp.array([0, B - 1])

    @jax.jit
    def ours(q, k, v, do, dlse):
        (out, lse), vjp = jax.vjp(lambda q, k, v: jfa.flash_attention(
            q, k, v, is_causal=is_causal, return_lse=True, implementation="cuda"), q, k, v)
        return tuple(x[picked] for x in (out, lse, *vjp((do, dlse))))

    got = ours(q, k, v, do, dlse)
    fwd_bound, grad_bound = BOUNDS[dtype]
    for i, b in enumerate((0, B - 1)):
        ref = reference_with_grads(q[b:b + 1], k[b:b + 1], v[b:b + 1], do[b:b + 1], dlse[b:b + 1],
                                   is_causal=is_causal)
        ref_out, ref_lse, (ref_dq, ref_dk, ref_dv) = ref
        out, lse, dq, dk, dv = (x[i:i + 1] for x in got)
        assert rel_err(out, ref_out) <= fwd_bound, f"seed {seed}: out of batch element {b}"
        assert rel_err(lse, ref_lse) <= 1e-4, f"seed {seed}: lse of batch element {b}"
        for name, g, r in (("dq", dq, ref_dq), ("dk", dk, ref_dk), ("dv", dv, ref_dv)):
            assert rel_err(g, r) <= grad_bound, f"seed {seed}: {name} of batch element {b}: {rel_err(g, r)}"
