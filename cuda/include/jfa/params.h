// AttentionParams: the one description of an attention call that every kernel path sees.
//
// The FFI handlers fill it from XLA buffers and attributes; kernels (CPU, sm80, sm90) read nothing
// else. Shape letters follow DESIGN.md: B batch, T query length, S key/value length, N query heads,
// K key/value heads (N % K == 0, G = N / K), H head dim of q/k, Hv head dim of v.
//
// Layouts. q [B,T,N,H], k [B,S,K,H], v [B,S,K,Hv], o/do [B,T,N,Hv]; the last dimension is
// contiguous and the other strides are given in elements, so a kernel never assumes packing.
// lse/dlse are float32 [B,T,N] (natural log, the public layout) with their own strides.
#pragma once

#include <cstdint>

#include "jfa/host_device.h"
#include "jfa/packed_mask.h"

namespace jfa {

// Rows of the dQ accumulator (and of the row statistics) are padded to whole query blocks of
// every backward kernel: to a multiple of kDqAccumRowAlign, which every kBlockM divides but the
// Hopper backward's 80 (H 128 without causality or masks), and to a multiple of that 80.
// jax_flashattn/primitives.py sizes the workspaces with the same constants.
inline constexpr int64_t kDqAccumRowAlign = 128;
inline constexpr int64_t kDqAccumTallBlock = 80;

// Query rows per dQ semaphore of the deterministic backward (a divisor of every backward kBlockM
// but the Hopper backward's 80, whose blocks take one semaphore each: sm90/bwd_dq_order.h).
// jax_flashattn/primitives.py sizes the semaphore workspace with the same constant.
inline constexpr int64_t kDqSemaphoreRows = 64;

// Copies ("lanes") of the dQ accumulator that the deterministic backward's workspace holds:
// the portable ordered causal kernel's and the Hopper split-head kernel's (H 256) key tile n adds
// into lane n % kDqLanes after the lower key tiles of its lane only, and the convert kernel sums
// the lanes in a fixed order (sm80/dq_accum.h and sm90/bwd_dq_order.h say why; the other kernels
// use one lane). jax_flashattn/primitives.py sizes both workspaces with the same constant.
inline constexpr int64_t kDqLanes = 2;

// Positions per chunk of the segment-id summaries (MaskParams::q_segment_chunks): a divisor of
// every GPU tile size. jax_flashattn/_segment_chunks.py uses the same constant.
inline constexpr int kSegmentChunk = 16;

// Keys per d(ALiBi slope) partial-sum slot of the CUDA backward (MaskParams::dslopes): every
// backward key tile is a multiple of it, so each slot has one writer.
inline constexpr int kDslopeKeys = 64;

enum class DType : int32_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "unknown";
}

// Element strides of a [batch, row, head, dim] tensor whose last dimension is contiguous.
struct Strides {
  int64_t batch = 0;
  int64_t row = 0;
  int64_t head = 0;
};

// Strides of a densely packed [batch, rows, heads, dim] tensor.
inline Strides packed_strides(int64_t rows, int64_t heads, int64_t dim) {
  return Strides{rows * heads * dim, heads * dim, dim};
}

// Element strides of a [batch, head, row (query), col (key)] tensor that is broadcast to
// [B, N, T, S]: a broadcast axis has stride 0, so a small bias or mask is never expanded.
struct Strides4 {
  int64_t batch = 0;
  int64_t head = 0;
  int64_t row = 0;
  int64_t col = 0;
};

// Packed (row-major) strides of an array of shape d, 0 on its size-1 axes: how a bias, mask or
// d(bias) of shape [B or 1, N or 1, T or 1, S or 1] is addressed as [B, N, T, S].
inline Strides4 broadcast_strides(const int64_t d[4]) {
  return Strides4{d[0] == 1 ? 0 : d[1] * d[2] * d[3], d[1] == 1 ? 0 : d[2] * d[3], d[2] == 1 ? 0 : d[3],
                  d[3] == 1 ? 0 : 1};
}

