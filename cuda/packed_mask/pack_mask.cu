// The packing kernel: each block packs one tile summary's rows (kMaskTileRows) over kBlockChunks
// chunks of keys of one slice, writing the bits and the tiles' summaries in the same pass, so the
// mask is read once and the bits are never read back. A warp packs kRowsPerWarp rows, all of their
// loads in flight at once; in it, 8 lanes own a chunk and each lane 16 consecutive keys, read as one
// 16-byte load where the mask's rows allow it.
#include "packed_mask/pack_mask.h"

namespace jfa::gpu {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kRowsPerWarp = kMaskTileRows / kWarps;
constexpr int kKeysPerLane = 16;
constexpr int kLanesPerChunk = kMaskChunkKeys / kKeysPerLane;
constexpr int kBlockChunks = 32 / kLanesPerChunk;
static_assert(kMaskTileRows % kWarps == 0 && kLanesPerChunk == 8 && kMaskChunkWords == 4,
              "the shifts below spell out 16 keys per lane, 8 lanes and 4 words per chunk");

// Bit i set iff byte i of x (i < 4) is nonzero.
__device__ uint32_t nonzero_bytes(uint32_t x) {
  const uint32_t flags = __vcmpne4(x, 0u) & 0x01010101u;
  return (flags | flags >> 7 | flags >> 14 | flags >> 21) & 0xFu;
}

// Bit y set iff key j0 + y of the row is below S and visible. kVector: the mask's rows are
// contiguous and 16-byte aligned, so keys that lie wholly below S are read as one vector.
template <bool kVector>
__device__ uint32_t visible_keys(const BooleanMask& m, int64_t slice, int64_t row, int64_t j0) {
  if (kVector && j0 + kKeysPerLane <= m.S) {
    const uint4 v = __ldg(reinterpret_cast<const uint4*>(m.data + slice * m.slice_stride + row * m.row_stride + j0));
    return nonzero_bytes(v.x) | nonzero_bytes(v.y) << 4 | nonzero_bytes(v.z) << 8 | nonzero_bytes(v.w) << 12;
  }
  uint32_t keys = 0;
  for (int y = 0; y < kKeysPerLane; ++y)
    if (j0 + y < m.S && m.at(slice, row, j0 + y)) keys |= 1u << y;
  return keys;
}

// Word `word` of the chunk that lane `lane` (of its chunk's 8) helps build: key x = 16 lane + y
// sits at bit 2 (x / 8) + x % 2 = 4 lane + 2 (y / 8) + y % 2 of word (y % 8) / 2 (jfa/packed_mask.h),
// so each lane gives each word one nibble, and the 8 lanes' nibbles are ORed together.
__device__ uint32_t chunk_word(uint32_t keys, int lane, int word) {
  const uint32_t nibble = ((keys >> (2 * word)) & 3u) | ((keys >> (8 + 2 * word)) & 3u) << 2;
  uint32_t bits = nibble << (4 * lane);
  for (int step = 1; step < kLanesPerChunk; step *= 2) bits |= __shfl_xor_sync(0xffffffffu, bits, step);
  return bits;
}

template <bool kVector>
__global__ void __launch_bounds__(kThreads) pack_kernel(BooleanMask mask, uint32_t* __restrict__ bits,
                                                        uint8_t* __restrict__ tiles, int64_t chunk_groups) {
  const int64_t chunks = mask_chunks(mask.S), row_blocks = mask_row_blocks(mask.T);
  const int64_t words = chunks * kMaskChunkWords;
  const int64_t group = blockIdx.x % chunk_groups, row_block = blockIdx.x / chunk_groups % row_blocks;
  const int64_t slice = blockIdx.x / chunk_groups / row_blocks;
  const int warp = threadIdx.x / 32, lane_in_warp = threadIdx.x % 32;
  const int lane = lane_in_warp % kLanesPerChunk;
  const int64_t chunk = group * kBlockChunks + lane_in_warp / kLanesPerChunk;
  const bool chunk_in_range = chunk < chunks;
  const int64_t j0 = chunk * kMaskChunkKeys + lane * kKeysPerLane;
  const int64_t row0 = row_block * kMaskTileRows + warp * kRowsPerWarp;

  uint32_t keys[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r)
    keys[r] = chunk_in_range && row0 + r < mask.T ? visible_keys<kVector>(mask, slice, row0 + r, j0) : 0u;

  // Lanes 0-3 of a chunk each store and summarize one of its words.
  const bool writes_word = chunk_in_range && lane < kMaskChunkWords;
  const uint32_t in_range = writes_word ? mask_bits_below(lane, mask.S - chunk * kMaskChunkKeys) : 0u;
  MaskTileSummary summary;
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const uint32_t w0 = chunk_word(keys[r], lane, 0), w1 = chunk_word(keys[r], lane, 1);
    const uint32_t w2 = chunk_word(keys[r], lane, 2), w3 = chunk_word(keys[r], lane, 3);
    const uint32_t mine = lane == 0 ? w0 : lane == 1 ? w1 : lane == 2 ? w2 : w3;
    if (writes_word && row0 + r < mask.T) {
      bits[(slice * mask.T + row0 + r) * words + chunk * kMaskChunkWords + lane] = mine;
      summary.add(mine, in_range);
    }
  }

