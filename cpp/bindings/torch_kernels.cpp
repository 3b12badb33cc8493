// The torch.ops.simdnorm forward ops' AutogradCPU kernels, in C++: a small call through a Python
// kernel costs several times torch's own op (the dispatcher's trip into Python, the Python frames),
// so plain calls of the common forms (batch norm with given statistics, layer, RMS, instance and
// group norm, no activation) run here, straight from the dispatcher into the engine.
//
// simdnorm builds without PyTorch, so nothing here includes torch's headers: the functions of
// torch's stable C ABI (torch/csrc/inductor/aoti_torch/c/shim.h, torch/csrc/stable/c/shim.h) are
// declared by hand and found with dlsym in the libtorch_cpu.so the process has loaded, as are a
// few C++ functions no stable function replaces (the tests a call needs to skip autograd and the
// Python dispatch: modes, forward AD, functorch, requires_grad, a subclass's __torch_dispatch__,
// the negative bit). Any of them missing, no kernel is
// registered and every call keeps the Python kernels.
//
// A kernel computes a call itself when nothing else may need to see it: no dispatch mode, Python
// dispatcher, forward-AD level or functorch transform active; every tensor a plain strided CPU
// tensor of simdnorm's dtypes with memory, not of a __torch_dispatch__ subclass, without the
// negative bit and, with grad mode on, not requiring grad; the call's shapes, dtypes and attributes planned before (by the Python route,
// which validated them: torch_plan_put); the input dense (its output takes its strides, as
// torch.empty_like). Anything else goes to the op's twin `_<op>_general` (the Python Autograd
// kernel, which records autograd and redispatches the op below it), with the stack as it came.
// A Python exception raised there reaches the caller as itself (stash_error).
#include "bindings/torch_kernels.h"

#include <dlfcn.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <typeinfo>
#include <unordered_map>
#include <utility>
#include <vector>

#include "bindings/common.h"
#include "runtime/huge_blocks.h"
#include "simdnorm/ops.h"

namespace py = pybind11;

