// edge_softmax / edge_softmax_backward on CUDA.
#include "utils.cuh"

namespace pyg_fastattn {
namespace cuda {
namespace {

// Pass-1 loads in flight per lane (the host sizes the lane groups so that an
// average row needs one such batch).
template <bool kBwd, typename scalar_t> constexpr int unroll() {
  return (kBwd || sizeof(scalar_t) == 8) ? 8 : 16;
}
// Row size (elements) above which a multi-pass row (one-pass path off) goes
// to the whole warp instead of its group of lanes.
template <bool kBwd, typename scalar_t> constexpr int64_t long_row_elems() {
  return static_cast<int64_t>(kWarp) * unroll<kBwd, scalar_t>();
}

template <typename scalar_t, typename index_t>
struct SoftmaxArgs {
  const index_t* rowptr;
  const scalar_t* x;   // scores (forward) or out (backward), [E, H]
  const scalar_t* g;   // grad_out (backward only), [E, H]
  scalar_t* out;       // [E, H]
  int64_t N, E;
  int H;
  int hs_log;          // HS = 2^hs_log head slots per group
  SplitArgs sp;        // split path (utils.cuh): rows over sp.split edges
  acc_t<scalar_t>* part;  // [2 * nwin, H, 2] per window slot: (max, sum) / (d, -)
  bool onepass;        // one-pass path allowed (power-of-two H <= 32 * V,
                       // 16-byte aligned x / g / out)
};

// One-pass path: V = 16-byte vector width, K vectors per lane
// (kSoftmaxLaneElems / kSoftmaxLaneElemsBwd elements; half as many for
// double, whose accumulators take two registers each).
template <bool kBwd, typename scalar_t> constexpr int onepass_v() {
  return vec_width<scalar_t>();
}
template <bool kBwd, typename scalar_t> constexpr int onepass_k() {
  constexpr int elems = (kBwd ? kSoftmaxLaneElemsBwd : kSoftmaxLaneElems) /
                        (sizeof(scalar_t) == 8 ? 2 : 1);
  constexpr int n = elems / onepass_v<kBwd, scalar_t>();
  return n < 1 ? 1 : n;
}

// Vector slots (V-element, 16-byte aligned) that the flat span
// [start * H, end * H) of a row touches.
template <bool kBwd, typename scalar_t>
__device__ __forceinline__ int64_t row_slots(int64_t start, int64_t end,
                                             int H) {
  constexpr int V = onepass_v<kBwd, scalar_t>();
  if (start == end) return 0;
  return (end * H + V - 1) / V - (start * H) / V;
}

// A row of edges [start, end) (not split) fits the one-pass registers of a
// group of 2^gs_log lanes.
template <bool kBwd, typename scalar_t>
__device__ __forceinline__ bool onepass_fits(int64_t start, int64_t end,
                                             int H, int gs_log) {
  return row_slots<kBwd, scalar_t>(start, end, H) <=
         (static_cast<int64_t>(onepass_k<kBwd, scalar_t>()) << gs_log);
}

// Combines v[t] over the positions t of one vector that share a head
// (t equal mod H; H a power of two): butterfly over bits [log2 H, log2 V).
// Every position ends with its head's total.
template <int V, typename A, typename Op>
__device__ __forceinline__ void fold_positions(A (&v)[V], int H, const Op& op) {
#pragma unroll
  for (int o = 1; o < V; o <<= 1) {
    if (o >= H) {
#pragma unroll
      for (int t = 0; t < V; ++t) {
        if ((t & o) == 0) {
          const A r = op(v[t], v[t | o]);
          v[t] = r;
          v[t | o] = r;
        }
      }
    }
  }
}

template <typename A>
__device__ __forceinline__ A max_nan_skip(A x, A y) {
  return y > x ? y : x;  // a NaN y never replaces x (the sum carries it)
}

// One-pass row: a group of GS = 2^gs_log lanes (gl = lane in group, gmask)
// holds a row's flat span [b, e) = [start * H, end * H) in registers.
// Lane gl owns the V-element vector slots j = vb + gl + GS * k (k < K,
// vb = b / V): a slot inside [b, e) is one 16-byte load / store, the partial
// first / last slot goes element by element. With GS * V a multiple of H,
// element t of every slot of lane gl has head ((vb + gl) * V + t) % H, so
// per-head statistics are folded over t in the lane (fold_positions), then
// over the lanes gl ^ o, o = P, 2P, .., GS / 2 (P = max(1, H / V)): every
// lane ends with the totals of its own heads. Forward: max, then
// sum of exp(x - max) (kept in registers), then out = exp * (1 / sum);
// backward: d = sum out * grad_out, then out * (grad_out - d). The caller
// checks onepass_fits(); the condition is uniform over the group.
template <bool kBwd, typename scalar_t, typename index_t>
__device__ __forceinline__ void onepass_row(
    const SoftmaxArgs<scalar_t, index_t>& a, int64_t start, int64_t end,
    int gl, int gs_log, unsigned gmask) {
  using A = acc_t<scalar_t>;
  constexpr int V = onepass_v<kBwd, scalar_t>();
  constexpr int K = onepass_k<kBwd, scalar_t>();
  if (start == end) return;
  const int H = a.H;
  const int GS = 1 << gs_log;
  const int P = H > V ? H / V : 1;
  const int64_t b = start * H, e = end * H;
  const int64_t vb = b / V;
  A x[K][V];
  A y[kBwd ? K : 1][V];  // grad_out (backward only)
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t p = (vb + gl + static_cast<int64_t>(GS) * k) * V;
    if (p >= b && p + V <= e) {
      const Vec<scalar_t, V> vx = load_vec<scalar_t, V>(a.x + p);
#pragma unroll
      for (int t = 0; t < V; ++t) x[k][t] = vec_get(vx, t);
      if constexpr (kBwd) {
        const Vec<scalar_t, V> vg = load_vec<scalar_t, V>(a.g + p);
#pragma unroll
        for (int t = 0; t < V; ++t) y[k][t] = vec_get(vg, t);
      }
    } else {
#pragma unroll
      for (int t = 0; t < V; ++t) {
        const int64_t q = p + t;
        const bool ok = q >= b && q < e;
        x[k][t] = ok ? to_acc(a.x[q]) : (kBwd ? A(0) : neg_inf<A>());
        if constexpr (kBwd) y[k][t] = ok ? to_acc(a.g[q]) : A(0);
      }
    }
  }
  if constexpr (!kBwd) {
    A m[V], s[V], inv[V];
#pragma unroll
    for (int t = 0; t < V; ++t) {
      m[t] = neg_inf<A>();
#pragma unroll
      for (int k = 0; k < K; ++k) m[t] = max_nan_skip(m[t], x[k][t]);
    }
    fold_positions<V>(m, H, [](A u, A w) { return max_nan_skip(u, w); });
    for (int o = P; o < GS; o <<= 1) {
#pragma unroll
      for (int t = 0; t < V; ++t)
        m[t] = max_nan_skip(m[t], __shfl_xor_sync(gmask, m[t], o));
    }
    // exp(x - m) in place; -inf entries (and the slots' padding) give 0,
    // also when m is -inf; a NaN entry makes the sum NaN.
#pragma unroll
    for (int t = 0; t < V; ++t) {
      s[t] = A(0);
#pragma unroll
      for (int k = 0; k < K; ++k) {
        x[k][t] = x[k][t] == neg_inf<A>() ? A(0) : pfa_exp(x[k][t] - m[t]);
        s[t] += x[k][t];
      }
    }
    fold_positions<V>(s, H, [](A u, A w) { return u + w; });
    for (int o = P; o < GS; o <<= 1) {
#pragma unroll
      for (int t = 0; t < V; ++t) s[t] += __shfl_xor_sync(gmask, s[t], o);
    }
#pragma unroll
    for (int t = 0; t < V; ++t) {
      online_finish(m[t], s[t]);
      inv[t] = fast_recip(s[t]);
    }
    // out: as softmax_weight (rows with m == -inf give s: 0 or NaN).
#pragma unroll
    for (int k = 0; k < K; ++k) {
#pragma unroll
      for (int t = 0; t < V; ++t)
        x[k][t] = m[t] == neg_inf<A>() ? s[t] : x[k][t] * inv[t];
    }
  } else {
    A d[V];
#pragma unroll
    for (int t = 0; t < V; ++t) {
      d[t] = A(0);
#pragma unroll
      for (int k = 0; k < K; ++k) d[t] += x[k][t] * y[k][t];
    }
    fold_positions<V>(d, H, [](A u, A w) { return u + w; });
    for (int o = P; o < GS; o <<= 1) {
#pragma unroll
      for (int t = 0; t < V; ++t) d[t] += __shfl_xor_sync(gmask, d[t], o);
    }
#pragma unroll
    for (int k = 0; k < K; ++k) {
#pragma unroll
      for (int t = 0; t < V; ++t) x[k][t] = x[k][t] * (y[k][t] - d[t]);
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) {
    const int64_t p = (vb + gl + static_cast<int64_t>(GS) * k) * V;
    if (p >= b && p + V <= e) {
      Vec<scalar_t, V> vo;
#pragma unroll
      for (int t = 0; t < V; ++t) vec_set(vo, t, x[k][t]);
      store_vec<scalar_t, V>(a.out + p, vo);
    } else {
#pragma unroll
      for (int t = 0; t < V; ++t) {
        const int64_t q = p + t;
        if (q >= b && q < e) a.out[q] = from_acc<scalar_t>(x[k][t]);
      }
    }
  }
}

// Multi-pass row of edges [start, end) (not split), handled by a group of
// GS = 2^gs_log lanes (gl = lane in group, gmask = the group's lanes). Lane
// gl = es * HS + hs owns head h0 + hs and edges es + k * ES; with HS == H
// (H dividing 32) this reads the row's [deg, H] block flat and coalesced:
// lane gl reads flat elements gl + GS*k.
template <bool kBwd, typename scalar_t, typename index_t>
__device__ __forceinline__ void softmax_row(
    const SoftmaxArgs<scalar_t, index_t>& a, int64_t start, int64_t end,
    int gl, int gs_log, unsigned gmask) {
  using A = acc_t<scalar_t>;
  const int64_t deg = end - start;
  const int H = a.H;
  const int HS = 1 << a.hs_log;
  const int GS = 1 << gs_log;
  const int ES = GS >> a.hs_log;
  const int hs = gl & (HS - 1);
  const int es = gl >> a.hs_log;
  const int64_t first = es;
  const int64_t stride = ES;
  constexpr int kUnroll = unroll<kBwd, scalar_t>();
  for (int h0 = 0; h0 < H; h0 += HS) {  // more than one round only if H > 32
    const int h = h0 + hs;
    const bool hok = h < H;
    const int64_t base = start * H + h;
    const scalar_t* __restrict__ x = a.x + base;
    scalar_t* __restrict__ out = a.out + base;
    if (!kBwd) {
      // pass 1: online max / sum of this lane's entries, then across the
      // lanes that share the head (bits [HS, GS) of the lane id).
      A m = neg_inf<A>(), s = A(0);
      for (int64_t k = first; k < deg; k += stride * kUnroll) {
        A v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t e = k + u * stride;
          v[u] = (hok && e < deg) ? to_acc(x[e * H]) : neg_inf<A>();
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) online_add(m, s, v[u]);
      }
      for (int off = HS; off < GS; off <<= 1) {
        const A m2 = __shfl_xor_sync(gmask, m, off);
        const A s2 = __shfl_xor_sync(gmask, s, off);
        online_merge(m, s, m2, s2);
      }
      online_finish(m, s);
      const A inv = fast_recip(s);
      // pass 2: the same entries again (L1/L2 hits), normalized.
      if (hok) {
#pragma unroll 4
        for (int64_t e = first; e < deg; e += stride)
          out[e * H] = from_acc<scalar_t>(
              softmax_weight(to_acc(x[e * H]), m, s, inv));
      }
    } else {
      const scalar_t* __restrict__ g = a.g + base;
      // pass 1: d = sum_row out * grad_out for this head.
      A d = A(0);
      for (int64_t k = first; k < deg; k += stride * kUnroll) {
        A y[kUnroll], gg[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t e = k + u * stride;
          const bool ok = hok && e < deg;
          y[u] = ok ? to_acc(x[e * H]) : A(0);
          gg[u] = ok ? to_acc(g[e * H]) : A(0);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) d += y[u] * gg[u];
      }
      d = xor_sum(d, HS, GS, gmask);
      // pass 2: grad = out * (grad_out - d).
      if (hok) {
#pragma unroll 4
        for (int64_t e = first; e < deg; e += stride)
          out[e * H] =
              from_acc<scalar_t>(to_acc(x[e * H]) * (to_acc(g[e * H]) - d));
      }
    }
  }
}

// Rows are handed out R = 32 / GS per warp, GS = 2^gs_log lanes per row
// (chosen on the host so that an average row fits one group's one-pass
// registers). Rows go through rounds of doubling group size: in a round of
// groups of 2^p lanes, the warp's pending rows are taken 32 >> p at a time;
// a row that fits the group's registers (onepass_fits) is read once and
// written once (onepass_row); one that does not waits for the next round;
// at p = 5 (the whole warp) it takes the multi-pass softmax_row. With the
// one-pass path off (odd H, misaligned tensors) every row takes softmax_row
// in the first round, except rows of more than long_row_elems() elements,
// which wait for the whole warp. Rows over the split threshold are skipped
// (left to edge_softmax_part_kernel / edge_softmax_finish_kernel). Finally
// all threads zero the entries outside every row ([rowptr[N], E)) with a
// grid-stride loop. No shared memory or block barrier: warps are
// independent. Occupancy floor: 4 blocks/SM (<= 64 registers) for 2- and
// 4-byte types, 3 (<= 80 registers; double exp needs more) for double.
template <typename scalar_t> constexpr int softmax_min_blocks() {
  return sizeof(scalar_t) == 8 ? 3 : 4;
}

// Position of the n-th (0-based) set bit of m (n < popc(m)).
__device__ __forceinline__ int nth_set_bit(unsigned m, int n) {
  for (int k = 0; k < n; ++k) m &= m - 1;
  return __ffs(m) - 1;
}

template <bool kBwd, typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kBlock, softmax_min_blocks<scalar_t>())
    edge_softmax_kernel(SoftmaxArgs<scalar_t, index_t> a, int gs_log) {
  const int64_t tail = tail_begin(a.rowptr, a.N, a.E);  // used at the end
  const int lane = lane_id();
  const int64_t row0 = global_warp() * (kWarp >> gs_log);
  if (row0 < a.N) {
    const int64_t left = a.N - row0;
    const int R0 = kWarp >> gs_log;
    unsigned todo = left >= R0 ? (R0 == 32 ? kFullMask : (1u << R0) - 1u)
                               : (1u << left) - 1u;
    for (int p = gs_log; todo != 0; ++p) {  // warp-uniform
      const int n = __popc(todo);
      const int grp = lane >> p;
      const int gl = lane & ((1 << p) - 1);
      const unsigned gmask =
          p == 5 ? kFullMask : (((1u << (1 << p)) - 1u) << (grp << p));
      unsigned wait = 0;
      for (int base = 0; base < n; base += kWarp >> p) {
        const int idx = base + grp;
        if (idx >= n) continue;
        const int bit = nth_set_bit(todo, idx);
        int64_t start, end;
        row_range(a.rowptr, row0 + bit, a.E, start, end);
        if (end - start > a.sp.split) continue;  // split path
        const bool fits =
            a.onepass && onepass_fits<kBwd, scalar_t>(start, end, a.H, p);
        if (fits)
          onepass_row<kBwd>(a, start, end, gl, p, gmask);
        else if (p == 5 ||
                 (!a.onepass &&
                  (end - start) * a.H <= long_row_elems<kBwd, scalar_t>()))
          softmax_row<kBwd>(a, start, end, gl, p, gmask);
        else
          wait |= 1u << bit;
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1)
        wait |= __shfl_xor_sync(kFullMask, wait, o);
      todo = wait;
    }
  }
  zero_from(tail, a.E, a.H, a.out);
}

// Split path. Per round of HS heads (HS = min(32, pow2 >= H)), lane
// (ks, hs) of warp q (ks = lane / HS) takes head h0 + hs and items
// k = q * ES + ks + 8 * ES * i (ES = 32 / HS) of [0, n); `add(k, h, m, s)`
// folds item k into the lane's state (fwd: online max / sum; bwd: s += d).
// The states are merged over ks by xor shuffles, then over the 8 warps in
// warp order in shared memory; every thread returns the totals of its head
// (a fixed order: deterministic). All threads of the block call it.
template <bool kBwd, typename A, typename Add>
__device__ __forceinline__ void block_head_stats(int64_t n, int h0, int H,
                                                 int hs_log, const Add& add,
                                                 A& m, A& s, A* s_a, A* s_b) {
  const int lane = lane_id();
  const int wib = threadIdx.x >> 5;
  const int HS = 1 << hs_log;
  const int ES = kWarp >> hs_log;
  const int h = h0 + (lane & (HS - 1));
  m = neg_inf<A>();
  s = A(0);
  if (h < H) {
    for (int64_t k = static_cast<int64_t>(wib) * ES + (lane >> hs_log); k < n;
         k += static_cast<int64_t>(kWarpsPerBlock) * ES)
      add(k, h, m, s);
  }
  for (int off = HS; off < kWarp; off <<= 1) {
    const A m2 = __shfl_xor_sync(kFullMask, m, off);
    const A s2 = __shfl_xor_sync(kFullMask, s, off);
    if (kBwd)
      s += s2;
    else
      online_merge(m, s, m2, s2);
  }
  s_a[wib * kWarp + lane] = m;
  s_b[wib * kWarp + lane] = s;
  __syncthreads();
  m = s_a[lane];
  s = s_b[lane];
  for (int q = 1; q < kWarpsPerBlock; ++q) {
    if (kBwd)
      s += s_b[q * kWarp + lane];
    else
      online_merge(m, s, s_a[q * kWarp + lane], s_b[q * kWarp + lane]);
  }
  __syncthreads();
}

// Partials: block w reduces both slots of edge window w (window_part): per
// head the slot's max and sum of exp(x - max) (forward) or
// d = sum out * grad_out (backward), into part[slot, h].
template <bool kBwd, typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kBlock)
    edge_softmax_part_kernel(SoftmaxArgs<scalar_t, index_t> a) {
  using A = acc_t<scalar_t>;
  __shared__ A s_a[kBlock], s_b[kBlock];
  const int64_t w = blockIdx.x;
  const int H = a.H;
  const int lane = lane_id();
  for (int q = 0; q < 2; ++q) {
    int64_t row, s, t;
    if (!window_part(a.sp, a.rowptr, a.E, w, q, row, s, t)) continue;
    const int64_t slot = 2 * w + q;
    for (int h0 = 0; h0 < H; h0 += 1 << a.hs_log) {
      A m, sum;
      block_head_stats<kBwd, A>(
          t - s, h0, H, a.hs_log,
          [&](int64_t k, int h, A& m_, A& s_) {
            const int64_t x = (s + k) * H + h;
            if (kBwd)
              s_ += to_acc(a.x[x]) * to_acc(a.g[x]);
            else
              online_add(m_, s_, to_acc(a.x[x]));
          },
          m, sum, s_a, s_b);
      const int h = h0 + (lane & ((1 << a.hs_log) - 1));
      if (threadIdx.x < (1u << a.hs_log) && h < H) {
        a.part[(slot * H + h) * 2] = m;
        a.part[(slot * H + h) * 2 + 1] = sum;
      }
    }
  }
}

