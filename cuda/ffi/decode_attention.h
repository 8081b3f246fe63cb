// Decoding a whole attention call, a struct with the members that attention_call.h lists, into
// AttentionParams: the steps both platforms' handlers share.
#pragma once

#include "ffi/decode.h"
#include "ffi/decode_mask.h"
#include "ffi/decode_packed_mask.h"
#include "jfa/params.h"

namespace jfa::ffi_decode {

// The optional operands and their attributes (JFA_MASK_OPERANDS, JFA_ATTRS) into p->mask.
template <typename Call>
ffi::Error decode_options(const Call& c, AttentionParams* p) {
  if (auto e = decode_mask(c, p); e.failure()) return e;
  return decode_packed_mask(c.mask_bits, c.mask_tiles, *p, &p->mask.packed_mask);
}

// A forward call: q, k, v, o, lse, scale, is_causal, then the optional operands.
template <typename Call>
ffi::Error decode_forward_call(Call& c, AttentionParams* p) {
  if (auto e = decode_forward(c.q, c.k, c.v, *c.o, *c.lse, c.scale, c.is_causal, p, &c.block_table); e.failure())
    return e;
  return decode_options(c, p);
}

// A backward call: the tensors, dq, dk, dv, scale, is_causal, then the optional operands; dbias
// and dslopes are left to the handler, whose kernels want them in their own shapes.
template <typename Call>
ffi::Error decode_backward_call(Call& c, AttentionParams* p) {
  if (c.block_table.dimensions().size() != 0)
    return invalid("the backward takes contiguous key and value, not a block_table (paged caches are gathered)");
  if (auto e = decode_backward(c.q, c.k, c.v, c.o, c.lse, c.dout, c.dlse, *c.dq, *c.dk, *c.dv, c.scale,
                               c.is_causal, p);
      e.failure())
    return e;
  return decode_options(c, p);
}

}  // namespace jfa::ffi_decode
