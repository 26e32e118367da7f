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
//
// DymemSwapOutPartial / DymemSwapInPartial: a partial swap, for a tensor the budget has room for part of. The
// swap-out keeps the first `keep_rows` rows on the device (a second, MOBILE output) and copies the others to host
// memory; the swap-in copies both into one new buffer. Plain-bytes types only (no variant). The GPU kernels copy the
// kept rows with the device context's same-device copy, beside the DMA of the others.
//
// TensorLists: a DT_VARIANT tensor whose elements hold TensorLists (a while loop's accumulators, what its gradient
// loop pops) swaps element by element: DymemSwapOut's output holds new TensorLists (same element_shape,
// element_dtype and max_num_elements) whose element tensors live in the host pool, DymemSwapIn's holds new ones
// whose elements are MOBILE device memory. The input's lists are only read: once its last reference goes, the
// device elements are freed. CPU device only: the GPU kernels are not registered for variant (a variant swap node
// placed on a GPU has no kernel), since TF moves a GPU TensorList's elements with VariantDeviceCopy, not with one
// DeviceContext copy of the variant tensor.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "host_pool.h"
#include "mobility.h"
#include "tensorflow/core/framework/common_shape_fns.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/framework/variant.h"
#include "tensorflow/core/kernels/tensor_list.h"
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

using tensorflow::TensorList;
using tensorflow::Variant;

// Every type whose tensors are plain bytes (DataTypeCanUseMemcpy): the numeric types and bool; and variant, for
// tensors of TensorLists (CPU device only, see the file's comment).
#define DYMEM_SWAP_TYPES \
  "T: {half, bfloat16, float, double, int8, int16, int32, int64, uint8, uint16, uint32, uint64, complex64, " \
  "complex128, bool, variant}"

// The types of DYMEM_SWAP_TYPES that the GPU kernels take: all but variant.
constexpr DataType kGpuSwapTypes[] = {
    tensorflow::DT_HALF,   tensorflow::DT_BFLOAT16, tensorflow::DT_FLOAT,  tensorflow::DT_DOUBLE,
    tensorflow::DT_INT8,   tensorflow::DT_INT16,    tensorflow::DT_INT32,  tensorflow::DT_INT64,
    tensorflow::DT_UINT8,  tensorflow::DT_UINT16,   tensorflow::DT_UINT32, tensorflow::DT_UINT64,
    tensorflow::DT_COMPLEX64, tensorflow::DT_COMPLEX128, tensorflow::DT_BOOL};

// The output is shaped like the input and, for a variant (a TensorList), keeps its element shape and dtype as the
// input's handle data, so that shape inference downstream (TensorListPopBack, TensorListStack) still sees them.
absl::Status SwapShape(tensorflow::shape_inference::InferenceContext* c) {
  c->set_output(0, c->input(0));
  const auto* handle = c->input_handle_shapes_and_types(0);
  if (handle != nullptr) c->set_output_handle_shapes_and_types(0, *handle);
  return absl::OkStatus();
}

REGISTER_OP("DymemSwapOut")
    .Input("x: T")
    .Output("host: T")
    .Attr(DYMEM_SWAP_TYPES)
    .SetIsStateful()
    .SetShapeFn(SwapShape);
// Copies `x` to host memory. `host` holds the same value; on a GPU it lives in pinned host memory, on the CPU device
// in dymem's host pool, outside the device allocator's budget.

REGISTER_OP("DymemSwapIn")
    .Input("host: T")
    .Output("y: T")
    .Attr(DYMEM_SWAP_TYPES)
    .SetIsStateful()
    .SetShapeFn(SwapShape);
// Copies a swapped-out tensor back into device memory, allocated as a MOBILE tensor when GTBM is the allocator.

// The rows of a partial swap: `keep_rows` (at most the tensor's first dimension) stay on the device, the rest move.
absl::Status PartialOutShape(tensorflow::shape_inference::InferenceContext* c) {
  tensorflow::shape_inference::ShapeHandle x;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &x));
  tensorflow::shape_inference::ShapeHandle rest;
  TF_RETURN_IF_ERROR(c->Subshape(x, 1, &rest));
  tensorflow::shape_inference::ShapeHandle host, kept;
  TF_RETURN_IF_ERROR(c->Concatenate(c->Vector(c->UnknownDim()), rest, &host));
  TF_RETURN_IF_ERROR(c->Concatenate(c->Vector(c->UnknownDim()), rest, &kept));
  c->set_output(0, host);
  c->set_output(1, kept);
  return absl::OkStatus();
}

