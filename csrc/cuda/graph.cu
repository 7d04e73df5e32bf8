// csr_build / csc_build (CUDA): graph preparation in a few fused kernels and
// one radix sort over the needed key bits; no host synchronization.
//
// Unsorted CSR:  keys kernel -> cub radix sort (key, source << 32 |
//                augmented position) -> split kernel (with the pointer at
//                key boundaries) -> pointer fallback (a no-op unless a run
//                of empty rows is long).
// Sorted CSR:    count kernel (kept edges per tile) -> cub exclusive scan
//                of the counts -> scatter kernel (no sort; each edge's CSR
//                position from the tile's prefix, the row pointer at row
//                starts) -> pointer fallback (a no-op unless a run of empty
//                rows is long or the input is bad) -> fix-up kernel (input
//                order of the removed self-loops; clamps when dst decreases
//                somewhere).
// CSC:           tiled keys kernel -> cub radix sort (column, row << 32 | CSR
//                position) -> finish kernel (with the pointer; the inv
//                scatter in passes over ranges of CSR positions that fit
//                L2) -> pointer fallback.
// Keys are uint32, positions and indices fit 31 bits (check_*_build bounds
// the sizes), so a uint64 value carries an index with its position through
// the sort and no kernel gathers at random. cub's radix sort is stable, so
// equal keys keep position order as torch's stable sort does.
#include <ATen/core/CachingHostAllocator.h>
#include <cub/cub.cuh>

#include <tuple>

#include "utils.cuh"

