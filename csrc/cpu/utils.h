// Helpers shared by the CPU kernels.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "../common.h"

namespace pyg_fastattn {
namespace cpu {

inline int64_t clamp64(int64_t v, int64_t lo, int64_t hi) {
  return std::min(std::max(v, lo), hi);
}

// Edge range [begin, end) of row i, clamped into [0, E] so that a bad rowptr
// can never index out of bounds.
template <typename index_t>
inline std::pair<int64_t, int64_t> row_range(const index_t* rowptr, int64_t i,
                                             int64_t E) {
  const int64_t b = clamp64(rowptr[i], 0, E);
  return {b, clamp64(rowptr[i + 1], b, E)};
}

// Runs f(row_begin, row_end) in parallel on chunks of the N rows that hold
// about equal work, measured as (edges + rows) * work_per_item, so that
// high-degree rows do not leave threads idle. Row r has cost rowptr[r] + r
// (increasing for a valid rowptr) and goes to the chunk holding its cost.
// Threads take chunks (about 16 per thread) from a shared counter rather
// than one fixed share each: on a shared machine a thread that loses its
// core for a while no longer holds up the whole op. Every row still goes
// to exactly one f call.
template <typename index_t, typename F>
void parallel_rows(const index_t* rowptr, int64_t N, int64_t E,
                   int64_t work_per_item, const F& f) {
  if (N <= 0) return;
  auto cost = [&](int64_t r) { return clamp64(rowptr[r], 0, E) + r; };
  auto first_row = [&](int64_t c) {  // first r in [0, N] with cost(r) >= c
    int64_t lo = 0, hi = N;
    while (lo < hi) {
      const int64_t mid = lo + (hi - lo) / 2;
      if (cost(mid) < c) lo = mid + 1; else hi = mid;
    }
    return lo;
  };
  const int64_t total = N + E;
  const int64_t grain =
      std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(1, work_per_item));
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || total <= grain || at::in_parallel_region()) {
    f(int64_t(0), N);
    return;
  }
  const int64_t chunk = std::max(grain, (total + threads * 16 - 1) / (threads * 16));
  const int64_t chunks = (total + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min(threads, chunks), 1, [&](int64_t, int64_t) {
    for (int64_t c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) {
      const int64_t r0 = first_row(c * chunk);
      const int64_t r1 = first_row(std::min(total, (c + 1) * chunk));
      if (r0 < r1) f(r0, r1);
    }
  });
}

// Long rows of a CSR (or CSC) and their chunks (split_plan() in common.h):
// rows with more than `split` edges, in increasing order, and for long row k
// the chunks first[k] .. first[k + 1] - 1, chunk q of the row being edges
// [b + q * chunk, min(b + (q + 1) * chunk, e)). The row kernels skip long
// rows; an op computes one partial per chunk (parallel_chunks) and combines
// each row's partials in chunk order, so the result does not depend on the
// thread count.
struct SplitRows {
  int64_t split = 0, chunk = 1;
  std::vector<int64_t> row;    // long rows
  std::vector<int64_t> first;  // [row.size() + 1]
  bool is_long(int64_t b, int64_t e) const { return e - b > split; }
  int64_t rows() const { return static_cast<int64_t>(row.size()); }
  int64_t chunks() const { return first.back(); }
};

template <typename index_t>
SplitRows split_rows(const index_t* rowptr, int64_t N, int64_t E) {
  const SplitPlan plan = split_plan();
  SplitRows s;
  s.split = plan.split;
  s.chunk = plan.chunk;
  s.first.push_back(0);
  if (E <= s.split) return s;  // no row can be long
  for (int64_t r = 0; r < N; ++r) {
    const auto [b, e] = row_range(rowptr, r, E);
    if (!s.is_long(b, e)) continue;
    s.row.push_back(r);
    s.first.push_back(s.first.back() + (e - b + s.chunk - 1) / s.chunk);
  }
  return s;
}