namespace simdnorm {
namespace {

// ---- torch's ABI, as its headers declare it (torch 2.10 and later)
using TorchError = int32_t;               // 0: success
using TensorHandle = void*;               // at::Tensor*: owned where a kernel receives it
using StableIValue = uint64_t;            // a stack slot: a handle, a number, or a pointer to a slot
using LibraryHandle = void*;
using BoxedKernel = void (*)(StableIValue* stack, uint64_t num_args, uint64_t num_outputs);
struct ForwardLevel;                      // torch::autograd::ForwardADLevel

// The extension ABI version the kernels are written to (TORCH_ABI_VERSION of 2.10.0).
constexpr uint64_t kExtensionVersion = (uint64_t{2} << 56) | (uint64_t{10} << 48);

struct Torch {
  int32_t f32 = -1, f16 = -1, bf16 = -1, f64 = -1, cpu = -1, strided = -1;
  bool (*grad_mode_is_enabled)() = nullptr;
  TorchError (*delete_tensor)(TensorHandle) = nullptr;
  TorchError (*data_ptr)(TensorHandle, void**) = nullptr;
  TorchError (*dim)(TensorHandle, int64_t*) = nullptr;
  TorchError (*sizes)(TensorHandle, int64_t**) = nullptr;
  TorchError (*strides)(TensorHandle, int64_t**) = nullptr;
  TorchError (*dtype)(TensorHandle, int32_t*) = nullptr;
  TorchError (*device_type)(TensorHandle, int32_t*) = nullptr;
  TorchError (*layout)(TensorHandle, int32_t*) = nullptr;
  TorchError (*empty_strided)(int64_t, const int64_t*, const int64_t*, int32_t, int32_t, int32_t,
                              TensorHandle*) = nullptr;
  TorchError (*library_init_impl)(const char*, const char*, const char*, uint32_t, LibraryHandle*) = nullptr;
  TorchError (*library_impl)(LibraryHandle, const char*, BoxedKernel, uint64_t) = nullptr;
  TorchError (*call_dispatcher)(const char*, const char*, StableIValue*, uint64_t) = nullptr;
  TorchError (*delete_stable_ivalue)(StableIValue*) = nullptr;  // (2.13; before: delete)
  const char* (*exception_what)() = nullptr;                    // (2.13)
  TorchError (*from_blob)(void*, int64_t, const int64_t*, const int64_t*, int64_t, int32_t, int32_t, int32_t,
                          TensorHandle*, int32_t, const uint8_t*, int64_t, void (*)(void*, void*),
                          void*) = nullptr;                     // (2.11: torch_from_blob, with a deleter)
  // torch's C++: what no stable function tells
  int64_t (*dispatch_modes)() = nullptr;             // c10::impl::TorchDispatchModeTLS::stack_len()
  const void* (*python_dispatcher)() = nullptr;      // c10::impl::PythonDispatcherTLS::get_state()
  bool (*requires_grad)(const void* impl) = nullptr;  // c10::TensorImpl::requires_grad() const
  bool (*is_neg)(TensorHandle) = nullptr;            // at::_ops::is_neg::call
  bool (*has_dispatch)(TensorHandle) = nullptr;      // at::impl::tensor_has_dispatch (a Python subclass's)
  std::shared_ptr<ForwardLevel> (*forward_level)(uint64_t) = nullptr;  // ForwardADLevel::try_get_by_idx
  const void* const* (*functorch_layers)() = nullptr;  // at::functorch::getDynamicLayerStack(): a vector
};
Torch g_torch;
bool g_attached = false;

template <class F>
bool find(void* lib, F& f, const char* name, std::string& missing) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  if (f == nullptr) missing += std::string(missing.empty() ? "" : ", ") + name;
  return f != nullptr;
}

// Resolves the ABI in the loaded library (and the libraries it loaded); "" or what is missing.
std::string attach(const std::string& libtorch_cpu) {
  if (g_attached) return "";
  void* lib = dlopen(libtorch_cpu.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) return "not loaded: " + libtorch_cpu;
  Torch t;
  std::string missing;
  int32_t (*code[6])() = {};
  const char* const code_names[6] = {"aoti_torch_dtype_float32", "aoti_torch_dtype_float16",
                                     "aoti_torch_dtype_bfloat16", "aoti_torch_dtype_float64",
                                     "aoti_torch_device_type_cpu", "aoti_torch_layout_strided"};
  for (int i = 0; i < 6; ++i) find(lib, code[i], code_names[i], missing);
  find(lib, t.grad_mode_is_enabled, "aoti_torch_grad_mode_is_enabled", missing);
  find(lib, t.delete_tensor, "aoti_torch_delete_tensor_object", missing);
  find(lib, t.data_ptr, "aoti_torch_get_data_ptr", missing);
  find(lib, t.dim, "aoti_torch_get_dim", missing);
  find(lib, t.sizes, "aoti_torch_get_sizes", missing);
  find(lib, t.strides, "aoti_torch_get_strides", missing);
  find(lib, t.dtype, "aoti_torch_get_dtype", missing);
  find(lib, t.device_type, "aoti_torch_get_device_type", missing);
  find(lib, t.layout, "aoti_torch_get_layout", missing);
  find(lib, t.empty_strided, "aoti_torch_empty_strided", missing);
  find(lib, t.library_init_impl, "aoti_torch_library_init_impl", missing);
  find(lib, t.library_impl, "torch_library_impl", missing);
  find(lib, t.call_dispatcher, "torch_call_dispatcher", missing);
  find(lib, t.dispatch_modes, "_ZN3c104impl20TorchDispatchModeTLS9stack_lenEv", missing);
  find(lib, t.python_dispatcher, "_ZN3c104impl19PythonDispatcherTLS9get_stateEv", missing);
  find(lib, t.requires_grad, "_ZNK3c1010TensorImpl13requires_gradEv", missing);
  find(lib, t.is_neg, "_ZN2at4_ops6is_neg4callERKNS_6TensorE", missing);
  find(lib, t.has_dispatch, "_ZN2at4impl19tensor_has_dispatchERKNS_6TensorE", missing);
  find(lib, t.forward_level, "_ZN5torch8autograd14ForwardADLevel14try_get_by_idxEm", missing);
  find(lib, t.functorch_layers, "_ZN2at9functorch20getDynamicLayerStackEv", missing);
  std::string optional;
  find(lib, t.delete_stable_ivalue, "torch_delete_stable_ivalue", optional);
  find(lib, t.exception_what, "torch_exception_get_what_without_backtrace", optional);
  find(lib, t.from_blob, "torch_from_blob", optional);
  if (!missing.empty()) return "missing: " + missing;
  t.f32 = code[0](), t.f16 = code[1](), t.bf16 = code[2](), t.f64 = code[3](), t.cpu = code[4](),
  t.strided = code[5]();
  g_torch = t;
  g_attached = true;
  return "";
}

template <class T>
T slot_as(StableIValue v) {
  T t;
  std::memcpy(&t, &v, sizeof(T));
  return t;
}
template <class T>
StableIValue as_slot(T t) {
  StableIValue v = 0;
  std::memcpy(&v, &t, sizeof(T));
  return v;
}

// An owned tensor handle, deleted with its owner.
struct OwnedTensor {
  TensorHandle h = nullptr;
  OwnedTensor() = default;
  OwnedTensor(const OwnedTensor&) = delete;
  OwnedTensor& operator=(const OwnedTensor&) = delete;
  ~OwnedTensor() {
    if (h != nullptr) g_torch.delete_tensor(h);
  }
  TensorHandle release() { return std::exchange(h, nullptr); }
};

// ---- the ops: where each argument sits on the stack (the schemas of simdnorm/torch/_ops.py)

enum class Kind { batch_norm, layer, rms, instance, group };
enum TensorSlot { kInput, kMean, kVariance, kScale, kBias, kTensorSlots };

struct OpLayout {
  const char* name;
  Kind kind;
  int args, outputs;
  int tensor[kTensorSlots];  // stack index, -1: the op has none (mean, variance: batch norm's, required)
  int ints[2];               // axis / channel_axis / num_groups
  int epsilon, activation, activation_params;
};

constexpr OpLayout kOps[] = {
    {"batch_normalization", Kind::batch_norm, 9, 1, {0, 1, 2, 3, 4}, {8, -1}, 5, 6, 7},
    {"layer_norm", Kind::layer, 7, 3, {0, -1, -1, 1, 2}, {3, -1}, 4, 5, 6},
    {"rms_norm", Kind::rms, 6, 2, {0, -1, -1, 1, -1}, {2, -1}, 3, 4, 5},
    {"instance_norm", Kind::instance, 7, 3, {0, -1, -1, 1, 2}, {4, -1}, 3, 5, 6},
    {"group_norm", Kind::group, 8, 3, {0, -1, -1, 2, 3}, {1, 5}, 4, 6, 7},
};
constexpr int kOpCount = sizeof(kOps) / sizeof(kOps[0]);
std::string g_fallback[kOpCount];  // each op's twin with the Python Autograd kernel

// ---- plans: what the Python route computed for a call's shapes, dtypes and attributes

struct Plan {
  double epsilon = 0;
  int channel_axis = -1;
  // MVN kinds
  uint32_t reduced = 0;
  bool normalize_mean = true, normalize_variance = true, epsilon_outside = false;
  int64_t groups = 0;  // 0: no split
  int stats_ndim = 0;
  int64_t stats_sizes[kMaxViewDims] = {};
  DType stats_dtype = DType::f32;
};

// A call's key: the op, each tensor's presence, dtype and shape, the int attributes and epsilon's
// bits, as 64-bit words (in place: a call's lookup allocates nothing).
struct PlanKey {
  static constexpr int kMaxWords = 4 + kTensorSlots * (1 + kMaxViewDims);
  int64_t words[kMaxWords];
  int n = 0;
  void add(int64_t v) { words[n++] = v; }
  std::string_view bytes() const { return {reinterpret_cast<const char*>(words), n * sizeof(int64_t)}; }
  bool operator==(const PlanKey& o) const { return bytes() == o.bytes(); }
};
struct PlanKeyHash {
  size_t operator()(const PlanKey& k) const { return std::hash<std::string_view>()(k.bytes()); }
};

std::shared_mutex g_plans_mutex;
// (Bounded by the Python route's cache, which clears both together: a plan it still holds is never
// put again, so this map must not drop one on its own.)
std::unordered_map<PlanKey, Plan, PlanKeyHash> g_plans;

PlanKey key_of(int op, const TensorView* const* tensors, const int64_t* ints, double epsilon) {
  PlanKey k;
  k.add(op);
  for (int s = 0; s < kTensorSlots; ++s) {
    const TensorView* v = tensors[s];
    if (v == nullptr) {
      k.add(-1);
      continue;
    }
    k.add(static_cast<int64_t>(v->dtype) << 8 | v->ndim);
    for (int d = 0; d < v->ndim; ++d) k.add(v->sizes[d]);
  }
  k.add(ints[0]);
  k.add(ints[1]);
  int64_t bits;
  std::memcpy(&bits, &epsilon, sizeof bits);
  k.add(bits);
  return k;
}

// ---- a call's tensors

// The view of a plain strided CPU tensor of simdnorm's dtypes with memory; false for anything else.
bool plain_view(TensorHandle h, bool grad, TensorView& v) {
  const Torch& t = g_torch;
  int32_t dtype, device, layout;
  int64_t ndim, *sizes, *strides;
  void* data = nullptr;
  if (t.dtype(h, &dtype) != 0 || t.device_type(h, &device) != 0 || device != t.cpu || t.layout(h, &layout) != 0 ||
      layout != t.strided || t.dim(h, &ndim) != 0 || ndim < 1 || ndim > kMaxViewDims)
    return false;
  if (dtype == t.f32) v.dtype = DType::f32;
  else if (dtype == t.f16) v.dtype = DType::f16;
  else if (dtype == t.bf16) v.dtype = DType::bf16;
  else if (dtype == t.f64) v.dtype = DType::f64;
  else return false;
  // (an at::Tensor is one pointer, to its TensorImpl)
  if ((grad && t.requires_grad(*static_cast<void* const*>(h))) || t.has_dispatch(h) || t.is_neg(h)) return false;
  if (t.sizes(h, &sizes) != 0 || t.strides(h, &strides) != 0 || t.data_ptr(h, &data) != 0 || data == nullptr)
    return false;
  const int64_t item = itemsize(v.dtype);
  v.ndim = static_cast<int>(ndim);
  v.data = static_cast<char*>(data);
  for (int d = 0; d < kMaxViewDims; ++d) {
    if (d < v.ndim && sizes[d] == 0) return false;  // (empty: the Python kernel's)
    v.sizes[d] = d < v.ndim ? sizes[d] : 0;
    v.strides[d] = d < v.ndim ? strides[d] * item : 0;
  }
  return true;
}

// Whether the (byte) strides lay the elements out densely, without overlap, in some order
// of the dims: torch.empty_like then gives its result the same strides.
bool dense(const TensorView& v) {
  const int64_t item = itemsize(v.dtype);
  uint32_t placed = 0;
  int64_t expected = 1;
  for (int n = 0; n < v.ndim; ++n) {
    int next = -1;
    for (int d = 0; d < v.ndim; ++d)
      if (!(placed >> d & 1u) && v.sizes[d] != 1 && (next < 0 || v.strides[d] < v.strides[next])) next = d;
    if (next < 0) return true;
    if (v.strides[next] != expected * item) return false;
    placed |= 1u << next;
    expected *= v.sizes[next];
  }
  return true;
}

int32_t torch_dtype(DType d) {
  switch (d) {
    case DType::f32: return g_torch.f32;
    case DType::f16: return g_torch.f16;
    case DType::bf16: return g_torch.bf16;
    default: return g_torch.f64;
  }
}

void give_block_back(void* block, void* bytes) { give_huge_block(block, reinterpret_cast<size_t>(bytes)); }

// A large dense output on a kept block of 2 MB pages (runtime/huge_blocks.h), as simdnorm.torch's
// routes give theirs; false where torch has no torch_from_blob or no block can be mapped.
bool new_tensor_on_block(OwnedTensor& owner, DType dtype, int ndim, const int64_t* sizes, const int64_t* strides,
                         int64_t count) {
  if (g_torch.from_blob == nullptr || count < kHugeBlockMinElements) return false;
  int64_t span = 1;
  for (int d = 0; d < ndim; ++d) span += (sizes[d] - 1) * strides[d];
  if (span != count) return false;  // (not dense: torch's allocator)
  const size_t bytes = static_cast<size_t>(count) * static_cast<size_t>(itemsize(dtype));
  void* block = take_huge_block(bytes);
  if (block == nullptr) return false;
  // (device index -1: the data's device is "cpu", which torch tells apart from "cpu:0")
  if (g_torch.from_blob(block, ndim, sizes, strides, 0, torch_dtype(dtype), g_torch.cpu, -1, &owner.h, g_torch.strided,
                        nullptr, 0, give_block_back, reinterpret_cast<void*>(bytes)) != 0) {
    owner.h = nullptr;
    give_huge_block(block, bytes);
    return false;
  }
  return true;
}

// A new tensor: the given strides (in bytes, as a view's: dense), or contiguous ones when none.
TensorView new_tensor(OwnedTensor& owner, DType dtype, int ndim, const int64_t* sizes, const int64_t* byte_strides) {
  const int64_t item = itemsize(dtype);
  int64_t strides[kMaxViewDims];
  int64_t step = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    strides[d] = byte_strides != nullptr ? byte_strides[d] / item : step;
    step *= sizes[d];
  }
  if (!new_tensor_on_block(owner, dtype, ndim, sizes, strides, step) &&
      g_torch.empty_strided(ndim, sizes, strides, torch_dtype(dtype), g_torch.cpu, 0, &owner.h) != 0)
    throw std::runtime_error(std::string("simdnorm: allocating a tensor failed: ") +
                             (g_torch.exception_what != nullptr ? g_torch.exception_what() : ""));
  void* data = nullptr;
  g_torch.data_ptr(owner.h, &data);
  TensorView v;
  v.dtype = dtype;
  v.ndim = ndim;
  v.data = static_cast<char*>(data);
  for (int d = 0; d < kMaxViewDims; ++d) {
    v.sizes[d] = d < ndim ? sizes[d] : 0;
    v.strides[d] = d < ndim ? strides[d] * item : 0;
  }
  return v;
}

