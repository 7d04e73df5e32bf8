// Backward destination pass of gatv2_attention (DOT = false) and
// transformer_attention (DOT = true), and the host side of both backwards
// (gatv2.cuh for the layout; the source pass is in gatv2_cols.cuh).
#pragma once

#include "gatv2.cuh"

namespace pyg_fastattn {
namespace cuda {
namespace gatv2 {
namespace {

// Backward pass 1, by destination row: grid (row_blocks + windows, head
// tiles), row_blocks at most kGatv2CudaBwdBlocks; warp w of the row blocks
// takes rows w, w + W, w + 2W, ... (W warps; rows over sp.split are left to
// the window blocks). Per row it keeps x_r[i], grad_out[i] and
// delta = <grad_out[i], out[i] - bias> per head (stored for the source
// pass); per edge (gathers batched as in the forward) it reduces s and
// g = <grad_out[i], x_l[j]> per head, forms grad_s = alpha * (mask * g -
// delta), writes grad_z = grad_s * att * leaky'(z) to grad_edge_term[e] and
// adds it into the row's grad_x_r, and adds grad_s * leaky(z) to the lane's
// grad_att slots. Each warp stores its
// grad_att partial row (fixed warp -> rows map, summed later in warp order).
// DOT: x_r is query[i], the gathers are key[j] and value[j]; per edge
// g = <grad_out[i], value[j] + edge_term[e]>, grad_s as above (scaled),
// grad_query[i] += grad_s * (key[j] + edge_term[e]) and grad_edge_term[e] =
// grad_s * query[i] + p * grad_out[i]; no grad_att.
// Window blocks (split path, gatv2.cuh): each warp walks an eighth of a
// window part of a long row the same way; warp 0 writes the part's grad_x_r
// sums (block_sum_slots; finished by split_sum_kernel) and, at the end, the
// block's grad_att partial row. Positions outside every row of
// grad_edge_term are zeroed by a grid-stride loop of the row blocks.
template <bool DOT, typename scalar_t, typename index_t, int V, int S,
          bool HEADS, bool ASYNC>
__global__ void __launch_bounds__(kBlock,
                                  ASYNC && S == 1 ? kGatv2AsyncBlocksRows : 0)
    gatv2_bwd_rows_kernel(Gatv2Args<scalar_t, index_t> a, Gatv2Layout L,
                          int64_t row_blocks) {
  using A = acc_t<scalar_t>;
  constexpr int NKH = Slots<S, HEADS>::NKH;
  extern __shared__ __align__(16) unsigned char smem[];
  const bool part = blockIdx.x >= row_blocks;  // block-uniform
  const int lane = lane_id();
  const int rank = static_cast<int>(threadIdx.x >> 5);
  const int H = L.H;
  const int64_t HC = static_cast<int64_t>(H) * L.C;
  const int64_t warp = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + rank;
  const int64_t W = row_blocks * kWarpsPerBlock;
  const int64_t w = static_cast<int64_t>(blockIdx.x) - row_blocks;
  if (!part && a.g_e != nullptr && blockIdx.y == 0) {  // outside every row
    const int64_t first = tail_begin(a.rowptr, 0, a.E);
    const int64_t last = tail_begin(a.rowptr, a.N, a.E);
    const int64_t stride = row_blocks * blockDim.x;
    const int64_t t0 = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    for (int64_t k = t0; k < first * HC; k += stride) a.g_e[k] = scalar_t(0.0f);
    for (int64_t k = last * HC + t0; k < a.E * HC; k += stride)
      a.g_e[k] = scalar_t(0.0f);
  }
  const Slots<S, HEADS> sl = decode<S, HEADS>(L, blockIdx.y, lane);
  const bool lead = (lane & ((1 << L.g_log) - 1)) == 0;
  A att[S][V], gatt[S][V];
  if (!DOT) load_row<scalar_t, S, V>(a.att, sl.off, att);
#pragma unroll
  for (int t = 0; t < S; ++t)
#pragma unroll
    for (int k = 0; k < V; ++k) gatt[t][k] = A(0);
  for (int64_t it = part ? 0 : warp;;) {
    int64_t i, start, end;
    if (!part) {
      if (it >= a.N) break;
      i = it;
      it += W;
      row_range(a.rowptr, i, a.E, start, end);
      if (end - start > a.sp.split) continue;  // long row: window blocks
    } else {
      if (it >= 2) break;
      int64_t s, t;
      if (!window_part(a.sp, a.rowptr, a.E, w, static_cast<int>(it++), i, s, t))
        continue;
      warp_part(s, t, rank, start, end);
    }
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
      if (lead && sl.h[kh] >= 0 && (!part || rank == 0))
        a.delta[i * H + sl.h[kh]] = delta[kh];  // for the source pass
    }
#pragma unroll
    for (int t = 0; t < S; ++t)
#pragma unroll
      for (int k = 0; k < V; ++k) gxr[t][k] = A(0);
    const bool has_et = a.edge_term != nullptr;
    auto skip = [&](int64_t e) {  // no weight: zero outputs
      if (a.g_e != nullptr) {
        A zero[V];
#pragma unroll
        for (int k = 0; k < V; ++k) zero[k] = A(0);
#pragma unroll
        for (int t = 0; t < S; ++t)
          store_slot<scalar_t, V>(a.g_e + e * HC, sl.off[t], zero);
      }
    };
    auto edge = [&](int64_t e, const A (&xl)[S][V], const A (&vv)[S][V],
                    const A (&et)[S][V]) {
      if (DOT) {
        A s[NKH], g[NKH];
        dot_scores<A, S, V, HEADS, NKH>(xl, xr, et, has_et, a.scale, L.g_log,
                                        s);
        head_dots<A, S, V, HEADS, NKH>(go, vv, et, has_et, L.g_log, g);
        A gs[NKH], p[NKH];
#pragma unroll
        for (int kh = 0; kh < NKH; ++kh) {
          gs[kh] = p[kh] = A(0);
          if (sl.h[kh] >= 0 && has_weight(lse[kh])) {  // else no weight
            const A alpha = pfa_exp(s[kh] - lse[kh]);
            const A mk = a.mask != nullptr ? to_acc(a.mask[e * H + sl.h[kh]]) : A(1);
            p[kh] = alpha * mk;
            gs[kh] = alpha * (mk * g[kh] - delta[kh]) * a.scale;
          }
        }
#pragma unroll
        for (int t = 0; t < S; ++t) {
          const int kh = head_slot<S, HEADS>(t);
          A ge[V];
#pragma unroll
          for (int k = 0; k < V; ++k) {
            const A kp = has_et ? xl[t][k] + et[t][k] : xl[t][k];
            gxr[t][k] += gs[kh] * kp;
            ge[k] = gs[kh] * xr[t][k] + p[kh] * go[t][k];
          }
          if (a.g_e != nullptr) store_slot<scalar_t, V>(a.g_e + e * HC, sl.off[t], ge);
        }
        return;
      }
      A z[S][V], s[NKH], g[NKH];
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
        if (sl.h[kh] >= 0 && has_weight(lse[kh])) {  // else no weight
          const A alpha = pfa_exp(s[kh] - lse[kh]);
          const A mk = a.mask != nullptr ? to_acc(a.mask[e * H + sl.h[kh]]) : A(1);
          gs[kh] = alpha * (mk * g[kh] - delta[kh]);
        }
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
    };
    walk_sources<ASYNC, DOT, V>(a, sl.off, HC, start, end, lane, rank, has_et,
                             smem + ring_offset(merge_smem<A, S, V, NKH>()),
                             edge, skip);
    if (part) {
      block_sum_slots<A, S, V>(gxr, reinterpret_cast<A*>(smem), rank);
      if (rank == 0)
        store_part<A, S, V>(a.part_acc + (it - 1 + 2 * w) * HC, sl.off, gxr);
      continue;
    }
#pragma unroll
    for (int t = 0; t < S; ++t) store_slot<scalar_t, V>(a.g_r + i * HC, sl.off[t], gxr[t]);
  }
  if (DOT) return;
  if (part) {  // one grad_att row per window block, after the row blocks'
    block_sum_slots<A, S, V>(gatt, reinterpret_cast<A*>(smem), rank);
    if (rank == 0) store_part<A, S, V>(a.att_partial + (W + w) * HC, sl.off, gatt);
  } else {
    store_part<A, S, V>(a.att_partial + warp * HC, sl.off, gatt);
  }
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

// Host: the backward of `a` (inputs, fout, lse, grad_out and the gradient
// outputs set; transpose in colptr/csc_row/csc_perm) for H heads of C
// channels. Not DOT: grad_att into g_att. max_row_len / max_col_len: the
// longest row / column or -1 (no split path when at most the threshold).
template <bool DOT, typename scalar_t, typename index_t>
void run_backward(Gatv2Args<scalar_t, index_t>& a, int64_t H, int64_t C,
                  bool vec, const at::TensorOptions& opts, at::Tensor* g_att,
                  int64_t max_row_len, int64_t max_col_len) {
  using A = acc_t<scalar_t>;
  const int64_t N = a.N, E = a.E, Ns = a.Ns, HC = H * C;
  const auto acc_opts = opts.dtype(c10::CppTypeToScalarType<A>::value);
  at::Tensor delta = at::empty({N, H}, acc_opts);
  a.delta = delta.data_ptr<A>();
  const int64_t row_blocks = std::min<int64_t>(kGatv2CudaBwdBlocks,
                                               ceil_div(N, kWarpsPerBlock));
  at::Tensor win, winc, part, partc, partial;
  a.sp = make_split(a.rowptr, N, E, opts, win, gatv2_split_plan(),
                    max_row_len);
  a.spc = make_split(a.colptr, Ns, E, opts, winc, gatv2_split_plan(),
                     max_col_len);
  const int64_t cw = DOT ? 2 * HC : HC;  // source pass partial width
  if (a.sp.nwin > 0) {
    part = at::empty({2 * a.sp.nwin, HC}, acc_opts);
    a.part_acc = part.data_ptr<A>();
  }
  if (a.spc.nwin > 0) {
    partc = at::empty({2 * a.spc.nwin, cw}, acc_opts);
    a.part_c = partc.data_ptr<A>();
  }
  // grad_att partials: one per row-block warp, then one per window block
  const int64_t warps = row_blocks * kWarpsPerBlock + a.sp.nwin;
  if (!DOT) {
    partial = at::empty({warps, HC}, acc_opts);
    a.att_partial = partial.data_ptr<A>();
  }
  constexpr int VW = gatv2_vec<scalar_t>();
  const Gatv2Plan P = make_plan(H, C, vec ? VW : 1);
  const int nu = 1 + DOT + (a.edge_term != nullptr);
  a.stages = ring_stages<scalar_t>(vec, P, nu, 0, a.Ns);
  launch_plan<scalar_t>(
      vec, P, dim3(split_grid_x(row_blocks, a.sp), P.L.n_tiles),
      a.sp.nwin > 0, a.stages, nu, 0,
      [](auto v, auto s, auto heads, auto as) {
        return gatv2_bwd_rows_kernel<DOT, scalar_t, index_t, decltype(v)::value,
                                     decltype(s)::value, decltype(heads)::value,
                                     decltype(as)::value>;
      },
      a, P.L, row_blocks);
  launch_split_sum<scalar_t, index_t>(a.sp, a.rowptr, E, a.part_acc, HC, HC,
                                      a.g_r);
  if (Ns > 0) {
    launch_bwd_cols<DOT, scalar_t, index_t>(a, P, vec);
    launch_split_sum<scalar_t, index_t>(a.spc, a.colptr, E, a.part_c, cw, HC,
                                        a.g_l, DOT ? a.g_v : nullptr);
  }
  if (DOT) return;
  auto stream = at::cuda::getCurrentCUDAStream();
  // grad_att: the partials summed in warp order, in two steps. The row-block
  // warps' rows and the window blocks' rows are chunked apart, so that the
  // grouping of the first does not depend on the number of windows (a
  // window without a long row adds a zero row: the same sum bit for bit).
  constexpr int64_t kChunks = 64;
  const int64_t row_warps = warps - a.sp.nwin;
  const int64_t per_chunk = ceil_div(row_warps, kChunks);
  const int64_t row_chunks = ceil_div(row_warps, per_chunk);
  const int64_t win_per_chunk = std::max<int64_t>(1, ceil_div(a.sp.nwin, kChunks));
  const int64_t win_chunks = ceil_div(a.sp.nwin, win_per_chunk);
  const int64_t chunks = row_chunks + win_chunks;
  at::Tensor mid = at::empty({chunks, HC}, acc_opts);
  const unsigned col_blocks = static_cast<unsigned>(ceil_div(HC, kWarp));
  gatv2_sum_rows_kernel<A, A>
      <<<dim3(col_blocks, static_cast<unsigned>(row_chunks)), kBlock, 0,
         stream>>>(a.att_partial, row_warps, HC, per_chunk, mid.data_ptr<A>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (win_chunks > 0) {
    gatv2_sum_rows_kernel<A, A>
        <<<dim3(col_blocks, static_cast<unsigned>(win_chunks)), kBlock, 0,
           stream>>>(a.att_partial + row_warps * HC, a.sp.nwin, HC,
                     win_per_chunk, mid.data_ptr<A>() + row_chunks * HC);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  gatv2_sum_rows_kernel<A, scalar_t>
      <<<dim3(col_blocks, 1), kBlock, 0, stream>>>(
          mid.data_ptr<A>(), chunks, HC, chunks, g_att->data_ptr<scalar_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace gatv2
}  // namespace cuda
}  // namespace pyg_fastattn
