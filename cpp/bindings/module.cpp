// The binding: numpy arrays -> TensorViews, GIL released around the ops; DLPack capsules ->
// numpy arrays over the producer's memory (bindings/dlpack.h has the ABI). No algorithm here.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <dlfcn.h>

#include <climits>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "bindings/dlpack.h"
#include "bindings/torch_kernels.h"
#include "bindings/common.h"
#include "runtime/cpu.h"
#include "runtime/huge_blocks.h"
#include "runtime/thread_pool.h"
#include "simdnorm/ops.h"

namespace py = pybind11;
using namespace simdnorm;

namespace {

// numpy's type number of ml_dtypes.bfloat16, -1 until known. simdnorm does not import ml_dtypes
// (its import takes most of a second): until something has, no array holds its type. A DLPack
// bfloat16 tensor, which becomes such an array, imports it.
int g_bfloat16_num = -1;
int bfloat16_num(bool import) {
  if (g_bfloat16_num < 0) {
    py::object ml = import ? py::module_::import("ml_dtypes")
                           : py::reinterpret_steal<py::object>(PyImport_GetModule(py::str("ml_dtypes").ptr()));
    if (!ml && PyErr_Occurred()) throw py::error_already_set();
    if (ml) g_bfloat16_num = py::dtype::from_args(ml.attr("bfloat16")).num();
  }
  return g_bfloat16_num;
}

// Reads the array struct directly (pybind11's numpy proxies): a call stays free of reference
// counting and temporary objects, which is most of the per-call cost for small inputs.
DType dtype_of(const py::handle& arr, const char* name) {
  const auto* descr = py::detail::array_descriptor_proxy(py::detail::array_proxy(arr.ptr())->descr);
  if (descr->byteorder == '>') throw py::type_error(std::string(name) + ": non-native byte order");
  const int num = descr->type_num;
  if (num == py::detail::npy_api::NPY_FLOAT_) return DType::f32;
  if (num == py::detail::npy_api::NPY_DOUBLE_) return DType::f64;
  if (num == 23 /* NPY_HALF */) return DType::f16;
  if (num >= 0 && num == bfloat16_num(false)) return DType::bf16;
  throw py::type_error(std::string(name) + ": unsupported dtype " +
                       py::str(py::reinterpret_borrow<py::array>(arr).dtype()).cast<std::string>() +
                       " (accepted: float32, float16, bfloat16, float64)");
}

// numpy does not stop a view (as_strided) whose element count or byte extent passes what 64-bit
// arithmetic can hold; every offset computed inside would wrap, so such a view is refused here.
void check_extent(const TensorView& v, const char* name) {
  int64_t count = 1, extent = 0;
  bool overflow = false;
  for (int d = 0; d < v.ndim; ++d) {
    if (v.sizes[d] == 0) return;  // no element: nothing is addressed
    overflow |= __builtin_mul_overflow(count, v.sizes[d], &count);
    int64_t term;
    const int64_t stride = v.strides[d] == INT64_MIN ? INT64_MAX : (v.strides[d] < 0 ? -v.strides[d] : v.strides[d]);
    overflow |= __builtin_mul_overflow(v.sizes[d] - 1, stride, &term);
    overflow |= __builtin_add_overflow(extent, term, &extent);
  }
  overflow |= __builtin_add_overflow(extent, int64_t{8}, &extent);
  if (overflow)
    throw py::value_error(std::string(name) + ": the byte extent of its sizes and strides overflows 64-bit arithmetic");
}

TensorView exchanged_view(py::handle obj, const char* name, bool writeable);

TensorView view_of(const py::handle& obj, const char* name, bool writeable) {
  if (!py::detail::npy_api::get().PyArray_Check_(obj.ptr())) return exchanged_view(obj, name, writeable);
  const auto* a = py::detail::array_proxy(obj.ptr());
  TensorView v;
  v.dtype = dtype_of(obj, name);
  v.ndim = a->nd;
  // (kMaxViewDims: the Python layer lets users pass up to kMaxDims, and group norm adds one.)
  if (v.ndim < 1 || v.ndim > kMaxViewDims)
    throw py::value_error(std::string(name) + ": expected 1 to " + std::to_string(kMaxViewDims) + " dimensions, got " +
                          std::to_string(v.ndim));
  if (writeable && !(a->flags & py::detail::npy_api::NPY_ARRAY_WRITEABLE_))
    throw py::value_error(std::string(name) + " is read-only");
  v.data = a->data;
  bool empty = false;
  for (int d = 0; d < kMaxViewDims; ++d) {  // every slot: TensorView's arrays have no initializer
    v.sizes[d] = d < v.ndim ? a->dimensions[d] : 0;
    v.strides[d] = d < v.ndim ? a->strides[d] : 0;
    empty |= d < v.ndim && v.sizes[d] == 0;
  }
  for (int d = 0; writeable && !empty && d < v.ndim; ++d)  // (threads would race for one location)
    if (v.strides[d] == 0 && v.sizes[d] > 1)
      throw py::value_error(std::string(name) + ": strides[" + std::to_string(d) + "] is 0 with size " +
                            std::to_string(v.sizes[d]) +
                            ": more than one element of it is one memory location, so it cannot be written");
  check_extent(v, name);
  return v;
}

void check_same_shape(const TensorView& x, const TensorView& other, const char* name, bool exact) {
  if (other.ndim != x.ndim) throw py::value_error(std::string(name) + ": rank differs from the input's");
  for (int d = 0; d < x.ndim; ++d) {
    const bool ok = other.sizes[d] == x.sizes[d] || (!exact && other.sizes[d] == 1);
    if (!ok) throw py::value_error(std::string(name) + ": shape does not match the input's");
  }
}

void check_param(const TensorView& x, const TensorView& p, const char* name) {
  check_same_shape(x, p, name, false);
  if (p.dtype != x.dtype && p.dtype != DType::f32)
    throw py::type_error(std::string(name) + ": dtype must be the input's or float32");
}

// A parameter of lower rank than the input, seen with the input's rank without a numpy view (a
// view costs about as much as the rest of a small call): common.h's aligned_param.
TensorView param_view(py::handle obj, const char* name, const TensorView& x, int channel_axis) {
  const TensorView v = aligned_param(view_of(obj, name, false), x, channel_axis, name);
  check_param(x, v, name);
  return v;
}

std::optional<TensorView> optional_param(py::handle obj, const char* name, const TensorView& x, int channel_axis) {
  if (obj.is_none()) return std::nullopt;
  return param_view(obj, name, x, channel_axis);
}

// The bytes [lo, hi) that an array of ndim sizes and byte strides addresses from data; false when
// it has no elements. An extent past int64 (a view not yet checked: its kernel refuses it) gives
// the whole address space: it may overlap anything.
template <class I>
bool byte_range(const void* data, int ndim, const I* sizes, const I* strides, int64_t item, uintptr_t& lo,
                uintptr_t& hi) {
  int64_t below = 0, above = 0;
  bool overflow = false;
  for (int d = 0; d < ndim; ++d) {
    if (sizes[d] == 0) return false;
    int64_t span;
    overflow |= __builtin_mul_overflow(static_cast<int64_t>(sizes[d] - 1), static_cast<int64_t>(strides[d]), &span);
    overflow |= __builtin_add_overflow(span < 0 ? below : above, span, span < 0 ? &below : &above);
  }
  int64_t top;
  overflow |= __builtin_add_overflow(above, item, &top);
  if (overflow) {
    lo = 0, hi = UINTPTR_MAX;
    return true;
  }
  lo = reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(below);  // (below <= 0: wraps down)
  hi = reinterpret_cast<uintptr_t>(data) + static_cast<uintptr_t>(top);
  return true;
}

// Could out share memory with `other`? Compares the byte ranges the two address, so it may say
// yes where numpy's exact test (np.shares_memory) says no: the caller then asks numpy.
bool may_overlap(const TensorView& out, const TensorView& other) {
  uintptr_t lo0, hi0, lo1, hi1;
  if (!byte_range(out.data, out.ndim, out.sizes, out.strides, itemsize(out.dtype), lo0, hi0) ||
      !byte_range(other.data, other.ndim, other.sizes, other.strides, itemsize(other.dtype), lo1, hi1))
    return false;
  return lo0 < hi1 && lo1 < hi0;
}

const TensorView* optional_ptr(const std::optional<TensorView>& v) { return v ? &*v : nullptr; }

// In place (out is the input: same memory, same strides) is allowed; any other overlap of out
// with an operand is left to the caller (a temporary).
bool overlaps_an_operand(const TensorView& out, const TensorView& in,
                         std::initializer_list<const TensorView*> params) {
  bool in_place = out.data == in.data;
  for (int d = 0; d < in.ndim && in_place; ++d) in_place = in.sizes[d] < 2 || out.strides[d] == in.strides[d];
  if (!in_place && may_overlap(out, in)) return true;
  for (const auto* p : params)
    if (p != nullptr && may_overlap(out, *p)) return true;
  return false;
}

int int_of(const py::handle& obj, const char* name) {
  const long v = PyLong_AsLong(obj.ptr());
  if (v == -1 && PyErr_Occurred()) throw py::type_error(std::string(name) + " must be an int");
  if (v < INT_MIN || v > INT_MAX) throw py::value_error(std::string(name) + ": out of range");
  return static_cast<int>(v);
}

Activation activation_of(const py::handle& obj) {
  if (!PyTuple_Check(obj.ptr()) || PyTuple_GET_SIZE(obj.ptr()) != 3)
    throw py::type_error("activation must be a (kind, p0, p1) tuple");
  Activation act;
  const long kind = PyLong_AsLong(PyTuple_GET_ITEM(obj.ptr(), 0));
  if (kind == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (kind < 0 || kind >= kNumActs) throw py::value_error("activation: unknown kind");
  act.kind = static_cast<ActKind>(kind);
  act.p0 = PyFloat_AsDouble(PyTuple_GET_ITEM(obj.ptr(), 1));
  act.p1 = PyFloat_AsDouble(PyTuple_GET_ITEM(obj.ptr(), 2));
  if (PyErr_Occurred()) throw py::error_already_set();
  return act;
}

double double_of(const py::handle& obj, const char* name) {
  const double v = PyFloat_AsDouble(obj.ptr());
  if (v == -1.0 && PyErr_Occurred()) throw py::type_error(std::string(name) + " must be a float");
  return v;
}

bool bool_of(const py::handle& obj, const char* name) {
  const int v = PyObject_IsTrue(obj.ptr());
  if (v < 0) throw py::type_error(std::string(name) + " must be a bool");
  return v != 0;
}

// Returns false, having done nothing, when check_overlap is set and out may share memory with an
// operand (other than being the input): the Python layer then decides exactly and uses a temporary.
bool py_batch_norm(PyObject* const* args, std::string* explain) {
  BatchNormArgs a;
  a.input = view_of(args[0], "input", false);
  a.output = view_of(args[5], "out", true);
  if (a.output.dtype != a.input.dtype) throw py::type_error("out: dtype differs from the input's");
  check_same_shape(a.input, a.output, "out", true);
  const int channel_axis = int_of(args[8], "channel_axis");
  if (channel_axis < 0 || channel_axis >= a.input.ndim) throw py::value_error("channel_axis: out of range");
  a.mean = param_view(args[1], "mean", a.input, channel_axis);
  a.variance = param_view(args[2], "variance", a.input, channel_axis);
  a.scale = optional_param(args[3], "scale", a.input, channel_axis);
  a.bias = optional_param(args[4], "bias", a.input, channel_axis);
  a.epsilon = double_of(args[6], "epsilon");
  a.activation = activation_of(args[7]);
  if (bool_of(args[9], "check_overlap") && overlaps_an_operand(a.output, a.input, {&a.mean, &a.variance, optional_ptr(a.scale), optional_ptr(a.bias)}))
    return false;
  if (explain != nullptr) {
    batch_norm(a, explain);
    return true;
  }
  run_without_gil(element_count(a.input), [&] { batch_norm(a); });
  return true;
}

bool py_mvn(PyObject* const* args, std::string* explain) {
  const py::handle x = args[0], axes = args[1], scale = args[2], bias = args[3], out = args[4], epsilon = args[5],
                   normalize_mean = args[6], normalize_variance = args[7], epsilon_outside = args[8],
                   activation = args[9], mean_out = args[10], inv_std_out = args[11], var_out = args[14];
  MvnArgs a;
  a.input = view_of(x, "input", false);
  // out None: the statistics only, in float64 (the planner reads the input's strides for out's)
  a.statistics_only = out.is_none();
  a.output = a.statistics_only ? a.input : view_of(out, "out", true);
  if (a.output.dtype != a.input.dtype) throw py::type_error("out: dtype differs from the input's");
  check_same_shape(a.input, a.output, "out", true);
  // -1: lower-rank scale/bias align right; an axis: a 1-D one goes there (instance norm's (C,))
  const int channel_axis = int_of(args[12], "channel_axis");
  if (channel_axis < -1 || channel_axis >= a.input.ndim) throw py::value_error("channel_axis: out of range");
  a.scale = optional_param(scale, "scale", a.input, channel_axis);
  a.bias = optional_param(bias, "bias", a.input, channel_axis);
  // groups: the channel dim (and the parameters along it) split into (groups, C / groups) here, so
  // that group norm's caller passes its arrays as they are; axes and the statistics then count
  // the split view's dims
  if (args[15] != Py_None) {
    const int groups = int_of(args[15], "groups");
    if (channel_axis < 0 || groups < 1 || a.input.sizes[channel_axis] % groups != 0)
      throw py::value_error("groups: must divide the size of dim channel_axis");
    a.input = split_dim(a.input, channel_axis, groups);
    a.output = split_dim(a.output, channel_axis, groups);
    for (auto* p : {&a.scale, &a.bias})
      if (*p) **p = split_dim(**p, channel_axis, groups);
  }
  if (!PyTuple_Check(axes.ptr())) throw py::type_error("axes must be a tuple of ints");
  for (const py::handle h : py::reinterpret_borrow<py::tuple>(axes)) {
    const int axis = h.cast<int>();
    if (axis < 0 || axis >= a.input.ndim) throw py::value_error("axes: out of range");
    a.reduced |= 1u << axis;
  }
  const DType stats = a.input.dtype == DType::f64 || a.statistics_only ? DType::f64 : DType::f32;
  auto stats_view = [&](py::handle obj, const char* name) -> std::optional<TensorView> {
    if (obj.is_none()) return std::nullopt;
    TensorView v = view_of(obj, name, true);
    if (v.dtype != stats)
      throw py::type_error(std::string(name) + (a.statistics_only ? ": must be float64 (statistics only)"
                                                                  : ": must be float32 (float64 for float64 input)"));
    return kept_view(v, a.input, a.reduced, name);
  };
  a.mean_out = stats_view(mean_out, "mean_out");
  a.inv_std_out = stats_view(inv_std_out, "inv_std_out");
  if (!var_out.is_none()) {
    a.var_out = stats_view(var_out, "var_out");
    bool same = a.inv_std_out.has_value() && bool_of(normalize_variance, "normalize_variance");
    for (int d = 0; same && d < a.input.ndim; ++d) same = a.var_out->strides[d] == a.inv_std_out->strides[d];
    if (!same) throw py::value_error("var_out: needs inv_std_out, with the same strides");
  }
  a.epsilon = double_of(epsilon, "epsilon");
  a.normalize_mean = bool_of(normalize_mean, "normalize_mean");
  a.normalize_variance = bool_of(normalize_variance, "normalize_variance");
  a.epsilon_outside = bool_of(epsilon_outside, "epsilon_outside");
  a.activation = activation_of(activation);
  if (a.statistics_only && (a.scale || a.bias || !a.mean_out))
    throw py::value_error("statistics only (out None): needs mean_out, and no scale or bias");
  if (!a.statistics_only && bool_of(args[13], "check_overlap") &&
      overlaps_an_operand(a.output, a.input, {optional_ptr(a.scale), optional_ptr(a.bias)}))
    return false;
  if (explain != nullptr) {
    mean_variance_normalization(a, explain);
    return true;
  }
  run_without_gil(element_count(a.input), [&] { mean_variance_normalization(a); });
  return true;
}

// mvn_backward(x, grad_output, axes, mean, inv_std, scale, bias, fused_add, grad_input, sum_gy, sum_g,
//              epsilon, normalize_mean, normalize_variance, epsilon_outside, activation,
//              statistics_terms, write_ga, channel_axis, explain, variance_given[, groups]) -> None, or the
// plan with explain. With variance_given, inv_std is batch norm's variance (1 / sqrt(it + epsilon) is
// taken in double). groups (mvn's): dim channel_axis of x, grad_output, grad_input and the
// parameters split into (groups, C / groups) here, the axes counting the split view's dims and the
// statistics taken in any shape equal to theirs up to size-1 dims (group norm's (N, G)). The
// Python layer has validated the call and keeps grad_input off every operand's memory.
constexpr size_t kMvnBackwardArgs = 22, kMvnBackwardOptionalArgs = 1;

py::object py_mvn_backward(PyObject* const* raw) {
  py::handle args[kMvnBackwardArgs];
  std::copy(raw, raw + kMvnBackwardArgs, args);
  MvnBackwardArgs a;
  a.input = view_of(args[0], "input", false);
  a.grad_output = view_of(args[1], "grad_output", false);
  if (a.grad_output.dtype != a.input.dtype) throw py::type_error("grad_output: dtype differs from the input's");
  check_same_shape(a.input, a.grad_output, "grad_output", true);
  const int channel_axis = int_of(args[18], "channel_axis");
  if (channel_axis < -1 || channel_axis >= a.input.ndim) throw py::value_error("channel_axis: out of range");
  a.scale = optional_param(args[5], "scale", a.input, channel_axis);
  a.bias = optional_param(args[6], "bias", a.input, channel_axis);
  if (!args[8].is_none()) {
    a.grad_input = view_of(args[8], "grad_input", true);
    const DType want = bool_of(args[17], "write_ga") ? (a.input.dtype == DType::f64 ? DType::f64 : DType::f32)
                                                     : a.input.dtype;
    if (a.grad_input->dtype != want) throw py::type_error("grad_input: dtype differs from the input's (write_ga: its compute type's)");
    check_same_shape(a.input, *a.grad_input, "grad_input", true);
  }
  const bool grouped = !args[21].is_none();
  if (grouped) {
    const int groups = int_of(args[21], "groups");
    if (channel_axis < 0 || groups < 1 || a.input.sizes[channel_axis] % groups != 0)
      throw py::value_error("groups: must divide the size of dim channel_axis");
    if (!args[7].is_none()) throw py::value_error("groups: no fused_add with groups");
    for (auto* v : {&a.input, &a.grad_output}) *v = split_dim(*v, channel_axis, groups);
    for (auto* p : {&a.scale, &a.bias, &a.grad_input})
      if (*p) **p = split_dim(**p, channel_axis, groups);
  }
  if (!PyTuple_Check(args[2].ptr())) throw py::type_error("axes must be a tuple of ints");
  for (const py::handle h : py::reinterpret_borrow<py::tuple>(args[2])) {
    const int axis = h.cast<int>();
    if (axis < 0 || axis >= a.input.ndim) throw py::value_error("axes: out of range");
    a.reduced |= 1u << axis;
  }
  a.variance_given = bool_of(args[20], "variance_given");
  const char* const inv_std_name = a.variance_given ? "variance" : "inv_std";  // (the caller's argument)
  if (grouped) {
    for (auto [stats, k] : {std::pair{&a.mean, 3}, std::pair{&a.inv_std, 4}})
      if (!args[k].is_none()) *stats = kept_view(view_of(args[k], k == 3 ? "mean" : inv_std_name, false), a.input,
                                                 a.reduced, k == 3 ? "mean" : inv_std_name);
  } else {
    a.mean = optional_param(args[3], "mean", a.input, channel_axis);
    a.inv_std = optional_param(args[4], inv_std_name, a.input, channel_axis);
    a.fused_add = optional_param(args[7], "fused_add", a.input, -1);
  }
  for (const auto* stats : {&a.mean, &a.inv_std})
    if (*stats)
      for (int d = 0; d < a.input.ndim; ++d)
        if (((a.reduced >> d) & 1u) && (*stats)->sizes[d] != 1)
          throw py::value_error("statistics: must have size 1 along the normalized axes");
  for (int o = 0; o < 2; ++o) {
    if (args[9 + o].is_none()) continue;
    TensorView v = view_of(args[9 + o], "parameter sums", true);
    int64_t step = itemsize(v.dtype);
    for (int d = v.ndim - 1; d >= 0; --d) {
      if (v.sizes[d] != 1 && v.strides[d] != step) throw py::value_error("parameter sums: must be C-contiguous");
      step *= v.sizes[d];
    }
    a.param_sums[o] = v;
  }
  a.epsilon = double_of(args[11], "epsilon");
  a.normalize_mean = bool_of(args[12], "normalize_mean");
  a.normalize_variance = bool_of(args[13], "normalize_variance");
  a.epsilon_outside = bool_of(args[14], "epsilon_outside");
  a.activation = activation_of(args[15]);
  a.statistics_terms = bool_of(args[16], "statistics_terms");
  a.write_ga = bool_of(args[17], "write_ga");
  if (a.variance_given && !a.inv_std) throw py::value_error("variance_given: no variance given");
  // Their count must be that of scale and bias's broadcast shape (what the op folds them into).
  int64_t count = 1;
  for (int d = 0; d < a.input.ndim; ++d) {
    const bool varies = (a.scale && a.scale->sizes[d] != 1) || (a.bias && a.bias->sizes[d] != 1);
    if (varies) count *= a.input.sizes[d];
  }
  for (const auto& sums : a.param_sums)
    if (sums && element_count(*sums) != count)
      throw py::value_error("parameter sums: must have scale and bias's broadcast shape");
  if (bool_of(args[19], "explain")) {
    std::string plan;
    mvn_backward(a, &plan);
    return py::str(plan);
  }
  run_without_gil(element_count(a.input), [&] { mvn_backward(a); });
  return py::none();
}

// The hot entry points are plain METH_FASTCALL functions: pybind11's general dispatcher costs
// more than the rest of a small call put together.
// f returns a bool (returned as True/False), a string (returned as str) or an object.
template <size_t N, class F>
PyObject* fastcall(PyObject* const* args, Py_ssize_t nargs, const char* name, F&& f) {
  try {
    if (nargs != static_cast<Py_ssize_t>(N))
      throw py::type_error(std::string(name) + "() takes " + std::to_string(N) + " positional arguments");
    if constexpr (std::is_same_v<decltype(f(args)), bool>) {
      return py::bool_(f(args)).release().ptr();
    } else if constexpr (std::is_same_v<decltype(f(args)), py::object>) {
      return f(args).release().ptr();
    } else {
      return py::str(f(args)).release().ptr();
    }
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (py::builtin_exception& e) {
    e.set_error();
  } catch (const std::invalid_argument& e) {  // (common.h)
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

constexpr size_t kBatchNormArgs = 10, kMvnArgs = 16, kMvnOptionalArgs = 2;

PyObject* fast_batch_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return fastcall<kBatchNormArgs>(args, nargs, "batch_norm", [](PyObject* const* a) { return py_batch_norm(a, nullptr); });
}

// A call whose last `Optional` of `Args` arguments may be left out (None).
template <size_t Args, size_t Optional, class F>
PyObject* with_optional(PyObject* const* args, Py_ssize_t nargs, const char* name, F&& f) {
  if (nargs < static_cast<Py_ssize_t>(Args - Optional) || nargs >= static_cast<Py_ssize_t>(Args))
    return fastcall<Args>(args, nargs, name, f);
  PyObject* full[Args];
  std::copy(args, args + nargs, full);
  std::fill(full + nargs, full + Args, Py_None);
  return fastcall<Args>(full, Args, name, f);
}

// mvn's last arguments, var_out and groups, may be left out.
template <class F>
PyObject* mvn_call(PyObject* const* args, Py_ssize_t nargs, const char* name, F&& f) {
  return with_optional<kMvnArgs, kMvnOptionalArgs>(args, nargs, name, std::forward<F>(f));
}

PyObject* fast_mvn(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return mvn_call(args, nargs, "mvn", [](PyObject* const* a) { return py_mvn(a, nullptr); });
}

PyObject* fast_mvn_backward(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return with_optional<kMvnBackwardArgs, kMvnBackwardOptionalArgs>(args, nargs, "mvn_backward", py_mvn_backward);
}

// The explain hooks run the same checks, then describe the plan instead of running it (or say
// "overlap" when the call would have declined).
template <bool (*Op)(PyObject* const*, std::string*)>
std::string explain(PyObject* const* a) {
  std::string s;
  return Op(a, &s) ? s : std::string("declined: out may overlap an operand");
}

PyObject* explain_batch_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return fastcall<kBatchNormArgs>(args, nargs, "explain_batch_norm", explain<py_batch_norm>);
}

PyObject* explain_mvn(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return mvn_call(args, nargs, "explain_mvn", explain<py_mvn>);
}

// may_overlap(out, *arrays): whether out's bytes meet those of any of the arrays (None skipped), by
// byte ranges: False is certain, True leaves it to numpy's exact test. The backward ops' out= check
// (np.may_share_memory a pair costs more than this call for all of them).
PyObject* fast_may_overlap(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  const auto& api = py::detail::npy_api::get();
  auto range = [&](PyObject* obj, uintptr_t& lo, uintptr_t& hi) {
    const auto* a = py::detail::array_proxy(obj);
    const int64_t item = py::reinterpret_borrow<py::array>(obj).itemsize();
    return byte_range(a->data, a->nd, a->dimensions, a->strides, item, lo, hi);
  };
  for (Py_ssize_t i = 0; i < nargs; ++i) {
    if (args[i] != Py_None && !api.PyArray_Check_(args[i])) {
      PyErr_SetString(PyExc_TypeError, "may_overlap: arguments must be numpy arrays or None");
      return nullptr;
    }
  }
  uintptr_t lo0, hi0, lo1, hi1;
  if (nargs < 1 || args[0] == Py_None || !range(args[0], lo0, hi0)) Py_RETURN_FALSE;
  for (Py_ssize_t i = 1; i < nargs; ++i)
    if (args[i] != Py_None && range(args[i], lo1, hi1) && lo0 < hi1 && lo1 < hi0) Py_RETURN_TRUE;
  Py_RETURN_FALSE;
}

// update_running(running_mean, running_var, mean, var, count, momentum, pytorch) -> whether it ran:
// batch norm training's running statistics (ops.h), for C-contiguous float32/float64 arrays of one
// element count; False for any other dtype or layout (the caller takes numpy's same arithmetic).
PyObject* fast_update_running(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return fastcall<7>(args, nargs, "update_running", [](PyObject* const* a) {
    TensorView v[4];
    const char* names[4] = {"running_mean", "running_var", "mean", "var"};
    for (int k = 0; k < 4; ++k) {
      v[k] = view_of(a[k], names[k], k < 2);
      if (v[k].dtype != DType::f32 && v[k].dtype != DType::f64) return false;
      if (element_count(v[k]) != element_count(v[0])) throw py::value_error("update_running: element counts differ");
      int64_t step = itemsize(v[k].dtype);
      for (int d = v[k].ndim - 1; d >= 0 && element_count(v[k]) > 0; --d) {  // (numpy's rule: empty is contiguous)
        if (v[k].sizes[d] != 1 && v[k].strides[d] != step) return false;
        step *= v[k].sizes[d];
      }
    }
    const long long count = PyLong_AsLongLong(a[4]);
    if (count == -1 && PyErr_Occurred()) throw py::type_error("count must be an int");
    update_running_statistics(v[0], v[1], v[2], v[3], count, double_of(a[5], "momentum"), bool_of(a[6], "pytorch"));
    return true;
  });
}

PyMethodDef g_fast_methods[] = {
    {"update_running", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_update_running)), METH_FASTCALL,
     "update_running(running_mean, running_var, mean, var, count, momentum, pytorch) -> whether it ran: batch norm "
     "training's running statistics, in place (C-contiguous float32/float64 arrays only)"},
    {"may_overlap", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_may_overlap)), METH_FASTCALL,
     "may_overlap(out, *arrays) -> whether out's byte range meets any array's (None skipped): False is certain"},
    {"batch_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_batch_norm)), METH_FASTCALL,
     "batch_norm(x, mean, variance, scale, bias, out, epsilon, activation, channel_axis, check_overlap) -> ran"},
    {"mvn", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_mvn)), METH_FASTCALL,
     "mvn(x, axes, scale, bias, out, epsilon, normalize_mean, normalize_variance, epsilon_outside, activation, "
     "mean_out, inv_std_out, channel_axis, check_overlap[, var_out[, groups]]) -> ran; out None: the statistics "
     "only, into float64 mean_out (inv_std_out, var_out); groups: dim channel_axis split into (groups, C / groups)"},
    {"mvn_backward", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_mvn_backward)), METH_FASTCALL,
     "mvn_backward(x, grad_output, axes, mean, inv_std, scale, bias, fused_add, grad_input, sum_gy, sum_g, "
     "epsilon, normalize_mean, normalize_variance, epsilon_outside, activation, statistics_terms, write_ga, "
     "channel_axis, explain, variance_given[, groups]) -> None (explain: the plan, as text); groups: as mvn's"},
    {"explain_batch_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(explain_batch_norm)),
     METH_FASTCALL, "explain_batch_norm(<batch_norm's arguments>) -> the plan batch_norm would run, as text"},
    {"explain_mvn", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(explain_mvn)), METH_FASTCALL,
     "explain_mvn(<mvn's arguments>) -> the plan mvn would run, as text"},
    {nullptr, nullptr, 0, nullptr},
};

