// Shared device helpers for the CUDA kernels: accumulation types, math,
// warp reductions, 16-byte vector loads, row-range clamping, lane layouts.
#pragma once

#include <cmath>
#include <cstdint>
#include <climits>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include "../common.h"

namespace pyg_fastattn {
namespace cuda {

constexpr int kWarp = 32;
constexpr int kWarpsPerBlock = kBlock / kWarp;
constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------------------
// Accumulation type and conversions: float for half/bfloat16/float, double
// for double.
template <typename T> struct AccType { using type = float; };
template <> struct AccType<double> { using type = double; };
template <typename T> using acc_t = typename AccType<T>::type;

template <typename T>
__device__ __forceinline__ acc_t<T> to_acc(T x) {
  return static_cast<acc_t<T>>(x);
}
template <typename T, typename A>
__device__ __forceinline__ T from_acc(A x) {
  return static_cast<T>(x);
}

__device__ __forceinline__ float pfa_exp(float x) { return expf(x); }
__device__ __forceinline__ double pfa_exp(double x) { return exp(x); }
__device__ __forceinline__ float pfa_log(float x) { return logf(x); }
__device__ __forceinline__ double pfa_log(double x) { return log(x); }

// 1 / x without a call to the IEEE division slow path (x >= 1 where used;
// 0 / NaN pass through to inf / NaN).
__device__ __forceinline__ float fast_recip(float x) {
  return __fdividef(1.0f, x);
}
__device__ __forceinline__ double fast_recip(double x) { return 1.0 / x; }

template <typename A> __device__ __forceinline__ A pos_inf() {
  return static_cast<A>(INFINITY);
}
template <typename A> __device__ __forceinline__ A neg_inf() {
  return -static_cast<A>(INFINITY);
}
template <typename A> __device__ __forceinline__ A quiet_nan() {
  return static_cast<A>(NAN);
}
// Whether a row's lse gives its entries a weight: not for -inf (an empty
// row, or all -inf). A NaN or +inf lse does (the weights are then NaN), so
// the gradients carry the row's NaN as autograd through PyG's softmax does.
template <typename A> __device__ __forceinline__ bool has_weight(A lse) {
  return lse != neg_inf<A>();
}

// leaky_relu exactly as the reference writes it: z > 0 ? z : z * slope.
template <typename A>
__device__ __forceinline__ A leaky(A z, A slope) {
  return z > A(0) ? z : z * slope;
}

// ---------------------------------------------------------------------------
// Online softmax state (running max m, running sum s of exp(x - m)).
// Semantics match reference._row_softmax:
//  * -inf entries contribute nothing (also while m is still -inf);
//  * NaN entries make s NaN, so the whole row becomes NaN;
//  * a +inf entry makes the row NaN (exp(inf - inf)); see finish().
template <typename A>
__device__ __forceinline__ void online_add(A& m, A& s, A x) {
  if (x > m) {
    s = s * pfa_exp(m - x) + A(1);
    m = x;
  } else if (x != neg_inf<A>()) {
    s += pfa_exp(x - m);  // NaN x or x == m == +inf give NaN
  }
}

template <typename A>
__device__ __forceinline__ void online_merge(A& m, A& s, A m2, A s2) {
  const A mx = m > m2 ? m : m2;
  if (mx == neg_inf<A>()) {
    s = s + s2;  // both 0, or NaN
  } else {
    s = s * pfa_exp(m - mx) + s2 * pfa_exp(m2 - mx);
  }
  m = mx;
}

// After the last merge: a +inf maximum makes the row NaN (as exp(inf - inf)
// does in the reference).
template <typename A>
__device__ __forceinline__ void online_finish(A m, A& s) {
  if (m == pos_inf<A>()) s = quiet_nan<A>();
}

// softmax weight of one entry given the finished row state (m, s, 1/s):
// rows with m == -inf (empty or all -inf) give s, i.e. 0 (or NaN).
template <typename A>
__device__ __forceinline__ A softmax_weight(A x, A m, A s, A inv) {
  return m == neg_inf<A>() ? s : pfa_exp(x - m) * inv;
}

// log-sum-exp of a finished row state; -inf for empty / all -inf rows.
template <typename A>
__device__ __forceinline__ A softmax_lse(A m, A s) {
  return (m == neg_inf<A>() ? A(0) : m) + pfa_log(s);
}

// ---------------------------------------------------------------------------
// Warp reductions over the lanes whose ids differ only in bits [lo, hi)
// (lo, hi powers of two). All lanes of `mask` must call them.
template <typename A>
__device__ __forceinline__ A xor_sum(A v, int lo, int hi,
                                     unsigned mask = kFullMask) {
  for (int off = lo; off < hi; off <<= 1) v += __shfl_xor_sync(mask, v, off);
  return v;
}

// ---------------------------------------------------------------------------
// Vectors of V elements, loaded / stored with one instruction (16 bytes when
// V = 16 / sizeof(T)). Callers guarantee alignment. The storage is raw 32-bit
// words (16-bit for a single half), so selects and copies stay in registers;
// get / set convert single elements from / to the accumulation type.
template <typename T, int V>
struct Vec {
  static constexpr int kBytes = static_cast<int>(sizeof(T)) * V;
  using word_t = typename std::conditional<kBytes % 4 == 0, uint32_t,
                                           uint16_t>::type;
  static constexpr int kWords = kBytes / static_cast<int>(sizeof(word_t));
  alignas(kBytes) word_t w[kWords];
};

// 16-bit element k of a vector (half / bfloat16 storage).
template <typename T, int V>
__device__ __forceinline__ uint16_t vec_u16(const Vec<T, V>& x, int k) {
  if constexpr (sizeof(typename Vec<T, V>::word_t) == 2) {
    return x.w[k];
  } else {
    return static_cast<uint16_t>(x.w[k >> 1] >> ((k & 1) * 16));
  }
}
template <typename T, int V>
__device__ __forceinline__ void vec_set_u16(Vec<T, V>& x, int k, uint16_t b) {
  if constexpr (sizeof(typename Vec<T, V>::word_t) == 2) {
    x.w[k] = b;
  } else {
    const int sh = (k & 1) * 16;
    x.w[k >> 1] = (x.w[k >> 1] & ~(0xffffu << sh)) | (uint32_t(b) << sh);
  }
}

template <typename T, int V>
__device__ __forceinline__ acc_t<T> vec_get(const Vec<T, V>& x, int k) {
  if constexpr (std::is_same<T, float>::value) {
    return __uint_as_float(x.w[k]);
  } else if constexpr (std::is_same<T, double>::value) {
    return __hiloint2double(static_cast<int>(x.w[2 * k + 1]),
                            static_cast<int>(x.w[2 * k]));
  } else if constexpr (std::is_same<T, c10::BFloat16>::value) {
    return __uint_as_float(uint32_t(vec_u16(x, k)) << 16);
  } else {
    static_assert(std::is_same<T, c10::Half>::value, "unsupported type");
    return __half2float(__ushort_as_half(vec_u16(x, k)));
  }
}

template <typename T, int V>
__device__ __forceinline__ void vec_set(Vec<T, V>& x, int k, acc_t<T> a) {
  if constexpr (std::is_same<T, float>::value) {
    x.w[k] = __float_as_uint(a);
  } else if constexpr (std::is_same<T, double>::value) {
    x.w[2 * k] = static_cast<uint32_t>(__double2loint(a));
    x.w[2 * k + 1] = static_cast<uint32_t>(__double2hiint(a));
  } else {
    // Same rounding as the c10 conversions (round to nearest even).
    const T t = static_cast<T>(a);
    vec_set_u16(x, k, t.x);
  }
}

template <typename T, int V>
__device__ __forceinline__ Vec<T, V> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, V>*>(p);
}

template <typename T, int V>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, V>& x) {
  *reinterpret_cast<Vec<T, V>*>(p) = x;
}