namespace pyg_fastattn {
namespace cuda {
namespace {

using Outputs4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;
using Outputs5 =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Adds status bits (kGraphBad*, common.h) seen by one thread; bad input is
// rare, so the atomic is almost never issued.
__device__ __forceinline__ void report(int32_t* status, int32_t bad) {
  if (bad != 0) atomicOr(status, bad);
}

// Status bits of an input edge's source s and destination d.
__device__ __forceinline__ int32_t range_bits(int64_t s, int64_t d,
                                              int64_t num_src,
                                              int64_t num_dst) {
  return (s < 0 || s >= num_src ? kGraphBadSrc : 0) |
         (d < 0 || d >= num_dst ? kGraphBadDst : 0);
}

// Blocks of a grid-stride launch over n elements (n > 0).
inline unsigned graph_blocks(int64_t n) {
  return static_cast<unsigned>(
      std::min<int64_t>(ceil_div(n, kGraphBlock), kGraphMaxBlocks));
}

// Consecutive positions a block of a tiled kernel takes at a time.
constexpr int64_t kGraphTile = int64_t(kGraphBlock) * kGraphItems;

// Blocks of a tiled launch over n positions (n > 0).
inline unsigned graph_tile_blocks(int64_t n) {
  return static_cast<unsigned>(
      std::min<int64_t>(ceil_div(n, kGraphTile), kGraphMaxBlocks));
}

// (hi << 32) | lo for hi, lo in [0, 2^32).
__device__ __forceinline__ uint64_t pack(uint32_t hi, uint32_t lo) {
  return (static_cast<uint64_t>(hi) << 32) | lo;
}

#define PFA_GRID_STRIDE(i, n)                                            \
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x +       \
                   threadIdx.x;                                          \
       i < (n); i += static_cast<int64_t>(gridDim.x) * blockDim.x)

// Bits that hold every key in [0, max_key] (at least 1).
inline int key_bits(int64_t max_key) {
  int b = 1;
  while (b < 32 && (int64_t(1) << b) <= max_key) ++b;
  return b;
}

__device__ __forceinline__ int64_t clamp_to(int64_t v, int64_t lo,
                                            int64_t hi) {
  return v < lo ? lo : (v > hi ? hi : v);
}

// First i in [0, n) with a[i * stride] >= v, n if none.
template <typename T>
__device__ __forceinline__ int64_t lower_bound(const T* __restrict__ a,
                                               int64_t stride, int64_t n,
                                               int64_t v) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (static_cast<int64_t>(a[mid * stride]) < v) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// First i in [0, n) with a[i] > v, n if none.
template <typename T>
__device__ __forceinline__ int64_t upper_bound(const T* __restrict__ a,
                                               int64_t n, int64_t v) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = (lo + hi) >> 1;
    if (static_cast<int64_t>(a[mid]) <= v) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// One thread per pointer entry d in [0, num_rows] (grid-stride): out[d] =
// number of keys < d, by binary search in the sorted keys, so long runs of
// empty rows cost no more than full ones.
template <typename K, typename out_t>
__global__ void ptr_kernel(const K* __restrict__ keys, int64_t stride,
                           int64_t n, int64_t num_rows,
                           out_t* __restrict__ out) {
  PFA_GRID_STRIDE(d, num_rows + 1) {
    out[d] = static_cast<out_t>(lower_bound(keys, stride, n, d));
  }
}

// Pointer of n > 0 sorted keys (each <= num_rows) at position p: ptr[x] = p
// for x in (key[p - 1], key[p]] (from x = 0 at p = 0) and, at p = n - 1,
// ptr[x] = n for x in (key[n - 1], num_rows]. A run longer than
// kGraphPtrGap sets *fallback instead (ptr_fallback_kernel).
template <typename out_t>
__device__ __forceinline__ void ptr_at(const uint32_t* __restrict__ keys,
                                       int64_t n, int64_t num_rows, int64_t p,
                                       out_t* __restrict__ ptr,
                                       int32_t* __restrict__ fallback) {
  const int64_t k = keys[p];
  const int64_t a = p == 0 ? 0 : static_cast<int64_t>(keys[p - 1]) + 1;
  if (k - a >= kGraphPtrGap) *fallback = 1;
  else for (int64_t x = a; x <= k; ++x) ptr[x] = static_cast<out_t>(p);
  if (p == n - 1) {
    if (num_rows - k > kGraphPtrGap) *fallback = 1;
    else for (int64_t x = k + 1; x <= num_rows; ++x)
      ptr[x] = static_cast<out_t>(n);
  }
}

// One thread per pointer entry d in [0, num_rows] (grid-stride), only when
// *fallback is set: ptr_kernel's binary search.
template <typename out_t>
__global__ void ptr_fallback_kernel(const int32_t* __restrict__ fallback,
                                    const uint32_t* __restrict__ keys,
                                    int64_t n, int64_t num_rows,
                                    out_t* __restrict__ out) {
  if (*fallback == 0) return;
  PFA_GRID_STRIDE(d, num_rows + 1) {
    out[d] = static_cast<out_t>(lower_bound(keys, 1, n, d));
  }
}

// Unsorted CSR. One thread per augmented edge i in [0, E + L)
// (grid-stride): its sort key (destination; num_dst for a removed
// self-loop; d for the added loop (d, d)), its value (source as int32, the
// col it gets) << 32 | i, removed and the range bits.
template <typename index_t>
__global__ void csr_keys_kernel(const index_t* __restrict__ src, int64_t ss,
                                const index_t* __restrict__ dst, int64_t ds,
                                int64_t E, int64_t L, int64_t num_src,
                                int64_t num_dst, uint32_t* __restrict__ key,
                                uint64_t* __restrict__ val,
                                bool* __restrict__ removed,
                                int32_t* __restrict__ status) {
  PFA_GRID_STRIDE(i, E + L) {
    int64_t c;
    if (i < E) {
      const int64_t s = src[i * ss], d = dst[i * ds];
      report(status, range_bits(s, d, num_src, num_dst));
      const bool loop = L > 0 && s == d;
      key[i] = static_cast<uint32_t>(loop ? num_dst : clamp_to(d, 0, num_dst));
      removed[i] = loop;
      c = s;
    } else {
      c = i - E;
      key[i] = static_cast<uint32_t>(c);
      removed[i] = false;
    }
    val[i] = pack(static_cast<uint32_t>(static_cast<int32_t>(c)),
                  static_cast<uint32_t>(i));
  }
}

// Unsorted CSR. One thread per CSR position p (grid-stride): the value
// sorted there gives perm[p] (low half) and col[p] (high half); the sorted
// keys give rowptr entries (ptr_at).
__global__ void csr_split_kernel(const uint64_t* __restrict__ val,
                                 const uint32_t* __restrict__ keys, int64_t n,
                                 int64_t num_dst, int64_t* __restrict__ perm,
                                 int32_t* __restrict__ col,
                                 int32_t* __restrict__ rowptr,
                                 int32_t* __restrict__ fallback) {
  PFA_GRID_STRIDE(p, n) {
    const uint64_t v = val[p];
    perm[p] = static_cast<int64_t>(v & 0xffffffffu);
    col[p] = static_cast<int32_t>(static_cast<uint32_t>(v >> 32));
    ptr_at(keys, n, num_dst, p, rowptr, fallback);
  }
}

// Sorted CSR without loops. One thread per edge e (grid-stride): CSR
// position = input position; range and order bits.
template <typename index_t>
__global__ void csr_copy_kernel(const index_t* __restrict__ src, int64_t ss,
                                const index_t* __restrict__ dst, int64_t ds,
                                int64_t E, int64_t num_src, int64_t num_dst,
                                int64_t* __restrict__ perm,
                                int32_t* __restrict__ col,
                                bool* __restrict__ removed,
                                int32_t* __restrict__ status) {
  PFA_GRID_STRIDE(e, E) {
    const int64_t s = src[e * ss], d = dst[e * ds];
    const bool down = e > 0 && static_cast<int64_t>(dst[(e - 1) * ds]) > d;
    report(status, range_bits(s, d, num_src, num_dst) |
                       (down ? kGraphUnsorted : 0));
    perm[e] = e;
    col[e] = static_cast<int32_t>(s);
    removed[e] = false;
  }
}

// Sorted CSR with loops: keep(i) = 1 for an input edge i < E that is not a
// self-loop, 0 at i = E (so the exclusive scan of [0, E] ends with the kept
// total).
template <typename index_t>
__device__ __forceinline__ bool keep_edge(const index_t* __restrict__ src,
                                          int64_t ss,
                                          const index_t* __restrict__ dst,
                                          int64_t ds, int64_t E, int64_t i) {
  return i < E && src[i * ss] != dst[i * ds];
}

// Sorted CSR with loops: csr_sorted_scatter_kernel calls this for every i
// in [0, E] with before = kept edges before i. An input edge i < E gets
// its CSR position p (row d: kept edges in input order, then the loop
// (d, d)): perm[p] = i, col[p] = its source; and removed[i], the range and
// order bits. A removed self-loop, the r-th (r = i - before),
// goes to n - 1 - r: the tail in reverse, since the kept total is not known
// yet (csr_sorted_fixup_kernel restores input order). Non-decreasing dst
// (in range or not) makes p a bijection onto [0, n); a decrease sets
// kGraphUnsorted (p is clamped, positions may be missed). Row pointer: with
// h = min(dst[i], num_dst) (num_dst at i = E), for every row x in
// (dst[i - 1], h] (from 0 at i = 0), rowptr[x] = before + min(x, L) and,
// for 1 <= x <= L, the loop of row x - 1 takes slot rowptr[x] - 1; a run
// longer than kGraphPtrGap sets *fallback instead (csr_sorted_ptr_kernel).
// ck[i] = before is kept for that kernel at row starts and at i = E.
template <typename index_t>
struct SortedScatter {
  const index_t* src;
  int64_t ss;
  const index_t* dst;
  int64_t ds;
  int64_t E, L, num_src, num_dst;
  int32_t* ck;
  int64_t* perm;
  int32_t* col;
  bool* removed;
  int32_t* rowptr;
  int32_t* fallback;
  int32_t* status;

