// DymemVariableSwapOut / DymemVariableSwapIn / DymemVariableRead / DymemVariableIsOffloaded: a resource variable's
// storage off the device between its uses, and back before them.
//
// The graph rewrite offloads optimizer state (Adam's m and v, momentum, ...): variables the step reads only after
// the gradients exist. For each such variable it inserts
//   evict:    DymemVariableSwapOut at the step's start (a no-op once the variable lives in host memory),
//   swap-in:  DymemVariableSwapIn after a trigger op in the backward pass, before every op using the variable,
//   swap-out: DymemVariableSwapOut after every op using the variable,
// so between steps, and during the forward and most of the backward pass, the variable's value is a tensor in host
// memory (dymem's host pool), and on the device only while its update runs. The value is copied byte for byte:
// training is bit-identical.
//
// It offloads weights the same way, with two stays on the device: one for the forward pass (a swap-in with
// keep_host, which keeps the host tensor as a clean copy, before the forward reads, and a swap-out with discard
// after their users, which puts the clean copy back without copying: nothing wrote the variable in between) and one
// for the backward pass and the update (DymemVariableRead gives the backward users the value again, then the update
// writes it and a swap-out copies it back).
//
// While offloaded, the variable's tensor *is* the host tensor. On the CPU device (the emulated accelerator) any
// kernel can read it, so a read between steps (a checkpoint, get_weights) sees the right value. The kernels are
// registered for the CPU device only; the planner does not offload variables of other devices.
//
// A process-wide table remembers which variables are offloaded, holding a reference to each host tensor: a swap-in
// acts only when the variable still holds exactly that tensor (a variable assigned in between already holds a new
// value, and the entry is dropped). After a keep_host swap-in the entry also holds the device tensor the variable
// was given, so that a discarding swap-out can tell the variable still holds it (the reference keeps its address
// from being reused).

#include <cstring>
#include <iterator>
#include <mutex>
#include <unordered_map>

#include "host_pool.h"
#include "mobility.h"
#include "absl/strings/str_cat.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor.h"

namespace dymem {
namespace {

using tensorflow::OpKernel;
using tensorflow::OpKernelConstruction;
using tensorflow::OpKernelContext;
using tensorflow::Tensor;
using tensorflow::Var;

REGISTER_OP("DymemVariableSwapOut")
    .Input("resource: resource")
    .Attr("discard: bool = false")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::NoOutputs);
// Moves the variable's value to host memory (no-op when it is there already or the variable is uninitialized).
// discard: when the variable still holds the device tensor a keep_host swap-in gave it, put the host copy back
// without copying (the caller guarantees nothing wrote the variable since); otherwise copy as usual.

REGISTER_OP("DymemVariableSwapIn")
    .Input("resource: resource")
    .Attr("keep_host: bool = false")
    .Attr("resident: bool = false")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::NoOutputs);
// Moves an offloaded variable's value back into device memory (no-op when it is not offloaded). keep_host: keep
// the host tensor as a clean copy for a later discarding swap-out. resident: the variable stays on the device from
// now on (GTBM's persistent group, not the mobile one, whose pageblocks it would pin between steps).

REGISTER_OP("DymemVariableRead")
    .Input("resource: resource")
    .Output("value: dtype")
    .Attr("dtype: type")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::UnknownShape);
// The variable's current value, as ReadVariableOp gives it (the variable's buffer, copy-on-write), but stateful:
// the rewrite inserts it for the backward users of a weight read again after its swap-in, and no later
// optimization may merge it with the forward pass's read.

REGISTER_OP("DymemVariableIsOffloaded")
    .Input("resource: resource")
    .Output("offloaded: bool")
    .SetIsStateful()
    .SetShapeFn(tensorflow::shape_inference::ScalarShape);
// Whether the variable's value currently lives in host memory (offloaded by DymemVariableSwapOut).

// A variable's host tensor and, after a keep_host swap-in, the device tensor that swap-in gave it.
struct OffloadEntry {
  Tensor host;
  Tensor device;       // meaningful only with `clean`
  bool clean = false;  // the host tensor is a copy of `device`, which the variable was given
};