// ------------------------------------------------------------------------------------------------
// DLPack in: a producer's capsule -> a numpy array over its memory, without a copy. The Python
// layer then treats it as any other array; the array's base owns the DLPack tensor, whose
// deleter runs once, when the array and every view of it are gone. Everything is validated before
// the capsule is taken: a refused capsule stays the producer's (its destructor deletes it).

namespace dl = simdnorm::dlpack;

[[noreturn]] void throw_type(const std::string& msg) { throw py::type_error(msg); }
[[noreturn]] void throw_value(const std::string& msg) { throw py::value_error(msg); }

std::string type_name(py::handle obj) { return Py_TYPE(obj.ptr())->tp_name; }

const dl::ExchangeApi* exchange_api_of(PyObject* obj);

// An unconsumed capsule's destructor, for the capsules made of an exchange API's export below (a
// producer's own capsule has the producer's): the deleter runs unless a consumer took it.
void delete_unconsumed(PyObject* cap) {
  if (!PyCapsule_IsValid(cap, dl::kCapsuleVersioned)) return;  // (renamed "used_...": taken)
  PyObject *type, *value, *trace;
  PyErr_Fetch(&type, &value, &trace);
  auto* m = static_cast<dl::DLManagedTensorVersioned*>(PyCapsule_GetPointer(cap, dl::kCapsuleVersioned));
  if (m != nullptr && m->deleter != nullptr) m->deleter(m);
  PyErr_Restore(type, value, trace);
}

