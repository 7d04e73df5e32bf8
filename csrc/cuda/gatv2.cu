// gatv2_attention / gatv2_attention_backward on CUDA: GATv2's per-edge score
// att . leaky_relu(x_l[j] + x_r[i] + edge_term[e]) computed on the fly with
// an online row softmax and the weighted aggregation (forward), and the
// gradients in a destination pass and a source pass (backward, no atomics).
#include "utils.cuh"

namespace pyg_fastattn {
namespace cuda {
namespace {

// Lane layout of the gatv2 kernels. A node's [H, C] row is read in units of
// V elements (16 bytes when aligned, else 1 element): CU = C / V units per
// head. A warp's lane = hs * G + cl: G = pow2 >= min(CU, 32) lanes share a
// head (cl: unit), HS = 32 / G heads side by side (hs). A lane has S slots:
//  * HEADS (KC = 1): slot t is unit cl of head h0 + hs + HS * t;
//  * otherwise (one head per lane, CU > 32): slot t is unit cl + G * t of
//    head h0 + hs.
// Per-head sums are taken over a lane's slots of that head, then over the G
// lanes of the head with xor shuffles (every lane gets the same bits). The
// heads h0 .. h0 + HS * KH - 1 form one tile (grid y).
struct Gatv2Layout {
  int H, C, V;
  int CU;        // units per head
  int g_log;     // log2 G
  int KH;        // heads per lane in a tile (HEADS) or 1
  int KC;        // units per lane per head (not HEADS) or 1
  int tile_heads;
  int n_tiles;
};

template <int S, bool HEADS>
struct Slots {
  int64_t off[S];  // element offset inside a node's [H, C] row, -1: unused
  int h[HEADS ? S : 1];  // head of each head slot, -1: outside the tile
  static constexpr int NKH = HEADS ? S : 1;
};

template <int S, bool HEADS>
__device__ __forceinline__ Slots<S, HEADS> decode(const Gatv2Layout& L,
                                                  int tile, int lane) {
  Slots<S, HEADS> sl;
  const int G = 1 << L.g_log;
  const int cl = lane & (G - 1), hs = lane >> L.g_log;
  const int HS = kWarp >> L.g_log;
  const int h0 = tile * L.tile_heads + hs;
#pragma unroll
  for (int t = 0; t < S; ++t) {
    const int kh = HEADS ? t : 0;
    const int u = HEADS ? cl : cl + G * t;
    const int h = h0 + HS * kh;
    const bool ok = (HEADS ? t < L.KH : t < L.KC) && h < L.H &&
                    HS * kh < L.tile_heads && u < L.CU;
    sl.off[t] = ok ? static_cast<int64_t>(h) * L.C + static_cast<int64_t>(u) * L.V
                   : -1;
  }
#pragma unroll
  for (int kh = 0; kh < Slots<S, HEADS>::NKH; ++kh) {
    const int h = h0 + HS * kh;
    sl.h[kh] = ((HEADS ? kh < L.KH : true) && h < L.H &&
                HS * kh < L.tile_heads) ? h : -1;
  }
  return sl;
}

template <int S, bool HEADS>
__device__ __forceinline__ int head_slot(int t) {
  return HEADS ? t : 0;
}

// Loads slot t of a node row (zeros for unused slots).
template <typename T, int V>
__device__ __forceinline__ void load_slot(const T* __restrict__ row,
                                          int64_t off, acc_t<T> (&x)[V]) {
  if (off >= 0) {
    const Vec<T, V> v = load_vec<T, V>(row + off);
#pragma unroll
    for (int k = 0; k < V; ++k) x[k] = vec_get<T, V>(v, k);
  } else {
#pragma unroll
    for (int k = 0; k < V; ++k) x[k] = acc_t<T>(0);
  }
}

template <typename T, int V>
__device__ __forceinline__ void store_slot(T* __restrict__ row, int64_t off,
                                           const acc_t<T> (&x)[V]) {
  if (off < 0) return;
  Vec<T, V> v;
#pragma unroll
  for (int k = 0; k < V; ++k) vec_set<T, V>(v, k, x[k]);
  store_vec<T, V>(row + off, v);
}

template <typename A>
__device__ __forceinline__ A leaky_grad(A z, A slope, A g) {
  return z > A(0) ? g : g * slope;
}

template <typename A>
__device__ __forceinline__ A head_sum(A v, int g_log) {
  return xor_sum(v, 1, 1 << g_log);
}

// idx[p + lane] (or -1 past end): the warp reads 32 edge indices with one
// coalesced load and hands them out by shuffle, so that no edge waits on
// its own index load.
template <typename index_t>
__device__ __forceinline__ int64_t batch_load(const index_t* __restrict__ idx,
                                              int64_t p, int64_t end,
                                              int lane) {
  return p + lane < end ? static_cast<int64_t>(idx[p + lane]) : int64_t(-1);
}

template <typename scalar_t, typename index_t>
struct Gatv2Args {
  using A = acc_t<scalar_t>;
  const index_t* rowptr;
  const index_t* col;
  const scalar_t* x_l;        // [Ns, H, C]
  const scalar_t* x_r;        // [N, H, C]
  const scalar_t* edge_term;  // [E, H, C] or nullptr
  const scalar_t* att;        // [H, C]
  const scalar_t* mask;       // [E, H] or nullptr
  const scalar_t* bias;       // [H * C] or nullptr
  int64_t N, E, Ns;
  A slope;
  // forward
  scalar_t* out;   // [N, H, C]
  A* lse_out;      // [N, H]
  // backward
  const index_t* colptr;  // [Ns + 1]
  const index_t* csc_row; // [E]
  const index_t* csc_perm;// [E]
  const scalar_t* fout;   // forward's out [N, H, C]
  const A* lse;           // [N, H]
  const scalar_t* grad_out;  // [N, H, C]
  A* grad_s;              // [E, H], CSR order
  A* att_partial;         // [warps of pass 1, H * C]
  scalar_t* g_l;          // [Ns, H, C]
  scalar_t* g_r;          // [N, H, C]
  scalar_t* g_e;          // [E, H, C] or nullptr
};

// Score partials of one edge for every head slot:
// s[kh] = sum over the lane's slots of head kh of att * leaky(z), z kept.
template <typename A, int S, int V, bool HEADS>
__device__ __forceinline__ void edge_z(const A (&xl)[S][V], const A (&xr)[S][V],
                                       const A (&et)[S][V], bool has_et,
                                       A (&z)[S][V]) {
#pragma unroll
  for (int t = 0; t < S; ++t)
#pragma unroll
    for (int k = 0; k < V; ++k)
      z[t][k] = has_et ? xl[t][k] + xr[t][k] + et[t][k] : xl[t][k] + xr[t][k];
}

template <typename A, int S, int V, bool HEADS, int NKH>
__device__ __forceinline__ void head_scores(const A (&z)[S][V],
                                            const A (&att)[S][V], A slope,
                                            int g_log, A (&s)[NKH]) {
#pragma unroll
  for (int kh = 0; kh < NKH; ++kh) s[kh] = A(0);
#pragma unroll
  for (int t = 0; t < S; ++t)
#pragma unroll
    for (int k = 0; k < V; ++k)
      s[head_slot<S, HEADS>(t)] += att[t][k] * leaky(z[t][k], slope);
#pragma unroll
  for (int kh = 0; kh < NKH; ++kh) s[kh] = head_sum(s[kh], g_log);
}

template <typename T, int S, int V>
__device__ __forceinline__ void load_row(const T* __restrict__ row,
                                         const int64_t (&off)[S],
                                         acc_t<T> (&x)[S][V]) {
#pragma unroll
  for (int t = 0; t < S; ++t) load_slot<T, V>(row, off[t], x[t]);
}

// Forward: one warp per (destination row, head tile); the grid is (row
// blocks of 8 warps, tiles). The warp reads the row's col indices 32 at a
// time (one coalesced load, handed out by shuffle) and walks the edges one
// by one: its lanes load x_l[j] (and edge_term[e]) for their slots, form z with x_r[i]
// (kept in registers, as att), reduce att . leaky(z) per head over the G
// lanes of the head, update the head's online softmax (max m, sum den) and
// rescale / accumulate p * mask * x_l[j] into their slots. At the end each
// lane stores its slots of out = acc / den + bias (empty rows: the bias)
// and lane cl = 0 of a head the row's lse. One warp walks a whole row, so a
// hub row takes time proportional to its degree (no split of long rows
// yet).
template <typename scalar_t, typename index_t, int V, int S, bool HEADS>
__global__ void __launch_bounds__(kBlock)
    gatv2_fwd_kernel(Gatv2Args<scalar_t, index_t> a, Gatv2Layout L) {
  using A = acc_t<scalar_t>;
  constexpr int NKH = Slots<S, HEADS>::NKH;
  const int64_t i =
      static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (i >= a.N) return;  // whole warps leave
  const int lane = lane_id();
  const Slots<S, HEADS> sl = decode<S, HEADS>(L, blockIdx.y, lane);
  const int64_t HC = static_cast<int64_t>(L.H) * L.C;
  const int H = L.H;
  A xr[S][V], att[S][V], acc[S][V];
  load_row<scalar_t, S, V>(a.x_r + i * HC, sl.off, xr);
  load_row<scalar_t, S, V>(a.att, sl.off, att);
#pragma unroll
  for (int t = 0; t < S; ++t)
#pragma unroll
    for (int k = 0; k < V; ++k) acc[t][k] = A(0);
  A m[NKH], den[NKH];
#pragma unroll
  for (int kh = 0; kh < NKH; ++kh) {
    m[kh] = neg_inf<A>();
    den[kh] = A(0);
  }
  int64_t start, end;
  row_range(a.rowptr, i, a.E, start, end);
  for (int64_t e = start, jb = 0; e < end; ++e) {
    const int kb = static_cast<int>((e - start) & (kWarp - 1));
    if (kb == 0) jb = batch_load(a.col, e, end, lane);
    const int64_t j = __shfl_sync(kFullMask, jb, kb);
    if (j < 0 || j >= a.Ns) continue;  // warp-uniform
    A xl[S][V], et[S][V], z[S][V], s[NKH];
    load_row<scalar_t, S, V>(a.x_l + j * HC, sl.off, xl);
    const bool has_et = a.edge_term != nullptr;
    if (has_et) load_row<scalar_t, S, V>(a.edge_term + e * HC, sl.off, et);
    edge_z<A, S, V, HEADS>(xl, xr, et, has_et, z);
    head_scores<A, S, V, HEADS, NKH>(z, att, a.slope, L.g_log, s);
    A scale[NKH], w[NKH];
#pragma unroll
    for (int kh = 0; kh < NKH; ++kh) {
      const A x = s[kh];
      A p;
      scale[kh] = A(1);
      if (x > m[kh]) {  // new maximum: rescale what was summed
        scale[kh] = pfa_exp(m[kh] - x);
        m[kh] = x;
        p = A(1);
      } else if (x == neg_inf<A>()) {
        p = A(0);
      } else {
        p = pfa_exp(x - m[kh]);  // NaN propagates
      }
      den[kh] = den[kh] * scale[kh] + p;
      if (a.mask != nullptr && sl.h[kh] >= 0)
        p *= to_acc(a.mask[e * H + sl.h[kh]]);
      w[kh] = p;
    }
#pragma unroll
    for (int t = 0; t < S; ++t) {
      const int kh = head_slot<S, HEADS>(t);
#pragma unroll
      for (int k = 0; k < V; ++k)
        acc[t][k] = acc[t][k] * scale[kh] + w[kh] * xl[t][k];
    }
  }
#pragma unroll
  for (int kh = 0; kh < NKH; ++kh) {
    online_finish(m[kh], den[kh]);  // a +inf score makes the row NaN
    if (sl.h[kh] >= 0 && (lane & ((1 << L.g_log) - 1)) == 0)
      a.lse_out[i * H + sl.h[kh]] = softmax_lse(m[kh], den[kh]);
  }
#pragma unroll
  for (int t = 0; t < S; ++t) {
    const int kh = head_slot<S, HEADS>(t);
    const A d = den[kh] == A(0) ? A(1) : den[kh];  // empty row: acc is 0
    A b[V];
    load_slot<scalar_t, V>(a.bias, a.bias != nullptr ? sl.off[t] : -1, b);
#pragma unroll
    for (int k = 0; k < V; ++k) acc[t][k] = acc[t][k] / d + b[k];
    store_slot<scalar_t, V>(a.out + i * HC, sl.off[t], acc[t]);
  }
}

// Backward pass 1, by destination row: a fixed grid of (at most
// kGatv2CudaBwdBlocks) blocks x head tiles; warp w of the x grid takes rows
// w, w + W, w + 2W, ... (W warps). Per row it keeps x_r[i], grad_out[i] and
// delta = <grad_out[i], out[i] - bias> per head; per edge (one at a time,
// lanes as in the forward) it reduces s and g = <grad_out[i], x_l[j]> per
// head, writes grad_s = alpha * (mask * g - delta) (lane cl = 0), grad_z =
// grad_s * att * leaky'(z) to grad_edge_term[e] and into the row's grad_x_r,
// and adds grad_s * leaky(z) to the lane's grad_att slots. Each warp stores its
// grad_att partial row (fixed warp -> rows map, summed later in warp order).
// Positions outside every row of grad_edge_term are zeroed by a grid-stride
// loop.
template <typename scalar_t, typename index_t, int V, int S, bool HEADS>
__global__ void __launch_bounds__(kBlock)
    gatv2_bwd_rows_kernel(Gatv2Args<scalar_t, index_t> a, Gatv2Layout L) {
  using A = acc_t<scalar_t>;
  constexpr int NKH = Slots<S, HEADS>::NKH;
  const int lane = lane_id();
  const int H = L.H;
  const int64_t HC = static_cast<int64_t>(H) * L.C;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock +
                       (threadIdx.x >> 5);
  const int64_t W = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  if (a.g_e != nullptr && blockIdx.y == 0) {  // per-edge output outside rows
    const int64_t first = tail_begin(a.rowptr, 0, a.E);
    const int64_t last = tail_begin(a.rowptr, a.N, a.E);
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const int64_t t0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    for (int64_t k = t0; k < first * HC; k += stride) a.g_e[k] = scalar_t(0.0f);
    for (int64_t k = last * HC + t0; k < a.E * HC; k += stride)
      a.g_e[k] = scalar_t(0.0f);
  }
  const Slots<S, HEADS> sl = decode<S, HEADS>(L, blockIdx.y, lane);
  const bool lead = (lane & ((1 << L.g_log) - 1)) == 0;
  A att[S][V], gatt[S][V];
  load_row<scalar_t, S, V>(a.att, sl.off, att);
#pragma unroll
  for (int t = 0; t < S; ++t)
#pragma unroll
    for (int k = 0; k < V; ++k) gatt[t][k] = A(0);
  for (int64_t i = warp; i < a.N; i += W) {
    A xr[S][V], go[S][V], gxr[S][V], delta[NKH], lse[NKH];
    load_row<scalar_t, S, V>(a.x_r + i * HC, sl.off, xr);
    load_row<scalar_t, S, V>(a.grad_out + i * HC, sl.off, go);
    {
      A o[S][V];
      load_row<scalar_t, S, V>(a.fout + i * HC, sl.off, o);
#pragma unroll
      for (int kh = 0; kh < NKH; ++kh) delta[kh] = A(0);
#pragma unroll
      for (int t = 0; t < S; ++t) {
        A b[V];  // out holds the forward's bias
        load_slot<scalar_t, V>(a.bias, a.bias != nullptr ? sl.off[t] : -1, b);
#pragma unroll
        for (int k = 0; k < V; ++k)
          delta[head_slot<S, HEADS>(t)] += go[t][k] * (o[t][k] - b[k]);
      }
    }
#pragma unroll
    for (int kh = 0; kh < NKH; ++kh) {
      delta[kh] = head_sum(delta[kh], L.g_log);
      lse[kh] = sl.h[kh] >= 0 ? a.lse[i * H + sl.h[kh]] : neg_inf<A>();
    }
#pragma unroll
    for (int t = 0; t < S; ++t)
#pragma unroll
      for (int k = 0; k < V; ++k) gxr[t][k] = A(0);
    int64_t start, end;
    row_range(a.rowptr, i, a.E, start, end);
    for (int64_t e = start, jb = 0; e < end; ++e) {
      const int kb = static_cast<int>((e - start) & (kWarp - 1));
      if (kb == 0) jb = batch_load(a.col, e, end, lane);
      const int64_t j = __shfl_sync(kFullMask, jb, kb);
      if (j < 0 || j >= a.Ns) {  // warp-uniform: no weight, zero outputs
#pragma unroll
        for (int kh = 0; kh < NKH; ++kh)
          if (lead && sl.h[kh] >= 0) a.grad_s[e * H + sl.h[kh]] = A(0);
        if (a.g_e != nullptr) {
          A zero[V];
#pragma unroll
          for (int k = 0; k < V; ++k) zero[k] = A(0);
#pragma unroll
          for (int t = 0; t < S; ++t)
            store_slot<scalar_t, V>(a.g_e + e * HC, sl.off[t], zero);
        }
        continue;
      }
      A xl[S][V], et[S][V], z[S][V], s[NKH], g[NKH];
      load_row<scalar_t, S, V>(a.x_l + j * HC, sl.off, xl);
      const bool has_et = a.edge_term != nullptr;
      if (has_et) load_row<scalar_t, S, V>(a.edge_term + e * HC, sl.off, et);
      edge_z<A, S, V, HEADS>(xl, xr, et, has_et, z);
      head_scores<A, S, V, HEADS, NKH>(z, att, a.slope, L.g_log, s);
#pragma unroll
      for (int kh = 0; kh < NKH; ++kh) g[kh] = A(0);
#pragma unroll
      for (int t = 0; t < S; ++t)
#pragma unroll
        for (int k = 0; k < V; ++k) g[head_slot<S, HEADS>(t)] += go[t][k] * xl[t][k];
      A gs[NKH];
#pragma unroll
      for (int kh = 0; kh < NKH; ++kh) {
        g[kh] = head_sum(g[kh], L.g_log);
        gs[kh] = A(0);
        if (sl.h[kh] >= 0 && is_finite(lse[kh])) {  // else no weight
          const A alpha = pfa_exp(s[kh] - lse[kh]);
          const A mk = a.mask != nullptr ? to_acc(a.mask[e * H + sl.h[kh]]) : A(1);
          gs[kh] = alpha * (mk * g[kh] - delta[kh]);
        }
        if (lead && sl.h[kh] >= 0) a.grad_s[e * H + sl.h[kh]] = gs[kh];
      }
#pragma unroll
      for (int t = 0; t < S; ++t) {
        const A gsv = gs[head_slot<S, HEADS>(t)];
        A gz[V];
#pragma unroll
        for (int k = 0; k < V; ++k) {
          gz[k] = leaky_grad(z[t][k], a.slope, gsv * att[t][k]);
          gxr[t][k] += gz[k];
          gatt[t][k] += gsv * leaky(z[t][k], a.slope);
        }
        if (a.g_e != nullptr) store_slot<scalar_t, V>(a.g_e + e * HC, sl.off[t], gz);
      }
    }
#pragma unroll
    for (int t = 0; t < S; ++t) store_slot<scalar_t, V>(a.g_r + i * HC, sl.off[t], gxr[t]);
  }
  A* part = a.att_partial + warp * HC;
#pragma unroll
  for (int t = 0; t < S; ++t) {
    if (sl.off[t] < 0) continue;
#pragma unroll
    for (int k = 0; k < V; ++k) part[sl.off[t] + k] = gatt[t][k];
  }
}

// Backward pass 2, by source over the transpose: one warp per (source node
// j, head tile), grid as the forward's. x_l[j] and att stay in registers;
// for each CSC entry k (destination i = csc_row[k], CSR position e =
// csc_perm[k]) the lanes load x_r[i], grad_out[i] (and edge_term[e]),
// recompute the score for alpha = exp(s - lse[i]) and leaky'(z), read
// grad_s[e] and add alpha * mask * grad_out[i] + grad_s * att * leaky'(z)
// to their slots of grad_x_l[j], stored once at the end.
template <typename scalar_t, typename index_t, int V, int S, bool HEADS>
__global__ void __launch_bounds__(kBlock)
    gatv2_bwd_cols_kernel(Gatv2Args<scalar_t, index_t> a, Gatv2Layout L) {
  using A = acc_t<scalar_t>;
  constexpr int NKH = Slots<S, HEADS>::NKH;
  const int64_t j =
      static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (j >= a.Ns) return;
  const int lane = lane_id();
  const int H = L.H;
  const int64_t HC = static_cast<int64_t>(H) * L.C;
  const Slots<S, HEADS> sl = decode<S, HEADS>(L, blockIdx.y, lane);
  A xl[S][V], att[S][V], gxl[S][V];
  load_row<scalar_t, S, V>(a.x_l + j * HC, sl.off, xl);
  load_row<scalar_t, S, V>(a.att, sl.off, att);
#pragma unroll
  for (int t = 0; t < S; ++t)
#pragma unroll
    for (int k = 0; k < V; ++k) gxl[t][k] = A(0);
  int64_t start, end;
  row_range(a.colptr, j, a.E, start, end);
  for (int64_t q = start, ib = 0, eb = 0; q < end; ++q) {
    const int kq = static_cast<int>((q - start) & (kWarp - 1));
    if (kq == 0) {
      ib = batch_load(a.csc_row, q, end, lane);
      eb = batch_load(a.csc_perm, q, end, lane);
    }
    const int64_t i = __shfl_sync(kFullMask, ib, kq);
    const int64_t e = __shfl_sync(kFullMask, eb, kq);
    if (i < 0 || i >= a.N || e < 0 || e >= a.E) continue;  // warp-uniform
    A xr[S][V], go[S][V], et[S][V], z[S][V], s[NKH];
    load_row<scalar_t, S, V>(a.x_r + i * HC, sl.off, xr);
    load_row<scalar_t, S, V>(a.grad_out + i * HC, sl.off, go);
    const bool has_et = a.edge_term != nullptr;
    if (has_et) load_row<scalar_t, S, V>(a.edge_term + e * HC, sl.off, et);
    edge_z<A, S, V, HEADS>(xl, xr, et, has_et, z);
    head_scores<A, S, V, HEADS, NKH>(z, att, a.slope, L.g_log, s);
    A p[NKH], gs[NKH];
#pragma unroll
    for (int kh = 0; kh < NKH; ++kh) {
      p[kh] = A(0);
      gs[kh] = A(0);
      if (sl.h[kh] >= 0) {
        const A l = a.lse[i * H + sl.h[kh]];
        if (is_finite(l)) {
          p[kh] = pfa_exp(s[kh] - l);
          if (a.mask != nullptr) p[kh] *= to_acc(a.mask[e * H + sl.h[kh]]);
          gs[kh] = a.grad_s[e * H + sl.h[kh]];
        }
      }
    }
#pragma unroll
    for (int t = 0; t < S; ++t) {
      const int kh = head_slot<S, HEADS>(t);
#pragma unroll
      for (int k = 0; k < V; ++k)
        gxl[t][k] += p[kh] * go[t][k] +
                     leaky_grad(z[t][k], a.slope, gs[kh] * att[t][k]);
    }
  }
#pragma unroll
  for (int t = 0; t < S; ++t) store_slot<scalar_t, V>(a.g_l + j * HC, sl.off[t], gxl[t]);
}

// out[c, q] = sum of in[r, q] over rows r of chunk c (rows_per_chunk rows),
// in a fixed order: block (x, c) takes 32 columns (lanes) and chunk c; warp
// w sums rows w, w + 8, ... of the chunk, then warp 0 adds the 8 warp sums
// in warp order.
template <typename A, typename T>
__global__ void __launch_bounds__(kBlock)
    gatv2_sum_rows_kernel(const A* __restrict__ in, int64_t rows, int64_t cols,
                          int64_t rows_per_chunk, T* __restrict__ out) {
  __shared__ A s_sum[kWarpsPerBlock][kWarp];
  const int lane = lane_id(), w = threadIdx.x >> 5;
  const int64_t q = static_cast<int64_t>(blockIdx.x) * kWarp + lane;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  A v = A(0);
  if (q < cols)
    for (int64_t r = r0 + w; r < r1; r += kWarpsPerBlock) v += in[r * cols + q];
  s_sum[w][lane] = v;
  __syncthreads();
  if (w == 0 && q < cols) {
    A t = s_sum[0][lane];
    for (int k = 1; k < kWarpsPerBlock; ++k) t += s_sum[k][lane];
    out[static_cast<int64_t>(blockIdx.y) * cols + q] = static_cast<T>(t);
  }
}

inline at::Tensor opt_contig(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? t->contiguous() : at::Tensor();
}

template <typename T>
inline const T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? t.data_ptr<T>() : nullptr;
}

// Layout and template choice for H heads of C channels, V elements a unit.
struct Gatv2Plan {
  Gatv2Layout L;
  int S;        // 1, 4 or 32 slots
  bool heads;   // slots are heads
};

inline Gatv2Plan make_plan(int64_t H, int64_t C, int V) {
  Gatv2Plan P;
  Gatv2Layout& L = P.L;
  L.H = static_cast<int>(H);
  L.C = static_cast<int>(C);
  L.V = V;
  L.CU = static_cast<int>(C / V);
  const int G = next_pow2(std::min<int64_t>(std::max(L.CU, 1), kWarp));
  L.g_log = log2_pow2(G);
  const int HS = kWarp / G;
  L.KC = static_cast<int>(ceil_div(std::max(L.CU, 1), G));
  PFA_CHECK(L.KC <= 32, "gatv2_attention: at most ", 32 * 32 * V,
            " channels per head for this dtype and alignment on CUDA, got ", C);
  if (L.KC == 1) {
    const int64_t need = ceil_div(H, HS);
    L.KH = static_cast<int>(std::min<int64_t>(kGatv2LaneSlots, std::max<int64_t>(need, 1)));
    P.heads = true;
    P.S = L.KH == 1 ? 1 : 4;
  } else {
    L.KH = 1;
    P.heads = false;
    P.S = L.KC <= 4 ? 4 : 32;
  }
  L.tile_heads = HS * L.KH;
  L.n_tiles = static_cast<int>(ceil_div(std::max<int64_t>(H, 1), L.tile_heads));
  PFA_CHECK(L.n_tiles <= 65535, "gatv2_attention: too many heads: ", H);
  return P;
}

// Calls f(V, S, HEADS) with compile-time constants.
template <typename scalar_t, typename F>
inline void dispatch_plan(bool vec, const Gatv2Plan& P, F&& f) {
  constexpr int VW = vec_width<scalar_t>();
  auto with_v = [&](auto v) {
    if (P.S == 1)
      f(v, std::integral_constant<int, 1>(), std::true_type());
    else if (P.S == 4 && P.heads)
      f(v, std::integral_constant<int, 4>(), std::true_type());
    else if (P.S == 4)
      f(v, std::integral_constant<int, 4>(), std::false_type());
    else
      f(v, std::integral_constant<int, 32>(), std::false_type());
  };
  if (vec)
    with_v(std::integral_constant<int, VW>());
  else
    with_v(std::integral_constant<int, 1>());
}

template <typename scalar_t, typename index_t>
Gatv2Args<scalar_t, index_t> make_args(const at::Tensor& rowptr,
                                       const at::Tensor& col,
                                       const at::Tensor& x_l,
                                       const at::Tensor& x_r,
                                       const at::Tensor& edge_term,
                                       const at::Tensor& att,
                                       const at::Tensor& mask,
                                       const at::Tensor& bias, double slope) {
  Gatv2Args<scalar_t, index_t> a{};
  a.rowptr = rowptr.data_ptr<index_t>();
  a.col = col.data_ptr<index_t>();
  a.x_l = x_l.data_ptr<scalar_t>();
  a.x_r = x_r.data_ptr<scalar_t>();
  a.edge_term = ptr_or_null<scalar_t>(edge_term);
  a.att = att.data_ptr<scalar_t>();
  a.mask = ptr_or_null<scalar_t>(mask);
  a.bias = ptr_or_null<scalar_t>(bias);
  a.N = rowptr.numel() - 1;
  a.E = col.numel();
  a.Ns = x_l.size(0);
  a.slope = static_cast<acc_t<scalar_t>>(slope);
  return a;
}

bool all_aligned(std::initializer_list<const void*> ps) {
  for (const void* p : ps)
    if (p != nullptr && !aligned16(p)) return false;
  return true;
}

std::tuple<at::Tensor, at::Tensor> gatv2_attention_cuda(
    const at::Tensor& rowptr_in, const at::Tensor& col_in,
    const at::Tensor& x_l_in, const at::Tensor& x_r_in,
    const c10::optional<at::Tensor>& edge_term_in, const at::Tensor& att_in,
    const c10::optional<at::Tensor>& mask_in, double negative_slope,
    const c10::optional<at::Tensor>& bias_in,
    const c10::optional<at::Tensor>& /*colptr*/,
    const c10::optional<at::Tensor>& /*csc_row*/,
    const c10::optional<at::Tensor>& /*csc_perm*/) {
  check_gatv2_attention(rowptr_in, col_in, x_l_in, x_r_in, edge_term_in,
                        att_in, mask_in, bias_in);
  c10::cuda::CUDAGuard guard(x_l_in.device());
  const at::Tensor rowptr = rowptr_in.contiguous(), col = col_in.contiguous(),
                   x_l = x_l_in.contiguous(), x_r = x_r_in.contiguous(),
                   att = att_in.contiguous(), edge_term = opt_contig(edge_term_in),
                   mask = opt_contig(mask_in), bias = opt_contig(bias_in);
  const int64_t N = rowptr.numel() - 1, H = x_l.size(1), C = x_l.size(2);
  at::Tensor out = at::empty({N, H, C}, x_l.options());
  at::Tensor lse = at::empty({N, H}, x_l.options().dtype(opmath_type(x_l.scalar_type())));
  if (N == 0 || H * C == 0) {
    lse.fill_(-std::numeric_limits<double>::infinity());
    return {out.zero_(), lse};
  }
  PFA_DISPATCH_FLOATS(x_l.scalar_type(), "gatv2_attention_cuda", [&] {
    PFA_DISPATCH_INDEX(rowptr.scalar_type(), "gatv2_attention_cuda", [&] {
      using A = acc_t<scalar_t>;
      auto a = make_args<scalar_t, index_t>(rowptr, col, x_l, x_r, edge_term,
                                            att, mask, bias, negative_slope);
      a.out = out.data_ptr<scalar_t>();
      a.lse_out = lse.data_ptr<A>();
      constexpr int VW = vec_width<scalar_t>();
      const bool vec = C % VW == 0 && all_aligned({a.x_l, a.x_r, a.edge_term,
                                                   a.att, a.bias, a.out});
      const Gatv2Plan P = make_plan(H, C, vec ? VW : 1);
      const dim3 grid(static_cast<unsigned>(ceil_div(N, kWarpsPerBlock)),
                      static_cast<unsigned>(P.L.n_tiles));
      auto stream = at::cuda::getCurrentCUDAStream();
      dispatch_plan<scalar_t>(vec, P, [&](auto v, auto s, auto heads) {
        gatv2_fwd_kernel<scalar_t, index_t, decltype(v)::value,
                         decltype(s)::value, decltype(heads)::value>
            <<<grid, kBlock, 0, stream>>>(a, P.L);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    });
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
gatv2_attention_backward_cuda(
    const at::Tensor& rowptr_in, const at::Tensor& col_in,
    const at::Tensor& colptr_in, const at::Tensor& csc_row_in,
    const at::Tensor& csc_perm_in, const at::Tensor& x_l_in,
    const at::Tensor& x_r_in, const c10::optional<at::Tensor>& edge_term_in,
    const at::Tensor& att_in, const c10::optional<at::Tensor>& mask_in,
    double negative_slope, const c10::optional<at::Tensor>& bias_in,
    const at::Tensor& out_in, const at::Tensor& lse_in,
    const at::Tensor& grad_out_in, bool need_edge) {
  check_gatv2_attention_backward(rowptr_in, col_in, colptr_in, csc_row_in,
                                 csc_perm_in, x_l_in, x_r_in, edge_term_in,
                                 att_in, mask_in, bias_in, out_in, lse_in,
                                 grad_out_in);
  c10::cuda::CUDAGuard guard(x_l_in.device());
  const at::Tensor rowptr = rowptr_in.contiguous(), col = col_in.contiguous(),
                   colptr = colptr_in.contiguous(),
                   csc_row = csc_row_in.contiguous(),
                   csc_perm = csc_perm_in.contiguous(),
                   x_l = x_l_in.contiguous(), x_r = x_r_in.contiguous(),
                   att = att_in.contiguous(), edge_term = opt_contig(edge_term_in),
                   mask = opt_contig(mask_in), bias = opt_contig(bias_in),
                   fout = out_in.contiguous(),
                   lse = lse_in.contiguous(), grad_out = grad_out_in.contiguous();
  const int64_t N = rowptr.numel() - 1, E = col.numel(), Ns = x_l.size(0),
                H = x_l.size(1), C = x_l.size(2), HC = H * C;
  const bool want_edge = need_edge && edge_term.defined();
  const auto opts = x_l.options();
  at::Tensor g_l = at::empty({Ns, H, C}, opts);
  at::Tensor g_r = at::empty({N, H, C}, opts);
  at::Tensor g_e = want_edge ? at::empty({E, H, C}, opts) : at::empty({0}, opts);
  at::Tensor g_att = at::empty({H, C}, opts);
  if (HC == 0) return {g_l, g_r, g_e, g_att};
  if (N == 0) {  // no edge lies in a row
    g_att.zero_();
    g_e.zero_();
  }
  if (N == 0 && Ns > 0) g_l.zero_();
  if (N == 0) return {g_l, g_r, g_e, g_att};
  const auto acc_opts = opts.dtype(opmath_type(x_l.scalar_type()));
  at::Tensor grad_s = at::empty({std::max<int64_t>(E, 1), H}, acc_opts);
  const int64_t blocks = std::min<int64_t>(kGatv2CudaBwdBlocks,
                                           ceil_div(N, kWarpsPerBlock));
  const int64_t warps = blocks * kWarpsPerBlock;
  at::Tensor partial = at::empty({warps, HC}, acc_opts);
  PFA_DISPATCH_FLOATS(x_l.scalar_type(), "gatv2_attention_backward_cuda", [&] {
    PFA_DISPATCH_INDEX(rowptr.scalar_type(), "gatv2_attention_backward_cuda", [&] {
      using A = acc_t<scalar_t>;
      auto a = make_args<scalar_t, index_t>(rowptr, col, x_l, x_r, edge_term,
                                            att, mask, bias, negative_slope);
      a.colptr = colptr.data_ptr<index_t>();
      a.csc_row = csc_row.data_ptr<index_t>();
      a.csc_perm = csc_perm.data_ptr<index_t>();
      a.fout = fout.data_ptr<scalar_t>();
      a.lse = lse.data_ptr<A>();
      a.grad_out = grad_out.data_ptr<scalar_t>();
      a.grad_s = grad_s.data_ptr<A>();
      a.att_partial = partial.data_ptr<A>();
      a.g_l = g_l.data_ptr<scalar_t>();
      a.g_r = g_r.data_ptr<scalar_t>();
      a.g_e = want_edge ? g_e.data_ptr<scalar_t>() : nullptr;
      constexpr int VW = vec_width<scalar_t>();
      const bool vec = C % VW == 0 &&
                       all_aligned({a.x_l, a.x_r, a.edge_term, a.att, a.bias,
                                    a.fout, a.grad_out, a.g_l, a.g_r, a.g_e});
      const Gatv2Plan P = make_plan(H, C, vec ? VW : 1);
      auto stream = at::cuda::getCurrentCUDAStream();
      dispatch_plan<scalar_t>(vec, P, [&](auto v, auto s, auto heads) {
        constexpr int kV = decltype(v)::value, kS = decltype(s)::value;
        constexpr bool kH = decltype(heads)::value;
        gatv2_bwd_rows_kernel<scalar_t, index_t, kV, kS, kH>
            <<<dim3(static_cast<unsigned>(blocks), P.L.n_tiles), kBlock, 0,
               stream>>>(a, P.L);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
        if (Ns > 0) {
          gatv2_bwd_cols_kernel<scalar_t, index_t, kV, kS, kH>
              <<<dim3(static_cast<unsigned>(ceil_div(Ns, kWarpsPerBlock)),
                      P.L.n_tiles),
                 kBlock, 0, stream>>>(a, P.L);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
      });
      // grad_att: the warps' partials summed in warp order, in two steps.
      constexpr int64_t kChunks = 64;
      const int64_t per_chunk = ceil_div(warps, kChunks);
      const int64_t chunks = ceil_div(warps, per_chunk);
      at::Tensor mid = at::empty({chunks, HC}, acc_opts);
      const unsigned col_blocks = static_cast<unsigned>(ceil_div(HC, kWarp));
      gatv2_sum_rows_kernel<A, A>
          <<<dim3(col_blocks, static_cast<unsigned>(chunks)), kBlock, 0,
             stream>>>(a.att_partial, warps, HC, per_chunk, mid.data_ptr<A>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      gatv2_sum_rows_kernel<A, scalar_t>
          <<<dim3(col_blocks, 1), kBlock, 0, stream>>>(
              mid.data_ptr<A>(), chunks, HC, chunks, g_att.data_ptr<scalar_t>());
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    });
  });
  return {g_l, g_r, g_e, g_att};
}

}  // namespace
}  // namespace cuda
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, CUDA, m) {
  m.impl("gatv2_attention", &pyg_fastattn::cuda::gatv2_attention_cuda);
  m.impl("gatv2_attention_backward",
         &pyg_fastattn::cuda::gatv2_attention_backward_cuda);
}