// The offloaded variables and their host tensors. Guarded by OffloadMutex(); locked after a variable's own mutex.
std::unordered_map<const Var*, OffloadEntry>& OffloadTable() {
  static auto* table = new std::unordered_map<const Var*, OffloadEntry>();  // leaked: tensors may outlive statics
  return *table;
}

std::mutex& OffloadMutex() {
  static auto* mu = new std::mutex();
  return *mu;
}

// Whether `var` (its mutex held) holds the host tensor recorded for it.
bool IsOffloadedLocked(Var* var) {
  std::lock_guard<std::mutex> lock(OffloadMutex());
  auto it = OffloadTable().find(var);
  return it != OffloadTable().end() && it->second.host.data() == var->tensor()->data();
}

// Whether an entry's variable is gone or holds neither of its tensors (only the table references them).
bool IsStale(const OffloadEntry& entry) {
  return entry.clean ? entry.device.RefCountIsOne() : entry.host.RefCountIsOne();
}

// Records `entry` for `var` (offloaded, or clean: a copy of the device tensor `var` now holds) and drops entries
// whose variable is gone or was reassigned.
void RecordOffloaded(Var* var, OffloadEntry entry) {
  std::lock_guard<std::mutex> lock(OffloadMutex());
  auto& table = OffloadTable();
  for (auto it = table.begin(); it != table.end();) {
    it = IsStale(it->second) ? table.erase(it) : std::next(it);
  }
  table[var] = std::move(entry);
}

// Sets `*host` to the clean host copy of `var` (its mutex held) and returns true when `var` still holds the device
// tensor of a keep_host swap-in; false otherwise.
bool CleanHostCopyLocked(Var* var, Tensor* host) {
  std::lock_guard<std::mutex> lock(OffloadMutex());
  auto it = OffloadTable().find(var);
  if (it == OffloadTable().end() || !it->second.clean || it->second.device.data() != var->tensor()->data()) {
    return false;
  }
  *host = it->second.host;
  return true;
}

// Forgets `var`'s entry, if any.
void ForgetOffloaded(Var* var) {
  std::lock_guard<std::mutex> lock(OffloadMutex());
  OffloadTable().erase(var);
}

// The variable behind input 0.
absl::Status LookupVariable(OpKernelContext* ctx, tensorflow::core::RefCountPtr<Var>* var) {
  return tensorflow::LookupResource(ctx, tensorflow::HandleFromInput(ctx, 0), var);
}

// OK when the variable's dtype is plain bytes (DataTypeCanUseMemcpy), else InvalidArgument naming `op`.
absl::Status CheckVariableSwappable(const char* op, const Tensor& value) {
  if (tensorflow::DataTypeCanUseMemcpy(value.dtype())) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(op, " cannot move a variable of dtype ",
                                                 tensorflow::DataTypeString(value.dtype()),
                                                 ": only numeric and bool variables are supported"));
}

class DymemVariableSwapOutOp : public OpKernel {
 public:
  explicit DymemVariableSwapOutOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("discard", &discard_));
  }

  void Compute(OpKernelContext* ctx) override {
    tensorflow::core::RefCountPtr<Var> var;
    OP_REQUIRES_OK(ctx, LookupVariable(ctx, &var));
    tensorflow::mutex_lock ml(*var->mu());
    if (!var->is_initialized || IsOffloadedLocked(var.get())) return;
    Tensor clean;
    if (discard_ && CleanHostCopyLocked(var.get(), &clean)) {  // unchanged: the host copy is its tensor again
      *var->tensor() = clean;
      RecordOffloaded(var.get(), {clean, Tensor(), false});
      return;
    }
    const Tensor& value = *var->tensor();
    OP_REQUIRES_OK(ctx, CheckVariableSwappable("DymemVariableSwapOut", value));
    Tensor host;
    OP_REQUIRES_OK(ctx, AllocateHostPoolTensor(value.dtype(), value.shape(), &host));
    const absl::string_view src = value.tensor_data();
    std::memcpy(host.data(), src.data(), src.size());
    *var->tensor() = host;  // the device buffer is freed once no read of it is alive
    RecordOffloaded(var.get(), {host, Tensor(), false});
    HostPool::Global()->RecordSwapOut(static_cast<int64_t>(src.size()));
  }

 private:
  bool discard_ = false;
};

