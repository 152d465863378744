// A CPU FFI handler for tests/test_gelu_matmul.py: builds and loads like jaxdist's GPU handlers.
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static ffi::Error Double(ffi::Buffer<ffi::F32> x, ffi::ResultBuffer<ffi::F32> y) {
  for (size_t i = 0; i < x.element_count(); ++i) y->typed_data()[i] = 2.0f * x.typed_data()[i];
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdistTestDouble, Double,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::F32>>());
