// Batch normalization: fold the four parameters once per call into (shift, mul, scale, bias) over
// their broadcast shape (usually C values), then one planned elementwise pass:
//   out = act(fma((in - mean) * 1/sqrt(var + eps), scale, bias))
// Keeping (in - mean) rather than folding everything into one multiply-add makes in == mean give
// exactly bias, at no cost in a memory-bound loop.
#include <algorithm>
#include <cmath>

#include "ops/common.h"

namespace simdnorm {
namespace {

// in: mean, variance, scale, bias; out: shift, mul, scale, bias.
void fold_batch_norm(const double* const* in, double* const* out, int64_t n, const void* ctx) {
  const double eps = *static_cast<const double*>(ctx);
  // Distinct arrays (restrict): the square roots and divisions vectorize.
  const double* __restrict var = in[1];
  double* __restrict mul = out[1];
  for (int64_t k = 0; k < n; ++k) mul[k] = 1.0 / std::sqrt(var[k] + eps);  // < 0 -> NaN, 0 -> inf (SPEC §2)
  for (int c : {0, 2, 3}) std::copy(in[c], in[c] + n, out[c]);
}

}  // namespace

void batch_norm(const BatchNormArgs& a, std::string* explain) {
  const TensorView& x = a.input;
  for (int d = 0; d < x.ndim; ++d)
    if (x.sizes[d] == 0) {
      if (explain != nullptr) *explain = "empty";
      return;
    }
  const DType compute = compute_type(x.dtype);
  FoldedParams folded(x.ndim, x.sizes,
                      {{&a.mean, 0.0}, {&a.variance, 0.0}, {a.scale ? &*a.scale : nullptr, 1.0},
                       {a.bias ? &*a.bias : nullptr, 0.0}},
                      4, compute, fold_batch_norm, &a.epsilon);
  Problem p;
  p.ndim = x.ndim;
  for (int d = 0; d < x.ndim; ++d) {
    p.sizes[d] = x.sizes[d];
    p.strides[kOut][d] = a.output.strides[d];
    p.strides[kIn][d] = x.strides[d];
    for (int op = kShift; op <= kBias; ++op) p.strides[op][d] = folded.strides()[d];
  }
  p.data[kOut] = a.output.data;
  p.data[kIn] = x.data;
  for (int op = kShift; op <= kBias; ++op) p.data[op] = folded.data(op - kShift);
  NormalizeTask task;
  plan_elementwise(p, task.loop);
  lengthen_repeating_runs(task.loop, folded, x.dtype);
  align_coefficients(task.loop, folded, kShift, x.dtype);
  task.dtype = x.dtype;
  task.act = a.activation;
  task.stream_stores = wants_stream_stores(task);
  if (explain != nullptr) {
    *explain = describe_normalize(task);
    return;
  }
  run_normalize(task);
}

}  // namespace simdnorm
