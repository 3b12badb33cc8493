#include "ops/common.h"

#include <cmath>
#include <cstdint>
#include <cstring>

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

#include "runtime/cpu.h"
#include "runtime/thread_pool.h"
#include "simdnorm/check.h"

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

void load_as_double(DType dtype, const char* p, int64_t stride, int64_t n, double* out) {
  auto each = [&](auto load, auto size) {
    constexpr int64_t kSize = decltype(size)::value;
    if (stride == kSize) {  // (the constant stride's loop vectorizes: thousands of channels a call)
      for (int64_t i = 0; i < n; ++i) out[i] = load(p + i * kSize);
    } else {
      for (int64_t i = 0; i < n; ++i) out[i] = load(p + i * stride);
    }
  };
  using Four = std::integral_constant<int64_t, 4>;
  using Two = std::integral_constant<int64_t, 2>;
  switch (dtype) {  // outside the loop
    case DType::f32: return each([](const char* q) { float v; std::memcpy(&v, q, 4); return double(v); }, Four{});
    case DType::f64:
      return each([](const char* q) { double v; std::memcpy(&v, q, 8); return v; }, std::integral_constant<int64_t, 8>{});
    case DType::f16:
      return each([](const char* q) { uint16_t b; std::memcpy(&b, q, 2); return double(f16_bits_to_float(b)); }, Two{});
    case DType::bf16:
      return each([](const char* q) { uint16_t b; std::memcpy(&b, q, 2); return double(bf16_bits_to_float(b)); }, Two{});
  }
}

double load_scalar(DType dtype, const char* p) {
  double v = 0.0;
  load_as_double(dtype, p, 0, 1, &v);
  return v;
}

