// The tile machinery the tensor-core sparse kernels (forward, attn_dist) share.
//
// A CTA takes one query position and a block of kRows query heads of one key/value head: all of
// them attend to the same selected keys, so each gathered key row, loaded once into shared memory,
// serves kRows rows of a 16-row MMA tile (DeepSeek's MQA-mode MLA has 128 heads per key head). The
// selected slots are streamed kKeys at a time through a ring of kStages cp.async buffers, up to
// kStages − 1 steps loading while one step's MMAs run; each thread reads the index of the row it
// copies one step before it copies it, so the index load's latency hides behind a step too.
//
// Warps come in pairs: warp (row group rg, half h) owns query rows 16·rg … 16·rg + 15. For Q·Kᵀ the
// two warps of a pair each take half of the head dim and exchange partial logits through shared
// memory, which halves the ldmatrix traffic per MMA against splitting the keys; both then hold the
// same logits (a + b in one, b + a in the other) and so the same softmax. For P·V each takes half
// of the value columns.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "jfa/sparse_params.h"
#include "sparse/device_common.cuh"
#include "sparse/mma.cuh"

namespace jfa::sparse_gpu::tc {

template <int kDimQK_, int kDimV_, int kRowGroups_, int kStages_ = 2>
struct TileShape {
  static constexpr int kDimQK = kDimQK_;  // head dim of q and k, padded (zeros) to a multiple of 32
  static constexpr int kDimV = kDimV_;    // value head dim, padded to a multiple of 32
  static constexpr int kRowGroups = kRowGroups_;
  static constexpr int kRows = 16 * kRowGroups;  // query heads per CTA
  static constexpr int kWarps = 2 * kRowGroups;
  static constexpr int kThreads = 32 * kWarps;
  // 32 slots per step at MLA's 576 keep Q and two key buffers within an A100's 163 KiB.
  static constexpr int kKeys = kDimQK > 256 ? 32 : 64;
  static constexpr int kKeyTiles = kKeys / 8;  // n8 tiles of the logits per row group
  // Buffers of key (and value) rows: 3 where shared memory allows (Hopper), else 2.
  static constexpr int kStages = kStages_;
  // Threads copying one selected row: 16 bytes each per instruction, adjacent threads adjacent bytes.
  static constexpr int kThreadsPerKey = kThreads / kKeys;
  // 16 bytes of padding per row: the 8 rows an ldmatrix reads fall in distinct bank groups.
  static constexpr int kQStride = kDimQK + 8;
  static constexpr int kVStride = kDimV + 8;
  static constexpr int kDimSteps = kDimQK / 16;  // k16 steps of Q·Kᵀ, split between a pair
  static_assert(kDimQK % 32 == 0 && kDimV % 32 == 0, "each half of a pair takes whole k16 / n16 steps");
  static_assert(kThreads % kKeys == 0 && (kDimQK / 8) % kThreadsPerKey == 0 && (kDimV / 8) % kThreadsPerKey == 0,
                "the threads of a key copy whole 16-byte chunks of its row");
};

// Where a CTA's shared memory goes (byte offsets into the dynamic allocation).
template <typename Shape, typename Elem>
struct SmemPlan {
  static constexpr size_t kQ = 0;
  static constexpr size_t kK = kQ + sizeof(Elem) * Shape::kRows * Shape::kQStride;
  static constexpr size_t kV = kK + sizeof(Elem) * Shape::kStages * Shape::kKeys * Shape::kQStride;
  // Partial logits of every warp, in fragment order ([warp][register][lane]: conflict-free).
  __host__ __device__ static size_t exchange(bool separate_v) {
    return kV + (separate_v ? sizeof(Elem) * Shape::kStages * Shape::kKeys * Shape::kVStride : 0);
  }
  __host__ __device__ static size_t valid(bool separate_v) {
    return exchange(separate_v) + sizeof(float) * Shape::kWarps * Shape::kKeyTiles * 4 * 32;
  }
  __host__ __device__ static size_t bytes(bool separate_v) {
    return valid(separate_v) + Shape::kStages * Shape::kKeys;  // one byte per slot: valid or not
  }
};

// Whether the tensor-core kernels take a call's dtype and head dims (16-byte row chunks; the
// largest padded dims built); Hv only for a kernel that reads values (attn_dist's calls carry
// Hv = 1). Other calls run on the CUDA-core kernels.
inline bool tensor_core_shapes(const SparseParams& p, bool reads_values) {
  return p.dtype != DType::kFloat32 && p.H % 8 == 0 && p.H <= 576 && p.topk > 0 &&
         (!reads_values || (p.Hv % 8 == 0 && p.Hv <= 512));
}

// The shared memory a CTA of the current device can opt in to (0 if the query fails).
inline int max_dynamic_smem() {
  int device = 0, bytes = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess)
    return 0;
  return bytes;
}