template <typename T, int V>
__device__ __forceinline__ Vec<T, V> zero_vec() {
  Vec<T, V> x;
#pragma unroll
  for (int k = 0; k < Vec<T, V>::kWords; ++k) x.w[k] = 0;
  return x;
}

// ---------------------------------------------------------------------------
// Asynchronous copies of 4, 8 or 16 bytes from global to shared memory
// (cp.async, sm_80+; before that a plain load and store). A thread waits for
// its own copies by commit group: cp_async_wait<N>() returns when at most N
// of its groups are still pending, and the copies of the others are then
// visible to it.
template <int Bytes>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
  static_assert(Bytes == 4 || Bytes == 8 || Bytes == 16, "cp.async size");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  if constexpr (Bytes == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d),
                 "l"(src)
                 : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(d),
                 "l"(src), "n"(Bytes)
                 : "memory");
  }
#else
  using W = typename std::conditional<
      Bytes == 16, uint4,
      typename std::conditional<Bytes == 8, uint2, uint32_t>::type>::type;
  *reinterpret_cast<W*>(dst) = *reinterpret_cast<const W*>(src);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int N>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
#endif
}

// Elements per 16-byte vector.
template <typename T> constexpr int vec_width() {
  return static_cast<int>(16 / sizeof(T));
}

