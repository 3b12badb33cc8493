#include "runtime/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace simdnorm {
namespace {

int default_threads() {
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

std::atomic<int> g_num_threads{default_threads()};

// A wake-up through the kernel costs tens of microseconds on a VM, more than a small call's work.
// So workers poll for the next job, and the caller for the workers' end, for up to kSpin before
// they block, as OpenMP runtimes do by default.
constexpr auto kSpin = std::chrono::microseconds(100);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// Polls ready() for up to kSpin; false if it never became true.
template <class Ready>
bool spin_until(Ready ready) {
  const auto until = std::chrono::steady_clock::now() + kSpin;
  for (unsigned i = 1;; ++i) {
    if (ready()) return true;
    cpu_relax();
    if (i % 64 == 0 && std::chrono::steady_clock::now() >= until) return false;
  }
}

// Runs fn on parts claimed from `next` until none of [0, nparts) is left: every thread of a job,
// the pool's and an OpenMP team's alike.
inline void run_claimed(std::atomic<int>& next, int nparts, const std::function<void(int)>& fn) {
  for (int part; (part = next.fetch_add(1, std::memory_order_relaxed)) < nparts;) fn(part);
}

// Parts a thread takes at most. More than one: a thread whose core is taken (another runtime's
// workers spinning after their own parallel region, as OpenMP's do) takes fewer parts, and the
// threads that run take the rest, instead of everyone waiting on its one part.
constexpr int64_t kPartsPerThread = 4;

class Pool {
 public:
  // A thread that cannot start (an address-space or process limit, a thread count set far past
  // the cores) leaves the pool smaller, not the call broken: its parts are drained by the threads
  // that did start and by the caller. (Thrown out of here, the exception destroyed the condition
  // variables under the workers already waiting on them: the call hung.)
  explicit Pool(int workers) : asked_(workers) {
    try {
      for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { work(); });
    } catch (const std::exception&) {
    }
  }
  // The workers the pool was built for (kept, so that a short pool is not rebuilt every call).
  int asked() const { return asked_; }

  // Caller holds region_mutex(). The caller takes parts too, and waits only for the workers that
  // joined the job: a worker that has not woken yet (its core busy with another process's thread,
  // or asleep) joins no job that has already been closed, so its lateness costs nothing here.
  // At most `helpers` workers take parts (a caller's own count below the pool's size).
  void run(int nparts, const std::function<void(int)>& fn, int helpers) {
    uint64_t generation;
    {
      std::lock_guard<std::mutex> lock(m_);
      job_ = &fn;
      nparts_ = nparts;
      seats_.store(helpers, std::memory_order_relaxed);
      next_.store(0, std::memory_order_relaxed);
      generation = generation_.load(std::memory_order_relaxed) + 1;
      open_.store(generation, std::memory_order_relaxed);
      generation_.store(generation, std::memory_order_release);  // publishes the job to spinning workers
    }
    wake_.notify_all();
    drain();
    // Every part is taken. Close the job, then wait for the workers inside it: a worker counts
    // itself in before it looks whether the job is open (both sequentially consistent), so either
    // it sees the job closed and leaves it alone, or this side sees it counted in and waits.
    open_.store(0, std::memory_order_seq_cst);
    auto all_out = [this] { return active_.load(std::memory_order_seq_cst) == 0; };
    if (!spin_until(all_out)) {
      std::unique_lock<std::mutex> lock(m_);
      done_.wait(lock, all_out);
    }
    job_ = nullptr;
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stopping_.store(true, std::memory_order_release);
    }
    wake_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  std::mutex& region_mutex() { return region_; }

 private:
  void drain() { run_claimed(next_, nparts_, *job_); }

  void work() {
    uint64_t seen = 0;
    auto called = [&] {
      return stopping_.load(std::memory_order_acquire) || generation_.load(std::memory_order_acquire) != seen;
    };
    for (;;) {
      if (!spin_until(called)) {
        std::unique_lock<std::mutex> lock(m_);
        wake_.wait(lock, called);
      }
      if (stopping_.load(std::memory_order_acquire)) return;
      seen = generation_.load(std::memory_order_acquire);
      active_.fetch_add(1, std::memory_order_seq_cst);
      if (open_.load(std::memory_order_seq_cst) == seen && seats_.fetch_sub(1, std::memory_order_relaxed) > 0) drain();
      std::lock_guard<std::mutex> lock(m_);  // so that the caller cannot miss the notification
      if (active_.fetch_sub(1, std::memory_order_seq_cst) == 1) done_.notify_one();
    }
  }

  const int asked_;
  std::vector<std::thread> threads_;
  std::mutex m_, region_;
  std::condition_variable wake_, done_;
  const std::function<void(int)>* job_ = nullptr;
  int nparts_ = 0;
  std::atomic<int> next_{0};
  std::atomic<int> seats_{0};  // workers that may still join the open job
  // Written under m_; read without it by the spinning side.
  std::atomic<uint64_t> generation_{0};
  // The generation that workers may still join (0: closed), and how many are inside a job.
  std::atomic<uint64_t> open_{0};
  std::atomic<int> active_{0};
  std::atomic<bool> stopping_{false};
};

// The pool lives on the heap and is never destroyed at exit (joining at static destruction time
// is fragile); a fork()ed child drops its copy, whose threads do not exist there, and builds anew.
std::mutex g_pool_mutex;
Pool* g_pool = nullptr;

// The shared team (never freed: a call may still be reading it), the lock its one region at a
// time holds, and whether this process is a fork()ed child (of one that loaded simdnorm: an
// OpenMP runtime the parent used hangs there, so a child never starts sharing one).
std::atomic<const OpenMpTeam*> g_team{nullptr};
std::mutex g_team_mutex;
bool g_forked_child = false;
// Whether a parallel call of this process (or of the parent it was forked from) ran on the team:
// its runtime then believes its threads exist in a child, where they do not.
std::atomic<bool> g_team_entered{false};

void forget_pool_in_child() {
  g_pool = nullptr;  // leaked on purpose: its mutexes may be held by threads that are gone
  new (&g_pool_mutex) std::mutex();
  // An OpenMP runtime used before fork() waits in the child for threads that are not there.
  g_team.store(nullptr, std::memory_order_relaxed);
  g_forked_child = true;
  new (&g_team_mutex) std::mutex();
}

void register_fork_handler() {
  static const int registered = pthread_atfork(nullptr, nullptr, forget_pool_in_child);
  (void)registered;
}
// (at load: a fork before simdnorm's first parallel call marks the child as well)
[[maybe_unused]] const bool g_fork_handler_at_load = (register_fork_handler(), true);

// One parallel_for on the shared team. Team thread t first runs its own block of parts, the t-th
// of nthreads in order (as torch's parallel ops split their range: the data the previous op's
// thread t wrote is then read by thread t), then claims parts left in the others' blocks.
struct TeamJob {
  const std::function<void(int)>* fn;
  int nparts, nthreads;
  int (*thread_num)();
  std::unique_ptr<std::atomic<int>[]> next;

