"""The masking and training keywords: validated at trace time (errors name the argument and show
the shapes) and canonicalized into what the primitives take:

  * MaskConfig — the static part (causal, alignment, window, softcap, dropout rate,
    deterministic), a hashable primitive parameter;
  * Extras — the array operands, in the kernels' order, batched [B, ...]: bias (float32, rank 4,
    broadcast axes kept at size 1), mask (bool, likewise) or a PackedMask's bits and tiles (uint32
    and uint8, rank 4, B and N kept at size 1 where broadcast), query/key lengths (int32 [B]),
    segment ids (int32 [B, T], [B, S]), ALiBi slopes (float32 [1 or B, N]), the dropout seeds
    (uint32 [B, 3]), block positions (int32 [B, 2]) and a paged cache's block table (int32 [B,
    max_pages]); None where absent.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from . import dropout as _dropout
from ._mask_packing import packed_shapes
from ._validate import concrete
from .masks import PackedMask

ALIGNMENTS = ("top_left", "bottom_right")


@dataclasses.dataclass(frozen=True)
class MaskConfig:
    is_causal: bool = False
    bottom_right: bool = False
    window_left: int = -1   # -1: unbounded
    window_right: int = -1
    softcap: float = 0.0    # 0: off
    dropout_rate: float = 0.0
    deterministic: bool = False


class Extras(NamedTuple):
    bias: Optional[jax.Array] = None
    mask: Optional[jax.Array] = None
    mask_bits: Optional[jax.Array] = None
    mask_tiles: Optional[jax.Array] = None
    query_seq_lengths: Optional[jax.Array] = None
    key_value_seq_lengths: Optional[jax.Array] = None
    q_segment_ids: Optional[jax.Array] = None
    kv_segment_ids: Optional[jax.Array] = None
    alibi_slopes: Optional[jax.Array] = None
    dropout_seeds: Optional[jax.Array] = None
    # int32 [B, 2]: where query row 0 and key 0 sit in a longer sequence, for a call on one block
    # of it (context parallelism, sequence sharding; jfa::MaskParams::positions).
    positions: Optional[jax.Array] = None
    # int32 [B, max_pages]: the pages of each sequence when k and v are page pools [num_pages,
    # page_size, K, H] (paged_attention's in-place forward only; jfa::PagedKV).
    block_table: Optional[jax.Array] = None

    def present(self):
        return [name for name, x in zip(self._fields, self) if x is not None]


def _static_float(value, name):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (numbers.Real, np.floating)):
        try:
            return float(value)
        except Exception as e:
            raise TypeError(f"{name} must be a static Python float, got {type(value).__name__}") from e
    return float(value)


def _bnts(x, name, B, N, T, S, is_mask):
    """bias/mask → rank 4, each axis 1 or full (numpy broadcasting, right-aligned)."""
    x = jnp.asarray(x)
    if is_mask and x.dtype != jnp.bool_:
        raise TypeError(f"mask must be a boolean array (True = attend) or a jax_flashattn.PackedMask, "
                        f"got {x.dtype} {x.shape}")
    if not is_mask and not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"bias must be a floating array, got {x.dtype} {x.shape}")
    full = (B, N, T, S)
    if x.ndim > 4 or any(d not in (1, f) for d, f in zip(x.shape[::-1], full[::-1])):
        raise ValueError(f"{name} of shape {x.shape} is not broadcastable to [B, N, T, S] = {full}")
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def _packed(mask, B, N, T, S):
    """A PackedMask's (bits, tiles), rank 4 (lower ranks right-aligned), checked against the call."""
    if (mask.q_len, mask.kv_len) != (T, S):
        raise ValueError(f"mask: a PackedMask of T={mask.q_len}, S={mask.kv_len} does not match the "
                         f"call's T={T} queries and S={S} keys")
    bits, tiles = jnp.asarray(mask.bits), jnp.asarray(mask.tiles)
    if (bits.dtype, tiles.dtype) != (jnp.uint32, jnp.uint8) or not 2 <= bits.ndim <= 4 or tiles.ndim != bits.ndim:
        raise TypeError(f"mask: a PackedMask holds uint32 bits and uint8 tiles of one rank (2 to 4), got "
                        f"{bits.dtype} {bits.shape} and {tiles.dtype} {tiles.shape}")
    bits, tiles = (x.reshape((1,) * (4 - x.ndim) + x.shape) for x in (bits, tiles))
    want = packed_shapes(bits.shape[:2], T, S)
    if (bits.shape, tiles.shape) != want or bits.shape[0] not in (1, B) or bits.shape[1] not in (1, N):
        raise ValueError(f"mask: a PackedMask's bits {bits.shape} and tiles {tiles.shape} must be "
                         f"[B|1, N|1, T, ceil(S/128)*4] and [B|1, N|1, ceil(T/64), ceil(S/128)] with "
                         f"[B, N, T, S] = {(B, N, T, S)}")
    return bits, tiles


def _per_batch(x, name, shape, unbatched, what):
    """An int32 array of `shape` ([B] or [B, L]); unbatched calls give it without the B axis."""
    x = jnp.asarray(x)
    if unbatched:
        x = x[None]
    if x.dtype != jnp.int32:
        raise TypeError(f"{name} must be int32 {what}, got {x.dtype} {x.shape[1:] if unbatched else x.shape}")
    if x.shape != shape:
        got = x.shape[1:] if unbatched else x.shape
        want = shape[1:] if unbatched else shape
        raise ValueError(f"{name} must have shape {want} ({what}), got {got}")
    return x


