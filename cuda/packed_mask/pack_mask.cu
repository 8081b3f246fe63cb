// The packing kernel: each block packs one tile summary's rows (kMaskTileRows) over kBlockChunks
// chunks of keys of one slice, writing the bits and the tiles' summaries in the same pass, so the
// mask is read once and the bits are never read back. Two phases per warp, for its kRowsPerWarp rows:
//   staging: 8 lanes per chunk copy its row's 128 bytes into shared memory, 16 bytes each (cp.async
//            where the mask's rows allow, so that every row's copy is in flight at once);
//   packing: each lane then owns one (row, chunk) and turns its 128 bytes into the chunk's 4 words
//            with byte permutes and a multiply per 4 keys, no shuffles, and stores them as one vector.
#include "packed_mask/pack_mask.h"

#include <utility>

namespace jfa::gpu {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kRowsPerWarp = kMaskTileRows / kWarps;
constexpr int kPieceBytes = 16;                                   // keys per staged piece
constexpr int kPiecesPerChunk = kMaskChunkKeys / kPieceBytes;     // 8
constexpr int kBlockChunks = 32 / kPiecesPerChunk;                // chunks per warp row: 4
static_assert(kMaskTileRows % kWarps == 0 && kPiecesPerChunk == 8 && kMaskChunkWords == 4 &&
                  kRowsPerWarp * kBlockChunks == 32,
              "one lane per (row, chunk) of a warp; the permutes below spell out 16-key pieces of 4-word chunks");

// Shared-memory slot of piece `piece` of (row, chunk) of a warp's rows: the pieces of a (row, chunk)
// are permuted by its owner lane (4 row + chunk), so that the 8 lanes of a quarter warp, each reading
// piece k of its own (row, chunk), hit 8 different bank groups.
__device__ int staged_slot(int warp, int row, int chunk, int piece) {
  return (row * kWarps + warp) * 32 + chunk * kPiecesPerChunk + (piece ^ ((row * kBlockChunks + chunk) & 7));
}

// Copies 16 bytes from global to shared memory without passing through registers (cp.async, sm_80+).
__device__ void copy_16_bytes_async(uint4* shared, const void* global) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(global) : "memory");
}

__device__ void wait_for_async_copies() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// One 16-byte store (the compiler split a uint4 assignment into four).
__device__ void store_16_bytes(uint32_t* global, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};\n" ::"l"(global), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// Keys j0 .. j0 + 15 of a row as 16 bytes, 1 where the key is below S and visible, else 0, one byte
// at a time: the piece that S cuts, and every piece of a mask whose rows are not vectors.
__device__ uint4 visible_bytes(const BooleanMask& m, int64_t slice, int64_t row, int64_t j0) {
  uint32_t words[4] = {0, 0, 0, 0};
  for (int y = 0; y < kPieceBytes; ++y)
    if (j0 + y < m.S && m.at(slice, row, j0 + y)) words[y / 4] |= 1u << (8 * (y % 4));
  return make_uint4(words[0], words[1], words[2], words[3]);
}

// Bit 28 + b of the result set iff byte b of x is nonzero: the byte's top bit after adding 0x7F to
// its low seven, the four top bits gathered into bits 28-31 by one multiply (the other partial
// products land on distinct bits below 28, so nothing carries into them).
__device__ uint32_t nonzero_bytes_high(uint32_t x) {
  const uint32_t high = (((x & 0x7F7F7F7Fu) + 0x7F7F7F7Fu) | x) & 0x80808080u;
  return high * 0x00204081u;
}

// Adds piece `piece` (keys 16 piece .. 16 piece + 15 of the chunk, bytes v) to the chunk's words.
// Key x = 8 i + 2 w + b is bit 2 i + b of word w (jfa/packed_mask.h), so word w takes keys 2w, 2w+1
// of each 8: bytes 2w, 2w+1 of the piece's two 8-byte halves, gathered by one byte permute, which
// land on bits 4 piece .. 4 piece + 3.
template <int kPiece>
__device__ void add_piece(uint4 v, uint32_t (&words)[kMaskChunkWords]) {
  const uint32_t pairs[kMaskChunkWords] = {__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632),
                                           __byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632)};
#pragma unroll
  for (int w = 0; w < kMaskChunkWords; ++w)
    words[w] |= (nonzero_bytes_high(pairs[w]) >> (28 - 4 * kPiece)) & (0xFu << (4 * kPiece));
}

template <int... kPieces>
__device__ void add_pieces(const uint4* staged, int warp, int row, int chunk, uint32_t (&words)[kMaskChunkWords],
                           std::integer_sequence<int, kPieces...>) {
  (add_piece<kPieces>(staged[staged_slot(warp, row, chunk, kPieces)], words), ...);
}

