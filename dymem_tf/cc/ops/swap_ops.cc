// DymemSwapOut / DymemSwapIn: move a tensor from the device to host memory and back.
//
// The graph rewrite inserts   producer -> DymemSwapOut -> (host tensor) -> DymemSwapIn -> backward consumer.
// Both ops are stateful so that Grappler neither folds the pair away as an identity chain nor merges or prunes it.
//
// CPU device (the "small device" emulation): DymemSwapOut copies into a buffer of the host pool (host_pool.h), which
// the device allocator's budget does not see; DymemSwapIn copies back into memory from the device allocator, tagged
// MOBILE for GTBM. GPU device: asynchronous copies through the device context into TF's pinned host memory, modelled
// on tensorflow/core/grappler/optimizers/gpu_swapping_kernels.cc; the pinned copies are charged to the host pool
// (AllocateChargedTensor), so its byte limit and statistics cover them too.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "host_pool.h"
#include "mobility.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/platform/errors.h"
#include "tensorflow/core/util/work_sharder.h"

#if GOOGLE_CUDA || TENSORFLOW_USE_ROCM || DYMEM_GPU_KERNELS
#define DYMEM_WITH_GPU_KERNELS 1
#include "tensorflow/core/common_runtime/device.h"
#include "tensorflow/core/framework/device_base.h"
#endif

namespace dymem {
namespace {

using tensorflow::DataType;
using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;

// Every type whose tensors are plain bytes (DataTypeCanUseMemcpy): the numeric types and bool.
#define DYMEM_SWAP_TYPES \
  "T: {half, bfloat16, float, double, int8, int16, int32, int64, uint8, uint16, uint32, uint64, complex64, " \
  "complex128, bool}"

REGISTER_OP("DymemSwapOut")
    .Input("x: T")
    .Output("host: T")
    .Attr(DYMEM_SWAP_TYPES)
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::UnchangedShape);
// Copies `x` to host memory. `host` holds the same value; on a GPU it lives in pinned host memory, on the CPU device
// in dymem's host pool, outside the device allocator's budget.

REGISTER_OP("DymemSwapIn")
    .Input("host: T")
    .Output("y: T")
    .Attr(DYMEM_SWAP_TYPES)
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::UnchangedShape);
// Copies a swapped-out tensor back into device memory, allocated as a MOBILE tensor when GTBM is the allocator.

// ---------------------------------------------------------------------------------------------------------------
// CPU kernels.

// Copies `bytes` bytes, splitting large copies over the device's intra-op threads (one memcpy thread cannot saturate
// memory bandwidth). Small copies stay on the calling thread, where the scheduling overhead would dominate.
void CopyBytes(OpKernelContext* ctx, char* dst, const char* src, size_t bytes) {
  constexpr size_t kChunk = size_t{1} << 20;
  constexpr size_t kParallelThreshold = size_t{8} << 20;
  if (bytes == 0) return;
  const auto* threads = ctx->device()->tensorflow_cpu_worker_threads();
  if (bytes < kParallelThreshold || threads == nullptr || threads->workers == nullptr || threads->num_threads < 2) {
    std::memcpy(dst, src, bytes);
    return;
  }
  const int64_t chunks = static_cast<int64_t>((bytes + kChunk - 1) / kChunk);
  tensorflow::Shard(threads->num_threads, threads->workers, chunks, /*cost_per_unit=*/static_cast<int64_t>(kChunk),
                    [dst, src, bytes](int64_t begin, int64_t end) {
                      const size_t first = static_cast<size_t>(begin) * kChunk;
                      const size_t last = std::min(bytes, static_cast<size_t>(end) * kChunk);
                      if (first < last) std::memcpy(dst + first, src + first, last - first);
                    });
}

// OK when tensors of `dtype` can be copied as plain bytes, else InvalidArgument naming `op`.
absl::Status CheckSwappable(const char* op, DataType dtype) {
  if (!tensorflow::DataTypeCanUseMemcpy(dtype)) {
    return absl::InvalidArgumentError(absl::StrCat(op, " cannot swap tensors of dtype ",
                                                   tensorflow::DataTypeString(dtype),
                                                   ": only numeric and bool tensors are supported"));
  }
  return absl::OkStatus();
}

class DymemSwapOutCpuOp : public OpKernel {
 public:
  explicit DymemSwapOutCpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckSwappable("DymemSwapOut", x.dtype()));
    Tensor host;
    OP_REQUIRES_OK(ctx, AllocateHostPoolTensor(x.dtype(), x.shape(), &host));
    const absl::string_view src = x.tensor_data();
    CopyBytes(ctx, static_cast<char*>(host.data()), src.data(), src.size());
    HostPool::Global()->RecordSwapOut(static_cast<int64_t>(src.size()));
    ctx->set_output(0, host);
  }
};

