// What the numpy binding (module.cpp) and the torch kernels (torch_kernels.cpp) share: the views
// they build over the caller's memory, without a copy (a parameter seen with the input's rank,
// group norm's split channel dim, a statistics array seen as the input's shape with its reduced
// dims 1; std::invalid_argument reaches Python as ValueError), and the GIL released around a call.
#pragma once

#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "simdnorm/ops.h"

namespace simdnorm {

inline int64_t element_count(const TensorView& v) {
  int64_t n = 1;
  for (int d = 0; d < v.ndim; ++d) n *= v.sizes[d];
  return n;
}

// Below this many elements a call is over in microseconds: releasing and retaking the GIL would
// cost more than any other Python thread could gain.
constexpr int64_t kReleaseGilElements = 1 << 14;

// f() with the GIL released, where this thread holds it (torch calls its kernels without) and the
// call is large enough. Not pybind11's gil_scoped_release: a daemon thread that retakes the GIL
// while the interpreter finalizes is ended by pthread_exit (Python before 3.14), whose unwinding
// std::terminate stops at a noexcept frame, as that class's destructor is: the process aborted.
template <class F>
void run_without_gil(int64_t elements, F&& f) {
  if (elements < kReleaseGilElements || !PyGILState_Check()) return f();
  PyThreadState* const state = PyEval_SaveThread();
  try {
    f();
  } catch (...) {
    PyEval_RestoreThread(state);
    throw;
  }
  PyEval_RestoreThread(state);
}

// p seen with x's rank: a 1-D p goes to channel_axis when one is given (batch norm's (C,)
// parameters), otherwise dims align right (numpy broadcasting). Shapes are checked by the caller.
inline TensorView aligned_param(const TensorView& p, const TensorView& x, int channel_axis, const char* name) {
  if (p.ndim == x.ndim) return p;
  if (p.ndim > x.ndim) throw std::invalid_argument(std::string(name) + ": more dims than the input");
  const int first = channel_axis >= 0 && p.ndim == 1 ? channel_axis : x.ndim - p.ndim;
  if (first + p.ndim > x.ndim) throw std::invalid_argument(std::string(name) + ": channel_axis out of range");
  TensorView v = p;
  v.ndim = x.ndim;
  for (int d = 0; d < x.ndim; ++d) {
    const bool own = d >= first && d < first + p.ndim;
    v.sizes[d] = own ? p.sizes[d - first] : 1;
    v.strides[d] = own ? p.strides[d - first] : 0;
  }
  return v;
}

// v with dim d split into (groups, sizes[d] / groups), no copy: group norm's view (a size-1 dim,
// a broadcast parameter's, splits into (1, 1)).
inline TensorView split_dim(const TensorView& v, int d, int64_t groups) {
  if (v.ndim + 1 > kMaxViewDims) throw std::invalid_argument("groups: no room to split a dim");
  if (v.sizes[d] == 1) groups = 1;
  TensorView s = v;
  s.ndim = v.ndim + 1;
  for (int e = v.ndim; e > d + 1; --e) {
    s.sizes[e] = v.sizes[e - 1];
    s.strides[e] = v.strides[e - 1];
  }
  s.sizes[d] = groups;
  s.sizes[d + 1] = v.sizes[d] / groups;
  s.strides[d] = v.strides[d] * s.sizes[d + 1];
  s.strides[d + 1] = v.strides[d];
  return s;
}

// A statistics array of the input's shape with the reduced dims 1, as a view of the input's rank:
// any shape that agrees with that once the size-1 dims of both are dropped (the torch route hands
// group norm's (N, G) over for the split view's (N, G, 1, 1, 1), as it returns them).
inline TensorView kept_view(const TensorView& v, const TensorView& input, uint32_t reduced, const char* name) {
  const auto refuse = [name] {
    throw std::invalid_argument(std::string(name) + ": must have the input's shape with reduced dims 1");
  };
  TensorView k = v;
  k.ndim = input.ndim;
  int from = 0;  // v's next dim
  for (int d = 0; d < input.ndim; ++d) {
    k.sizes[d] = (reduced >> d) & 1u ? 1 : input.sizes[d];
    k.strides[d] = 0;
    if (k.sizes[d] == 1) continue;
    while (from < v.ndim && v.sizes[from] == 1) ++from;
    if (from == v.ndim || v.sizes[from] != k.sizes[d]) refuse();
    k.strides[d] = v.strides[from++];
  }
  for (; from < v.ndim; ++from)
    if (v.sizes[from] != 1) refuse();
  return k;
}

}  // namespace simdnorm