// Runs f(k, r, cb, ce, q) for every chunk q (global index) of long row k
// (row r), edges [cb, ce), in parallel over the chunks.
template <typename index_t, typename F>
void parallel_chunks(const SplitRows& s, const index_t* rowptr, int64_t E,
                     const F& f) {
  if (s.chunks() == 0) return;
  at::parallel_for(0, s.chunks(), 1, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t k =
          std::upper_bound(s.first.begin(), s.first.end(), q) - s.first.begin() - 1;
      const int64_t r = s.row[k];
      const auto [b, e] = row_range(rowptr, r, E);
      const int64_t cb = b + (q - s.first[k]) * s.chunk;
      f(k, r, cb, std::min(e, cb + s.chunk), q);
    }
  });
}

// Runs f(k, r) for every long row k (row r), in parallel.
template <typename F>
void parallel_long_rows(const SplitRows& s, const F& f) {
  if (s.rows() == 0) return;
  at::parallel_for(0, s.rows(), 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) f(k, s.row[k]);
  });
}

// Sums the partials of long row k's chunks (P values each, at part + q * P)
// in chunk order into out [P].
template <typename acc_t>
void sum_chunks(const SplitRows& s, int64_t k, const acc_t* part, int64_t P,
                acc_t* out) {
  std::fill(out, out + P, acc_t(0));
  for (int64_t q = s.first[k]; q < s.first[k + 1]; ++q)
    for (int64_t x = 0; x < P; ++x) out[x] += part[q * P + x];
}

// Combines the softmax partials of long row k's chunks, each {acc [H * C],
// m [H], den [H]} at part + q * (H * C + 2 * H) (m: max score, -inf if none;
// den, acc: sums of exp(s - m) and exp(s - m) * value): m = the row's max,
// den and acc rescaled to it and summed in chunk order. A chunk without a
// finite max adds 0 (or its NaN).
template <typename acc_t>
void combine_softmax_chunks(const SplitRows& s, int64_t k, const acc_t* part,
                            int64_t H, int64_t C, acc_t* acc, acc_t* m,
                            acc_t* den) {
  constexpr acc_t inf = std::numeric_limits<acc_t>::infinity();
  const int64_t HC = H * C, P = HC + 2 * H;
  std::fill(acc, acc + HC, acc_t(0));
  std::fill(m, m + H, -inf);
  std::fill(den, den + H, acc_t(0));
  for (int64_t q = s.first[k]; q < s.first[k + 1]; ++q)
    for (int64_t h = 0; h < H; ++h) m[h] = std::max(m[h], part[q * P + HC + h]);
  for (int64_t q = s.first[k]; q < s.first[k + 1]; ++q) {
    const acc_t* p = part + q * P;
    for (int64_t h = 0; h < H; ++h) {
      const acc_t mq = p[HC + h];
      const acc_t f = mq == -inf ? acc_t(0) : std::exp(mq - m[h]);
      den[h] += f * p[HC + H + h];
      for (int64_t c = 0; c < C; ++c) acc[h * C + c] += f * p[h * C + c];
    }
  }
}

// Runs f(t) for t in [0, n) in parallel, threads taking t from a shared
// counter (work of the t may differ a lot).
template <typename F>
void parallel_tasks(int64_t n, const F& f) {
  if (n <= 0) return;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    for (int64_t t = 0; t < n; ++t) f(t);
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    for (int64_t t = next.fetch_add(1); t < n; t = next.fetch_add(1)) f(t);
  });
}

// Dot product of two length-n vectors, accumulated in opmath of T with 8
// independent partial sums so that the compiler can vectorize it (b may hold
// another type, e.g. opmath values).
template <typename T, typename U>
inline at::opmath_type<T> dot(const T* a, const U* b, int64_t n) {
  using acc_t = at::opmath_type<T>;
  acc_t s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t c = 0;
  for (; c + 8 <= n; c += 8)
    for (int k = 0; k < 8; ++k) s[k] += acc_t(a[c + k]) * acc_t(b[c + k]);
  acc_t r = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
  for (; c < n; ++c) r += acc_t(a[c]) * acc_t(b[c]);
  return r;
}