class DymemSwapInCpuOp : public OpKernel {
 public:
  explicit DymemSwapInCpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) { GetMobilityHooks(); }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& host = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckSwappable("DymemSwapIn", host.dtype()));
    Tensor* y = nullptr;
    {
      ScopedMobility mobile(kMobilityMobile);
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, host.shape(), &y));
    }
    const absl::string_view src = host.tensor_data();
    CopyBytes(ctx, static_cast<char*>(y->data()), src.data(), src.size());
    HostPool::Global()->RecordSwapIn(static_cast<int64_t>(src.size()));
  }
};

REGISTER_KERNEL_BUILDER(Name("DymemSwapOut").Device(tensorflow::DEVICE_CPU), DymemSwapOutCpuOp);
REGISTER_KERNEL_BUILDER(Name("DymemSwapIn").Device(tensorflow::DEVICE_CPU), DymemSwapInCpuOp);

// ---------------------------------------------------------------------------------------------------------------
// GPU kernels: the copies are asynchronous DMA through the device context; no device code, so no nvcc.
#if DYMEM_WITH_GPU_KERNELS

using tensorflow::AsyncOpKernel;
using tensorflow::Device;

class DymemSwapOutGpuOp : public AsyncOpKernel {
 public:
  explicit DymemSwapOutGpuOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {}

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& x = ctx->input(0);
    OP_REQUIRES_ASYNC(ctx, !ctx->input_alloc_attr(0).on_host(),
                      absl::InternalError("DymemSwapOut: the input must reside on the device"), done);
    tensorflow::DeviceContext* device_context = ctx->op_device_context();
    OP_REQUIRES_ASYNC(ctx, device_context != nullptr,
                      absl::InternalError("DymemSwapOut: the device has no device context"), done);
    // Pinned host memory, so that the copy is a real asynchronous DMA, charged to the host pool's limit and stats.
    tensorflow::AllocatorAttributes host_attr;
    host_attr.set_on_host(true);
    host_attr.set_gpu_compatible(true);
    Tensor pinned;
    OP_REQUIRES_OK_ASYNC(ctx,
                         AllocateChargedTensor(HostPool::Global(), ctx->device()->GetAllocator(host_attr), x.dtype(),
                                               x.shape(), &pinned),
                         done);
    ctx->set_output(0, pinned);
    Tensor* host = ctx->mutable_output(0);  // owned by the context until done() runs
    const int64_t bytes = static_cast<int64_t>(x.TotalBytes());
    if (bytes == 0) {
      HostPool::Global()->RecordSwapOut(0);
      done();
      return;
    }
    device_context->CopyDeviceTensorToCPU(&x, "DymemSwapOut", static_cast<Device*>(ctx->device()), host,
                                          [ctx, done, bytes](const absl::Status& s) {
                                            if (s.ok()) HostPool::Global()->RecordSwapOut(bytes);
                                            ctx->SetStatus(s);
                                            done();
                                          });
  }
};

class DymemSwapInGpuOp : public AsyncOpKernel {
 public:
  explicit DymemSwapInGpuOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) { GetMobilityHooks(); }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& host = ctx->input(0);
    OP_REQUIRES_ASYNC(ctx, ctx->input_alloc_attr(0).on_host(),
                      absl::InternalError("DymemSwapIn: the input must reside in host memory"), done);
    tensorflow::DeviceContext* device_context = ctx->op_device_context();
    OP_REQUIRES_ASYNC(ctx, device_context != nullptr,
                      absl::InternalError("DymemSwapIn: the device has no device context"), done);
    Tensor* y = nullptr;
    {
      ScopedMobility mobile(kMobilityMobile);
      OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, host.shape(), &y), done);
    }
    const int64_t bytes = static_cast<int64_t>(host.TotalBytes());
    if (bytes == 0) {
      HostPool::Global()->RecordSwapIn(0);
      done();
      return;
    }
    device_context->CopyCPUTensorToDevice(&host, static_cast<Device*>(ctx->device()), y,
                                          [ctx, done, bytes](const absl::Status& s) {
                                            if (s.ok()) HostPool::Global()->RecordSwapIn(bytes);
                                            ctx->SetStatus(s);
                                            done();
                                          });
  }
};

REGISTER_KERNEL_BUILDER(Name("DymemSwapOut").Device(tensorflow::DEVICE_GPU).HostMemory("host"), DymemSwapOutGpuOp);
REGISTER_KERNEL_BUILDER(Name("DymemSwapIn").Device(tensorflow::DEVICE_GPU).HostMemory("host"), DymemSwapInGpuOp);

#endif  // DYMEM_WITH_GPU_KERNELS

}  // namespace
}  // namespace dymem
