// Plain data shared by the planner, the kernels and the binding. Nothing here computes: this header
// is included by translation units compiled with different instruction-set flags, and only POD types
// and constants may cross that boundary (an inline function would be compiled once per ISA and the
// linker would keep an arbitrary copy).
#pragma once
#include <cstddef>
#include <cstdint>

namespace simdnorm {

// Dims of a user's tensor.
constexpr int kMaxDims = 8;
// Dims of a view an op takes: group norm views the channel dim as (groups, channels per group).
constexpr int kMaxViewDims = kMaxDims + 1;
// Dims of a planned loop nest: a reduction puts a unit kept dim before its reduced ones when every
// dim is reduced (or a unit reduced dim after its kept ones), one more than the view's.
constexpr int kMaxNestDims = kMaxViewDims + 1;

// Element types of the input/output. Coefficients and statistics are always the compute type:
// float32 for f32/f16/bf16 data, float64 for f64 data.
enum class DType : int { f32 = 0, f16 = 1, bf16 = 2, f64 = 3 };
constexpr int kNumDTypes = 4;

// The fused activations, in the order the Python layer's table lists them (python/simdnorm/_activation.py).
enum class ActKind : int {
  identity = 0, linear, relu, leaky_relu, thresholded_relu, elu, celu, scaled_elu, sigmoid,
  hard_sigmoid, tanh, scaled_tanh, softplus, parametric_softplus, softsign, shrink, gelu, clip, silu,
  hard_swish,
};
constexpr int kNumActs = 20;
// The activations the kernels apply inline, in every loop (kernels/activations.h): identity, relu
// and the piecewise-linear ones. Each other one is a call (a vector, or a block of vectors) and
// bounds its loop by itself (gelu: 7-10x relu's time): those run in fewer loops (no periodic
// stream across runs, no fused rows). A unit may take fewer inline (the x86 fallback unit):
// the planners read the unit's KernelTable::inline_activations.
constexpr bool kActInline[kNumActs] = {
    true,   // identity
    true,   // linear
    true,   // relu
    true,   // leaky_relu
    false,  // thresholded_relu
    false,  // elu
    false,  // celu
    false,  // scaled_elu
    false,  // sigmoid
    true,   // hard_sigmoid
    false,  // tanh
    false,  // scaled_tanh
    false,  // softplus
    false,  // parametric_softplus
    false,  // softsign
    false,  // shrink
    false,  // gelu
    true,   // clip
    false,  // silu
    false,  // hard_swish
};

struct Activation {
  ActKind kind = ActKind::identity;
  double p0 = 0.0;  // meaning depends on kind (alpha, steepness, min, bias, ...)
  double p1 = 0.0;  // second parameter (beta, gamma, max, threshold, ...)
};

// The smallest L1 data cache of the x86 cores the kernels are tuned for (32 KB; 48 KB on Intel
// since Ice Lake): what the kernels assume where the size is not known.
constexpr int64_t kMinL1DataBytes = int64_t(32) << 10;
// A cache line: the unit the loops align their stores to and prefetch by.
constexpr int64_t kLineBytes = 64;
// A page: a load waits on an earlier store to the same address modulo this (4K aliasing).
constexpr int64_t kPageBytes = 4096;

// The one elementwise operation both ops end in:
//   out = act(fma((in - shift) * mul, scale, bias))
// MVN: shift = group mean, mul = group 1/std, scale and bias = its optional parameters.
// Batch norm folds its scale into mul (NormalizeTask::scale_folded):
//   out = act(fma(in - shift, mul, bias)),  shift = mean, mul = scale/sqrt(var + eps), bias.
// So does MVN without scale and bias (scale 1, bias 0): fma(in - mean, 1/std, 0) has the values of
// fma((in - mean) * (1/std), 1, 0), with one multiply fewer.
// shift/mul/scale/bias point to compute-type (float or double) arrays addressed with byte strides.
enum Operand : int { kOut = 0, kIn = 1, kShift = 2, kMul = 3, kScale = 4, kBias = 5, kNumOperands = 6 };

// The backward ops' operands, in the same six slots of a plan (the planner orders and merges any
// six): grad_input is written, input and grad_output read; the statistics and the parameters are
// compact compute-type arrays (ops/backward.cpp), fused_add read where an activation needs it.
enum BackwardOperand : int { kGradIn = kOut, kX = kIn, kGradOut = kShift, kStats = kMul, kParams = kScale,
                             kFusedAdd = kBias };

// A strided iteration space after planning: dims ordered outermost first, innermost last.
struct LoopNest {
  int ndim = 0;
  int64_t sizes[kMaxNestDims] = {};
  int64_t strides[kNumOperands][kMaxNestDims] = {};  // bytes
  char* data[kNumOperands] = {};
};

// The loop a normalize task runs over its nest's rows (the two innermost dims), chosen once per task
// (plan_inner_loop, ops/common.cpp), switched on by the kernel (kernels/normalize.h) and printed by
// explain. The coefficient pairs (shift, mul) and (scale, bias) are each constant along a run or
// contiguous beside it ("vary"); any other strides take the strided loop.
enum class InnerLoop : int {
  strided,          // any strides: a vector's worth gathered, computed, scattered
  contiguous,       // each run on its own
  row_stream,       // runs back to back, coefficients constant per run: one stream across runs
  periodic_stream,  // runs back to back reading the same coefficient arrays: one stream
  column_blocks,    // runs too wide for the L1 with their coefficient arrays: blocks of columns
};
struct InnerPlan {
  InnerLoop loop = InnerLoop::strided;
  bool stats_vary = false, affine_vary = false;
  int64_t block_columns = 0;  // column_blocks: the columns a block spans (whole output lines)
};
// Runs up to this long may take the periodic stream (its copies of the coefficients are on the stack).
constexpr int64_t kPeriodicMaxRun = 2048;

struct NormalizeTask {
  LoopNest loop;
  DType dtype = DType::f32;
  Activation act;
  // Non-temporal stores for outputs much larger than the caches (never for in-place work, whose
  // lines are already cached).
  bool stream_stores = false;
  // mul already holds mul * scale (or the scale is 1): the kernel computes
  // act(fma(in - shift, mul, bias)) and never reads the scale operand.
  bool scale_folded = false;
  // The L1 data cache, bytes: loops whose rows outgrow it run in blocks of columns.
  int64_t l1_bytes = kMinL1DataBytes;
  InnerPlan inner;
};

// Moments of one normalization group, the unit that chunks merge into (Chan et al.): count, mean,
// and the sum of squared deviations from the mean.
struct Moments {
  double count = 0.0;
  double mean = 0.0;
  double m2 = 0.0;
};

}  // namespace simdnorm