// ---------------------------------------------------------------------------
// Index checks with one unsigned compare: index_in(x, index_limit<T>(n)) is
// 0 <= x < n for x of type T (negative x wraps past the limit, which is at
// most 2^(bits - 1)).
template <typename index_t>
__host__ __device__ __forceinline__ std::make_unsigned_t<index_t> index_limit(
    int64_t n) {
  constexpr uint64_t half = uint64_t(1) << (8 * sizeof(index_t) - 1);
  const uint64_t u = n < 0 ? 0 : static_cast<uint64_t>(n);
  return static_cast<std::make_unsigned_t<index_t>>(u < half ? u : half);
}
template <typename index_t>
__device__ __forceinline__ bool index_in(index_t x,
                                         std::make_unsigned_t<index_t> lim) {
  return static_cast<std::make_unsigned_t<index_t>>(x) < lim;
}

// ---------------------------------------------------------------------------
// CSR row range with clamping: start = clamp(rowptr[i], 0, E),
// end = clamp(rowptr[i + 1], start, E). Bad rowptr can never address outside
// [0, E).
template <typename index_t>
__device__ __forceinline__ void row_range(const index_t* __restrict__ rowptr,
                                          int64_t i, int64_t E,
                                          int64_t& start, int64_t& end) {
  int64_t s = static_cast<int64_t>(rowptr[i]);
  int64_t t = static_cast<int64_t>(rowptr[i + 1]);
  s = s < 0 ? 0 : (s > E ? E : s);
  t = t < s ? s : (t > E ? E : t);
  start = s;
  end = t;
}

// First position outside every row: clamp(rowptr[N], 0, E).
template <typename index_t>
__device__ __forceinline__ int64_t tail_begin(const index_t* __restrict__ rowptr,
                                              int64_t N, int64_t E) {
  int64_t t = static_cast<int64_t>(rowptr[N]);
  return t < 0 ? 0 : (t > E ? E : t);
}

// Zero out[t * W, E * W) (grid-stride over all threads of a 1-D or 2-D
// grid); t = tail_begin(...), loaded early by the caller so that its latency
// overlaps the row work.
template <typename T>
__device__ __forceinline__ void zero_from(int64_t t, int64_t E, int64_t W,
                                          T* __restrict__ out) {
  const int64_t nblocks = static_cast<int64_t>(gridDim.x) * gridDim.y;
  const int64_t stride = nblocks * blockDim.x;
  const int64_t b =
      static_cast<int64_t>(blockIdx.y) * gridDim.x + blockIdx.x;
  for (int64_t k = t * W + b * blockDim.x + threadIdx.x; k < E * W;
       k += stride)
    out[k] = T(0.0f);
}

__device__ __forceinline__ int64_t global_warp() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >>
         5;
}
__device__ __forceinline__ int lane_id() { return threadIdx.x & 31; }

// ---------------------------------------------------------------------------
// Lane layout for the feature kernels (sddmm, spmm, attention).
//
// Node features are rows of H heads x C channels, read in "units" of V
// elements (V = 16 bytes' worth when aligned, else 1): CU = C / V units per
// head. A warp's lane id is split into three bit fields
//     lane = (es * HS + hs) * LH + cl
// cl: unit within a head (LH = pow2 >= CU, at most 32),
// hs: head slot (HS heads side by side), es: edge slot (ES = 32/(LH*HS)
// edges side by side). A lane owns head h0 + hs and its unit c0 + cl; heads
// that a warp cannot hold side by side go to further tiles of the grid.
// When CU > 32 the feature dimension is tiled (LH = 32, one head per tile,
// 32 units per tile; "channel tiles") or, where a kernel needs whole heads
// (attention_backward, sddmm), each lane walks units cl + 32 * kc for
// kc < KC.
struct TileLayout {
  int H = 0;       // heads
  int C = 0;       // channels (elements) per head
  int CU = 0;      // units per head
  int lh_log = 0;  // log2 LH
  int hs_log = 0;  // log2 HS
  int HT = 1;      // heads per tile
  int n_ct = 1;    // channel tiles per head tile
  int n_tiles = 1; // tiles per row: ceil(H / HT) * n_ct
  int KC = 1;      // unit steps per lane (streaming mode, CU > 32)
};