// The producer's export as a DLPack capsule: through its type's C exchange API where it has one
// (no Python call: a torch tensor's __dlpack__ is slow), made into a "dltensor_versioned" capsule
// as __dlpack__ would return it; else its __dlpack__(max_version=(1, 0)), or __dlpack__()
// for one that predates max_version (a TypeError for the keyword). Whatever either raises (an
// Exception) becomes a TypeError naming the argument, chained to the producer's own error.
py::object call_dlpack(py::handle producer, const char* name) {
  static PyObject* const method = PyUnicode_InternFromString("__dlpack__");
  static PyObject* const kwnames = Py_BuildValue("(s)", "max_version");
  static PyObject* const version = Py_BuildValue("(II)", dl::kMajorVersion, 0u);
  if (method == nullptr || kwnames == nullptr || version == nullptr) throw py::error_already_set();
  PyObject* cap = nullptr;
  const char* what = "__dlpack__()";
  if (const dl::ExchangeApi* api = exchange_api_of(producer.ptr())) {
    what = "DLPack C exchange API export";
    dl::DLManagedTensorVersioned* m = nullptr;
    if (api->managed_tensor_from_py_object_no_sync(producer.ptr(), &m) == 0) {
      cap = PyCapsule_New(m, dl::kCapsuleVersioned, delete_unconsumed);
      if (cap == nullptr && m->deleter != nullptr) m->deleter(m);
    }
  } else {
    PyObject* args[] = {producer.ptr(), version};
    cap = PyObject_VectorcallMethod(method, args, 1, kwnames);
    if (cap == nullptr && PyErr_ExceptionMatches(PyExc_TypeError)) {
      PyErr_Clear();
      cap = PyObject_CallMethodNoArgs(producer.ptr(), method);
    }
  }
  if (cap != nullptr) return py::reinterpret_steal<py::object>(cap);
  py::error_already_set e;
  if (!e.matches(PyExc_Exception) || e.matches(PyExc_MemoryError)) throw e;
  std::string cause = py::str(e.value()).cast<std::string>();
  cause = cause.substr(0, cause.find('\n'));  // (torch's C++ errors go on with a stack trace; chained below)
  const std::string msg = std::string(name) + ": cannot read this " + type_name(producer) + " through DLPack: its " +
                          what + " raised " + py::str(e.type().attr("__name__")).cast<std::string>() + ": " + cause;
  py::raise_from(e, PyExc_TypeError, msg.c_str());
  throw py::error_already_set();
}

