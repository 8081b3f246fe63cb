// A handler's FFI signature written once, as a list macro CALL(ARG, RET, ATTR) that names its
// operands, results and attributes in order: JFA_FFI_CALL_STRUCT turns it into the struct the
// handler takes, JFA_FFI_BIND into the Bind() chain, so the two cannot drift apart.
#pragma once

#include <utility>

#include "xla/ffi/api/ffi.h"

#define JFA_FFI_ARG_FIELD(name) ::xla::ffi::AnyBuffer name;
#define JFA_FFI_RET_FIELD(name) ::xla::ffi::Result<::xla::ffi::AnyBuffer> name;
#define JFA_FFI_ATTR_FIELD(type, name) type name;
#define JFA_FFI_BIND_ARG(name) .Arg<::xla::ffi::AnyBuffer>()
#define JFA_FFI_BIND_RET(name) .Ret<::xla::ffi::AnyBuffer>()
#define JFA_FFI_BIND_ATTR(type, name) .Attr<type>(#name)

// The members of CALL, in order, as the fields of a struct body.
#define JFA_FFI_CALL_FIELDS(CALL) CALL(JFA_FFI_ARG_FIELD, JFA_FFI_RET_FIELD, JFA_FFI_ATTR_FIELD)

// The binding steps of CALL, to append to Ffi::Bind() (after any .Ctx<>()).
#define JFA_FFI_BIND(CALL) CALL(JFA_FFI_BIND_ARG, JFA_FFI_BIND_RET, JFA_FFI_BIND_ATTR)

namespace jfa::ffi_call {

// The handler for a Bind() chain whose decoded values are the members of Call in order: it packs
// them into a Call (aggregate initialization keeps the order) and hands that to fn.
template <typename Call, typename Fn>
auto packed(Fn fn) {
  return [fn](auto... x) { return fn(Call{std::move(x)...}); };
}

}  // namespace jfa::ffi_call