// The whole tensor again: the kept rows, then the host's.
absl::Status PartialInShape(tensorflow::shape_inference::InferenceContext* c) {
  tensorflow::shape_inference::ShapeHandle host, kept, merged;
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(0), 1, &host));
  TF_RETURN_IF_ERROR(c->WithRankAtLeast(c->input(1), 1, &kept));
  tensorflow::shape_inference::DimensionHandle rows;
  TF_RETURN_IF_ERROR(c->Add(c->Dim(kept, 0), c->Dim(host, 0), &rows));
  TF_RETURN_IF_ERROR(c->ReplaceDim(kept, 0, rows, &merged));
  tensorflow::shape_inference::ShapeHandle rest_host, rest_kept, rest;
  TF_RETURN_IF_ERROR(c->Subshape(host, 1, &rest_host));
  TF_RETURN_IF_ERROR(c->Subshape(merged, 1, &rest_kept));
  TF_RETURN_IF_ERROR(c->Merge(rest_host, rest_kept, &rest));
  TF_RETURN_IF_ERROR(c->Concatenate(c->Vector(c->Dim(merged, 0)), rest, &merged));
  c->set_output(0, merged);
  return absl::OkStatus();
}

#define DYMEM_PARTIAL_SWAP_TYPES \
  "T: {half, bfloat16, float, double, int8, int16, int32, int64, uint8, uint16, uint32, uint64, complex64, " \
  "complex128, bool}"

REGISTER_OP("DymemSwapOutPartial")
    .Input("x: T")
    .Output("host: T")
    .Output("kept: T")
    .Attr(DYMEM_PARTIAL_SWAP_TYPES)
    .Attr("keep_rows: int >= 1")
    .SetIsStateful()
    .SetShapeFn(PartialOutShape);
// A partial swap-out: `x`'s first `keep_rows` rows (along its first dimension; all of them when it has fewer) are
// copied into `kept`, MOBILE device memory, and the other rows to host memory (`host`, as DymemSwapOut's). The
// planner keeps what the budget has room for of a tensor it must otherwise move whole.

REGISTER_OP("DymemSwapInPartial")
    .Input("host: T")
    .Input("kept: T")
    .Output("y: T")
    .Attr(DYMEM_PARTIAL_SWAP_TYPES)
    .SetIsStateful()
    .SetShapeFn(PartialInShape);
// The tensor a DymemSwapOutPartial split: `kept`'s rows, then `host`'s, in one new MOBILE device buffer.

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

// Where a TensorList swap puts the copies of its elements.
enum class Destination { kHostPool, kDevice };

absl::Status CopyTensorTo(OpKernelContext* ctx, const char* op, Destination to, const Tensor& src, Tensor* dst,
                          int64_t* bytes);

// `src`'s bytes in a new buffer at `to` (the host pool, or MOBILE memory of the device allocator), into `*dst`;
// adds the bytes copied to `*bytes`.
absl::Status CopyBytesTo(OpKernelContext* ctx, const char* op, Destination to, const Tensor& src, Tensor* dst,
                         int64_t* bytes) {
  TF_RETURN_IF_ERROR(CheckSwappable(op, src.dtype()));
  if (to == Destination::kHostPool) {
    TF_RETURN_IF_ERROR(AllocateHostPoolTensor(src.dtype(), src.shape(), dst));
  } else {
    ScopedMobility mobile(kMobilityMobile);
    TF_RETURN_IF_ERROR(ctx->allocate_temp(src.dtype(), src.shape(), dst));
  }
  const absl::string_view data = src.tensor_data();
  CopyBytes(ctx, static_cast<char*>(dst->data()), data.data(), data.size());
  *bytes += static_cast<int64_t>(data.size());
  return absl::OkStatus();
}

// A new TensorList like `src` (element shape, dtype, maximum size) whose elements are copies at `to`, into `*dst`.
// An element TensorListReserve left unset (no buffer) stays unset.
absl::Status CopyListTo(OpKernelContext* ctx, const char* op, Destination to, const TensorList& src,
                        TensorList* dst, int64_t* bytes) {
  dst->element_shape = src.element_shape;
  dst->element_dtype = src.element_dtype;
  dst->max_num_elements = src.max_num_elements;
  std::vector<Tensor>& elements = dst->tensors();
  elements.reserve(src.tensors().size());
  for (const Tensor& element : src.tensors()) {
    if (element.dtype() == tensorflow::DT_INVALID || !element.IsInitialized()) {
      elements.push_back(element);
      continue;
    }
    elements.emplace_back();
    TF_RETURN_IF_ERROR(CopyTensorTo(ctx, op, to, element, &elements.back(), bytes));
  }
  return absl::OkStatus();
}