const char* device_name(int32_t type) {
  switch (type) {
    case 2: return "CUDA";
    case 4: return "OpenCL";
    case 7: return "Vulkan";
    case 8: return "Metal";
    case 9: return "VPI";
    case 10: return "ROCm";
    case 12: return "ExtDev";
    case 13: return "CUDA managed";
    case 14: return "oneAPI";
    case 15: return "WebGPU";
    case 16: return "Hexagon";
    case 17: return "MAIA";
    default: return "unknown";
  }
}

std::string dtype_text(const dl::DLDataType& t) {
  static const char* const kinds[] = {"int", "uint", "float", "opaque handle", "bfloat", "complex", "bool"};
  const bool sized = t.code != dl::kDLOpaqueHandle && t.code != dl::kDLBool;
  std::string s = t.code < 7 ? std::string(kinds[t.code]) + (sized ? std::to_string(t.bits) : "") : "float8 or sub-byte";
  s += " (DLPack code " + std::to_string(t.code) + ", " + std::to_string(t.bits) + " bits, " +
       std::to_string(t.lanes) + (t.lanes == 1 ? " lane)" : " lanes)");
  return s;
}

// The numpy type number of a DLPack dtype: float16, bfloat16 (ml_dtypes'), float32, float64.
int numpy_type_of(const dl::DLDataType& t, const char* name) {
  int num = -1;
  if (t.lanes == 1 && t.code == dl::kDLFloat)
    num = t.bits == 16 ? 23 /* NPY_HALF */ : t.bits == 32 ? py::detail::npy_api::NPY_FLOAT_
                                           : t.bits == 64 ? py::detail::npy_api::NPY_DOUBLE_ : -1;
  else if (t.lanes == 1 && t.code == dl::kDLBfloat && t.bits == 16)
    num = bfloat16_num(true);
  if (num < 0)
    throw_type(std::string(name) + ": dtype " + dtype_text(t) +
               " is not supported; accepted: float32, float16, bfloat16, float64");
  return num;
}

