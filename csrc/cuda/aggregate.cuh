// Warp-per-row weighted aggregation shared by spmm, segment_sum and the
// attention forward:  out[i, h, :] = sum_{e in row i} w(e, h) * values[j_e, h, :].
// The weight functor supplies w (1, weight[e], weight[perm[e]], or the
// attention probability alpha * mask).
#pragma once

#include "utils.cuh"

namespace pyg_fastattn {
namespace cuda {

// What one lane of a (row, tile) warp owns, decoded from TileLayout (see
// utils.cuh): head h = h0 + hs and its unit at element offset uoff inside a
// node's [H, C] row.
struct LaneTile {
  int cl, hs, es;  // lane bit fields
  int LH, HS, ES;
  int64_t row;     // the warp's row (may be >= N: nothing to do)
  int ct;          // channel tile
  int h;
  bool hok;        // head inside the tile
  bool uok;        // head inside the tile and unit inside the head
  int64_t uoff;
};

// The kernels' grid is (row blocks, tiles): warp w of block (bx, t) handles
// row bx * kWarpsPerBlock + w and tile t.
__device__ __forceinline__ LaneTile decode_tile(const TileLayout& L, int V,
                                               int64_t row, int t, int lane) {
  LaneTile T;
  T.LH = 1 << L.lh_log;
  T.HS = 1 << L.hs_log;
  T.ES = kWarp >> (L.lh_log + L.hs_log);
  T.cl = lane & (T.LH - 1);
  T.hs = (lane >> L.lh_log) & (T.HS - 1);
  T.es = lane >> (L.lh_log + L.hs_log);
  T.row = row;
  const int ht = t / L.n_ct;
  T.ct = t - ht * L.n_ct;
  const int h0 = ht * L.HT;
  const int hend = min(L.H, h0 + L.HT);
  const int c = T.ct * 32 + T.cl;
  T.h = h0 + T.hs;
  T.hok = T.h < hend;
  T.uok = T.hok && c < L.CU;
  T.uoff = static_cast<int64_t>(T.h) * L.C + static_cast<int64_t>(c) * V;
  return T;
}

__device__ __forceinline__ int64_t block_row() {
  return static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
}

// Index prefetch for a warp walking a segment [start, end) of a CSR / CSC
// index array in chunks of 32 positions: lane l loads position c0 + l
// (coalesced) and the chunk's batches take their indices by shuffles, so
// that a batch costs one dependent memory round trip (its gathers) instead
// of two. Used by the attention backward; the forward gathers re-read
// indices that their first pass left in L1, where this was slower
// (benchmarks/RESULTS.md, "Numbers moved out of code comments").
template <typename index_t>
struct IdxChunk {
  index_t v;
  __device__ __forceinline__ void load(const index_t* __restrict__ idx,
                                       int64_t c0, int64_t end) {
    const int64_t k = c0 + lane_id();
    v = k < end ? idx[k] : index_t(0);
  }
  // Position c0 + s (0 <= s < 32; s & 31 otherwise). All lanes must call it.
  __device__ __forceinline__ index_t get(int s) const {
    return __shfl_sync(kFullMask, v, s & (kWarp - 1));
  }
};

// Pass over the row's edges: lane (es, hs, cl) of warp `rank` (of `nranks`
// warps sharing the row, 1 unless the row is long) takes edges
// start + rank*ES + es + k * nranks*ES and, for each, loads its units of
// values[j] (16-byte loads when V > 1; EB edges' loads in flight) and
// accumulates w * values into acc. col == nullptr means j = e. Edges with j
// outside [0, Ns) or rejected by fn.edge_ok contribute nothing.
// Each stage issues all EB edges' loads before any of them is used (the
// indices, fn's per-edge terms, the rows, then fn.weights' loads), so a
// batch waits for one round trip per stage, not one per edge.
// Fn provides edge_aux(e, in) (a per-edge word, e.g. a weight's position),
// edge_ok(aux), and weights<EB>(T, e, j, aux, ok, w) filling w[b].
template <int V, typename scalar_t, typename index_t, typename Fn>
__device__ __forceinline__ void gather_accumulate(
    const LaneTile& T, int rank, int nranks, int64_t start, int64_t end,
    const index_t* __restrict__ col, int64_t Ns, int64_t D,
    const scalar_t* __restrict__ values, const Fn& fn,
    acc_t<scalar_t> (&acc)[V]) {
  using A = acc_t<scalar_t>;
  constexpr int EB = kEdgeBatch;
  const int64_t stride = static_cast<int64_t>(T.ES) * nranks;
  const auto slim = index_limit<index_t>(Ns);
  // the trip count is warp-uniform (fn.weights may shuffle)
  for (int64_t e0 = start + static_cast<int64_t>(rank) * T.ES; e0 < end;
       e0 += stride * EB) {
    int64_t e[EB], j[EB], aux[EB];
    bool ok[EB];
#pragma unroll
    for (int b = 0; b < EB; ++b) {
      e[b] = e0 + T.es + b * stride;
      ok[b] = e[b] < end;
      j[b] = e[b];
    }
    bool jin[EB];
    if (col != nullptr) {
      index_t c[EB];
#pragma unroll
      for (int b = 0; b < EB; ++b) c[b] = ok[b] ? col[e[b]] : index_t(0);
#pragma unroll
      for (int b = 0; b < EB; ++b) {
        j[b] = static_cast<int64_t>(c[b]);
        jin[b] = index_in(c[b], slim);
      }
    } else {
#pragma unroll
      for (int b = 0; b < EB; ++b) jin[b] = j[b] >= 0 && j[b] < Ns;
    }
#pragma unroll
    for (int b = 0; b < EB; ++b) aux[b] = fn.edge_aux(e[b], ok[b]);
#pragma unroll
    for (int b = 0; b < EB; ++b)
      ok[b] = ok[b] && jin[b] && fn.edge_ok(aux[b]);
    Vec<scalar_t, V> raw[EB];
#pragma unroll
    for (int b = 0; b < EB; ++b)
      raw[b] = (ok[b] && T.uok)
                   ? load_vec<scalar_t, V>(values + j[b] * D + T.uoff)
                   : zero_vec<scalar_t, V>();
    A wgt[EB];
    fn.template weights<EB>(T, e, j, aux, ok, wgt);
#pragma unroll
    for (int b = 0; b < EB; ++b) {
      if (!ok[b] || !T.uok) continue;
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] += wgt[b] * vec_get(raw[b], v);
    }
  }
}

// Owner lanes (a batch of EB entries, STRIDE = EB / OWN lanes of a head
// share it): lane cl owns entries own0 + STRIDE*m, own0 = cl % STRIDE.
// owned: that entry of a per-entry array (selects; own0 is per lane).
template <int STRIDE, typename T, int N>
__device__ __forceinline__ T owned(const T (&x)[N], int own0, int m) {
  T v = x[STRIDE * m];
#pragma unroll
  for (int r = 1; r < STRIDE; ++r)
    if (own0 == r) v = x[STRIDE * m + r];
  return v;
}
// from_owner: entry b's value, held as mine[b / STRIDE] by its owner lane
// gbase | (b % STRIDE) (gbase: the head's first lane). All lanes call it.
template <int STRIDE, typename A, int OWN>
__device__ __forceinline__ A from_owner(const A (&mine)[OWN], int b,
                                        int gbase) {
  if constexpr (STRIDE == 1) {
    return mine[b];
  } else {
    return __shfl_sync(kFullMask, mine[b / STRIDE], gbase | (b % STRIDE));
  }
}

// Sum acc over the edge slots (lane bits [LH*HS, 32)); every lane ends with
// its (hs, cl) total.
template <int V, typename A>
__device__ __forceinline__ void reduce_edge_slots(const LaneTile& T,
                                                  A (&acc)[V]) {
  for (int off = T.LH * T.HS; off < kWarp; off <<= 1) {
#pragma unroll
    for (int v = 0; v < V; ++v)
      acc[v] += __shfl_xor_sync(kFullMask, acc[v], off);
  }
}

// Block-cooperative rows: sum acc over the nranks warps of the block (fixed
// order: deterministic); rank 0 ends with the total. s_red holds
// kWarpsPerBlock * 32 * V values. All threads of the block call it.
template <int V, typename A>
__device__ __forceinline__ void block_sum(A (&acc)[V], A* s_red, int rank,
                                          int nranks) {
  const int lane = lane_id();
#pragma unroll
  for (int v = 0; v < V; ++v) s_red[(rank * kWarp + lane) * V + v] = acc[v];
  __syncthreads();
  if (rank == 0) {
    for (int r = 1; r < nranks; ++r) {
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] += s_red[(r * kWarp + lane) * V + v];
    }
  }
  __syncthreads();
}

