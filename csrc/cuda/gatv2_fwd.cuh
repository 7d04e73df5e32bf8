// Forward kernel of gatv2_attention (DOT = false) and transformer_attention
// (DOT = true), and its host launch (gatv2.cuh for the layout).
#pragma once

#include "gatv2.cuh"

namespace pyg_fastattn {
namespace cuda {
namespace gatv2 {
namespace {

// Forward: grid (row_blocks + windows, head tiles). Row blocks: one warp per
// destination row (rows over sp.split are left to the window blocks). The
// warp reads the row's col indices 32 at a time (one coalesced load, handed
// out by shuffle) and walks the edges in batches of kGatv2EdgeBatch: its
// lanes first load x_l[j] (DOT: key[j] and value[j]; and edge_term[e]) of
// the batch's edges for their slots, then per edge form the score with
// x_r[i] (kept in registers, as att): att . leaky(z) (DOT: scale *
// <query[i], key[j] + edge_term[e]>) reduced per head over the G lanes of
// the head, update the head's online softmax (max m, sum den) and rescale /
// accumulate p * mask * x_l[j] (DOT: value[j] + edge_term[e]) into their
// slots. At the end each lane stores its slots of out = acc / den + bias
// (empty rows: the bias) and lane cl = 0 of a head the row's lse. Window
// blocks (split path, gatv2.cuh): each warp walks an eighth of a window
// part of a long row the same way; the 8 states are merged
// (block_merge_softmax) and warp 0 writes the part's (m, den) and
// unnormalized sums, finished by split_softmax_combine_kernel.
template <bool DOT, typename scalar_t, typename index_t, int V, int S,
          bool HEADS, bool ASYNC>
__global__ void __launch_bounds__(kBlock)
    gatv2_fwd_kernel(Gatv2Args<scalar_t, index_t> a, Gatv2Layout L,
                     int64_t row_blocks) {
  using A = acc_t<scalar_t>;
  constexpr int NKH = Slots<S, HEADS>::NKH;
  extern __shared__ __align__(16) unsigned char smem[];
  const bool part = blockIdx.x >= row_blocks;  // block-uniform
  const int lane = lane_id();
  const int rank = static_cast<int>(threadIdx.x >> 5);
  const Slots<S, HEADS> sl = decode<S, HEADS>(L, blockIdx.y, lane);
  const int64_t HC = static_cast<int64_t>(L.H) * L.C;
  const int H = L.H;
  const int64_t w = static_cast<int64_t>(blockIdx.x) - row_blocks;
  A att[S][V];
  if (!DOT) load_row<scalar_t, S, V>(a.att, sl.off, att);
  for (int q = 0; q < (part ? 2 : 1); ++q) {
    int64_t i, start, end;
    if (!part) {
      i = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + rank;
      if (i >= a.N) return;  // whole warps leave
      row_range(a.rowptr, i, a.E, start, end);
      if (end - start > a.sp.split) return;  // long row: window blocks
    } else {
      int64_t s, t;
      if (!window_part(a.sp, a.rowptr, a.E, w, q, i, s, t)) continue;
      warp_part(s, t, rank, start, end);
    }
    A xr[S][V], acc[S][V];
    load_row<scalar_t, S, V>(a.x_r + i * HC, sl.off, xr);
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
    const bool has_et = a.edge_term != nullptr;
    auto edge = [&](int64_t e, const A (&xl)[S][V], const A (&vv)[S][V],
                    const A (&et)[S][V]) {
      A s[NKH];
      if (DOT) {
        dot_scores<A, S, V, HEADS, NKH>(xl, xr, et, has_et, a.scale, L.g_log,
                                        s);
      } else {
        A z[S][V];
        edge_z<A, S, V, HEADS>(xl, xr, et, has_et, z);
        head_scores<A, S, V, HEADS, NKH>(z, att, a.slope, L.g_log, s);
      }
      A scale[NKH], wt[NKH];
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
        wt[kh] = p;
      }
#pragma unroll
      for (int t = 0; t < S; ++t) {
        const int kh = head_slot<S, HEADS>(t);
#pragma unroll
        for (int k = 0; k < V; ++k) {
          const A x = !DOT ? xl[t][k] : (has_et ? vv[t][k] + et[t][k] : vv[t][k]);
          acc[t][k] = acc[t][k] * scale[kh] + wt[kh] * x;
        }
      }
    };
    walk_sources<ASYNC, DOT, V>(a, sl.off, HC, start, end, lane, rank, has_et,
                             smem + ring_offset(merge_smem<A, S, V, NKH>()),
                             edge, [](int64_t) {});
    const bool lead = (lane & ((1 << L.g_log) - 1)) == 0;
    if (part) {
      block_merge_softmax<A, S, V, HEADS, NKH>(m, den, acc,
                                               reinterpret_cast<A*>(smem), rank);
      if (rank == 0) {
        const int64_t slot = 2 * w + q;
#pragma unroll
        for (int kh = 0; kh < NKH; ++kh)
          if (sl.h[kh] >= 0 && lead) {
            a.part_ms[(slot * H + sl.h[kh]) * 2] = m[kh];
            a.part_ms[(slot * H + sl.h[kh]) * 2 + 1] = den[kh];
          }
        store_part<A, S, V>(a.part_acc + slot * HC, sl.off, acc);
      }
      continue;
    }
#pragma unroll
    for (int kh = 0; kh < NKH; ++kh) {
      online_finish(m[kh], den[kh]);  // a +inf score makes the row NaN
      if (sl.h[kh] >= 0 && lead)
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
}

// Host: the forward of `a` (inputs, out, lse_out set) for H heads of C
// channels, `vec`: aligned rows in gatv2_vec units; long rows through the
// split path (none when max_row_len, the longest row or -1, is at most the
// threshold).
template <bool DOT, typename scalar_t, typename index_t>
void run_forward(Gatv2Args<scalar_t, index_t>& a, int64_t H, int64_t C,
                 bool vec, const at::TensorOptions& opts,
                 int64_t max_row_len) {
  using A = acc_t<scalar_t>;
  constexpr int VW = gatv2_vec<scalar_t>();
  const Gatv2Plan P = make_plan(H, C, vec ? VW : 1);
  at::Tensor win, part;
  a.sp = make_split(a.rowptr, a.N, a.E, opts, win, gatv2_split_plan(),
                    max_row_len);
  if (a.sp.nwin > 0) {
    part = at::empty({2 * a.sp.nwin, H * C + 2 * H},
                     opts.dtype(c10::CppTypeToScalarType<A>::value));
    a.part_acc = part.data_ptr<A>();
    a.part_ms = a.part_acc + 2 * a.sp.nwin * H * C;
  }
  const int64_t row_blocks = ceil_div(a.N, kWarpsPerBlock);
  const dim3 grid(split_grid_x(row_blocks, a.sp),
                  static_cast<unsigned>(P.L.n_tiles));
  const int nu = 1 + DOT + (a.edge_term != nullptr);
  a.stages = ring_stages<scalar_t>(vec, P, nu, 0, a.Ns);
  launch_plan<scalar_t>(
      vec, P, grid, a.sp.nwin > 0, a.stages, nu, 0,
      [](auto v, auto s, auto heads, auto as) {
        return gatv2_fwd_kernel<DOT, scalar_t, index_t, decltype(v)::value,
                                decltype(s)::value, decltype(heads)::value,
                                decltype(as)::value>;
      },
      a, P.L, row_blocks);
  launch_split_softmax_combine<scalar_t, index_t>(
      a.sp, a.rowptr, a.E, a.part_acc, a.part_ms, a.bias, H, C, a.out,
      a.lse_out);
}

}  // namespace
}  // namespace gatv2
}  // namespace cuda
}  // namespace pyg_fastattn