// The tensor's sizes and byte strides, checked: sizes >= 0, every byte stride and the byte extent
// within int64, the addressed bytes inside the address space, data non-null when there are
// elements. (The kernels add int64 byte offsets to the data pointer: none may wrap.)
struct Layout {
  Py_intptr_t sizes[kMaxViewDims];
  Py_intptr_t strides[kMaxViewDims];
  char* data;
};

Layout layout_of(const dl::DLTensor& t, int64_t itemsize, const char* name, bool writeable) {
  const std::string n(name);
  Layout l{};
  if (t.ndim > 0 && t.shape == nullptr) throw_value(n + ": the DLPack tensor has " + std::to_string(t.ndim) + " dims and no shape");
  // the bytes of the non-zero sizes must fit (numpy's rule, even when a zero size leaves no element)
  bool empty = false;
  int64_t bytes = itemsize;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] < 0)
      throw_value(n + ": DLPack shape[" + std::to_string(d) + "] is " + std::to_string(t.shape[d]) + "; sizes must be >= 0");
    l.sizes[d] = t.shape[d];
    empty |= t.shape[d] == 0;
    if (t.shape[d] > 0 && __builtin_mul_overflow(bytes, t.shape[d], &bytes))
      throw_value(n + ": the DLPack shape's element count times " + std::to_string(itemsize) +
                  " bytes overflows 64-bit arithmetic");
  }
  if (t.strides == nullptr) {  // compact row-major: every stride is at most the bytes, which fit
    int64_t step = itemsize;
    for (int d = t.ndim - 1; d >= 0; --d) {
      l.strides[d] = step;
      step *= t.shape[d] > 0 ? t.shape[d] : 1;
    }
  } else {
    for (int d = 0; d < t.ndim; ++d) {
      int64_t b;
      if (__builtin_mul_overflow(t.strides[d], itemsize, &b))
        throw_value(n + ": DLPack strides[" + std::to_string(d) + "] = " + std::to_string(t.strides[d]) + " elements of " +
                    std::to_string(itemsize) + " bytes overflows 64-bit arithmetic");
      l.strides[d] = b;
    }
  }
  if (t.byte_offset > static_cast<uint64_t>(INT64_MAX))
    throw_value(n + ": DLPack byte_offset " + std::to_string(t.byte_offset) + " overflows 64-bit arithmetic");
  if (empty) {  // nothing is addressed; numpy wants a pointer all the same
    static double nothing;
    uintptr_t p;
    const bool usable = t.data != nullptr && !__builtin_add_overflow(reinterpret_cast<uintptr_t>(t.data), t.byte_offset, &p);
    l.data = usable ? reinterpret_cast<char*>(p) : reinterpret_cast<char*>(&nothing);
    return l;
  }
  if (t.data == nullptr)
    throw_value(n + ": the DLPack tensor's data pointer is null and it has " + std::to_string(bytes / itemsize) + " elements");
  // byte offsets below and above element (0, ..., 0); then the addresses they reach
  int64_t below = 0, above = 0;
  bool overflow = false;
  for (int d = 0; d < t.ndim; ++d) {
    int64_t span;
    const int64_t s = l.strides[d];
    overflow |= __builtin_mul_overflow(l.sizes[d] - 1, s, &span);  // sizes[d] >= 1 here
    if (span < 0) overflow |= __builtin_sub_overflow(below, span, &below);
    else overflow |= __builtin_add_overflow(above, span, &above);
    if (writeable && s == 0 && l.sizes[d] > 1)
      throw_value(n + ": DLPack strides[" + std::to_string(d) + "] is 0 with size " + std::to_string(l.sizes[d]) +
                  ": more than one element of it is one memory location, so it cannot be written");
  }
  overflow |= __builtin_add_overflow(below, above, &bytes) || __builtin_add_overflow(bytes, int64_t{8}, &bytes);
  uintptr_t base = 0, lo = 0, hi = 0;
  overflow = overflow || __builtin_add_overflow(reinterpret_cast<uintptr_t>(t.data), t.byte_offset, &base) ||
             __builtin_sub_overflow(base, static_cast<uintptr_t>(below), &lo) ||
             __builtin_add_overflow(base, static_cast<uintptr_t>(above) + static_cast<uintptr_t>(itemsize), &hi);
  if (overflow)
    throw_value(n + ": the byte extent of the DLPack tensor's shape, strides and byte_offset overflows 64-bit "
                "arithmetic or the address space");
  l.data = reinterpret_cast<char*>(base);
  return l;
}

