// Decoding XLA FFI buffers into AttentionParams, with the checks that turn a bad call into an
// ffi::Error naming the argument and its shape (the Python layer checks first, at trace time;
// these checks keep the C++ entry points safe on their own).
#pragma once

#include <cmath>
#include <cstdint>
#include <sstream>
#include <string>

#include "jfa/params.h"
#include "xla/ffi/api/ffi.h"

namespace jfa::ffi_decode {

namespace ffi = xla::ffi;

inline std::string shape_str(ffi::Span<const int64_t> dims) {
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < dims.size(); ++i) s << (i ? ", " : "") << dims[i];
  s << (dims.size() == 1 ? ",)" : ")");
  return s.str();
}

inline ffi::Error invalid(const std::string& msg) {
  return ffi::Error::InvalidArgument("jax_flashattn: " + msg);
}

// The element type of q/k/v as a kernel dtype; an error for anything but f32/f16/bf16.
inline ffi::Error to_dtype(ffi::DataType t, DType* out) {
  switch (t) {
    case ffi::DataType::F32: *out = DType::kFloat32; return ffi::Error::Success();
    case ffi::DataType::F16: *out = DType::kFloat16; return ffi::Error::Success();
    case ffi::DataType::BF16: *out = DType::kBFloat16; return ffi::Error::Success();
    default: return invalid("query must be float32, float16 or bfloat16");
  }
}

// Checks that `buf` has exactly `want` dims and, when `dtype` is given, that element type.
inline ffi::Error expect(const ffi::AnyBuffer& buf, const char* name,
                         std::initializer_list<int64_t> want, ffi::DataType dtype) {
  auto dims = buf.dimensions();
  bool ok = dims.size() == want.size() && buf.element_type() == dtype;
  size_t i = 0;
  for (int64_t w : want) ok = ok && dims[i++] == w;
  if (!ok) {
    std::ostringstream s;
    s << name << " must have shape (";
    i = 0;
    for (int64_t w : want) s << (i++ ? ", " : "") << w;
    s << ") matching the query, got " << shape_str(dims);
    if (buf.element_type() != dtype) s << " with a different dtype";
    return invalid(s.str());
  }
  return ffi::Error::Success();
}

// A paged call's key and value page pools [num_pages, page_size, K, H] and block table int32 [B,
// max_pages] into p->paged; *kv_rows = max_pages * page_size, the keys of each sequence.
inline ffi::Error decode_paged_kv(const ffi::AnyBuffer& table, ffi::Span<const int64_t> qd,
                                  ffi::Span<const int64_t> kd, ffi::Span<const int64_t> vd,
                                  AttentionParams* p, int64_t* kv_rows) {
  auto td = table.dimensions();
  if (table.element_type() != ffi::DataType::S32 || td.size() != 2 || td[0] != qd[0] || td[1] < 1)
    return invalid("block_table must be int32 [B, max_pages] with B=" + std::to_string(qd[0]) +
                   " and max_pages >= 1, got " + shape_str(td));
  if (kd[0] < 1 || kd[1] < 1)
    return invalid("key_cache must hold at least one page of at least one row, got " + shape_str(kd));
  if (vd[0] != kd[0] || vd[1] != kd[1] || vd[2] != kd[2])
    return invalid("value_cache " + shape_str(vd) + " does not match key_cache " + shape_str(kd) +
                   " in pages, page size or heads");
  p->paged.table = static_cast<const int32_t*>(table.untyped_data());
  p->paged.table_stride = td[1];
  p->paged.page_size = kd[1];
  p->paged.num_pages = kd[0];
  *kv_rows = td[1] * kd[1];
  return ffi::Error::Success();
}