template <bool kVector>
__global__ void __launch_bounds__(kThreads) pack_kernel(BooleanMask mask, uint32_t* __restrict__ bits,
                                                        uint8_t* __restrict__ tiles, int64_t chunk_groups) {
  const int64_t chunks = mask_chunks(mask.S), row_blocks = mask_row_blocks(mask.T);
  const int64_t words = chunks * kMaskChunkWords;
  const int64_t group = blockIdx.x % chunk_groups, row_block = blockIdx.x / chunk_groups % row_blocks;
  const int64_t slice = blockIdx.x / chunk_groups / row_blocks;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t row0 = row_block * kMaskTileRows + warp * kRowsPerWarp;
  __shared__ uint4 staged[kRowsPerWarp * kThreads];

  // Staging: lane = 8 chunk + piece copies 16 keys of each of the warp's rows. A row past T copies
  // the last row (its words are neither stored nor summarized); pieces past S are zero.
  {
    const int chunk = lane / kPiecesPerChunk, piece = lane % kPiecesPerChunk;
    const int64_t j0 = (group * kBlockChunks + chunk) * kMaskChunkKeys + piece * kPieceBytes;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int64_t row = row0 + r < mask.T ? row0 + r : mask.T - 1;
      uint4* slot = &staged[staged_slot(warp, r, chunk, piece)];
      if (kVector && j0 + kPieceBytes <= mask.S)
        copy_16_bytes_async(slot, mask.data + slice * mask.slice_stride + row * mask.row_stride + j0);
      else
        *slot = j0 < mask.S ? visible_bytes(mask, slice, row, j0) : make_uint4(0, 0, 0, 0);
    }
    wait_for_async_copies();
    __syncwarp();
  }

  // Packing: lane = 4 row + chunk turns its (row, chunk) into 4 words.
  const int own_row = lane / kBlockChunks, own_chunk = lane % kBlockChunks;
  const int64_t row = row0 + own_row, chunk = group * kBlockChunks + own_chunk;
  uint32_t chunk_words[kMaskChunkWords] = {0, 0, 0, 0};
  add_pieces(staged, warp, own_row, own_chunk, chunk_words, std::make_integer_sequence<int, kPiecesPerChunk>());
  // Bits past S are zero (their bytes were staged as zeros), so the (row, chunk) is all visible iff
  // it holds as many bits as it has keys below S.
  bool any_visible = false, all_visible = true;
  if (row < mask.T && chunk < chunks) {
    store_16_bytes(bits + (slice * mask.T + row) * words + chunk * kMaskChunkWords,
                   make_uint4(chunk_words[0], chunk_words[1], chunk_words[2], chunk_words[3]));
    const int64_t keys_in_range = mask.S - chunk * kMaskChunkKeys;
    const int visible = __popc(chunk_words[0]) + __popc(chunk_words[1]) + __popc(chunk_words[2]) + __popc(chunk_words[3]);
    any_visible = visible != 0;
    all_visible = visible == (keys_in_range < kMaskChunkKeys ? keys_in_range : kMaskChunkKeys);
  }

  // The tile summaries: any and all over the lanes of a chunk in every warp.
  __shared__ uint32_t any_lanes[kWarps], all_lanes[kWarps];
  const uint32_t any = __ballot_sync(0xffffffffu, any_visible);
  const uint32_t all = __ballot_sync(0xffffffffu, all_visible);
  if (lane == 0) {
    any_lanes[warp] = any;
    all_lanes[warp] = all;
  }
  __syncthreads();
  if (threadIdx.x < kBlockChunks && group * kBlockChunks + threadIdx.x < chunks) {
    const uint32_t chunk_lanes = 0x11111111u << threadIdx.x;
    bool tile_any = false, tile_all = true;
    for (int w = 0; w < kWarps; ++w) {
      tile_any = tile_any || (any_lanes[w] & chunk_lanes) != 0;
      tile_all = tile_all && (all_lanes[w] & chunk_lanes) == chunk_lanes;
    }
    const MaskTileKind kind = !tile_any ? MaskTileKind::kEmpty
                              : tile_all ? MaskTileKind::kFull
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
  if (reinterpret_cast<uintptr_t>(bits) % 16 != 0) return cudaErrorMisalignedAddress;  // a chunk's words: one vector
  if (rows_are_vectors(mask))
    pack_kernel<true><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(mask, bits, tiles, chunk_groups);
  else
    pack_kernel<false><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(mask, bits, tiles, chunk_groups);
  return cudaGetLastError();
}

}  // namespace jfa::gpu
