// The kernels' own worker threads.
//
// Why not at::parallel_for (OpenMP): its parallel region ends in a barrier that waits for every
// thread of the team. When another process holds a core, a team thread waits for the scheduler
// (a time slice) before it even starts, and every call pays that: with a second process busy on
// the same cores, a small matmul became about a thousand times slower (docs/kernels.md, Threads).
// Here work is cut into chunks that threads take from a shared counter. The caller works too
// and returns as soon as every chunk is done; a worker that wakes late finds nothing left and
// nobody waits for it. Chunks only ever split independent outputs (tiles of columns, activation
// blocks, attention rows), so which thread runs a chunk cannot change a result.
#pragma once

#include <cstdint>
#include <functional>

namespace verispec {

// fn(i) for every i in [0, n), on the calling thread and up to threads - 1 workers (threads:
// torch's setting, at::get_num_threads, when 0). Calls from several threads run one at a time.
void run_chunks(int64_t n, const std::function<void(int64_t)>& fn, int threads = 0);

// [begin, end) of chunk i when [0, total) is cut into n nearly equal chunks.
inline void chunk_range(int64_t total, int64_t n, int64_t i, int64_t* begin, int64_t* end) {
  *begin = total * i / n;
  *end = total * (i + 1) / n;
}

}  // namespace verispec