  __device__ __forceinline__ void operator()(int64_t i,
                                             int64_t before) const {
    const int64_t n = E + L;
    const bool first = i == 0;
    const int64_t prev = first ? -1 : static_cast<int64_t>(dst[(i - 1) * ds]);
    int64_t h = num_dst;
    if (i < E) {
      const int64_t s = src[i * ss], d = dst[i * ds];
      const bool loop = s == d;
      const int64_t p = clamp_to(
          loop ? n - 1 - (i - before) : before + clamp_to(d, 0, L), 0, n - 1);
      removed[i] = loop;
      perm[p] = i;
      col[p] = static_cast<int32_t>(s);
      report(status, range_bits(s, d, num_src, num_dst) |
                         (!first && prev > d ? kGraphUnsorted : 0));
      h = d < num_dst ? d : num_dst;
    }
    const int64_t a = prev + 1 > 0 ? prev + 1 : 0;
    if (i == E) ck[E] = static_cast<int32_t>(before);
    if (h < a) return;
    ck[i] = static_cast<int32_t>(before);  // a row start
    if (h - a >= kGraphPtrGap) {
      *fallback = 1;
      return;
    }
    for (int64_t x = a; x <= h; ++x) {
      const int64_t r = before + (x < L ? x : L);
      rowptr[x] = static_cast<int32_t>(r);
      if (x >= 1 && x <= L) {
        const int64_t q = clamp_to(r - 1, 0, n - 1);
        perm[q] = E + x - 1;
        col[q] = static_cast<int32_t>(x - 1);
        removed[E + x - 1] = false;
      }
    }
  }
};

// Sorted CSR with loops, pass 1. One block per tile of kGraphTile positions
// of [0, E] (block-stride over tiles): cnt[t] = kept edges in tile t.
// Thread k reads positions t0 + k + j * kGraphBlock (coalesced).
template <typename index_t>
__global__ void __launch_bounds__(kGraphBlock)
    csr_keep_count_kernel(const index_t* __restrict__ src, int64_t ss,
                          const index_t* __restrict__ dst, int64_t ds,
                          int64_t E, int64_t tiles, int32_t* __restrict__ cnt) {
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t t0 = t * kGraphTile;
    int c = 0;
#pragma unroll
    for (int j = 0; j < kGraphItems; ++j)
      c += __syncthreads_count(
          keep_edge(src, ss, dst, ds, E, t0 + threadIdx.x + j * kGraphBlock));
    if (threadIdx.x == 0) cnt[t] = c;
  }
}

// Sorted CSR with loops, pass 2. One block per tile (block-stride), the
// tile's positions in kGraphItems rounds of kGraphBlock consecutive ones:
// before = base[t] (kept edges before the tile) + the round's exclusive
// prefix (warp ballots, then the warps' counts in shared memory), then
// SortedScatter for the position.
template <typename index_t>
__global__ void __launch_bounds__(kGraphBlock)
    csr_sorted_scatter_kernel(SortedScatter<index_t> op, int64_t tiles,
                              const int32_t* __restrict__ base) {
  __shared__ int s_warp[kGraphBlock / 32];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned below = (1u << lane) - 1u;
  for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int64_t t0 = t * kGraphTile;
    int64_t before = base[t];
    for (int j = 0; j < kGraphItems; ++j) {
      const int64_t i = t0 + threadIdx.x + j * kGraphBlock;
      const bool k = keep_edge(op.src, op.ss, op.dst, op.ds, op.E, i);
      const unsigned ball = __ballot_sync(0xffffffffu, k);
      if (lane == 0) s_warp[warp] = __popc(ball);
      __syncthreads();
      int ahead = 0, total = 0;
#pragma unroll
      for (int w = 0; w < kGraphBlock / 32; ++w) {
        const int c = s_warp[w];
        ahead += w < warp ? c : 0;
        total += c;
      }
      if (i <= op.E) op(i, before + ahead + __popc(ball & below));
      before += total;
      __syncthreads();  // s_warp is rewritten next round
    }
  }
}

