"""paged_attention against a float32 reference that assembles each sequence's rows page by page:
random page order, unused pages and rows past each length filled with NaN (they must not reach the
result or the gradients), GQA/MQA, causal, window, softcap, ALiBi; the argument checks; jit, vmap
and the split-KV decoding path it is meant to reach."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn as jfa
from jax_flashattn import decode, paged
from jax_flashattn.reference import attention_reference
from util import fresh_seed, rel_err

H = 16


def make_cache(seed, B, T, N, K, page_size, lengths, max_pages, spare_pages=3, head_dim=H):
    """(q, key_cache, value_cache, block_table, lengths): the sequences' pages are a random
    permutation of the pool; pages no sequence uses, rows past each length and block_table entries
    past the used pages are garbage (NaN rows, out-of-range ids)."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, np.int32)
    used = -(-lengths // page_size)
    num_pages = int(used.sum()) + spare_pages
    q = rng.standard_normal((B, T, N, head_dim)).astype(np.float32)
    kc = rng.standard_normal((num_pages, page_size, K, head_dim)).astype(np.float32)
    vc = rng.standard_normal((num_pages, page_size, K, head_dim)).astype(np.float32)
    order = rng.permutation(num_pages)
    table = rng.integers(-5, num_pages + 5, (B, max_pages)).astype(np.int32)  # garbage ids
    start = 0
    for b in range(B):
        table[b, :used[b]] = order[start:start + used[b]]
        start += used[b]
        tail = lengths[b] % page_size
        if tail:  # the rest of the last page holds stale rows
            kc[table[b, used[b] - 1], tail:] = np.nan
            vc[table[b, used[b] - 1], tail:] = np.nan
    kc[order[start:]] = np.nan
    vc[order[start:]] = np.nan
    return q, kc, vc, table, lengths


def row_index(table, lengths, page_size, rows):
    """(page, offset, valid) [B, rows] of each sequence's cached rows, walked one page at a time."""
    B = len(lengths)
    page, offset = np.zeros((B, rows), np.int32), np.zeros((B, rows), np.int32)
    for b in range(B):
        r = 0
        for j in range(-(-int(lengths[b]) // page_size)):
            for o in range(page_size):
                if r < lengths[b]:
                    page[b, r], offset[b, r] = table[b, j], o
                    r += 1
    return page, offset, np.arange(rows)[None] < lengths[:, None]


def reference(q, kc, vc, table, lengths, **kw):
    """(out, lse) of the float32 reference over each sequence's rows (zero past its length)."""
    rows = int(lengths.max())
    page, offset, valid = row_index(table, lengths, kc.shape[1], rows)
    mask = jnp.asarray(valid)[:, :, None, None]
    k = jnp.where(mask, kc[page, offset], 0.0)
    v = jnp.where(mask, vc[page, offset], 0.0)
    return attention_reference(q, k, v, key_value_seq_lengths=jnp.asarray(lengths),
                               causal_alignment="bottom_right", **kw)


def check(seed, B, T, N, K, page_size, lengths, max_pages, kw):
    q, kc, vc, table, lengths = make_cache(seed, B, T, N, K, page_size, lengths, max_pages)
    slopes = kw.pop("alibi_slopes", None)
    if kw.pop("share_first_page", False):  # a shared prompt prefix: its gradient sums both uses
        table[1, 0] = table[0, 0]

    def ours(q, kc, vc, slopes):
        return jfa.paged_attention(q, kc, vc, table, lengths, alibi_slopes=slopes, return_lse=True,
                                   **kw)

    def ref(q, kc, vc, slopes):
        return reference(q, kc, vc, table, lengths, alibi_slopes=slopes, **kw)

    rng = np.random.default_rng(seed + 1)
    cot = (rng.standard_normal((B, T, N, H)).astype(np.float32),
           rng.standard_normal((B, T, N)).astype(np.float32))

    def run(fn, q, kc, vc, slopes, cot):
        (out, lse), vjp = jax.vjp(fn, q, kc, vc, slopes)
        return out, lse, vjp(cot)

    run = jax.jit(run, static_argnums=0)  # forward and gradients in one compilation: compiling dominates
    out, lse, got = run(ours, q, kc, vc, slopes, cot)
    r_out, r_lse, want = run(ref, q, kc, vc, slopes, cot)
    assert rel_err(out, r_out) <= 1e-5, f"seed {seed}: out {rel_err(out, r_out)}"
    assert rel_err(lse, r_lse) <= 1e-5, f"seed {seed}: lse {rel_err(lse, r_lse)}"
    for name, g, w in zip(("dq", "dkey_cache", "dvalue_cache", "dslopes"), got, want):
        if w is None:
            continue
        assert np.all(np.isfinite(g)), f"seed {seed}: {name} is not finite"
        assert rel_err(g, w) <= 4e-5, f"seed {seed}: {name} {rel_err(g, w)}"
    used = np.unique(np.concatenate([table[b, :-(-lengths[b] // page_size)] for b in range(B)]))
    unused = np.setdiff1d(np.arange(kc.shape[0]), used)
    assert not np.any(np.asarray(got[1])[unused]) and not np.any(np.asarray(got[2])[unused])


# (B, T, N, K, page_size, lengths, max_pages, keywords); each has one length on a page boundary.
CASES = {
    "t1-p16-mha-causal": (3, 1, 4, 4, 16, [48, 37, 1], 4, dict(is_causal=True)),
    "t1-p64-gqa4-softcap": (2, 1, 8, 2, 64, [128, 75], 3, dict(softcap=3.0)),
    "t1-p256-gqa8-window": (2, 1, 8, 1, 256, [256, 300], 2, dict(is_causal=True,
                                                                 local_window_size=(100, 0))),
    "t4-p16-gqa4-causal": (3, 4, 8, 2, 16, [32, 21, 4], 3, dict(is_causal=True)),
    "t4-p64-mqa-noncausal": (2, 4, 4, 1, 64, [64, 90], 2, dict()),
    "t4-p256-gqa1-causal-softcap": (2, 4, 2, 2, 256, [512, 260], 3, dict(is_causal=True, softcap=5.0)),
    "t16-p16-gqa8-window": (2, 16, 8, 1, 16, [64, 50], 5, dict(is_causal=True,
                                                               local_window_size=(20, 0))),
    "t16-p64-gqa4-alibi": (2, 16, 8, 2, 64, [128, 100], 2, dict(
        is_causal=True, alibi_slopes=np.linspace(0.01, 0.1, 8, dtype=np.float32))),
    "t16-p256-mqa-noncausal-window": (2, 16, 4, 1, 256, [256, 400], 2, dict(local_window_size=64)),
    "t64-p64-gqa4-causal": (2, 64, 4, 1, 64, [128, 70], 3, dict(is_causal=True)),
    "t2-p16-shared-first-page": (2, 2, 4, 2, 16, [20, 32], 2, dict(is_causal=True,
                                                                     share_first_page=True)),
    "t1-p64-gqa4-padded-to-512": (2, 1, 8, 2, 64, [1088, 700], 17, dict(is_causal=True)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case):
    B, T, N, K, page_size, lengths, max_pages, kw = CASES[case]
    check(fresh_seed(), B, T, N, K, page_size, lengths, max_pages, dict(kw))


def test_matches_jax_nn():
    """One query, GQA, per-sequence lengths: jax.nn.dot_product_attention on the rows gathered in
    NumPy, an implementation independent of the library's reference."""
    seed = fresh_seed()
    q, kc, vc, table, lengths = make_cache(seed, 3, 1, 8, 2, 16, [40, 16, 3], 3)
    page, offset, valid = row_index(table, lengths, 16, 48)
    k = np.where(valid[:, :, None, None], kc[page, offset], 0)
    v = np.where(valid[:, :, None, None], vc[page, offset], 0)
    want = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=jnp.asarray(lengths),
                                        implementation="xla")
    got = jfa.paged_attention(q, kc, vc, table, lengths)
    assert rel_err(got, want) <= 1e-5, f"seed {seed}: {rel_err(got, want)}"


def test_jit_with_traced_tables_and_bad_ids():
    """Traced tables are not checked: used ids out of range are clamped into the pool, entries past
    the used pages (here -1 and huge) never reach the result."""
    seed = fresh_seed()
    q, kc, vc, table, lengths = make_cache(seed, 2, 4, 4, 2, 16, [20, 32], 4)
    want = reference(q, kc, vc, table, lengths, is_causal=True)[0]
    table[0, 2:] = -1
    table[1, 2:] = 2**30
    fn = jax.jit(lambda q, k, v, t, n: jfa.paged_attention(q, k, v, t, n, is_causal=True))
    assert rel_err(fn(q, kc, vc, table, lengths), want) <= 1e-5, f"seed {seed}"
    kc, vc = np.nan_to_num(kc), np.nan_to_num(vc)
    for bad_id in (-7, kc.shape[0], 2**30):  # a used page out of range: clamped into the pool
        table[0, 0] = bad_id
        assert np.all(np.isfinite(np.asarray(fn(q, kc, vc, table, lengths)))), bad_id


def test_vmap_over_an_extra_batch_axis():
    seed = fresh_seed()
    caches = [make_cache(seed + i, 2, 4, 4, 2, 16, [20 + 4 * i, 32], 3, spare_pages=0)
              for i in range(3)]
    stacked = [np.stack(x) for x in zip(*caches)]
    got = jax.jit(jax.vmap(lambda *a: jfa.paged_attention(*a, is_causal=True)))(*stacked)
    for i, c in enumerate(caches):
        want = reference(*c, is_causal=True)[0]
        assert rel_err(got[i], want) <= 1e-5, f"seed {seed}: element {i}"


def test_decode_calls_reach_the_split_path(monkeypatch):
    """The flash_attention call it makes qualifies for decode.py's split (one query: heads folded
    and keys cut into blocks; a few queries: keys cut), also where the cache's rows are no multiple
    of 512 (the gathered buffer is padded with masked rows)."""
    plans = []
    real = decode.split_plan

    def spy(*args):
        plans.append(real(*args))
        return plans[-1]

    monkeypatch.setattr(decode, "split_plan", spy)
    for T, page_size, max_pages, rows in ((1, 64, 17, 1536), (4, 256, 8, 2048), (16, 16, 100, 2048)):
        q = jax.ShapeDtypeStruct((2, T, 8, 64), jnp.bfloat16)
        cache = jax.ShapeDtypeStruct((300, page_size, 2, 64), jnp.bfloat16)
        table = jax.ShapeDtypeStruct((2, max_pages), jnp.int32)
        lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
        jaxpr = jax.make_jaxpr(lambda *a: jfa.paged_attention(*a, is_causal=True))(
            q, cache, cache, table, lengths)
        assert f"bf16[2,{rows},2,64]" in str(jaxpr)
        assert plans[-1] is not None and plans[-1].chunks > 1, (T, page_size, plans[-1])
        assert plans[-1].fold_heads == (T == 1)
    assert paged.gathered_pages(3, 16) == 3  # short caches are not padded
    assert paged.gathered_pages(10, 128) == 10  # 1280 rows split in two as they are
    assert paged.gathered_pages(9, 128) == 12  # 1152 rows do not split, 1536 do
    assert paged.gathered_pages(11, 100) == 11  # no multiple of 512 is a whole number of pages


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 4, 16])
def test_on_gpu(T):
    """On a GPU the call takes the split-KV path (bf16 against the float32 reference)."""
    seed = fresh_seed()
    q, kc, vc, table, lengths = make_cache(seed, 3, T, 8, 2, 64, [1088, 700, 64], 17, head_dim=64)
    with jax.default_device(jax.devices("cpu")[0]):
        want = reference(q, kc, vc, table, lengths, is_causal=True)[0]
    bf16 = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    got = jfa.paged_attention(bf16(q), bf16(kc), bf16(vc), table, lengths, is_causal=True)
    assert rel_err(got, want) < 2e-2, f"seed {seed}: {rel_err(got, want)}"


def test_page_size_is_inferred_and_checked():
    q, kc, vc, table, lengths = make_cache(0, 2, 1, 4, 2, 16, [20, 16], 2)
    a = jfa.paged_attention(q, kc, vc, table, lengths, page_size=16)
    assert np.array_equal(a, jfa.paged_attention(q, kc, vc, table, lengths))


def _bad(**change):
    q, kc, vc, table, lengths = make_cache(0, 2, 4, 4, 2, 16, [20, 32], 3)
    args = dict(query=q, key_cache=kc, value_cache=vc, block_table=table, seq_lengths=lengths)
    args.update(change)
    return args


ERRORS = [
    (dict(query=np.zeros((4, 4, 16), np.float32)), ValueError, r"query must be \[B, T, N, H\]"),
    (dict(key_cache=np.zeros((5, 16, 32), np.float32)), ValueError, r"key_cache must be \[num_pages"),
    (dict(value_cache=np.zeros((5, 16, 2, 16), np.float16)), TypeError, "one dtype"),
    (dict(key_cache=np.zeros((5, 16, 2, 16), np.int32)), TypeError, "key_cache must be float32"),
    (dict(key_cache=np.zeros((5, 16, 3, 16), np.float32),
          value_cache=np.zeros((5, 16, 3, 16), np.float32)), ValueError, "multiple of cache heads K=3"),
    (dict(value_cache=np.zeros((6, 16, 2, 16), np.float32)), ValueError, "value_cache must match"),
    (dict(key_cache=np.zeros((8, 16, 2, 8), np.float32),
          value_cache=np.zeros((8, 16, 2, 16), np.float32)), ValueError, "key_cache head dim"),
    (dict(block_table=np.zeros((2, 3), np.float32)), TypeError,
     r"block_table must be int32 \[B, max_pages\]"),
    (dict(block_table=np.zeros((3, 3), np.int32)), ValueError, r"block_table .* B=2 .* \(3, 3\)"),
    (dict(block_table=np.zeros((6,), np.int32)), ValueError, "block_table must be"),
    (dict(seq_lengths=np.zeros((2, 1), np.int32)), ValueError, r"seq_lengths must be int32 \[B\]"),
    (dict(seq_lengths=np.zeros((2,), np.float32)), TypeError, "seq_lengths must be int32"),
    (dict(seq_lengths=np.array([20, 49], np.int32)), ValueError, r"seq_lengths\[1\] = 49 .* 3 \* 16 = 48"),
    (dict(seq_lengths=np.array([3, 32], np.int32)), ValueError, r"seq_lengths\[0\] = 3 must be in \[T"),
]


@pytest.mark.parametrize("change,error,message", ERRORS)
def test_argument_errors(change, error, message):
    with pytest.raises(error, match=message):
        jfa.paged_attention(**_bad(**change))


@pytest.mark.parametrize("bad_id", [-1, 11])
def test_used_page_out_of_range(bad_id):
    args = _bad()
    args["block_table"][1, 1] = bad_id  # sequence 1 (32 rows) uses its first two pages
    with pytest.raises(ValueError, match=rf"block_table\[1, 1\] = {bad_id} .*num_pages=.*uses its "
                                         r"first 2"):
        jfa.paged_attention(**args)
    args["block_table"][1, 1] = 0
    args["block_table"][1, 2] = bad_id  # past the used pages: allowed
    jfa.paged_attention(**args)


def test_page_size_mismatch():
    with pytest.raises(ValueError, match="page_size=32 does not match the caches' page size 16"):
        jfa.paged_attention(**_bad(), page_size=32)