// The producer type's exchange API (major version 1), or null: looked up once per type. A cached
// type is kept alive, so that its address cannot come back as another type's.
const dl::ExchangeApi* exchange_api_of(PyObject* obj) {
  static std::vector<std::pair<PyTypeObject*, const dl::ExchangeApi*>> known;  // (the GIL guards it)
  PyTypeObject* type = Py_TYPE(obj);
  for (const auto& [t, api] : known)
    if (t == type) return api;
  const dl::ExchangeApi* api = nullptr;
  PyObject* cap = PyObject_GetAttrString(reinterpret_cast<PyObject*>(type), dl::kExchangeApiAttribute);
  if (cap == nullptr) {
    PyErr_Clear();
  } else {
    if (PyCapsule_IsValid(cap, dl::kExchangeApiCapsule)) {
      // (the table lives as long as the process, by the protocol's rule: the capsule may go)
      auto* h = static_cast<const dl::ExchangeApiHeader*>(PyCapsule_GetPointer(cap, dl::kExchangeApiCapsule));
      while (h != nullptr && h->version.major != dl::kMajorVersion) h = h->prev_api;
      api = reinterpret_cast<const dl::ExchangeApi*>(h);
      if (api != nullptr && api->managed_tensor_from_py_object_no_sync == nullptr) api = nullptr;
    }
    Py_DECREF(cap);
  }
  if (known.size() < 16) {
    Py_INCREF(type);
    known.emplace_back(type, api);
  }
  return api;
}

DType dtype_of(const dl::DLDataType& t, const char* name) {
  if (t.lanes == 1 && t.code == dl::kDLFloat && t.bits == 32) return DType::f32;
  if (t.lanes == 1 && t.code == dl::kDLFloat && t.bits == 16) return DType::f16;
  if (t.lanes == 1 && t.code == dl::kDLFloat && t.bits == 64) return DType::f64;
  if (t.lanes == 1 && t.code == dl::kDLBfloat && t.bits == 16) return DType::bf16;
  throw_type(std::string(name) + ": dtype " + dtype_text(t) + " is not supported; accepted: float32, float16, "
             "bfloat16, float64");
}

// A tensor whose type has the DLPack C exchange API (a torch tensor) as a TensorView, read where it
// lies without a Python call: the torch layer's route for small calls. Borrowed (the caller holds
// obj for the call); writeable takes the owning export, whose flags say read-only, and gives it back
// at once. The callers pass plain tensors only: a fake tensor's export has no real data.
TensorView exchanged_view(py::handle obj, const char* name, bool writeable) {
  const dl::ExchangeApi* api = exchange_api_of(obj.ptr());
  if (api == nullptr)
    throw_type(std::string(name) + " must be a numpy.ndarray or a tensor with the DLPack C exchange API, not " +
               type_name(obj));
  dl::DLTensor t;
  dl::DLManagedTensorVersioned* managed = nullptr;
  struct GiveBack {
    dl::DLManagedTensorVersioned*& m;
    ~GiveBack() {
      if (m != nullptr && m->deleter != nullptr) m->deleter(m);
    }
  } give_back{managed};
  if (writeable || api->dltensor_from_py_object_no_sync == nullptr) {
    if (api->managed_tensor_from_py_object_no_sync(obj.ptr(), &managed) != 0) throw py::error_already_set();
    if (writeable && (managed->flags & dl::kFlagReadOnly) != 0)
      throw_value(std::string(name) + ": the " + type_name(obj) + " is read-only (its DLPack export says so)");
    t = managed->dl_tensor;
  } else if (api->dltensor_from_py_object_no_sync(obj.ptr(), &t) != 0) {
    throw py::error_already_set();
  }
  if (t.device.device_type != dl::kDLCPU && t.device.device_type != dl::kDLCUDAHost &&
      t.device.device_type != dl::kDLROCMHost)
    throw_type(std::string(name) + ": the tensor is on device " + device_name(t.device.device_type) +
               ", not in the CPU's memory");
  if (t.ndim < 1 || t.ndim > kMaxViewDims)
    throw_value(std::string(name) + ": expected 1 to " + std::to_string(kMaxViewDims) + " dimensions, got " +
                std::to_string(t.ndim));
  TensorView v;
  v.dtype = dtype_of(t.dtype, name);
  v.ndim = t.ndim;
  const Layout l = layout_of(t, itemsize(v.dtype), name, writeable);
  v.data = l.data;
  for (int d = 0; d < kMaxViewDims; ++d) {
    v.sizes[d] = d < v.ndim ? l.sizes[d] : 0;
    v.strides[d] = d < v.ndim ? l.strides[d] : 0;
  }
  check_extent(v, name);
  return v;
}