FoldedParams::FoldedParams(int ndim, const int64_t* sizes, std::initializer_list<Input> inputs,
                           std::initializer_list<int> operands, DType compute, Fold fold, const void* ctx,
                           const int* order, bool kept, CompactFold compact_fold, int64_t phase) {
  SIMDNORM_CHECK(ndim >= 0 && ndim <= kMaxViewDims);
  SIMDNORM_CHECK(operands.size() <= kMaxInputs && inputs.size() <= kMaxInputs);
  elsize_ = itemsize(compute);
  outputs_ = static_cast<int>(operands.size());
  std::copy(operands.begin(), operands.end(), operands_);
  const int outputs = outputs_;
  const int nin = static_cast<int>(inputs.size());
  const Input* in = inputs.begin();
  // The broadcast shape, reduced to its dims of size > 1 (in `order`), with each input's byte
  // stride on them.
  int nd = 0;
  int64_t shape[kMaxViewDims], in_strides[kMaxInputs][kMaxViewDims];
  for (int k = 0; k < ndim; ++k) {
    const int d = order != nullptr ? order[k] : k;
    bool varies = false;
    for (int i = 0; i < nin; ++i) varies |= in[i].view != nullptr && in[i].view->sizes[d] != 1;
    int64_t step = 1;
    for (int j = k + 1; j < ndim; ++j) {
      const int e = order != nullptr ? order[j] : j;
      bool v = false;
      for (int i = 0; i < nin; ++i) v |= in[i].view != nullptr && in[i].view->sizes[e] != 1;
      if (v) step *= sizes[e];
    }
    strides_[d] = varies && sizes[d] != 1 ? step * elsize_ : 0;
    if (!varies || sizes[d] == 1) continue;
    shape[nd] = sizes[d];
    for (int i = 0; i < nin; ++i)
      in_strides[i][nd] = in[i].view != nullptr && in[i].view->sizes[d] != 1 ? in[i].view->strides[d] : 0;
    count_ *= sizes[d];
    ++nd;
  }
  const int64_t array_bytes = count_ * elsize_;
  pitch_ = phase < 0 ? array_bytes : (array_bytes + kLineBytes - 1) / kLineBytes * kLineBytes;
  const int64_t slack = phase < 0 ? 0 : kLineBytes + phase;
  const size_t bytes = static_cast<size_t>(pitch_ * outputs + slack);
  if (bytes > sizeof local_ && kept) {
    storage_ = kept_storage_.reserve(bytes);
  } else if (bytes > sizeof local_) {
    heap_.reset(new char[bytes]);
    storage_ = heap_.get();
  }
  if (phase >= 0) storage_ += (kLineBytes - reinterpret_cast<uintptr_t>(storage_) % kLineBytes) % kLineBytes + phase;
  // Whether every input given is compact in the compute type: its elements in the arrays' order.
  bool compact = true;
  for (int i = 0; i < nin && compact; ++i) {
    if (in[i].view == nullptr) continue;
    compact = in[i].view->dtype == compute;
    int64_t step = elsize_;
    for (int d = nd - 1; d >= 0 && compact; --d) {
      compact = in_strides[i][d] == step;
      step *= shape[d];
    }
  }
  if (compact && compact_fold != nullptr) {
    const char* in_data[kMaxInputs] = {};
    char* out_data[kMaxInputs] = {};
    for (int i = 0; i < nin; ++i) in_data[i] = in[i].view != nullptr ? in[i].view->data : nullptr;
    for (int o = 0; o < outputs; ++o) out_data[o] = data(o);
    if (compact_fold(compute, in_data, out_data, count_, ctx)) return;
  }
  // No fold (each output its input): inputs already compact in the compute type are copied as
  // they are (per-element layer norm parameters: thousands of elements, each call).
  if (fold == nullptr) {
    SIMDNORM_CHECK(nin == outputs);
    if (compact) {
      for (int i = 0; i < nin; ++i) {
        if (in[i].view != nullptr) {
          std::memcpy(data(i), in[i].view->data, static_cast<size_t>(array_bytes));
        } else if (compute == DType::f64) {
          std::fill_n(reinterpret_cast<double*>(data(i)), count_, in[i].absent_value);
        } else {
          std::fill_n(reinterpret_cast<float*>(data(i)), count_, static_cast<float>(in[i].absent_value));
        }
      }
      return;
    }
  }
  // Chunks of the flat broadcast index: gather each input (its dtype switch outside the loop),
  // fold the chunk, store it; no temporaries beyond the stack.
  double vin[kMaxInputs][kChunk], vout[kMaxInputs][kChunk];
  const double* in_rows[kMaxInputs];
  double* out_rows[kMaxInputs];
  for (int i = 0; i < kMaxInputs; ++i) {
    in_rows[i] = vin[i];
    out_rows[i] = vout[i];
  }
  for (int64_t c0 = 0; c0 < count_; c0 += kChunk) {
    const int64_t n = count_ - c0 < kChunk ? count_ - c0 : kChunk;
    for (int i = 0; i < nin; ++i) {
      if (in[i].view == nullptr) {
        std::fill(vin[i], vin[i] + n, in[i].absent_value);
        continue;
      }
      // Position of element c0 of the broadcast shape in input i (no dims: one element).
      const char* p = in[i].view->data;
      int64_t rem = c0, idx[kMaxViewDims] = {};
      for (int d = nd - 1; d >= 0; --d) {
        idx[d] = rem % shape[d];
        rem /= shape[d];
        p += idx[d] * in_strides[i][d];
      }
      // A tight loop along the innermost dim; the odometer carries through the outer dims only at
      // the end of each run (per-channel parameters are one run).
      const int inner = nd > 0 ? nd - 1 : 0;
      const int64_t run_len = nd > 0 ? shape[inner] : 1, step = nd > 0 ? in_strides[i][inner] : 0;
      auto gather = [&](auto load) {
        for (int64_t k = 0; k < n;) {
          const int64_t run = std::min(n - k, run_len - idx[inner]);
          for (int64_t j = 0; j < run; ++j) vin[i][k + j] = load(p + j * step);
          k += run;
          p += run * step;
          idx[inner] += run;
          if (idx[inner] < run_len) continue;
          p -= run_len * step;
          idx[inner] = 0;
          for (int d = inner - 1; d >= 0; --d) {
            p += in_strides[i][d];
            if (++idx[d] < shape[d]) break;
            p -= idx[d] * in_strides[i][d];
            idx[d] = 0;
          }
        }
      };
      // (a run of one-after-another float or double elements, aligned to their size: a loop that
      // vectorizes)
      const int64_t es = static_cast<int64_t>(itemsize(in[i].view->dtype));
      const bool unit = step == es && reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(es) == 0;
      switch (in[i].view->dtype) {
        case DType::f32:
          if (unit && idx[inner] + n <= run_len) {
            const float* q = reinterpret_cast<const float*>(p);
            for (int64_t k = 0; k < n; ++k) vin[i][k] = static_cast<double>(q[k]);
            break;
          }
          gather([](const char* q) { float v; std::memcpy(&v, q, 4); return double(v); });
          break;
        case DType::f64:
          if (unit && idx[inner] + n <= run_len) {
            std::memcpy(vin[i], p, static_cast<size_t>(n) * 8);
            break;
          }
          gather([](const char* q) { double v; std::memcpy(&v, q, 8); return v; });
          break;
        case DType::f16: gather([](const char* q) { return load_scalar(DType::f16, q); }); break;
        case DType::bf16: gather([](const char* q) { return load_scalar(DType::bf16, q); }); break;
      }
    }
    if (fold != nullptr) fold(in_rows, out_rows, n, ctx);
    else
      for (int o = 0; o < outputs; ++o) std::copy(vin[o], vin[o] + n, vout[o]);
    for (int o = 0; o < outputs; ++o) {
      char* dst = data(o) + c0 * elsize_;
      if (compute == DType::f64) {
        std::memcpy(dst, vout[o], static_cast<size_t>(n) * 8);
      } else {
        float* f = reinterpret_cast<float*>(dst);  // (the storage: aligned for its compute type)
        for (int64_t k = 0; k < n; ++k) f[k] = static_cast<float>(vout[o][k]);
      }
    }
  }
}

