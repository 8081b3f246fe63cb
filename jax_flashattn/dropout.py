"""The dropout stream: a JAX PRNG key → Philox key words, and a NumPy re-implementation of the
kernels' dropout mask (cuda/include/jfa/philox.h), bit for bit.

The kernels never store a mask. Element (b, n, i, j) — batch, query head, query, key — is dropped
when its 16-bit uniform, half (j % 2) (the low half first) of word (j // 2) % 4 of Philox4x32-10 at
counter (j // 8, i, n, b) under key (k0, k1), is below floor(rate · 2^16); kept elements are
scaled by 1 / (1 − rate). The mask is therefore a pure
function of the key and the coordinates: the same in the forward and backward passes, on the CPU
and the GPU, and here, which is what the tests and the reference use.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def key_words(rng):
    """The two uint32 Philox key words of a JAX PRNG key (typed, or a raw uint32[2] key).

    A threefry key's own two words are used as they are (stable across JAX versions); other key
    implementations are first reduced to two words with jax.random.bits.
    """
    rng = jnp.asarray(rng) if not isinstance(rng, jax.Array) else rng
    if jnp.issubdtype(rng.dtype, jax.dtypes.prng_key):
        if rng.shape != ():
            raise ValueError(f"dropout_rng must be a single PRNG key, got a key array of shape {rng.shape}")
        data = jax.random.key_data(rng).reshape(-1)
        if data.shape == (2,) and data.dtype == jnp.uint32:
            return data
        return jax.random.bits(rng, (2,), jnp.uint32)
    if rng.dtype == jnp.uint32 and rng.shape == (2,):
        return rng
    raise TypeError(f"dropout_rng must be a JAX PRNG key (jax.random.key(...)) or a raw uint32[2] key, "
                    f"got {rng.dtype}{list(rng.shape)}")


def seeds_for_batch(words, batch: int):
    """The kernels' per-example seed rows, uint32 [B, 3] = (k0, k1, b): carrying the batch
    coordinate with the row keeps each example's mask when vmap folds examples into B."""
    b = jnp.arange(batch, dtype=jnp.uint32)
    return jnp.stack([jnp.broadcast_to(words[0], (batch,)), jnp.broadcast_to(words[1], (batch,)), b], axis=1)


# ---- NumPy re-implementation (reference and tests; concrete keys only) -------------------------

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
_LOW = np.uint64(0xFFFFFFFF)


def philox4x32_10(counter, k0, k1):
    """Philox4x32-10 on uint32 arrays: counter is a tuple of 4 broadcastable arrays."""
    c0, c1, c2, c3 = (np.asarray(c, np.uint32) for c in counter)
    k0, k1 = np.uint32(k0), np.uint32(k1)
    with np.errstate(over="ignore"):
        for r in range(10):
            if r:
                k0, k1 = np.uint32(k0 + _W0), np.uint32(k1 + _W1)
            p0 = _M0 * c0.astype(np.uint64)
            p1 = _M1 * c2.astype(np.uint64)
            hi0, lo0 = (p0 >> np.uint64(32)).astype(np.uint32), (p0 & _LOW).astype(np.uint32)
            hi1, lo1 = (p1 >> np.uint64(32)).astype(np.uint32), (p1 & _LOW).astype(np.uint32)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def threshold(rate: float) -> int:
    """floor(rate · 2^16) computed in double from the float32 rate, as the kernels do."""
    return min(int(float(np.float32(rate)) * 65536.0), 0xFFFF)


def keep_mask(rng, rate: float, shape):
    """The kernels' keep mask, bool [B, N, T, S], for key rng (concrete) and dropout rate."""
    B, N, T, S = shape
    k0, k1 = (int(x) for x in np.asarray(key_words(rng)))
    b, n, i, j = np.meshgrid(*(np.arange(d, dtype=np.uint32) for d in (B, N, T, S)), indexing="ij")
    words = np.stack(philox4x32_10((j >> np.uint32(3), i, n, b), k0, k1))  # [4, B, N, T, S]
    word = np.take_along_axis(words, ((j >> np.uint32(1)) & np.uint32(3))[None].astype(np.int64), axis=0)[0]
    uniform = (word >> (np.uint32(16) * (j & np.uint32(1)))) & np.uint32(0xFFFF)
    return uniform >= np.uint32(threshold(rate))
