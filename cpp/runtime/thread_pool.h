// A small persistent thread pool (no OpenMP runtime in the wheel): N-1 workers plus the caller;
// or, shared, the team of an OpenMP runtime the process has loaded (torch's).
#pragma once
#include <cstdint>
#include <functional>

namespace simdnorm {

int get_num_threads();
// n >= 1. Workers are (re)created lazily at the next parallel call.
void set_num_threads(int n);

// The calling thread's own count (0: none, get_num_threads() applies), for the calls it makes
// from now on: a Dask task limits itself without changing what other threads use. Returns the
// previous value. The pool grows to serve a larger count; a smaller one keeps the rest idle.
int set_caller_threads(int n);
int caller_threads();  // the count the calling thread's calls use

// Runs fn(part) for every part in [0, nparts), spread over up to get_num_threads() threads; the
// caller runs parts too and returns when all are done. If another thread is already running a
// parallel region, the parts run on the caller alone (results never depend on the split).
void parallel_for(int nparts, const std::function<void(int)>& fn);

// How many parts to cut `work` units into so that each part has at least `min_per_part` units
// (small work stays on one thread), and a few parts per thread (thread_pool.cpp: kPartsPerThread).
int parts_for(int64_t work, int64_t min_per_part);

// An OpenMP runtime's entries: GOMP_parallel (libgomp's fork-join ABI, which Intel's and LLVM's
// runtimes export too), omp_get_max_threads and omp_get_thread_num.
struct OpenMpTeam {
  void (*parallel)(void (*fn)(void*), void* data, unsigned num_threads, unsigned flags);
  int (*max_threads)();
  int (*thread_num)();
};
// Runs parallel_for's parts on that runtime's team (simdnorm.torch shares torch's): the threads
// torch's parallel ops use, and leave spinning between ops, instead of simdnorm's own workers
// competing with them for the cores. A call uses the team only while the runtime's own count
// (omp_get_max_threads: torch.set_num_threads) is at least the call's, else the pool. Refused
// (false) in a fork()ed child of a process that shared one, where the team's threads are gone
// (a child falls back to the pool).
bool share_openmp_team(const OpenMpTeam& team);
void use_own_threads();
bool sharing_openmp_team();
// Whether a parallel call ran on a shared team in this process or in the one it was forked from
// (whose runtime, in a child, waits in its next parallel region for threads that are not there).
bool openmp_team_entered();

}  // namespace simdnorm