// The array's base: owns the managed tensor; its destructor is the one place the deleter runs.
// (The destructor is set only once the array holds it, so a failure before leaves no call behind.)
constexpr const char* kOwnerVersioned = "simdnorm.dltensor_versioned_owner";
constexpr const char* kOwnerLegacy = "simdnorm.dltensor_owner";

template <class Managed>
void release_managed(PyObject* owner) {
  const char* name = std::is_same_v<Managed, dl::DLManagedTensorVersioned> ? kOwnerVersioned : kOwnerLegacy;
  auto* m = static_cast<Managed*>(PyCapsule_GetPointer(owner, name));
  PyObject *type, *value, *trace;  // a deleter (a Python callback, say) must not eat a pending error
  PyErr_Fetch(&type, &value, &trace);
  if (m != nullptr && m->deleter != nullptr) m->deleter(m);
  PyErr_Restore(type, value, trace);
}

// obj.__dlpack__() as a numpy array over the same memory: float16, bfloat16, float32, float64 on
// the CPU, 0 to 8 dims. Read-only (DLPack 1.x's flag) gives a read-only array; writeable asks for
// a writeable one (out=, running statistics), refusing a read-only or self-overlapping tensor.
py::object array_from_dlpack(py::handle producer, const char* name, bool writeable) {
  const std::string n(name);
  py::object capsule = call_dlpack(producer, name);
  PyObject* cap = capsule.ptr();
  if (!PyCapsule_CheckExact(cap))
    throw_type(n + ": " + type_name(producer) + ".__dlpack__() returned a " + type_name(capsule) +
               ", not a DLPack capsule");
  const char* cap_name = PyCapsule_GetName(cap);
  if (cap_name == nullptr && PyErr_Occurred()) throw py::error_already_set();
  const std::string cname = cap_name ? cap_name : "";
  const bool versioned = cname == dl::kCapsuleVersioned;
  if (cname == dl::kUsedCapsule || cname == dl::kUsedCapsuleVersioned)
    throw_value(n + ": " + type_name(producer) + ".__dlpack__() returned a capsule already consumed (named \"" + cname +
                "\"): a DLPack capsule can be read once");
  if (!versioned && cname != dl::kCapsule)
    throw_type(n + ": " + type_name(producer) + ".__dlpack__() returned a capsule named \"" + cname +
               "\", not a DLPack tensor (\"dltensor_versioned\" or \"dltensor\")");
  void* managed = PyCapsule_GetPointer(cap, cap_name);
  if (managed == nullptr) throw py::error_already_set();
  const dl::DLTensor* t;
  uint64_t flags = 0;
  if (versioned) {
    auto* m = static_cast<dl::DLManagedTensorVersioned*>(managed);
    if (m->version.major != dl::kMajorVersion)
      throw_type(n + ": DLPack version " + std::to_string(m->version.major) + "." + std::to_string(m->version.minor) +
                 " (simdnorm reads major version " + std::to_string(dl::kMajorVersion) + ")");
    t = &m->dl_tensor;
    flags = m->flags;
  } else {
    t = &static_cast<dl::DLManagedTensor*>(managed)->dl_tensor;
  }
  const int32_t dev = t->device.device_type;
  if (dev != dl::kDLCPU && dev != dl::kDLCUDAHost && dev != dl::kDLROCMHost)
    throw_type(n + ": the DLPack tensor is on device " + device_name(dev) + " (type " + std::to_string(dev) + ", id " +
               std::to_string(t->device.device_id) + "), not in the CPU's memory; move it to the CPU first");
  if (t->ndim < 0 || t->ndim > kMaxDims)
    throw_value(n + ": " + std::to_string(t->ndim) + " dimensions (DLPack ndim); tensors must have 1 to " +
                std::to_string(kMaxDims) + " dimensions");
  const bool read_only = (flags & dl::kFlagReadOnly) != 0;
  if (writeable && read_only)
    throw_value(n + ": the " + type_name(producer) + " is read-only (its DLPack export says so); it cannot be written");
  const int num = numpy_type_of(t->dtype, name);
  auto& api = py::detail::npy_api::get();
  py::object descr = py::reinterpret_steal<py::object>(api.PyArray_DescrFromType_(num));
  if (!descr) throw py::error_already_set();
  const int64_t itemsize = py::reinterpret_borrow<py::dtype>(descr).itemsize();
  if (itemsize * 8 != t->dtype.bits) throw_type(n + ": dtype " + dtype_text(t->dtype) + " does not match its numpy type");
  const Layout l = layout_of(*t, itemsize, name, writeable);
  // The array first, then the owner (no destructor yet); only when the array holds the owner is
  // the capsule renamed (taken) and the owner's destructor set: no failure can call the deleter
  // twice, or leave it uncalled.
  py::object arr = py::reinterpret_steal<py::object>(api.PyArray_NewFromDescr_(
      api.PyArray_Type_, descr.release().ptr(), t->ndim, l.sizes, l.strides, l.data,
      read_only ? 0 : py::detail::npy_api::NPY_ARRAY_WRITEABLE_, nullptr));
  if (!arr) throw py::error_already_set();
  PyObject* owner = PyCapsule_New(managed, versioned ? kOwnerVersioned : kOwnerLegacy, nullptr);
  if (owner == nullptr) throw py::error_already_set();
  if (api.PyArray_SetBaseObject_(arr.ptr(), owner) != 0) throw py::error_already_set();  // (owner stolen)
  if (PyCapsule_SetName(cap, versioned ? dl::kUsedCapsuleVersioned : dl::kUsedCapsule) != 0 ||
      PyCapsule_SetDestructor(owner, versioned ? release_managed<dl::DLManagedTensorVersioned>
                                               : release_managed<dl::DLManagedTensor>) != 0)
    throw py::error_already_set();  // (cannot fail for a valid capsule)
  return arr;
}

PyObject* fast_from_dlpack(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return fastcall<3>(args, nargs, "from_dlpack", [](PyObject* const* a) {
    const char* name = PyUnicode_AsUTF8(a[1]);
    if (name == nullptr) throw py::error_already_set();
    return array_from_dlpack(a[0], name, bool_of(a[2], "writeable"));
  });
}

PyMethodDef g_dlpack_methods[] = {
    {"from_dlpack", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_from_dlpack)), METH_FASTCALL,
     "from_dlpack(obj, name, writeable) -> a numpy array over obj's memory, read through obj.__dlpack__() (no "
     "copy; the array owns the DLPack tensor); name is the argument's, for messages"},
    {nullptr, nullptr, 0, nullptr},
};

// ---- large outputs for torch: DLPack capsules over blocks of huge pages (runtime/huge_blocks.h)

struct BlockTensor {
  dlpack::DLManagedTensor managed;
  int64_t shape[kMaxViewDims];
  int64_t strides[kMaxViewDims];
  size_t bytes;
};