template <int V, typename A>
__device__ __forceinline__ void zero_acc(A (&acc)[V]) {
#pragma unroll
  for (int v = 0; v < V; ++v) acc[v] = A(0);
}

// A row's weighted sum for the lane's units, complete in rank 0: zero,
// gather_accumulate, then the sums over edge slots and the block's warps.
template <int V, typename scalar_t, typename index_t, typename Fn>
__device__ __forceinline__ void aggregate_row(
    const LaneTile& T, int rank, int nranks, int64_t start, int64_t end,
    const index_t* __restrict__ col, int64_t Ns, int64_t D,
    const scalar_t* __restrict__ values, const Fn& fn,
    acc_t<scalar_t>* s_red, acc_t<scalar_t> (&acc)[V]) {
  zero_acc<V>(acc);
  gather_accumulate<V>(T, rank, nranks, start, end, col, Ns, D, values, fn,
                       acc);
  reduce_edge_slots<V>(T, acc);
  if (nranks > 1) block_sum<V>(acc, s_red, rank, nranks);
}

// Edge slot 0 stores the row's units: out_row = out + i * D, plus the
// matching units of bias [D] when given.
template <int V, typename scalar_t>
__device__ __forceinline__ void store_units(const LaneTile& T,
                                            const acc_t<scalar_t> (&acc)[V],
                                            scalar_t* __restrict__ out_row,
                                            const scalar_t* __restrict__ bias = nullptr) {
  if (T.es != 0 || !T.uok) return;
  Vec<scalar_t, V> o = zero_vec<scalar_t, V>();
  if (bias != nullptr) {
    const Vec<scalar_t, V> b = load_vec<scalar_t, V>(bias + T.uoff);
#pragma unroll
    for (int v = 0; v < V; ++v) vec_set(o, v, acc[v] + to_acc(vec_get(b, v)));
  } else {
#pragma unroll
    for (int v = 0; v < V; ++v) vec_set(o, v, acc[v]);
  }
  store_vec<scalar_t, V>(out_row + T.uoff, o);
}