// The masking and training features (jax_flashattn's keywords), read through jfa/mask.h.
// Positions: query i of batch b is at position i + offset(b) relative to the keys, where the
// offset is 0 (top-left alignment) or kv_len(b) - q_len(b) (bottom-right). Causal keeps keys
// j <= i + offset; a window keeps i + offset - window_left <= j <= i + offset + window_right;
// ALiBi adds -slope * |i + offset - j|.
struct MaskParams {
  bool bottom_right = false;
  int64_t window_left = -1;   // -1: unbounded on that side
  int64_t window_right = -1;

  // Valid lengths (padding at the end), int32 [B]; null: T and S. Values are clamped to [0, T|S].
  const int32_t* q_lengths = nullptr;
  const int32_t* kv_lengths = nullptr;

  // Packed sequences: query i sees key j only if q_segment_ids[b, i] == kv_segment_ids[b, j].
  // int32 [B, T] and [B, S], packed (null: no segments).
  const int32_t* q_segment_ids = nullptr;
  const int32_t* kv_segment_ids = nullptr;
  // Their summaries per chunk of kSegmentChunk positions, computed by the caller (jax_flashattn/
  // _segment_chunks.py defines them), so that the GPU kernels skip tiles that share no segment and
  // prove tiles inside one segment full. q_segment_chunks int32 [B, ceil(T / 16), 8]: per query
  // chunk (min id, max id, begin, end, run begin, run end, match begin, match end), where a block
  // of chunks c0..c1 may see keys [begin(c0), end(c1)) only (empty if begin >= end), queries [run
  // begin, run end) all hold the chunk's one id (empty if it holds several), and so do keys [match
  // begin, match end) (a run of the key side's, maybe empty); kv_segment_chunks int32
  // [B, ceil(S / 16), 8]: the same per key chunk, sides swapped. Optional: null means no tile is
  // skipped or proven full by segments (the CPU kernels compute their own).
  const int32_t* q_segment_chunks = nullptr;
  const int32_t* kv_segment_chunks = nullptr;

  // Boolean mask, bit-packed with per-tile summaries (jfa/packed_mask.h: jax_flashattn.PackedMask;
  // a boolean array is packed by the caller), broadcast over B and N by strides. Absent: bits null.
  PackedMaskView packed_mask;

  // Score modifiers, in order: logits = softcap * tanh(scale * q.k / softcap) (softcap > 0 only),
  // then + bias[b, n, i, j] (float32, broadcast by strides) + ALiBi.
  float softcap = 0.f;
  const float* bias = nullptr;
  Strides4 bias_strides;
  const float* alibi_slopes = nullptr;  // float32 [B or 1, N]
  int64_t alibi_batch_stride = 0;       // 0 when the slopes are shared by the batch

  int64_t bias_dims[4] = {0, 0, 0, 0};  // the bias's shape (each axis 1 or full)

  // Backward output: d(bias), float32, packed in dbias_dims and addressed by dbias_strides (0 on
  // its size-1 axes). Either the bias's own shape, every broadcast axis summed into it with float
  // atomics, or (GPU, deterministic=True, broadcast bias) the full [B, N, T, S]: each element is
  // then added once onto zero, so exactly, and the caller sums the broadcast axes in a fixed order.
  float* dbias = nullptr;
  int64_t dbias_dims[4] = {0, 0, 0, 0};
  Strides4 dbias_strides;

  // Backward output, with ALiBi: d(loss)/d(slope of batch b, head n) = -sum_ij dS_bnij |pos_i - j|
  // as partial sums [B, N, dslope_slots], float32, each slot written by one thread in a fixed
  // order; the caller adds the slots up (so the result is deterministic without atomics).
  float* dslopes = nullptr;
  int64_t dslope_slots = 0;

  // Dropout on the probabilities: element (b, n, i, j) is dropped when
  // dropout_uniform(seed[b].k0, seed[b].k1, seed[b].batch, n, i, j) < dropout_threshold(rate);
  // kept ones are scaled by 1 / (1 - rate). dropout_seeds: uint32 [B, 3] = (k0, k1, batch).
  float dropout_rate = 0.f;
  const uint32_t* dropout_seeds = nullptr;

