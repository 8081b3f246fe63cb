// Decoding the masking and training operands of the handlers into AttentionParams::mask.
//
// Every optional operand is an FFI buffer; a rank-0 buffer means "absent" (the lowering passes a
// scalar placeholder), so one handler signature serves every combination. Each present operand is
// checked against the attention shapes and named in the error. The boolean mask comes bit-packed
// with its tile summaries to both platforms' handlers (decode_packed_mask.h).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "ffi/decode.h"
#include "jfa/params.h"
#include "xla/ffi/api/ffi.h"

namespace jfa::ffi_decode {

inline bool present(const ffi::AnyBuffer& b) { return b.dimensions().size() != 0; }

// `buf` of rank 4 whose dims are 1 or the matching dim of [B, N, T, S]; returns broadcast strides.
inline ffi::Error broadcast_bnts(const ffi::AnyBuffer& buf, const char* name, ffi::DataType type,
                                 const char* type_name, const AttentionParams& p, Strides4* st) {
  auto d = buf.dimensions();
  const int64_t full[4] = {p.B, p.N, p.T, p.S};
  bool ok = d.size() == 4 && buf.element_type() == type;
  for (size_t a = 0; ok && a < 4; ++a) ok = d[a] == 1 || d[a] == full[a];
  if (!ok)
    return invalid(std::string(name) + " must be " + type_name + " of rank 4 broadcastable to [B, N, T, S] = (" +
                   std::to_string(full[0]) + ", " + std::to_string(full[1]) + ", " + std::to_string(full[2]) +
                   ", " + std::to_string(full[3]) + "), got " + shape_str(d));
  const int64_t dims[4] = {d[0], d[1], d[2], d[3]};
  *st = broadcast_strides(dims);
  return ffi::Error::Success();
}

// The operands and attributes of `x`, an attention call (attention_call.h), other than the packed
// mask's, into p->mask.
template <typename Call>
ffi::Error decode_mask(const Call& x, AttentionParams* p) {
  MaskParams& m = p->mask;
  m.bottom_right = x.bottom_right != 0;
  if (x.window_left < -1 || x.window_right < -1)
    return invalid("local_window_size must be >= 0 on each side, got (" + std::to_string(x.window_left) +
                   ", " + std::to_string(x.window_right) + ")");
  m.window_left = x.window_left;
  m.window_right = x.window_right;
  if (!(x.softcap >= 0.f) || !std::isfinite(x.softcap))
    return invalid("softcap must be a positive finite float, got " + std::to_string(x.softcap));
  m.softcap = x.softcap;
  if (!(x.dropout_rate >= 0.f && x.dropout_rate < 1.f))
    return invalid("dropout_rate must be in [0, 1), got " + std::to_string(x.dropout_rate));
  m.dropout_rate = x.dropout_rate;

  if (present(x.bias)) {
    if (auto e = broadcast_bnts(x.bias, "bias", ffi::DataType::F32, "float32", *p, &m.bias_strides); e.failure())
      return e;
    m.bias = static_cast<const float*>(x.bias.untyped_data());
    for (int i = 0; i < 4; ++i) m.bias_dims[i] = x.bias.dimensions()[i];
  }
  if (present(x.q_lengths)) {
    if (auto e = expect(x.q_lengths, "query_seq_lengths", {p->B}, ffi::DataType::S32); e.failure()) return e;
    m.q_lengths = static_cast<const int32_t*>(x.q_lengths.untyped_data());
  }
  if (present(x.kv_lengths)) {
    if (auto e = expect(x.kv_lengths, "key_value_seq_lengths", {p->B}, ffi::DataType::S32); e.failure()) return e;
    m.kv_lengths = static_cast<const int32_t*>(x.kv_lengths.untyped_data());
  }
  if (present(x.q_segment_ids) != present(x.kv_segment_ids))
    return invalid("q_segment_ids and kv_segment_ids must be given together");
  if (present(x.q_segment_ids)) {
    if (auto e = expect(x.q_segment_ids, "q_segment_ids", {p->B, p->T}, ffi::DataType::S32); e.failure())
      return e;
    if (auto e = expect(x.kv_segment_ids, "kv_segment_ids", {p->B, p->S}, ffi::DataType::S32); e.failure())
      return e;
    m.q_segment_ids = static_cast<const int32_t*>(x.q_segment_ids.untyped_data());
    m.kv_segment_ids = static_cast<const int32_t*>(x.kv_segment_ids.untyped_data());
  }
  if (present(x.alibi_slopes)) {
    auto d = x.alibi_slopes.dimensions();
    if (d.size() != 2 || (d[0] != 1 && d[0] != p->B) || d[1] != p->N ||
        x.alibi_slopes.element_type() != ffi::DataType::F32)
      return invalid("alibi_slopes must be float32 [1 or B, N] with B=" + std::to_string(p->B) +
                     ", N=" + std::to_string(p->N) + ", got " + shape_str(d));
    m.alibi_slopes = static_cast<const float*>(x.alibi_slopes.untyped_data());
    m.alibi_batch_stride = d[0] == 1 ? 0 : p->N;
  }
  if (m.dropout_rate > 0.f && !present(x.dropout_seeds))
    return invalid("dropout_rate > 0 needs dropout seeds (a dropout_rng key)");
  if (present(x.dropout_seeds)) {
    if (auto e = expect(x.dropout_seeds, "dropout seeds", {p->B, 3}, ffi::DataType::U32); e.failure()) return e;
    m.dropout_seeds = static_cast<const uint32_t*>(x.dropout_seeds.untyped_data());
  }
  if (present(x.positions)) {  // values: check_positions_on_host where readable (the CPU)
    if (auto e = expect(x.positions, "positions", {p->B, 2}, ffi::DataType::S32); e.failure()) return e;
    m.positions = static_cast<const int32_t*>(x.positions.untyped_data());
  }
  return ffi::Error::Success();
}

// The values of the positions operand, where the handler can read them (host memory: the CPU).
inline ffi::Error check_positions_on_host(const AttentionParams& p) {
  const int32_t* x = p.mask.positions;
  for (int64_t b = 0; x != nullptr && b < p.B; ++b)
    if (x[2 * b] < 0 || x[2 * b + 1] < 0 || (p.mask.has_dropout() && x[2 * b + 1] % 8 != 0))
      return invalid("positions must be non-negative, the key position a multiple of 8 with dropout; batch " +
                     std::to_string(b) + " has (" + std::to_string(x[2 * b]) + ", " + std::to_string(x[2 * b + 1]) + ")");
  return ffi::Error::Success();
}

// The segment-id summaries the CUDA handlers take after the optional operands (MaskParams::
// q_segment_chunks): present exactly when segment ids are, int32 [B, ceil(len / 16), 8].
inline ffi::Error decode_segment_chunks(const ffi::AnyBuffer& q_chunks, const ffi::AnyBuffer& kv_chunks,
                                        AttentionParams* p) {
  MaskParams& m = p->mask;
  if (m.q_segment_ids == nullptr) {
    if (present(q_chunks) || present(kv_chunks)) return invalid("segment summaries given without segment ids");
    return ffi::Error::Success();
  }
  auto chunks = [](int64_t len) { return (len + kSegmentChunk - 1) / kSegmentChunk; };
  if (auto e = expect(q_chunks, "q segment summaries", {p->B, chunks(p->T), 8}, ffi::DataType::S32); e.failure())
    return e;
  if (auto e = expect(kv_chunks, "kv segment summaries", {p->B, chunks(p->S), 8}, ffi::DataType::S32); e.failure())
    return e;
  m.q_segment_chunks = static_cast<const int32_t*>(q_chunks.untyped_data());
  m.kv_segment_chunks = static_cast<const int32_t*>(kv_chunks.untyped_data());
  return ffi::Error::Success();
}

// The d(bias) output: float32 in the bias's shape, or a rank-0 placeholder without a bias. With
// allow_full (the GPU backward with deterministic=True), it may instead have the full [B, N, T, S]
// shape, so that no element sums several contributions with atomics (MaskParams::dbias).
inline ffi::Error decode_dbias(ffi::AnyBuffer dbias, bool allow_full, AttentionParams* p) {
  MaskParams& m = p->mask;
  if (m.bias == nullptr) {
    if (present(dbias)) return invalid("dbias output given without a bias");
    return ffi::Error::Success();
  }
  const int64_t full[4] = {p->B, p->N, p->T, p->S};
  auto d = dbias.dimensions();
  bool is_full = allow_full && d.size() == 4 && dbias.element_type() == ffi::DataType::F32;
  for (size_t a = 0; is_full && a < 4; ++a) is_full = d[a] == full[a];
  const int64_t* dims = is_full ? full : m.bias_dims;
  if (!is_full)
    if (auto e = expect(dbias, "dbias", {dims[0], dims[1], dims[2], dims[3]}, ffi::DataType::F32); e.failure())
      return e;
  for (int a = 0; a < 4; ++a) m.dbias_dims[a] = dims[a];
  m.dbias_strides = broadcast_strides(dims);
  m.dbias = static_cast<float*>(dbias.untyped_data());
  return ffi::Error::Success();
}

// The d(ALiBi slopes) output, or a rank-0 placeholder without slopes: float32 [B, N, slots] of
// partial sums (MaskParams::dslopes) that the caller adds up, or with kDslopesComplete float32
// [B, N], the sums themselves (one slot).
inline constexpr int64_t kDslopesComplete = 0;
inline ffi::Error decode_dslopes(ffi::AnyBuffer dslopes, int64_t slots, AttentionParams* p) {
  if (p->mask.alibi_slopes == nullptr) {
    if (present(dslopes)) return invalid("dslopes output given without alibi_slopes");
    return ffi::Error::Success();
  }
  if (slots == kDslopesComplete) {
    if (auto e = expect(dslopes, "dslopes", {p->B, p->N}, ffi::DataType::F32); e.failure()) return e;
  } else if (auto e = expect(dslopes, "dslopes", {p->B, p->N, slots}, ffi::DataType::F32); e.failure()) {
    return e;
  }
  p->mask.dslopes = static_cast<float*>(dslopes.untyped_data());
  p->mask.dslope_slots = slots == kDslopesComplete ? 1 : slots;
  return ffi::Error::Success();
}

}  // namespace jfa::ffi_decode