// While edge k is processed, asks the CPU to start loading the row
// base[idx[k + 8]] of base [rows, row_size] (its first 512 bytes; the
// hardware prefetcher follows longer rows). A loop that does real work per
// edge (exp, scores) otherwise stalls on each random row (benchmarks/
// RESULTS.md, "Numbers moved out of code comments"). No-op without
// GCC/Clang.
//
// Forced inline: otherwise GCC finds the function free of side effects (a
// prefetch is none, to it), marks it const and deletes every call. A
// function that wraps it needs PFA_FORCE_INLINE as well.
#if defined(__GNUC__)
#define PFA_FORCE_INLINE __attribute__((always_inline)) inline
#else
#define PFA_FORCE_INLINE inline
#endif
template <typename index_t, typename T>
PFA_FORCE_INLINE void prefetch_ahead(const index_t* idx, int64_t k, int64_t E,
                                    const T* base, int64_t rows,
                                    int64_t row_size) {
#if defined(__GNUC__)
  constexpr int64_t kAhead = 8;
  if (k + kAhead >= E) return;
  const int64_t j = idx[k + kAhead];
  if (j < 0 || j >= rows) return;
  const char* p = reinterpret_cast<const char*>(base + j * row_size);
  const int64_t bytes = std::min<int64_t>(row_size * int64_t(sizeof(T)), 512);
  for (int64_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off);
#endif
}

// Whether a row's lse gives its entries a weight: not for -inf (an empty
// row, or all -inf). A NaN or +inf lse does (the weights are then NaN), so
// the gradients carry the row's NaN as autograd through PyG's softmax does.
template <typename T>
inline bool has_weight(T lse) {
  return lse != -std::numeric_limits<T>::infinity();
}

// leaky_relu(z) = z > 0 ? z : slope * z, and its derivative times g, without
// a branch on the sign of z (random per edge: a branch mispredicts half the
// time). Same values as the branchy form (a zero's sign aside); NaN and
// +-inf propagate as there.
template <typename T>
inline T leaky(T z, T slope) {
  return std::max(z, T(0)) + slope * std::min(z, T(0));
}
template <typename T>
inline T leaky_grad(T z, T slope, T g) {
  // A quiet compare (z > 0 may trap on NaN) turned into 0 / 1: GCC (with
  // trapping math) then vectorizes float loops calling this, where the
  // ternary form became a branch.
#if defined(__GNUC__)
  const T pos = static_cast<T>(__builtin_isgreater(z, T(0)));
#else
  const T pos = z > T(0) ? T(1) : T(0);
#endif
  return g * (pos + (T(1) - pos) * slope);
}

// Contiguous copy of an optional tensor, or an undefined tensor.
inline at::Tensor contiguous_or_undefined(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->contiguous() : at::Tensor();
}

// Data pointer of a possibly undefined tensor (nullptr when undefined).
template <typename T>
inline const T* data_or_null(const at::Tensor& t) {
  return t.defined() ? t.const_data_ptr<T>() : nullptr;
}

// Zeroes the positions [0, rowptr[0]) and [rowptr[N], E) of a per-edge
// output [E, H] made with at::empty: they lie outside every row.
template <typename index_t>
inline void zero_outside_rows(at::Tensor& t, const index_t* rowptr, int64_t N) {
  const int64_t E = t.size(0);
  const int64_t first = clamp64(rowptr[0], 0, E);
  const int64_t last = clamp64(rowptr[N], first, E);
  if (first > 0) t.narrow(0, 0, first).zero_();
  if (last < E) t.narrow(0, last, E - last).zero_();
}

}  // namespace cpu
}  // namespace pyg_fastattn
