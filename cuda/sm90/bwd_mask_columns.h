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

// Key x's words over 128 queries of a block whose two 64-query halves the summaries prove empty or
// full (`full_lo`, `full_hi`): a query's bit is set where its half is full and it lies before T
// (the bits' keys past S are zero: the packing's summaries count in-range elements only).
__device__ __forceinline__ uint4 mask_words_of_kinds(bool full_lo, bool full_hi, int64_t i0, int64_t T, bool key_in) {
  uint32_t out[kMaskChunkWords] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int q = 0; q < kMaskChunkKeys; ++q)
    if ((q < kMaskTileRows ? full_lo : full_hi) && i0 + q < T && key_in)
      out[(q % 8) / 2] |= 1u << (2 * (q / 8) + q % 2);
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// One block per (128 keys, 128 queries, mask slice). Where the block's two tile summaries are
// each empty or full (every block of a block mask of whole tiles), its words follow from them and
// no bit is read; otherwise the 128 query rows' words of the key chunk go to shared memory, then
// thread x writes key x's 4 words over the 128 queries. Bits past T and S are zero, as in the bits
// (their packing writes zeros past S; rows past T read as zeros here). A block whose two tiles are
// empty is left unwritten unless `every_block`: a walk that skips empty steps never reads it (a
// step lies in one block's key chunk and in one or both of its query halves), and the writes of a
// sparse mask's empty blocks would cost more than the kernel saves on it.
template <int kThreads>
__global__ void __launch_bounds__(kThreads) transpose_mask_bits_kernel(PackedMaskView m, int64_t T, int64_t S,
                                                                       int64_t heads, bool every_block) {
  static_assert(kThreads == kMaskChunkKeys && kMaskChunkWords == 4 && kMaskChunkKeys == 2 * kMaskTileRows,
                "a thread per key and per query row of a chunk; two tile summaries per chunk of queries");
  __shared__ uint4 rows[kMaskChunkKeys];
  const int key_chunk = int(blockIdx.x), query_chunk = int(blockIdx.y), t = int(threadIdx.x);
  const int64_t slice = blockIdx.z, b = slice / heads, n = slice % heads;
  const int64_t j = int64_t(key_chunk) * kMaskChunkKeys + t;
  uint32_t* dst = const_cast<uint32_t*>(m.key_bits) + slice * m.key_rows * m.key_words + j * m.key_words +
                  query_chunk * kMaskChunkWords;
  const int64_t rb = 2 * int64_t(query_chunk);
  const MaskTileKind lo = m.tile(b, n, rb, key_chunk);
  const MaskTileKind hi = rb + 1 < m.row_blocks ? m.tile(b, n, rb + 1, key_chunk) : MaskTileKind::kEmpty;
  if (lo == MaskTileKind::kEmpty && hi == MaskTileKind::kEmpty && !every_block) return;
  if (lo != MaskTileKind::kPartial && hi != MaskTileKind::kPartial) {  // the same for the whole block
    *reinterpret_cast<uint4*>(dst) = mask_words_of_kinds(lo == MaskTileKind::kFull, hi == MaskTileKind::kFull,
                                                         int64_t(query_chunk) * kMaskChunkKeys, T, j < S);
    return;
  }
  const int64_t i = int64_t(query_chunk) * kMaskChunkKeys + t;
  uint4 row = make_uint4(0u, 0u, 0u, 0u);
  if (i < T) {
    const uint32_t* src = m.row(b, n, i) + key_chunk * kMaskChunkWords;
    row = make_uint4(__ldg(src), __ldg(src + 1), __ldg(src + 2), __ldg(src + 3));
  }
  rows[t] = row;
  __syncthreads();
  // Key x sits in word (x % 8) / 2 of a query row, at bit 2·(x / 8) + x % 2; query q goes to word
  // (q % 8) / 2 of the key's row, at bit 2·(q / 8) + q % 2.
  const int x = t, key_word = (x % 8) / 2, key_bit = 2 * (x / 8) + x % 2;
  const uint32_t* words_of = reinterpret_cast<const uint32_t*>(rows) + key_word;
  uint32_t out[kMaskChunkWords] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int q = 0; q < kMaskChunkKeys; ++q)
    out[(q % 8) / 2] |= ((words_of[4 * q] >> key_bit) & 1u) << (2 * (q / 8) + q % 2);
  *reinterpret_cast<uint4*>(dst) = make_uint4(out[0], out[1], out[2], out[3]);
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
  const dim3 grid(unsigned(mask_chunks(p.S)), unsigned(mask_chunks(p.T)), unsigned(batches * heads));
  transpose_mask_bits_kernel<kMaskChunkKeys><<<grid, kMaskChunkKeys, 0, stream>>>(m, p.T, p.S, heads, every_block);
  return cudaGetLastError();
}

}  // namespace jfa::sm90