// A variant tensor like `src` whose TensorLists are copied to `to` (CopyListTo), into `*dst`: the container too
// lives at `to`, so that nothing of a swapped-out list stays in the device's budget; InvalidArgument naming the
// type held when an element is not a TensorList.
absl::Status CopyListsTo(OpKernelContext* ctx, const char* op, Destination to, const Tensor& src, Tensor* dst,
                         int64_t* bytes) {
  if (to == Destination::kHostPool) {
    TF_RETURN_IF_ERROR(AllocateHostPoolVariantTensor(src.shape(), dst));
  } else {
    TF_RETURN_IF_ERROR(ctx->allocate_temp(tensorflow::DT_VARIANT, src.shape(), dst));
  }
  const auto in = src.flat<Variant>();
  auto out = dst->flat<Variant>();
  for (int64_t i = 0; i < in.size(); ++i) {
    const TensorList* list = in(i).get<TensorList>();
    if (list == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat(op, " swaps variant tensors of TensorLists only, not of ",
                                                     in(i).TypeName()));
    }
    TensorList copy;
    TF_RETURN_IF_ERROR(CopyListTo(ctx, op, to, *list, &copy, bytes));
    out(i) = std::move(copy);
  }
  return absl::OkStatus();
}

// `src` copied to `to` into `*dst`: its bytes, or for a variant tensor its TensorLists element by element.
absl::Status CopyTensorTo(OpKernelContext* ctx, const char* op, Destination to, const Tensor& src, Tensor* dst,
                          int64_t* bytes) {
  if (src.dtype() == tensorflow::DT_VARIANT) return CopyListsTo(ctx, op, to, src, dst, bytes);
  return CopyBytesTo(ctx, op, to, src, dst, bytes);
}

class DymemSwapOutCpuOp : public OpKernel {
 public:
  explicit DymemSwapOutCpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    if (x.dtype() == tensorflow::DT_VARIANT) {
      SwapLists(ctx, x);
      return;
    }
    OP_REQUIRES_OK(ctx, CheckSwappable("DymemSwapOut", x.dtype()));
    Tensor host;
    OP_REQUIRES_OK(ctx, AllocateHostPoolTensor(x.dtype(), x.shape(), &host));
    const absl::string_view src = x.tensor_data();
    CopyBytes(ctx, static_cast<char*>(host.data()), src.data(), src.size());
    HostPool::Global()->RecordSwapOut(static_cast<int64_t>(src.size()));
    ctx->set_output(0, host);
  }

 private:
  // `x`'s TensorLists with their elements copied into the host pool.
  static void SwapLists(OpKernelContext* ctx, const Tensor& x) {
    Tensor host;
    int64_t bytes = 0;
    OP_REQUIRES_OK(ctx, CopyListsTo(ctx, "DymemSwapOut", Destination::kHostPool, x, &host, &bytes));
    HostPool::Global()->RecordSwapOut(bytes);
    ctx->set_output(0, host);
  }
};

class DymemSwapInCpuOp : public OpKernel {
 public:
  explicit DymemSwapInCpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) { GetMobilityHooks(); }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& host = ctx->input(0);
    if (host.dtype() == tensorflow::DT_VARIANT) {
      SwapLists(ctx, host);
      return;
    }
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

 private:
  // `host`'s TensorLists with their elements copied into MOBILE device memory.
  static void SwapLists(OpKernelContext* ctx, const Tensor& host) {
    Tensor y;
    int64_t bytes = 0;
    OP_REQUIRES_OK(ctx, CopyListsTo(ctx, "DymemSwapIn", Destination::kDevice, host, &y, &bytes));
    HostPool::Global()->RecordSwapIn(bytes);
    ctx->set_output(0, y);
  }
};

