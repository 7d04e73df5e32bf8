// Backward source pass of gatv2_attention (DOT = false) and
// transformer_attention (DOT = true) over the transpose, and its launch;
// instantiated by gatv2_bwd_cols.cu and transformer_bwd_cols.cu.
#pragma once

#include "gatv2.cuh"

namespace pyg_fastattn {
namespace cuda {
namespace gatv2 {
namespace {

// Backward pass 2, by source over the transpose: grid (row_blocks +
// windows, head tiles); one warp per (source node j, head tile) of the row
// blocks (columns over spc.split are left to the window blocks). x_l[j] and
// att stay in registers; for each CSC entry k (destination i = csc_row[k],
// CSR position e = csc_perm[k]; gathers batched as in the forward) the lanes
// load x_r[i], grad_out[i] (and edge_term[e]), lse[i] and delta[i] (pass 1),
// recompute the score, alpha = exp(s - lse[i]), leaky'(z) and grad_s =
// alpha * (mask * <grad_out[i], x_l[j]> - delta[i]), and add alpha * mask *
// grad_out[i] + grad_s * att * leaky'(z) to their slots of grad_x_l[j],
// stored once at the end. Window blocks (split path, gatv2.cuh): each warp
// walks an eighth of a window part of a long column the same way; warp 0
// writes the part's sums (block_sum_slots), finished by split_sum_kernel.
// DOT: key[j] and value[j] stay in registers, the gathers are query[i],
// grad_out[i] (and edge_term[e]); grad_s (scaled) as in the destination
// pass; grad_key[j] += grad_s * query[i] and grad_value[j] += p *
// grad_out[i] (partials: grad key, then grad value, 2 * H * C a slot).
template <bool DOT, typename scalar_t, typename index_t, int V, int S,
          bool HEADS, bool ASYNC>
__global__ void __launch_bounds__(
    kBlock, !ASYNC || S > 1 ? 0
            : (!DOT && sizeof(scalar_t) == 4 ? kGatv2AsyncBlocksCols
                                             : kGatv2AsyncBlocksColsOther))
    gatv2_bwd_cols_kernel(Gatv2Args<scalar_t, index_t> a, Gatv2Layout L,
                          int64_t row_blocks) {
  using A = acc_t<scalar_t>;
  constexpr int NKH = Slots<S, HEADS>::NKH;
  extern __shared__ __align__(16) unsigned char smem[];
  const bool part = blockIdx.x >= row_blocks;  // block-uniform
  const int lane = lane_id();
  const int rank = static_cast<int>(threadIdx.x >> 5);
  const int H = L.H;
  const int64_t HC = static_cast<int64_t>(H) * L.C;
  const int64_t w = static_cast<int64_t>(blockIdx.x) - row_blocks;
  const Slots<S, HEADS> sl = decode<S, HEADS>(L, blockIdx.y, lane);
  A att[S][V];
  if (!DOT) load_row<scalar_t, S, V>(a.att, sl.off, att);
  for (int pq = 0; pq < (part ? 2 : 1); ++pq) {
    int64_t j, start, end;
    if (!part) {
      j = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + rank;
      if (j >= a.Ns) return;
      row_range(a.colptr, j, a.E, start, end);
      if (end - start > a.spc.split) return;  // long column: window blocks
    } else {
      int64_t s, t;
      if (!window_part(a.spc, a.colptr, a.E, w, pq, j, s, t)) continue;
      warp_part(s, t, rank, start, end);
    }
    A xl[S][V], gxl[S][V], vl[S][V], gvl[S][V];
    load_row<scalar_t, S, V>(a.x_l + j * HC, sl.off, xl);
    if (DOT) load_row<scalar_t, S, V>(a.value + j * HC, sl.off, vl);
#pragma unroll
    for (int t = 0; t < S; ++t)
#pragma unroll
      for (int k = 0; k < V; ++k) gxl[t][k] = gvl[t][k] = A(0);
    const bool has_et = a.edge_term != nullptr;
    // One CSC entry: x_r[i] (DOT: query[i]), grad_out[i], edge_term[e] and
    // the row's lse, delta and mask per head slot.
    auto edge = [&](const A (&xr)[S][V], const A (&go)[S][V],
                    const A (&et)[S][V], const A (&lb)[NKH],
                    const A (&db)[NKH], const A (&mb)[NKH]) {
      if (DOT) {
        A s[NKH], g[NKH], p[NKH], gs[NKH];
        dot_scores<A, S, V, HEADS, NKH>(xl, xr, et, has_et, a.scale, L.g_log,
                                        s);
        head_dots<A, S, V, HEADS, NKH>(go, vl, et, has_et, L.g_log, g);
#pragma unroll
        for (int kh = 0; kh < NKH; ++kh) {
          p[kh] = gs[kh] = A(0);
          if (sl.h[kh] >= 0 && has_weight(lb[kh])) {  // else no weight
            const A alpha = pfa_exp(s[kh] - lb[kh]);
            p[kh] = alpha * mb[kh];
            gs[kh] = alpha * (mb[kh] * g[kh] - db[kh]) * a.scale;
          }
        }
#pragma unroll
        for (int t = 0; t < S; ++t) {
          const int kh = head_slot<S, HEADS>(t);
#pragma unroll
          for (int k = 0; k < V; ++k) {
            gxl[t][k] += gs[kh] * xr[t][k];
            gvl[t][k] += p[kh] * go[t][k];
          }
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
      A p[NKH], gs[NKH];
#pragma unroll
      for (int kh = 0; kh < NKH; ++kh) {
        g[kh] = head_sum(g[kh], L.g_log);
        p[kh] = A(0);
        gs[kh] = A(0);
        if (sl.h[kh] >= 0 && has_weight(lb[kh])) {  // else no weight
          const A alpha = pfa_exp(s[kh] - lb[kh]);
          p[kh] = alpha * mb[kh];
          gs[kh] = alpha * (mb[kh] * g[kh] - db[kh]);
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
    };
    // mask of CSR position e for head slot kh
    auto mask_of = [&](int64_t e, int kh) {
      return sl.h[kh] >= 0 && a.mask != nullptr
                 ? to_acc(a.mask[e * H + sl.h[kh]]) : A(1);
    };
    if constexpr (ASYNC) {
      // Through the warp's ring: units x_r[i], grad_out[i] (and
      // edge_term[e]) of each slot, and floats lse[i] and delta[i] of each
      // head slot and (with a mask) the 4-byte word that holds mask[e, h],
      // since entries reach a column in random CSR order; the tag is e (-1:
      // skip). Index batches are loaded one batch ahead.
      constexpr int UB = static_cast<int>(sizeof(scalar_t)) * V;
      const bool has_mask = a.mask != nullptr;
      const Ring<UB> ring(smem + ring_offset(merge_smem<A, S, V, NKH>()), rank,
                          a.stages, (2 + (has_et ? 1 : 0)) * S,
                          (2 + (has_mask ? 1 : 0)) * NKH);
      const int64_t EH = a.E * H;
      const bool mask_pairs = (reinterpret_cast<uintptr_t>(a.mask) & 3) == 0;
      index_t ib = 0, eb = 0;
      index_t in = batch_load<index_t>(a.csc_row, start, end, lane);
      index_t en = batch_load<index_t>(a.csc_perm, start, end, lane);
      auto fetch = [&](int64_t q, int st) {
        const int kq = static_cast<int>((q - start) & (kWarp - 1));
        if (kq == 0) {
          ib = in;
          eb = en;
          in = batch_load<index_t>(a.csc_row, q + kWarp, end, lane);
          en = batch_load<index_t>(a.csc_perm, q + kWarp, end, lane);
        }
        const int64_t i = static_cast<int64_t>(__shfl_sync(kFullMask, ib, kq));
        const int64_t e = static_cast<int64_t>(__shfl_sync(kFullMask, eb, kq));
        const bool ok = i >= 0 && i < a.N && e >= 0 && e < a.E;
        *ring.tag(st, lane) = ok ? e : -1;
        if (!ok) return;  // warp-uniform
#pragma unroll
        for (int t = 0; t < S; ++t) {
          ring_copy<scalar_t, V>(ring.unit(st, t, lane), a.x_r + i * HC, sl.off[t]);
          ring_copy<scalar_t, V>(ring.unit(st, S + t, lane), a.grad_out + i * HC,
                                 sl.off[t]);
          if (has_et)
            ring_copy<scalar_t, V>(ring.unit(st, 2 * S + t, lane),
                                   a.edge_term + e * HC, sl.off[t]);
        }
#pragma unroll
        for (int kh = 0; kh < NKH; ++kh) {
          const int h = sl.h[kh];
          if (h < 0) continue;
          cp_async<4>(ring.flt(st, kh, lane), a.lse + i * H + h);
          cp_async<4>(ring.flt(st, NKH + kh, lane), a.delta + i * H + h);
          if (!has_mask) continue;
          const int64_t m = e * H + h;
          float* dst = ring.flt(st, 2 * NKH + kh, lane);
          if (sizeof(scalar_t) == 4) {
            cp_async<4>(dst, a.mask + m);
          } else if (mask_pairs && (m | 1) < EH) {  // the pair holding m
            cp_async<4>(dst, a.mask + (m & ~int64_t(1)));
          } else {  // a plain copy into the half the body reads
            reinterpret_cast<scalar_t*>(dst)[m & 1] = a.mask[m];
          }
        }
      };
      auto body = [&](int64_t, int st) {
        const int64_t e = *ring.tag(st, lane);
        if (e < 0) return;  // warp-uniform
        A xr[S][V], go[S][V], et[S][V], lb[NKH], db[NKH], mb[NKH];
#pragma unroll
        for (int t = 0; t < S; ++t) {
          ring_slot<scalar_t, V>(ring.unit(st, t, lane), sl.off[t], xr[t]);
          ring_slot<scalar_t, V>(ring.unit(st, S + t, lane), sl.off[t], go[t]);
          if (has_et)
            ring_slot<scalar_t, V>(ring.unit(st, 2 * S + t, lane), sl.off[t],
                                   et[t]);
        }
#pragma unroll
        for (int kh = 0; kh < NKH; ++kh) {
          const int h = sl.h[kh];
          lb[kh] = h >= 0 ? *ring.flt(st, kh, lane) : neg_inf<A>();
          db[kh] = h >= 0 ? *ring.flt(st, NKH + kh, lane) : A(0);
          mb[kh] = h >= 0 && has_mask
                       ? to_acc(reinterpret_cast<const scalar_t*>(
                             ring.flt(st, 2 * NKH + kh, lane))
                             [sizeof(scalar_t) == 4 ? 0 : (e * H + h) & 1])
                       : A(1);
        }
        edge(xr, go, et, lb, db, mb);
      };
      async_walk(ring.ns, start, end, fetch, body);
    } else {
      constexpr int B = kGatv2EdgeBatch;
      for (int64_t q0 = start, ib = 0, eb = 0; q0 < end; q0 += B) {
        const int kq = static_cast<int>((q0 - start) & (kWarp - 1));
        if (kq == 0) {
          ib = batch_load(a.csc_row, q0, end, lane);
          eb = batch_load(a.csc_perm, q0, end, lane);
        }
        int64_t iv[B];
        A xrb[B][S][V], gob[B][S][V], etb[B][S][V];
        A lb[B][NKH], db[B][NKH], mb[B][NKH];
#pragma unroll
        for (int b = 0; b < B; ++b) {  // issue the batch's gathers first
          iv[b] = __shfl_sync(kFullMask, ib, kq + b);  // -1 past end
          const int64_t e = __shfl_sync(kFullMask, eb, kq + b);
          if (iv[b] >= a.N || e < 0 || e >= a.E) iv[b] = -1;
          if (iv[b] < 0) continue;  // warp-uniform
          const int64_t i = iv[b];
          load_row<scalar_t, S, V>(a.x_r + i * HC, sl.off, xrb[b]);
          load_row<scalar_t, S, V>(a.grad_out + i * HC, sl.off, gob[b]);
          if (has_et) load_row<scalar_t, S, V>(a.edge_term + e * HC, sl.off, etb[b]);
#pragma unroll
          for (int kh = 0; kh < NKH; ++kh) {
            const bool ok = sl.h[kh] >= 0;
            lb[b][kh] = ok ? a.lse[i * H + sl.h[kh]] : neg_inf<A>();
            db[b][kh] = ok ? a.delta[i * H + sl.h[kh]] : A(0);
            mb[b][kh] = mask_of(e, kh);
          }
        }
#pragma unroll
        for (int b = 0; b < B; ++b)
          if (iv[b] >= 0)  // warp-uniform
            edge(xrb[b], gob[b], etb[b], lb[b], db[b], mb[b]);
      }
    }
    if (part) {
      const int64_t cw = DOT ? 2 * HC : HC;
      block_sum_slots<A, S, V>(gxl, reinterpret_cast<A*>(smem), rank);
      if (rank == 0) store_part<A, S, V>(a.part_c + (2 * w + pq) * cw, sl.off, gxl);
      if (DOT) {
        block_sum_slots<A, S, V>(gvl, reinterpret_cast<A*>(smem), rank);
        if (rank == 0)
          store_part<A, S, V>(a.part_c + (2 * w + pq) * cw + HC, sl.off, gvl);
      }
      continue;
    }
#pragma unroll
    for (int t = 0; t < S; ++t) store_slot<scalar_t, V>(a.g_l + j * HC, sl.off[t], gxl[t]);
    if (DOT) {
#pragma unroll
      for (int t = 0; t < S; ++t) store_slot<scalar_t, V>(a.g_v + j * HC, sl.off[t], gvl[t]);
    }
  }
}

}  // namespace

template <bool DOT, typename scalar_t, typename index_t>
void launch_bwd_cols(const Gatv2Args<scalar_t, index_t>& a, const Gatv2Plan& P,
                     bool vec) {
  const int64_t row_blocks = ceil_div(a.Ns, kWarpsPerBlock);
  Gatv2Args<scalar_t, index_t> c = a;  // its own ring stages
  const int nu = 2 + (a.edge_term != nullptr), nf = 2 + (a.mask != nullptr);
  c.stages = ring_stages<scalar_t>(vec, P, nu, nf, a.N);
  launch_plan<scalar_t>(
      vec, P, dim3(split_grid_x(row_blocks, a.spc), P.L.n_tiles),
      a.spc.nwin > 0, c.stages, nu, nf,
      [](auto v, auto s, auto heads, auto as) {
        return gatv2_bwd_cols_kernel<DOT, scalar_t, index_t, decltype(v)::value,
                                     decltype(s)::value, decltype(heads)::value,
                                     decltype(as)::value>;
      },
      c, P.L, row_blocks);
}

#define PFA_GATV2_COLS(DOT, T)                                               \
  template void launch_bwd_cols<DOT, T, int32_t>(                            \
      const Gatv2Args<T, int32_t>&, const Gatv2Plan&, bool);                 \
  template void launch_bwd_cols<DOT, T, int64_t>(                            \
      const Gatv2Args<T, int64_t>&, const Gatv2Plan&, bool);
#define PFA_GATV2_COLS_ALL(DOT)                                              \
  PFA_GATV2_COLS(DOT, float)                                                 \
  PFA_GATV2_COLS(DOT, double)                                                \
  PFA_GATV2_COLS(DOT, c10::Half)                                             \
  PFA_GATV2_COLS(DOT, c10::BFloat16)

}  // namespace gatv2
}  // namespace cuda
}  // namespace pyg_fastattn