// Calls launch(Elem{}) for a float16 / bfloat16 call; float32 calls are not the tensor cores'.
template <typename Launch>
inline cudaError_t dispatch_half_dtype(DType dtype, Launch&& launch) {
  return dispatch_dtype(dtype, [&](auto tag) -> cudaError_t {
    if constexpr (std::is_same_v<decltype(tag), float>) {
      return cudaErrorNotSupported;
    } else {
      return launch(tag);
    }
  });
}

// Runs the launches in order until one takes the call (returns other than cudaErrorNotSupported).
template <typename... Launches>
inline cudaError_t first_taken(Launches&&... launches) {
  cudaError_t e = cudaErrorNotSupported;
  ((e = e == cudaErrorNotSupported ? launches() : e), ...);
  return e;
}

// The head dims of the kernels built: (q/k, v), each call taking the first pair that covers it.
// 64 … 256 are the dense kernels' dims (and (192, 128) DeepSeek's non-latent training shape);
// (576, 512) is MLA's latent cache (512 + 64 rotary dims, V the first 512).
template <typename Launch>
inline cudaError_t dispatch_dims(int64_t H, int64_t Hv, Launch&& launch) {
  if (H <= 64 && Hv <= 64) return launch(std::integral_constant<int, 64>{}, std::integral_constant<int, 64>{});
  if (H <= 128 && Hv <= 128) return launch(std::integral_constant<int, 128>{}, std::integral_constant<int, 128>{});
  if (H <= 192 && Hv <= 128) return launch(std::integral_constant<int, 192>{}, std::integral_constant<int, 128>{});
  if (H <= 256 && Hv <= 256) return launch(std::integral_constant<int, 256>{}, std::integral_constant<int, 256>{});
  if (H <= 576 && Hv <= 512) return launch(std::integral_constant<int, 576>{}, std::integral_constant<int, 512>{});
  return cudaErrorNotSupported;
}

// The same list for kernels that read only q and k (attn_dist).
template <typename Launch>
inline cudaError_t dispatch_qk_dim(int64_t H, Launch&& launch) {
  if (H <= 64) return launch(std::integral_constant<int, 64>{});
  if (H <= 128) return launch(std::integral_constant<int, 128>{});
  if (H <= 192) return launch(std::integral_constant<int, 192>{});
  if (H <= 256) return launch(std::integral_constant<int, 256>{});
  if (H <= 576) return launch(std::integral_constant<int, 576>{});
  return cudaErrorNotSupported;
}

// The CTA's work item: query position, key/value head and its block of query heads.
struct TileItem {
  int64_t b, t, kh;
  int64_t n0, n_end;  // query heads n0 … n_end − 1 (the block, clipped to the key head's group)
};

// Item `cta` of the grid's order: head block fastest, then key head, query position, batch.
template <typename Shape>
__device__ __forceinline__ TileItem tile_item(const SparseParams& p, int64_t cta) {
  const int64_t G = p.group_size(), blocks = (G + Shape::kRows - 1) / Shape::kRows;
  int64_t item = cta;
  const int64_t block = item % blocks;
  item /= blocks;
  TileItem it;
  it.kh = item % p.K;
  item /= p.K;
  it.t = item % p.T;
  it.b = item / p.T;
  it.n0 = it.kh * G + block * Shape::kRows;
  const int64_t group_end = (it.kh + 1) * G;
  it.n_end = it.n0 + Shape::kRows < group_end ? it.n0 + Shape::kRows : group_end;
  return it;
}