// The rows of `x` a partial swap-out with `keep_rows` keeps on the device; InvalidArgument for a scalar.
absl::Status KeptRows(const Tensor& x, int64_t keep_rows, int64_t* kept) {
  if (x.dims() < 1) {
    return absl::InvalidArgumentError("DymemSwapOutPartial splits a tensor along its first dimension: got a scalar");
  }
  *kept = std::min<int64_t>(keep_rows, x.dim_size(0));
  return absl::OkStatus();
}

// `shape` with its first dimension set to `rows`.
tensorflow::TensorShape WithRows(tensorflow::TensorShape shape, int64_t rows) {
  shape.set_dim(0, rows);
  return shape;
}

// The shape DymemSwapInPartial rebuilds from `host` and `kept`; InvalidArgument where they do not match.
absl::Status WholeShape(const Tensor& host, const Tensor& kept, tensorflow::TensorShape* whole) {
  if (host.dims() < 1 || host.dims() != kept.dims() || host.dtype() != kept.dtype()) {
    return absl::InvalidArgumentError(absl::StrCat("DymemSwapInPartial: the host part ", host.shape().DebugString(),
                                                   " and the kept part ", kept.shape().DebugString(),
                                                   " are not rows of one tensor"));
  }
  for (int d = 1; d < host.dims(); ++d) {
    if (host.dim_size(d) != kept.dim_size(d)) {
      return absl::InvalidArgumentError(absl::StrCat("DymemSwapInPartial: the host part ",
                                                     host.shape().DebugString(), " and the kept part ",
                                                     kept.shape().DebugString(), " differ beyond their rows"));
    }
  }
  *whole = WithRows(kept.shape(), kept.dim_size(0) + host.dim_size(0));
  return absl::OkStatus();
}

class DymemSwapOutPartialCpuOp : public OpKernel {
 public:
  explicit DymemSwapOutPartialCpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("keep_rows", &keep_rows_));
    GetMobilityHooks();
  }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& x = ctx->input(0);
    OP_REQUIRES_OK(ctx, CheckSwappable("DymemSwapOutPartial", x.dtype()));
    int64_t rows = 0;
    OP_REQUIRES_OK(ctx, KeptRows(x, keep_rows_, &rows));
    Tensor* kept = nullptr;
    {
      ScopedMobility mobile(kMobilityMobile);
      OP_REQUIRES_OK(ctx, ctx->allocate_output(1, WithRows(x.shape(), rows), &kept));
    }
    Tensor host;
    OP_REQUIRES_OK(ctx, AllocateHostPoolTensor(x.dtype(), WithRows(x.shape(), x.dim_size(0) - rows), &host));
    const absl::string_view src = x.tensor_data();
    const size_t head = kept->tensor_data().size();
    CopyBytes(ctx, static_cast<char*>(kept->data()), src.data(), head);
    CopyBytes(ctx, static_cast<char*>(host.data()), src.data() + head, src.size() - head);
    HostPool::Global()->RecordSwapOut(static_cast<int64_t>(src.size() - head));
    ctx->set_output(0, host);
  }

 private:
  int64_t keep_rows_ = 1;
};

class DymemSwapInPartialCpuOp : public OpKernel {
 public:
  explicit DymemSwapInPartialCpuOp(OpKernelConstruction* ctx) : OpKernel(ctx) { GetMobilityHooks(); }

  void Compute(OpKernelContext* ctx) override {
    const Tensor& host = ctx->input(0);
    const Tensor& kept = ctx->input(1);
    OP_REQUIRES_OK(ctx, CheckSwappable("DymemSwapInPartial", host.dtype()));
    tensorflow::TensorShape whole;
    OP_REQUIRES_OK(ctx, WholeShape(host, kept, &whole));
    Tensor* y = nullptr;
    {
      ScopedMobility mobile(kMobilityMobile);
      OP_REQUIRES_OK(ctx, ctx->allocate_output(0, whole, &y));
    }
    const absl::string_view head = kept.tensor_data(), tail = host.tensor_data();
    CopyBytes(ctx, static_cast<char*>(y->data()), head.data(), head.size());
    CopyBytes(ctx, static_cast<char*>(y->data()) + head.size(), tail.data(), tail.size());
    HostPool::Global()->RecordSwapIn(static_cast<int64_t>(tail.size()));
  }
};

