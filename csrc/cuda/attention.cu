// attention on CUDA: fused GAT score, row softmax and aggregation (the
// forward; attention_backward.cu has the per-edge gradients).
#include "attention.cuh"

namespace pyg_fastattn {
namespace cuda {
namespace {


// The score of edge e = (j -> i), head h: z = a_src[j, h] + a_dst[i, h] +
// a_edge[e, h] (absent terms 0), summed in the reference's order from 0.
template <typename A>
__device__ __forceinline__ A score_z(bool has_src, A zs, A adst, bool has_edge,
                                     A ze) {
  A z = A(0);
  if (has_src) z += zs;
  z += adst;
  if (has_edge) z += ze;
  return z;
}

// Which per-edge terms a forward kernel reads, fixed at compile time for the
// common cases so that an edge's work has no branches on absent tensors
// (each check, and each load behind one, is paid per edge and head):
// kFwdAny checks every pointer at run time; kFwdSrc has a_src and neither
// a_edge nor mask (GAT); kFwdEdge has a_edge and neither a_src nor mask
// (softmax_aggregate). a_dst is read once per row and checked at run time.
enum FwdTerms { kFwdAny = 0, kFwdSrc = 1, kFwdEdge = 2 };

template <int TERMS>
struct FwdHas {
  template <typename P>
  __device__ __forceinline__ static bool src(const P* p) {
    return TERMS == kFwdAny ? p != nullptr : TERMS == kFwdSrc;
  }
  template <typename P>
  __device__ __forceinline__ static bool edge(const P* p) {
    return TERMS == kFwdAny ? p != nullptr : TERMS == kFwdEdge;
  }
  template <typename P>
  __device__ __forceinline__ static bool mask(const P* p) {
    return TERMS == kFwdAny && p != nullptr;
  }
};

// Forward edge weights: p = softmax(s)[e, h] * mask[e, h], for a batch of
// EB edges: every load of the batch is issued before the first is used.
// OWN < EB (LH >= EB / OWN lanes a head): lane cl computes the weights of
// edges b = (cl % STRIDE) + STRIDE*m only, and the head's lanes take them
// from their owners by shuffles.
template <typename scalar_t, int TERMS, int OWN>
struct AttnFwdWeight {
  using A = acc_t<scalar_t>;
  using Has = FwdHas<TERMS>;
  const scalar_t* __restrict__ a_src;
  const scalar_t* __restrict__ a_edge;
  const scalar_t* __restrict__ mask;
  int H;
  A slope;
  int h;
  A adst, m, s, inv;
  __device__ __forceinline__ int64_t edge_aux(int64_t, bool) const { return 0; }
  __device__ __forceinline__ bool edge_ok(int64_t) const { return true; }
  template <int EB>
  __device__ __forceinline__ void weights(const LaneTile& T,
                                          const int64_t (&e)[EB],
                                          const int64_t (&j)[EB],
                                          const int64_t (&)[EB],
                                          const bool (&ok)[EB],
                                          A (&w)[EB]) const {
    const bool has_src = Has::src(a_src), has_edge = Has::edge(a_edge),
               has_mask = Has::mask(mask);
    if constexpr (OWN < EB) {
      static_assert(EB % OWN == 0, "OWN divides the batch");
      constexpr int STRIDE = EB / OWN;
      const int own0 = T.cl & (STRIDE - 1);
      int64_t jo[OWN], eo[OWN];
      bool use[OWN];
#pragma unroll
      for (int q = 0; q < OWN; ++q) {
        jo[q] = owned<STRIDE>(j, own0, q);
        eo[q] = owned<STRIDE>(e, own0, q);
        use[q] = owned<STRIDE>(ok, own0, q) && T.hok;
      }
      A zs[OWN], ze[OWN], mk[OWN], al[OWN];
#pragma unroll
      for (int q = 0; q < OWN; ++q) {
        zs[q] = (has_src && use[q]) ? to_acc(a_src[jo[q] * H + h]) : A(0);
        ze[q] = (has_edge && use[q]) ? to_acc(a_edge[eo[q] * H + h]) : A(0);
        mk[q] = (has_mask && use[q]) ? to_acc(mask[eo[q] * H + h]) : A(1);
      }
#pragma unroll
      for (int q = 0; q < OWN; ++q) {
        const A z = score_z(has_src, zs[q], adst, has_edge, ze[q]);
        al[q] = softmax_weight(leaky(z, slope), m, s, inv);
        if (has_mask) al[q] *= mk[q];
      }
      const int gbase = lane_id() & ~(T.LH - 1);
#pragma unroll
      for (int b = 0; b < EB; ++b) w[b] = from_owner<STRIDE>(al, b, gbase);
      return;
    }
    A zs[EB], ze[EB], mk[EB];
#pragma unroll
    for (int b = 0; b < EB; ++b) {
      const bool use = ok[b] && T.uok;
      zs[b] = (has_src && use) ? to_acc(a_src[j[b] * H + h]) : A(0);
      ze[b] = (has_edge && use) ? to_acc(a_edge[e[b] * H + h]) : A(0);
      mk[b] = (has_mask && use) ? to_acc(mask[e[b] * H + h]) : A(1);
    }
#pragma unroll
    for (int b = 0; b < EB; ++b) {
      const A z = score_z(has_src, zs[b], adst, has_edge, ze[b]);
      A al = softmax_weight(leaky(z, slope), m, s, inv);
      if (has_mask) al *= mk[b];
      w[b] = al;
    }
  }
};

// One warp per (row, feature tile) (TileLayout: lane = (es, hs, cl), a lane
// owns head hs and its unit cl).
// Pass 1: per-head online max / sum of the scores; for each of its heads a
//   lane takes edges (es * LH + cl) + ES*LH*k, so the row's (edge, head)
//   pairs are split over all 32 lanes (a_edge loads issued with the col
//   loads, not after them); merged over the cl and es lane bits.
// Pass 2: gather_accumulate (aggregate.cuh) with w = alpha * mask (OWN < EB:
//   computed by owner lanes, AttnFwdWeight): lane
//   (es, hs, cl) walks edges es + ES*k and accumulates its 16-byte unit of
//   values[col[e]] of its head; the ES edge slots are summed with
//   shuffles; slot 0 stores them plus bias. Channel tile 0 also writes lse.
// Rows with more than coop_edges(...) edges are shared by the 8 warps of the
// block: edges interleaved over the warps, statistics and partial sums
// combined in shared memory in a fixed order. Rows over the split threshold
// are left to attention_fwd_part_kernel / split_softmax_combine_kernel.
//
// Edges [start, end) of row `row` (the whole row, or with PARTIAL one window
// part of a long row, whose unnormalized sums and statistics go to slot
// `slot` of the partials), processed by warp `rank` of `nranks`.
template <bool PARTIAL, typename scalar_t, typename index_t, int V, int TERMS,
          int OWN>
__device__ __forceinline__ void fwd_row(const AttnArgs<scalar_t, index_t>& a,
                                        const TileLayout& L, int64_t row,
                                        int64_t start, int64_t end, int rank,
                                        int nranks, acc_t<scalar_t>* s_m,
                                        acc_t<scalar_t>* s_s,
                                        acc_t<scalar_t>* s_red, int64_t slot) {
  using A = acc_t<scalar_t>;
  constexpr int U = 4;  // pass-1 edges in flight per lane
  const int H = L.H;
  const int64_t D = static_cast<int64_t>(H) * L.C;
  const int lane = lane_id();
  const LaneTile T = decode_tile(L, V, row, static_cast<int>(blockIdx.y), lane);
  const int64_t i = T.row;

  using Has = FwdHas<TERMS>;
  const bool has_src = Has::src(a.a_src), has_edge = Has::edge(a.a_edge);
  AttnFwdWeight<scalar_t, TERMS, OWN> fn;
  fn.a_src = a.a_src;
  fn.a_edge = a.a_edge;
  fn.mask = a.mask;
  fn.H = H;
  fn.slope = a.slope;
  fn.h = T.h;
  fn.adst = (a.a_dst != nullptr && T.hok) ? to_acc(a.a_dst[i * H + T.h]) : A(0);
  fn.m = neg_inf<A>();
  fn.s = A(0);

  // ---- pass 1
  const int64_t nslots = static_cast<int64_t>(T.ES) * T.LH;
  const int64_t stride = nslots * nranks;
  const int64_t first = start + rank * nslots + T.es * T.LH + T.cl;
  const auto slim = index_limit<index_t>(a.Ns);
  for (int64_t e0 = first; e0 < end; e0 += stride * U) {
    int64_t e[U], j[U];
    bool ok[U];
    A ae[U], as[U];
    // every load of the batch is issued before the first is used
#pragma unroll
    for (int u = 0; u < U; ++u) {
      e[u] = e0 + u * stride;
      const bool in = e[u] < end;
      const index_t c = in ? a.col[e[u]] : index_t(0);
      j[u] = static_cast<int64_t>(c);
      // a_edge does not wait for col
      ae[u] = (in && has_edge && T.hok) ? to_acc(a.a_edge[e[u] * H + T.h])
                                        : A(0);
      ok[u] = in && index_in(c, slim);
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      as[u] = (has_src && ok[u] && T.hok) ? to_acc(a.a_src[j[u] * H + T.h])
                                          : A(0);
    A x[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const A z = score_z(has_src, as[u], fn.adst, has_edge, ae[u]);
      x[u] = (ok[u] && T.hok) ? leaky(z, a.slope) : neg_inf<A>();
    }
#pragma unroll
    for (int u = 0; u < U; ++u) online_add(fn.m, fn.s, x[u]);
  }
  for (int off = 1; off < kWarp; off <<= 1) {
    if (off < T.LH || off >= T.LH * T.HS) {  // cl and es bits
      const A m2 = __shfl_xor_sync(kFullMask, fn.m, off);
      const A s2 = __shfl_xor_sync(kFullMask, fn.s, off);
      online_merge(fn.m, fn.s, m2, s2);
    }
  }
  // A merge rounds in its own lane's order (s * e + s2 * e2 becomes an
  // fma), so a head's lanes may end with sums a rounding apart: all take
  // the state of the head's first lane (cl = es = 0, the one that writes
  // lse), so that an edge's weight does not depend on the lane that
  // computes it (owner lanes).
  {
    const int head0 = lane & (T.LH * T.HS - 1) & ~(T.LH - 1);
    fn.m = __shfl_sync(kFullMask, fn.m, head0);
    fn.s = __shfl_sync(kFullMask, fn.s, head0);
  }
  if (nranks > 1) {  // merge over the block's warps, same order everywhere
    s_m[rank * kWarp + lane] = fn.m;
    s_s[rank * kWarp + lane] = fn.s;
    __syncthreads();
    fn.m = s_m[lane];
    fn.s = s_s[lane];
    for (int r = 1; r < nranks; ++r)
      online_merge(fn.m, fn.s, s_m[r * kWarp + lane], s_s[r * kWarp + lane]);
    __syncthreads();
  }
  {
    const bool w0 = rank == 0 && T.ct == 0 && T.es == 0 && T.cl == 0 && T.hok;
    if (PARTIAL) {  // weights exp(x - m): the combine rescales
      if (w0) {
        a.part_ms[(slot * H + T.h) * 2] = fn.m;
        a.part_ms[(slot * H + T.h) * 2 + 1] = fn.s;
      }
      fn.inv = A(1);
    } else {
      online_finish(fn.m, fn.s);
      fn.inv = fast_recip(fn.s);
      if (w0) a.lse_out[i * H + T.h] = softmax_lse(fn.m, fn.s);
    }
  }

  // ---- pass 2
  A acc[V];
  aggregate_row<V>(T, rank, nranks, start, end, a.col, a.Ns, D, a.values, fn,
                   s_red, acc);
  if (rank == 0) {
    if (PARTIAL)
      store_partial<V>(T, acc, a.part_acc + slot * D);
    else
      store_units<V>(T, acc, a.out + i * D, a.bias);
  }
}

template <typename scalar_t, typename index_t, int V, int TERMS, int OWN>
__global__ void __launch_bounds__(kBlock, (TERMS == kFwdAny ? kAttnFwdBlocksAny
                                                            : kAttnFwdBlocks))
    attention_fwd_kernel(AttnArgs<scalar_t, index_t> a, TileLayout L) {
  using A = acc_t<scalar_t>;
  __shared__ int64_t s_long[kWarpsPerBlock];
  __shared__ A s_m[kWarpsPerBlock * kWarp];
  __shared__ A s_s[kWarpsPerBlock * kWarp];
  __shared__ A s_red[kWarpsPerBlock * kWarp * V];
  run_rows(a.rowptr, a.N, a.E, a.coop, a.sp.split, s_long,
           [&](int64_t row, int rank, int nranks) {
    int64_t start, end;
    row_range(a.rowptr, row, a.E, start, end);
    fwd_row<false, scalar_t, index_t, V, TERMS, OWN>(a, L, row, start, end,
                                                     rank, nranks, s_m, s_s,
                                                     s_red, 0);
  });
}

// Split path, partials: block (w, tile) processes both slots of edge window
// w (window_part, utils.cuh) with its 8 warps as fwd_row's block-shared
// rows do, writing per head the part's max m and sum s of exp(x - m) and
// the sums of exp(x - m) * mask * values[j] (not divided by s).
template <typename scalar_t, typename index_t, int V>
__global__ void __launch_bounds__(kBlock)
    attention_fwd_part_kernel(AttnArgs<scalar_t, index_t> a, TileLayout L) {
  using A = acc_t<scalar_t>;
  __shared__ A s_m[kWarpsPerBlock * kWarp];
  __shared__ A s_s[kWarpsPerBlock * kWarp];
  __shared__ A s_red[kWarpsPerBlock * kWarp * V];
  const int64_t w = blockIdx.x;
  for (int q = 0; q < 2; ++q) {
    int64_t row, s, t;
    if (!window_part(a.sp, a.rowptr, a.E, w, q, row, s, t)) continue;
    fwd_row<true, scalar_t, index_t, V, kFwdAny, kEdgeBatch>(
        a, L, row, s, t, static_cast<int>(threadIdx.x >> 5), kWarpsPerBlock,
        s_m, s_s, s_red, 2 * w + q);
  }
}

std::tuple<at::Tensor, at::Tensor> attention_cuda(
    const at::Tensor& rowptr_in, const at::Tensor& col_in,
    const c10::optional<at::Tensor>& a_src_in,
    const c10::optional<at::Tensor>& a_dst_in,
    const c10::optional<at::Tensor>& a_edge_in,
    const c10::optional<at::Tensor>& mask_in, const at::Tensor& values_in,
    double negative_slope, const c10::optional<at::Tensor>& bias_in,
    const c10::optional<at::Tensor>& /*colptr*/,
    const c10::optional<at::Tensor>& /*csc_row*/,
    const c10::optional<at::Tensor>& /*csc_perm*/,
    const c10::optional<at::Tensor>& /*csc_inv*/) {
  check_attention(rowptr_in, col_in, a_src_in, a_dst_in, a_edge_in, mask_in,
                  values_in, bias_in);
  c10::cuda::CUDAGuard guard(values_in.device());
  const at::Tensor rowptr = rowptr_in.contiguous();
  const at::Tensor col = col_in.contiguous();
  const at::Tensor values = values_in.contiguous();
  const at::Tensor a_src = opt_contig(a_src_in), a_dst = opt_contig(a_dst_in),
                   a_edge = opt_contig(a_edge_in), mask = opt_contig(mask_in),
                   bias = opt_contig(bias_in);
  const int64_t N = rowptr.numel() - 1;
  const int64_t H = values.size(1), C = values.size(2);
  at::Tensor out = at::empty({N, H, C}, values.options());
  at::Tensor lse = at::empty(
      {N, H}, values.options().dtype(opmath_type(values.scalar_type())));
  if (N * H == 0) return {out, lse};
  PFA_DISPATCH_FLOATS(values.scalar_type(), "attention_cuda", [&] {
    PFA_DISPATCH_INDEX(rowptr.scalar_type(), "attention_cuda", [&] {
      using A = acc_t<scalar_t>;
      auto a = attn_args<scalar_t, index_t>(rowptr, col, a_src, a_dst, a_edge,
                                            mask, values, bias, negative_slope);
      a.out = out.data_ptr<scalar_t>();
      a.lse_out = lse.data_ptr<A>();
      constexpr int VW = vec_width<scalar_t>();
      const bool vec = C % VW == 0 && aligned16(a.values) && aligned16(a.out) &&
                       (a.bias == nullptr || aligned16(a.bias));
      const TileLayout L = make_layout(H, C, vec ? VW : 1, true);
      const dim3 grid = row_grid(N, L.n_tiles);
      a.coop = coop_edges(N, L.n_tiles);
      at::Tensor win, part;
      a.sp = make_split(a.rowptr, N, a.E, values.options(), win, split_plan(),
                        length_hint().rows);
      if (a.sp.nwin > 0) {
        part = at::empty({2 * a.sp.nwin, H * C + 2 * H}, lse.options());
        a.part_acc = part.data_ptr<A>();
        a.part_ms = a.part_acc + 2 * a.sp.nwin * H * C;
      }
      auto stream = at::cuda::getCurrentCUDAStream();
      dispatch_v<scalar_t>(vec, [&](auto v) {
        constexpr int V = decltype(v)::value;
        if (a.sp.nwin > 0) {
          attention_fwd_part_kernel<scalar_t, index_t, V>
              <<<dim3(static_cast<unsigned>(a.sp.nwin), grid.y), kBlock, 0,
                 stream>>>(a, L);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
        // the common term sets get their own kernels
        const int terms =
            a.mask != nullptr ? kFwdAny
            : (a.a_src != nullptr && a.a_edge == nullptr)  ? kFwdSrc
            : (a.a_src == nullptr && a.a_edge != nullptr)  ? kFwdEdge
                                                           : kFwdAny;
        constexpr int EB = kEdgeBatch;
        // OWN: edges of a batch whose weights a lane computes (EB: all;
        // 1 when a head has at least EB lanes to share them).
        auto launch = [&](auto terms_c) {
          if (owner_lanes(kOwnerLanesFwd) && (1 << L.lh_log) >= EB)
            attention_fwd_kernel<scalar_t, index_t, V,
                                 decltype(terms_c)::value, 1>
                <<<grid, kBlock, 0, stream>>>(a, L);
          else
            attention_fwd_kernel<scalar_t, index_t, V,
                                 decltype(terms_c)::value, EB>
                <<<grid, kBlock, 0, stream>>>(a, L);
        };
        if (terms == kFwdSrc)
          launch(std::integral_constant<int, kFwdSrc>());
        else if (terms == kFwdEdge)
          launch(std::integral_constant<int, kFwdEdge>());
        else
          launch(std::integral_constant<int, kFwdAny>());
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      launch_split_softmax_combine<scalar_t, index_t>(
          a.sp, a.rowptr, a.E, a.part_acc, a.part_ms, a.bias, H, C, a.out,
          a.lse_out);
    });
  });
  return {out, lse};
}

}  // namespace
}  // namespace cuda
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, CUDA, m) {
  m.impl("attention", &pyg_fastattn::cuda::attention_cuda);
}