template <typename Shape>
__device__ __forceinline__ TileItem tile_item(const SparseParams& p) {
  return tile_item<Shape>(p, blockIdx.x);
}

// Rows of the CTA's heads into shared memory with row stride kStride: head n's row starts at
// src + row_of(n); zeros past `dim` columns (up to kWidth) and past n_end.
template <typename Shape, int kWidth, int kStride, typename Elem, typename RowOf>
__device__ __forceinline__ void load_head_rows(const TileItem& it, const Elem* src, int64_t dim, RowOf row_of,
                                               Elem* dst) {
  constexpr int kChunks = kWidth / 8;
  for (int i = threadIdx.x; i < Shape::kRows * kChunks; i += Shape::kThreads) {
    const int row = i / kChunks, col = i % kChunks * 8;
    const int64_t n = it.n0 + row;
    const bool read = n < it.n_end && col < dim;
    mma::copy_16b(dst + row * kStride + col, read ? src + row_of(n) + col : src, read);
  }
}

// Q rows of the CTA's heads into shared memory (zeros past the head dim and past n_end).
template <typename Shape, typename Elem>
__device__ __forceinline__ void load_queries(const SparseParams& p, const TileItem& it, Elem* sq) {
  load_head_rows<Shape, Shape::kDimQK, Shape::kQStride>(
      it, static_cast<const Elem*>(p.q), p.H, [&](int64_t n) { return p.q_row(it.b, it.t, n); }, sq);
}

// The selected rows of one step: the thread's share of copying them into a ring buffer. Each
// thread copies chunks of one row (key threadIdx.x / kThreadsPerKey); it holds that row's index
// for the next step it will copy, loaded one step ahead.
template <typename Shape, typename Elem>
struct StepLoader {
  const SparseParams& p;
  const TileItem& it;
  const int32_t* indices;  // the (query, key head) row of topk indices
  int key, first_chunk;
  int32_t next_index = -1;  // index of this thread's row in the step fetch_index() read last

  __device__ __forceinline__ StepLoader(const SparseParams& p_, const TileItem& it_)
      : p(p_), it(it_), indices(p_.indices + p_.index_row(it_.b, it_.t, it_.kh)),
        key(threadIdx.x / Shape::kThreadsPerKey), first_chunk(threadIdx.x % Shape::kThreadsPerKey) {}

  // Loads the index this thread's row has in `step` (-1 past topk), for a later copy().
  __device__ __forceinline__ void fetch_index(int64_t step) {
    const int64_t slot = step * Shape::kKeys + key;
    next_index = slot < p.topk ? __ldg(indices + slot) : -1;
  }

  // Starts the copies of the fetched step's rows into buffer `buf` (zeros for an invalid slot, whose
  // row is never read, and past the head dims); where `valid` is given, marks which slots are
  // valid, and where `rows` is, which key row each slot holds (-1: invalid).
  __device__ __forceinline__ void copy(int buf, Elem* sk, Elem* sv, uint8_t* valid, int32_t* rows) const {
    const int32_t s = next_index;
    const bool ok = sparse_index_valid(p, it.t, s);
    copy_row<Shape::kDimQK, Shape::kQStride>(static_cast<const Elem*>(p.k), ok ? p.k_row(it.b, s, it.kh) : 0, p.H,
                                             ok, sk + (buf * Shape::kKeys + key) * Shape::kQStride);
    if (sv != nullptr)
      copy_row<Shape::kDimV, Shape::kVStride>(static_cast<const Elem*>(p.v), ok ? p.v_row(it.b, s, it.kh) : 0, p.Hv,
                                              ok, sv + (buf * Shape::kKeys + key) * Shape::kVStride);
    if (first_chunk == 0) {
      if (valid != nullptr) valid[buf * Shape::kKeys + key] = ok;
      if (rows != nullptr) rows[buf * Shape::kKeys + key] = ok ? s : -1;
    }
  }

