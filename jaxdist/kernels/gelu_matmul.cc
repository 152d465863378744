// The MLP's backward matmul with GELU's gradient in cuBLASLt's epilogue, as an XLA FFI handler.
//
//   d_pre = (d_out @ down^T) * gelu'(pre)      (row-major; gelu is the tanh approximation)
//
// d_out: (rows, embed) bf16; down: (mlp, embed) bf16, the down-projection as the model stores it;
// pre: (rows, mlp) bf16, the up-projection's output; d_pre: (rows, mlp) bf16; workspace: bytes for
// cuBLASLt. XLA computes the product and then the gradient in a second pass over memory; cuBLASLt's
// DGELU epilogue applies it as the product's tiles leave the tensor cores. Built by
// jaxdist/kernels/build.py (`jaxdist build-kernels`) and loaded by jaxdist/kernels/gelu_matmul.py.
// JAXDIST_CUBLASLT_LOG=1 prints the algorithms' timings.

#include <cublasLt.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kCandidates = 8;  // algorithms asked of cuBLASLt's heuristic, then timed
constexpr int kTimedRuns = 5;

// One handle per device, and one plan per device and shape: the heuristic query and the timing
// cost host time that a step should not pay more than once.
struct Plan {
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  std::vector<cublasLtMatmulAlgo_t> candidates;  // in the heuristic's order
  size_t chosen = 0;
  bool tuned = false;
};

struct Operands {
  const void* down;
  const void* d_out;
  void* d_pre;
  void* workspace;
  size_t workspace_bytes;
};

using PlanKey = std::tuple<int, int64_t, int64_t, int64_t, size_t>;  // device, rows, embed, mlp, workspace

std::mutex plans_mutex;
std::map<int, cublasLtHandle_t> handles;
std::map<PlanKey, Plan> plans;

ffi::Error Failed(const char* what, int status) {
  return ffi::Error(ffi::ErrorCode::kInternal, std::string(what) + " failed with cuBLAS status " + std::to_string(status));
}

#define RETURN_IF_FAILED(call)                                             \
  do {                                                                     \
    cublasStatus_t status_ = (call);                                       \
    if (status_ != CUBLAS_STATUS_SUCCESS) return Failed(#call, status_);   \
  } while (0)

template <typename T>
cublasStatus_t SetDesc(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute, T value) {
  return cublasLtMatmulDescSetAttribute(desc, attribute, &value, sizeof(value));
}

// The descriptor holds the aux pointer, which changes from call to call: one per call (host only).
// cuBLAS is column-major: the row-major (rows, mlp) result is a column-major (mlp, rows) matrix
// D = op(A) @ B with A = down seen as column-major (embed, mlp), transposed, and B = d_out seen as
// column-major (embed, rows). pre has d_pre's layout.
cublasStatus_t MakeDesc(int64_t mlp, void* pre, cublasLtMatmulDesc_t* desc) {
  cublasStatus_t status = cublasLtMatmulDescCreate(desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (status == CUBLAS_STATUS_SUCCESS) status = SetDesc(*desc, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
  if (status == CUBLAS_STATUS_SUCCESS) status = SetDesc(*desc, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
  if (status == CUBLAS_STATUS_SUCCESS) status = SetDesc(*desc, CUBLASLT_MATMUL_DESC_EPILOGUE, CUBLASLT_EPILOGUE_DGELU);
  if (status == CUBLAS_STATUS_SUCCESS) status = SetDesc(*desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, pre);
  if (status == CUBLAS_STATUS_SUCCESS) status = SetDesc(*desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, mlp);
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = SetDesc(*desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, static_cast<int32_t>(CUDA_R_16BF));
  }
  return status;
}

ffi::Error MakePlan(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, int64_t rows, int64_t embed, int64_t mlp,
                    size_t workspace, Plan* plan) {
  RETURN_IF_FAILED(cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_16BF, embed, mlp, embed));
  RETURN_IF_FAILED(cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_16BF, embed, rows, embed));
  RETURN_IF_FAILED(cublasLtMatrixLayoutCreate(&plan->d, CUDA_R_16BF, mlp, rows, mlp));
  cublasLtMatmulPreference_t preference;
  RETURN_IF_FAILED(cublasLtMatmulPreferenceCreate(&preference));
  cublasStatus_t status = cublasLtMatmulPreferenceSetAttribute(
      preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace));
  cublasLtMatmulHeuristicResult_t results[kCandidates];
  int found = 0;
  if (status == CUBLAS_STATUS_SUCCESS) {
    status = cublasLtMatmulAlgoGetHeuristic(handle, desc, plan->a, plan->b, plan->d, plan->d, preference, kCandidates,
                                            results, &found);
  }
  cublasLtMatmulPreferenceDestroy(preference);
  if (status != CUBLAS_STATUS_SUCCESS) return Failed("cublasLtMatmulAlgoGetHeuristic", status);
  for (int i = 0; i < found; ++i) {
    if (results[i].state == CUBLAS_STATUS_SUCCESS) plan->candidates.push_back(results[i].algo);
  }
  if (plan->candidates.empty()) {
    return ffi::Error(ffi::ErrorCode::kUnimplemented, "cuBLASLt has no algorithm with a DGELU epilogue for this shape");
  }
  return ffi::Error::Success();
}

cublasStatus_t Run(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const Plan& plan,
                   const cublasLtMatmulAlgo_t& algo, const Operands& operands, cudaStream_t stream) {
  const float alpha = 1.0f, beta = 0.0f;
  return cublasLtMatmul(handle, desc, &alpha, operands.down, plan.a, operands.d_out, plan.b, &beta, operands.d_pre,
                        plan.d, operands.d_pre, plan.d, &algo, operands.workspace, operands.workspace_bytes, stream);
}