// The tests' witnesses: the calls computed here; the data pointers of this thread's last one
// (its tensors', then its output's).
std::atomic<int64_t> g_computed{0};
thread_local std::vector<uintptr_t> t_last_pointers;

bool no_one_else_looks() {
  const Torch& t = g_torch;
  if (t.dispatch_modes() != 0 || t.python_dispatcher() != nullptr || t.forward_level(0) != nullptr) return false;
  const void* const* layers = t.functorch_layers();  // (a std::vector: begin, end)
  return layers[0] == layers[1];
}

// The call computed here, its outputs on the stack and its arguments released; false, the stack
// untouched, where it is not this kernel's to compute. An exception (an allocation that failed)
// also leaves the stack untouched: nothing is released before the last step, which cannot throw.
bool compute(int op, StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  const OpLayout& l = kOps[op];
  if (num_args != static_cast<uint64_t>(l.args) || num_outputs != static_cast<uint64_t>(l.outputs) ||
      stack[l.activation] != 0 || stack[l.activation_params] != 0 || !no_one_else_looks())
    return false;
  const bool grad = g_torch.grad_mode_is_enabled();
  TensorView views[kTensorSlots];
  const TensorView* given[kTensorSlots] = {};
  StableIValue* cells[kTensorSlots] = {};
  for (int s = 0; s < kTensorSlots; ++s) {
    if (l.tensor[s] < 0) continue;
    TensorHandle h;
    if (s == kScale || s == kBias) {  // Tensor?: 0, or a slot holding the tensor
      cells[s] = slot_as<StableIValue*>(stack[l.tensor[s]]);
      if (cells[s] == nullptr) continue;
      h = slot_as<TensorHandle>(*cells[s]);
    } else {
      h = slot_as<TensorHandle>(stack[l.tensor[s]]);
    }
    if (!plain_view(h, grad, views[s])) return false;
    given[s] = &views[s];
  }
  const int64_t ints[2] = {l.ints[0] < 0 ? 0 : slot_as<int64_t>(stack[l.ints[0]]),
                           l.ints[1] < 0 ? 0 : slot_as<int64_t>(stack[l.ints[1]])};
  const double epsilon = slot_as<double>(stack[l.epsilon]);
  Plan plan;
  {
    std::shared_lock<std::shared_mutex> lock(g_plans_mutex);
    const auto it = g_plans.find(key_of(op, given, ints, epsilon));
    if (it == g_plans.end()) return false;
    plan = it->second;
  }
  const TensorView& x = views[kInput];
  if (!dense(x)) return false;

  OwnedTensor out[3];
  const TensorView y = new_tensor(out[0], x.dtype, x.ndim, x.sizes, x.strides);
  const auto param = [&](int s) -> std::optional<TensorView> {
    if (given[s] == nullptr) return std::nullopt;
    return aligned_param(views[s], x, plan.channel_axis, "parameter");
  };
  if (l.kind == Kind::batch_norm) {
    BatchNormArgs a;
    a.input = x;
    a.output = y;
    a.mean = *param(kMean);
    a.variance = *param(kVariance);
    a.scale = param(kScale);
    a.bias = param(kBias);
    a.epsilon = plan.epsilon;
    run_without_gil(element_count(x), [&] { batch_norm(a); });
  } else {
    MvnArgs a;
    a.input = x;
    a.output = y;
    a.scale = param(kScale);
    a.bias = param(kBias);
    if (plan.groups > 0) {
      a.input = split_dim(a.input, plan.channel_axis, plan.groups);
      a.output = split_dim(a.output, plan.channel_axis, plan.groups);
      for (auto* p : {&a.scale, &a.bias})
        if (*p) **p = split_dim(**p, plan.channel_axis, plan.groups);
    }
    a.reduced = plan.reduced;
    a.epsilon = plan.epsilon;
    a.normalize_mean = plan.normalize_mean;
    a.normalize_variance = plan.normalize_variance;
    a.epsilon_outside = plan.epsilon_outside;
    // the statistics: (mean, inv_std), or RMS norm's inv_rms alone
    const bool mean_out = l.kind != Kind::rms;
    if (mean_out)
      a.mean_out = kept_view(new_tensor(out[1], plan.stats_dtype, plan.stats_ndim, plan.stats_sizes, nullptr),
                             a.input, a.reduced, "mean");
    a.inv_std_out = kept_view(new_tensor(out[mean_out ? 2 : 1], plan.stats_dtype, plan.stats_ndim,
                                         plan.stats_sizes, nullptr),
                              a.input, a.reduced, "inv_std");
    run_without_gil(element_count(x), [&] { mean_variance_normalization(a); });
  }
  // (the tests' witnesses first: nothing from here on may throw, the arguments once released)
  t_last_pointers.clear();
  for (int s = 0; s < kTensorSlots; ++s)
    if (given[s] != nullptr) t_last_pointers.push_back(reinterpret_cast<uintptr_t>(views[s].data));
  t_last_pointers.push_back(reinterpret_cast<uintptr_t>(y.data));
  // done: the arguments released (the kernel owns them), the outputs handed over
  for (int s = 0; s < kTensorSlots; ++s) {
    if (l.tensor[s] < 0) continue;
    if (s == kScale || s == kBias) {
      if (cells[s] == nullptr) continue;
      g_torch.delete_tensor(slot_as<TensorHandle>(*cells[s]));
      if (g_torch.delete_stable_ivalue != nullptr) g_torch.delete_stable_ivalue(cells[s]);
      else delete cells[s];
    } else {
      g_torch.delete_tensor(slot_as<TensorHandle>(stack[l.tensor[s]]));
    }
  }
  for (int i = 0; i < l.outputs; ++i) stack[i] = as_slot(out[i].release());
  g_computed.fetch_add(1, std::memory_order_relaxed);
  return true;
}