  template <int kWidth, int kStride>
  __device__ __forceinline__ void copy_row(const Elem* src, int64_t row, int64_t dim, bool ok, Elem* dst) const {
#pragma unroll
    for (int c = first_chunk; c < kWidth / 8; c += Shape::kThreadsPerKey) {
      const bool read = ok && 8 * c < dim;
      mma::copy_16b(dst + 8 * c, read ? src + row + 8 * c : src, read);
    }
  }
};

// Runs body(step, buf) for each step of the CTA's selected slots, its rows in ring buffer `buf`,
// with the copies of the next kStages − 1 steps in flight. Loads the CTA's queries first (in the
// first step's copies, as is anything the caller started copying before). `valid` and `rows` may
// be null.
template <typename Shape, typename Elem, typename Body>
__device__ __forceinline__ void for_each_step(const SparseParams& p, const TileItem& it, Elem* sq, Elem* sk, Elem* sv,
                                              uint8_t* valid, int32_t* rows, Body&& body) {
  StepLoader<Shape, Elem> loader(p, it);
  load_queries<Shape>(p, it, sq);
  const int64_t steps = (p.topk + Shape::kKeys - 1) / Shape::kKeys;
#pragma unroll
  for (int step = 0; step < Shape::kStages - 1; ++step) {
    if (step < steps) {
      loader.fetch_index(step);
      loader.copy(step, sk, sv, valid, rows);
    }
    mma::commit_copies();  // (empty groups too: every step commits one, so wait_copies counts steps)
  }
  loader.fetch_index(Shape::kStages - 1);
  for (int64_t step = 0; step < steps; ++step) {
    mma::wait_copies<Shape::kStages - 2>();
    __syncthreads();  // the step's rows are in; every warp is done with the buffer refilled next
    const int64_t ahead = step + Shape::kStages - 1;
    if (ahead < steps) {
      loader.copy(ahead % Shape::kStages, sk, sv, valid, rows);
      loader.fetch_index(ahead + 1);
    }
    mma::commit_copies();
    body(step, static_cast<int>(step % Shape::kStages));
  }
}

// This warp's role in its pair.
template <typename Shape>
struct WarpRole {
  int warp, lane, row_group, half, partner;
  __device__ __forceinline__ WarpRole() {
    warp = threadIdx.x / 32;
    lane = threadIdx.x % 32;
    row_group = warp % Shape::kRowGroups;
    half = warp / Shape::kRowGroups;
    partner = (1 - half) * Shape::kRowGroups + row_group;
  }
  // Both warps of a pair meet here (named barriers 1 … kRowGroups; 0 is __syncthreads').
  __device__ __forceinline__ void pair_barrier() const { mma::barrier(1 + row_group, 64); }
};