  TeamJob(const std::function<void(int)>* f, int parts, int threads, int (*num)())
      : fn(f), nparts(parts), nthreads(threads), thread_num(num), next(new std::atomic<int>[threads]) {
    for (int t = 0; t < threads; ++t) next[t].store(block_start(t), std::memory_order_relaxed);
  }
  int block_start(int t) const { return static_cast<int>(int64_t{nparts} * t / nthreads); }

  static void run(void* self) {
    TeamJob& job = *static_cast<TeamJob*>(self);
    const int me = job.thread_num();
    for (int k = 0; k < job.nthreads; ++k) {
      const int t = (me + k) % job.nthreads;
      const int end = job.block_start(t + 1);
      for (int part; (part = job.next[t].fetch_add(1, std::memory_order_relaxed)) < end;) (*job.fn)(part);
    }
  }
};

}  // namespace

int get_num_threads() { return g_num_threads.load(std::memory_order_relaxed); }

void set_num_threads(int n) { g_num_threads.store(n < 1 ? 1 : n, std::memory_order_relaxed); }

namespace {
thread_local int t_caller_threads = 0;
}  // namespace

int set_caller_threads(int n) {
  const int previous = t_caller_threads;
  t_caller_threads = n < 0 ? 0 : n;
  return previous;
}

int caller_threads() { return t_caller_threads > 0 ? t_caller_threads : get_num_threads(); }

int parts_for(int64_t work, int64_t min_per_part) {
  const int64_t threads = caller_threads();
  if (threads == 1) return 1;
  int64_t parts = min_per_part > 0 ? work / min_per_part : work;
  if (parts > threads * kPartsPerThread) parts = threads * kPartsPerThread;
  return parts < 1 ? 1 : static_cast<int>(parts);
}

void parallel_for(int nparts, const std::function<void(int)>& fn) {
  const int threads = caller_threads(), global_threads = get_num_threads();
  auto run_here = [&] {
    for (int p = 0; p < nparts; ++p) fn(p);
  };
  if (nparts <= 1 || threads <= 1) return run_here();
  register_fork_handler();
  const OpenMpTeam* team = g_team.load(std::memory_order_acquire);
  if (team != nullptr && team->max_threads() >= threads) {
    // As with the pool: while one Python thread's call holds the team, a rival runs on its own.
    std::unique_lock<std::mutex> busy(g_team_mutex, std::try_to_lock);
    if (!busy.owns_lock()) return run_here();
    TeamJob job(&fn, nparts, threads, team->thread_num);
    g_team_entered.store(true, std::memory_order_relaxed);
    team->parallel(&TeamJob::run, &job, static_cast<unsigned>(threads), 0);
    return;
  }
  std::unique_lock<std::mutex> global(g_pool_mutex);
  // The pool has get_num_threads() - 1 workers; a caller with its own count uses a pool of at
  // least its size (rebuilt larger if need be) and keeps the workers past its count out of the job.
  const bool own = t_caller_threads > 0;
  const int workers = (own && threads > global_threads ? threads : global_threads) - 1;
  // A pool is only replaced or used by whoever holds its region lock, so a pool in use by another
  // Python thread is never deleted under it; that thread's rival simply runs on its own thread.
  if (g_pool != nullptr) {
    std::unique_lock<std::mutex> region(g_pool->region_mutex(), std::try_to_lock);
    if (!region.owns_lock()) {
      global.unlock();
      return run_here();
    }
    if (own ? g_pool->asked() >= threads - 1 : g_pool->asked() == workers) {
      Pool* pool = g_pool;
      global.unlock();
      pool->run(nparts, fn, threads - 1);
      return;
    }
    g_pool->stop();
    region.unlock();
    delete g_pool;
    g_pool = nullptr;
  }
  g_pool = new Pool(workers);
  Pool* pool = g_pool;
  std::unique_lock<std::mutex> region(pool->region_mutex());
  global.unlock();
  pool->run(nparts, fn, threads - 1);
}

bool share_openmp_team(const OpenMpTeam& team) {
  register_fork_handler();
  if (g_forked_child) return false;
  g_team.store(new OpenMpTeam(team), std::memory_order_release);
  return true;
}

void use_own_threads() { g_team.store(nullptr, std::memory_order_release); }

bool sharing_openmp_team() { return g_team.load(std::memory_order_acquire) != nullptr; }

bool openmp_team_entered() { return g_team_entered.load(std::memory_order_relaxed); }

}  // namespace simdnorm