def _lengths(x, name, B, unbatched):
    """Valid lengths, int32 [B]; values known at trace time must be >= 0 (traced ones count as 0)."""
    # Read before jnp.asarray, which stages a NumPy array under jit as a traced constant.
    values = concrete(x)
    x = _per_batch(x, name, (B,), unbatched, "one length per batch element, [B]")
    if values is not None and np.any(values < 0):
        b = int(np.flatnonzero(values.reshape(-1) < 0)[0])
        raise ValueError(f"{name} must be >= 0, got {int(values.reshape(-1)[b])} for batch element {b} "
                         f"(shape {values.shape})")
    return x


def window(local_window_size):
    """(left, right) from an int or a pair of ints (jax.nn's meaning); (-1, -1) for None."""
    if local_window_size is None:
        return -1, -1
    pair = (local_window_size, local_window_size) if isinstance(local_window_size, numbers.Integral) \
        else tuple(local_window_size) if isinstance(local_window_size, (tuple, list)) else None
    if pair is None or len(pair) != 2 or not all(
            isinstance(w, numbers.Integral) and not isinstance(w, bool) and w >= 0 for w in pair):
        raise ValueError(f"local_window_size must be an int >= 0 or a pair (left, right) of them, "
                         f"got {local_window_size!r}")
    return int(pair[0]), int(pair[1])


def canonicalize(q_shape, unbatched, *, is_causal=False, bias=None, mask=None,
                 query_seq_lengths=None, key_value_seq_lengths=None, local_window_size=None,
                 causal_alignment="top_left", q_segment_ids=None, kv_segment_ids=None,
                 softcap=None, alibi_slopes=None, dropout_rate=0.0, dropout_rng=None,
                 deterministic=False, k_len=None, positions=None):
    """(MaskConfig, Extras) for batched BTNH shapes; raises on any bad keyword. `positions`
    (internal, int32 [2] or [B, 2], non-negative, traced or not): the global positions of query
    row 0 and key 0 when the call is one block of a longer sequence; the key position must be a
    multiple of 8 with dropout, which its callers guarantee by their block sizes."""
    B, T, N, _ = q_shape
    S = k_len
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"causal_alignment must be one of {ALIGNMENTS}, got {causal_alignment!r}")
    left, right = window(local_window_size)
    if softcap is None:
        softcap = 0.0
    else:
        softcap = _static_float(softcap, "softcap")
        if not (softcap > 0 and np.isfinite(softcap)):
            raise ValueError(f"softcap must be a positive finite float, got {softcap}")
    rate = _static_float(dropout_rate, "dropout_rate")
    if not 0.0 <= rate < 1.0:
        raise ValueError(f"dropout_rate must be in [0, 1), got {rate}")
    if rate > 0 and dropout_rng is None:
        raise ValueError(f"dropout_rate={rate} needs a dropout_rng (a JAX PRNG key)")
    if not isinstance(deterministic, (bool, np.bool_)):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    config = MaskConfig(bool(is_causal), causal_alignment == "bottom_right", left, right, softcap,
                        rate, bool(deterministic))

    ex = {}
    if bias is not None:
        # float32 inside: the kernels read it as float32; its gradient is cast back to its dtype.
        ex["bias"] = _bnts(bias, "bias", B, N, T, S, False).astype(jnp.float32)
    if isinstance(mask, PackedMask):
        ex["mask_bits"], ex["mask_tiles"] = _packed(mask, B, N, T, S)
    elif mask is not None:
        ex["mask"] = _bnts(mask, "mask", B, N, T, S, True)
    if query_seq_lengths is not None:
        ex["query_seq_lengths"] = _lengths(query_seq_lengths, "query_seq_lengths", B, unbatched)
    if key_value_seq_lengths is not None:
        ex["key_value_seq_lengths"] = _lengths(key_value_seq_lengths, "key_value_seq_lengths", B, unbatched)
    if (q_segment_ids is None) != (kv_segment_ids is None):
        raise ValueError("q_segment_ids and kv_segment_ids must be given together")
    if q_segment_ids is not None:
        ex["q_segment_ids"] = _per_batch(q_segment_ids, "q_segment_ids", (B, T), unbatched,
                                         "one id per query, [B, T]")
        ex["kv_segment_ids"] = _per_batch(kv_segment_ids, "kv_segment_ids", (B, S), unbatched,
                                          "one id per key, [B, S]")
    if alibi_slopes is not None:
        slopes = jnp.asarray(alibi_slopes)
        if unbatched and slopes.ndim == 1:
            slopes = slopes[None]
        floating = jnp.issubdtype(slopes.dtype, jnp.floating)
        if not floating or slopes.ndim not in (1, 2) or \
                slopes.shape[-1] != N or (slopes.ndim == 2 and slopes.shape[0] not in (1, B)):
            raise (ValueError if floating else TypeError)(
                f"alibi_slopes must be float [N] or [B, N] with B={B}, N={N}, "
                f"got {slopes.dtype} {jnp.shape(alibi_slopes)}")
        # Differentiable (learned slopes): the gradient flows back through reshape and cast.
        ex["alibi_slopes"] = slopes.reshape((-1, N)).astype(jnp.float32)
    if rate > 0:
        ex["dropout_seeds"] = _dropout.seeds_for_batch(_dropout.key_words(dropout_rng), B)
    if positions is not None:
        positions = jnp.asarray(positions)
        if positions.dtype != jnp.int32 or positions.shape not in ((2,), (B, 2)):
            raise ValueError(f"positions must be int32 [2] or [B, 2] with B={B}, got "
                             f"{positions.dtype} {positions.shape}")
        ex["positions"] = jnp.broadcast_to(positions, (B, 2))
    return config, Extras(**ex)