  // Where this call's rows sit in a longer sequence, for a call on one block of it (context
  // parallelism, sequence sharding): int32 [B, 2] = (position of query row 0, position of key 0)
  // per batch element, non-negative, the key position a multiple of 8 (dropout draws 8
  // neighbouring keys per Philox call). Causality, windows and ALiBi see row i at position 0 + i
  // and key j at position 1 + j, and so does the dropout stream. Null: (0, 0). Device memory for
  // the CUDA kernels.
  const int32_t* positions = nullptr;

  JFA_HOST_DEVICE bool has_score_mod() const {
    return softcap > 0.f || bias != nullptr || alibi_slopes != nullptr;
  }
  JFA_HOST_DEVICE bool has_dropout() const { return dropout_rate > 0.f; }
  // The positions of query row 0 and key 0 of batch element b (see positions).
  JFA_HOST_DEVICE int64_t query_position0(int64_t b) const { return positions != nullptr ? positions[2 * b] : 0; }
  JFA_HOST_DEVICE int64_t key_position0(int64_t b) const { return positions != nullptr ? positions[2 * b + 1] : 0; }
  // The ALiBi slope of batch element b, head n (alibi_slopes given).
  JFA_HOST_DEVICE float alibi_slope(int64_t b, int64_t n) const { return alibi_slopes[b * alibi_batch_stride + n]; }
  // Whether any element-wise mask beyond positions exists (tiles cannot be proven full).
  JFA_HOST_DEVICE bool has_element_mask() const { return packed_mask.present(); }
  // Whether any feature beyond plain/causal (top-left) attention is on: kernels that specialize
  // the plain path (sm80, sm90) take their general path, or decline the call, when it is.
  JFA_HOST_DEVICE bool active() const {
    return bottom_right || window_left >= 0 || window_right >= 0 || q_lengths != nullptr ||
           kv_lengths != nullptr || q_segment_ids != nullptr || packed_mask.present() || has_score_mod() ||
           has_dropout() || positions != nullptr;
  }
};

// A paged key/value cache (vLLM's layout): k and v are page pools [num_pages, page_size, K, H]
// (their strides' `batch` is a page's), and key row s of batch element b lives at row s % page_size
// of page table[b * table_stride + s / page_size], S = table_stride * page_size. A page id outside
// [0, num_pages) is clamped into it, so a bad table never reads out of bounds. Null table: k and v
// are [B, S, K, H].
struct PagedKV {
  const int32_t* table = nullptr;  // int32 [B, table_stride]; device memory for the CUDA kernels
  int64_t table_stride = 0;        // pages per sequence
  int64_t page_size = 0;
  int64_t num_pages = 0;

  JFA_HOST_DEVICE bool present() const { return table != nullptr; }
  // The page that holds key row `row` of batch element b.
  JFA_HOST_DEVICE int64_t page(int64_t b, int64_t row) const {
    const int64_t id = table[b * table_stride + row / page_size];
    return id < 0 ? 0 : id >= num_pages ? num_pages - 1 : id;
  }
};

struct AttentionParams {
  // Shapes.
  int64_t B = 0, T = 0, S = 0, N = 0, K = 0, H = 0, Hv = 0;
  DType dtype = DType::kFloat32;  // of q, k, v, o, do, dq, dk, dv

  // Softmax scale applied to q·k (natural units) and the same folded with log2(e) for exp2.
  float scale = 1.f;
  float scale_log2 = 1.4426950408889634f;

  // Masking. Causal uses jax.nn's top-left alignment: query i sees keys j <= i, unless
  // mask.bottom_right (then j <= i + offset, see jfa/mask.h).
  bool is_causal = false;

  // Everything beyond plain/causal attention: masks as per-tile policies and per-element
  // predicates, score modifiers, dropout (jfa/mask.h, jfa/philox.h). Defaults change nothing.
  MaskParams mask;

  // Forward inputs and outputs.
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;
  Strides q_strides, k_strides, v_strides, o_strides;
  Strides lse_strides;  // dim unused: lse[b,t,n] = lse[b*batch + t*row + n*head]
  PagedKV paged;        // k and v as page pools (the forward only)

