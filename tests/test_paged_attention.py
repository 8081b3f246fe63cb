"""paged_attention against a float32 reference that assembles each sequence's rows page by page:
random page order, unused pages and rows past each length filled with NaN (they must not reach the
result or the gradients), GQA/MQA, causal, window, softcap, ALiBi; the argument checks; jit, vmap
and the split-KV decoding path it is meant to reach; both ways of reading the pages (gathered into
a contiguous cache, or handed to the kernel with the block table, as on Hopper GPUs)."""
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


def _run_cuda_branch(monkeypatch):
    """paged_attention with its CUDA branch taken on this machine, reading pages in place as on a
    Hopper GPU: the paged primitive and the split-KV path, on the CPU's handler."""
    real = jax.lax.platform_dependent
    monkeypatch.setattr(paged, "_hopper_reads_pages", lambda *a: True)
    monkeypatch.setattr(jax.lax, "platform_dependent",
                        lambda *args, default, cuda: real(*args, default=cuda))


# (B, T, N, K, page_size, lengths, max_pages, keywords): what the Hopper path takes (pages a
# multiple of 16 rows), with and without the split (short caches, ALiBi's unfolded heads); key
# blocks of whole 128-key tiles where the pages allow it, else of whole pages (p16 with 66 pages).
IN_PLACE_CASES = {
    "t1-p16-gqa4-causal-split": (2, 1, 8, 2, 16, [1100, 517], 80, dict(is_causal=True)),
    "t2-p16-unaligned-split": (2, 2, 4, 2, 16, [1056, 300], 66, dict(is_causal=True)),
    "t4-p48-gqa2-softcap-split": (2, 4, 4, 2, 48, [1536, 49], 32, dict(softcap=4.0)),
    "t1-p128-gqa4-causal-split": (2, 1, 8, 2, 128, [1100, 517], 12, dict(is_causal=True)),
    "t4-p256-gqa2-causal-split": (2, 4, 4, 2, 256, [2048, 700], 8, dict(is_causal=True)),
    "t16-p128-mqa-softcap-split": (2, 16, 4, 1, 128, [1500, 1024], 16, dict(softcap=4.0)),
    "t1-p128-alibi-split": (2, 1, 4, 2, 128, [900, 1025], 12, dict(
        is_causal=True, alibi_slopes=np.linspace(0.01, 0.1, 4, dtype=np.float32))),
    "t8-p128-window-unsplit": (3, 8, 4, 2, 128, [300, 129, 8], 3, dict(is_causal=True,
                                                                      local_window_size=(64, 0))),
}


@pytest.mark.parametrize("case", list(IN_PLACE_CASES))
def test_in_place_path_matches_reference(case, monkeypatch):
    """The path that hands the block table to the kernel (split into key blocks that are slices
    of the table, the causal tail gathered from the pools), against the reference, gradients
    included (through the gathered call)."""
    _run_cuda_branch(monkeypatch)
    B, T, N, K, page_size, lengths, max_pages, kw = IN_PLACE_CASES[case]
    check(fresh_seed(), B, T, N, K, page_size, lengths, max_pages, dict(kw))