REGISTER_KERNEL_BUILDER(Name("DymemSwapOut").Device(tensorflow::DEVICE_CPU), DymemSwapOutCpuOp);
REGISTER_KERNEL_BUILDER(Name("DymemSwapIn").Device(tensorflow::DEVICE_CPU), DymemSwapInCpuOp);
REGISTER_KERNEL_BUILDER(Name("DymemSwapOutPartial").Device(tensorflow::DEVICE_CPU), DymemSwapOutPartialCpuOp);
REGISTER_KERNEL_BUILDER(Name("DymemSwapInPartial").Device(tensorflow::DEVICE_CPU), DymemSwapInPartialCpuOp);

// ---------------------------------------------------------------------------------------------------------------
// GPU kernels: the copies are asynchronous DMA through the device context; no device code, so no nvcc.
#if DYMEM_WITH_GPU_KERNELS

using tensorflow::AsyncOpKernel;
using tensorflow::Device;

// The device context that `op`'s copies go through, into `*out`; InternalError where its first input (`input`, in
// words) is not where the kernel reads it (in host memory when `on_host`, else on the device) or there is none.
absl::Status CopyContext(OpKernelContext* ctx, const char* op, const char* input, bool on_host,
                         tensorflow::DeviceContext** out) {
  if (ctx->input_alloc_attr(0).on_host() != on_host) {
    return absl::InternalError(
        absl::StrCat(op, ": ", input, " must reside ", on_host ? "in host memory" : "on the device"));
  }
  *out = ctx->op_device_context();
  if (*out == nullptr) return absl::InternalError(absl::StrCat(op, ": the device has no device context"));
  return absl::OkStatus();
}

// A tensor of `dtype` and `shape` in pinned host memory, so that a copy into it is a real asynchronous DMA, charged
// to the host pool's limit and statistics, into `*out`.
absl::Status AllocatePinned(OpKernelContext* ctx, DataType dtype, const tensorflow::TensorShape& shape, Tensor* out) {
  tensorflow::AllocatorAttributes host_attr;
  host_attr.set_on_host(true);
  host_attr.set_gpu_compatible(true);
  return AllocateChargedTensor(HostPool::Global(), ctx->device()->GetAllocator(host_attr), dtype, shape, out);
}

class DymemSwapOutGpuOp : public AsyncOpKernel {
 public:
  explicit DymemSwapOutGpuOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {}

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& x = ctx->input(0);
    tensorflow::DeviceContext* device_context = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, CopyContext(ctx, "DymemSwapOut", "the input", /*on_host=*/false, &device_context), done);
    Tensor pinned;
    OP_REQUIRES_OK_ASYNC(ctx, AllocatePinned(ctx, x.dtype(), x.shape(), &pinned), done);
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
    tensorflow::DeviceContext* device_context = nullptr;
    OP_REQUIRES_OK_ASYNC(ctx, CopyContext(ctx, "DymemSwapIn", "the input", /*on_host=*/true, &device_context), done);
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

// Calls `done` once both of a partial swap's two asynchronous copies have reported, with the first error seen.
class TwoCopies {
 public:
  TwoCopies(OpKernelContext* ctx, tensorflow::AsyncOpKernel::DoneCallback done, std::function<void()> on_ok)
      : ctx_(ctx), done_(std::move(done)), on_ok_(std::move(on_ok)) {}

  // The callback of one of the two copies; the second to run finishes the op and deletes this.
  tensorflow::StatusCallback Callback() {
    return [this](const absl::Status& s) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (!s.ok() && status_.ok()) status_ = s;
        if (++reported_ < 2) return;
      }
      if (status_.ok()) on_ok_();
      ctx_->SetStatus(status_);
      auto done = std::move(done_);
      delete this;
      done();
    };
  }

  // The views of tensors the copies read or write; kept alive until the copies are done.
  Tensor* Keep(const Tensor& t) {
    views_.push_back(std::make_unique<Tensor>(t));
    return views_.back().get();
  }

 private:
  OpKernelContext* ctx_;
  tensorflow::AsyncOpKernel::DoneCallback done_;
  std::function<void()> on_ok_;
  std::mutex mu_;
  absl::Status status_;
  int reported_ = 0;
  std::vector<std::unique_ptr<Tensor>> views_;
};

