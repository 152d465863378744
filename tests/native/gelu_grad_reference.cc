// A CPU stand-in for jaxdist's cuBLASLt handler (jaxdist/kernels/gelu_matmul.cc), with the same operands and
// results: d_pre = (d_out @ down.T) * gelu'(pre), float32, plus the workspace result it ignores.
// The tests build it with jaxdist's builder and register it in place of the GPU target, to run the
// real ffi_call path.
#include <cmath>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

static float GeluSlope(float x) {
  const float k = 0.7978845608028654f;
  const float t = std::tanh(k * (x + 0.044715f * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * k * (1.0f + 3.0f * 0.044715f * x * x);
}

static ffi::Error GeluGrad(ffi::Buffer<ffi::F32> d_out, ffi::Buffer<ffi::F32> down, ffi::Buffer<ffi::F32> pre,
                           ffi::ResultBuffer<ffi::F32> d_pre, ffi::ResultBuffer<ffi::U8> workspace) {
  const auto mlp = down.dimensions()[0], embed = down.dimensions()[1], rows = pre.dimensions()[0];
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t m = 0; m < mlp; ++m) {
      float sum = 0.0f;
      for (int64_t e = 0; e < embed; ++e) sum += d_out.typed_data()[r * embed + e] * down.typed_data()[m * embed + e];
      d_pre->typed_data()[r * mlp + m] = sum * GeluSlope(pre.typed_data()[r * mlp + m]);
    }
  }
  return ffi::Error::Success();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdistTestGeluGrad, GeluGrad,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::U8>>());
