// The one binding file: numpy arrays -> TensorViews, GIL released around the ops. No algorithm here.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <climits>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "runtime/cpu.h"
#include "runtime/thread_pool.h"
#include "simdnorm/ops.h"

namespace py = pybind11;
using namespace simdnorm;

namespace {

int g_bfloat16_num = -1;  // numpy type number of ml_dtypes.bfloat16, registered at import

// Reads the array struct directly (pybind11's numpy proxies): a call stays free of reference
// counting and temporary objects, which is most of the per-call cost for small inputs.
DType dtype_of(const py::handle& arr, const char* name) {
  const auto* descr = py::detail::array_descriptor_proxy(py::detail::array_proxy(arr.ptr())->descr);
  if (descr->byteorder == '>') throw py::type_error(std::string(name) + ": non-native byte order");
  const int num = descr->type_num;
  if (num == py::detail::npy_api::NPY_FLOAT_) return DType::f32;
  if (num == py::detail::npy_api::NPY_DOUBLE_) return DType::f64;
  if (num == 23 /* NPY_HALF */) return DType::f16;
  if (num == g_bfloat16_num && g_bfloat16_num >= 0) return DType::bf16;
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

TensorView view_of(const py::handle& obj, const char* name, bool writeable) {
  if (!py::detail::npy_api::get().PyArray_Check_(obj.ptr()))
    throw py::type_error(std::string(name) + " must be a numpy.ndarray");
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
  for (int d = 0; d < kMaxViewDims; ++d) {  // every slot: TensorView's arrays have no initializer
    v.sizes[d] = d < v.ndim ? a->dimensions[d] : 0;
    v.strides[d] = d < v.ndim ? a->strides[d] : 0;
  }
  check_extent(v, name);
  return v;
}

int64_t element_count(const TensorView& v) {
  int64_t n = 1;
  for (int d = 0; d < v.ndim; ++d) n *= v.sizes[d];
  return n;
}

// Below this many elements a call is over in microseconds: releasing and retaking the GIL would
// cost more than any other Python thread could gain.
constexpr int64_t kReleaseGilElements = 1 << 14;

template <class F>
void run_without_gil(int64_t elements, F&& f) {
  if (elements < kReleaseGilElements) return f();
  py::gil_scoped_release release;
  f();
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
// view costs about as much as the rest of a small call): a 1-D parameter goes to channel_axis when
// one is given (batch norm's (C,) parameters), otherwise dims align right (numpy broadcasting).
TensorView param_view(py::handle obj, const char* name, const TensorView& x, int channel_axis) {
  const TensorView p = view_of(obj, name, false);
  TensorView v = p;
  if (p.ndim != x.ndim) {
    if (p.ndim > x.ndim) throw py::value_error(std::string(name) + ": more dims than the input");
    const int first = channel_axis >= 0 && p.ndim == 1 ? channel_axis : x.ndim - p.ndim;
    if (first + p.ndim > x.ndim) throw py::value_error(std::string(name) + ": channel_axis out of range");
    v.ndim = x.ndim;
    for (int d = 0; d < x.ndim; ++d) {
      const bool own = d >= first && d < first + p.ndim;
      v.sizes[d] = own ? p.sizes[d - first] : 1;
      v.strides[d] = own ? p.strides[d - first] : 0;
    }
  }
  check_param(x, v, name);
  return v;
}

std::optional<TensorView> optional_param(py::handle obj, const char* name, const TensorView& x, int channel_axis) {
  if (obj.is_none()) return std::nullopt;
  return param_view(obj, name, x, channel_axis);
}

// Could out share memory with `other`? Compares the byte ranges the two address, so it may say
// yes where numpy's exact test (np.shares_memory) says no: the caller then asks numpy.
bool may_overlap(const TensorView& out, const TensorView& other) {
  auto range = [](const TensorView& v, uintptr_t& lo, uintptr_t& hi) {
    int64_t below = 0, above = 0;
    for (int d = 0; d < v.ndim; ++d) {
      if (v.sizes[d] == 0) return false;
      const int64_t span = (v.sizes[d] - 1) * v.strides[d];  // fits: check_extent passed
      (span < 0 ? below : above) += span;
    }
    lo = reinterpret_cast<uintptr_t>(v.data) + below;
    hi = reinterpret_cast<uintptr_t>(v.data) + above + itemsize(v.dtype);
    return true;
  };
  uintptr_t lo0, hi0, lo1, hi1;
  if (!range(out, lo0, hi0) || !range(other, lo1, hi1)) return false;
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
  a.output = view_of(out, "out", true);
  if (a.output.dtype != a.input.dtype) throw py::type_error("out: dtype differs from the input's");
  check_same_shape(a.input, a.output, "out", true);
  if (!PyTuple_Check(axes.ptr())) throw py::type_error("axes must be a tuple of ints");
  for (const py::handle h : py::reinterpret_borrow<py::tuple>(axes)) {
    const int axis = h.cast<int>();
    if (axis < 0 || axis >= a.input.ndim) throw py::value_error("axes: out of range");
    a.reduced |= 1u << axis;
  }
  // -1: lower-rank scale/bias align right; an axis: a 1-D one goes there (instance norm's (C,))
  const int channel_axis = int_of(args[12], "channel_axis");
  if (channel_axis < -1 || channel_axis >= a.input.ndim) throw py::value_error("channel_axis: out of range");
  a.scale = optional_param(scale, "scale", a.input, channel_axis);
  a.bias = optional_param(bias, "bias", a.input, channel_axis);
  const DType stats = a.input.dtype == DType::f64 ? DType::f64 : DType::f32;
  auto stats_view = [&](py::handle obj, const char* name) -> std::optional<TensorView> {
    if (obj.is_none()) return std::nullopt;
    TensorView v = view_of(obj, name, true);
    if (v.dtype != stats) throw py::type_error(std::string(name) + ": must be float32 (float64 for float64 input)");
    check_same_shape(a.input, v, name, false);
    for (int d = 0; d < v.ndim; ++d)
      if (v.sizes[d] != ((a.reduced >> d) & 1u ? 1 : a.input.sizes[d]))
        throw py::value_error(std::string(name) + ": must have the input's shape with reduced dims 1");
    return v;
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
  if (bool_of(args[13], "check_overlap") && overlaps_an_operand(a.output, a.input, {optional_ptr(a.scale), optional_ptr(a.bias)}))
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
//              statistics_terms, write_ga, channel_axis, explain) -> None, or the plan with explain
// The Python layer has validated the call and keeps grad_input off every operand's memory.
py::object py_mvn_backward(py::args args) {
  if (args.size() != 20) throw py::type_error("mvn_backward() takes 20 positional arguments");
  MvnBackwardArgs a;
  a.input = view_of(args[0], "input", false);
  a.grad_output = view_of(args[1], "grad_output", false);
  if (a.grad_output.dtype != a.input.dtype) throw py::type_error("grad_output: dtype differs from the input's");
  check_same_shape(a.input, a.grad_output, "grad_output", true);
  if (!PyTuple_Check(args[2].ptr())) throw py::type_error("axes must be a tuple of ints");
  for (const py::handle h : py::reinterpret_borrow<py::tuple>(args[2])) {
    const int axis = h.cast<int>();
    if (axis < 0 || axis >= a.input.ndim) throw py::value_error("axes: out of range");
    a.reduced |= 1u << axis;
  }
  const int channel_axis = int_of(args[18], "channel_axis");
  if (channel_axis < -1 || channel_axis >= a.input.ndim) throw py::value_error("channel_axis: out of range");
  a.mean = optional_param(args[3], "mean", a.input, channel_axis);
  a.inv_std = optional_param(args[4], "inv_std", a.input, channel_axis);
  a.scale = optional_param(args[5], "scale", a.input, channel_axis);
  a.bias = optional_param(args[6], "bias", a.input, channel_axis);
  a.fused_add = optional_param(args[7], "fused_add", a.input, -1);
  for (const auto* stats : {&a.mean, &a.inv_std})
    if (*stats)
      for (int d = 0; d < a.input.ndim; ++d)
        if (((a.reduced >> d) & 1u) && (*stats)->sizes[d] != 1)
          throw py::value_error("statistics: must have size 1 along the normalized axes");
  if (!args[8].is_none()) {
    a.grad_input = view_of(args[8], "grad_input", true);
    const DType want = bool_of(args[17], "write_ga") ? (a.input.dtype == DType::f64 ? DType::f64 : DType::f32)
                                                     : a.input.dtype;
    if (a.grad_input->dtype != want) throw py::type_error("grad_input: dtype differs from the input's (write_ga: its compute type's)");
    check_same_shape(a.input, *a.grad_input, "grad_input", true);
  }
  for (int o = 0; o < 2; ++o) {
    if (args[9 + o].is_none()) continue;
    TensorView v = view_of(args[9 + o], "parameter sums", true);
    if (v.dtype != DType::f64) throw py::type_error("parameter sums: must be float64");
    int64_t step = 8;
    for (int d = v.ndim - 1; d >= 0; --d) {
      if (v.sizes[d] != 1 && v.strides[d] != step) throw py::value_error("parameter sums: must be C-contiguous");
      step *= v.sizes[d];
    }
    a.param_sums[o] = v;
  }
  if (a.param_sums[0].has_value() != a.param_sums[1].has_value())
    throw py::value_error("parameter sums: both or neither");
  a.epsilon = double_of(args[11], "epsilon");
  a.normalize_mean = bool_of(args[12], "normalize_mean");
  a.normalize_variance = bool_of(args[13], "normalize_variance");
  a.epsilon_outside = bool_of(args[14], "epsilon_outside");
  a.activation = activation_of(args[15]);
  a.statistics_terms = bool_of(args[16], "statistics_terms");
  a.write_ga = bool_of(args[17], "write_ga");
  if (a.param_sums[0]) {
    // Their count must be that of scale and bias's broadcast shape (what the op folds them into).
    int64_t count = 1;
    for (int d = 0; d < a.input.ndim; ++d) {
      const bool varies = (a.scale && a.scale->sizes[d] != 1) || (a.bias && a.bias->sizes[d] != 1);
      if (varies) count *= a.input.sizes[d];
    }
    if (element_count(*a.param_sums[0]) != count || element_count(*a.param_sums[1]) != count)
      throw py::value_error("parameter sums: must have scale and bias's broadcast shape");
  }
  if (bool_of(args[19], "explain")) {
    std::string plan;
    mvn_backward(a, &plan);
    return py::str(plan);
  }
  run_without_gil(element_count(a.input), [&] { mvn_backward(a); });
  return py::none();
}

// The two hot entry points are plain METH_FASTCALL functions: pybind11's general dispatcher costs
// more than the rest of a small call put together.
// f returns a bool (returned as True/False) or a string (returned as str).
template <size_t N, class F>
PyObject* fastcall(PyObject* const* args, Py_ssize_t nargs, const char* name, F&& f) {
  try {
    if (nargs != static_cast<Py_ssize_t>(N))
      throw py::type_error(std::string(name) + "() takes " + std::to_string(N) + " positional arguments");
    if constexpr (std::is_same_v<decltype(f(args)), bool>) {
      return py::bool_(f(args)).release().ptr();
    } else {
      return py::str(f(args)).release().ptr();
    }
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (py::builtin_exception& e) {
    e.set_error();
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

constexpr size_t kBatchNormArgs = 10, kMvnArgs = 15;

PyObject* fast_batch_norm(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return fastcall<kBatchNormArgs>(args, nargs, "batch_norm", [](PyObject* const* a) { return py_batch_norm(a, nullptr); });
}

// mvn's last argument, var_out, may be left out (None).
template <class F>
PyObject* mvn_call(PyObject* const* args, Py_ssize_t nargs, const char* name, F&& f) {
  if (nargs != static_cast<Py_ssize_t>(kMvnArgs) - 1) return fastcall<kMvnArgs>(args, nargs, name, f);
  PyObject* full[kMvnArgs];
  std::copy(args, args + nargs, full);
  full[kMvnArgs - 1] = Py_None;
  return fastcall<kMvnArgs>(full, kMvnArgs, name, f);
}

PyObject* fast_mvn(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  return mvn_call(args, nargs, "mvn", [](PyObject* const* a) { return py_mvn(a, nullptr); });
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

PyMethodDef g_fast_methods[] = {
    {"batch_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_batch_norm)), METH_FASTCALL,
     "batch_norm(x, mean, variance, scale, bias, out, epsilon, activation, channel_axis, check_overlap) -> ran"},
    {"mvn", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(fast_mvn)), METH_FASTCALL,
     "mvn(x, axes, scale, bias, out, epsilon, normalize_mean, normalize_variance, epsilon_outside, activation, "
     "mean_out, inv_std_out, channel_axis, check_overlap[, var_out]) -> ran"},
    {"explain_batch_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(explain_batch_norm)),
     METH_FASTCALL, "explain_batch_norm(<batch_norm's arguments>) -> the plan batch_norm would run, as text"},
    {"explain_mvn", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(explain_mvn)), METH_FASTCALL,
     "explain_mvn(<mvn's arguments>) -> the plan mvn would run, as text"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "simdnorm kernels (see the simdnorm package for the public API)";
  m.attr("__version__") = SIMDNORM_VERSION;
  if (PyModule_AddFunctions(m.ptr(), g_fast_methods) != 0) throw py::error_already_set();
  m.def("mvn_backward", &py_mvn_backward,
        "mvn_backward(x, grad_output, axes, mean, inv_std, scale, bias, fused_add, grad_input, sum_gy, sum_g, "
        "epsilon, normalize_mean, normalize_variance, epsilon_outside, activation, statistics_terms, write_ga, "
        "channel_axis, explain)");
  m.def("isa", &active_isa, "The active instruction set.");
  m.def("available_isas", &available_isas, "Instruction sets this CPU and OS run, best first.");
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
      "set_bfloat16_dtype", [](const py::dtype& dt) { g_bfloat16_num = dt.num(); }, py::arg("dtype"));
}