// Finish: block w, for both slots of window w, merges the partials of the
// slot's row over all of the row's windows (window order within each
// lane's share, then the fixed merge of block_head_stats: every block of a
// row gets the same totals) and writes the slot's edges:
// softmax weight (forward) or out * (grad_out - d) (backward).
template <bool kBwd, typename scalar_t, typename index_t>
__global__ void __launch_bounds__(kBlock)
    edge_softmax_finish_kernel(SoftmaxArgs<scalar_t, index_t> a) {
  using A = acc_t<scalar_t>;
  __shared__ A s_a[kBlock], s_b[kBlock];
  const int64_t w = blockIdx.x;
  const int H = a.H;
  const int lane = lane_id();
  const int wib = threadIdx.x >> 5;
  const int HS = 1 << a.hs_log;
  const int ES = kWarp >> a.hs_log;
  for (int q = 0; q < 2; ++q) {
    int64_t row, s, t;
    if (!window_part(a.sp, a.rowptr, a.E, w, q, row, s, t)) continue;
    int64_t rs, re;
    row_range(a.rowptr, row, a.E, rs, re);
    const int64_t k0 = rs / a.sp.chunk;
    const int64_t nw = (re - 1) / a.sp.chunk - k0 + 1;
    const int64_t chunk = a.sp.chunk;
    for (int h0 = 0; h0 < H; h0 += HS) {
      A m, sum;
      block_head_stats<kBwd, A>(
          nw, h0, H, a.hs_log,
          [&](int64_t k, int h, A& m_, A& s_) {
            const A* p = a.part + (win_slot(k0 + k, rs, chunk) * H + h) * 2;
            if (kBwd)
              s_ += p[1];  // the part kernel stores (max, sum): d is the sum
            else
              online_merge(m_, s_, p[0], p[1]);
          },
          m, sum, s_a, s_b);
      if (!kBwd) online_finish(m, sum);
      const A inv = kBwd ? A(0) : fast_recip(sum);
      const int h = h0 + (lane & (HS - 1));
      if (h >= H) continue;
      for (int64_t e = s + static_cast<int64_t>(wib) * ES + (lane >> a.hs_log);
           e < t; e += static_cast<int64_t>(kWarpsPerBlock) * ES) {
        const int64_t x = e * H + h;
        a.out[x] = kBwd ? from_acc<scalar_t>(to_acc(a.x[x]) *
                                             (to_acc(a.g[x]) - sum))
                        : from_acc<scalar_t>(
                              softmax_weight(to_acc(a.x[x]), m, sum, inv));
      }
    }
  }
}

