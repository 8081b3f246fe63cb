// Global-memory views and the bulk-copy engine of the Hopper kernels: tensors as TMA sees them,
// tiled TMA loads and stores (cuTensorMapEncodeTiled through CuTe's make_tma_copy, built on the
// host per call), and the 1-D bulk copies (no tensor map) that move contiguous float rows: row
// statistics into smem, dQ partial sums added into global memory.
#pragma once

#include <cstdint>
#include <utility>

#include <cute/tensor.hpp>

#include "jfa/params.h"

namespace jfa::sm90 {

using namespace cute;

// A [batch, rows, heads, dim] tensor as (rows, dim, heads, batch), dim contiguous.
using GmemShape = Shape<int32_t, int32_t, int32_t, int32_t>;
using GmemStride = Stride<int64_t, _1, int64_t, int64_t>;

// A dimension of size 1 never moves its index, so its stride is replaced by one TMA accepts (a
// multiple of 16 bytes).
inline GmemStride gmem_stride(const Strides& s, int64_t heads, int64_t batch) {
  return GmemStride{s.row, _1{}, heads == 1 ? s.row : s.head, batch == 1 ? s.row : s.batch};
}

template <typename Element>
auto gmem_tensor(const void* ptr, GmemShape shape, GmemStride stride) {
  return make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)), shape, stride);
}
template <typename Element>
auto gmem_tensor(void* ptr, GmemShape shape, GmemStride stride) {
  return make_tensor(make_gmem_ptr(static_cast<Element*>(ptr)), shape, stride);
}

// The call's query-side tensors (q, o, dout: [B, T, N, H]) and key-side ones (k, v, dk, dv:
// [B, S, K, H]) in that view.
inline GmemShape query_shape(const AttentionParams& p) { return GmemShape{int(p.T), int(p.H), int(p.N), int(p.B)}; }
inline GmemShape key_shape(const AttentionParams& p) { return GmemShape{int(p.S), int(p.H), int(p.K), int(p.B)}; }
template <typename Element, typename Ptr>
auto query_tensor(const AttentionParams& p, Ptr ptr, const Strides& s) {
  return gmem_tensor<Element>(ptr, query_shape(p), gmem_stride(s, p.N, p.B));
}
template <typename Element, typename Ptr>
auto key_tensor(const AttentionParams& p, Ptr ptr, const Strides& s) {
  return gmem_tensor<Element>(ptr, key_shape(p), gmem_stride(s, p.K, p.B));
}

// The forward's K and V: key_tensor's view, or a paged call's page pool [num_pages, page_size, K,
// H] as (page rows, dim, heads, pages), whose tiles the producer addresses page by page.
inline GmemShape kv_shape(const AttentionParams& p) {
  return p.paged.present() ? GmemShape{int(p.paged.page_size), int(p.H), int(p.K), int(p.paged.num_pages)}
                           : key_shape(p);
}
template <typename Element, typename Ptr>
auto kv_tensor(const AttentionParams& p, Ptr ptr, const Strides& s) {
  return gmem_tensor<Element>(ptr, kv_shape(p), gmem_stride(s, p.K, p.paged.present() ? p.paged.num_pages : p.B));
}

// TMA load of one (rows x dim) tile into smem of layout `SmemLayout` (its first two modes).
template <int kRows, int kDim, typename SmemLayout, typename GTensor>
auto make_tma_load(GTensor const& t) {
  return make_tma_copy(SM90_TMA_LOAD{}, t, take<0, 2>(SmemLayout{}), Shape<Int<kRows>, Int<kDim>>{}, _1{});
}

// 128-byte swizzled K-major atom (8 rows x 64 elements): what TMA writes and wgmma reads without
// bank conflicts.
template <typename Element>
using SmemAtomSw128 = GMMA::Layout_K_SW128_Atom<Element>;

// The smem layout of kRows rows of a K or V tile, for the TMA boxes of a paged tile's chunks
// (paged_kv.h, load_paged_chunks). Chunk c (rows kRows·c..) of a tile laid out by
// tile_to_shape(SmemAtomSw128, (rows, dim)) is, per 64-column atom, kRows whole contiguous rows
// (kRows a multiple of the atom's 8), so a box built for this layout lands in it.
template <typename Element, int kRows, int kDim>
using SmemLayoutRows = decltype(tile_to_shape(SmemAtomSw128<Element>{}, Shape<Int<kRows>, Int<kDim>>{}));