  // The tile summaries: any and all over every lane and warp of a chunk.
  __shared__ uint32_t any_lanes[kWarps], all_lanes[kWarps];
  const uint32_t any = __ballot_sync(0xffffffffu, summary.any);
  const uint32_t all = __ballot_sync(0xffffffffu, summary.all);
  if (lane_in_warp == 0) {
    any_lanes[warp] = any;
    all_lanes[warp] = all;
  }
  __syncthreads();
  if (threadIdx.x < kBlockChunks && group * kBlockChunks + threadIdx.x < chunks) {
    const uint32_t chunk_lanes = 0xFu << (kLanesPerChunk * threadIdx.x);
    bool any_visible = false, all_visible = true;
    for (int w = 0; w < kWarps; ++w) {
      any_visible = any_visible || (any_lanes[w] & chunk_lanes) != 0;
      all_visible = all_visible && (all_lanes[w] & chunk_lanes) == chunk_lanes;
    }
    const MaskTileKind kind = !any_visible ? MaskTileKind::kEmpty
                              : all_visible ? MaskTileKind::kFull
                                            : MaskTileKind::kPartial;
    tiles[(slice * row_blocks + row_block) * chunks + group * kBlockChunks + threadIdx.x] =
        static_cast<uint8_t>(kind);
  }
}

// Whether every row's keys are contiguous and start on a 16-byte boundary.
bool rows_are_vectors(const BooleanMask& m) {
  return m.key_stride == 1 && m.row_stride % 16 == 0 && m.slice_stride % 16 == 0 &&
         reinterpret_cast<uintptr_t>(m.data) % 16 == 0;
}

}  // namespace

cudaError_t pack_mask(const BooleanMask& mask, uint32_t* bits, uint8_t* tiles, cudaStream_t stream) {
  const int64_t chunks = mask_chunks(mask.S), row_blocks = mask_row_blocks(mask.T);
  const int64_t chunk_groups = (chunks + kBlockChunks - 1) / kBlockChunks;
  const int64_t blocks = mask.slices * row_blocks * chunk_groups;
  if (blocks == 0) return cudaSuccess;
  if (blocks > INT32_MAX) return cudaErrorInvalidConfiguration;
  if (rows_are_vectors(mask))
    pack_kernel<true><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(mask, bits, tiles, chunk_groups);
  else
    pack_kernel<false><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(mask, bits, tiles, chunk_groups);
  return cudaGetLastError();
}

}  // namespace jfa::gpu
