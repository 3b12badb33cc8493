// The two operators, as the binding calls them. Inputs arrive validated by the Python layer
// (dtypes, ranks, parameter shapes); these functions plan, run on the thread pool, and return.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

#include "simdnorm/types.h"

namespace simdnorm {

// Bytes per element of a storage type.
int64_t itemsize(DType dtype);

// A strided N-d array as numpy describes it: sizes in elements, strides in bytes. The binding
// (view_of) fills every slot, zeros past ndim; the arrays have no initializer: zero-filling each
// view (GCC: `rep stos`, slow to start) would add up over the six views of a small call.
struct TensorView {
  char* data = nullptr;
  DType dtype = DType::f32;
  int ndim = 0;
  int64_t sizes[kMaxViewDims];
  int64_t strides[kMaxViewDims];
};

struct BatchNormArgs {
  TensorView input, output;
  TensorView mean, variance;                   // same ndim as input, each dim equal or 1
  std::optional<TensorView> scale, bias;
  double epsilon = 1e-5;
  Activation activation;
};

struct MvnArgs {
  TensorView input, output;                    // output unused (never written) with statistics_only
  uint32_t reduced = 0;                        // bit d set: dim d is reduced
  std::optional<TensorView> scale, bias;       // same ndim as input, each dim equal or 1
  double epsilon = 1e-5;
  bool normalize_mean = true;
  bool normalize_variance = true;
  bool epsilon_outside = false;                // 1 / (sqrt(var) + eps) instead of 1 / sqrt(var + eps)
  Activation activation;
  std::optional<TensorView> mean_out, inv_std_out;  // compute type, input's shape with reduced dims 1
  // The variance, beside inv_std_out (which it needs): same dtype, shape and strides, so that it
  // lies at a fixed distance from it.
  std::optional<TensorView> var_out;
  // Only the statistics, in float64 whatever the input's type (simdnorm.moments: partial statistics
  // merged later, which float32 rounding of each part's mean would spoil); no normalize pass.
  bool statistics_only = false;
};

// The backward of MVN (and of batch norm, MVN over every dim but the channel's): grad_input and the
// parameters' sums, from grad_output, the input and the forward's statistics (kernels/backward.h
// gives the formulas). The statistics and the parameters are broadcast against the input as in
// the forward ops.
struct MvnBackwardArgs {
  TensorView input, grad_output;
  std::optional<TensorView> grad_input;        // written: dx, or dy * act'(pre) with write_ga
  uint32_t reduced = 0;                        // the dims the statistics were taken over
  std::optional<TensorView> mean, inv_std;     // absent: 0 and 1
  bool variance_given = false;                 // inv_std holds the variance: u = 1 / sqrt(it + epsilon)
  std::optional<TensorView> scale, bias, fused_add;
  double epsilon = 1e-5;
  bool normalize_mean = true, normalize_variance = true, epsilon_outside = false;
  // The statistics depend on the input (training): grad_input takes the terms of their gradients.
  bool statistics_terms = true;
  bool write_ga = false;
  Activation activation;
  // sum(ga y) and sum(ga), each when given: C-contiguous over the broadcast shape of scale and bias,
  // float64 (summed further by the caller) or float32 (rounded once from the double sums).
  std::optional<TensorView> param_sums[2];
};

// With `explain` set, nothing runs: the plan that would run is described there instead (which loop
// nest, which inner loop), so tests can check that a layout takes the path meant for it.
void batch_norm(const BatchNormArgs& args, std::string* explain = nullptr);
void mean_variance_normalization(const MvnArgs& args, std::string* explain = nullptr);
void mvn_backward(const MvnBackwardArgs& args, std::string* explain = nullptr);

// Batch norm training's running statistics, updated in place from the batch's mean and (population)
// variance over `count` elements, in double, each result rounded once into its buffer: PyTorch's
// convention (r = (1 - m) r + m b, the variance unbiased by count / (count - 1)) or ONNX's (r = m r
// + (1 - m) b). Every array C-contiguous with one element count; the running ones float32 or
// float64, the batch's float32 or float64.
void update_running_statistics(const TensorView& running_mean, const TensorView& running_var,
                               const TensorView& mean, const TensorView& var, int64_t count, double momentum,
                               bool pytorch);

}  // namespace simdnorm