inline int next_pow2(int64_t x) {
  int p = 1;
  while (p < x) p <<= 1;
  return p;
}
inline int log2_pow2(int x) {
  int l = 0;
  while ((1 << l) < x) ++l;
  return l;
}

// channel_tiles: tile the channels of big heads (forward aggregation) instead
// of having lanes walk them (KC > 1).
inline TileLayout make_layout(int64_t H, int64_t C, int V, bool channel_tiles) {
  TileLayout L;
  L.H = static_cast<int>(H);
  L.C = static_cast<int>(C);
  L.CU = static_cast<int>(C / V);
  if (L.CU > 32) {
    L.lh_log = 5;
    L.hs_log = 0;
    L.HT = 1;
    const int chunks = static_cast<int>((L.CU + 31) / 32);
    if (channel_tiles) {
      L.n_ct = chunks;
      L.KC = 1;
    } else {
      L.n_ct = 1;
      L.KC = chunks;
    }
  } else {
    const int LH = next_pow2(L.CU < 1 ? 1 : L.CU);
    int HS = next_pow2(H < 1 ? 1 : H);
    if (HS > 32 / LH) HS = 32 / LH;
    L.lh_log = log2_pow2(LH);
    L.hs_log = log2_pow2(HS);
    L.HT = static_cast<int>(H < HS ? H : HS);
    if (L.HT < 1) L.HT = 1;
    L.n_ct = 1;
    L.KC = 1;
  }
  L.n_tiles = static_cast<int>((H + L.HT - 1) / L.HT) * L.n_ct;
  return L;
}

// Contiguous copy of an optional tensor, or an undefined tensor; the data
// pointer of a possibly undefined one (nullptr).
inline at::Tensor opt_contig(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->contiguous() : at::Tensor();
}

template <typename T>
inline const T* opt_ptr(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

inline bool aligned16(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15u) == 0;
}

inline int num_sms() {
  return at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Resident blocks of kBlock threads per SM for `kernel` (at least 1).
template <typename Kernel>
inline int blocks_per_sm(Kernel kernel) {
  int occ = 0;
  C10_CUDA_CHECK(
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, kernel, kBlock, 0));
  return occ > 0 ? occ : 1;
}

// Blocks for `warps` warps, at least enough to sweep a per-edge tail of
// `tail_elems` elements with a grid-stride loop reasonably fast.
inline int64_t blocks_for(int64_t warps, int64_t tail_elems = 0) {
  int64_t b = ceil_div(warps, kWarpsPerBlock);
  const int64_t tb = std::min<int64_t>(ceil_div(tail_elems, kBlock * 4),
                                       static_cast<int64_t>(num_sms()) * 8);
  b = std::max<int64_t>(b, tb);
  return std::max<int64_t>(b, 1);
}

// Grid of the row kernels: x = blocks of kWarpsPerBlock rows (at least enough
// to sweep a per-edge tail), y = feature tiles.
inline dim3 row_grid(int64_t N, int n_tiles, int64_t tail_elems = 0) {
  PFA_CHECK(n_tiles >= 1 && n_tiles <= 65535, "too many feature tiles: ",
            n_tiles);
  const int64_t bx = blocks_for(N, tail_elems);
  PFA_CHECK(bx < (int64_t(1) << 31), "too many rows: ", N);
  return dim3(static_cast<unsigned>(bx), static_cast<unsigned>(n_tiles));
}

// ---------------------------------------------------------------------------
// Split path for long rows (split_plan() in common.h). Edge window w is
// [w * chunk, (w + 1) * chunk). A long row (more than `split` edges,
// split >= chunk) overlaps a window in slot 0 when it holds the window's
// first edge, or in slot 1 when it starts inside the window (at most one
// long row can: it then runs past the window's end). win[2w + q] is the
// long row of slot q of window w, or -1; partial results of a launch live
// at slot 2w + q. Kernels: mark_windows (writes win), the op's partial kernel
// (one block per window, both slots), the row kernel (skips long rows) and
// a combine kernel (per long row, its partials in window order).
struct SplitArgs {
  int64_t split = INT64_MAX;  // rows with more edges are split
  int64_t chunk = 1;
  int64_t nwin = 0;           // windows; 0: no split path in this launch
  const int64_t* win = nullptr;
};