void FoldedParams::repeat(int64_t copies) {
  const size_t array_bytes = static_cast<size_t>(count_ * elsize_);
  const size_t bytes = array_bytes * static_cast<size_t>(copies * outputs_);
  std::unique_ptr<char[]> grown(new char[bytes]);
  char* to = grown.get();
  for (int o = 0; o < outputs_; ++o)
    for (int64_t c = 0; c < copies; ++c) std::memcpy(to + (o * copies + c) * array_bytes, data(o), array_bytes);
  heap_ = std::move(grown);
  storage_ = to;
  count_ *= copies;
  pitch_ = count_ * elsize_;
}

void FoldedParams::spread_inner(int first, int ndim, const int64_t* sizes) {
  int64_t copies = 1;
  for (int d = first; d < ndim; ++d) {
    SIMDNORM_CHECK(strides_[d] == 0);
    copies *= sizes[d];
  }
  int64_t step = elsize_;
  for (int d = ndim - 1; d >= first; --d) {
    strides_[d] = sizes[d] == 1 ? 0 : step;
    step *= sizes[d];
  }
  for (int d = 0; d < first; ++d) strides_[d] *= copies;
  const int64_t count = count_ * copies;
  // (One FoldedParams a thread spreads at a time: an MVN call's scale and bias.)
  char* const base = spread_scratch_.reserve(static_cast<size_t>(count * elsize_ * outputs_ + kLineBytes));
  char* to = base + (kLineBytes - reinterpret_cast<uintptr_t>(base) % kLineBytes) % kLineBytes;
  auto spread = [&](auto* dst, const auto* from) {
    for (int64_t e = 0; e < count_; ++e) std::fill_n(dst + e * copies, copies, from[e]);
  };
  for (int o = 0; o < outputs_; ++o) {
    char* dst = to + o * count * elsize_;
    if (elsize_ == 8) spread(reinterpret_cast<double*>(dst), reinterpret_cast<const double*>(data(o)));
    else spread(reinterpret_cast<float*>(dst), reinterpret_cast<const float*>(data(o)));
  }
  heap_.reset();  // (the old storage is no longer read)
  storage_ = to;
  count_ = count;
  pitch_ = count_ * elsize_;
}

