// Second pass of the tensor-core backward (the first is backward_tensor_cores.cu): dK and dV of the
// selected rows from the P and scale·dS the first pass left in the workspace,
//   dK[row(slot)] += Σ_heads scale·dS[head][slot] · Q[head],   dV[row(slot)] += Σ_heads P[head][slot] · dO[head],
// for each (query position, key head) item. A CTA takes one item, one block of columns of dK or dV
// and up to 128 of the key head's query heads, whose Q (or dO) columns stay in shared memory while
// the item's slots stream through in blocks of 64: every block is a GEMM with the heads as its inner
// dimension, then one float32 atomic add per element of each selected row (16-byte reductions on
// Hopper). Summing all the heads before the atomics, rather than one CTA's block of them, is what
// this pass is for: the reductions are most of L2's traffic. For the same reason, where V is K's
// first columns (MLA's shared latent rows: v null) and shared memory allows, one CTA sums both
// products into the same row, dS·Q + P·dO, and adds it once rather than once per gradient.
#include "sparse/backward_key_rows.h"

#include <algorithm>

#include "sparse/device_common.cuh"
#include "sparse/mma.cuh"
#include "sparse/tensor_core_tiles.cuh"

namespace jfa::sparse_gpu {
namespace key_rows {
namespace {

// The tile of one CTA for gradient rows kDim wide (the padded head dim of dK or of dV), summing
// kProducts products: 1 (dK or dV), or 2 (dK and dV of shared rows: 8 warps, as one CTA fills an SM).
template <int kDim, int kProducts_ = 1>
struct KeyRowShape {
  static constexpr int kProducts = kProducts_;
  static constexpr int kSlotGroups = kProducts;        // warps along the slots
  static constexpr int kWarps = 4 * kSlotGroups;       // four along the columns
  static constexpr int kThreads = 32 * kWarps;
  static constexpr int kSlots = 64;                     // slots per block: four m16 tiles of rows
  static constexpr int kMaxHeads = 128;                 // query heads per CTA: the GEMMs' inner dimension
  static constexpr int kParts = kDim > 128 ? 2 : 1;     // column blocks, one CTA each
  static constexpr int kPartColumns = kDim / kParts;
  static constexpr int kWarpColumns = kPartColumns / 4;
  static constexpr int kColumnTiles = kWarpColumns / 8;  // n8 tiles per warp
  static constexpr int kRowTiles = kSlots / 16 / kSlotGroups;  // m16 tiles per warp
  // 16 bytes of padding per row: the 8 rows an ldmatrix reads fall in distinct bank groups.
  static constexpr int kXStride = kPartColumns + 8;
  static constexpr int kWStride = kSlots + 8;
  static_assert(kWarpColumns % 8 == 0, "each warp takes whole n8 tiles");
  static_assert(kPartColumns % 8 == 0, "rows are copied in 16-byte chunks");
};

// Shared memory of a CTA with `heads` (a multiple of 16) query heads: each product's Q or dO
// columns, then two buffers of each product's weights for a block of slots.
template <typename Shape, typename Elem>
struct KeyRowSmem {
  __host__ __device__ static size_t columns(int heads) { return sizeof(Elem) * heads * Shape::kXStride; }
  __host__ __device__ static size_t block(int heads) { return sizeof(Elem) * heads * Shape::kWStride; }
  __host__ __device__ static size_t weights(int heads) { return Shape::kProducts * columns(heads); }
  __host__ __device__ static size_t bytes(int heads) { return weights(heads) + 2 * Shape::kProducts * block(heads); }
};

// One product summed into the rows: scale·dS with Q's columns (dK), or P with dO's (dV).
struct Product {
  int weights;     // 0: P with dO's rows, 1: scale·dS with Q's (the workspace's second axis)
  const void* x;   // Q or dO
  int64_t x_dim;   // H or Hv: its columns (zeros past them)
};

// What one launch computes: the sum of `products` of them into `out`, `width` columns.
struct Target {
  Product product[2];
  int products;
  int64_t width;     // columns formed: the widest product's
  float* out;        // accumulator
  bool value_rows;   // out's rows are V's (v_row) rather than K's (k_row)
};

// The CTA's work: an item (query position and key head) of the chunk, a column part, a head block.
struct KeyRowItem {
  int64_t b, t, kh, local;
  int part, h0, heads;  // heads h0 … h0 + heads − 1 of the key head's group
};

// Column parts that hold some of x_dim's columns (the others would add nothing).
template <typename Shape>
__host__ __device__ int parts_used(int64_t x_dim) {
  return static_cast<int>((x_dim + Shape::kPartColumns - 1) / Shape::kPartColumns);
}

template <typename Shape>
__device__ __forceinline__ KeyRowItem key_row_item(const SparseParams& p, const Target& target, int64_t first_item) {
  KeyRowItem it;
  it.local = blockIdx.x;
  int64_t item = first_item + it.local;  // (b·T + t)·K + kh
  it.kh = item % p.K;
  item /= p.K;
  it.t = item % p.T;
  it.b = item / p.T;
  const int parts = parts_used<Shape>(target.width);
  it.part = blockIdx.y % parts;
  it.h0 = (blockIdx.y / parts) * Shape::kMaxHeads;
  const int64_t left = p.group_size() - it.h0;
  it.heads = static_cast<int>(left < Shape::kMaxHeads ? left : Shape::kMaxHeads);
  return it;
}

// Copies the CTA's heads' Q or dO columns of one product into shared memory [heads_padded][kXStride]
// (zeros past the head block and past the product's x_dim).
template <typename Shape, typename Elem>
__device__ __forceinline__ void load_head_columns(const SparseParams& p, const Product& product,
                                                  const KeyRowItem& it, int heads_padded, Elem* sx) {
  constexpr int kChunks = Shape::kPartColumns / 8;
  const Elem* x = static_cast<const Elem*>(product.x);
  const int64_t n0 = it.kh * p.group_size() + it.h0;
  for (int i = threadIdx.x; i < heads_padded * kChunks; i += Shape::kThreads) {
    const int h = i / kChunks, local_col = i % kChunks * 8;
    const int64_t col = it.part * Shape::kPartColumns + local_col;
    const bool read = h < it.heads && col < product.x_dim;
    const int64_t n = n0 + h;
    const int64_t row = product.weights == 1 ? p.q_row(it.b, it.t, n) : p.o_row(it.b, it.t, n);
    mma::copy_16b(sx + h * Shape::kXStride + local_col, read ? x + row + col : x, read);
  }
}

// Starts the copies of one block of slots' weights of the CTA's heads into `sw` [heads_padded][kWStride].
template <typename Shape, typename Elem>
__device__ __forceinline__ void load_weight_block(const Elem* weights, int64_t row_slots, const KeyRowItem& it,
                                                  int heads_padded, int64_t block, Elem* sw) {
  constexpr int kChunks = Shape::kSlots / 8;
  for (int i = threadIdx.x; i < heads_padded * kChunks; i += Shape::kThreads) {
    const int h = i / kChunks, c = i % kChunks;
    const bool read = h < it.heads;
    // Rows are whole blocks long (weight_row_slots), so a read never leaves the row.
    mma::copy_16b(sw + h * Shape::kWStride + c * 8,
                  read ? weights + (it.h0 + h) * row_slots + block * Shape::kSlots + c * 8 : weights, read);
  }
}

// The accumulator offsets of the rows a lane's fragments hold in one block: m16 tile mt of the
// warp's slot group, rows lane / 4 and + 8; −1 for a slot that is past topk or whose index is
// invalid (never written).
template <typename Shape>
__device__ __forceinline__ void block_row_offsets(const SparseParams& p, const Target& target, const KeyRowItem& it,
                                                  int64_t block, int64_t (&offset)[Shape::kRowTiles][2]) {
  const int32_t* indices = p.indices + p.index_row(it.b, it.t, it.kh);
  const int lane = threadIdx.x % 32, first_tile = threadIdx.x / 32 / 4 * Shape::kRowTiles;
#pragma unroll
  for (int mt = 0; mt < Shape::kRowTiles; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t slot = block * Shape::kSlots + (first_tile + mt) * 16 + lane / 4 + 8 * r;
      const int32_t s = slot < p.topk ? __ldg(indices + slot) : -1;
      offset[mt][r] = !sparse_index_valid(p, it.t, s) ? -1
                      : target.value_rows              ? p.v_row(it.b, s, it.kh)
                                                       : p.k_row(it.b, s, it.kh);
    }
}

// Adds a lane's accumulator fragment of one n8 tile (rows g and g + 8 of the m16 tile, g = lane / 4,
// at row offsets row_offset[0] and [1], −1 for an invalid slot; columns col and col + 1) into `out`.
// On Hopper as one 16-byte reduction per lane: the even lane of each pair takes row g's four
// columns (its two and its neighbour's), the odd lane row g + 8's. Elsewhere as float atomics.
__device__ __forceinline__ void add_fragment(float* out, const int64_t (&row_offset)[2], int64_t col,
                                             const float (&v)[4], int lane) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const bool even = lane % 2 == 0;
  const float got0 = __shfl_xor_sync(0xffffffffu, even ? v[2] : v[0], 1);
  const float got1 = __shfl_xor_sync(0xffffffffu, even ? v[3] : v[1], 1);
  const int64_t row = even ? row_offset[0] : row_offset[1];  // (a select: an index would put the array in local memory)
  if (row >= 0)
    atomicAdd(reinterpret_cast<float4*>(out + row + (col & ~int64_t{3})),
              even ? make_float4(v[0], v[1], got0, got1) : make_float4(got0, got1, v[2], v[3]));
#else
#pragma unroll
  for (int h = 0; h < 2; ++h)
    if (row_offset[h] >= 0) {
      atomicAdd(out + row_offset[h] + col, v[2 * h]);
      atomicAdd(out + row_offset[h] + col + 1, v[2 * h + 1]);
    }
#endif
}

// acc[mt][nt] += Wᵀ·X over the warp's slots of the block (rows) and its columns: W [heads][slots]
// and X [heads][columns] in shared memory, the heads the inner dimension, both read through
// transposing ldmatrix.
template <typename Shape, typename Elem>
__device__ __forceinline__ void block_products(const Elem* sw, const Elem* sx, int head_steps,
                                               float (&acc)[Shape::kRowTiles][Shape::kColumnTiles][4]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int first_slot = warp / 4 * Shape::kRowTiles * 16;
  const Elem* w_row = sw + (lane / 16 * 8 + lane % 8) * Shape::kWStride + first_slot + lane / 8 % 2 * 8;
  const Elem* x_row =
      sx + (lane % 8 + lane / 8 % 2 * 8) * Shape::kXStride + warp % 4 * Shape::kWarpColumns + lane / 16 * 8;
  for (int ks = 0; ks < head_steps; ++ks) {
    uint32_t a[Shape::kRowTiles][4];
#pragma unroll
    for (int mt = 0; mt < Shape::kRowTiles; ++mt)
      mma::ldmatrix_x4_trans(a[mt], w_row + ks * 16 * Shape::kWStride + mt * 16);
#pragma unroll
    for (int np = 0; np < Shape::kColumnTiles / 2; ++np) {
      uint32_t b[4];
      mma::ldmatrix_x4_trans(b, x_row + ks * 16 * Shape::kXStride + np * 16);
#pragma unroll
      for (int mt = 0; mt < Shape::kRowTiles; ++mt) {
        mma::mma_16816<Elem>(acc[mt][2 * np], a[mt], b[0], b[1]);
        mma::mma_16816<Elem>(acc[mt][2 * np + 1], a[mt], b[2], b[3]);
      }
    }
    if constexpr (Shape::kColumnTiles % 2 == 1) {  // the last n8 tile alone
      constexpr int nt = Shape::kColumnTiles - 1;
      uint32_t b[2];
      mma::ldmatrix_x2_trans(b, x_row - lane / 16 * 8 + ks * 16 * Shape::kXStride + nt * 8);
#pragma unroll
      for (int mt = 0; mt < Shape::kRowTiles; ++mt) mma::mma_16816<Elem>(acc[mt][nt], a[mt], b[0], b[1]);
    }
  }
}

template <typename Shape, typename Elem>
__global__ void __launch_bounds__(Shape::kThreads)
    key_rows_kernel(SparseParams p, SparseBackwardWorkspace ws, Target target, int64_t first_item) {
  extern __shared__ __align__(16) unsigned char smem[];
  using Smem = KeyRowSmem<Shape, Elem>;
  const KeyRowItem it = key_row_item<Shape>(p, target, first_item);
  const int heads_padded = (it.heads + 15) / 16 * 16;
  const int column_elems = heads_padded * Shape::kXStride, block_elems = heads_padded * Shape::kWStride;
  Elem* sx = reinterpret_cast<Elem*>(smem);  // [product][heads_padded][kXStride]
  Elem* sw = reinterpret_cast<Elem*>(smem + Smem::weights(heads_padded));  // [buffer][product][heads_padded][kWStride]
  const int64_t row_slots = weight_row_slots(p.topk), G = p.group_size();
  const Elem* item_weights = static_cast<const Elem*>(ws.weights) + it.local * 2 * G * row_slots;
  const int64_t blocks = (p.topk + Shape::kSlots - 1) / Shape::kSlots;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t warp_col0 = it.part * Shape::kPartColumns + warp % 4 * Shape::kWarpColumns;
  const bool has_columns = warp_col0 < target.width;  // (warps past the width still meet the barriers)
  auto load_block = [&](int64_t block) {
#pragma unroll
    for (int j = 0; j < Shape::kProducts; ++j)
      load_weight_block<Shape>(item_weights + target.product[j].weights * G * row_slots, row_slots, it,
                               heads_padded, block, sw + ((block % 2) * Shape::kProducts + j) * block_elems);
  };

#pragma unroll
  for (int j = 0; j < Shape::kProducts; ++j)
    load_head_columns<Shape>(p, target.product[j], it, heads_padded, sx + j * column_elems);
  load_block(0);
  mma::commit_copies();
  for (int64_t block = 0; block < blocks; ++block) {
    if (block + 1 < blocks) load_block(block + 1);  // into the buffers every warp finished with last block
    mma::commit_copies();
    int64_t offset[Shape::kRowTiles][2];
    block_row_offsets<Shape>(p, target, it, block, offset);
    mma::wait_copies<1>();
    __syncthreads();  // the block's weights (and, the first time, the head columns) are in
    if (has_columns) {
      float acc[Shape::kRowTiles][Shape::kColumnTiles][4] = {};
#pragma unroll
      for (int j = 0; j < Shape::kProducts; ++j)
        block_products<Shape>(sw + ((block % 2) * Shape::kProducts + j) * block_elems, sx + j * column_elems,
                              heads_padded / 16, acc);
#pragma unroll
      for (int mt = 0; mt < Shape::kRowTiles; ++mt)
#pragma unroll
        for (int nt = 0; nt < Shape::kColumnTiles; ++nt) {
          const int64_t col = warp_col0 + nt * 8 + lane % 4 * 2;
          // The width is a multiple of 8, so the test is the same for the whole warp (add_fragment shuffles).
          if (warp_col0 + nt * 8 < target.width) add_fragment(target.out, offset[mt], col, acc[mt][nt], lane);
        }
    }
    __syncthreads();  // every warp is done with the block's buffers before the next block refills them
  }
}

template <typename Shape, typename Elem>
size_t smem_bytes(const SparseParams& p) {
  const int64_t G = p.group_size();
  const int heads = static_cast<int>(((G < Shape::kMaxHeads ? G : Shape::kMaxHeads) + 15) / 16 * 16);
  return KeyRowSmem<Shape, Elem>::bytes(heads);
}

template <typename Shape, typename Elem>
cudaError_t launch(const SparseParams& p, const SparseBackwardWorkspace& ws, const Target& target,
                   int64_t first_item, int64_t count, cudaStream_t stream) {
  const size_t smem = smem_bytes<Shape, Elem>(p);
  const int64_t head_blocks = (p.group_size() + Shape::kMaxHeads - 1) / Shape::kMaxHeads;
  const int64_t y = head_blocks * parts_used<Shape>(target.width);
  if (count <= 0 || count > 0x7fffffff || y > 65535) return cudaErrorInvalidConfiguration;
  auto kernel = key_rows_kernel<Shape, Elem>;
  if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
      e != cudaSuccess)
    return e;
  kernel<<<dim3(static_cast<unsigned>(count), static_cast<unsigned>(y)), Shape::kThreads, smem, stream>>>(
      p, ws, target, first_item);
  return cudaGetLastError();
}

}  // namespace
}  // namespace key_rows