// The row r in [0, N) whose range holds edge e of a non-decreasing rowptr
// (the last r with rowptr[r] <= e: empty rows before it are passed over);
// 0 when none (the caller checks the range).
template <typename index_t>
__device__ __forceinline__ int64_t row_of_edge(const index_t* __restrict__ rowptr,
                                               int64_t N, int64_t e) {
  int64_t lo = 0, hi = N;  // rowptr[lo] <= e < rowptr[hi] as far as known
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (static_cast<int64_t>(rowptr[mid]) <= e) lo = mid; else hi = mid;
  }
  return lo;
}

// Thread per window w (grid-stride), one writer per slot: slot 0 gets the
// row that holds the window's first edge when it is long, slot 1 a long row
// that starts inside the window (it holds the window's last edge: a long
// row has more than split >= chunk edges), else -1.
template <typename index_t>
__global__ void __launch_bounds__(kBlock)
    mark_windows_kernel(const index_t* __restrict__ rowptr, int64_t N,
                        int64_t E, int64_t split, int64_t chunk, int64_t nwin,
                        int64_t* __restrict__ win) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       w < nwin; w += stride) {
    const int64_t a = w * chunk;
    const int64_t b = (a + chunk < E ? a + chunk : E) - 1;
    int64_t s, t;
    const int64_t r0 = row_of_edge(rowptr, N, a);
    row_range(rowptr, r0, E, s, t);
    win[2 * w] = (t - s > split && s <= a && a < t) ? r0 : -1;
    const int64_t r1 = row_of_edge(rowptr, N, b);
    row_range(rowptr, r1, E, s, t);
    win[2 * w + 1] =
        (r1 != r0 && t - s > split && s > a && s <= b && b < t) ? r1 : -1;
  }
}

// Partial slot of window w of a long row starting at edge `start`.
__device__ __forceinline__ int64_t win_slot(int64_t w, int64_t start,
                                            int64_t chunk) {
  return 2 * w + ((w == start / chunk && start > w * chunk) ? 1 : 0);
}

// Slot q of window w: the long row and its edges [s, t) in the window;
// false when the slot is empty. Block-uniform when w and q are.
template <typename index_t>
__device__ __forceinline__ bool window_part(const SplitArgs& sp,
                                            const index_t* __restrict__ rowptr,
                                            int64_t E, int64_t w, int q,
                                            int64_t& row, int64_t& s,
                                            int64_t& t) {
  row = sp.win[2 * w + q];
  if (row < 0) return false;
  int64_t rs, re;
  row_range(rowptr, row, E, rs, re);
  s = rs > w * sp.chunk ? rs : w * sp.chunk;
  t = re < (w + 1) * sp.chunk ? re : (w + 1) * sp.chunk;
  return s < t;
}

// The long row that block w combines (the one whose first window is w; at
// most one), with its edge range; false when none. Block-uniform.
template <typename index_t>
__device__ __forceinline__ bool window_owner(const SplitArgs& sp,
                                             const index_t* __restrict__ rowptr,
                                             int64_t E, int64_t w, int64_t& row,
                                             int64_t& rs, int64_t& re) {
  for (int q = 0; q < 2; ++q) {
    row = sp.win[2 * w + q];
    if (row < 0) continue;
    row_range(rowptr, row, E, rs, re);
    if (rs / sp.chunk == w) return true;
  }
  return false;
}

