// Shared parts of the gatv2 and transformer CUDA kernels. The kernels
// (gatv2_fwd.cuh: forward; gatv2_rows.cuh: backward destination pass;
// gatv2_cols.cuh: backward source pass) take DOT = false for GATv2's score
// att . leaky_relu(x_l[j] + x_r[i] + edge_term[e]) with values x_l[j], and
// DOT = true for the transformer's scale * <query[i], key[j] + edge_term[e]>
// with values value[j] + edge_term[e] (x_l: key, x_r: query). Ops:
// gatv2.cu / gatv2_backward.cu / gatv2_bwd_cols.cu and transformer.cu /
// transformer_backward.cu / transformer_bwd_cols.cu.
#pragma once

#include "utils.cuh"

namespace pyg_fastattn {
namespace cuda {
namespace gatv2 {

// Lane layout of the gatv2 kernels. A node's [H, C] row is read in units of
// V elements (16 bytes when aligned, else 1 element): CU = C / V units per
// head. A warp's lane = hs * G + cl: G = pow2 >= min(CU, 32) lanes share a
// head (cl: unit), HS = 32 / G heads side by side (hs). A lane keeps one
// head (make_plan sets KH = 1; the kernels take KH heads a lane, slot t
// holding unit cl of head h0 + hs + HS * t, when HEADS) in S slots:
//  * HEADS (KC = 1, S = 1): unit cl of head h0 + hs;
//  * otherwise (CU > 32): slot t is unit cl + G * t of head h0 + hs.
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

// idx[p + lane] (or -1 past end) as an R: the warp reads 32 edge indices
// with one coalesced load and hands them out by shuffle, so that no edge
// waits on its own index load (R = index_t: one shuffle a hand-out for
// int32 indices).
template <typename R = int64_t, typename index_t>
__device__ __forceinline__ R batch_load(const index_t* __restrict__ idx,
                                        int64_t p, int64_t end, int lane) {
  return p + lane < end ? static_cast<R>(idx[p + lane]) : R(-1);
}

template <typename scalar_t, typename index_t>
struct Gatv2Args {
  using A = acc_t<scalar_t>;
  const index_t* rowptr;
  const index_t* col;
  const scalar_t* x_l;        // [Ns, H, C] (DOT: key)
  const scalar_t* x_r;        // [N, H, C] (DOT: query)
  const scalar_t* value;      // DOT: [Ns, H, C]
  const scalar_t* edge_term;  // [E, H, C] or nullptr
  const scalar_t* att;        // [H, C] (not DOT)
  const scalar_t* mask;       // [E, H] or nullptr
  const scalar_t* bias;       // [H * C] or nullptr
  int64_t N, E, Ns;
  A slope;  // not DOT
  A scale;  // DOT
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
  A* delta;               // [N, H]: <grad_out[i], out[i] - bias> (pass 1)
  A* att_partial;         // [partial rows of pass 1, H * C] (not DOT)
  scalar_t* g_l;          // [Ns, H, C] (DOT: grad key)
  scalar_t* g_r;          // [N, H, C] (DOT: grad query)
  scalar_t* g_v;          // DOT: [Ns, H, C] grad value
  scalar_t* g_e;          // [E, H, C] or nullptr
  // split path (utils.cuh): long rows (sp, CSR) and long columns (spc, CSC)
  SplitArgs sp, spc;
  int stages;   // ASYNC kernels: stages of a warp's ring (ring_stages)
  A* part_acc;  // [2 * sp.nwin, H * C]: forward sums / backward grad_x_r
  A* part_ms;   // [2 * sp.nwin, H, 2]: forward (max, sum)
  A* part_c;    // [2 * spc.nwin, H * C]: backward grad_x_l (DOT: [.., 2HC],
                //  grad key then grad value)
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

// Per head slot: sum over the lane's slots of x * (y (+ et)), then over the
// head's lanes.
template <typename A, int S, int V, bool HEADS, int NKH>
__device__ __forceinline__ void head_dots(const A (&x)[S][V],
                                          const A (&y)[S][V],
                                          const A (&et)[S][V], bool has_et,
                                          int g_log, A (&s)[NKH]) {
#pragma unroll
  for (int kh = 0; kh < NKH; ++kh) s[kh] = A(0);
#pragma unroll
  for (int t = 0; t < S; ++t)
#pragma unroll
    for (int c = 0; c < V; ++c)
      s[head_slot<S, HEADS>(t)] +=
          x[t][c] * (has_et ? y[t][c] + et[t][c] : y[t][c]);
#pragma unroll
  for (int kh = 0; kh < NKH; ++kh) s[kh] = head_sum(s[kh], g_log);
}

// DOT score of one edge per head slot: scale * <q, k (+ et)>.
template <typename A, int S, int V, bool HEADS, int NKH>
__device__ __forceinline__ void dot_scores(const A (&k)[S][V],
                                           const A (&q)[S][V],
                                           const A (&et)[S][V], bool has_et,
                                           A scale, int g_log, A (&s)[NKH]) {
  head_dots<A, S, V, HEADS, NKH>(q, k, et, has_et, g_log, s);
#pragma unroll
  for (int kh = 0; kh < NKH; ++kh) s[kh] *= scale;
}

template <typename T, int S, int V>
__device__ __forceinline__ void load_row(const T* __restrict__ row,
                                         const int64_t (&off)[S],
                                         acc_t<T> (&x)[S][V]) {
#pragma unroll
  for (int t = 0; t < S; ++t) load_slot<T, V>(row, off[t], x[t]);
}

// Issues the gathers of CSR positions e0 .. e0 + B - 1 before any is used:
// source jv[b] (lane kb + b of the warp's index batch jb; -1 past the end
// or out of range, warp-uniform), its x_l row (DOT: and value row) and the
// edge_term row.
template <int B, bool DOT, typename scalar_t, typename index_t, int S, int V>
__device__ __forceinline__ void gather_edges(
    const Gatv2Args<scalar_t, index_t>& a, const int64_t (&off)[S],
    int64_t HC, int64_t e0, int kb, int64_t jb, bool has_et, int64_t (&jv)[B],
    acc_t<scalar_t> (&xlb)[B][S][V], acc_t<scalar_t> (&vb)[B][S][V],
    acc_t<scalar_t> (&etb)[B][S][V]) {
#pragma unroll
  for (int b = 0; b < B; ++b) {
    jv[b] = __shfl_sync(kFullMask, jb, kb + b);
    if (jv[b] >= a.Ns) jv[b] = -1;
    if (jv[b] < 0) continue;
    load_row<scalar_t, S, V>(a.x_l + jv[b] * HC, off, xlb[b]);
    if (DOT) load_row<scalar_t, S, V>(a.value + jv[b] * HC, off, vb[b]);
    if (has_et) load_row<scalar_t, S, V>(a.edge_term + (e0 + b) * HC, off, etb[b]);
  }
}

// ---------------------------------------------------------------------------
// Asynchronous gathers (ASYNC kernels: one, two or four slots a lane, UB-byte
// units). Each warp has a ring of ns >= 2 stages (ring_stages, launch_plan)
// in shared memory.
// A stage holds, for each lane, nu units (the rows of one edge), the edge's
// tag (int64; -1: skip the edge) and nf floats; a lane writes and reads
// only its own places, so no lane waits for another.
template <int UB>
struct Ring {
  unsigned char* base;  // the warp's first stage
  int nu, sb, ns;       // units a stage, bytes a stage, stages
  static constexpr int stage_bytes(int nu, int nf) {
    return kWarp * (nu * UB + 8 + nf * 4);
  }
  // Shared memory of a block's rings.
  static size_t block_bytes(int ns, int nu, int nf) {
    return static_cast<size_t>(kWarpsPerBlock) * ns * stage_bytes(nu, nf);
  }
  __device__ Ring(unsigned char* smem, int rank, int ns_, int nu_, int nf)
      : nu(nu_), sb(stage_bytes(nu_, nf)), ns(ns_) {
    base = smem + static_cast<size_t>(rank) * ns * sb;
  }
  __device__ unsigned char* unit(int s, int u, int lane) const {
    return base + s * sb + (u * kWarp + lane) * UB;
  }
  __device__ int64_t* tag(int s, int lane) const {
    return reinterpret_cast<int64_t*>(base + s * sb + nu * kWarp * UB) + lane;
  }
  __device__ float* flt(int s, int k, int lane) const {
    return reinterpret_cast<float*>(base + s * sb + nu * kWarp * UB +
                                    kWarp * 8) + k * kWarp + lane;
  }
};

// A lane's copy of its unit of row + off (none for an unused slot, off < 0),
// and the unit read back (zeros for an unused slot, as load_slot).
template <typename T, int V>
__device__ __forceinline__ void ring_copy(unsigned char* dst,
                                          const T* __restrict__ row,
                                          int64_t off) {
  if (off >= 0) cp_async<static_cast<int>(sizeof(T)) * V>(dst, row + off);
}

template <typename T, int V>
__device__ __forceinline__ void ring_slot(const unsigned char* src,
                                          int64_t off, acc_t<T> (&x)[V]) {
  load_slot<T, V>(reinterpret_cast<const T*>(src), off >= 0 ? 0 : -1, x);
}

// cp_async_wait<n>() for a run-time n (n > 7: wait for all).
__device__ __forceinline__ void cp_async_wait_n(int n) {
  switch (n) {
    case 1: cp_async_wait<1>(); break;
    case 2: cp_async_wait<2>(); break;
    case 3: cp_async_wait<3>(); break;
    case 4: cp_async_wait<4>(); break;
    case 5: cp_async_wait<5>(); break;
    case 6: cp_async_wait<6>(); break;
    case 7: cp_async_wait<7>(); break;
    default: cp_async_wait<0>();
  }
}

// Walks positions [start, end) of a warp through a ring of ns stages:
// fetch(p, s) issues the copies of position p into stage s, in order of p
// and D = ns - 1 positions ahead of body(p, s), which reads stage s. Each
// position has its own commit group (empty ones included), so the wait
// before body(p) waits for p's copies only. Position p + D is fetched into
// the stage of p - 1, whose body has already read it.
template <typename Fetch, typename Body>
__device__ __forceinline__ void async_walk(int ns, int64_t start, int64_t end,
                                           Fetch&& fetch, Body&& body) {
  const int D = ns - 1;
  for (int k = 0; k < D; ++k) {
    if (start + k < end) fetch(start + k, k);
    cp_async_commit();
  }
  int s = 0;
  for (int64_t p = start; p < end; ++p) {
    cp_async_wait_n(D - 1);
    if (p + D < end) fetch(p + D, s == 0 ? D : s - 1);
    cp_async_commit();
    body(p, s);
    s = s == D ? 0 : s + 1;
  }
}

// Walks the edges [start, end) of a destination row (forward and backward
// destination pass): edge(e, xl, v, et) for each edge whose source j is in
// range, with xl = x_l[j] (DOT: key[j]), v = value[j] (DOT) and et =
// edge_term[e] (has_et); skip(e) for the others. ASYNC: through the warp's
// ring in ring_smem ((1 + DOT + has_et) * S units); the warp's 32-edge
// index batches are loaded one batch ahead. Otherwise kGatv2EdgeBatch edges
// at a time (gather_edges).
template <bool ASYNC, bool DOT, int V, typename scalar_t, typename index_t,
          int S, typename Edge, typename Skip>
__device__ __forceinline__ void walk_sources(
    const Gatv2Args<scalar_t, index_t>& a, const int64_t (&off)[S],
    int64_t HC, int64_t start, int64_t end, int lane, int rank, bool has_et,
    unsigned char* ring_smem, Edge&& edge, Skip&& skip) {
  using A = acc_t<scalar_t>;
  if constexpr (ASYNC) {
    constexpr int UB = static_cast<int>(sizeof(scalar_t)) * V;
    const Ring<UB> ring(ring_smem, rank, a.stages,
                        (1 + DOT + (has_et ? 1 : 0)) * S, 0);
    const int ue = (1 + DOT) * S;  // edge_term's first unit
    index_t jb = 0, jn = batch_load<index_t>(a.col, start, end, lane);
    auto fetch = [&](int64_t p, int s) {
      const int kb = static_cast<int>((p - start) & (kWarp - 1));
      if (kb == 0) {
        jb = jn;
        jn = batch_load<index_t>(a.col, p + kWarp, end, lane);
      }
      int64_t j = static_cast<int64_t>(__shfl_sync(kFullMask, jb, kb));
      if (j >= a.Ns) j = -1;
      *ring.tag(s, lane) = j;
      if (j < 0) return;  // warp-uniform
#pragma unroll
      for (int t = 0; t < S; ++t) {
        ring_copy<scalar_t, V>(ring.unit(s, t, lane), a.x_l + j * HC, off[t]);
        if (DOT)
          ring_copy<scalar_t, V>(ring.unit(s, S + t, lane), a.value + j * HC,
                                 off[t]);
        if (has_et)
          ring_copy<scalar_t, V>(ring.unit(s, ue + t, lane),
                                 a.edge_term + p * HC, off[t]);
      }
    };
    auto body = [&](int64_t p, int s) {
      if (*ring.tag(s, lane) < 0) {  // warp-uniform
        skip(p);
        return;
      }
      A xl[S][V], vv[S][V], et[S][V];
#pragma unroll
      for (int t = 0; t < S; ++t) {
        ring_slot<scalar_t, V>(ring.unit(s, t, lane), off[t], xl[t]);
        if (DOT) ring_slot<scalar_t, V>(ring.unit(s, S + t, lane), off[t], vv[t]);
        if (has_et)
          ring_slot<scalar_t, V>(ring.unit(s, ue + t, lane), off[t], et[t]);
      }
      edge(p, xl, vv, et);
    };
    async_walk(ring.ns, start, end, fetch, body);
  } else {
    constexpr int B = kGatv2EdgeBatch;
    for (int64_t e0 = start, jb = 0; e0 < end; e0 += B) {
      const int kb = static_cast<int>((e0 - start) & (kWarp - 1));
      if (kb == 0) jb = batch_load(a.col, e0, end, lane);
      int64_t jv[B];
      A xlb[B][S][V], vb[B][S][V], etb[B][S][V];
      gather_edges<B, DOT>(a, off, HC, e0, kb, jb, has_et, jv, xlb, vb, etb);
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const int64_t e = e0 + b;
        if (e >= end) break;
        if (jv[b] < 0) {  // warp-uniform
          skip(e);
          continue;
        }
        edge(e, xlb[b], vb[b], etb[b]);
      }
    }
  }
}

// ---------------------------------------------------------------------------
// Split path. A kernel's grid.x holds `row_blocks` blocks of rows (warp per
// row; rows over sp.split skipped) followed by one block per edge window w
// (utils.cuh), which processes both slots of w: warp r of the block takes
// the r-th of 8 contiguous parts of the slot's edges with the row code,
// then the 8 warp states are merged in warp order into warp 0, which writes
// the slot's partial. The split sums are finished by split_sum_kernel /
// split_softmax_combine_kernel (utils.cuh).

// Warp `rank`'s part [s2, t2) of edges [s, t), split in kWarpsPerBlock.
__device__ __forceinline__ void warp_part(int64_t s, int64_t t, int rank,
                                          int64_t& s2, int64_t& t2) {
  const int64_t n = t - s;
  s2 = s + n * rank / kWarpsPerBlock;
  t2 = s + n * (rank + 1) / kWarpsPerBlock;
}

// Dynamic shared memory of a window block: one warp's S x V slots and
// 2 x NKH softmax states per lane.
template <typename A, int S, int V, int NKH>
constexpr size_t merge_smem() {
  return sizeof(A) * kWarp * (S * V + 2 * NKH);
}

// Offset of the rings (ASYNC kernels) after the merge space.
__host__ __device__ constexpr size_t ring_offset(size_t merge) {
  return (merge + 15) / 16 * 16;
}

// x of warps 1..7 added into warp 0's x, in warp order (all threads of the
// block call it; sh: merge_smem()).
template <typename A, int S, int V>
__device__ __forceinline__ void block_sum_slots(A (&x)[S][V], A* sh, int rank) {
  const int lane = lane_id();
  for (int r = 1; r < kWarpsPerBlock; ++r) {
    if (rank == r) {
#pragma unroll
      for (int t = 0; t < S; ++t)
#pragma unroll
        for (int k = 0; k < V; ++k) sh[(t * V + k) * kWarp + lane] = x[t][k];
    }
    __syncthreads();
    if (rank == 0) {
#pragma unroll
      for (int t = 0; t < S; ++t)
#pragma unroll
        for (int k = 0; k < V; ++k) x[t][k] += sh[(t * V + k) * kWarp + lane];
    }
    __syncthreads();
  }
}

// Online-softmax states (m, den, acc) of warps 1..7 merged into warp 0's,
// in warp order, rescaled to the larger maximum (as online_merge).
template <typename A, int S, int V, bool HEADS, int NKH>
__device__ __forceinline__ void block_merge_softmax(A (&m)[NKH], A (&den)[NKH],
                                                    A (&acc)[S][V], A* sh,
                                                    int rank) {
  const int lane = lane_id();
  A* sm = sh + S * V * kWarp;
  for (int r = 1; r < kWarpsPerBlock; ++r) {
    if (rank == r) {
#pragma unroll
      for (int t = 0; t < S; ++t)
#pragma unroll
        for (int k = 0; k < V; ++k) sh[(t * V + k) * kWarp + lane] = acc[t][k];
#pragma unroll
      for (int kh = 0; kh < NKH; ++kh) {
        sm[(2 * kh) * kWarp + lane] = m[kh];
        sm[(2 * kh + 1) * kWarp + lane] = den[kh];
      }
    }
    __syncthreads();
    if (rank == 0) {
      A f0[NKH], f1[NKH];
#pragma unroll
      for (int kh = 0; kh < NKH; ++kh) {
        const A m2 = sm[(2 * kh) * kWarp + lane];
        const A d2 = sm[(2 * kh + 1) * kWarp + lane];
        const A mx = m[kh] > m2 ? m[kh] : m2;
        f0[kh] = mx == neg_inf<A>() ? A(1) : pfa_exp(m[kh] - mx);
        f1[kh] = mx == neg_inf<A>() ? A(1) : pfa_exp(m2 - mx);
        den[kh] = den[kh] * f0[kh] + d2 * f1[kh];
        m[kh] = mx;
      }
#pragma unroll
      for (int t = 0; t < S; ++t) {
        const int kh = head_slot<S, HEADS>(t);
#pragma unroll
        for (int k = 0; k < V; ++k)
          acc[t][k] = acc[t][k] * f0[kh] + sh[(t * V + k) * kWarp + lane] * f1[kh];
      }
    }
    __syncthreads();
  }
}

// Stores a lane's slots as accumulators (partials).
template <typename A, int S, int V>
__device__ __forceinline__ void store_part(A* __restrict__ row,
                                           const int64_t (&off)[S],
                                           const A (&x)[S][V]) {
#pragma unroll
  for (int t = 0; t < S; ++t) {
    if (off[t] < 0) continue;
#pragma unroll
    for (int k = 0; k < V; ++k) row[off[t] + k] = x[t][k];
  }
}

inline SplitPlan gatv2_split_plan() {
  return split_plan(kGatv2SplitEdges, kGatv2SplitChunk);
}

// Grid x of a row kernel with its window blocks.
inline unsigned split_grid_x(int64_t row_blocks, const SplitArgs& sp) {
  const int64_t bx = row_blocks + sp.nwin;
  PFA_CHECK(bx < (int64_t(1) << 31), "gatv2_attention: grid too large: ", bx);
  return static_cast<unsigned>(bx);
}

// Elements of a unit on aligned rows: 16 bytes of 32- and 64-bit floats, 8
// bytes of 16-bit ones, so that 16-bit rows get float32's lanes and
// registers (16-byte units would leave half of a warp idle at C = 32).
template <typename T>
constexpr int gatv2_vec() {
  return vec_width<T>() < 4 ? vec_width<T>() : 4;
}

// Layout and template choice for H heads of C channels, V elements a unit.
struct Gatv2Plan {
  Gatv2Layout L;
  int S;  // slots a lane: 1 (HEADS), 2, 4, 8 or 32 units of one head
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
  // One head a lane: heads beyond a tile's HS go to further tiles (grid y;
  // each walks the row's edges again), which costs less than the registers
  // of several heads a lane (benchmarks/RESULTS.md). A head wider than 32
  // units takes the fewest slots that hold its KC units a lane.
  L.KH = 1;
  P.S = L.KC == 1 ? 1 : L.KC <= 2 ? 2 : L.KC <= 4 ? 4 : L.KC <= 8 ? 8 : 32;
  L.tile_heads = HS * L.KH;
  L.n_tiles = static_cast<int>(ceil_div(std::max<int64_t>(H, 1), L.tile_heads));
  PFA_CHECK(L.n_tiles <= 65535, "gatv2_attention: too many heads: ", H);
  return P;
}

// Calls f(V, S, HEADS, ASYNC) with compile-time constants (ASYNC: async,
// which ring_stages allows only for one, two or four slots).
template <typename scalar_t, typename F>
inline void dispatch_plan(bool vec, const Gatv2Plan& P, bool async, F&& f) {
  constexpr int VW = gatv2_vec<scalar_t>();
  using no = std::false_type;
  auto with_v = [&](auto v) {
    if (P.S == 1)
      f(v, std::integral_constant<int, 1>(), std::true_type(), no());
    else if (P.S == 2)
      f(v, std::integral_constant<int, 2>(), std::false_type(), no());
    else if (P.S == 4)
      f(v, std::integral_constant<int, 4>(), std::false_type(), no());
    else if (P.S == 8)
      f(v, std::integral_constant<int, 8>(), std::false_type(), no());
    else
      f(v, std::integral_constant<int, 32>(), std::false_type(), no());
  };
  if constexpr (sizeof(scalar_t) <= 4) {
    if (async) {  // S is 1, 2 or 4 (ring_stages)
      using VC = std::integral_constant<int, VW>;
      using yes = std::true_type;
      if (P.S == 1)
        f(VC(), std::integral_constant<int, 1>(), yes(), yes());
      else if (P.S == 2)
        f(VC(), std::integral_constant<int, 2>(), no(), yes());
      else
        f(VC(), std::integral_constant<int, 4>(), no(), yes());
      return;
    }
  }
  if (vec)
    with_v(std::integral_constant<int, VW>());
  else
    with_v(std::integral_constant<int, 1>());
}

// Dynamic shared memory of a launch: the window blocks' merge space
// (merge_smem bytes, when there are windows) and, ASYNC, the rings after
// it (nu units and nf floats a stage). Over 48 KiB the kernel is allowed
// that much first.
template <int UB>
inline size_t launch_smem(size_t merge, bool windows, bool async, int ns,
                          int nu, int nf) {
  if (!async) return windows ? merge : 0;
  return ring_offset(merge) + Ring<UB>::block_bytes(ns, nu, nf);
}

template <typename K>
inline void allow_smem(K kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    C10_CUDA_CHECK(cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
        static_cast<int>(bytes)));
}

// Stages of the asynchronous gathers for a launch of the plan, 0 for none:
// one, two or four slots a lane on aligned rows of 32- or 16-bit floats, and
// gatv2_async() (default: float32 rows of a table of `rows` rows larger
// than the L2 cache); gatv2_stages() stages, or fewer (at least 2) where
// the block's rings (nu units a slot and nf floats a head slot a stage)
// would not fit the shared memory the device grants.
template <typename scalar_t>
inline int ring_stages(bool vec, const Gatv2Plan& P, int nu, int nf,
                       int64_t rows) {
  if (sizeof(scalar_t) > 4 || !vec || P.S > 4) return 0;
  const auto* prop = at::cuda::getCurrentDeviceProperties();
  const bool big = rows * P.L.H * P.L.C * static_cast<int64_t>(sizeof(scalar_t)) >
                   static_cast<int64_t>(prop->l2CacheSize);
  if (!gatv2_async(sizeof(scalar_t) == 4 && big)) return 0;
  using A = acc_t<scalar_t>;
  constexpr int VW = gatv2_vec<scalar_t>();
  constexpr int UB = static_cast<int>(sizeof(scalar_t)) * VW;
  const size_t merge = P.S == 1   ? merge_smem<A, 1, VW, 1>()
                       : P.S == 2 ? merge_smem<A, 2, VW, 1>()
                                  : merge_smem<A, 4, VW, 1>();
  const size_t limit = prop->sharedMemPerBlockOptin;
  for (int ns = gatv2_stages(); ns >= 2; --ns)
    if (launch_smem<UB>(merge, true, true, ns, nu * P.S, nf) <= limit)
      return ns;
  return 0;
}

// Launches kernel_of(V, S, HEADS, ASYNC) (a generic lambda returning the
// kernel for those compile-time constants) on `grid` with `args`, with the
// shared memory it needs: the merge space when the launch has window
// blocks, and the rings when stages > 0 (ring_stages of the same nu, nf).
// `stages` (the field of args the kernel reads) is lowered, to 2 at least,
// while the rings would cost resident blocks that the registers allow.
template <typename scalar_t, typename KernelOf, typename... Args>
inline void launch_plan(bool vec, const Gatv2Plan& P, dim3 grid, bool windows,
                        int& stages, int nu, int nf, KernelOf&& kernel_of,
                        const Args&... args) {
  using A = acc_t<scalar_t>;
  constexpr int VW = gatv2_vec<scalar_t>();
  constexpr int UB = static_cast<int>(sizeof(scalar_t)) * VW;
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_plan<scalar_t>(vec, P, stages > 0, [&](auto v, auto s, auto heads, auto as) {
    constexpr int kV = decltype(v)::value, kS = decltype(s)::value;
    constexpr bool kH = decltype(heads)::value, kA = decltype(as)::value;
    constexpr int NKH = Slots<kS, kH>::NKH;
    auto kernel = kernel_of(v, s, heads, as);
    auto smem_of = [&](int ns) {
      return launch_smem<UB>(merge_smem<A, kS, kV, NKH>(), windows, kA, ns,
                             nu * kS, nf * NKH);
    };
    if constexpr (kA) {
      static const int occ = blocks_per_sm(kernel);
      const auto* prop = at::cuda::getCurrentDeviceProperties();
      while (stages > 2 &&
             static_cast<size_t>(occ) *
                     (smem_of(stages) + prop->reservedSharedMemPerBlock) >
                 prop->sharedMemPerMultiprocessor)
        --stages;
    }
    const size_t smem = smem_of(stages);
    allow_smem(kernel, smem);
    kernel<<<grid, kBlock, smem, stream>>>(args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
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
  a.edge_term = opt_ptr<scalar_t>(edge_term);
  a.att = opt_ptr<scalar_t>(att);
  a.mask = opt_ptr<scalar_t>(mask);
  a.bias = opt_ptr<scalar_t>(bias);
  a.N = rowptr.numel() - 1;
  a.E = col.numel();
  a.Ns = x_l.size(0);
  a.slope = static_cast<acc_t<scalar_t>>(slope);
  return a;
}

// make_args of the transformer (DOT): x_l = key, x_r = query, values and
// the score's scale.
template <typename scalar_t, typename index_t>
Gatv2Args<scalar_t, index_t> make_dot_args(
    const at::Tensor& rowptr, const at::Tensor& col, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value,
    const at::Tensor& edge_term, const at::Tensor& mask, double scale) {
  auto a = make_args<scalar_t, index_t>(rowptr, col, key, query, edge_term,
                                        at::Tensor(), mask, at::Tensor(), 0.0);
  a.value = value.data_ptr<scalar_t>();
  a.scale = static_cast<acc_t<scalar_t>>(scale);
  return a;
}

// The backward's inputs besides make_args': the transpose, the forward's
// out and lse, and grad_out.
template <typename scalar_t, typename index_t>
void set_backward_inputs(Gatv2Args<scalar_t, index_t>& a,
                         const at::Tensor& colptr, const at::Tensor& csc_row,
                         const at::Tensor& csc_perm, const at::Tensor& fout,
                         const at::Tensor& lse, const at::Tensor& grad_out) {
  a.colptr = colptr.data_ptr<index_t>();
  a.csc_row = csc_row.data_ptr<index_t>();
  a.csc_perm = csc_perm.data_ptr<index_t>();
  a.fout = fout.data_ptr<scalar_t>();
  a.lse = lse.data_ptr<acc_t<scalar_t>>();
  a.grad_out = grad_out.data_ptr<scalar_t>();
}

inline bool all_aligned(std::initializer_list<const void*> ps) {
  for (const void* p : ps)
    if (p != nullptr && !aligned16(p)) return false;
  return true;
}

// Backward source pass (gatv2_cols.cuh): grad_x_l into a.g_l (DOT: grad
// key into a.g_l, grad value into a.g_v), long columns (a.spc) through
// a.part_c.
template <bool DOT, typename scalar_t, typename index_t>
void launch_bwd_cols(const Gatv2Args<scalar_t, index_t>& a, const Gatv2Plan& P,
                     bool vec);

}  // namespace gatv2
}  // namespace cuda
}  // namespace pyg_fastattn
