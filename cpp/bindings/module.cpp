// The one binding file: numpy arrays -> TensorViews, GIL released around the ops. No algorithm here.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>

#include "runtime/cpu.h"
#include "runtime/thread_pool.h"
#include "simdnorm/ops.h"

namespace py = pybind11;
using namespace simdnorm;

namespace {

int g_bfloat16_num = -1;  // numpy type number of ml_dtypes.bfloat16, registered at import

DType dtype_of(const py::array& a, const char* name) {
  const py::dtype dt = a.dtype();
  if (dt.byteorder() == '>') throw py::type_error(std::string(name) + ": non-native byte order");
  const int num = dt.num();
  if (num == py::detail::npy_api::NPY_FLOAT_) return DType::f32;
  if (num == py::detail::npy_api::NPY_DOUBLE_) return DType::f64;
  if (num == 23 /* NPY_HALF */) return DType::f16;
  if (num == g_bfloat16_num && g_bfloat16_num >= 0) return DType::bf16;
  throw py::type_error(std::string(name) + ": unsupported dtype " + py::str(dt).cast<std::string>() +
                       " (accepted: float32, float16, bfloat16, float64)");
}

TensorView view_of(const py::handle& obj, const char* name, bool writeable) {
  if (!py::isinstance<py::array>(obj)) throw py::type_error(std::string(name) + " must be a numpy.ndarray");
  const auto a = py::reinterpret_borrow<py::array>(obj);
  TensorView v;
  v.dtype = dtype_of(a, name);
  v.ndim = static_cast<int>(a.ndim());
  if (v.ndim < 1 || v.ndim > kMaxDims)
    throw py::value_error(std::string(name) + ": expected 1 to 8 dimensions, got " + std::to_string(v.ndim));
  if (writeable && !a.writeable()) throw py::value_error(std::string(name) + " is read-only");
  v.data = static_cast<char*>(const_cast<void*>(a.data()));
  for (int d = 0; d < v.ndim; ++d) {
    v.sizes[d] = a.shape(d);
    v.strides[d] = a.strides(d);
  }
  return v;
}

std::optional<TensorView> optional_view(const py::object& obj, const char* name) {
  if (obj.is_none()) return std::nullopt;
  return view_of(obj, name, false);
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

Activation activation_of(const py::tuple& t) {
  Activation act;
  const int kind = t[0].cast<int>();
  if (kind < 0 || kind >= kNumActs) throw py::value_error("activation: unknown kind");
  act.kind = static_cast<ActKind>(kind);
  act.p0 = t[1].cast<double>();
  act.p1 = t[2].cast<double>();
  return act;
}

void py_batch_norm(const py::object& x, const py::object& mean, const py::object& variance,
                   const py::object& scale, const py::object& bias, const py::object& out, double epsilon,
                   const py::tuple& activation) {
  BatchNormArgs a;
  a.input = view_of(x, "input", false);
  a.output = view_of(out, "out", true);
  if (a.output.dtype != a.input.dtype) throw py::type_error("out: dtype differs from the input's");
  check_same_shape(a.input, a.output, "out", true);
  a.mean = view_of(mean, "mean", false);
  a.variance = view_of(variance, "variance", false);
  a.scale = optional_view(scale, "scale");
  a.bias = optional_view(bias, "bias");
  check_param(a.input, a.mean, "mean");
  check_param(a.input, a.variance, "variance");
  if (a.scale) check_param(a.input, *a.scale, "scale");
  if (a.bias) check_param(a.input, *a.bias, "bias");
  a.epsilon = epsilon;
  a.activation = activation_of(activation);
  py::gil_scoped_release release;
  batch_norm(a);
}

void py_mvn(const py::object& x, const py::tuple& axes, const py::object& scale, const py::object& bias,
            const py::object& out, double epsilon, bool normalize_mean, bool normalize_variance,
            bool epsilon_outside, const py::tuple& activation, const py::object& mean_out,
            const py::object& inv_std_out) {
  MvnArgs a;
  a.input = view_of(x, "input", false);
  a.output = view_of(out, "out", true);
  if (a.output.dtype != a.input.dtype) throw py::type_error("out: dtype differs from the input's");
  check_same_shape(a.input, a.output, "out", true);
  for (const py::handle& h : axes) {
    const int axis = h.cast<int>();
    if (axis < 0 || axis >= a.input.ndim) throw py::value_error("axes: out of range");
    a.reduced |= 1u << axis;
  }
  a.scale = optional_view(scale, "scale");
  a.bias = optional_view(bias, "bias");
  if (a.scale) check_param(a.input, *a.scale, "scale");
  if (a.bias) check_param(a.input, *a.bias, "bias");
  const DType stats = a.input.dtype == DType::f64 ? DType::f64 : DType::f32;
  auto stats_view = [&](const py::object& obj, const char* name) -> std::optional<TensorView> {
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
  a.epsilon = epsilon;
  a.normalize_mean = normalize_mean;
  a.normalize_variance = normalize_variance;
  a.epsilon_outside = epsilon_outside;
  a.activation = activation_of(activation);
  py::gil_scoped_release release;
  mean_variance_normalization(a);
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "simdnorm kernels (see the simdnorm package for the public API)";
  m.attr("__version__") = SIMDNORM_VERSION;
  m.def("batch_norm", &py_batch_norm, py::arg("x"), py::arg("mean"), py::arg("variance"), py::arg("scale"),
        py::arg("bias"), py::arg("out"), py::arg("epsilon"), py::arg("activation"));
  m.def("mvn", &py_mvn, py::arg("x"), py::arg("axes"), py::arg("scale"), py::arg("bias"), py::arg("out"),
        py::arg("epsilon"), py::arg("normalize_mean"), py::arg("normalize_variance"),
        py::arg("epsilon_outside"), py::arg("activation"), py::arg("mean_out"), py::arg("inv_std_out"));
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