// Sorted CSR with loops, after the scan. One thread per row pointer x in
// [0, num_dst] (grid-stride), only when a run of empty rows was too long for
// the scan (*fallback) or the input is bad (status): rowptr[x] = kept edges
// before row x (ck at the first edge with dst >= x, a row start, by binary
// search) plus the loops of rows < x, and the loop of row x - 1 in slot
// rowptr[x] - 1 (as SortedScatter). With dst decreasing somewhere
// (kGraphUnsorted) the search may miss the row starts: kept * x / num_dst
// stands in (a monotone pointer in range).
template <typename index_t>
__global__ void csr_sorted_ptr_kernel(const int32_t* __restrict__ fallback,
                                      const int32_t* __restrict__ status,
                                      const index_t* __restrict__ dst,
                                      int64_t ds, const int32_t* __restrict__ ck,
                                      int64_t E, int64_t L, int64_t num_dst,
                                      int32_t* __restrict__ rowptr,
                                      int64_t* __restrict__ perm,
                                      int32_t* __restrict__ col,
                                      bool* __restrict__ removed) {
  if (*fallback == 0 && *status == 0) return;
  const int64_t n = E + L;
  const int64_t kept = ck[E];
  const bool unsorted = (*status & kGraphUnsorted) != 0;
  PFA_GRID_STRIDE(x, num_dst + 1) {
    const int64_t k =
        unsorted ? kept * x / (num_dst > 0 ? num_dst : 1)
                 : static_cast<int64_t>(ck[lower_bound(dst, ds, E, x)]);
    const int64_t r = clamp_to(k, 0, kept) + (x < L ? x : L);
    rowptr[x] = static_cast<int32_t>(r);
    if (x >= 1 && x <= L) {
      const int64_t p = clamp_to(r - 1, 0, n - 1);
      perm[p] = E + x - 1;
      col[p] = static_cast<int32_t>(x - 1);
      removed[E + x - 1] = false;
    }
  }
}

// Sorted CSR with loops, last. Sorted input: the R = E - kept removed
// self-loops sit in the tail [n - R, n) in reverse; one thread per pair
// (grid-stride) swaps them into input order (nothing to do without input
// self-loops). Declared sorted but dst decreasing somewhere (kGraphUnsorted):
// one thread per CSR position clamps perm into [0, n) and col into
// [0, num_src) instead, so positions the scatter missed hold in-range
// garbage.
__global__ void csr_sorted_fixup_kernel(const int32_t* __restrict__ status,
                                        const int32_t* __restrict__ ck,
                                        int64_t E, int64_t n, int64_t num_src,
                                        int64_t* __restrict__ perm,
                                        int32_t* __restrict__ col) {
  if ((*status & kGraphUnsorted) == 0) {
    const int64_t R = E - ck[E], base = n - R;
    PFA_GRID_STRIDE(t, R / 2) {
      const int64_t u = base + t, v = n - 1 - t;
      const int64_t pu = perm[u];
      perm[u] = perm[v];
      perm[v] = pu;
      const int32_t cu = col[u];
      col[u] = col[v];
      col[v] = cu;
    }
    return;
  }
  PFA_GRID_STRIDE(p, n) {
    perm[p] = clamp_to(perm[p], 0, n - 1);
    col[p] = static_cast<int32_t>(
        clamp_to(static_cast<int64_t>(col[p]), 0, num_src - 1));
  }
}

