// Pieces the two op drivers share: scalar element access, parameter folding into compute-type
// arrays, and running the normalize kernel over a nest on the thread pool. Compiled without ISA
// flags (baseline), like everything outside cpp/kernels.
#pragma once
#include <algorithm>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <vector>

#include "plan/plan.h"
#include "runtime/thread_pool.h"
#include "simdnorm/kernel_table.h"
#include "simdnorm/ops.h"

namespace simdnorm {

double load_scalar(DType dtype, const char* p);
// out[i] = the element at p + i * stride, for i < n.
void load_as_double(DType dtype, const char* p, int64_t stride, int64_t n, double* out);
// float32 for the float formats, float64 for float64.
inline DType compute_type(DType dtype) { return dtype == DType::f64 ? DType::f64 : DType::f32; }

// Scratch that the calling thread keeps from call to call, one buffer a Slot: allocated per call,
// blocks past glibc's mmap threshold are fresh pages that fault on every call (the columns of MVN
// over (0, 2, 3) of 2x256x14x14 spent most of their time there; group norm of 1x512x7x7's spread
// scale and bias 5x its time). Up to kKeptScratchBytes a slot; larger requests get a block of the
// object's own. Never zeroed. One object a slot alive on a thread at a time.
constexpr size_t kKeptScratchBytes = 1 << 20;
// The backward's arrays of one element a statistics element (the folded statistics, the groups'
// sums: 16 bytes an element each) grow with the number of groups, and for groups of a few
// elements (layer norm of 8 features) they are a third as large as the data: they are kept up
// to this size (per slot and calling thread), where their pages faulted in took 40% of the call.
constexpr size_t kKeptStatisticsBytes = size_t(16) << 20;
enum ScratchSlot {
  kLaneSlot, kStatsSlot, kChunkSlot, kSpreadSlot, kFoldSlot, kGroupSumsSlot, kPartialsSlot, kMergedSlot, kColumnChunkSlot
};
template <int Slot, size_t KeepBytes = kKeptScratchBytes>
class KeptScratch {
 public:
  char* reserve(size_t bytes) {
    static thread_local std::vector<char> kept;
    own_.reset();
    if (bytes > KeepBytes) own_.reset(new char[bytes]);
    else if (kept.size() < bytes) kept.resize(bytes);
    return data_ = own_ ? own_.get() : kept.data();
  }
  char* data() const { return data_; }

 private:
  std::unique_ptr<char[]> own_;
  char* data_ = nullptr;
};

// Parameters broadcast against an input of `ndim` dims with `sizes`, folded into compute-type
// arrays laid out contiguously over their common broadcast shape (usually just C values).
class FoldedParams {
 public:
  static constexpr int kMaxInputs = 4;
  struct Input {
    const TensorView* view;  // nullptr: absent, reads as `absent_value`
    double absent_value;
  };
  // fold(in, out, n, ctx) maps n <= kChunk elements of the broadcast shape, given as one array per
  // input (in[i][k]), to one array per output (out[o][k]); the results are stored in the compute
  // type. Output o is the kernel's operand operands[o] (kShift...kBias). A null fold makes each
  // output its input (as many of each).
  static constexpr int64_t kChunk = 256;
  using Fold = void (*)(const double* const* in, double* const* out, int64_t n, const void* ctx);
  // Where every input given is already compact in the compute type (in[i]: its n elements, null
  // where absent; out[o]: output o's), `compact` folds all of them at once instead, in the fold's
  // arithmetic, or returns false to leave them to `fold` (thousands of per-channel parameters took
  // a conversion pass each way an array).
  using CompactFold = bool (*)(DType compute, const char* const* in, char* const* out, int64_t n, const void* ctx);
  // For compact folds of float32: whether the first k inputs (null ones too) can be read as floats,
  // and output `to` set to input `from`'s n floats, or to `absent` where it is null.
  static bool floats_aligned(const char* const* in, int k) {
    for (int i = 0; i < k; ++i)
      if (reinterpret_cast<uintptr_t>(in[i]) % alignof(float) != 0) return false;
    return true;
  }
  static void copy_floats(const char* from, char* to, int64_t n, float absent) {
    if (from != nullptr) std::memcpy(to, from, static_cast<size_t>(n) * sizeof(float));
    else std::fill_n(reinterpret_cast<float*>(to), n, absent);
  }
  // The arrays are laid out row-major over the dims in `order` (outermost first; null: 0 to ndim - 1).
  // `kept`: their storage the calling thread's kFoldSlot (one such object a thread at a time).
  // `phase` (0 to 63): each array starts that many bytes past a 64-byte boundary, where
  // align_coefficients would move them (-1: anywhere).
  FoldedParams(int ndim, const int64_t* sizes, std::initializer_list<Input> inputs,
               std::initializer_list<int> operands, DType compute, Fold fold, const void* ctx,
               const int* order = nullptr, bool kept = false, CompactFold compact = nullptr, int64_t phase = -1);
  // For each element of the arrays, its index in the row-major order of the dims (0 to ndim - 1)
  // along which they vary; none (empty) where that is the element's own.
  std::vector<int64_t> row_major_indices(int ndim, const int64_t* sizes) const;
  FoldedParams(const FoldedParams&) = delete;
  FoldedParams& operator=(const FoldedParams&) = delete;
  // Byte strides of output `i` over the input's dims (0 where the broadcast shape is 1).
  const int64_t* strides() const { return strides_; }
  char* data(int i) { return storage_ + i * pitch_; }
  const char* data(int i) const { return storage_ + i * pitch_; }
  int outputs() const { return outputs_; }
  int operand(int i) const { return operands_[i]; }
  int64_t count() const { return count_; }
  // Repeats every output array `copies` times end to end (count() grows by that factor).
  void repeat(int64_t copies);
  // Moves the arrays so that each starts `phase` bytes past a 64-byte boundary (0 <= phase < 64).
  void realign(int64_t phase);
  // Makes the outputs vary along dims [first, ndim) of `sizes` too, along which they are constant:
  // each element repeated for every index there (count() grows by their product), row-major.
  void spread_inner(int first, int ndim, const int64_t* sizes);
  // Gives the outputs `layout`'s strides and count, each element a copy of this one's at the same
  // indices (of `sizes`), where they vary along no dim that `layout` does not. Returns, for each
  // new element, the old one it copies.
  std::vector<int64_t> spread_like(const FoldedParams& layout, int ndim, const int64_t* sizes);
  bool spread() const { return spread_scratch_.data() != nullptr; }