// The Python exception the twin's kernel raised on this thread (a new reference), handed back to
// the caller as itself: torch's C ABI carries only a message.
thread_local PyObject* t_stashed_error = nullptr;

}  // namespace
}  // namespace simdnorm

// What torch throws where a Python error is pending (torch/csrc/Exceptions.h: its members, in its
// order; all of it inline there, so torch's handlers find this one by its name, restore() the
// error and destroy it with this destructor): the twin's exception reaches the caller unchanged.
struct python_error : public std::exception {
  python_error() = default;
  python_error(const python_error& other)
      : type(other.type), value(other.value), traceback(other.traceback), message(other.message) {
    py::gil_scoped_acquire gil;
    Py_XINCREF(type);
    Py_XINCREF(value);
    Py_XINCREF(traceback);
  }
  python_error& operator=(const python_error&) = delete;
  ~python_error() override {
    if (type || value || traceback) {
      py::gil_scoped_acquire gil;
      Py_XDECREF(type);
      Py_XDECREF(value);
      Py_XDECREF(traceback);
    }
  }
  const char* what() const noexcept override { return message.c_str(); }
  PyObject* type{nullptr};
  PyObject* value{nullptr};
  PyObject* traceback{nullptr};
  std::string message;
};

namespace simdnorm {
namespace {

[[noreturn]] void raise_fallback_error(int op) {
  PyObject* stashed = std::exchange(t_stashed_error, nullptr);
  if (stashed != nullptr) {
    python_error e;
    py::gil_scoped_acquire gil;
    e.type = reinterpret_cast<PyObject*>(Py_TYPE(stashed));
    Py_INCREF(e.type);
    e.value = stashed;  // (the stash's reference)
    e.traceback = PyException_GetTraceback(stashed);
    PyObject* text = PyObject_Str(stashed);
    const char* utf8 = text != nullptr ? PyUnicode_AsUTF8(text) : nullptr;
    e.message = utf8 != nullptr ? utf8 : "python_error";
    Py_XDECREF(text);
    PyErr_Clear();
    throw e;
  }
  throw std::runtime_error(std::string("simdnorm::") + kOps[op].name + ": " +
                           (g_torch.exception_what != nullptr ? g_torch.exception_what() : "the call failed"));
}

template <int Op>
void autograd_kernel(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  // An exception must not leave here with the stack still holding the arguments (torch's boxed
  // wrapper would leak every handle on it): a call this kernel could not finish goes to the twin,
  // which computes it or raises the Python kernel's own error.
  try {
    if (compute(Op, stack, num_args, num_outputs)) return;
  } catch (const std::exception&) {
  }
  if (t_stashed_error != nullptr) {  // (left from a failure nobody read)
    py::gil_scoped_acquire gil;
    Py_CLEAR(t_stashed_error);
  }
  if (g_torch.call_dispatcher(g_fallback[Op].c_str(), "", stack, kExtensionVersion) != 0) raise_fallback_error(Op);
}

template <int... I>
constexpr BoxedKernel kernel_of(int op, std::integer_sequence<int, I...>) {
  BoxedKernel k = nullptr;
  ((k = op == I ? &autograd_kernel<I> : k), ...);
  return k;
}

int op_index(const std::string& name) {
  for (int i = 0; i < kOpCount; ++i)
    if (name == kOps[i].name) return i;
  throw std::invalid_argument("no C++ kernel for simdnorm::" + name);
}

LibraryHandle g_library = nullptr;  // kept: deleting it would deregister the kernels

void register_kernel(const std::string& name, const std::string& fallback) {
  if (!g_attached) throw std::runtime_error("torch_attach() first");
  const int op = op_index(name);
  if (g_library == nullptr &&
      g_torch.library_init_impl("simdnorm", "AutogradCPU", __FILE__, __LINE__, &g_library) != 0)
    throw std::runtime_error(std::string("torch.library init for simdnorm AutogradCPU failed: ") +
                             (g_torch.exception_what != nullptr ? g_torch.exception_what() : ""));
  g_fallback[op] = "simdnorm::" + fallback;
  const BoxedKernel k = kernel_of(op, std::make_integer_sequence<int, kOpCount>());
  if (g_torch.library_impl(g_library, name.c_str(), k, kExtensionVersion) != 0)
    throw std::runtime_error("registering simdnorm::" + name + " for AutogradCPU failed: " +
                             (g_torch.exception_what != nullptr ? g_torch.exception_what() : ""));
}

// The view (dtype and shape only) of a torch tensor passed from Python, for the key.
DType dtype_named(const std::string& name) {
  if (name == "torch.float32") return DType::f32;
  if (name == "torch.float16") return DType::f16;
  if (name == "torch.bfloat16") return DType::bf16;
  if (name == "torch.float64") return DType::f64;
  throw std::invalid_argument("dtype " + name + " has no plan");
}

bool shape_of(py::handle t, TensorView& v) {
  if (t.is_none()) return false;
  const py::tuple shape(t.attr("shape"));
  v.dtype = dtype_named(py::str(t.attr("dtype")));
  v.ndim = static_cast<int>(shape.size());
  if (v.ndim < 1 || v.ndim > kMaxViewDims) throw std::invalid_argument("a plan's tensor has 1 to 8 dims");
  for (int d = 0; d < v.ndim; ++d) v.sizes[d] = shape[d].cast<int64_t>();
  return true;
}

// plan_put(op, (input, mean, variance, scale, bias), (int, int), epsilon, plan): the Python route's
// plan for calls like this one (the tensors' dtypes and shapes; None where absent). plan: batch
// norm's (epsilon, channel_axis); the MVN kinds' (axes, epsilon, normalize_mean,
// normalize_variance, epsilon_outside, channel_axis, groups or None, stats_shape, stats_dtype).
void plan_put(const std::string& name, const py::tuple& tensors, const py::tuple& ints, double epsilon,
              const py::tuple& p) {
  const int op = op_index(name);
  TensorView views[kTensorSlots];
  const TensorView* given[kTensorSlots] = {};
  for (int s = 0; s < kTensorSlots; ++s)
    if (shape_of(tensors[s], views[s])) given[s] = &views[s];
  const int64_t key_ints[2] = {ints[0].cast<int64_t>(), ints[1].cast<int64_t>()};
  Plan plan;
  if (kOps[op].kind == Kind::batch_norm) {
    plan.epsilon = p[0].cast<double>();
    plan.channel_axis = p[1].cast<int>();
  } else {
    for (const py::handle axis : py::tuple(p[0])) plan.reduced |= 1u << axis.cast<int>();
    plan.epsilon = p[1].cast<double>();
    plan.normalize_mean = p[2].cast<bool>();
    plan.normalize_variance = p[3].cast<bool>();
    plan.epsilon_outside = p[4].cast<bool>();
    plan.channel_axis = p[5].cast<int>();
    plan.groups = p[6].is_none() ? 0 : p[6].cast<int64_t>();
    const py::tuple shape(p[7]);
    plan.stats_ndim = static_cast<int>(shape.size());
    if (plan.stats_ndim < 1 || plan.stats_ndim > kMaxViewDims) throw std::invalid_argument("stats_shape: 1 to 8 dims");
    for (int d = 0; d < plan.stats_ndim; ++d) plan.stats_sizes[d] = shape[d].cast<int64_t>();
    plan.stats_dtype = dtype_named(py::str(p[8]));
  }
  std::unique_lock<std::shared_mutex> lock(g_plans_mutex);
  g_plans[key_of(op, given, key_ints, epsilon)] = plan;
}

}  // namespace

void add_torch_kernel_functions(py::module_& m) {
  m.def("torch_attach", &attach, py::arg("libtorch_cpu"),
        "Finds torch's ABI in the loaded library; '' or what is missing.");
  m.def("torch_register", &register_kernel, py::arg("name"), py::arg("fallback"),
        "The C++ AutogradCPU kernel of simdnorm::<name>; calls it does not compute go to simdnorm::<fallback>.");
  m.def("torch_plan_put", &plan_put, py::arg("name"), py::arg("tensors"), py::arg("ints"), py::arg("epsilon"),
        py::arg("plan"));
  m.def(
      "torch_stash_error",
      [](py::object error) {
        PyObject* old = std::exchange(t_stashed_error, error.release().ptr());
        Py_XDECREF(old);
      },
      py::arg("error"), "The exception a fallback kernel is raising, for the C++ kernel to raise as itself.");
  m.def("torch_plans_clear", [] {
    std::unique_lock<std::shared_mutex> lock(g_plans_mutex);
    g_plans.clear();
  });
  m.def("torch_kernel_calls", [] { return g_computed.load(); }, "Calls the C++ kernels have computed.");
  m.def("torch_kernel_pointers", [] { return t_last_pointers; },
        "The data pointers of this thread's last call computed by a C++ kernel: its tensors', its output's.");
  m.def("torch_plans", [] {
    std::shared_lock<std::shared_mutex> lock(g_plans_mutex);
    return g_plans.size();
  });
}

}  // namespace simdnorm
