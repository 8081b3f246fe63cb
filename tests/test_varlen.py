"""varlen_attention against the float32 reference run on each packed sequence on its own."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn as jfa
from jax_flashattn import dropout
from jax_flashattn.reference import attention_reference
from util import fresh_seed, rel_err


def _packed(seed, q_lens, k_lens, N=4, K=2, H=16, extra_rows=3):
    keys = jax.random.split(jax.random.key(seed), 3)
    total_q, total_k = sum(q_lens) + extra_rows, sum(k_lens)
    q = jax.random.normal(keys[0], (total_q, N, H))
    k = jax.random.normal(keys[1], (total_k, K, H))
    v = jax.random.normal(keys[2], (total_k, K, H))
    cu = lambda lens: jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)  # noqa: E731
    return q, k, v, cu(q_lens), cu(k_lens)


@pytest.mark.parametrize("kw", [
    dict(), dict(is_causal=True), dict(is_causal=True, causal_alignment="bottom_right"),
    dict(local_window_size=(4, 2), causal_alignment="bottom_right", softcap=3.0,
         alibi_slopes=jnp.array([0.1, 0.2, 0.3, 0.4])),
], ids=["full", "causal", "bottom_right", "window+softcap+alibi"])
def test_matches_each_sequence_alone(kw):
    seed = fresh_seed()
    q_lens, k_lens = [5, 17, 1, 70], [9, 17, 30, 66]
    q, k, v, cu_q, cu_k = _packed(seed, q_lens, k_lens)
    w = jax.random.normal(jax.random.key(seed + 1), (q.shape[0], 4, 16))

    def ours(q, k, v):
        out, lse = jfa.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=70, max_seqlen_k=66,
                                        return_lse=True, **kw)
        return jnp.sum(out * w), (out, lse)

    def theirs(q, k, v):
        outs, lses = [], []
        for b in range(len(q_lens)):
            sq = slice(int(cu_q[b]), int(cu_q[b + 1]))
            sk = slice(int(cu_k[b]), int(cu_k[b + 1]))
            o, l = attention_reference(q[None, sq], k[None, sk], v[None, sk], **kw)
            outs.append(o[0])
            lses.append(l[0])
        out = jnp.concatenate(outs + [jnp.zeros((3, 4, 16))])
        return jnp.sum(out * w), (out, jnp.concatenate(lses))

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    (_, (r_out, r_lse)), r_grads = jax.value_and_grad(theirs, argnums=(0, 1, 2), has_aux=True)(q, k, v)
    assert rel_err(out, r_out) <= 1e-5, f"seed {seed}"
    empty = np.isneginf(np.asarray(r_lse))  # e.g. the first rows of a bottom-right sequence
    assert np.array_equal(np.isneginf(np.asarray(lse[:-3])), empty)
    assert rel_err(jnp.where(empty, 0, lse[:-3]), jnp.where(empty, 0, r_lse)) <= 1e-5
    assert np.all(np.isneginf(np.asarray(lse[-3:])))
    assert not np.any(np.asarray(out[-3:]))
    for g, r in zip(grads, r_grads):
        assert rel_err(g, r) <= 4e-5, f"seed {seed}"


def test_dropout_coordinates_are_per_sequence():
    """Sequence b's dropout mask is the batched mask of batch element b at its own positions."""
    rng = jax.random.key(fresh_seed())
    q_lens, k_lens = [3, 6], [4, 6]
    q, k, v, cu_q, cu_k = _packed(fresh_seed(), q_lens, k_lens, N=2, K=1, extra_rows=0)
    kw = dict(dropout_rate=0.5, dropout_rng=rng)
    out = jfa.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=6, max_seqlen_k=6, **kw)
    keep = dropout.keep_mask(rng, 0.5, (2, 2, 6, 6))
    for b in range(2):
        sq, sk = slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))
        ref, _ = attention_reference(q[None, sq], k[None, sk], v[None, sk], dropout_rate=0.5,
                                     dropout_keep=keep[b:b + 1, :, :q_lens[b], :k_lens[b]])
        assert rel_err(out[sq], ref[0]) <= 1e-5


def test_bad_arguments_are_named():
    q, k, v, cu_q, cu_k = _packed(0, [2, 3], [2, 3])
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        jfa.varlen_attention(q, k, v, cu_q.astype(jnp.float32), cu_k, max_seqlen_q=3, max_seqlen_k=3)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        jfa.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=3, max_seqlen_k=0)
    with pytest.raises(ValueError, match="query"):
        jfa.varlen_attention(q[None], k, v, cu_q, cu_k, max_seqlen_q=3, max_seqlen_k=3)
    with pytest.raises(TypeError, match="query_seq_lengths"):
        jfa.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=3, max_seqlen_k=3,
                             query_seq_lengths=jnp.array([1, 2], jnp.int32))
