// The worker pool of pool.h.
//
// Workers spin for a short while after a job (a decode step makes over a hundred kernel calls,
// a few tens of microseconds apart) and then sleep on a condition variable. A job is published
// as a shared object holding its own counters, so a worker that is late for one job can only
// find that job's counter exhausted; it never touches the next job's state. The caller waits
// for the chunks, not for the workers: spinning first, then yielding its core (which is what a
// descheduled worker holding the last chunk needs).
#include "pool.h"

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <atomic>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace verispec {
namespace {

constexpr int kWorkerSpins = 20000;  // pause loops before a worker sleeps (well under a time slice)
constexpr int kCallerSpins = 2000;   // before the caller starts yielding its core

struct Job {
  const std::function<void(int64_t)>* fn;
  int64_t n;
  int workers;  // how many workers may join (threads - 1)
  std::atomic<int64_t> next{0}, done{0};
};

class Pool {
 public:
  void run(int64_t n, const std::function<void(int64_t)>& fn, int threads) {
    std::lock_guard<std::mutex> serial(run_mu_);
    auto job = std::make_shared<Job>();
    job->fn = &fn;
    job->n = n;
    job->workers = threads - 1;
    {
      std::lock_guard<std::mutex> lk(mu_);
      while ((int)workers_.size() < threads - 1) {
        const int id = (int)workers_.size();
        workers_.emplace_back([this, id] { loop(id); });
        workers_.back().detach();  // never joined: the pool lives as long as the process
      }
      job_ = job;
      gen_.fetch_add(1, std::memory_order_release);
      if (sleepers_ > 0) cv_.notify_all();
    }
    work(*job);
    for (int spin = 0; job->done.load(std::memory_order_acquire) < n; ++spin) {
      if (spin < kCallerSpins) _mm_pause();
      else std::this_thread::yield();
    }
  }

 private:
  static void work(Job& job) {
    for (int64_t i; (i = job.next.fetch_add(1, std::memory_order_relaxed)) < job.n;) {
      (*job.fn)(i);
      job.done.fetch_add(1, std::memory_order_release);
    }
  }

  void loop(int id) {
    uint64_t seen = 0;
    for (;;) {
      for (int spin = 0; gen_.load(std::memory_order_acquire) == seen; ++spin) {
        if (spin < kWorkerSpins) {
          _mm_pause();
          continue;
        }
        std::unique_lock<std::mutex> lk(mu_);
        ++sleepers_;
        cv_.wait(lk, [&] { return gen_.load(std::memory_order_acquire) != seen; });
        --sleepers_;
        break;
      }
      std::shared_ptr<Job> job;
      {
        std::lock_guard<std::mutex> lk(mu_);
        job = job_;
        seen = gen_.load(std::memory_order_acquire);
      }
      if (job && id < job->workers) work(*job);
    }
  }

  std::mutex run_mu_, mu_;
  std::condition_variable cv_;
  std::vector<std::thread> workers_;
  std::shared_ptr<Job> job_;
  std::atomic<uint64_t> gen_{0};
  int sleepers_ = 0;
};

}  // namespace

void run_chunks(int64_t n, const std::function<void(int64_t)>& fn, int threads) {
  if (threads <= 0) threads = at::get_num_threads();
  if (threads > n) threads = (int)n;
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) fn(i);
    return;
  }
  static Pool* pool = new Pool();  // leaked on purpose: workers outlive static destructors
  pool->run(n, fn, threads);
}

}  // namespace verispec