// Host: the split path of a launch over N rows and E edges (rowptr on the
// device). Without a possible long row (E <= split) nothing is launched.
// `win` keeps the window table alive until the launches are queued.
template <typename index_t>
inline SplitArgs make_split(const index_t* rowptr, int64_t N, int64_t E,
                            const at::TensorOptions& opts, at::Tensor& win,
                            const SplitPlan& plan = split_plan(),
                            int64_t max_len = -1) {
  SplitArgs sp;
  if (N <= 0 || E <= plan.split) return sp;
  if (max_len >= 0 && max_len <= plan.split) return sp;  // no long row
  sp.split = plan.split;
  sp.chunk = plan.chunk;
  sp.nwin = ceil_div(E, sp.chunk);
  PFA_CHECK(sp.nwin < (int64_t(1) << 30), "too many edge windows: ", sp.nwin);
  win = at::empty({2 * sp.nwin}, opts.dtype(at::kLong));
  sp.win = win.data_ptr<int64_t>();
  const int64_t blocks = std::max<int64_t>(
      1, std::min<int64_t>(ceil_div(sp.nwin, kBlock), int64_t(num_sms()) * 8));
  mark_windows_kernel<index_t>
      <<<static_cast<unsigned>(blocks), kBlock, 0,
         at::cuda::getCurrentCUDAStream()>>>(rowptr, N, E, sp.split, sp.chunk,
                                             sp.nwin, win.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return sp;
}

// Combine helper: for x in [x0, x1), total(x) = sum over the row's windows
// k = 0 .. nw - 1 (in order within each warp's share) of
// factor(k, x) * part[slot(k) * W + x]; warp q takes windows q, q + 8, ...,
// lane l elements x0 + l + 32u (u < 4), and the 8 warp sums are added in
// warp order in shared memory (s_red: kBlock * 4 values). Calls
// store(x, total) once per x (from warp 0). All threads of the block call it.
template <typename A, typename Slot, typename Factor, typename Store>
__device__ __forceinline__ void window_sum(const A* __restrict__ part,
                                           int64_t W, int64_t x0, int64_t x1,
                                           int64_t nw, const Slot& slot,
                                           const Factor& factor, A* s_red,
                                           const Store& store) {
  constexpr int U = 4;
  const int lane = lane_id();
  const int wib = threadIdx.x >> 5;
  for (int64_t xb = x0; xb < x1; xb += kWarp * U) {
    A acc[U];
#pragma unroll
    for (int u = 0; u < U; ++u) acc[u] = A(0);
#pragma unroll 2
    for (int64_t k = wib; k < nw; k += kWarpsPerBlock) {
      const A* p = part + slot(k) * W;
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t x = xb + lane + kWarp * u;
        if (x < x1) acc[u] += factor(k, x) * p[x];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) s_red[(wib * U + u) * kWarp + lane] = acc[u];
    __syncthreads();
    if (wib == 0) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const int64_t x = xb + lane + kWarp * u;
        A t = s_red[u * kWarp + lane];
        for (int q = 1; q < kWarpsPerBlock; ++q) t += s_red[(q * U + u) * kWarp + lane];
        if (x < x1) store(x, t);
      }
    }
    __syncthreads();
  }
}

// Split path, sum combine: block w finishes the long row whose first window
// is w (window_owner), adding its partials (rows of W accumulators) in
// window order (window_sum): x < D goes to out[row, x], the rest to
// out2[row, x - D] (out2: rows of W - D).
template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kBlock)
    split_sum_kernel(SplitArgs sp, const index_t* __restrict__ rowptr,
                     int64_t E, const acc_t<scalar_t>* __restrict__ part,
                     int64_t W, int64_t D, scalar_t* __restrict__ out,
                     scalar_t* __restrict__ out2) {
  using A = acc_t<scalar_t>;
  __shared__ A s_red[kBlock * 4];
  int64_t i, rs, re;
  if (!window_owner(sp, rowptr, E, blockIdx.x, i, rs, re)) return;
  const int64_t k0 = rs / sp.chunk;
  const int64_t nw = (re - 1) / sp.chunk - k0 + 1;
  const int64_t chunk = sp.chunk;
  window_sum(
      part, W, 0, W, nw, [&](int64_t k) { return win_slot(k0 + k, rs, chunk); },
      [](int64_t, int64_t) { return A(1); }, s_red, [&](int64_t x, A tot) {
        if (x < D)
          out[i * D + x] = from_acc<scalar_t>(tot);
        else
          out2[i * (W - D) + (x - D)] = from_acc<scalar_t>(tot);
      });
}