class DymemSwapOutPartialGpuOp : public AsyncOpKernel {
 public:
  explicit DymemSwapOutPartialGpuOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("keep_rows", &keep_rows_));
    GetMobilityHooks();
  }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& x = ctx->input(0);
    tensorflow::DeviceContext* device_context = nullptr;
    OP_REQUIRES_OK_ASYNC(
        ctx, CopyContext(ctx, "DymemSwapOutPartial", "the input", /*on_host=*/false, &device_context), done);
    int64_t rows = 0;
    OP_REQUIRES_OK_ASYNC(ctx, KeptRows(x, keep_rows_, &rows), done);
    Tensor* kept = nullptr;
    {
      ScopedMobility mobile(kMobilityMobile);
      OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(1, WithRows(x.shape(), rows), &kept), done);
    }
    Tensor pinned;
    OP_REQUIRES_OK_ASYNC(ctx, AllocatePinned(ctx, x.dtype(), WithRows(x.shape(), x.dim_size(0) - rows), &pinned),
                         done);
    ctx->set_output(0, pinned);
    const int64_t moved = static_cast<int64_t>(pinned.TotalBytes());
    auto* copies = new TwoCopies(ctx, std::move(done), [moved] { HostPool::Global()->RecordSwapOut(moved); });
    Device* device = static_cast<Device*>(ctx->device());
    if (kept->TotalBytes() == 0) {
      copies->Callback()(absl::OkStatus());
    } else {
      device_context->CopyTensorInSameDevice(copies->Keep(x.Slice(0, rows)), device, kept, copies->Callback());
    }
    if (moved == 0) {
      copies->Callback()(absl::OkStatus());
    } else {
      device_context->CopyDeviceTensorToCPU(copies->Keep(x.Slice(rows, x.dim_size(0))), "DymemSwapOutPartial",
                                            device, ctx->mutable_output(0), copies->Callback());
    }
  }

 private:
  int64_t keep_rows_ = 1;
};

class DymemSwapInPartialGpuOp : public AsyncOpKernel {
 public:
  explicit DymemSwapInPartialGpuOp(OpKernelConstruction* ctx) : AsyncOpKernel(ctx) { GetMobilityHooks(); }

  void ComputeAsync(OpKernelContext* ctx, DoneCallback done) override {
    const Tensor& host = ctx->input(0);
    const Tensor& kept = ctx->input(1);
    tensorflow::DeviceContext* device_context = nullptr;
    OP_REQUIRES_OK_ASYNC(
        ctx, CopyContext(ctx, "DymemSwapInPartial", "the host part", /*on_host=*/true, &device_context), done);
    tensorflow::TensorShape whole;
    OP_REQUIRES_OK_ASYNC(ctx, WholeShape(host, kept, &whole), done);
    Tensor* y = nullptr;
    {
      ScopedMobility mobile(kMobilityMobile);
      OP_REQUIRES_OK_ASYNC(ctx, ctx->allocate_output(0, whole, &y), done);
    }
    const int64_t moved = static_cast<int64_t>(host.TotalBytes());
    auto* copies = new TwoCopies(ctx, std::move(done), [moved] { HostPool::Global()->RecordSwapIn(moved); });
    Device* device = static_cast<Device*>(ctx->device());
    const int64_t rows = kept.dim_size(0);
    if (kept.TotalBytes() == 0) {
      copies->Callback()(absl::OkStatus());
    } else {
      device_context->CopyTensorInSameDevice(&kept, device, copies->Keep(y->Slice(0, rows)), copies->Callback());
    }
    if (moved == 0) {
      copies->Callback()(absl::OkStatus());
    } else {
      device_context->CopyCPUTensorToDevice(&host, device, copies->Keep(y->Slice(rows, whole.dim_size(0))),
                                            copies->Callback());
    }
  }
};

// Not for variant: see the file's comment.
REGISTER_KERNEL_BUILDER(
    Name("DymemSwapOut").Device(tensorflow::DEVICE_GPU).TypeConstraint("T", kGpuSwapTypes).HostMemory("host"),
    DymemSwapOutGpuOp);
REGISTER_KERNEL_BUILDER(Name("DymemSwapOutPartial").Device(tensorflow::DEVICE_GPU).HostMemory("host"),
                        DymemSwapOutPartialGpuOp);
REGISTER_KERNEL_BUILDER(Name("DymemSwapInPartial").Device(tensorflow::DEVICE_GPU).HostMemory("host"),
                        DymemSwapInPartialGpuOp);
REGISTER_KERNEL_BUILDER(
    Name("DymemSwapIn").Device(tensorflow::DEVICE_GPU).TypeConstraint("T", kGpuSwapTypes).HostMemory("host"),
    DymemSwapInGpuOp);

#endif  // DYMEM_WITH_GPU_KERNELS

}  // namespace
}  // namespace dymem
