// The packing kernels: one thread per word of bits, then one thread per tile summary. Neighbouring
// threads write neighbouring words and summaries and read the same 128-byte key chunks, so both
// passes are coalesced; together they read the mask once and the bits once more.
#include "packed_mask/pack_mask.h"

namespace jfa::gpu {
namespace {

constexpr int kThreads = 256;

__global__ void pack_words_kernel(BooleanMask mask, uint32_t* bits, int64_t words, int64_t total) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= total) return;
  const int64_t k = index % words, row = index / words;  // row: slice * T + i
  bits[index] = pack_mask_word(mask, row / mask.T, row % mask.T, k / kMaskChunkWords,
                               static_cast<int>(k % kMaskChunkWords));
}

__global__ void summarize_tiles_kernel(const uint32_t* bits, uint8_t* tiles, int64_t T, int64_t S,
                                       int64_t total) {
  const int64_t index = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (index >= total) return;
  const int64_t chunks = mask_chunks(S), row_blocks = mask_row_blocks(T);
  const int64_t chunk = index % chunks, row_block = index / chunks % row_blocks;
  const int64_t slice = index / (chunks * row_blocks);
  const uint32_t* slice_bits = bits + slice * T * mask_words(S);
  tiles[index] = static_cast<uint8_t>(summarize_mask_tile(slice_bits, T, S, row_block, chunk));
}

unsigned blocks_for(int64_t threads) { return static_cast<unsigned>((threads + kThreads - 1) / kThreads); }

}  // namespace

cudaError_t pack_mask(const BooleanMask& mask, uint32_t* bits, uint8_t* tiles, cudaStream_t stream) {
  const int64_t words = mask_words(mask.S);
  const int64_t total_words = mask.slices * mask.T * words;
  const int64_t total_tiles = mask.slices * mask_row_blocks(mask.T) * mask_chunks(mask.S);
  if (total_words == 0) return cudaSuccess;
  pack_words_kernel<<<blocks_for(total_words), kThreads, 0, stream>>>(mask, bits, words, total_words);
  summarize_tiles_kernel<<<blocks_for(total_tiles), kThreads, 0, stream>>>(bits, tiles, mask.T, mask.S,
                                                                           total_tiles);
  return cudaGetLastError();
}

}  // namespace jfa::gpu
