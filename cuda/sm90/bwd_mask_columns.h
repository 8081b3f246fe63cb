// The bit-packed mask by key (PackedMaskView::key_bits), made before the Hopper backward's kernel
// wherever its score tiles hold keys in rows (every layout but the split-head one). Such a tile's
// thread holds two keys (rows) and its queries in columns; read by query row, a thread's bits are
// scattered over the 4 words of as many query rows as it has columns and have to be gathered by
// shuffles every step. Read by key, they are one word per key: a thread's columns are queries
// 8·g + 2·(lane % 4) + e of the step, which the layout puts in word lane % 4 at bit 2·g + e
// (above the 16th for the upper 64 queries of a 128-query chunk).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "jfa/packed_mask.h"
#include "jfa/params.h"

namespace jfa::sm90 {

// Word `word` of a key's row over the 128 queries from i0 of a block whose two 64-query halves
// the summaries prove empty or full (`full_lo`, `full_hi`): its bit b is query
// mask_key_of_bit(word, b), so the lower half's queries are its low 16 bits. Queries past T are
// cleared (a loop only in the chunk that holds T).
__device__ __forceinline__ uint32_t mask_word_of_kinds(bool full_lo, bool full_hi, int word, int64_t i0, int64_t T) {
  const uint32_t bits = (full_lo ? 0x0000FFFFu : 0u) | (full_hi ? 0xFFFF0000u : 0u);
  return T - i0 < kMaskChunkKeys ? bits & mask_bits_below(word, T - i0) : bits;
}

// A 32 x 32 bit matrix held a row per lane (bit c of lane l: element (l, c)) transposed in place
// (bit c of lane l becomes element (c, l)): five rounds, each swapping the off-diagonal blocks of
// the next smaller block size between lane pairs.
__device__ __forceinline__ uint32_t transpose_bits_32x32(uint32_t x, int lane) {
  constexpr uint32_t kLow[5] = {0x0000FFFFu, 0x00FF00FFu, 0x0F0F0F0Fu, 0x33333333u, 0x55555555u};
#pragma unroll
  for (int r = 0; r < 5; ++r) {
    const int j = 16 >> r;
    const uint32_t other = __shfl_xor_sync(0xffffffffu, x, j);
    x = (lane & j) == 0 ? (x & kLow[r]) | ((other & kLow[r]) << j) : (x & ~kLow[r]) | ((other >> j) & kLow[r]);
  }
  return x;
}

// One block per (128 keys, 128 queries, mask slice). Where the block's two tile summaries are
// each empty or full (every block of a block mask of whole tiles), its words follow from them and
// no bit is read. A block whose two tiles are empty is left unwritten unless `every_block`: a
// walk that skips empty steps never reads it (a step lies in one block's key chunk and in one or
// both of its query halves), and the writes of a sparse mask's empty blocks would cost more than
// the kernel saves on it. Otherwise the 128 query rows' words of the key chunk go to shared
// memory and the block is 16 transposes of 32 x 32 bits: word w of a query row holds the keys
// 8·a + 2·w + e (bit 2·a + e), and word w' of a key row the queries 8·a' + 2·w' + e in the same
// order, so the keys of word w against the queries of word w' are one 32 x 32 bit matrix, which
// warp w transposes for each w'. Bits past T and S are zero, as in the bits (their packing writes
// zeros past S; rows past T read as zeros here).
template <int kThreads>
__global__ void __launch_bounds__(kThreads) transpose_mask_bits_kernel(PackedMaskView m, int64_t T, int64_t S,
                                                                       int64_t heads, int64_t key_chunks,
                                                                       int64_t query_chunks, bool every_block) {
  static_assert(kThreads == kMaskChunkKeys && kMaskChunkWords == 4 && kMaskChunkKeys == 2 * kMaskTileRows,
                "a thread per query row of a chunk, a warp per word; two tile summaries per chunk of queries");
  __shared__ uint4 rows[kMaskChunkKeys];
  // One flat grid (key chunks fastest, then query chunks, then slices): a grid's y and z stop at
  // 65535, fewer than the slices of a mask per batch and head can be.
  const int64_t block = blockIdx.x, chunk_pairs = key_chunks * query_chunks;
  const int key_chunk = int(block % key_chunks), query_chunk = int(block % chunk_pairs / key_chunks);
  const int t = int(threadIdx.x);
  const int64_t slice = block / chunk_pairs, b = slice / heads, n = slice % heads;
  const int64_t i0 = int64_t(query_chunk) * kMaskChunkKeys, key0 = int64_t(key_chunk) * kMaskChunkKeys;
  uint32_t* plane =
      const_cast<uint32_t*>(m.key_bits) + slice * m.key_rows * m.key_words + query_chunk * kMaskChunkWords;
  const int64_t rb = 2 * int64_t(query_chunk);
  const MaskTileKind lo = m.tile(b, n, rb, key_chunk);
  const MaskTileKind hi = rb + 1 < m.row_blocks ? m.tile(b, n, rb + 1, key_chunk) : MaskTileKind::kEmpty;
  if (lo == MaskTileKind::kEmpty && hi == MaskTileKind::kEmpty && !every_block) return;
  if (lo != MaskTileKind::kPartial && hi != MaskTileKind::kPartial) {  // the same for the whole block
    const bool key_in = key0 + t < S, full_lo = lo == MaskTileKind::kFull, full_hi = hi == MaskTileKind::kFull;
    uint32_t out[kMaskChunkWords];
#pragma unroll
    for (int w = 0; w < kMaskChunkWords; ++w) out[w] = key_in ? mask_word_of_kinds(full_lo, full_hi, w, i0, T) : 0u;
    *reinterpret_cast<uint4*>(plane + (key0 + t) * m.key_words) = make_uint4(out[0], out[1], out[2], out[3]);
    return;
  }
  uint4 row = make_uint4(0u, 0u, 0u, 0u);
  if (i0 + t < T) {
    const uint32_t* src = m.row(b, n, i0 + t) + key_chunk * kMaskChunkWords;
    row = make_uint4(__ldg(src), __ldg(src + 1), __ldg(src + 2), __ldg(src + 3));
  }
  rows[t] = row;
  __syncthreads();
  // Lane l of warp w: word w of query mask_key_of_bit(w', l) in, word w' of key mask_key_of_bit(w, l) out.
  const int w = t / 32, lane = t % 32;
  const uint32_t* words = reinterpret_cast<const uint32_t*>(rows);
  uint32_t out[kMaskChunkWords];
#pragma unroll
  for (int wq = 0; wq < kMaskChunkWords; ++wq)
    out[wq] = transpose_bits_32x32(words[4 * mask_key_of_bit(wq, lane) + w], lane);
  const int64_t key = key0 + mask_key_of_bit(w, lane);
  *reinterpret_cast<uint4*>(plane + key * m.key_words) = make_uint4(out[0], out[1], out[2], out[3]);
}

// Sets the mask's key_bits to p.mask_key_bits and fills them (nothing without a mask). The
// workspace must hold [slices, S rounded up to 128, mask_words(T)] words, slices the bits'
// unbroadcast batch and head axes. every_block: also the blocks of two empty tiles, for a walk
// that visits every step (the deterministic backward's; bwd_skips_empty_steps).
inline cudaError_t transpose_mask_bits(AttentionParams& p, bool every_block, cudaStream_t stream) {
  PackedMaskView& m = p.mask.packed_mask;
  if (!m.present()) return cudaSuccess;
  if (p.mask_key_bits == nullptr) return cudaErrorInvalidValue;
  const int64_t batches = m.bits_batch_stride != 0 ? p.B : 1, heads = m.bits_head_stride != 0 ? p.N : 1;
  m.key_bits = p.mask_key_bits;
  m.key_words = mask_words(p.T);
  m.key_rows = mask_chunks(p.S) * kMaskChunkKeys;
  const int64_t plane = m.key_rows * m.key_words;
  m.key_bits_head_stride = heads > 1 ? plane : 0;
  m.key_bits_batch_stride = batches > 1 ? heads * plane : 0;
  if (p.T == 0 || p.S == 0) return cudaSuccess;
  const int64_t key_chunks = mask_chunks(p.S), query_chunks = mask_chunks(p.T);
  const int64_t blocks = key_chunks * query_chunks * batches * heads;
  if (blocks > int64_t(INT32_MAX)) return cudaErrorInvalidConfiguration;  // a grid's x stops at 2^31 - 1
  transpose_mask_bits_kernel<kMaskChunkKeys><<<unsigned(blocks), kMaskChunkKeys, 0, stream>>>(
      m, p.T, p.S, heads, key_chunks, query_chunks, every_block);
  return cudaGetLastError();
}

}  // namespace jfa::sm90