bool key_rows_take(const SparseParams& p, int max_smem) {
  using key_rows::KeyRowShape;
  const int64_t head_blocks = (p.group_size() + KeyRowShape<64>::kMaxHeads - 1) / KeyRowShape<64>::kMaxHeads;
  if (head_blocks * 2 > 65535) return false;  // blockIdx.y: head blocks x column parts
  return tc::dispatch_half_dtype(p.dtype, [&](auto tag) {
           using Elem = decltype(tag);
           return tc::dispatch_dims(p.H, p.Hv, [&](auto qk, auto v) {
             const size_t need = std::max(key_rows::smem_bytes<KeyRowShape<qk()>, Elem>(p),
                                          key_rows::smem_bytes<KeyRowShape<v()>, Elem>(p));
             return need <= static_cast<size_t>(max_smem) ? cudaSuccess : cudaErrorNotSupported;
           });
         }) == cudaSuccess;
}

cudaError_t key_row_gradients(const SparseParams& p, const SparseBackwardWorkspace& ws, int64_t first_item,
                              int64_t count, cudaStream_t stream) {
  using key_rows::KeyRowShape;
  using key_rows::Product;
  using key_rows::Target;
  const bool separate_v = p.v != nullptr;
  const Product dk{1, p.q, p.H}, dv{0, p.dout, p.Hv};
  return tc::dispatch_half_dtype(p.dtype, [&](auto tag) {
    using Elem = decltype(tag);
    return tc::dispatch_dims(p.H, p.Hv, [&](auto qk, auto v) {
      // With v null, dV lands in the first Hv columns of dK's accumulator (K and V are one buffer):
      // one sum of both products per row where its tile fits.
      using Both = KeyRowShape<qk(), 2>;
      if (!separate_v && key_rows::smem_bytes<Both, Elem>(p) <= static_cast<size_t>(tc::max_dynamic_smem()))
        return key_rows::launch<Both, Elem>(p, ws, Target{{dk, dv}, 2, p.H, ws.dk_accum, false}, first_item, count,
                                            stream);
      const Target dk_only{{dk, dk}, 1, p.H, ws.dk_accum, false};
      const Target dv_only{{dv, dv}, 1, p.Hv, separate_v ? ws.dv_accum : ws.dk_accum, separate_v};
      if (cudaError_t e = key_rows::launch<KeyRowShape<qk()>, Elem>(p, ws, dk_only, first_item, count, stream);
          e != cudaSuccess)
        return e;
      return key_rows::launch<KeyRowShape<v()>, Elem>(p, ws, dv_only, first_item, count, stream);
    });
  });
}

}  // namespace jfa::sparse_gpu