 private:
  // Per-channel parameters (the common case) fit here, so a small call does not allocate.
  alignas(64) char local_[4096];
  std::unique_ptr<char[]> heap_;
  char* storage_ = local_;
  int64_t strides_[kMaxViewDims] = {};
  int64_t count_ = 1;
  int64_t elsize_ = 4;
  int64_t pitch_ = 0;  // bytes from one output array to the next
  int outputs_ = 0;
  int operands_[kMaxInputs] = {};
  KeptScratch<kSpreadSlot> spread_scratch_;  // spread_inner's arrays (reserved only by it)
  KeptScratch<kFoldSlot, kKeptStatisticsBytes> kept_storage_;
};

// Channels-last layouts with few channels: the nest's inner run is one pixel's channels, with
// coefficients (the folded arrays, exactly one run long) varying along it and repeating for every
// pixel. A run that short pays the kernel's per-run costs every few vectors; repeating the
// coefficients makes the inner run several pixels long. No-op for other nests.
void lengthen_repeating_runs(LoopNest& nest, FoldedParams& folded, DType dtype);

// Coefficient arrays read beside the data (folded's operands, varying along the inner run) are
// moved so that their vectors are 64-byte aligned where the kernel's stores are (it peels the output
// to a 64-byte boundary): a vector load that straddles two cache lines costs about twice as much.
void align_coefficients(LoopNest& nest, FoldedParams& folded, DType dtype);
// Where align_coefficients puts the arrays (bytes past a 64-byte boundary) for an inner run that
// writes `out` from `offset` bytes into them: a FoldedParams' phase.
int64_t coefficient_phase(const char* out, DType dtype, int64_t offset = 0);

// Runs the normalize kernel over the whole nest, split over threads in element ranges.
void run_normalize(NormalizeTask& task);
// fn(begin, end) over [0, total) split into one range per thread (one range when the work is too
// small for a second), the boundaries on multiples of 64 elements: threads stay off each other's
// output cache lines.
template <class Fn>
void for_element_ranges(int64_t total, Fn&& fn);
// fn(begin, end) over items [0, items) in contiguous ranges, one a part: as many parts as `work`
// (elements) is worth threads (parts_for), at most one an item.
template <class Fn>
void for_item_ranges(int64_t items, int64_t work, Fn&& fn);
// The rest of a task's plan, once its loop, dtype and scale_folded are set: the L1's size; whether
// to write with non-temporal stores (for operations that move more bytes, input plus output, than
// stream_threshold_bytes(): smaller ones stay cached between calls, and their output is cached for
// its reader; never in place); and the inner loop (plan_inner_loop).
void plan_normalize(NormalizeTask& task);
// task.inner: the kernel's loop for the task's nest, by its two innermost dims' strides and sizes
// (again after a change of nest).
void plan_inner_loop(NormalizeTask& task);
// Orders this thread's non-temporal stores before what it does next (kernels that take single runs
// leave this to their caller).
void fence_streaming_stores();

// "nest=... inner=<loop>[ streaming-stores]": the loop nest and the inner loop the normalize kernel
// runs over it.
std::string describe_normalize(const NormalizeTask& task);

// Minimum elements per thread before a second thread is worth waking (less work than this costs
// less than the wake-up).
constexpr int64_t kMinElementsPerThread = 1 << 15;

template <class Fn>
void for_element_ranges(int64_t total, Fn&& fn) {
  const int parts = parts_for(total, kMinElementsPerThread);
  if (parts == 1) return fn(int64_t{0}, total);
  const int64_t per = ((total + parts - 1) / parts + 63) / 64 * 64;
  parallel_for(parts, [&](int part) {
    const int64_t begin = part * per, end = begin + per < total ? begin + per : total;
    if (begin < end) fn(begin, end);
  });
}

template <class Fn>
void for_item_ranges(int64_t items, int64_t work, Fn&& fn) {
  if (items <= 0) return;
  const int parts = static_cast<int>(std::min<int64_t>(items, parts_for(work, kMinElementsPerThread)));
  const int64_t per = (items + parts - 1) / parts;
  parallel_for(parts, [&](int part) {
    const int64_t begin = part * per, end = std::min(items, begin + per);
    if (begin < end) fn(begin, end);
  });
}

}  // namespace simdnorm
