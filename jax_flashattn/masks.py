"""Bit-packed boolean masks: `pack_mask` and `block_mask` make a `PackedMask`, which the `mask=`
keyword of every attention function takes in place of a boolean array.

A PackedMask stores a boolean mask [B|1, N|1, T, S] (True = attend) as bits, 1/8 of the bytes,
in the layout of FlashAttention-3's SM90 sparse mask (one 32-bit word per row per quad lane of a
wgmma accumulator), with a summary per tile of 64 query rows × 128 keys that lets a kernel skip
empty tiles and skip the per-element test on full ones (docs/masks.md;
cuda/include/jfa/packed_mask.h).
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ._mask_packing import CHUNK_KEYS, CHUNK_WORDS, TILE_ROWS, pack_mask_p, packed_shapes

# Key x = 8a + 2w + e of a chunk (a < 16, w < 4, e < 2) is bit 2a + e of word w: with the chunk's
# keys viewed as [16, 4, 2], word w gathers axis 1 and bit b = SHIFTS[a, 0, e] the other two.
_SHIFTS = (2 * np.arange(16)[:, None, None] + np.arange(2)[None, None, :]).astype(np.uint32)

EMPTY_TILE, PARTIAL_TILE, FULL_TILE = 0, 1, 2


@dataclasses.dataclass(frozen=True, eq=False)
class PackedMask:
    """A boolean mask [B|1, N|1, T, S] (True = attend) as bits and per-tile summaries.

    Attributes:
      bits: uint32 [B|1, N|1, T, ceil(S / 128) · 4]. Each row's keys are cut into chunks of 128;
        key j = 128 c + x of row t is bit b = 2 (x // 8) + x % 2 of word bits[..., t, 4 c + w],
        w = (x % 8) // 2. Keys past S are 0.
      tiles: uint8 [B|1, N|1, ceil(T / 64), ceil(S / 128)]: per tile of 64 query rows × 128 keys,
        EMPTY_TILE (0: no element visible), FULL_TILE (2: every element visible) or PARTIAL_TILE
        (1); rows past T and keys past S do not count.
      q_len, kv_len: T and S, static.

    A registered pytree whose leaves are bits and tiles: it passes through jit, vmap (a mapped
    axis is one more batch axis), grad, shard_map and device_put like the arrays it holds. Make
    one with pack_mask or block_mask.
    """
    bits: Any
    tiles: Any
    q_len: int
    kv_len: int

    @property
    def shape(self):
        """The shape of the boolean mask it holds, [B|1, N|1, T, S] (for rank-4 bits)."""
        return tuple(self.bits.shape[:-2]) + (self.q_len, self.kv_len)

    def unpack(self):
        """The boolean mask, [..., T, S] with the leading axes of bits."""
        return unpack_bits(self.bits, self.kv_len)


jax.tree_util.register_dataclass(PackedMask, data_fields=["bits", "tiles"], meta_fields=["q_len", "kv_len"])


def unpack_bits(bits, kv_len):
    """bool [..., T, S] from bits [..., T, ceil(S / 128) · 4]: elementwise shifts, no gather."""
    bits = jnp.asarray(bits)
    chunks = bits.shape[-1] // CHUNK_WORDS
    words = bits.reshape(bits.shape[:-1] + (chunks, 1, CHUNK_WORDS, 1))
    keys = (words >> _SHIFTS) & 1
    return keys.reshape(bits.shape[:-1] + (chunks * CHUNK_KEYS,))[..., :kv_len].astype(bool)


def _as_rank4(x, name, what):
    if not 2 <= x.ndim <= 4:
        raise ValueError(f"{name} must be {what}, got shape {x.shape}")
    return x.reshape((1,) * (4 - x.ndim) + x.shape)


def pack_mask(mask):
    """A PackedMask from a boolean mask (True = attend).

    Args:
      mask: bool [T, S], [N|1, T, S] or [B|1, N|1, T, S]: T and S are its last two axes, so broadcast
        a mask that is shared along queries or keys to them first. Lower ranks gain leading axes of 1.

    Returns:
      PackedMask with bits [B|1, N|1, T, ceil(S / 128) · 4] and tiles [B|1, N|1, ceil(T / 64),
      ceil(S / 128)], computed by a kernel of its own (C++ on the CPU, CUDA on a GPU) that writes
      T · S / 8 bytes of bits. Works under jit, vmap and on sharded masks (split along B and N).
    """
    mask = jnp.asarray(mask)
    if mask.dtype != jnp.bool_:
        raise TypeError(f"pack_mask: mask must be a boolean array (True = attend), got {mask.dtype} "
                        f"{mask.shape}; for a 0/1 mask of another dtype pass mask != 0")
    mask = _as_rank4(mask, "pack_mask: mask", "[T, S], [N, T, S] or [B, N, T, S]")
    B, N, T, S = mask.shape
    if B * N * T * S == 0:
        bits, tiles = packed_shapes((B, N), T, S)
        return PackedMask(jnp.zeros(bits, jnp.uint32), jnp.zeros(tiles, jnp.uint8), T, S)
    bits, tiles = pack_mask_p.bind(mask, q_len=T, kv_len=S)
    return PackedMask(bits, tiles, T, S)


def _block_size(block_size):
    pair = (block_size, block_size) if isinstance(block_size, numbers.Integral) else block_size
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(
            isinstance(b, numbers.Integral) and not isinstance(b, bool) and b >= 1 for b in pair)):
        raise ValueError(f"block_mask: block_size must be an int >= 1 or a pair (query block, key block) "
                         f"of them, got {block_size!r}")
    return int(pair[0]), int(pair[1])


def _length(length, blocks, block, name, axis):
    if length is None:
        return blocks * block
    if not isinstance(length, numbers.Integral) or isinstance(length, bool) or length < 0:
        raise ValueError(f"block_mask: {name} must be a static int >= 0, got {length!r}")
    if -(-length // block) != blocks:
        raise ValueError(f"block_mask: {name}={length} in blocks of {block} needs {-(-length // block)} "
                         f"blocks along axis {axis} of blocks, which has {blocks}")
    return int(length)


def block_mask(blocks, block_size, *, q_len=None, kv_len=None):
    """A PackedMask that keeps or drops whole blocks of queries × keys (FlexAttention's BlockMask).

    Args:
      blocks: bool [B|1, N|1, ceil(T / bq), ceil(S / bk)] (or without its leading axes): True =
        the block's queries attend to its keys.
      block_size: bq or (bq, bk), static ints >= 1; any sizes, not only multiples of the tiles.
      q_len, kv_len: T and S (static); by default the whole grid, rows · bq and columns · bk. The last
        block row or column may be cut short by them.

    Returns:
      PackedMask whose bits and tiles are those pack_mask gives for the elementwise mask, computed
      from the blocks without ever forming a T × S array (jnp ops: jit- and vmap-able).
    """
    blocks = jnp.asarray(blocks)
    if blocks.dtype != jnp.bool_:
        raise TypeError(f"block_mask: blocks must be a boolean array (True = attend), got {blocks.dtype} "
                        f"{blocks.shape}")
    blocks = _as_rank4(blocks, "block_mask: blocks", "[rows, cols], [N, rows, cols] or [B, N, rows, cols]")
    bq, bk = _block_size(block_size)
    rows, cols = blocks.shape[2:]
    T = _length(q_len, rows, bq, "q_len", -2)
    S = _length(kv_len, cols, bk, "kv_len", -1)
    lead = blocks.shape[:2]
    if np.prod(lead) * T * S == 0:
        bits, tiles = packed_shapes(lead, T, S)
        return PackedMask(jnp.zeros(bits, jnp.uint32), jnp.zeros(tiles, jnp.uint8), T, S)
    return PackedMask(_block_bits(blocks, bq, bk, T, S), _block_tiles(blocks, bq, bk, T, S), T, S)


def _block_bits(blocks, bq, bk, T, S):
    """bits [.., T, W]: each block row's words once (a row's key j is block column j // bk), then
    gathered to the rows of that block row."""
    chunks = -(-S // CHUNK_KEYS)
    keys = np.arange(chunks * CHUNK_KEYS)
    visible = blocks[..., np.minimum(keys // bk, blocks.shape[-1] - 1)] & (keys < S)
    visible = visible.reshape(visible.shape[:-1] + (chunks, 16, CHUNK_WORDS, 2)).astype(jnp.uint32)
    # Distinct bits: the sum is their OR.
    words = jnp.sum(visible << _SHIFTS, axis=(-3, -1), dtype=jnp.uint32)
    words = words.reshape(words.shape[:-2] + (chunks * CHUNK_WORDS,))
    return words[..., np.arange(T) // bq, :]


def _block_tiles(blocks, bq, bk, T, S):
    """tiles [.., ceil(T/64), ceil(S/128)]: the number of visible blocks among those a tile's
    in-range elements meet, by a summed-area table; none → empty, all → full."""
    lead = blocks.shape[:2]
    counts = jnp.cumsum(jnp.cumsum(blocks.astype(jnp.int32), axis=-2), axis=-1)
    counts = jnp.pad(counts, [(0, 0), (0, 0), (1, 0), (1, 0)])
    r = np.arange(-(-T // TILE_ROWS)) * TILE_ROWS
    r0, r1 = r // bq, (np.minimum(r + TILE_ROWS, T) - 1) // bq + 1
    c = np.arange(-(-S // CHUNK_KEYS)) * CHUNK_KEYS
    c0, c1 = c // bk, (np.minimum(c + CHUNK_KEYS, S) - 1) // bk + 1
    at = lambda i, j: counts[..., i[:, None], j[None, :]]  # noqa: E731
    inside = at(r1, c1) - at(r0, c1) - at(r1, c0) + at(r0, c0)
    total = ((r1 - r0)[:, None] * (c1 - c0)[None, :]).astype(np.int32)
    tiles = jnp.where(inside == 0, EMPTY_TILE, jnp.where(inside == total, FULL_TILE, PARTIAL_TILE))
    return jnp.broadcast_to(tiles.astype(jnp.uint8), lead + tiles.shape[-2:])
