// XLA FFI handlers for the CPU platform: decode, check, run the C++ FlashAttention-2 kernels.
//
// Beyond q, k, v the handlers take every masking/training operand (bias, the bit-packed mask's
// bits and tile summaries, lengths, segment ids, ALiBi slopes, dropout seeds; rank 0 = absent) and
// their attributes: see decode_mask.h and decode_packed_mask.h. The lowering packs a boolean mask
// before it reaches them (jax_flashattn/primitives.py).
#include "cpu/attention_cpu.h"
#include "ffi/decode.h"
#include "ffi/decode_mask.h"
#include "ffi/decode_packed_mask.h"
#include "ffi/handlers.h"

namespace jfa {
namespace {

namespace ffi = xla::ffi;
using ffi_decode::decode_backward;
using ffi_decode::decode_forward;
using ffi_decode::MaskAttrs;
using ffi_decode::MaskOperands;

ffi::Error ForwardCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer bias,
                      ffi::AnyBuffer mask_bits, ffi::AnyBuffer mask_tiles, ffi::AnyBuffer q_lengths, ffi::AnyBuffer kv_lengths,
                      ffi::AnyBuffer q_segment_ids, ffi::AnyBuffer kv_segment_ids,
                      ffi::AnyBuffer alibi_slopes, ffi::AnyBuffer dropout_seeds, ffi::AnyBuffer positions,
                      ffi::Result<ffi::AnyBuffer> o, ffi::Result<ffi::AnyBuffer> lse, float scale,
                      int32_t is_causal, int32_t bottom_right, int64_t window_left,
                      int64_t window_right, float softcap, float dropout_rate) {
  AttentionParams p;
  if (auto e = decode_forward(q, k, v, *o, *lse, scale, is_causal, &p); e.failure()) return e;
  const MaskOperands extra{bias, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, alibi_slopes,
                           dropout_seeds, positions};
  const MaskAttrs attrs{bottom_right, window_left, window_right, softcap, dropout_rate};
  if (auto e = ffi_decode::decode_mask(extra, attrs, &p); e.failure()) return e;
  if (auto e = ffi_decode::check_positions_on_host(p); e.failure()) return e;
  if (auto e = ffi_decode::decode_packed_mask(mask_bits, mask_tiles, p, &p.mask.packed_mask); e.failure()) return e;
  cpu::forward(p);
  return ffi::Error::Success();
}

ffi::Error BackwardCpu(ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v, ffi::AnyBuffer o,
                       ffi::AnyBuffer lse, ffi::AnyBuffer dout, ffi::AnyBuffer dlse,
                       ffi::AnyBuffer bias, ffi::AnyBuffer mask_bits, ffi::AnyBuffer mask_tiles,
                       ffi::AnyBuffer q_lengths,
                       ffi::AnyBuffer kv_lengths, ffi::AnyBuffer q_segment_ids,
                       ffi::AnyBuffer kv_segment_ids, ffi::AnyBuffer alibi_slopes,
                       ffi::AnyBuffer dropout_seeds, ffi::AnyBuffer positions, ffi::Result<ffi::AnyBuffer> dq,
                       ffi::Result<ffi::AnyBuffer> dk, ffi::Result<ffi::AnyBuffer> dv,
                       ffi::Result<ffi::AnyBuffer> dbias, ffi::Result<ffi::AnyBuffer> dslopes,
                       float scale, int32_t is_causal,
                       int32_t bottom_right, int64_t window_left, int64_t window_right,
                       float softcap, float dropout_rate) {
  AttentionParams p;
  if (auto e = decode_backward(q, k, v, o, lse, dout, dlse, *dq, *dk, *dv, scale, is_causal, &p);
      e.failure())
    return e;
  const MaskOperands extra{bias, q_lengths, kv_lengths, q_segment_ids, kv_segment_ids, alibi_slopes,
                           dropout_seeds, positions};
  const MaskAttrs attrs{bottom_right, window_left, window_right, softcap, dropout_rate};
  if (auto e = ffi_decode::decode_mask(extra, attrs, &p); e.failure()) return e;
  if (auto e = ffi_decode::check_positions_on_host(p); e.failure()) return e;
  if (auto e = ffi_decode::decode_packed_mask(mask_bits, mask_tiles, p, &p.mask.packed_mask); e.failure()) return e;
  if (auto e = ffi_decode::decode_dbias(*dbias, /*allow_full=*/false, &p); e.failure()) return e;
  // The CPU backward adds its partial sums up itself.
  if (auto e = ffi_decode::decode_dslopes(*dslopes, ffi_decode::kDslopesComplete, &p); e.failure()) return e;
  cpu::backward(p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jfa

// Optional operands (rank 0 = absent) and attributes in the order of MaskOperands / MaskAttrs.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaForwardCpu, jfa::ForwardCpu,
    xla::ffi::Ffi::Bind()
      .Arg<xla::ffi::AnyBuffer>()  // q
      .Arg<xla::ffi::AnyBuffer>()  // k
      .Arg<xla::ffi::AnyBuffer>()  // v
      .Arg<xla::ffi::AnyBuffer>()  // bias, float32 broadcastable to [B, N, T, S]
      .Arg<xla::ffi::AnyBuffer>()  // packed mask bits, uint32 [B or 1, N or 1, T, ceil(S/128)*4]
      .Arg<xla::ffi::AnyBuffer>()  // packed mask tiles, uint8 [B or 1, N or 1, ceil(T/64), ceil(S/128)]
      .Arg<xla::ffi::AnyBuffer>()  // query_seq_lengths, int32 [B]
      .Arg<xla::ffi::AnyBuffer>()  // key_value_seq_lengths, int32 [B]
      .Arg<xla::ffi::AnyBuffer>()  // q_segment_ids, int32 [B, T]
      .Arg<xla::ffi::AnyBuffer>()  // kv_segment_ids, int32 [B, S]
      .Arg<xla::ffi::AnyBuffer>()  // alibi_slopes, float32 [1 or B, N]
      .Arg<xla::ffi::AnyBuffer>()  // dropout seeds, uint32 [B, 3]
      .Arg<xla::ffi::AnyBuffer>()  // positions of query row 0 and key 0, int32 [B, 2]
      .Ret<xla::ffi::AnyBuffer>()  // o
      .Ret<xla::ffi::AnyBuffer>()  // lse
      .Attr<float>("scale")
      .Attr<int32_t>("is_causal")
      .Attr<int32_t>("bottom_right")
      .Attr<int64_t>("window_left")
      .Attr<int64_t>("window_right")
      .Attr<float>("softcap")
      .Attr<float>("dropout_rate"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JfaBackwardCpu, jfa::BackwardCpu,
    xla::ffi::Ffi::Bind()
      .Arg<xla::ffi::AnyBuffer>()  // q
      .Arg<xla::ffi::AnyBuffer>()  // k
      .Arg<xla::ffi::AnyBuffer>()  // v
      .Arg<xla::ffi::AnyBuffer>()  // o
      .Arg<xla::ffi::AnyBuffer>()  // lse
      .Arg<xla::ffi::AnyBuffer>()  // dout
      .Arg<xla::ffi::AnyBuffer>()  // dlse
      .Arg<xla::ffi::AnyBuffer>()  // bias, float32 broadcastable to [B, N, T, S]
      .Arg<xla::ffi::AnyBuffer>()  // packed mask bits, uint32 [B or 1, N or 1, T, ceil(S/128)*4]
      .Arg<xla::ffi::AnyBuffer>()  // packed mask tiles, uint8 [B or 1, N or 1, ceil(T/64), ceil(S/128)]
      .Arg<xla::ffi::AnyBuffer>()  // query_seq_lengths, int32 [B]
      .Arg<xla::ffi::AnyBuffer>()  // key_value_seq_lengths, int32 [B]
      .Arg<xla::ffi::AnyBuffer>()  // q_segment_ids, int32 [B, T]
      .Arg<xla::ffi::AnyBuffer>()  // kv_segment_ids, int32 [B, S]
      .Arg<xla::ffi::AnyBuffer>()  // alibi_slopes, float32 [1 or B, N]
      .Arg<xla::ffi::AnyBuffer>()  // dropout seeds, uint32 [B, 3]
      .Arg<xla::ffi::AnyBuffer>()  // positions of query row 0 and key 0, int32 [B, 2]
      .Ret<xla::ffi::AnyBuffer>()  // dq
      .Ret<xla::ffi::AnyBuffer>()  // dk
      .Ret<xla::ffi::AnyBuffer>()  // dv
      .Ret<xla::ffi::AnyBuffer>()  // dbias, float32 in the bias's shape (rank 0 without a bias)
      .Ret<xla::ffi::AnyBuffer>()  // dslopes, float32 [B, N] (rank 0 without ALiBi slopes)
      .Attr<float>("scale")
      .Attr<int32_t>("is_causal")
      .Attr<int32_t>("bottom_right")
      .Attr<int64_t>("window_left")
      .Attr<int64_t>("window_right")
      .Attr<float>("softcap")
      .Attr<float>("dropout_rate"));