class DymemVariableSwapInOp : public OpKernel {
 public:
  explicit DymemVariableSwapInOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("keep_host", &keep_host_));
    OP_REQUIRES_OK(ctx, ctx->GetAttr("resident", &resident_));
    GetMobilityHooks();
  }

  void Compute(OpKernelContext* ctx) override {
    tensorflow::core::RefCountPtr<Var> var;
    OP_REQUIRES_OK(ctx, LookupVariable(ctx, &var));
    tensorflow::mutex_lock ml(*var->mu());
    if (!IsOffloadedLocked(var.get())) {
      ForgetOffloaded(var.get());
      return;
    }
    const Tensor host = *var->tensor();
    Tensor device;
    absl::Status s;
    {
      ScopedMobility group(resident_ ? kMobilityPersistent : kMobilityMobile, /*yield_to_caller=*/true);
      s = ctx->allocate_temp(host.dtype(), host.shape(), &device);
    }
    OP_REQUIRES_OK(ctx, s);  // out of memory: the variable stays offloaded, its value intact
    const absl::string_view src = host.tensor_data();
    std::memcpy(device.data(), src.data(), src.size());
    *var->tensor() = device;
    if (keep_host_) {
      RecordOffloaded(var.get(), {host, device, true});
    } else {
      ForgetOffloaded(var.get());
    }
    HostPool::Global()->RecordSwapIn(static_cast<int64_t>(src.size()));
  }

 private:
  bool keep_host_ = false;
  bool resident_ = false;
};

class DymemVariableReadOp : public OpKernel {
 public:
  explicit DymemVariableReadOp(OpKernelConstruction* ctx) : OpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("dtype", &dtype_));
  }

  void Compute(OpKernelContext* ctx) override {
    tensorflow::core::RefCountPtr<Var> var;
    OP_REQUIRES_OK(ctx, LookupVariable(ctx, &var));
    tensorflow::tf_shared_lock ml(*var->mu());
    const Tensor& value = *var->tensor();
    OP_REQUIRES(ctx, var->is_initialized && value.dtype() == dtype_,
                absl::InvalidArgumentError(absl::StrCat("DymemVariableRead: the variable is uninitialized or not of "
                                                        "dtype ", tensorflow::DataTypeString(dtype_))));
    if (!var->copy_on_read_mode.load()) {
      ctx->set_output(0, value);  // the variable's buffer, as ReadVariableOp gives it
      return;
    }
    OP_REQUIRES_OK(ctx, CheckVariableSwappable("DymemVariableRead", value));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, value.shape(), &out));
    const absl::string_view src = value.tensor_data();
    std::memcpy(out->data(), src.data(), src.size());
  }

 private:
  tensorflow::DataType dtype_;
};

class DymemVariableIsOffloadedOp : public OpKernel {
 public:
  explicit DymemVariableIsOffloadedOp(OpKernelConstruction* ctx) : OpKernel(ctx) {}

  void Compute(OpKernelContext* ctx) override {
    tensorflow::core::RefCountPtr<Var> var;
    OP_REQUIRES_OK(ctx, LookupVariable(ctx, &var));
    Tensor* out = nullptr;
    OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tensorflow::TensorShape({}), &out));
    tensorflow::mutex_lock ml(*var->mu());
    out->scalar<bool>()() = IsOffloadedLocked(var.get());
  }
};

REGISTER_KERNEL_BUILDER(Name("DymemVariableSwapOut").Device(tensorflow::DEVICE_CPU), DymemVariableSwapOutOp);
REGISTER_KERNEL_BUILDER(Name("DymemVariableSwapIn").Device(tensorflow::DEVICE_CPU), DymemVariableSwapInOp);
REGISTER_KERNEL_BUILDER(Name("DymemVariableRead").Device(tensorflow::DEVICE_CPU), DymemVariableReadOp);
REGISTER_KERNEL_BUILDER(Name("DymemVariableIsOffloaded").Device(tensorflow::DEVICE_CPU), DymemVariableIsOffloadedOp);

}  // namespace
}  // namespace dymem