// Times the candidates on the call's own operands (the heuristic's first choice is often not the
// fastest with an epilogue), once per plan. Not while the stream is being captured into a CUDA
// graph: that would record the timing runs into the graph; the heuristic's choice stands until a
// call runs outside one.
void Tune(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, Plan* plan, const Operands& operands,
          cudaStream_t stream) {
  cudaStreamCaptureStatus capture;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) return;
  plan->tuned = true;
  if (plan->candidates.size() < 2) return;
  cudaEvent_t start, stop;
  if (cudaEventCreate(&start) != cudaSuccess) return;
  if (cudaEventCreate(&stop) != cudaSuccess) {
    cudaEventDestroy(start);
    return;
  }
  const bool log = std::getenv("JAXDIST_CUBLASLT_LOG") != nullptr;
  float best = std::numeric_limits<float>::infinity();
  for (size_t i = 0; i < plan->candidates.size(); ++i) {
    const cublasLtMatmulAlgo_t& algo = plan->candidates[i];
    if (Run(handle, desc, *plan, algo, operands, stream) != CUBLAS_STATUS_SUCCESS) continue;  // warm-up
    bool ran = cudaEventRecord(start, stream) == cudaSuccess;
    for (int run = 0; ran && run < kTimedRuns; ++run) {
      ran = Run(handle, desc, *plan, algo, operands, stream) == CUBLAS_STATUS_SUCCESS;
    }
    float ms = 0;
    ran = ran && cudaEventRecord(stop, stream) == cudaSuccess && cudaEventSynchronize(stop) == cudaSuccess &&
          cudaEventElapsedTime(&ms, start, stop) == cudaSuccess;
    if (log) std::fprintf(stderr, "jaxdist gelu_grad_matmul: algorithm %zu: %.4f ms\n", i, ran ? ms / kTimedRuns : -1.0f);
    if (ran && ms < best) {
      best = ms;
      plan->chosen = i;
    }
  }
  if (log) std::fprintf(stderr, "jaxdist gelu_grad_matmul: chose algorithm %zu\n", plan->chosen);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
}

ffi::Error GeluGradMatmul(cudaStream_t stream, int32_t device, ffi::AnyBuffer d_out, ffi::AnyBuffer down,
                          ffi::AnyBuffer pre, ffi::Result<ffi::AnyBuffer> d_pre,
                          ffi::Result<ffi::AnyBuffer> workspace) {
  auto d_out_dims = d_out.dimensions();
  auto down_dims = down.dimensions();
  auto pre_dims = pre.dimensions();
  if (d_out_dims.size() != 2 || down_dims.size() != 2 || pre_dims.size() != 2) {
    return ffi::Error::InvalidArgument("gelu_grad_matmul takes 2-D operands");
  }
  const int64_t rows = d_out_dims[0], embed = d_out_dims[1], mlp = down_dims[0];
  if (down_dims[1] != embed || pre_dims[0] != rows || pre_dims[1] != mlp) {
    return ffi::Error::InvalidArgument("gelu_grad_matmul: operand shapes do not match");
  }
  for (ffi::DataType dtype : {d_out.element_type(), down.element_type(), pre.element_type(), d_pre->element_type()}) {
    if (dtype != ffi::DataType::BF16) return ffi::Error::InvalidArgument("gelu_grad_matmul takes bfloat16");
  }
  const Operands operands{down.untyped_data(), d_out.untyped_data(), d_pre->untyped_data(),
                          workspace->untyped_data(), workspace->size_bytes()};

  cublasLtMatmulDesc_t desc;
  RETURN_IF_FAILED(MakeDesc(mlp, pre.untyped_data(), &desc));
  ffi::Error error = ffi::Error::Success();
  {
    std::lock_guard<std::mutex> lock(plans_mutex);
    cublasLtHandle_t handle = nullptr;
    auto found_handle = handles.find(device);
    cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
    if (found_handle != handles.end()) {
      handle = found_handle->second;
    } else if ((status = cublasLtCreate(&handle)) == CUBLAS_STATUS_SUCCESS) {
      handles[device] = handle;
    } else {
      error = Failed("cublasLtCreate", status);
    }
    PlanKey key{device, rows, embed, mlp, operands.workspace_bytes};
    auto found_plan = plans.find(key);
    if (error.success() && found_plan == plans.end()) {
      Plan fresh;
      error = MakePlan(handle, desc, rows, embed, mlp, operands.workspace_bytes, &fresh);
      if (error.success()) found_plan = plans.emplace(key, fresh).first;
    }
    if (error.success()) {
      Plan& plan = found_plan->second;
      if (!plan.tuned) Tune(handle, desc, &plan, operands, stream);
      status = Run(handle, desc, plan, plan.candidates[plan.chosen], operands, stream);
      if (status != CUBLAS_STATUS_SUCCESS) error = Failed("cublasLtMatmul", status);
    }
  }
  cublasLtMatmulDescDestroy(desc);
  return error;
}

}  // namespace

// Not marked command-buffer compatible: inside XLA's CUDA graphs the circular pipeline schedule's
// step hung on H200s in its first step (the cause inside the graph is not known), while run as its
// own thunk the step runs, and the one-GPU and GPipe steps are as fast as with the graphs.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxdistGeluGradMatmul, GeluGradMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Arg<ffi::AnyBuffer>()  // d_out
                                  .Arg<ffi::AnyBuffer>()  // down
                                  .Arg<ffi::AnyBuffer>()  // pre
                                  .Ret<ffi::AnyBuffer>()  // d_pre
                                  .Ret<ffi::AnyBuffer>());  // workspace