def test_in_place_path_never_copies_the_cache(monkeypatch):
    """Reading in place: the forward has no cache-sized gather, and a decode call's blocks are the
    block table cut in slices ([B·P, max_pages / P])."""
    _run_cuda_branch(monkeypatch)
    q = jax.ShapeDtypeStruct((2, 1, 8, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((300, 256, 2, 128), jnp.bfloat16)
    table = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    jaxpr = str(jax.make_jaxpr(lambda *a: jfa.paged_attention(*a, is_causal=True))(q, cache, cache, table, lengths))
    assert "jfa_paged_fwd" in jaxpr and "bf16[2,4096,2,128]" not in jaxpr
    plan = decode.split_plan((2, 1, 8, 128), (2, 4096, 2, 128), jfa._options.MaskConfig(is_causal=True),
                             jfa._options.Extras(block_table=jnp.zeros((2, 16), jnp.int32)), None, granule=256)
    assert plan.chunks > 1 and f"i32[{2 * plan.chunks},{16 // plan.chunks}]" in jaxpr


def test_in_place_blocks_of_whole_pages_when_tiles_do_not_divide(monkeypatch):
    """16-row pages whose 2064 rows make no whole number of 128-key tiles per block: the call is
    still cut into blocks, of whole pages (3 blocks of 43 pages), rather than left unsplit with
    the heads folded only; 1280 rows split into whole tiles (2 blocks of 40 pages)."""
    _run_cuda_branch(monkeypatch)
    q = jax.ShapeDtypeStruct((2, 1, 8, 128), jnp.bfloat16)
    cache = jax.ShapeDtypeStruct((300, 16, 2, 128), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((2,), jnp.int32)
    for max_pages, sliced in ((129, "i32[6,43]"), (80, "i32[4,40]")):
        table = jax.ShapeDtypeStruct((2, max_pages), jnp.int32)
        jaxpr = str(jax.make_jaxpr(lambda *a: jfa.paged_attention(*a, is_causal=True))(q, cache, cache, table, lengths))
        assert "jfa_paged_fwd" in jaxpr and sliced in jaxpr, (max_pages, sliced)


def test_vmap_with_a_shared_pool(monkeypatch):
    """vmap over the queries, tables and lengths of one shared pool (in_axes None for the caches),
    on both paths."""
    seed = fresh_seed()
    q, kc, vc, table, lengths = make_cache(seed, 2, 4, 4, 2, 128, [300, 129], 3, spare_pages=2)
    qs = np.stack([q, q[::-1]])
    tables, all_lengths = np.stack([table, table[::-1]]), np.stack([lengths, lengths[::-1]])
    for in_place in (False, True):
        if in_place:
            _run_cuda_branch(monkeypatch)
        fn = jax.vmap(lambda q, t, n: jfa.paged_attention(q, kc, vc, t, n, is_causal=True))
        got = jax.jit(fn)(qs, tables, all_lengths)
        for i in range(2):
            want = reference(qs[i], kc, vc, tables[i], all_lengths[i], is_causal=True)[0]
            assert rel_err(got[i], want) <= 1e-5, f"seed {seed}: in place {in_place}, element {i}"


def test_kernel_checks_paged_operands_again():
    """What reaches the C++ handlers is checked there too: an ffi::Error naming the operand."""
    from jax_flashattn._options import Extras, MaskConfig
    from jax_flashattn._paged_primitive import paged_fwd_p
    from jax_flashattn.primitives import attention_bwd_p
    q, kc, vc, table, lengths = (jnp.asarray(x) for x in make_cache(0, 2, 1, 4, 2, 16, [20, 16], 2))
    kc, vc = jnp.nan_to_num(kc), jnp.nan_to_num(vc)
    none = {name: jnp.zeros((), jnp.int32) for name in Extras._fields}

    def forward(kc, vc, table):
        extras = dict(none, key_value_seq_lengths=lengths, block_table=table)
        return paged_fwd_p.bind(q, kc, vc, *extras.values(), scale=0.25, config=MaskConfig(),
                                implementation=None)
    forward(kc, vc, table)
    with pytest.raises(Exception, match=r"block_table must be int32 \[B, max_pages\] with B=2"):
        forward(kc, vc, table[:1])
    with pytest.raises(Exception, match="value_cache .* does not match key_cache"):
        forward(kc, vc[:-1], table)
    with pytest.raises(Exception, match=r"key_cache .* does not match query .* in head dim"):
        forward(kc[..., :8], vc, table)
    k = jnp.zeros((2, 32, 2, 16))
    extras = dict(none, block_table=table)
    with pytest.raises(Exception, match="backward takes contiguous key and value"):
        attention_bwd_p.bind(q, k, k, q, jnp.zeros((2, 1, 4)), q, jnp.zeros((2, 1, 4)), *extras.values(),
                             scale=0.25, config=MaskConfig(), implementation=None)


def test_cuda_lowering_of_the_in_place_path(monkeypatch):
    """Lowering for CUDA with the table handed to the kernel works without a GPU (in a build
    without CUDA kernels it stops at the missing kernels, never before)."""
    monkeypatch.setattr(paged, "_hopper_reads_pages", lambda *a: True)
    q, kc, vc, table, lengths = make_cache(0, 2, 1, 8, 2, 128, [300, 129], 3, head_dim=128)
    bf16 = lambda x: jnp.asarray(np.nan_to_num(x), jnp.bfloat16)  # noqa: E731
    traced = jax.jit(lambda *a: jfa.paged_attention(*a, is_causal=True)).trace(
        bf16(q), bf16(kc), bf16(vc), table, lengths)
    try:
        text = traced.lower(lowering_platforms=("cuda",)).as_text()
    except RuntimeError as e:
        assert "without its CUDA kernels" in str(e)
        return
    assert "jfa_attention_fwd" in text


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["t1-causal", "t4-causal", "t4-fp16-causal", "t16-alibi", "t1-softcap-h64",
                                  "t2-window-h256"])
def test_hopper_reads_pages_in_place(case):
    """On a Hopper GPU, pages of any multiple of 16 rows are read by the kernel (bf16, and fp16 once,
    against the float32 reference; NaN in the rows past each length and in unused pages, which must
    not reach the result): pages smaller than a key tile in chunks (64-row chunks inside 192-row
    pages too), and key blocks of the split that end inside a tile (2064 rows of 16-row pages split
    in three)."""
    T, head_dim, kw, dtype = {
        "t1-causal": (1, 128, dict(is_causal=True), jnp.bfloat16),
        "t4-causal": (4, 128, dict(is_causal=True), jnp.bfloat16),
        "t4-fp16-causal": (4, 128, dict(is_causal=True), jnp.float16),
        "t16-alibi": (16, 128, dict(is_causal=True, alibi_slopes=np.linspace(0.01, 0.1, 8, dtype=np.float32)),
                      jnp.bfloat16),
        "t1-softcap-h64": (1, 64, dict(softcap=5.0), jnp.bfloat16),
        "t2-window-h256": (2, 256, dict(is_causal=True, local_window_size=(300, 0)), jnp.bfloat16),
    }[case]
    variants = jfa.build_info()["cuda_variants"] or ""  # e.g. "fwd+bwd: fp16,bf16 x hdim 64,128"
    dtypes, _, head_dims = variants.partition(" x hdim ")
    if {jnp.float16: "fp16", jnp.bfloat16: "bf16"}[dtype] not in dtypes or str(head_dim) not in head_dims.split(","):
        pytest.skip(f"this build has no {jnp.dtype(dtype).name} H {head_dim} kernels ({variants})")
    seed = fresh_seed()
    for page_size, lengths in ((16, [1100, 517, 16]), (48, [2064, 95, 48]), (64, [1000, 64, 21]),
                               (128, [1100, 517, 128]), (192, [2000, 300, 192]), (256, [2048, 300, 21])):
        q, kc, vc, table, lengths = make_cache(seed, 3, T, 8, 2, page_size, lengths, 2048 // page_size + 1,
                                               head_dim=head_dim)
        assert paged._hopper_reads_pages(jnp.zeros(q.shape, dtype), vc, page_size), case
        with jax.default_device(jax.devices("cpu")[0]):
            want = reference(q, kc, vc, table, lengths, **kw)[0]
        cast = lambda x: jnp.asarray(x, dtype)  # noqa: E731
        got = jfa.paged_attention(cast(q), cast(kc), cast(vc), table, lengths, **kw)
        assert rel_err(got, want) < 2e-2, f"seed {seed}, page size {page_size}: {rel_err(got, want)}"


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
