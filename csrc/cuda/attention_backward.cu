// attention_backward on CUDA: the per-edge gradients of the fused GAT
// attention (attention.cu has the forward).
#include "attention.cuh"

namespace pyg_fastattn {
namespace cuda {
namespace {

// Backward prologue: G lanes per (row i, head h) (G a power of two, the
// fewest that cover C in V-element units; 32 / G pairs per warp, warps
// grid-stride over the pairs), so each warp load covers consecutive bytes of
// grad_out and out. Packs RowInfo {a_dst, lse, delta = <grad_out[i, h],
// out[i, h] - bias[h]>} (delta summed over the G lanes by shuffles); all
// threads also zero grad_z at the positions no warp visits: k >= colptr[Ns]
// (CSC order) or e >= rowptr[N] (CSR).
template <typename scalar_t, typename index_t, int V, bool COMPACT>
__global__ void __launch_bounds__(kBlock)
    bwd_prologue_kernel(AttnArgs<scalar_t, index_t> a,
                        const scalar_t* __restrict__ fout, int H, int64_t C,
                        int G) {
  using A = acc_t<scalar_t>;
  const int64_t tail = a.gz_csr ? tail_begin(a.rowptr, a.N, a.E)
                                : tail_begin(a.colptr, a.Ns, a.E);
  const int64_t rows = a.N * H;
  const int lane = lane_id();
  const int per_warp = kWarp / G;
  const int64_t nwarps =
      static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarp);
  for (int64_t t0 = global_warp() * per_warp; t0 < rows;
       t0 += nwarps * per_warp) {  // warp-uniform trip count
    const int64_t t = t0 + lane / G;
    const bool ok = t < rows;
    A d = A(0);
    if (ok) {
      const scalar_t* b = a.bias != nullptr ? a.bias + (t % H) * C : nullptr;
      for (int64_t c = static_cast<int64_t>(lane % G) * V; c < C;
           c += static_cast<int64_t>(G) * V) {
        const Vec<scalar_t, V> u =
            load_vec<scalar_t, V>(a.grad_out + t * C + c);
        Vec<scalar_t, V> w = load_vec<scalar_t, V>(fout + t * C + c);
        if (b != nullptr) {
          const Vec<scalar_t, V> bv = load_vec<scalar_t, V>(b + c);
#pragma unroll
          for (int v = 0; v < V; ++v)
            d += to_acc(vec_get(u, v)) *
                 (to_acc(vec_get(w, v)) - to_acc(vec_get(bv, v)));
        } else {
#pragma unroll
          for (int v = 0; v < V; ++v)
            d += to_acc(vec_get(u, v)) * to_acc(vec_get(w, v));
        }
      }
    }
    d = xor_sum(d, 1, G);
    if (ok && lane % G == 0) {
      if (COMPACT) {
        RowInfoLD<A> r;
        r.lse = a.lse[t];
        r.delta = d;
        reinterpret_cast<RowInfoLD<A>*>(a.rinfo)[t] = r;
      } else {
        RowInfo<A> r;
        r.adst = a.a_dst != nullptr ? to_acc(a.a_dst[t]) : A(0);
        r.lse = a.lse[t];
        r.delta = d;
        r.pad = A(0);
        a.rinfo[t] = r;
      }
    }
  }
  zero_from(tail, a.E, H, a.gz);
}

// Recomputed forward weight of one (edge, head) for the backward, from the
// row's packed terms: z = a_src + a_dst + a_edge (the reference's order),
// alpha = exp(leaky(z) - lse) (0 where lse is -inf: fin = false).
template <typename A, typename R>
__device__ __forceinline__ A bwd_alpha(A asrc, const R& r, A aedge,
                                       A slope, A& z, bool& fin) {
  z = asrc + row_adst(r) + aedge;
  fin = has_weight(r.lse);
  return fin ? pfa_exp(leaky(z, slope) - r.lse) : A(0);
}

// Backward, one pass over the transpose: one warp per (source node j, head
// tile), same lane layout as the forward with whole heads per warp (heads
// of more than 32 units: each lane walks units cl + 32*kc). The lane's units
// of values[j] stay in registers. The column's entries come in chunks of
// 32 whose (i = row[k], e = perm[k]) one coalesced load per lane fetches
// (IdxChunk); lane (es, hs, cl) takes entries es + ES*b of each batch of
// ES*EB (EB in flight), gets (i, e) by shuffles, first issues every load of
// the batch (RowInfo of (i, h), a_edge / mask of (e, h), its units of
// grad_out[i]), then reduces <grad_out[i,h], values[j,h]> over the
// head's LH lanes, recomputes alpha and accumulates alpha*mask*grad_out[i]
// (grad_values) and grad_z (grad_a_src). With owner lanes (OWN < EB, lean
// modes) lane cl loads the row info of, reduces (reduce-scatter) and scores
// only the entries b = cl % STRIDE + STRIDE*m, writes their grad_z, and
// shuffles alpha to the head's lanes; otherwise every lane scores every
// entry and lane cl == 0 writes grad_z[k, h]
// (CSC order: consecutive entries, coalesced; or grad_z[e, h], scattered,
// when the caller needs it in CSR order). Edge slots are summed with
// shuffles; columns with more than coop_edges(...) entries are shared by the 8
// warps of the block and combined in shared memory in a fixed order (no
// atomics: bitwise deterministic). Units beyond the first 32 of a head
// (streaming mode) get their grad_values in extra passes over the column.
// Registers and latency bound this kernel: capped at 128 registers so that
// two blocks fit; the chunked index loads take one dependent round trip out
// of every batch. MODE kBwdLean (no a_edge, mask or CSR-order grad_z, no
// streaming units, one head per lane) compiles without that code to 80
// registers, so three blocks fit (four in fp32, with narrower batches:
// bwd_min_blocks, bwd_narrow_batch). kBwdEdge (softmax_aggregate: a_edge,
// no a_src or a_dst, grad_z in CSR order, still no mask or streaming units)
// keeps three blocks (a few bytes spill) and gathers the 8-byte RowInfoLD
// {lse, delta} per entry and head.
// Measurements: RESULTS.md.
//
// PARTIAL: the split path's partials: block (w, tile) processes both slots
// of CSC edge window w (window_part) with its 8 warps as for a block-shared
// column and stores its sums into slot 2w + q of part_acc ([D] grad_values
// terms, then [H] grad_a_src terms; grad_z is written as usual); the
// non-partial launch skips those columns and split_sum_kernel
// adds the partials in window order.
enum BwdMode { kBwdFull = 0, kBwdLean = 1, kBwdEdge = 2 };

// Entries of a column a lane has in flight per batch.
template <typename scalar_t>
constexpr int bwd_batch() {
  return sizeof(scalar_t) <= 4 ? 4 : 1;
}

// Resident blocks per SM a backward variant is compiled for (common.h).
template <typename scalar_t, int MODE, bool PARTIAL, int EB>
constexpr int bwd_min_blocks() {
  constexpr bool lean = MODE == kBwdLean && !PARTIAL && EB <= 4;
  return MODE == kBwdFull ? kAttnBwdBlocksFull
         : (lean && sizeof(scalar_t) == 4) ? kAttnBwdBlocksLeanFp32
         : (lean && std::is_same<scalar_t, at::BFloat16>::value)
             ? kAttnBwdBlocksLeanBf16
             : kAttnBwdBlocksLean;
}

// EB: entries of a column a lane has in flight per batch (bwd_batch;
// kAttnBwdWideBatch or kAttnBwdNarrowBatch for the float32 lean kernel with
// and without owner lanes).
template <typename scalar_t, typename index_t, int V, int MODE, bool PARTIAL,
          int EB, int OWN>
__global__ void __launch_bounds__(kBlock,
                                  (bwd_min_blocks<scalar_t, MODE, PARTIAL, EB>()))
    attention_bwd_kernel(AttnArgs<scalar_t, index_t> a, TileLayout L) {
  using A = acc_t<scalar_t>;
  // Lean modes: each batch entry is scored by one of STRIDE lanes of its
  // head (OWN entries a lane, LH >= STRIDE); kBwdFull: by every lane.
  static_assert(OWN >= 1 && EB % OWN == 0, "OWN divides the batch");
  static_assert(MODE != kBwdFull || (OWN == EB && EB == bwd_batch<scalar_t>()),
                "kBwdFull scores every entry");
  constexpr int STRIDE = EB / OWN;
  __shared__ int64_t s_long[kWarpsPerBlock];
  __shared__ A s_red[kWarpsPerBlock * kWarp * V];
  const int H = L.H;
  const int64_t D = static_cast<int64_t>(H) * L.C;
  constexpr bool EDGE = MODE == kBwdEdge;
  using RI = std::conditional_t<EDGE, RowInfoLD<A>, RowInfo<A>>;
  const scalar_t* __restrict__ grad_out = a.grad_out;
  const RI* __restrict__ rinfo = reinterpret_cast<const RI*>(a.rinfo);
  // kBwdLean: no per-edge term (a_edge, mask, CSR-order grad_z); kBwdEdge:
  // no mask. Neither has streaming units: the compiler drops that code and
  // three blocks fit per SM.
  const scalar_t* __restrict__ a_edge = MODE == kBwdLean ? nullptr : a.a_edge;
  const scalar_t* __restrict__ mask = MODE == kBwdFull ? a.mask : nullptr;
  const bool gz_csr = EDGE || (MODE == kBwdFull && a.gz_csr);
  const int KC = MODE == kBwdFull ? L.KC : 1;
  auto col_body = [&](int64_t node, int rank, int nranks, int64_t start,
                      int64_t end, int64_t slot) {
    const LaneTile T =
        decode_tile(L, V, node, static_cast<int>(blockIdx.y), lane_id());
    const int64_t j = T.row;
    const scalar_t* __restrict__ v_row = a.values + j * D;
    A* __restrict__ part = PARTIAL ? a.part_acc + slot * (D + H) : nullptr;

    // The column's CSC entries in chunks of 32 (IdxChunk: row and perm
    // loaded once per chunk, coalesced), chunks interleaved over the nranks
    // warps; per batch of ES*EB entries (at most 32 used),
    // body(i, e, k0, in, ok): lane's entries k = k0 + b*ES + es,
    // i = row[k], e = perm[k] (0 when nothing per-edge is read or written),
    // in: k < end, ok: and (i, e) valid. Indices
    // stay index_t (registers bound this kernel). The trip counts are
    // warp-uniform (shuffles inside and in body).
    const int batch = T.ES * EB;
    const bool need_e =
        MODE != kBwdLean && (a_edge != nullptr || mask != nullptr || gz_csr);
    const auto nlim = index_limit<index_t>(a.N);
    const auto elim = index_limit<index_t>(a.E);
    auto walk = [&](auto&& body) {
      for (int64_t c0 = start + rank * kWarp; c0 < end; c0 += kWarp * nranks) {
        IdxChunk<index_t> ci, ce;
        ci.load(a.row_t, c0, end);
        ce.v = index_t(0);  // perm only when a per-edge term needs it
        if (need_e) ce.load(a.perm, c0, end);
        const int cnt = static_cast<int>(end - c0 < kWarp ? end - c0 : kWarp);
        for (int q = 0; q < cnt; q += batch) {
          index_t i[EB], e[EB];
          bool in[EB], ok[EB];
#pragma unroll
          for (int b = 0; b < EB; ++b) {
            const int sl = q + b * T.ES + T.es;
            in[b] = sl < cnt;
            i[b] = ci.get(sl);
            e[b] = MODE == kBwdLean ? index_t(0) : ce.get(sl);
            ok[b] = in[b] && index_in(i[b], nlim) &&
                    (MODE == kBwdLean || index_in(e[b], elim));
          }
          body(i, e, c0 + q, in, ok);
        }
      }
    };
    // Per-(edge, head) terms of a batch: row info, a_edge, mask.
    auto load_terms = [&](const index_t (&i)[EB], const index_t (&e)[EB],
                          const bool (&ok)[EB], RI (&ri)[EB], A (&ae)[EB],
                          A (&mk)[EB]) {
#pragma unroll
      for (int b = 0; b < EB; ++b) {
        const bool use = ok[b] && T.hok;
        if (use)
          ri[b] = rinfo[static_cast<int64_t>(i[b]) * H + T.h];
        else
          row_none(ri[b]);
        const int64_t eh = static_cast<int64_t>(e[b]) * H + T.h;
        ae[b] = (use && a_edge != nullptr) ? to_acc(a_edge[eh]) : A(0);
        mk[b] = (use && mask != nullptr) ? to_acc(mask[eh]) : A(1);
      }
    };

    A vj[V], acc[V], gsrc[1];
    const A asrc = (!EDGE && a.a_src != nullptr && T.hok)
                       ? to_acc(a.a_src[j * H + T.h])
                       : A(0);
    gsrc[0] = A(0);
    {
      const Vec<scalar_t, V> r = T.uok ? load_vec<scalar_t, V>(v_row + T.uoff)
                                       : zero_vec<scalar_t, V>();
#pragma unroll
      for (int v = 0; v < V; ++v) {
        vj[v] = vec_get(r, v);
        acc[v] = A(0);
      }
    }

    // The lane's units of grad_out[i] for a batch, and their part of
    // <grad_out[i, h], values[j, h]>.
    auto rows_and_dots = [&](const index_t (&i)[EB], const bool (&ok)[EB],
                             Vec<scalar_t, V> (&raw)[EB], A (&dot)[EB]) {
#pragma unroll
      for (int b = 0; b < EB; ++b)
        raw[b] = (ok[b] && T.uok)
                     ? load_vec<scalar_t, V>(
                           grad_out + static_cast<int64_t>(i[b]) * D + T.uoff)
                     : zero_vec<scalar_t, V>();
#pragma unroll
      for (int b = 0; b < EB; ++b) {
        A d = A(0);
#pragma unroll
        for (int v = 0; v < V; ++v) d += vec_get(raw[b], v) * vj[v];
        dot[b] = d;
      }
    };

    if constexpr (MODE != kBwdFull) {
      // Lean modes: lane cl scores the entries b = own0 +
      // STRIDE*m of each batch; a reduce-scatter over the head's lanes gives
      // it their dots, and the owners' weights reach every lane by shuffles.
      const int own0 = T.cl & (STRIDE - 1);
      const int gbase = lane_id() & ~(T.LH - 1);
      const int h = T.h;
      walk([&](const index_t (&i)[EB], const index_t (&e)[EB], int64_t k0,
               const bool (&wr)[EB], const bool (&ok)[EB]) {
        index_t io[OWN], eo[OWN];
        bool oko[OWN], wro[OWN];
#pragma unroll
        for (int m = 0; m < OWN; ++m) {
          io[m] = owned<STRIDE>(i, own0, m);
          eo[m] = owned<STRIDE>(e, own0, m);
          oko[m] = owned<STRIDE>(ok, own0, m);
          wro[m] = owned<STRIDE>(wr, own0, m);
        }
        RI ri[OWN];
        A ae[OWN];
#pragma unroll
        for (int m = 0; m < OWN; ++m) {
          const bool use = oko[m] && T.hok;
          if (use)
            ri[m] = rinfo[static_cast<int64_t>(io[m]) * H + h];
          else
            row_none(ri[m]);
          ae[m] = (EDGE && use)
                      ? to_acc(a_edge[static_cast<int64_t>(eo[m]) * H + h])
                      : A(0);
        }
        Vec<scalar_t, V> raw[EB];
        A dot[EB];
        rows_and_dots(i, ok, raw, dot);
        // Reduce-scatter over lane bits 0 .. log2(STRIDE) - 1: a lane keeps
        // the entries whose bit matches its own and sends the others (the
        // same pairwise sums as xor_sum); then a butterfly over the rest.
#pragma unroll
        for (int t = 0, n = EB; n > OWN; ++t, n >>= 1) {
          const bool hi = (T.cl >> t) & 1;
#pragma unroll
          for (int m = 0; m < n / 2; ++m) {
            const A keep = hi ? dot[2 * m + 1] : dot[2 * m];
            const A send = hi ? dot[2 * m] : dot[2 * m + 1];
            dot[m] = keep + __shfl_xor_sync(kFullMask, send, 1 << t);
          }
        }
        for (int off = STRIDE; off < T.LH; off <<= 1) {
#pragma unroll
          for (int m = 0; m < OWN; ++m)
            dot[m] += __shfl_xor_sync(kFullMask, dot[m], off);
        }
        A p[OWN];
#pragma unroll
        for (int m = 0; m < OWN; ++m) {
          A z;
          bool fin;
          const A alpha = bwd_alpha(asrc, ri[m], ae[m], a.slope, z, fin);
          const A gs = alpha * (dot[m] - ri[m].delta);
          const A gzv = fin ? (z > A(0) ? gs : gs * a.slope) : A(0);
          if (wro[m] && T.hok && T.cl < STRIDE) {
            const int64_t pos =
                gz_csr ? (oko[m] ? static_cast<int64_t>(eo[m]) : -1)
                       : k0 + static_cast<int64_t>(own0 + STRIDE * m) * T.ES + T.es;
            if (pos >= 0) a.gz[pos * H + h] = from_acc<scalar_t>(gzv);
          }
          gsrc[0] += gzv;
          p[m] = alpha;
        }
#pragma unroll
        for (int b = 0; b < EB; ++b) {
          const A pb = from_owner<STRIDE>(p, b, gbase);
#pragma unroll
          for (int v = 0; v < V; ++v) acc[v] += pb * vec_get(raw[b], v);
        }
      });
      // the owners' grad_z sums (lanes cl >= STRIDE hold copies)
      if constexpr (STRIDE > 1) gsrc[0] = xor_sum(gsrc[0], 1, STRIDE);
    } else {
      walk([&](const index_t (&i)[EB], const index_t (&e)[EB], int64_t k0,
               const bool (&wr)[EB], const bool (&ok)[EB]) {
        RI ri[EB];
        A ae[EB], mk[EB];
        load_terms(i, e, ok, ri, ae, mk);
        Vec<scalar_t, V> raw[EB];
        A dot[EB];
        rows_and_dots(i, ok, raw, dot);
        for (int kc = 1; kc < KC; ++kc) {  // streaming mode only
          const int c = T.cl + 32 * kc;
          if (c < L.CU && T.hok) {
            const int64_t off = static_cast<int64_t>(T.h) * L.C +
                                static_cast<int64_t>(c) * V;
            const Vec<scalar_t, V> r = load_vec<scalar_t, V>(v_row + off);
#pragma unroll
            for (int b = 0; b < EB; ++b) {
              if (!ok[b]) continue;
              const Vec<scalar_t, V> g = load_vec<scalar_t, V>(
                  grad_out + static_cast<int64_t>(i[b]) * D + off);
#pragma unroll
              for (int v = 0; v < V; ++v)
                dot[b] += vec_get(g, v) * vec_get(r, v);
            }
          }
        }
        // the head's LH lanes sum each dot; the batch's shuffles of one step
        // are issued together (each value's order of additions as xor_sum's)
        for (int off = 1; off < T.LH; off <<= 1) {
#pragma unroll
          for (int b = 0; b < EB; ++b)
            dot[b] += __shfl_xor_sync(kFullMask, dot[b], off);
        }
#pragma unroll
        for (int b = 0; b < EB; ++b) {
          A z;
          bool fin;
          const A alpha = bwd_alpha(asrc, ri[b], ae[b], a.slope, z, fin);
          const A gs = alpha * (mk[b] * dot[b] - ri[b].delta);
          const A gzv = fin ? (z > A(0) ? gs : gs * a.slope) : A(0);
          if (wr[b] && T.hok && T.cl == 0) {
            const int64_t pos =
                gz_csr ? (ok[b] ? static_cast<int64_t>(e[b]) : -1)
                       : k0 + b * T.ES + T.es;
            if (pos >= 0) a.gz[pos * H + T.h] = from_acc<scalar_t>(gzv);
          }
          gsrc[0] += gzv;
          const A p = alpha * mk[b];
#pragma unroll
          for (int v = 0; v < V; ++v) acc[v] += p * vec_get(raw[b], v);
        }
      });
    }
    reduce_edge_slots<V>(T, acc);
    reduce_edge_slots<1>(T, gsrc);
    if (nranks > 1) {
      block_sum<V>(acc, s_red, rank, nranks);
      block_sum<1>(gsrc, s_red, rank, nranks);
    }
    if (rank == 0) {
      if (PARTIAL)
        store_partial<V>(T, acc, part);
      else
        store_units<V>(T, acc, a.gvalues + j * D);
      if (T.es == 0 && T.cl == 0 && T.hok) {
        if (PARTIAL)
          part[D + T.h] = gsrc[0];
        else
          a.gsrc[j * H + T.h] = from_acc<scalar_t>(gsrc[0]);
      }
    }

    // Streaming mode: grad_values of units cl + 32*kc, one pass each.
    for (int kc = 1; kc < KC; ++kc) {
      const int c = T.cl + 32 * kc;
      const bool uk = c < L.CU && T.hok;
      const int64_t off =
          static_cast<int64_t>(T.h) * L.C + static_cast<int64_t>(c) * V;
      A acc2[V];
      zero_acc<V>(acc2);
      walk([&](const index_t (&i)[EB], const index_t (&e)[EB], int64_t,
               const bool (&)[EB], const bool (&ok)[EB]) {
        RI ri[EB];
        A ae[EB], mk[EB];
        load_terms(i, e, ok, ri, ae, mk);
#pragma unroll
        for (int b = 0; b < EB; ++b) {
          if (!ok[b] || !uk) continue;
          A z;
          bool fin;
          const A p = bwd_alpha(asrc, ri[b], ae[b], a.slope, z, fin) * mk[b];
          const Vec<scalar_t, V> g =
              load_vec<scalar_t, V>(grad_out + static_cast<int64_t>(i[b]) * D + off);
#pragma unroll
          for (int v = 0; v < V; ++v) acc2[v] += p * vec_get(g, v);
        }
      });
      if (nranks > 1) block_sum<V>(acc2, s_red, rank, nranks);
      if (rank == 0 && uk) {
        if (PARTIAL) {
#pragma unroll
          for (int v = 0; v < V; ++v) part[off + v] = acc2[v];
        } else {
          Vec<scalar_t, V> o = zero_vec<scalar_t, V>();
#pragma unroll
          for (int v = 0; v < V; ++v) vec_set(o, v, acc2[v]);
          store_vec<scalar_t, V>(a.gvalues + j * D + off, o);
        }
      }
    }
  };
  run_rows_or_windows<PARTIAL>(a.sp, a.colptr, a.Ns, a.E, a.coop, s_long,
                               col_body);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_backward_cuda(
    const at::Tensor& rowptr_in, const at::Tensor& col_in,
    const at::Tensor& colptr_in, const at::Tensor& row_in,
    const at::Tensor& perm_in, const c10::optional<at::Tensor>& a_src_in,
    const c10::optional<at::Tensor>& a_dst_in,
    const c10::optional<at::Tensor>& a_edge_in,
    const c10::optional<at::Tensor>& mask_in, const at::Tensor& values_in,
    double negative_slope, const at::Tensor& out_in, const at::Tensor& lse_in,
    const at::Tensor& grad_out_in, bool grad_z_csr,
    const c10::optional<at::Tensor>& bias_in) {
  check_attention_backward(rowptr_in, col_in, colptr_in, row_in, perm_in,
                           a_src_in, a_dst_in, a_edge_in, mask_in, values_in,
                           out_in, lse_in, grad_out_in, bias_in);
  c10::cuda::CUDAGuard guard(values_in.device());
  const at::Tensor rowptr = rowptr_in.contiguous();
  const at::Tensor col = col_in.contiguous();
  const at::Tensor colptr = colptr_in.contiguous();
  const at::Tensor row_t = row_in.contiguous();
  const at::Tensor perm = perm_in.contiguous();
  const at::Tensor values = values_in.contiguous();
  const at::Tensor fout = out_in.contiguous();
  const at::Tensor lse = lse_in.contiguous();
  const at::Tensor grad_out = grad_out_in.contiguous();
  const at::Tensor a_src = opt_contig(a_src_in), a_dst = opt_contig(a_dst_in),
                   a_edge = opt_contig(a_edge_in), mask = opt_contig(mask_in),
                   bias = opt_contig(bias_in);
  const int64_t N = rowptr.numel() - 1;
  const int64_t E = col.numel();
  const int64_t Ns = values.size(0), H = values.size(1), C = values.size(2);
  at::Tensor gvalues = at::empty({Ns, H, C}, values.options());
  at::Tensor gz = at::empty({E, H}, values.options());  // tail zeroed in-kernel
  at::Tensor gsrc = at::empty({Ns, H}, values.options());
  if (Ns * H == 0) return {gvalues, gz.zero_(), gsrc};
  // RowInfo [N, H] as raw bytes (4 accumulators each; the kBwdEdge launch
  // uses the first half as RowInfoLD).
  at::Tensor rinfo = at::empty({std::max<int64_t>(N * H, 1), 4}, lse.options());
  PFA_DISPATCH_FLOATS(values.scalar_type(), "attention_backward_cuda", [&] {
    PFA_DISPATCH_INDEX(rowptr.scalar_type(), "attention_backward_cuda", [&] {
      using A = acc_t<scalar_t>;
      auto a = attn_args<scalar_t, index_t>(rowptr, col, a_src, a_dst, a_edge,
                                            mask, values, bias, negative_slope);
      a.colptr = colptr.data_ptr<index_t>();
      a.row_t = row_t.data_ptr<index_t>();
      a.perm = perm.data_ptr<index_t>();
      a.lse = lse.data_ptr<A>();
      a.rinfo = reinterpret_cast<RowInfo<A>*>(rinfo.data_ptr<A>());
      a.grad_out = grad_out.data_ptr<scalar_t>();
      a.gvalues = gvalues.data_ptr<scalar_t>();
      a.gz = gz.data_ptr<scalar_t>();
      a.gsrc = gsrc.data_ptr<scalar_t>();
      a.gz_csr = grad_z_csr;
      constexpr int VW = vec_width<scalar_t>();
      const bool vec = C % VW == 0 && aligned16(a.values) &&
                       aligned16(fout.data_ptr()) && aligned16(a.grad_out) &&
                       aligned16(a.gvalues) &&
                       (a.bias == nullptr || aligned16(a.bias));
      auto stream = at::cuda::getCurrentCUDAStream();
      const int64_t blocks =
          std::min<int64_t>(ceil_div(std::max<int64_t>(N * H, E * H), kBlock),
                            int64_t(num_sms()) * 16);
      auto prologue = [&](auto v, auto compact) {
        const int G = next_pow2(
            std::min<int64_t>(ceil_div(C, int64_t(decltype(v)::value)), kWarp));
        bwd_prologue_kernel<scalar_t, index_t, decltype(v)::value,
                            decltype(compact)::value>
            <<<std::max<int64_t>(blocks, 1), kBlock, 0, stream>>>(
                a, fout.data_ptr<scalar_t>(), static_cast<int>(H), C, G);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      const TileLayout L = make_layout(H, C, vec ? VW : 1, false);
      // The lean modes: no mask or streaming units. kBwdEdge
      // (softmax_aggregate) reads RowInfoLD, written by its prologue.
      constexpr int EBL = bwd_batch<scalar_t>();
      const int LH = 1 << L.lh_log;
      const bool lean = vec && L.KC == 1 && !mask.defined();
      const bool edge = lean && grad_z_csr && a_edge.defined() &&
                        !a_src.defined() && !a_dst.defined();
      if (edge)
        prologue(std::integral_constant<int, VW>(), std::true_type());
      else if (vec)
        prologue(std::integral_constant<int, VW>(), std::false_type());
      else
        prologue(std::integral_constant<int, 1>(), std::false_type());
      const dim3 grid = row_grid(Ns, L.n_tiles);
      a.coop = coop_edges(Ns, L.n_tiles);
      at::Tensor win, part;
      a.sp = make_split(a.colptr, Ns, E, values.options(), win, split_plan(),
                        length_hint().cols);
      const dim3 pgrid(static_cast<unsigned>(std::max<int64_t>(a.sp.nwin, 1)),
                       grid.y);
      if (a.sp.nwin > 0) {
        part = at::empty({2 * a.sp.nwin, H * C + H}, lse.options());
        a.part_acc = part.data_ptr<A>();
      }
      // OWN: batch entries a lane scores (EB / OWN <= LH lanes a head).
      auto launch_own = [&](auto mode, auto eb, auto own) {
        constexpr int M = decltype(mode)::value, B = decltype(eb)::value,
                      O = decltype(own)::value;
        if (a.sp.nwin > 0) {
          attention_bwd_kernel<scalar_t, index_t, VW, M, true, B, O>
              <<<pgrid, kBlock, 0, stream>>>(a, L);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        }
        attention_bwd_kernel<scalar_t, index_t, VW, M, false, B, O>
            <<<grid, kBlock, 0, stream>>>(a, L);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      };
      using EBc = std::integral_constant<int, EBL>;
      auto launch_lean = [&](auto mode) {
        const bool own = owner_lanes(
            decltype(mode)::value == kBwdLean && sizeof(scalar_t) == 4
                ? kOwnerLanesBwdFp32
                : kOwnerLanesBwdOther);
        constexpr bool wide_ok = decltype(mode)::value == kBwdLean &&
                                 sizeof(scalar_t) == 4 && EBL == 4;
        if constexpr (EBL == 1) {
          launch_own(mode, EBc(), std::integral_constant<int, 1>());
        } else {
          if constexpr (wide_ok) {  // float32 GAT: other batch sizes
            if (own && LH >= kAttnBwdWideBatch && bwd_wide_batch()) {
              launch_own(mode, std::integral_constant<int, kAttnBwdWideBatch>(),
                         std::integral_constant<int, 1>());
              return;
            }
            if (!own && bwd_narrow_batch()) {
              using NB = std::integral_constant<int, kAttnBwdNarrowBatch>;
              launch_own(mode, NB(), NB());
              return;
            }
          }
          if (own && LH >= EBL)
            launch_own(mode, EBc(), std::integral_constant<int, 1>());
          else if (own && LH == EBL / 2)
            launch_own(mode, EBc(), std::integral_constant<int, 2>());
          else
            launch_own(mode, EBc(), EBc());
        }
      };
      if (lean && !grad_z_csr && !a_edge.defined()) {
        launch_lean(std::integral_constant<int, kBwdLean>());
      } else if (edge) {
        launch_lean(std::integral_constant<int, kBwdEdge>());
      } else {
        dispatch_v<scalar_t>(vec, [&](auto v) {
          constexpr int V = decltype(v)::value, O = EBL;
          if (a.sp.nwin > 0) {
            attention_bwd_kernel<scalar_t, index_t, V, kBwdFull, true, O, O>
                <<<pgrid, kBlock, 0, stream>>>(a, L);
            C10_CUDA_KERNEL_LAUNCH_CHECK();
          }
          attention_bwd_kernel<scalar_t, index_t, V, kBwdFull, false, O, O>
              <<<grid, kBlock, 0, stream>>>(a, L);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      }
      launch_split_sum<scalar_t, index_t>(a.sp, a.colptr, E, a.part_acc,
                                          H * C + H, H * C, a.gvalues, a.gsrc);
    });
  });
  return {gvalues, gz, gsrc};
}

}  // namespace
}  // namespace cuda
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, CUDA, m) {
  m.impl("attention_backward", &pyg_fastattn::cuda::attention_backward_cuda);
}