// Fills the shape, dtype, scale, mask and forward pointers of `p` from q, k, v, o, lse. With a
// block_table present (rank > 0), k and v are page pools (PagedKV) and S is the table's reach.
inline ffi::Error decode_forward(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                 const ffi::AnyBuffer& v, ffi::AnyBuffer o, ffi::AnyBuffer lse,
                                 float scale, int32_t is_causal, AttentionParams* p,
                                 const ffi::AnyBuffer* block_table = nullptr) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const bool paged = block_table != nullptr && block_table->dimensions().size() != 0;
  if (qd.size() != 4) return invalid("query must be 4-D [B, T, N, H], got " + shape_str(qd));
  if (kd.size() != 4)
    return invalid(std::string(paged ? "key_cache must be 4-D [num_pages, page_size, K, H]"
                                     : "key must be 4-D [B, S, K, H]") + ", got " + shape_str(kd));
  if (vd.size() != 4)
    return invalid(std::string(paged ? "value_cache must be 4-D [num_pages, page_size, K, Hv]"
                                     : "value must be 4-D [B, S, K, Hv]") + ", got " + shape_str(vd));
  if (auto e = to_dtype(q.element_type(), &p->dtype); e.failure()) return e;
  if (k.element_type() != q.element_type() || v.element_type() != q.element_type())
    return invalid("query, key and value must have one dtype");
  p->B = qd[0]; p->T = qd[1]; p->N = qd[2]; p->H = qd[3];
  p->S = kd[1]; p->K = kd[2]; p->Hv = vd[3];
  if (paged) {
    if (auto e = decode_paged_kv(*block_table, qd, kd, vd, p, &p->S); e.failure()) return e;
    if (kd[3] != p->H)
      return invalid("key_cache " + shape_str(kd) + " does not match query " + shape_str(qd) + " in head dim");
  } else {
    if (kd[0] != p->B || kd[3] != p->H)
      return invalid("key " + shape_str(kd) + " does not match query " + shape_str(qd) +
                     " in batch or head dim");
    if (vd[0] != p->B || vd[1] != p->S || vd[2] != p->K)
      return invalid("value " + shape_str(vd) + " does not match key " + shape_str(kd));
  }
  if (p->K < 1 || p->N % p->K != 0)
    return invalid("query heads N=" + std::to_string(p->N) +
                   " must be a multiple of key/value heads K=" + std::to_string(p->K));
  if (p->H < 1 || p->Hv < 1) return invalid("head dims must be >= 1");
  if (!std::isfinite(scale)) return invalid("scale must be finite, got " + std::to_string(scale));
  if (auto e = expect(o, "output", {p->B, p->T, p->N, p->Hv}, q.element_type()); e.failure())
    return e;
  if (auto e = expect(lse, "lse", {p->B, p->T, p->N}, ffi::DataType::F32); e.failure()) return e;

  p->scale = scale;
  p->scale_log2 = scale * 1.4426950408889634f;
  p->is_causal = is_causal != 0;
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->v = v.untyped_data();
  p->o = o.untyped_data();
  p->lse = static_cast<float*>(lse.untyped_data());
  p->q_strides = packed_strides(p->T, p->N, p->H);
  // A page pool's `batch` stride is a page's.
  const int64_t kv_rows = paged ? p->paged.page_size : p->S;
  p->k_strides = packed_strides(kv_rows, p->K, p->H);
  p->v_strides = packed_strides(kv_rows, p->K, p->Hv);
  p->o_strides = packed_strides(p->T, p->N, p->Hv);
  p->lse_strides = packed_strides(p->T, p->N, 1);
  return ffi::Error::Success();
}

// Fills `p` for the backward pass: the forward fields from q, k, v, o, lse, then dO, dLSE and the
// gradient outputs, each checked against the shape of the tensor it belongs to.
inline ffi::Error decode_backward(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                                  const ffi::AnyBuffer& v, const ffi::AnyBuffer& o,
                                  const ffi::AnyBuffer& lse, const ffi::AnyBuffer& dout,
                                  const ffi::AnyBuffer& dlse, ffi::AnyBuffer dq,
                                  ffi::AnyBuffer dk, ffi::AnyBuffer dv, float scale,
                                  int32_t is_causal, AttentionParams* p) {
  // o and lse are inputs here; decode_forward only reads their shapes and pointers.
  if (auto e = decode_forward(q, k, v, o, lse, scale, is_causal, p); e.failure()) return e;
  const auto t = q.element_type();
  if (auto e = expect(dout, "output cotangent", {p->B, p->T, p->N, p->Hv}, t); e.failure())
    return e;
  if (auto e = expect(dlse, "lse cotangent", {p->B, p->T, p->N}, ffi::DataType::F32);
      e.failure())
    return e;
  if (auto e = expect(dq, "dq", {p->B, p->T, p->N, p->H}, t); e.failure()) return e;
  if (auto e = expect(dk, "dk", {p->B, p->S, p->K, p->H}, t); e.failure()) return e;
  if (auto e = expect(dv, "dv", {p->B, p->S, p->K, p->Hv}, t); e.failure()) return e;
  p->dout = dout.untyped_data();
  p->dlse = static_cast<const float*>(dlse.untyped_data());
  p->dq = dq.untyped_data();
  p->dk = dk.untyped_data();
  p->dv = dv.untyped_data();
  p->do_strides = p->o_strides;
  p->dq_strides = p->q_strides;
  p->dk_strides = p->k_strides;
  p->dv_strides = p->v_strides;
  return ffi::Error::Success();
}

}  // namespace jfa::ffi_decode