namespace {
// fn(idx) for every index of the dims `shape` (nd of them), row-major.
template <class Fn>
void for_each_index(int nd, const int64_t* shape, Fn&& fn) {
  int64_t idx[kMaxViewDims] = {};
  for (bool more = true; more;) {
    fn(static_cast<const int64_t*>(idx));
    more = false;
    for (int k = nd - 1; k >= 0 && !more; --k) {
      more = ++idx[k] < shape[k];
      if (!more) idx[k] = 0;
    }
  }
}
}  // namespace

std::vector<int64_t> FoldedParams::spread_like(const FoldedParams& layout, int ndim, const int64_t* sizes) {
  SIMDNORM_CHECK(layout.elsize_ == elsize_);
  int nd = 0;
  int64_t shape[kMaxViewDims], to_step[kMaxViewDims], from_step[kMaxViewDims];
  for (int d = 0; d < ndim; ++d) {
    SIMDNORM_CHECK(strides_[d] == 0 || layout.strides_[d] != 0);
    if (layout.strides_[d] == 0) continue;
    shape[nd] = sizes[d], to_step[nd] = layout.strides_[d] / elsize_, from_step[nd] = strides_[d] / elsize_;
    ++nd;
  }
  // Each index of the dims `layout` varies along gives one new element.
  const int64_t count = layout.count_;
  std::vector<int64_t> from(static_cast<size_t>(count), -1);
  int64_t visited = 0;
  for_each_index(nd, shape, [&](const int64_t* idx) {
    int64_t to = 0, at = 0;
    for (int k = 0; k < nd; ++k) to += idx[k] * to_step[k], at += idx[k] * from_step[k];
    SIMDNORM_CHECK(to >= 0 && to < count && from[static_cast<size_t>(to)] < 0);
    from[static_cast<size_t>(to)] = at;
    ++visited;
  });
  SIMDNORM_CHECK(visited == count);
  std::unique_ptr<char[]> grown(new char[static_cast<size_t>(count * elsize_ * outputs_)]);
  auto copy = [&](auto* dst, const auto* src) {
    for (int64_t e = 0; e < count; ++e) dst[e] = src[from[static_cast<size_t>(e)]];
  };
  for (int o = 0; o < outputs_; ++o) {
    char* dst = grown.get() + o * count * elsize_;
    if (elsize_ == 8) copy(reinterpret_cast<double*>(dst), reinterpret_cast<const double*>(data(o)));
    else copy(reinterpret_cast<float*>(dst), reinterpret_cast<const float*>(data(o)));
  }
  heap_ = std::move(grown);
  storage_ = heap_.get();
  std::copy(layout.strides_, layout.strides_ + kMaxViewDims, strides_);
  count_ = count;
  pitch_ = count_ * elsize_;
  return from;
}

std::vector<int64_t> FoldedParams::row_major_indices(int ndim, const int64_t* sizes) const {
  int nd = 0;
  int64_t shape[kMaxViewDims], step[kMaxViewDims];
  for (int d = 0; d < ndim; ++d)
    if (strides_[d] != 0) shape[nd] = sizes[d], step[nd] = strides_[d] / elsize_, ++nd;
  bool in_order = true;  // (the arrays row-major already: every element its own index)
  for (int k = nd - 1, row = 1; k >= 0 && in_order; row *= static_cast<int>(shape[k]), --k) in_order = step[k] == row;
  if (in_order) return {};
  std::vector<int64_t> index(static_cast<size_t>(count_), -1);
  int64_t r = 0;
  for_each_index(nd, shape, [&](const int64_t* idx) {
    int64_t at = 0;
    for (int k = 0; k < nd; ++k) at += idx[k] * step[k];
    SIMDNORM_CHECK(at >= 0 && at < count_ && index[static_cast<size_t>(at)] < 0);
    index[static_cast<size_t>(at)] = r++;
  });
  SIMDNORM_CHECK(r == count_);
  return index;
}

