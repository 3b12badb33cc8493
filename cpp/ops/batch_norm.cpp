// Batch normalization: fold the four parameters once per call over their broadcast shape (usually
// C values), then one planned elementwise pass:
//   out = act(fma(in - mean, scale / sqrt(var + eps), bias))
// Keeping (in - mean) rather than folding everything into one multiply-add (in * a + b) makes
// in == mean give exactly bias, and keeps the error of a large mean out of the result.
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <optional>

#include "ops/common.h"
#include "runtime/cpu.h"

namespace simdnorm {
namespace {

struct FoldContext {
  double epsilon;
  DType compute;
  bool scale_fits = true;  // set by fold_scale_into_mul

  // scale / sqrt(var + eps) into mul (and 1 / sqrt(var + eps) into inv_std unless null), and
  // whether all (and, into fits unless null, each) lie in the compute type's normal range; the
  // arithmetic is the active ISA's (kernels/lane_stats.h).
  bool scale_over_std(const double* const* in, double* mul, double* inv_std, uint8_t* fits, int64_t n) const {
    const bool f64 = compute == DType::f64;
    return kernels().scale_over_std_lanes(in[1], in[2], mul, inv_std, fits, n, epsilon, f64 ? DBL_MIN : FLT_MIN,
                                          f64 ? DBL_MAX : FLT_MAX);
  }
};

// in: mean, variance, scale, bias; out: shift, mul = scale / sqrt(var + eps), bias.
// A product that leaves the compute type's normal range while scale and 1/sqrt(var + eps) do not
// (scale 1e30 over var 1e-20, say) would overflow or lose bits that (in - mean) * mul * scale keeps:
// such a call clears scale_fits and takes the four-array form below.
void fold_scale_into_mul(const double* const* in, double* const* out, int64_t n, const void* ctx) {
  auto& c = *const_cast<FoldContext*>(static_cast<const FoldContext*>(ctx));
  c.scale_fits &= c.scale_over_std(in, out[1], nullptr, nullptr, n);
  std::copy(in[0], in[0] + n, out[0]);
  std::copy(in[3], in[3] + n, out[2]);
}

// fold_scale_into_mul of compact float32 inputs (FoldedParams::CompactFold): shift and bias copied
// (a float32's double rounds back to itself), mul by the active unit's float32 loop, the same
// arithmetic. Declines arrays not aligned to their floats.
bool fold_scale_into_mul_f32(DType compute, const char* const* in, char* const* out, int64_t n, const void* ctx) {
  auto& c = *const_cast<FoldContext*>(static_cast<const FoldContext*>(ctx));
  if (compute != DType::f32 || in[1] == nullptr || !FoldedParams::floats_aligned(in, 4)) return false;
  FoldedParams::copy_floats(in[0], out[0], n, 0.0f);
  FoldedParams::copy_floats(in[3], out[2], n, 0.0f);
  c.scale_fits &= kernels().scale_over_std_f32(reinterpret_cast<const float*>(in[1]),
                                                reinterpret_cast<const float*>(in[2]), reinterpret_cast<float*>(out[1]),
                                                n, c.epsilon, FLT_MIN, FLT_MAX);
  return true;
}

// in: mean, variance, scale, bias; out: shift, mul = 1 / sqrt(var + eps), scale, bias; except
// that a channel whose own scale / std fits keeps that product as mul (the same one as a folded
// call's), with a scale of 1: kept apart, its (in - mean) * inv_std could overflow where the result
// does not (in - mean 1e30, var 1e-20, scale 1e-10 gave inf beside a channel whose product was out
// of range, 1e30 alone).
void fold_separately(const double* const* in, double* const* out, int64_t n, const void* ctx) {
  const auto& c = *static_cast<const FoldContext*>(ctx);
  double product[FoldedParams::kChunk];
  uint8_t fits[FoldedParams::kChunk];
  c.scale_over_std(in, product, out[1], fits, n);
  for (int k : {0, 2, 3}) std::copy(in[k], in[k] + n, out[k]);
  for (int64_t i = 0; i < n; ++i)
    if (fits[i]) {
      out[1][i] = product[i];
      out[2][i] = 1.0;
    }
}

}  // namespace

void batch_norm(const BatchNormArgs& a, std::string* explain) {
  const TensorView& x = a.input;
  for (int d = 0; d < x.ndim; ++d)
    if (x.sizes[d] == 0) {
      if (explain != nullptr) *explain = "empty";
      return;
    }
  FoldContext ctx{a.epsilon, compute_type(x.dtype)};
  std::optional<FoldedParams> folded;
  auto fold = [&](std::initializer_list<int> operands, FoldedParams::Fold f, FoldedParams::CompactFold compact) {
    folded.emplace(x.ndim, x.sizes,
                   std::initializer_list<FoldedParams::Input>{{&a.mean, 0.0},
                                                              {&a.variance, 0.0},
                                                              {a.scale ? &*a.scale : nullptr, 1.0},
                                                              {a.bias ? &*a.bias : nullptr, 0.0}},
                   operands, ctx.compute, f, &ctx, nullptr, false, compact, coefficient_phase(a.output.data, x.dtype));
  };
  fold({kShift, kMul, kBias}, fold_scale_into_mul, fold_scale_into_mul_f32);
  const bool scale_folded = ctx.scale_fits;
  if (!scale_folded) fold({kShift, kMul, kScale, kBias}, fold_separately, nullptr);
  // A folded scale is not used. The contiguous loops never load it; the row stream and the gather
  // loop load it with stride 0 and ignore it, so one readable value is all it needs to be.
  static const double unread_scale = 0.0;
  Problem p;
  p.ndim = x.ndim;
  for (int d = 0; d < x.ndim; ++d) {
    p.sizes[d] = x.sizes[d];
    p.strides[kOut][d] = a.output.strides[d];
    p.strides[kIn][d] = x.strides[d];
    for (int op = kShift; op <= kBias; ++op) p.strides[op][d] = folded->strides()[d];
    if (scale_folded) p.strides[kScale][d] = 0;
  }
  p.data[kOut] = a.output.data;
  p.data[kIn] = x.data;
  for (int o = 0; o < folded->outputs(); ++o) p.data[folded->operand(o)] = folded->data(o);
  if (scale_folded) p.data[kScale] = const_cast<char*>(reinterpret_cast<const char*>(&unread_scale));
  NormalizeTask task;
  plan_elementwise(p, task.loop);
  lengthen_repeating_runs(task.loop, *folded, x.dtype);
  align_coefficients(task.loop, *folded, x.dtype);
  task.dtype = x.dtype;
  task.act = a.activation;
  task.scale_folded = scale_folded;
  plan_normalize(task);
  if (explain != nullptr) {
    *explain = describe_normalize(task) + (scale_folded ? "" : " scale-apart");
    return;
  }
  run_normalize(task);
}

void update_running_statistics(const TensorView& running_mean, const TensorView& running_var,
                               const TensorView& mean, const TensorView& var, int64_t count, double m, bool pytorch) {
  int64_t n = 1;
  for (int d = 0; d < mean.ndim; ++d) n *= mean.sizes[d];
  const double unbias = pytorch && count > 1 ? static_cast<double>(count) / static_cast<double>(count - 1) : 1.0;
  auto store = [](const TensorView& v, int64_t i, double value) {  // (memcpy: the buffers may be misaligned)
    if (v.dtype == DType::f32) {
      const float f = static_cast<float>(value);
      std::memcpy(v.data + i * 4, &f, 4);
    } else {
      std::memcpy(v.data + i * 8, &value, 8);
    }
  };
  auto at = [](const TensorView& v, int64_t i) {  // (typed: load_scalar is a converter call an element)
    if (v.dtype == DType::f32) {
      float f;
      std::memcpy(&f, v.data + i * 4, 4);
      return static_cast<double>(f);
    }
    double d;
    std::memcpy(&d, v.data + i * 8, 8);
    return d;
  };
  // The common case, the four arrays apart and aligned: the active unit's typed loops (thousands of
  // channels a call), the same arithmetic.
  auto bytes = [&](const TensorView& v) { return static_cast<uintptr_t>(n) * itemsize(v.dtype); };
  auto apart = [&](const TensorView& a, const TensorView& b) {
    const uintptr_t pa = reinterpret_cast<uintptr_t>(a.data), pb = reinterpret_cast<uintptr_t>(b.data);
    return pa + bytes(a) <= pb || pb + bytes(b) <= pa;
  };
  auto aligned = [](const TensorView& v) { return reinterpret_cast<uintptr_t>(v.data) % itemsize(v.dtype) == 0; };
  const bool typed = apart(running_mean, running_var) && apart(running_mean, mean) && apart(running_mean, var) &&
                     apart(running_var, mean) && apart(running_var, var) && aligned(running_mean) &&
                     aligned(running_var) && aligned(mean) && aligned(var) && running_mean.dtype == running_var.dtype &&
                     mean.dtype == var.dtype;
  if (typed) {
    kernels().update_running(RunningUpdateArgs{running_mean.data, running_var.data, mean.data, var.data,
                                               running_mean.dtype == DType::f64, mean.dtype == DType::f64, pytorch, n,
                                               m, unbias});
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    // (both read before either is written: the two buffers may be one)
    const double rm = at(running_mean, i), rv = at(running_var, i), bm = at(mean, i), bv = at(var, i);
    // (the products and sums in numpy's order, without contraction: -ffp-contract=off)
    store(running_mean, i, pytorch ? (1.0 - m) * rm + m * bm : m * rm + (1.0 - m) * bm);
    store(running_var, i, pytorch ? (1.0 - m) * rv + (m * bv) * unbias : m * rv + (1.0 - m) * bv);
  }
}

}  // namespace simdnorm