template <bool kBwd>
at::Tensor launch_edge_softmax(const at::Tensor& rowptr_in,
                               const at::Tensor& x_in,
                               const at::Tensor* g_in) {
  c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor rowptr = rowptr_in.contiguous();
  const at::Tensor x = x_in.contiguous();
  at::Tensor g;
  if (kBwd) g = g_in->contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t N = rowptr.numel() - 1;
  const int64_t E = x.size(0);
  const int64_t H = x.size(1);
  if (out.numel() == 0) return out;
  PFA_CHECK(H < (1 << 30), "too many heads");
  int HS = next_pow2(H);
  if (HS > 32) HS = 32;
  const int64_t avg = N > 0 ? ceil_div(E * H, N) : 1;
  auto stream = at::cuda::getCurrentCUDAStream();
  PFA_DISPATCH_FLOATS(x.scalar_type(), "edge_softmax_cuda", [&] {
    // One-pass path: H a power of two with GS * V a multiple of H (GS >= HS
    // gives that for H <= 32 * V), all three tensors 16-byte aligned.
    constexpr int V = onepass_v<kBwd, scalar_t>();
    constexpr int K = onepass_k<kBwd, scalar_t>();
    const bool onepass = (H & (H - 1)) == 0 && H <= 32 * V &&
                         aligned16(x.data_ptr()) && aligned16(out.data_ptr()) &&
                         (!kBwd || aligned16(g.data_ptr()));
    // Group size: an average row fills about one batch of pass-1 loads
    // (unroll() per lane) or, one-pass, its vector slots (one more for a
    // misaligned start) fill the group's K slots per lane; at least HS lanes.
    const int64_t per_lane = onepass ? K : unroll<kBwd, scalar_t>();
    const int64_t need = onepass ? ceil_div(avg, V) + (H < V ? 1 : 0) : avg;
    int GS = next_pow2(std::max<int64_t>(1, ceil_div(need, per_lane)));
    GS = std::min(32, std::max(GS, HS));
    const int gs_log = log2_pow2(GS);
    const int64_t warps = ceil_div(N, kWarp / GS);
    const int64_t blocks = blocks_for(warps, E * H);
    PFA_DISPATCH_INDEX(rowptr.scalar_type(), "edge_softmax_cuda", [&] {
      SoftmaxArgs<scalar_t, index_t> a;
      a.rowptr = rowptr.data_ptr<index_t>();
      a.x = x.data_ptr<scalar_t>();
      a.g = kBwd ? g.data_ptr<scalar_t>() : nullptr;
      a.out = out.data_ptr<scalar_t>();
      a.N = N;
      a.E = E;
      a.H = static_cast<int>(H);
      a.hs_log = log2_pow2(HS);
      a.onepass = onepass;
      at::Tensor win, part;
      // Long rows split by elements (a row a single warp walks stays
      // bounded): more than kSoftmaxSplitElems / H edges, within
      // [kSplitChunk, kSplitEdges].
      const int64_t split = std::min<int64_t>(
          kSplitEdges,
          std::max<int64_t>(kSplitChunk, kSoftmaxSplitElems / H));
      a.sp = make_split(a.rowptr, N, E, x.options(), win,
                        split_plan(split, kSplitChunk));
      a.part = nullptr;
      if (a.sp.nwin > 0) {
        part = at::empty({2 * a.sp.nwin, H, 2},
                         x.options().dtype(opmath_type(x.scalar_type())));
        a.part = part.data_ptr<acc_t<scalar_t>>();
        edge_softmax_part_kernel<kBwd, scalar_t, index_t>
            <<<static_cast<unsigned>(a.sp.nwin), kBlock, 0, stream>>>(a);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
      edge_softmax_kernel<kBwd, scalar_t, index_t>
          <<<static_cast<unsigned>(blocks), kBlock, 0, stream>>>(a, gs_log);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      if (a.sp.nwin > 0) {
        edge_softmax_finish_kernel<kBwd, scalar_t, index_t>
            <<<static_cast<unsigned>(a.sp.nwin), kBlock, 0, stream>>>(a);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      }
    });
  });
  return out;
}

at::Tensor edge_softmax_cuda(const at::Tensor& rowptr,
                             const at::Tensor& scores) {
  check_edge_softmax(rowptr, scores);
  return launch_edge_softmax<false>(rowptr, scores, nullptr);
}

at::Tensor edge_softmax_backward_cuda(const at::Tensor& rowptr,
                                      const at::Tensor& out,
                                      const at::Tensor& grad_out) {
  check_edge_softmax_backward(rowptr, out, grad_out);
  return launch_edge_softmax<true>(rowptr, out, &grad_out);
}

}  // namespace
}  // namespace cuda
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, CUDA, m) {
  m.impl("edge_softmax", &pyg_fastattn::cuda::edge_softmax_cuda);
  m.impl("edge_softmax_backward",
         &pyg_fastattn::cuda::edge_softmax_backward_cuda);
}