void FoldedParams::realign(int64_t phase) {
  const int64_t array_bytes = count_ * elsize_, pitch = (array_bytes + 63) / 64 * 64;
  std::unique_ptr<char[]> moved(new char[static_cast<size_t>(pitch * outputs_ + 128)]);
  const uintptr_t start = reinterpret_cast<uintptr_t>(moved.get());
  char* to = moved.get() + ((kLineBytes - start % kLineBytes) % kLineBytes) + phase;
  for (int o = 0; o < outputs_; ++o) std::memcpy(to + o * pitch, data(o), static_cast<size_t>(array_bytes));
  heap_ = std::move(moved);
  storage_ = to;
  pitch_ = pitch;
}

int64_t coefficient_phase(const char* out, DType dtype, int64_t offset) {
  const int64_t ts = itemsize(dtype), cs = itemsize(compute_type(dtype));
  // The kernel's first full vector is at element `head` of the run (see ContiguousRun).
  const int64_t past = static_cast<int64_t>(reinterpret_cast<uintptr_t>(out) % kLineBytes);
  const int64_t head = (kLineBytes - past) % kLineBytes / ts;
  return ((-(offset + head * cs)) % kLineBytes + kLineBytes) % kLineBytes;
}

void align_coefficients(LoopNest& nest, FoldedParams& folded, DType dtype) {
  const int inner = nest.ndim - 1;
  const int64_t ts = itemsize(dtype), cs = itemsize(compute_type(dtype));
  if (inner < 0 || nest.sizes[inner] * cs < 256) return;  // short runs: the copy would cost more
  if (folded.spread()) return;  // (moving spread arrays measured nothing, and would allocate again)
  const uintptr_t out = reinterpret_cast<uintptr_t>(nest.data[kOut]);
  if (nest.strides[kOut][inner] != ts || out % ts != 0) return;
  int64_t offset[FoldedParams::kMaxInputs];
  for (int o = 0; o < folded.outputs(); ++o) {
    const int op = folded.operand(o);
    if (nest.strides[op][inner] != cs) return;
    offset[o] = nest.data[op] - folded.data(o);
    if (offset[o] < 0 || offset[o] >= folded.count() * cs) return;
  }
  bool aligned = true;  // (as FoldedParams' phase may have placed them)
  for (int o = 0; o < folded.outputs(); ++o)
    aligned &= static_cast<int64_t>(reinterpret_cast<uintptr_t>(folded.data(o)) % kLineBytes) ==
               coefficient_phase(nest.data[kOut], dtype, offset[o]);
  if (aligned) return;
  folded.realign(coefficient_phase(nest.data[kOut], dtype, offset[0]));
  for (int o = 0; o < folded.outputs(); ++o) nest.data[folded.operand(o)] = folded.data(o) + offset[o];
}

