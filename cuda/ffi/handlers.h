// The FFI handler symbols this extension exports, per platform.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(JfaForwardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfaBackwardCpu);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfaPackMaskCpu);

#ifdef JFA_WITH_CUDA
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfaForwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfaBackwardCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(JfaPackMaskCuda);
#endif