// Split path, softmax combine: block w finishes the long row i whose first
// window is w (window_owner). part_ms[slot, h] = (max m, sum s of
// exp(x - m)) and part_acc[slot] (D = H * C sums of exp(x - m) * weight *
// value) of each window part. Per round of 32 heads: lane = head, warps
// take the row's windows k = warp + 8i and merge their (m, s) online, the
// 8 warp states merged in warp order (shared memory); then window_sum adds
// the partial sums rescaled by exp(m_k - M) in window order, and the store
// divides by S and adds bias; lse = M + log S.
template <typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kBlock)
    split_softmax_combine_kernel(SplitArgs sp,
                                 const index_t* __restrict__ rowptr, int64_t E,
                                 const acc_t<scalar_t>* __restrict__ part_acc,
                                 const acc_t<scalar_t>* __restrict__ part_ms,
                                 const scalar_t* __restrict__ bias, int H,
                                 int64_t C, scalar_t* __restrict__ out,
                                 acc_t<scalar_t>* __restrict__ lse_out) {
  using A = acc_t<scalar_t>;
  __shared__ A s_red[kBlock * 4];
  __shared__ A s_M[kWarp], s_S[kWarp];
  int64_t i, rs, re;
  if (!window_owner(sp, rowptr, E, blockIdx.x, i, rs, re)) return;
  const int64_t k0 = rs / sp.chunk;
  const int64_t nw = (re - 1) / sp.chunk - k0 + 1;
  const int64_t chunk = sp.chunk;
  auto slot = [&](int64_t k) { return win_slot(k0 + k, rs, chunk); };
  const int64_t D = static_cast<int64_t>(H) * C;
  const int lane = lane_id();
  const int wib = threadIdx.x >> 5;
  for (int h0 = 0; h0 < H; h0 += kWarp) {
    const int h = h0 + lane;
    A m = neg_inf<A>(), sum = A(0);
    if (h < H) {
      for (int64_t k = wib; k < nw; k += kWarpsPerBlock) {
        const A* p = part_ms + (slot(k) * H + h) * 2;
        online_merge(m, sum, p[0], p[1]);
      }
    }
    s_red[wib * kWarp + lane] = m;
    s_red[kBlock + wib * kWarp + lane] = sum;
    __syncthreads();
    if (wib == 0) {
      A M = s_red[lane], S = s_red[kBlock + lane];
      for (int q = 1; q < kWarpsPerBlock; ++q)
        online_merge(M, S, s_red[q * kWarp + lane], s_red[kBlock + q * kWarp + lane]);
      online_finish(M, S);
      s_M[lane] = M;
      s_S[lane] = S;
      if (h < H) lse_out[i * H + h] = softmax_lse(M, S);
    }
    __syncthreads();
    const int h1 = min(H, h0 + kWarp);
    window_sum(
        part_acc, D, h0 * C, h1 * C, nw, slot,
        [&](int64_t k, int64_t x) {
          const int hh = static_cast<int>(x / C);
          const A M = s_M[hh - h0];
          return M == neg_inf<A>() ? A(1)
                                   : pfa_exp(part_ms[(slot(k) * H + hh) * 2] - M);
        },
        s_red, [&](int64_t x, A tot) {
          const int hh = static_cast<int>(x / C);
          const A M = s_M[hh - h0];
          A r = M == neg_inf<A>() ? tot : tot * fast_recip(s_S[hh - h0]);
          if (bias != nullptr) r += to_acc(bias[x]);
          out[i * D + x] = from_acc<scalar_t>(r);
        });
  }
}

// Host: queues split_sum_kernel (nothing without a split path).
template <typename scalar_t, typename index_t>
inline void launch_split_sum(const SplitArgs& sp, const index_t* rowptr,
                             int64_t E, const acc_t<scalar_t>* part, int64_t W,
                             int64_t D, scalar_t* out, scalar_t* out2 = nullptr) {
  if (sp.nwin == 0) return;
  split_sum_kernel<scalar_t, index_t>
      <<<static_cast<unsigned>(sp.nwin), kBlock, 0,
         at::cuda::getCurrentCUDAStream()>>>(sp, rowptr, E, part, W, D, out,
                                             out2);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Host: queues split_softmax_combine_kernel (nothing without a split path).
template <typename scalar_t, typename index_t>
inline void launch_split_softmax_combine(
    const SplitArgs& sp, const index_t* rowptr, int64_t E,
    const acc_t<scalar_t>* part_acc, const acc_t<scalar_t>* part_ms,
    const scalar_t* bias, int64_t H, int64_t C, scalar_t* out,
    acc_t<scalar_t>* lse_out) {
  if (sp.nwin == 0) return;
  split_softmax_combine_kernel<scalar_t, index_t>
      <<<static_cast<unsigned>(sp.nwin), kBlock, 0,
         at::cuda::getCurrentCUDAStream()>>>(sp, rowptr, E, part_acc, part_ms,
                                             bias, static_cast<int>(H), C, out,
                                             lse_out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace cuda
}  // namespace pyg_fastattn