// CSC. One block per tile of kGraphTile consecutive CSR positions
// (block-stride over tiles): two threads find the rows of the tile's first
// and last positions by binary search in rowptr, then each thread takes the
// positions t0 + tid + j * kGraphBlock and searches its row among the
// tile's rows only (few levels, cached). key = column (num_cols from
// rowptr[N] on), val = row << 32 | position.
template <typename index_t>
__global__ void __launch_bounds__(kGraphBlock)
    csc_keys_kernel(const index_t* __restrict__ rowptr, int64_t N,
                    const index_t* __restrict__ col, int64_t E,
                    int64_t num_cols, uint32_t* __restrict__ key,
                    uint64_t* __restrict__ val) {
  __shared__ int64_t rows[2];
  const int64_t tail = tail_begin(rowptr, N, E);
  const int64_t step = static_cast<int64_t>(gridDim.x) * kGraphTile;
  for (int64_t t0 = static_cast<int64_t>(blockIdx.x) * kGraphTile; t0 < E;
       t0 += step) {  // uniform over the block
    const int64_t t1 = t0 + kGraphTile < E ? t0 + kGraphTile : E;
    if (threadIdx.x < 2)
      rows[threadIdx.x] =
          upper_bound(rowptr + 1, N, threadIdx.x == 0 ? t0 : t1 - 1);
    __syncthreads();
    // Rows of [t0, t1) lie in [lo, hi] when rowptr is non-decreasing (and
    // stay in [0, N] when it is not).
    const int64_t lo = rows[0], hi = rows[1] > lo ? rows[1] : lo;
    for (int64_t e = t0 + threadIdx.x; e < t1; e += kGraphBlock) {
      const int64_t r = lo + upper_bound(rowptr + 1 + lo, hi - lo, e);
      key[e] = static_cast<uint32_t>(
          e < tail ? clamp_to(static_cast<int64_t>(col[e]), 0, num_cols)
                   : num_cols);
      val[e] = pack(static_cast<uint32_t>(r), static_cast<uint32_t>(e));
    }
    __syncthreads();  // rows[] is rewritten for the next tile
  }
}

// CSC. One thread per CSC position k (grid-stride). The first pass reads
// the value sorted there (row << 32 | CSR position e) and writes perm[k] = e,
// row[k] and the colptr entries of the sorted keys (ptr_at); later passes
// read e back from perm (half the bytes when index_t is int32). Each pass
// writes inv[e] = k for e in [lo, hi) (the one random access, a write):
// csc_build launches it once per range of e whose inv slice fits
// kGraphInvPassBytes, so the scatter of each pass merges in L2. Values and
// perm are read with an evict-first hint.
template <typename index_t>
__global__ void csc_finish_kernel(const uint64_t* __restrict__ val,
                                  const uint32_t* __restrict__ keys,
                                  int64_t E, int64_t num_cols, int64_t lo,
                                  int64_t hi, bool first,
                                  index_t* __restrict__ perm,
                                  index_t* __restrict__ inv,
                                  index_t* __restrict__ row,
                                  index_t* __restrict__ colptr,
                                  int32_t* __restrict__ fallback) {
  if (first) {
    PFA_GRID_STRIDE(k, E) {
      const uint64_t v =
          __ldcs(reinterpret_cast<const unsigned long long*>(val) + k);
      const int64_t e = static_cast<int64_t>(v & 0xffffffffu);
      if (e < hi) inv[e] = static_cast<index_t>(k);  // lo == 0
      perm[k] = static_cast<index_t>(e);
      row[k] = static_cast<index_t>(v >> 32);
      ptr_at(keys, E, num_cols, k, colptr, fallback);
    }
  } else {
    PFA_GRID_STRIDE(k, E) {
      const int64_t e = static_cast<int64_t>(__ldcs(perm + k));
      if (e >= lo && e < hi) inv[e] = static_cast<index_t>(k);
    }
  }
}

// Entries of inv per csc_finish_kernel pass (at least 1): kGraphInvPassBytes,
// or PYG_FASTATTN_INV_PASS_BYTES when set (tests), over index_bytes; read at
// every launch.
inline int64_t inv_pass_entries(int64_t index_bytes) {
  int64_t bytes = kGraphInvPassBytes;
  if (const char* env = std::getenv("PYG_FASTATTN_INV_PASS_BYTES")) {
    const long long n = std::atoll(env);
    if (n > 0) bytes = n;
  }
  return std::max<int64_t>(1, bytes / index_bytes);
}