void lengthen_repeating_runs(LoopNest& nest, FoldedParams& folded, DType dtype) {
  // Inner runs of at least this many elements gain nothing more.
  constexpr int64_t kTargetRun = 1024;
  const int nd = nest.ndim;
  if (nd < 2) return;
  const int inner = nd - 1, outer = nd - 2;
  const int64_t n = nest.sizes[inner], ts = itemsize(dtype), cs = itemsize(compute_type(dtype));
  if (n >= kTargetRun / 2 || folded.count() != n) return;
  for (int op = kOut; op <= kIn; ++op)
    if (nest.strides[op][inner] != ts || nest.strides[op][outer] != n * ts) return;
  bool from_folded[kNumOperands] = {};
  for (int o = 0; o < folded.outputs(); ++o) {
    const int op = folded.operand(o);
    from_folded[op] = true;
    if (nest.strides[op][inner] != cs || nest.strides[op][outer] != 0 || nest.data[op] != folded.data(o)) return;
  }
  for (int op = kShift; op <= kBias; ++op)  // any other coefficient must be one value throughout
    if (!from_folded[op] && (nest.strides[op][inner] != 0 || nest.strides[op][outer] != 0)) return;
  // The largest number of pixels per run that divides the outer dim (so every run is whole).
  int64_t copies = 1;
  for (int64_t k = kTargetRun / n; k >= 2; --k)
    if (nest.sizes[outer] % k == 0) {
      copies = k;
      break;
    }
  if (copies == 1) return;
  folded.repeat(copies);
  for (int o = 0; o < folded.outputs(); ++o) nest.data[folded.operand(o)] = folded.data(o);
  nest.sizes[inner] *= copies;
  nest.sizes[outer] /= copies;
  for (int op = kOut; op <= kIn; ++op) nest.strides[op][outer] *= copies;
}

void plan_normalize(NormalizeTask& task) {
  const int64_t run_bytes = task.loop.ndim > 0 ? task.loop.sizes[task.loop.ndim - 1] * itemsize(task.dtype) : 0;
  task.stream_stores = task.loop.data[kOut] != task.loop.data[kIn] && run_bytes >= kMinStreamRunBytes &&
                       2 * element_count(task.loop) * itemsize(task.dtype) > stream_threshold_bytes();
  task.l1_bytes = l1_data_cache_bytes();
  plan_inner_loop(task);
}

namespace {

// Rows that read coefficient arrays beside the data and whose coefficients, input and output
// outgrow the L1 (channels-last batch norm with 2048 channels and more: 40 KB a row in float32)
// run in blocks of columns, each block over all the rows before the next: a block's coefficients
// (kBlockBytes with its input and output) stay in the L1 while its rows stream through. Row by
// row, each row's input and output lines would push the coefficients out before the next row
// reread them (an L1 under LRU loses a cyclic working set larger than itself whole). Rows up to
// the L1's size, exactly the L1 included, run whole: blocks cost them more than they save. Not
// with streaming stores: a block's rows write their lines a few KB at a time, which suits
// non-temporal stores worse than whole rows.
constexpr int64_t kBlockBytes = 20 << 10;
// A block, with the first one's head (under a line) and the rounding (under a line), of four
// float64 coefficient arrays at most, never blocks again.
static_assert(kBlockBytes + 2 * kLineBytes * (4 * 8 + 2) <= kMinL1DataBytes, "a block of columns fits the L1 whole");

// Columns a block spans (a whole number of output lines), or 0 when rows of n run whole;
// coefficient_bytes: the bytes of coefficients an element reads; ts: the element's bytes.
int64_t column_block(int64_t n, int64_t coefficient_bytes, int64_t ts, int64_t l1) {
  const int64_t row_bytes = n * (coefficient_bytes + 2 * ts);
  if (coefficient_bytes == 0 || row_bytes <= l1) return 0;
  const int64_t per_line = kLineBytes / ts;
  const int64_t blocks = (row_bytes + kBlockBytes - 1) / kBlockBytes, columns = (n + blocks - 1) / blocks;
  return (columns + per_line - 1) / per_line * per_line;
}

}  // namespace