// Edge slot 0 stores the row's units in the accumulation type (partials of
// the split path): part_row = part + slot * D.
template <int V, typename A>
__device__ __forceinline__ void store_partial(const LaneTile& T,
                                              const A (&acc)[V],
                                              A* __restrict__ part_row) {
  if (T.es != 0 || !T.uok) return;
#pragma unroll
  for (int v = 0; v < V; ++v) part_row[T.uoff + v] = acc[v];
}

// Rows with more edges than this are processed by all warps of a block
// together (a 10^6-edge row would otherwise keep one warp busy for long).
constexpr int64_t kCoopEdges = 256;

// The threshold for a launch: grids of about one wave (small graphs) take
// as long as their longest row, so rows over 32 edges are shared there.
inline int64_t coop_edges(int64_t rows, int n_tiles) {
  const int64_t blocks = ceil_div(rows, kWarpsPerBlock) * n_tiles;
  return blocks <= int64_t(num_sms()) * 4 ? 32 : kCoopEdges;
}

// Work scheduling for the row kernels: each warp owns one row (of the
// block's tile blockIdx.y). Rows with more than `coop` edges are first
// processed one after the other by the whole block (body(row, rank = warp in
// block, nranks = kWarpsPerBlock)); then every warp processes its own short
// row (body(row, 0, 1)). One call site, so body is inlined once. body may
// call __syncthreads() only when nranks > 1 (block-uniform).
// Rows with more than `split` edges are skipped (the split path, utils.cuh).
template <typename index_t, typename Body>
__device__ __forceinline__ void run_rows(const index_t* __restrict__ rowptr,
                                         int64_t N, int64_t E, int64_t coop,
                                         int64_t split, int64_t* s_long,
                                         Body&& body) {
  const int64_t item = block_row();
  bool valid = item < N;
  bool is_long = false;
  if (valid) {
    int64_t s0, s1;
    row_range(rowptr, item, E, s0, s1);
    is_long = s1 - s0 > coop;
    valid = s1 - s0 <= split;
  }
  const int wib = threadIdx.x >> 5;
  if (lane_id() == 0) s_long[wib] = (valid && is_long) ? item : -1;
  __syncthreads();
  int k = 0;
  bool own = valid && !is_long;
  while (true) {
    while (k < kWarpsPerBlock && s_long[k] < 0) ++k;  // block-uniform
    int64_t it;
    int rank, nranks;
    if (k < kWarpsPerBlock) {
      it = s_long[k];
      rank = wib;
      nranks = kWarpsPerBlock;
      ++k;
    } else if (own) {
      it = item;
      rank = 0;
      nranks = 1;
      own = false;
    } else {
      break;
    }
    body(it, rank, nranks);
  }
}

// The rows of a row kernel's block: PARTIAL, the two window slots of
// window block blockIdx.x (body(row, warp in block, kWarpsPerBlock, start,
// end, slot 2 * w + q)); otherwise run_rows (body(row, rank, nranks, start,
// end, 0) over the whole row).
template <bool PARTIAL, typename index_t, typename Body>
__device__ __forceinline__ void run_rows_or_windows(
    const SplitArgs& sp, const index_t* __restrict__ rowptr, int64_t N,
    int64_t E, int64_t coop, int64_t* s_long, Body&& body) {
  if (PARTIAL) {
    const int64_t w = blockIdx.x;
    for (int q = 0; q < 2; ++q) {
      int64_t row, s, t;
      if (!window_part(sp, rowptr, E, w, q, row, s, t)) continue;
      body(row, static_cast<int>(threadIdx.x >> 5), kWarpsPerBlock, s, t,
           2 * w + q);
    }
  } else {
    run_rows(rowptr, N, E, coop, sp.split, s_long,
             [&](int64_t row, int rank, int nranks) {
      int64_t start, end;
      row_range(rowptr, row, E, start, end);
      body(row, rank, nranks, start, end, 0);
    });
  }
}

// Host: launch kernel<V> for V the 16-byte width (vec) or 1. `f` is a
// generic lambda taking std::integral_constant V.
template <typename scalar_t, typename F>
inline void dispatch_v(bool vec, F&& f) {
  if (vec)
    f(std::integral_constant<int, vec_width<scalar_t>()>());
  else
    f(std::integral_constant<int, 1>());
}

}  // namespace cuda
}  // namespace pyg_fastattn
