"""varlen_attention against the float32 reference run on each packed sequence on its own."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn as jfa
from jax_flashattn import dropout
from jax_flashattn.reference import attention_reference
from util import fresh_seed, nested_eqns, rel_err


def _packed(seed, q_lens, k_lens, N=4, K=2, H=16, extra_rows=3):
    keys = jax.random.split(jax.random.key(seed), 3)
    total_q, total_k = sum(q_lens) + extra_rows, sum(k_lens)
    q = jax.random.normal(keys[0], (total_q, N, H))
    k = jax.random.normal(keys[1], (total_k, K, H))
    v = jax.random.normal(keys[2], (total_k, K, H))
    cu = lambda lens: jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)  # noqa: E731
    return q, k, v, cu(q_lens), cu(k_lens)


@pytest.mark.parametrize("kw", [
    dict(), dict(softcap=3.0, deterministic=True), dict(is_causal=True),
    dict(is_causal=True, causal_alignment="bottom_right"),
    dict(local_window_size=(4, 2), causal_alignment="bottom_right", softcap=3.0,
         alibi_slopes=jnp.array([0.1, 0.2, 0.3, 0.4])),
], ids=["full", "softcap", "causal", "bottom_right", "window+softcap+alibi"])
def test_matches_each_sequence_alone(kw):
    """Two different packings: without positions (full, softcap) one unpadded batch row with
    segment ids, otherwise the padded path (test_cross_packing_without_positions_is_unpadded)."""
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
            ref_kw = {name: x for name, x in kw.items() if name != "deterministic"}
            o, l = attention_reference(q[None, sq], k[None, sk], v[None, sk], **ref_kw)
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


@pytest.mark.parametrize("empty", ["keys", "queries"])
@pytest.mark.parametrize("kw", [dict(), dict(is_causal=True), dict(mask=jnp.ones((1, 1, 5, 4), bool))],
                         ids=["unpadded", "causal", "mask"])
def test_packings_without_rows(empty, kw):
    """Every key (or query) sequence empty: zero packed rows on that side, on both paths. Query
    rows then see no key (out 0, LSE -inf, zero gradients); with no query rows there is nothing."""
    q, k, v, cu_q, cu_k = _packed(fresh_seed(), [2, 3], [0, 0] if empty == "keys" else [4, 1],
                                  extra_rows=0)
    if empty == "queries":
        q, cu_q = q[:0], jnp.zeros(3, jnp.int32)

    def loss(q, k, v):
        out, lse = jfa.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=5, max_seqlen_k=4,
                                        return_lse=True, **kw)
        return jnp.sum(out), (out, lse)

    (_, (out, lse)), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    assert out.shape == q.shape[:2] + (v.shape[-1],) and lse.shape == q.shape[:2]
    assert not np.any(np.asarray(out)) and np.all(np.isneginf(np.asarray(lse)))
    for g, x in zip(grads, (q, k, v)):
        assert g.shape == x.shape and not np.any(np.asarray(g))


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


def test_offsets_known_at_trace_time_are_checked():
    """Concrete cu_seqlens: a sequence longer than max_seqlen, falling offsets and offsets past
    the packed rows name the argument. Traced ones cannot be checked: a longer sequence is cut."""
    q, k, v, cu_q, cu_k = _packed(fresh_seed(), [2, 5], [3, 4], extra_rows=0)
    with pytest.raises(ValueError, match=r"sequence 1 has 5 rows \(cu_seqlens_q\[1:3\] = \[2, 7\]\), "
                                         r"more than max_seqlen_q=4"):
        jfa.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=4, max_seqlen_k=4)
    with pytest.raises(ValueError, match="max_seqlen_k=3"):
        jfa.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=5, max_seqlen_k=3)
    with pytest.raises(ValueError, match=r"cu_seqlens_k must rise .* 7 packed rows, got \[0, 5, 3\]"):
        jfa.varlen_attention(q, k, v, cu_q, jnp.array([0, 5, 3], jnp.int32), max_seqlen_q=5, max_seqlen_k=5)
    with pytest.raises(ValueError, match=r"cu_seqlens_q must rise .* 7 packed rows, got \[0, 2, 9\]"):
        jfa.varlen_attention(q, k, v, jnp.array([0, 2, 9], jnp.int32), cu_k, max_seqlen_q=9, max_seqlen_k=5)
    # Traced offsets: sequence 1's query rows past max_seqlen_q = 4 give 0 (documented cut).
    out = jax.jit(lambda cq, ck: jfa.varlen_attention(q, k, v, cq, ck, max_seqlen_q=4, max_seqlen_k=4))(cu_q, cu_k)
    assert np.all(np.asarray(out[6:]) == 0) and np.all(np.any(np.asarray(out[:6]) != 0, axis=(1, 2)))


SELF_KW = [dict(), dict(is_causal=True), dict(is_causal=True, causal_alignment="bottom_right"),
           dict(local_window_size=(4, 2), softcap=3.0, alibi_slopes=jnp.array([0.1, 0.2, 0.3, 0.4])),
           dict(is_causal=True, deterministic=True)]


@pytest.mark.parametrize("kw", SELF_KW, ids=["full", "causal", "bottom_right", "window+softcap+alibi",
                                             "deterministic"])
def test_packed_self_attention_runs_unpadded_and_matches(kw):
    """Self-attention over one packing (the same cu_seqlens object, or None): one batch row with
    segment ids, no padded copy; the same results as the padded path and the reference."""
    seed = fresh_seed()
    lens = [5, 17, 1, 70, 0, 9]
    q, _, _, cu, _ = _packed(seed, lens, lens, extra_rows=3)
    k = jax.random.normal(jax.random.key(seed + 2), (q.shape[0], 2, 16))
    v = jax.random.normal(jax.random.key(seed + 3), (q.shape[0], 2, 16))
    w = jax.random.normal(jax.random.key(seed + 1), q.shape)

    def run(cu_k):
        def loss(q, k, v):
            out, lse = jfa.varlen_attention(q, k, v, cu, cu_k, max_seqlen_q=70, max_seqlen_k=70,
                                            return_lse=True, **kw)
            return jnp.sum(out * w), (out, lse)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))

    # A copy of cu (another array) takes the padded path: both must agree.
    (_, (out, lse)), grads = run(cu)(q, k, v)
    (_, (out_none, _)), _ = run(None)(q, k, v)
    (_, (p_out, p_lse)), p_grads = run(jnp.array(cu))(q, k, v)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_none))
    ref_kw = {name: x for name, x in kw.items() if name != "deterministic"}
    for b in range(len(lens)):
        s = slice(int(cu[b]), int(cu[b + 1]))
        if lens[b] == 0:
            continue
        r_out, r_lse = attention_reference(q[None, s], k[None, s], v[None, s], **ref_kw)
        assert rel_err(out[s], r_out[0]) <= 1e-5, f"seed {seed}, sequence {b}"
        assert rel_err(lse[s], r_lse[0]) <= 1e-5, f"seed {seed}, sequence {b}"
    assert np.all(np.isneginf(np.asarray(lse[-3:]))) and not np.any(np.asarray(out[-3:]))
    assert rel_err(out, p_out) <= 1e-5 and rel_err(jnp.where(jnp.isinf(lse), 0, lse),
                                                   jnp.where(jnp.isinf(p_lse), 0, p_lse)) <= 1e-5
    for g, r in zip(grads, p_grads):
        assert rel_err(g, r) <= 4e-5, f"seed {seed}"


def test_packed_self_attention_has_no_padded_copy():
    q, k, v, cu, _ = _packed(0, [5, 17, 1], [5, 17, 1], extra_rows=0)
    k, v = q[:, :2], q[:, :2]

    def fwd_operand_shapes(cu_k):
        jaxpr = jax.make_jaxpr(lambda q, k, v: jfa.varlen_attention(
            q, k, v, cu, cu_k, max_seqlen_q=17, max_seqlen_k=17, is_causal=True))(q, k, v)
        return [e.invars[0].aval.shape for e in nested_eqns(jaxpr.jaxpr) if e.primitive.name == "jfa_attention_fwd"]

    assert fwd_operand_shapes(cu) == [(1, 23, 4, 16)]
    assert fwd_operand_shapes(jnp.array(cu)) == [(3, 17, 4, 16)]  # another array: padded


def test_cross_packing_without_positions_is_unpadded():
    """Two packings (different lengths on each side): one batch row when nothing depends on
    positions; causal, window or ALiBi need each sequence's own start, so those pad."""
    q, k, v, cu_q, cu_k = _packed(0, [5, 17, 1], [9, 2, 30], extra_rows=2)

    def fwd_operand_shapes(**kw):
        jaxpr = jax.make_jaxpr(lambda q, k, v: jfa.varlen_attention(
            q, k, v, cu_q, cu_k, max_seqlen_q=17, max_seqlen_k=30, **kw))(q, k, v)
        return [tuple(x.aval.shape for x in e.invars[:2]) for e in nested_eqns(jaxpr.jaxpr)
                if e.primitive.name == "jfa_attention_fwd"]

    assert fwd_operand_shapes() == [((1, 25, 4, 16), (1, 41, 2, 16))]
    assert fwd_operand_shapes(softcap=2.0) == [((1, 25, 4, 16), (1, 41, 2, 16))]
    padded = [((3, 17, 4, 16), (3, 30, 2, 16))]
    assert fwd_operand_shapes(is_causal=True) == padded
    assert fwd_operand_shapes(local_window_size=(3, 3)) == padded
    assert fwd_operand_shapes(alibi_slopes=jnp.ones((4,))) == padded
    assert fwd_operand_shapes(bias=jnp.zeros((1, 4, 17, 30))) == padded