void release_block_tensor(dlpack::DLManagedTensor* self) {  // (any thread, without the GIL)
  auto* t = static_cast<BlockTensor*>(self->manager_ctx);
  give_huge_block(t->managed.dl_tensor.data, t->bytes);
  delete t;
}

void destroy_unused_capsule(PyObject* capsule) {  // (a consumer renames the capsule it takes)
  if (PyCapsule_IsValid(capsule, "used_dltensor")) return;
  auto* m = static_cast<dlpack::DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
  if (m != nullptr) m->deleter(m);
  else PyErr_Clear();
}

// A legacy DLPack capsule of a new, uninitialized dense tensor of `sizes` on a block of huge pages:
// the given element strides (a permutation of a dense layout), or row-major ones where none; None
// where no block could be mapped.
py::object huge_block_capsule(const std::vector<int64_t>& sizes, const std::optional<std::vector<int64_t>>& strides,
                              int code, int bits) {
  const int ndim = static_cast<int>(sizes.size());
  if (ndim < 1 || ndim > kMaxViewDims || (strides && strides->size() != sizes.size()) || bits % 8 != 0 || bits <= 0)
    throw py::value_error("huge_block_capsule: a shape of 1 to 9 dims, strides as many, whole bytes");
  auto t = std::make_unique<BlockTensor>();
  int64_t span = 1, step = 1;  // (elements: the largest offset plus one, of a dense layout)
  for (int d = ndim - 1; d >= 0; --d) {
    if (sizes[d] < 1) throw py::value_error("huge_block_capsule: sizes must be positive");
    t->shape[d] = sizes[d];
    t->strides[d] = strides ? (*strides)[d] : step;
    if (t->strides[d] < 0) throw py::value_error("huge_block_capsule: strides must not be negative");
    step *= sizes[d];
    span += (sizes[d] - 1) * t->strides[d];
  }
  if (span != step) throw py::value_error("huge_block_capsule: the strides must lay the elements out densely");
  t->bytes = static_cast<size_t>(span) * static_cast<size_t>(bits / 8);
  void* data = take_huge_block(t->bytes);
  if (data == nullptr) return py::none();  // (the caller takes torch's allocator instead)
  dlpack::DLTensor& dl = t->managed.dl_tensor;
  dl.data = data;
  dl.device = {dlpack::kDLCPU, 0};
  dl.ndim = ndim;
  dl.dtype = {static_cast<uint8_t>(code), static_cast<uint8_t>(bits), 1};
  dl.shape = t->shape;
  dl.strides = t->strides;
  dl.byte_offset = 0;
  t->managed.manager_ctx = t.get();
  t->managed.deleter = release_block_tensor;
  PyObject* capsule = PyCapsule_New(&t->managed, "dltensor", destroy_unused_capsule);
  if (capsule == nullptr) {
    give_huge_block(data, t->bytes);
    throw py::error_already_set();
  }
  t.release();
  return py::reinterpret_steal<py::object>(capsule);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "simdnorm kernels (see the simdnorm package for the public API)";
  m.attr("__version__") = SIMDNORM_VERSION;
  // The ISA units compiled in (comma-separated) and the build's SIMDNORM_ISAS (host, all or a list)
  m.attr("built_isas") = SIMDNORM_BUILT_ISAS;
  m.attr("isas_setting") = SIMDNORM_ISAS_SETTING;
  if (PyModule_AddFunctions(m.ptr(), g_fast_methods) != 0 || PyModule_AddFunctions(m.ptr(), g_dlpack_methods) != 0)
    throw py::error_already_set();
  add_torch_kernel_functions(m);
  m.def("isa", &active_isa, "The active instruction set.");
  m.def("available_isas", &available_isas, "The built units this CPU and OS run, best first.");
  m.def("cpu_isas", &cpu_isas, "The units this CPU and OS run, built or not, best first.");
  m.def(
      "set_isa",
      [](const std::string& name) {
        try {
          set_isa(name);
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
      },
      py::arg("name"));
  m.def("stream_threshold_bytes", &stream_threshold_bytes,
        "Input plus output bytes past which an out-of-place operation writes with non-temporal stores "
        "(half the largest cache the cores share, at most 16 MiB).");
  m.def("get_num_threads", &get_num_threads);
  m.def(
      "set_num_threads",
      [](int n) {
        if (n < 1) throw py::value_error("number of threads must be >= 1, got " + std::to_string(n));
        const int previous = get_num_threads();
        set_num_threads(n);
        return previous;
      },
      py::arg("n"));
  m.def(
      "set_caller_threads",
      [](int n) {
        if (n < 0) throw py::value_error("number of threads must be >= 0 (0: none of its own), got " + std::to_string(n));
        return set_caller_threads(n);
      },
      py::arg("n"),
      "The calling thread's own thread count for its calls (0: none, get_num_threads() applies); returns "
      "the previous one.");
  m.def(
      "share_openmp_team",
      [](const std::string& library) {
        // Only a library the process has already loaded (RTLD_NOLOAD); its handle is kept, so the
        // entries stay valid for the process's life.
        void* handle = dlopen(library.c_str(), RTLD_NOW | RTLD_NOLOAD);
        if (handle == nullptr) return false;
        OpenMpTeam team{};
        team.parallel = reinterpret_cast<decltype(team.parallel)>(dlsym(handle, "GOMP_parallel"));
        team.max_threads = reinterpret_cast<decltype(team.max_threads)>(dlsym(handle, "omp_get_max_threads"));
        team.thread_num = reinterpret_cast<decltype(team.thread_num)>(dlsym(handle, "omp_get_thread_num"));
        if (team.parallel == nullptr || team.max_threads == nullptr || team.thread_num == nullptr ||
            !share_openmp_team(team)) {
          dlclose(handle);
          return false;
        }
        return true;
      },
      py::arg("library"),
      "Run parallel calls on the team of the loaded OpenMP runtime `library`; False, nothing changed, "
      "where it is not loaded, lacks GOMP_parallel, omp_get_max_threads or omp_get_thread_num, or in a "
      "fork()ed child of a process that shared a team.");
  m.def("use_own_threads", &use_own_threads, "Parallel calls on simdnorm's own pool again.");
  m.def("sharing_openmp_team", &sharing_openmp_team);
  m.def("openmp_team_entered", &openmp_team_entered,
        "Whether a parallel call ran on the shared OpenMP team here or in the process this one was forked from.");
  m.def("caller_threads", &caller_threads, "The thread count the calling thread's calls use.");
  m.def("huge_block_capsule", &huge_block_capsule, py::arg("sizes"), py::arg("strides"), py::arg("code"),
        py::arg("bits"),
        "A DLPack capsule ('dltensor') of a new dense tensor on a block of 2 MB pages, given back to "
        "simdnorm's cache when the consumer's tensor dies (large torch outputs: simdnorm.torch).");
  m.attr("huge_block_min_elements") = kHugeBlockMinElements;
  m.def("huge_cache_bytes", &cached_huge_bytes, "The bytes of freed huge-page blocks kept for reuse.");
  m.def("huge_cache_limit", &huge_cache_limit, "The bound on those (SIMDNORM_TORCH_CACHE_MB, default 1024 MB).");
  m.def("huge_cache_setting_ignored", &huge_cache_setting_ignored,
        "Whether SIMDNORM_TORCH_CACHE_MB was set to something other than whole megabytes (then 1024).");
  m.def("release_huge_blocks", &release_huge_blocks, "Unmap the kept blocks; returns the bytes released.");
}