void plan_inner_loop(NormalizeTask& task) {
  const LoopNest& nest = task.loop;
  InnerPlan& plan = task.inner;
  plan = InnerPlan{};
  if (nest.ndim < 1) return;
  const int inner = nest.ndim - 1;
  const int64_t ts = itemsize(task.dtype), cs = itemsize(compute_type(task.dtype));
  const int64_t n = nest.sizes[inner], rows = nest.ndim >= 2 ? nest.sizes[inner - 1] : 1;
  // Lanes of a vector of the compute type, in the ISA that will run.
  const int64_t lanes = kernels().float_lanes / (cs / 4);
  auto s = [&](int op) { return nest.strides[op][inner]; };
  auto rs = [&](int op) { return nest.ndim >= 2 ? nest.strides[op][inner - 1] : 0; };
  if (s(kIn) != ts || s(kOut) != ts) return;
  const bool st_const = s(kShift) == 0 && s(kMul) == 0, st_vary = s(kShift) == cs && s(kMul) == cs;
  // A folded scale is not read, whatever its strides: the affine pair is the bias alone.
  const bool scale_const = task.scale_folded || s(kScale) == 0, scale_vary = task.scale_folded || s(kScale) == cs;
  const bool af_const = scale_const && s(kBias) == 0, af_vary = scale_vary && s(kBias) == cs;
  if (!(st_const || st_vary) || !(af_const || af_vary)) return;
  plan.stats_vary = st_vary && !st_const;
  plan.affine_vary = af_vary && !af_const;
  plan.loop = InnerLoop::contiguous;
  const int64_t arrays = (plan.stats_vary ? 2 : 0) + (plan.affine_vary ? (task.scale_folded ? 1 : 2) : 0);
  if (rows > 1 && !task.stream_stores) {
    if (const int64_t block = column_block(n, arrays * cs, ts, task.l1_bytes)) {
      plan.loop = InnerLoop::column_blocks;
      plan.block_columns = block;
      return;
    }
  }
  const bool back_to_back = rows > 1 && lanes > 1 && rs(kIn) == n * ts && rs(kOut) == n * ts;
  if (!plan.stats_vary && !plan.affine_vary) {
    // 16-bit data: each run's masked head and tail cost two more conversions; the row stream has
    // neither. float32 runs pay a masked tail each, and stream too, but not with streaming stores
    // (outputs past the caches), where the stream gains them nothing.
    if (back_to_back && n >= lanes && (ts == 2 || !task.stream_stores)) plan.loop = InnerLoop::row_stream;
    return;
  }
  bool shared = true;  // every run reads the same coefficients
  for (int op = kShift; op <= kBias; ++op) shared = shared && rs(op) == 0;
  // (Not for activations the unit calls: the stream is not compiled for them.)
  const bool act_inline = kernels().inline_activations >> static_cast<int>(task.act.kind) & 1u;
  if (back_to_back && shared && n >= 2 * lanes && n <= kPeriodicMaxRun && act_inline)
    plan.loop = InnerLoop::periodic_stream;
}

void fence_streaming_stores() {
#if defined(__x86_64__) || defined(__SSE2__)
  __builtin_ia32_sfence();
#endif
}

std::string describe_normalize(const NormalizeTask& task) {
  const InnerPlan& plan = task.inner;
  static const char* const kLoopNames[] = {"strided", "contiguous", "row_stream", "periodic_stream", "column_blocks"};
  std::string loop = kLoopNames[static_cast<int>(plan.loop)];
  if (plan.loop != InnerLoop::strided)
    loop += std::string("(stats=") + (plan.stats_vary ? "vary" : "const") +
            ",affine=" + (plan.affine_vary ? "vary" : "const") + ")";
  if (plan.loop == InnerLoop::column_blocks) loop += " block_columns=" + std::to_string(plan.block_columns);
  return "nest=" + describe(task.loop) + " inner=" + loop + (task.stream_stores ? " streaming-stores" : "");
}

void run_normalize(NormalizeTask& task) {
  const KernelTable& k = kernels();
  for_element_ranges(element_count(task.loop), [&](int64_t begin, int64_t end) { k.normalize(task, begin, end); });
}

}  // namespace simdnorm