// out[nt][e] = a·b over kDim columns, for the pair's 16 rows of `a` (row stride kAStride: the CTA's
// queries, or their output gradients) and the step's kKeys rows of `b` (row stride b_stride: the
// gathered keys or values): this warp's half of the columns, then the partner's half added through
// `exchange`. Both warps of the pair end with the same sums.
template <typename Shape, int kDim, int kAStride, typename Elem>
__device__ __forceinline__ void pair_products(const WarpRole<Shape>& role, const Elem* a, const Elem* b, int b_stride,
                                              float* exchange, float (&out)[Shape::kKeyTiles][4]) {
  static_assert(kDim % 32 == 0, "each warp of a pair takes whole k16 steps");
#pragma unroll
  for (int nt = 0; nt < Shape::kKeyTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) out[nt][e] = 0.f;
  const int lane = role.lane;
  const Elem* a_row = a + (role.row_group * 16 + lane % 16) * kAStride + lane / 16 * 8;
  const Elem* b_row = b + (lane % 8 + lane / 16 * 8) * b_stride + lane / 8 % 2 * 8;
  constexpr int kHalfSteps = kDim / 32;
#pragma unroll
  for (int step = 0; step < kHalfSteps; ++step) {
    const int col = (role.half * kHalfSteps + step) * 16;
    uint32_t a_frag[4];
    mma::ldmatrix_x4(a_frag, a_row + col);
#pragma unroll
    for (int kt = 0; kt < Shape::kKeyTiles / 2; ++kt) {
      uint32_t b_frag[4];
      mma::ldmatrix_x4(b_frag, b_row + kt * 16 * b_stride + col);
      mma::mma_16816<Elem>(out[2 * kt], a_frag, b_frag[0], b_frag[1]);
      mma::mma_16816<Elem>(out[2 * kt + 1], a_frag, b_frag[2], b_frag[3]);
    }
  }
  float* mine = exchange + (role.warp * Shape::kKeyTiles * 4) * 32 + lane;
  const float* theirs = exchange + (role.partner * Shape::kKeyTiles * 4) * 32 + lane;
#pragma unroll
  for (int nt = 0; nt < Shape::kKeyTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) mine[(nt * 4 + e) * 32] = out[nt][e];
  role.pair_barrier();
#pragma unroll
  for (int nt = 0; nt < Shape::kKeyTiles; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) out[nt][e] += theirs[(nt * 4 + e) * 32];
}

// logits[nt][e] = q·k of the pair's 16 rows and the step's keys (fragment layout of n8 tile nt).
template <typename Shape, typename Elem>
__device__ __forceinline__ void step_logits(const WarpRole<Shape>& role, const Elem* sq, const Elem* sk,
                                            float* exchange, float (&logits)[Shape::kKeyTiles][4]) {
  pair_products<Shape, Shape::kDimQK, Shape::kQStride>(role, sq, sk, Shape::kQStride, exchange, logits);
}

// acc (this warp's half of kWidth columns) += W·R over the step's keys: W the pair's 16 x kKeys
// weights in the logits' fragment layout (which is the A operand's: P in the forward, scale·dS for
// the backward's dQ), R the step's gathered rows (values, or keys), row stride r_stride.
template <typename Shape, int kWidth, typename Elem>
__device__ __forceinline__ void accumulate_half_columns(const WarpRole<Shape>& role,
                                                        const float (&w)[Shape::kKeyTiles][4], const Elem* r,
                                                        int r_stride, float (&acc)[kWidth / 16][4]) {
  const int lane = role.lane;
  const Elem* r_row = r + (lane % 8 + lane / 8 % 2 * 8) * r_stride + role.half * (kWidth / 2) + lane / 16 * 8;
#pragma unroll
  for (int kk = 0; kk < Shape::kKeys / 16; ++kk) {
    const uint32_t a[4] = {mma::pack2<Elem>(w[2 * kk][0], w[2 * kk][1]), mma::pack2<Elem>(w[2 * kk][2], w[2 * kk][3]),
                           mma::pack2<Elem>(w[2 * kk + 1][0], w[2 * kk + 1][1]),
                           mma::pack2<Elem>(w[2 * kk + 1][2], w[2 * kk + 1][3])};
#pragma unroll
    for (int nc = 0; nc < kWidth / 32; ++nc) {
      uint32_t b[4];
      mma::ldmatrix_x4_trans(b, r_row + kk * 16 * r_stride + nc * 16);
      mma::mma_16816<Elem>(acc[2 * nc], a, b[0], b[1]);
      mma::mma_16816<Elem>(acc[2 * nc + 1], a, b[2], b[3]);
    }
  }
}

// The step's key index of fragment element e of n8 tile nt (rows: e < 2 → lane / 4, else + 8).
__device__ __forceinline__ int fragment_key(int nt, int e, int lane) { return nt * 8 + lane % 4 * 2 + (e & 1); }

}  // namespace jfa::sparse_gpu::tc