// Outputs are stored per warpgroup in boxes of 64 rows x 64 columns, one swizzle atom wide. A
// (rows, dim) smem tile laid out by tile_to_shape(SmemAtomSw128, ...) tiles the atom down the rows
// first, so box (w, c) (rows 64w.., columns 64c..) is contiguous at box_offset(w, c) and laid out as
// a 64 x 64 tile of its own (the offset is a multiple of the swizzle's 1024-element period).
template <typename Element>
using SmemLayoutStoreBox = decltype(tile_to_shape(SmemAtomSw128<Element>{}, Shape<_64, _64>{}));

template <int kTileRows>
__host__ __device__ constexpr int store_box_offset(int w, int c) {
  static_assert((kTileRows * 64) % 1024 == 0);
  return w * 64 * 64 + c * kTileRows * 64;
}

template <typename Element, typename GTensor>
auto make_tma_store_box(GTensor const& t) {
  return make_tma_copy(SM90_TMA_STORE{}, t, SmemLayoutStoreBox<Element>{}, Shape<_64, _64>{}, _1{});
}

// The descriptor types that kernel parameter structs hold.
template <typename Element>
using GmemTensorIn = decltype(gmem_tensor<Element>(static_cast<const void*>(nullptr), GmemShape{}, GmemStride{}));
template <typename Element>
using GmemTensorOut = decltype(gmem_tensor<Element>(static_cast<void*>(nullptr), GmemShape{}, GmemStride{}));
template <typename Element, int kRows, int kDim, typename SmemLayout>
using TmaLoad = decltype(make_tma_load<kRows, kDim, SmemLayout>(std::declval<GmemTensorIn<Element>>()));
template <typename Element>
using TmaStoreBox = decltype(make_tma_store_box<Element>(std::declval<GmemTensorOut<Element>>()));

// The TMA copy of tile `coord` (kRows x kDim) of head `head`, batch `batch` of TMA tensor `m`
// ((rows, dim, heads, batch), get_tma_tensor's) into smem tensor `s`, completing on `bar`. Called
// by one thread.
template <int kRows, int kDim, typename Tma, typename MTensor, typename STensor>
__forceinline__ __device__ void tma_load_tile(Tma const& tma, MTensor const& m, int head, int batch, int row_block,
                                              STensor&& s, uint64_t& bar) {
  Tensor g = local_tile(m(_, _, head, batch), Shape<Int<kRows>, Int<kDim>>{}, make_coord(row_block, _0{}));
  auto [tg, ts] = tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(s), group_modes<0, 2>(g));
  copy(tma.with(bar), tg, ts);
}

// Stores this warpgroup's 64 rows (of a tile of kTileRows rows starting at global row `row0` of
// the (rows, dim) view `g`) from smem tile `smem` through TMA, box by box (rows past the tensor's
// end are clipped by TMA). Called by one thread; the caller arrives and waits on the store group.
template <int kTileRows, int kDim, typename Element, typename Tma, typename GTensor2>
__forceinline__ __device__ void tma_store_rows(Tma const& tma, GTensor2 const& g, const Element* smem, int w,
                                               int row_block) {
  Tensor boxes = local_tile(g, Shape<_64, _64>{}, make_coord(row_block, _));  // (64, 64, dim / 64)
  CUTE_UNROLL
  for (int c = 0; c < kDim / 64; ++c) {
    Tensor box = make_tensor(make_smem_ptr(smem + store_box_offset<kTileRows>(w, c)), SmemLayoutStoreBox<Element>{});
    auto [gmem_part, smem_part] =
        tma_partition(tma, _0{}, Layout<_1>{}, group_modes<0, 2>(box), group_modes<0, 2>(boxes(_, _, c)));
    copy(tma, smem_part, gmem_part);
  }
}

// ---- 1-D bulk copies ----------------------------------------------------------------------------

// smem[0, bytes) = gmem[0, bytes), completing on `mbar` as `bytes` transaction bytes. Both
// addresses 16-byte aligned, bytes a multiple of 16.
__forceinline__ __device__ void bulk_load(void* smem, const void* gmem, int bytes, uint64_t& mbar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          cute::cast_smem_ptr_to_uint(smem)),
      "l"(gmem), "r"(bytes), "r"(cute::cast_smem_ptr_to_uint(&mbar))
      : "memory");
}

// gmem[0, bytes) += smem[0, bytes), float32 adds performed in L2, as one bulk group of this
// thread (bulk_commit, then bulk_wait_read before smem is overwritten). Same alignment rules.
__forceinline__ __device__ void bulk_reduce_add(float* gmem, const float* smem, int bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(gmem),
               "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes)
               : "memory");
}
__forceinline__ __device__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// This thread's bulk groups but the newest kPending have read their smem.
template <int kPending>
__forceinline__ __device__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}
// This thread's bulk groups have all completed (their writes performed).
__forceinline__ __device__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

}  // namespace jfa::sm90
