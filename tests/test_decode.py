"""The decoding split (jax_flashattn/decode.py: key blocks folded into the batch, query heads of a
group folded into the rows, merged by their LSEs) against the plain call, forward, LSE and every
gradient. The split runs on CUDA devices by itself; here it is called directly on the CPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashattn as jfa
from jax_flashattn import _options, decode
from jax_flashattn.autodiff import attention, attention_core
from util import fresh_seed, random_qkv, rel_err

# (B, T, S, N, K, keywords, chunks, fold_heads)
CASES = {
    "one-query-gqa-causal-lengths": (3, 1, 1024, 8, 2, dict(is_causal=True, causal_alignment="bottom_right",
                                                            key_value_seq_lengths=[1024, 700, 129]), 4, True),
    "one-query-mqa-softcap": (2, 1, 512, 4, 1, dict(softcap=5.0), 4, True),
    "few-queries-causal-window-alibi": (2, 5, 1024, 4, 2, dict(
        is_causal=True, causal_alignment="bottom_right", local_window_size=(300, 0),
        key_value_seq_lengths=[900, 1024], alibi_slopes=[0.01, 0.02, 0.04, 0.08]), 8, False),
    "one-query-window-no-fold": (2, 1, 768, 4, 2, dict(is_causal=True, causal_alignment="bottom_right",
                                                       local_window_size=(200, 0)), 3, False),
    "empty-cache-rows": (2, 3, 512, 2, 2, dict(is_causal=True, causal_alignment="bottom_right",
                                               key_value_seq_lengths=[0, 2]), 2, False),
    # T > 1 folded: the keys every query sees in the folded call, the last T - 1 in the causal tail
    # (a cache shorter than the queries: rows that see nothing, tail keys before the cache's start).
    "few-queries-gqa-causal-lengths": (3, 5, 1024, 8, 2, dict(
        is_causal=True, causal_alignment="bottom_right", key_value_seq_lengths=[1024, 700, 3]), 4, True),
    "two-queries-mqa-causal-softcap": (2, 2, 512, 4, 1, dict(
        is_causal=True, causal_alignment="bottom_right", softcap=3.0), 2, True),
    "few-queries-gqa-no-causality": (2, 4, 512, 8, 4, dict(key_value_seq_lengths=[512, 300]), 2, True),
}


def _keywords(kw):
    kw = dict(kw)
    if "key_value_seq_lengths" in kw:
        kw["key_value_seq_lengths"] = jnp.asarray(kw["key_value_seq_lengths"], jnp.int32)
    if "alibi_slopes" in kw:
        kw["alibi_slopes"] = jnp.asarray(kw["alibi_slopes"], jnp.float32)
    return kw


@pytest.mark.parametrize("case", list(CASES))
def test_split_matches_the_plain_call(case):
    B, T, S, N, K, kw, chunks, fold = CASES[case]
    seed = fresh_seed()
    q, k, v = random_qkv(seed, B, T, S, N, K, 32)
    config, extras = _options.canonicalize(q.shape, False, k_len=S, **_keywords(kw))
    scale = 0.2
    do = jax.random.normal(jax.random.key(seed + 1), (B, T, N, 32))
    dlse = jax.random.normal(jax.random.key(seed + 2), (B, T, N))

    def call(q, k, v, config, extras):
        return attention_core(q, k, v, extras.bias, tuple(extras[1:]), scale, config, None)

    plan = decode.SplitPlan(chunks, fold)
    split = lambda q, k, v: decode.split_kv_attention(q, k, v, config, extras, plan, call)  # noqa: E731
    plain = lambda q, k, v: attention(q, k, v, scale, config, extras, "cpu")  # noqa: E731

    def run(fn):
        (out, lse), vjp = jax.vjp(fn, q, k, v)
        return (out, lse) + vjp((do, dlse))

    got, want = run(split), run(plain)
    assert np.array_equal(np.isfinite(got[1]), np.isfinite(want[1])), f"seed {seed}"
    finite = np.isfinite(np.asarray(want[1]))
    assert np.abs(np.asarray(got[1])[finite] - np.asarray(want[1])[finite]).max() < 1e-5, f"seed {seed}"
    for name, g, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        if name != "lse":
            assert rel_err(g, w) < 2e-5, f"seed {seed}: {name} {rel_err(g, w):.2e}"


def test_plan_covers_decoding_calls_only():
    config, extras = _options.canonicalize((8, 1, 32, 128), False, k_len=8192, is_causal=True,
                                           causal_alignment="bottom_right")
    plan = decode.split_plan((8, 1, 32, 128), (8, 8192, 8, 128), config, extras, None)
    assert plan is not None and plan.fold_heads and plan.chunks > 1
    assert decode.split_plan((8, 1, 32, 128), (8, 8192, 8, 128), config, extras, "cpu") is None
    config, extras = _options.canonicalize((8, 16, 32, 128), False, k_len=32768, is_causal=True,
                                           causal_alignment="bottom_right")
    assert decode.split_plan((8, 16, 32, 128), (8, 32768, 8, 128), config, extras, None).fold_heads
    # A small cache, a window, or more than 64 rows once folded: the heads stay apart.
    config, extras = _options.canonicalize((1, 16, 32, 128), False, k_len=4096, is_causal=True,
                                           causal_alignment="bottom_right")
    assert not decode.split_plan((1, 16, 32, 128), (1, 4096, 8, 128), config, extras, None).fold_heads
    config, extras = _options.canonicalize((8, 16, 32, 128), False, k_len=32768, is_causal=True,
                                           causal_alignment="bottom_right", local_window_size=(4096, 0))
    assert not decode.split_plan((8, 16, 32, 128), (8, 32768, 8, 128), config, extras, None).fold_heads
    config, extras = _options.canonicalize((8, 16, 64, 128), False, k_len=32768, is_causal=True,
                                           causal_alignment="bottom_right")
    assert not decode.split_plan((8, 16, 64, 128), (8, 32768, 8, 128), config, extras, None).fold_heads
    config, extras = _options.canonicalize((1, 2048, 32, 128), False, k_len=2048, is_causal=True)
    assert decode.split_plan((1, 2048, 32, 128), (1, 2048, 8, 128), config, extras, None) is None
    config, extras = _options.canonicalize((1, 4, 8, 64), False, k_len=4096, dropout_rate=0.1,
                                           dropout_rng=jax.random.key(0))
    assert decode.split_plan((1, 4, 8, 64), (1, 4096, 8, 64), config, extras, None) is None


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_decoding_calls_on_gpu_match_the_cpu_kernels(case, monkeypatch):
    """On a GPU the dispatcher takes the split by itself for such calls (bf16 against the float32
    CPU kernels); several queries' heads fold here although the caches are small."""
    monkeypatch.setattr(decode, "_MIN_FOLD_ELEMENTS", 0)
    B, T, S, N, K, kw, _, _ = CASES[case]
    seed = fresh_seed()
    q, k, v = random_qkv(seed, B, T, S * 8, N, K, 64)  # long enough for blocks of 512 keys
    kw = _keywords(kw)
    if "key_value_seq_lengths" in kw:
        kw["key_value_seq_lengths"] = kw["key_value_seq_lengths"] * 8
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        on_cpu = {name: jax.device_put(x, cpu) if isinstance(x, jax.Array) else x for name, x in kw.items()}
        want = jfa.flash_attention(*jax.device_put((q, k, v), cpu), return_lse=True, **on_cpu)
    got = jfa.flash_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), return_lse=True, **kw)
    assert rel_err(got[0], want[0]) < 2e-2, f"seed {seed}"
    finite = np.isfinite(np.asarray(want[1]))
    assert np.array_equal(np.isfinite(np.asarray(got[1])), finite), f"seed {seed}"
    assert np.abs(np.asarray(got[1])[finite] - np.asarray(want[1])[finite]).max() < 5e-2, f"seed {seed}"
