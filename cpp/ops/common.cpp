#include "ops/common.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include "runtime/cpu.h"
#include "runtime/thread_pool.h"

namespace simdnorm {
namespace {
#include "simd/half.h"
}  // namespace

int64_t itemsize(DType dtype) {
  switch (dtype) {
    case DType::f32: return 4;
    case DType::f16: case DType::bf16: return 2;
    case DType::f64: return 8;
  }
  return 4;
}

double load_scalar(DType dtype, const char* p) {
  switch (dtype) {
    case DType::f32: { float v; std::memcpy(&v, p, 4); return v; }
    case DType::f64: { double v; std::memcpy(&v, p, 8); return v; }
    case DType::f16: { uint16_t b; std::memcpy(&b, p, 2); return f16_bits_to_float(b); }
    case DType::bf16: {
      uint16_t b;
      std::memcpy(&b, p, 2);
      return bf16_bits_to_float(b);
    }
  }
  return 0.0;
}

FoldedParams::FoldedParams(int ndim, const int64_t* sizes, const std::vector<Input>& inputs, int outputs,
                           DType compute, Fold fold, const void* ctx) {
  elsize_ = itemsize(compute);
  int64_t shape[kMaxDims];
  for (int d = 0; d < ndim; ++d) {
    shape[d] = 1;
    for (const Input& in : inputs)
      if (in.view != nullptr && in.view->sizes[d] != 1) shape[d] = sizes[d];
    count_ *= shape[d];
  }
  for (int d = ndim - 1, step = 1; d >= 0; --d) {
    strides_[d] = shape[d] == 1 ? 0 : step * elsize_;
    step *= static_cast<int>(shape[d]);
  }
  storage_.resize(static_cast<size_t>(count_ * elsize_ * outputs));
  const size_t nparams = inputs.size();
  std::vector<double> in(nparams), out(outputs);
  int64_t idx[kMaxDims] = {};
  for (int64_t flat = 0; flat < count_; ++flat) {
    for (size_t i = 0; i < nparams; ++i) {
      const TensorView* t = inputs[i].view;
      if (t == nullptr) {
        in[i] = inputs[i].absent_value;
        continue;
      }
      const char* p = t->data;
      for (int d = 0; d < ndim; ++d)
        if (t->sizes[d] != 1) p += idx[d] * t->strides[d];
      in[i] = load_scalar(t->dtype, p);
    }
    fold(in.data(), out.data(), ctx);
    for (int o = 0; o < outputs; ++o) {
      char* dst = data(o) + flat * elsize_;
      if (compute == DType::f64) std::memcpy(dst, &out[o], 8);
      else { const float f = static_cast<float>(out[o]); std::memcpy(dst, &f, 4); }
    }
    for (int d = ndim - 1; d >= 0; --d) {
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
    }
  }
}

void run_normalize(NormalizeTask task) {
  const int64_t total = element_count(task.loop);
  task.stream_stores = task.loop.data[kOut] != task.loop.data[kIn] &&
                       total * itemsize(task.dtype) >= kStreamingStoreBytes;
  const int parts = parts_for(total, kMinElementsPerThread);
  const KernelTable& k = kernels();
  if (parts == 1) return k.normalize(task, 0, total);
  // Boundaries on multiples of 64 elements keep threads off each other's output cache lines.
  const int64_t per = ((total + parts - 1) / parts + 63) / 64 * 64;
  parallel_for(parts, [&](int part) {
    const int64_t begin = part * per, end = begin + per < total ? begin + per : total;
    if (begin < end) k.normalize(task, begin, end);
  });
}

}  // namespace simdnorm