  // Backward inputs and outputs (unused by the forward pass).
  const void* dout = nullptr;  // cotangent of o, layout of o
  const float* dlse = nullptr; // cotangent of lse, layout of lse; may be null (treated as 0)
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  Strides do_strides, dq_strides, dk_strides, dv_strides;

  // Backward workspace for GPU kernels, provided by the FFI (never allocated per call).
  // dq_accum: float32 [lanes, B, N, dq_accum_rows(), H or accum_cols], lanes = kDqLanes with
  // deterministic, else 1. Rows are padded so that every query tile of the backward kernel owns a
  // whole contiguous block, which the kernel stores in the order its threads hold the dQ fragments
  // (sm80/dq_accum.h): its atomics then cover contiguous spans.
  float* dq_accum = nullptr;
  // Row statistics of the backward, float32 [B, N, dq_accum_rows()] each (rows past T: D = 0 and
  // LSE·log2 e = +inf, so that those rows' probabilities are 0), written by the backward's first
  // kernel (jfa/bwd_row_stats.cuh): D = rowsum(dO∘O) − dLSE, and LSE·log2 e (the Hopper backward
  // only; null for the portable one). Padded rows keep every query block's rows whole and 16-byte
  // aligned, which the Hopper backward's bulk copies of them need.
  float* softmax_d = nullptr;
  float* lse_log2 = nullptr;
  // Causal GQA without deterministic=True only (null otherwise): float32 [2, B, K, dkv_accum_rows(),
  // H or accum_cols], dK then dV, where the Hopper backward runs a group's query heads in CTAs of
  // their own, which add their partial dK and dV here (zeroed by its launcher) instead of storing
  // them.
  float* dkv_accum = nullptr;
  // The Hopper backward's workspace for a mask's bits by key (PackedMaskView::key_bits), which it
  // makes before its kernel: uint32 [B or 1, N or 1, S rounded up to 128, mask_words(T)] (the bits'
  // broadcast axes). Null where no backward with a mask runs.
  uint32_t* mask_key_bits = nullptr;
  // Columns of a dq_accum and dkv_accum row (0: H). The Hopper backward runs a head dim between
  // its kernels' on the next larger kernel (sm90/api.h, kernel_head_dim), whose partial sums span
  // that kernel's width, so it takes such a call only where the workspace rows are that wide.
  int64_t accum_cols = 0;

  // Deterministic backward (deterministic=True): every lane of a dQ tile receives its key
  // blocks' adds in increasing key-block order, ordered through dq_semaphore, int32 [kDqLanes, B,
  // N, ceil(T / 64)], zeroed by the launcher (sm80/launch.h; the protocol: sm80/dq_accum.h).
  // d(bias) is deterministic only for a bias without broadcast axes (the lowering refuses the
  // others).
  bool deterministic = false;
  int32_t* dq_semaphore = nullptr;

  // Forward workspace of the Hopper kernel's dynamic tile scheduler: int32 [1], zeroed by its
  // launcher (sm90/fwd_launch.h; the order: sm90/tile_scheduler.h). Null: a static schedule.
  int32_t* tile_counter = nullptr;

  JFA_HOST_DEVICE int64_t dq_accum_rows() const {
    const int64_t aligned = (T + kDqAccumRowAlign - 1) / kDqAccumRowAlign * kDqAccumRowAlign;
    const int64_t tall = (T + kDqAccumTallBlock - 1) / kDqAccumTallBlock * kDqAccumTallBlock;
    return aligned > tall ? aligned : tall;
  }
  JFA_HOST_DEVICE int64_t dkv_accum_rows() const {
    return (S + kDqAccumRowAlign - 1) / kDqAccumRowAlign * kDqAccumRowAlign;
  }
  JFA_HOST_DEVICE int64_t dq_semaphores_per_head() const { return (T + kDqSemaphoreRows - 1) / kDqSemaphoreRows; }

  JFA_HOST_DEVICE int64_t group_size() const { return N / K; }
};

}  // namespace jfa
