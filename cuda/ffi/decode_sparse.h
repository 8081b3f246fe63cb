// Decoding the top-k sparse attention calls' buffers (jax_flashattn.sparse_attention, attn_dist)
// into SparseParams, shared by their CPU and CUDA handlers. The Python layer checks first, at trace
// time; these checks keep the C++ entry points safe on their own.
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "ffi/decode.h"
#include "jfa/sparse_params.h"
#include "xla/ffi/api/ffi.h"

namespace jfa::ffi_decode {

// The attributes every sparse call has.
struct SparseAttrs {
  float scale;
  int32_t is_causal;
  int32_t bottom_right;
};

// q, k, indices, and v (null or rank 0: V is k[..., :value_head_dim]); fills shapes, dtype and pointers.
inline ffi::Error decode_sparse_inputs(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer* v,
                                       const ffi::AnyBuffer& indices, const SparseAttrs& attrs,
                                       int64_t value_head_dim, SparseParams* p) {
  auto qd = q.dimensions(), kd = k.dimensions(), id = indices.dimensions();
  if (qd.size() != 4) return invalid("sparse attention: query must be 4-D [B, T, N, H], got " + shape_str(qd));
  if (kd.size() != 4) return invalid("sparse attention: key must be 4-D [B, S, K, H], got " + shape_str(kd));
  if (auto e = to_dtype(q.element_type(), &p->dtype); e.failure()) return e;
  if (k.element_type() != q.element_type()) return invalid("sparse attention: query and key must have one dtype");
  p->B = qd[0]; p->T = qd[1]; p->N = qd[2]; p->H = qd[3];
  p->S = kd[1]; p->K = kd[2];
  if (kd[0] != p->B || kd[3] != p->H)
    return invalid("sparse attention: key " + shape_str(kd) + " does not match query " + shape_str(qd) +
                   " in batch or head dim");
  if (p->K < 1 || p->N % p->K != 0 || p->H < 1)
    return invalid("sparse attention: query heads N=" + std::to_string(p->N) +
                   " must be a multiple of key/value heads K=" + std::to_string(p->K) + " and H >= 1");
  if (id.size() != 4 || id[0] != p->B || id[1] != p->T || id[2] != p->K || indices.element_type() != ffi::DataType::S32)
    return invalid("sparse attention: indices must be int32 [B, T, K, topk] = [" + std::to_string(p->B) + ", " +
                   std::to_string(p->T) + ", " + std::to_string(p->K) + ", topk], got " + shape_str(id));
  p->topk = id[3];
  if (v == nullptr || v->dimensions().size() == 0) {
    if (value_head_dim < 1 || value_head_dim > p->H)
      return invalid("sparse attention: value_head_dim must be in [1, H=" + std::to_string(p->H) + "], got " +
                     std::to_string(value_head_dim));
    p->Hv = value_head_dim;
    p->v = nullptr;
  } else {
    auto vd = v->dimensions();
    if (vd.size() != 4 || vd[0] != p->B || vd[1] != p->S || vd[2] != p->K || vd[3] < 1 ||
        v->element_type() != q.element_type())
      return invalid("sparse attention: value must be [B, S, K, Hv] like key " + shape_str(kd) + ", got " +
                     shape_str(vd));
    p->Hv = vd[3];
    p->v = v->untyped_data();
  }
  if (!std::isfinite(attrs.scale)) return invalid("sparse attention: scale must be finite");
  p->scale = attrs.scale;
  p->is_causal = attrs.is_causal != 0;
  p->causal_offset = attrs.bottom_right ? p->S - p->T : 0;
  p->q = q.untyped_data();
  p->k = k.untyped_data();
  p->indices = static_cast<const int32_t*>(indices.untyped_data());
  return ffi::Error::Success();
}

inline ffi::Error decode_sparse_forward(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                        const ffi::AnyBuffer& indices, ffi::AnyBuffer o, ffi::AnyBuffer lse,
                                        const SparseAttrs& attrs, int64_t value_head_dim, SparseParams* p) {
  if (auto e = decode_sparse_inputs(q, k, &v, indices, attrs, value_head_dim, p); e.failure()) return e;
  if (auto e = expect(o, "output", {p->B, p->T, p->N, p->Hv}, q.element_type()); e.failure()) return e;
  if (auto e = expect(lse, "lse", {p->B, p->T, p->N}, ffi::DataType::F32); e.failure()) return e;
  p->o = o.untyped_data();
  p->lse = static_cast<float*>(lse.untyped_data());
  return ffi::Error::Success();
}

// The forward's buffers (o and lse read), the cotangents and the gradients (dv rank 0 when v is).
inline ffi::Error decode_sparse_backward(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                         const ffi::AnyBuffer& indices, const ffi::AnyBuffer& o,
                                         const ffi::AnyBuffer& lse, const ffi::AnyBuffer& dout,
                                         const ffi::AnyBuffer& dlse, ffi::AnyBuffer dq, ffi::AnyBuffer dk,
                                         ffi::AnyBuffer dv, const SparseAttrs& attrs, int64_t value_head_dim,
                                         SparseParams* p) {
  if (auto e = decode_sparse_forward(q, k, v, indices, o, lse, attrs, value_head_dim, p); e.failure()) return e;
  const auto t = q.element_type();
  if (auto e = expect(dout, "output cotangent", {p->B, p->T, p->N, p->Hv}, t); e.failure()) return e;
  if (auto e = expect(dlse, "lse cotangent", {p->B, p->T, p->N}, ffi::DataType::F32); e.failure()) return e;
  if (auto e = expect(dq, "dq", {p->B, p->T, p->N, p->H}, t); e.failure()) return e;
  if (auto e = expect(dk, "dk", {p->B, p->S, p->K, p->H}, t); e.failure()) return e;
  if (p->v) {
    if (auto e = expect(dv, "dv", {p->B, p->S, p->K, p->Hv}, t); e.failure()) return e;
    p->dv = dv.untyped_data();
  }
  p->dout = dout.untyped_data();
  p->dlse = static_cast<const float*>(dlse.untyped_data());
  p->dq = dq.untyped_data();
  p->dk = dk.untyped_data();
  return ffi::Error::Success();
}

inline ffi::Error decode_attn_dist(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& indices,
                                   const ffi::AnyBuffer& lse, ffi::AnyBuffer dist, const SparseAttrs& attrs,
                                   int64_t head_group, SparseParams* p) {
  // attn_dist reads no value: decode as if V were k's first column.
  if (auto e = decode_sparse_inputs(q, k, nullptr, indices, attrs, 1, p); e.failure()) return e;
  if (head_group < 1 || p->N % head_group != 0)
    return invalid("attn_dist: head_group=" + std::to_string(head_group) + " must divide N=" + std::to_string(p->N));
  if (auto e = expect(lse, "lse", {p->B, p->T, p->N}, ffi::DataType::F32); e.failure()) return e;
  if (auto e = expect(dist, "attn_dist output", {p->B, p->N / head_group, p->T, p->topk}, ffi::DataType::F32);
      e.failure())
    return e;
  p->head_group = head_group;
  p->lse = static_cast<float*>(lse.untyped_data());
  p->dist = static_cast<float*>(dist.untyped_data());
  return ffi::Error::Success();
}

// The three calls from their call structs (the members sparse_call.h lists).
template <typename Call>
ffi::Error decode_sparse_forward_call(Call& c, SparseParams* p) {
  return decode_sparse_forward(c.q, c.k, c.v, c.indices, *c.o, *c.lse, {c.scale, c.is_causal, c.bottom_right},
                               c.value_head_dim, p);
}

template <typename Call>
ffi::Error decode_sparse_backward_call(Call& c, SparseParams* p) {
  return decode_sparse_backward(c.q, c.k, c.v, c.indices, c.o, c.lse, c.dout, c.dlse, *c.dq, *c.dk, *c.dv,
                                {c.scale, c.is_causal, c.bottom_right}, c.value_head_dim, p);
}

template <typename Call>
ffi::Error decode_attn_dist_call(Call& c, SparseParams* p) {
  return decode_attn_dist(c.q, c.k, c.indices, c.lse, *c.dist, {c.scale, c.is_causal, c.bottom_right},
                          c.head_group, p);
}

}  // namespace jfa::ffi_decode