// Stable sort of n (key, value) pairs by key bits [0, end_bit), in place
// in the double buffers (the sorted pairs end in keys.Current() and
// vals.Current()); temp storage from the caching allocator on the current
// stream.
template <typename V>
void sort_pairs(cub::DoubleBuffer<uint32_t>& keys, cub::DoubleBuffer<V>& vals,
                int64_t n, int end_bit, const at::TensorOptions& opt,
                cudaStream_t stream) {
  if (n == 0) return;
  size_t bytes = 0;
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, keys, vals, static_cast<int>(n), 0, end_bit, stream));
  at::Tensor tmp = at::empty({static_cast<int64_t>(bytes)}, opt.dtype(at::kByte));
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      tmp.data_ptr(), bytes, keys, vals, static_cast<int>(n), 0, end_bit,
      stream));
}

// out[i] = in[0] + ... + in[i - 1] over n items (cub's single-pass scan).
template <typename InputIt, typename OutputIt>
void exclusive_sum(InputIt in, OutputIt out, int64_t n,
                   const at::TensorOptions& opt, cudaStream_t stream) {
  size_t bytes = 0;
  C10_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(nullptr, bytes, in, out,
                                               static_cast<int>(n), stream));
  at::Tensor tmp = at::empty({static_cast<int64_t>(bytes)}, opt.dtype(at::kByte));
  C10_CUDA_CHECK(cub::DeviceScan::ExclusiveSum(tmp.data_ptr(), bytes, in, out,
                                               static_cast<int>(n), stream));
}

Outputs5 csr_build_cuda(const at::Tensor& src, const at::Tensor& dst,
                        int64_t num_src, int64_t num_dst, bool add_self_loops,
                        bool is_sorted) {
  check_csr_build(src, dst, num_src, num_dst, add_self_loops);
  const c10::cuda::CUDAGuard guard(src.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t E = src.numel();
  const int64_t L = add_self_loops ? std::min(num_src, num_dst) : 0;
  const int64_t n = E + L;
  const auto opt = src.options();
  const auto i32 = opt.dtype(at::kInt);
  at::Tensor rowptr = at::empty({num_dst + 1}, i32);
  at::Tensor col = at::empty({n}, i32);
  at::Tensor perm = at::empty({n}, opt.dtype(at::kLong));
  at::Tensor removed = at::empty({n}, opt.dtype(at::kBool));
  at::Tensor status = at::zeros({1}, i32);
  int32_t* st = status.data_ptr<int32_t>();
  PFA_DISPATCH_INDEX(src.scalar_type(), "csr_build_cuda", [&] {
    const index_t* s = src.const_data_ptr<index_t>();
    const index_t* d = dst.const_data_ptr<index_t>();
    const int64_t ss = src.stride(0), ds = dst.stride(0);
    int32_t* rp = rowptr.data_ptr<int32_t>();
    int32_t* cl = col.data_ptr<int32_t>();
    int64_t* pm = perm.data_ptr<int64_t>();
    bool* rm = removed.data_ptr<bool>();
    if (!is_sorted) {
      // Keys (two buffers), then the pointer fallback flag.
      at::Tensor keys = at::empty({2 * n + 1}, i32);
      at::Tensor vals = at::empty({2 * n}, opt.dtype(at::kLong));
      uint32_t* k0 = reinterpret_cast<uint32_t*>(keys.data_ptr<int32_t>());
      uint64_t* v0 = reinterpret_cast<uint64_t*>(vals.data_ptr<int64_t>());
      int32_t* fallback = keys.data_ptr<int32_t>() + 2 * n;
      C10_CUDA_CHECK(cudaMemsetAsync(fallback, n > 0 ? 0 : 1,
                                     sizeof(int32_t), stream));
      if (n > 0) {
        csr_keys_kernel<index_t><<<graph_blocks(n), kGraphBlock, 0, stream>>>(
            s, ss, d, ds, E, L, num_src, num_dst, k0, v0, rm, st);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      cub::DoubleBuffer<uint32_t> kb(k0, k0 + n);
      cub::DoubleBuffer<uint64_t> vb(v0, v0 + n);
      sort_pairs(kb, vb, n, key_bits(num_dst), opt, stream);
      if (n > 0) {
        csr_split_kernel<<<graph_blocks(n), kGraphBlock, 0, stream>>>(
            vb.Current(), kb.Current(), n, num_dst, pm, cl, rp, fallback);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      ptr_fallback_kernel<int32_t>
          <<<graph_blocks(num_dst + 1), kGraphBlock, 0, stream>>>(
              fallback, kb.Current(), n, num_dst, rp);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else if (L == 0) {
      ptr_kernel<index_t, int32_t>
          <<<graph_blocks(num_dst + 1), kGraphBlock, 0, stream>>>(
              d, ds, E, num_dst, rp);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (E > 0) {
        csr_copy_kernel<index_t><<<graph_blocks(E), kGraphBlock, 0, stream>>>(
            s, ss, d, ds, E, num_src, num_dst, pm, cl, rm, st);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    } else {
      // ck [E + 1] (kept edges before i, at row starts and E), the pointer
      // fallback flag, then the tiles' kept counts and their prefix.
      const int64_t tiles = ceil_div(E + 1, kGraphTile);
      at::Tensor work = at::empty({E + 2 + 2 * tiles}, i32);
      int32_t* ck = work.data_ptr<int32_t>();
      int32_t* fallback = ck + E + 1;
      int32_t* cnt = fallback + 1;
      int32_t* base = cnt + tiles;
      C10_CUDA_CHECK(cudaMemsetAsync(fallback, 0, sizeof(int32_t), stream));
      const unsigned grid = static_cast<unsigned>(
          std::min<int64_t>(tiles, kGraphMaxBlocks));
      csr_keep_count_kernel<index_t><<<grid, kGraphBlock, 0, stream>>>(
          s, ss, d, ds, E, tiles, cnt);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      exclusive_sum(cnt, base, tiles, opt, stream);
      csr_sorted_scatter_kernel<index_t><<<grid, kGraphBlock, 0, stream>>>(
          SortedScatter<index_t>{s, ss, d, ds, E, L, num_src, num_dst, ck, pm,
                                 cl, rm, rp, fallback, st},
          tiles, base);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      csr_sorted_ptr_kernel<index_t>
          <<<graph_blocks(num_dst + 1), kGraphBlock, 0, stream>>>(
              fallback, st, d, ds, ck, E, L, num_dst, rp, pm, cl, rm);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      csr_sorted_fixup_kernel<<<graph_blocks(n), kGraphBlock, 0, stream>>>(
          st, ck, E, n, num_src, pm, cl);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return {rowptr, col, perm, removed, status};
}

Outputs4 csc_build_cuda(const at::Tensor& rowptr_, const at::Tensor& col_,
                        int64_t num_cols) {
  check_csc_build(rowptr_, col_, num_cols);
  const c10::cuda::CUDAGuard guard(rowptr_.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor rowptr = rowptr_.contiguous(), col = col_.contiguous();
  const int64_t N = rowptr.numel() - 1, E = col.numel();
  const auto opt = rowptr.options();
  const auto i32 = opt.dtype(at::kInt);
  at::Tensor colptr = at::empty({num_cols + 1}, opt);
  at::Tensor row = at::empty({E}, opt);
  at::Tensor perm = at::empty({E}, opt);
  at::Tensor inv = at::empty({E}, opt);
  // Keys (two buffers), then the pointer fallback flag.
  at::Tensor keys = at::empty({2 * E + 1}, i32);
  at::Tensor vals = at::empty({2 * E}, opt.dtype(at::kLong));
  uint32_t* k0 = reinterpret_cast<uint32_t*>(keys.data_ptr<int32_t>());
  uint64_t* v0 = reinterpret_cast<uint64_t*>(vals.data_ptr<int64_t>());
  int32_t* fallback = keys.data_ptr<int32_t>() + 2 * E;
  C10_CUDA_CHECK(
      cudaMemsetAsync(fallback, E > 0 ? 0 : 1, sizeof(int32_t), stream));
  PFA_DISPATCH_INDEX(rowptr.scalar_type(), "csc_build_cuda", [&] {
    const index_t* rp = rowptr.const_data_ptr<index_t>();
    if (E > 0) {
      csc_keys_kernel<index_t>
          <<<graph_tile_blocks(E), kGraphBlock, 0, stream>>>(
              rp, N, col.const_data_ptr<index_t>(), E, num_cols, k0, v0);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
    cub::DoubleBuffer<uint32_t> kb(k0, k0 + E);
    cub::DoubleBuffer<uint64_t> vb(v0, v0 + E);
    sort_pairs(kb, vb, E, key_bits(num_cols), opt, stream);
    index_t* cp = colptr.data_ptr<index_t>();
    if (E > 0) {
      const int64_t pass = inv_pass_entries(sizeof(index_t));
      for (int64_t lo = 0; lo < E; lo += pass) {
        const int64_t hi = E - lo > pass ? lo + pass : E;
        csc_finish_kernel<index_t>
            <<<graph_blocks(E), kGraphBlock, 0, stream>>>(
                vb.Current(), kb.Current(), E, num_cols, lo, hi, lo == 0,
                perm.data_ptr<index_t>(), inv.data_ptr<index_t>(),
                row.data_ptr<index_t>(), cp, fallback);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    }
    ptr_fallback_kernel<index_t>
        <<<graph_blocks(num_cols + 1), kGraphBlock, 0, stream>>>(
            fallback, kb.Current(), E, num_cols, cp);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {colptr, row, perm, inv};
}

// graph_lengths. One thread per pointer entry i of either pointer
// (grid-stride over both, at most kGraphLengthBlocks blocks): its row length
// (a decreasing step counts as 0), a warp max, a block max in shared memory,
// then one atomicMax per block into out[k] (zeroed before): few atomics on
// the two addresses, which serialize.
template <typename index_t>
__global__ void __launch_bounds__(kGraphBlock)
    lengths_kernel(const index_t* __restrict__ rowptr, int64_t N,
                   const index_t* __restrict__ colptr, int64_t C,
                   unsigned long long* __restrict__ out) {
  __shared__ unsigned long long s_max[2][kGraphBlock / 32];
  unsigned long long r = 0, c = 0;
  PFA_GRID_STRIDE(i, N > C ? N : C) {
    if (i < N) {
      const int64_t d = static_cast<int64_t>(rowptr[i + 1]) - rowptr[i];
      if (d > 0 && static_cast<unsigned long long>(d) > r) r = d;
    }
    if (i < C) {
      const int64_t d = static_cast<int64_t>(colptr[i + 1]) - colptr[i];
      if (d > 0 && static_cast<unsigned long long>(d) > c) c = d;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long r2 = __shfl_down_sync(0xffffffffu, r, o);
    const unsigned long long c2 = __shfl_down_sync(0xffffffffu, c, o);
    r = r2 > r ? r2 : r;
    c = c2 > c ? c2 : c;
  }
  if ((threadIdx.x & 31) == 0) {
    s_max[0][threadIdx.x >> 5] = r;
    s_max[1][threadIdx.x >> 5] = c;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < kGraphBlock / 32; ++w) {
      r = s_max[0][w] > r ? s_max[0][w] : r;
      c = s_max[1][w] > c ? s_max[1][w] : c;
    }
    if (r > 0) atomicMax(out, r);
    if (c > 0) atomicMax(out + 1, c);
  }
}

// The two maxima on the device, then one copy into pinned host memory on
// the current stream (no synchronization: the caller waits on an event).
at::Tensor graph_lengths_cuda(const at::Tensor& rowptr_, const at::Tensor& colptr_) {
  check_graph_lengths(rowptr_, colptr_);
  PFA_CHECK(rowptr_.scalar_type() == colptr_.scalar_type(),
            "`rowptr` and `colptr` must have one dtype, got ",
            rowptr_.scalar_type(), " and ", colptr_.scalar_type());
  const c10::cuda::CUDAGuard guard(rowptr_.device());
  cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const at::Tensor rowptr = rowptr_.contiguous(), colptr = colptr_.contiguous();
  const int64_t N = rowptr.numel() - 1, C = colptr.numel() - 1;
  at::Tensor dev = at::empty({2}, rowptr.options().dtype(at::kLong));
  at::Tensor host = at::empty(
      {2}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  C10_CUDA_CHECK(cudaMemsetAsync(dev.data_ptr(), 0, 2 * sizeof(int64_t), stream));
  if (std::max(N, C) > 0) {
    PFA_DISPATCH_INDEX(rowptr.scalar_type(), "graph_lengths_cuda", [&] {
      lengths_kernel<index_t>
          <<<std::min<unsigned>(graph_blocks(std::max(N, C)),
                                kGraphLengthBlocks),
             kGraphBlock, 0, stream>>>(
              rowptr.const_data_ptr<index_t>(), N,
              colptr.const_data_ptr<index_t>(), C,
              reinterpret_cast<unsigned long long*>(dev.data_ptr<int64_t>()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  }
  C10_CUDA_CHECK(cudaMemcpyAsync(host.data_ptr(), dev.data_ptr(),
                                 2 * sizeof(int64_t), cudaMemcpyDeviceToHost,
                                 stream));
  // the pinned block is not handed out again before the copy has landed
  at::getHostAllocator(at::kCUDA)->record_event(
      host.data_ptr(), host.storage().data_ptr().get_context(),
      at::cuda::getCurrentCUDAStream().unwrap());
  return host;
}

#undef PFA_GRID_STRIDE

}  // namespace
}  // namespace cuda
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, CUDA, m) {
  m.impl("csr_build", &pyg_fastattn::cuda::csr_build_cuda);
  m.impl("csc_build", &pyg_fastattn::cuda::csc_build_cuda);
  m.impl("graph_lengths", &pyg_fastattn::cuda::graph_lengths_cuda);
}
