// spmm and segment_sum on CUDA (the aggregation engine of aggregate.cuh;
// segment_sum of narrow rows has its own group-per-row kernel).
#include "aggregate.cuh"

namespace pyg_fastattn {
namespace cuda {
namespace {

template <typename scalar_t, typename index_t>
struct SpmmArgs {
  const index_t* rowptr;
  const index_t* col;       // nullptr: j = e (segment_sum without perm)
  const scalar_t* weight;   // [Ew, H] or nullptr (all ones)
  const index_t* wperm;     // [E] or nullptr
  const scalar_t* values;   // [Ns, H, C]
  scalar_t* out;            // [N, H, C]
  int64_t N, E, Ns, Ew;
  int64_t coop;  // rows over this many edges are block-shared
  SplitArgs sp;  // split path (utils.cuh)
  acc_t<scalar_t>* part;  // [2 * nwin, H * C] partial sums
};

// w(e, h) = weight[wperm[e] or e, h], or 1 without weight.
template <typename scalar_t, typename index_t>
struct SpmmWeight {
  using A = acc_t<scalar_t>;
  const scalar_t* __restrict__ w_;
  const index_t* __restrict__ wperm;
  int64_t Ew;
  int H;
  int h;
  // The weight's position (wperm[e] or e); in: e is inside the row.
  __device__ __forceinline__ int64_t edge_aux(int64_t e, bool in) const {
    return (w_ != nullptr && wperm != nullptr)
               ? (in ? static_cast<int64_t>(wperm[e]) : int64_t(0))
               : e;
  }
  __device__ __forceinline__ bool edge_ok(int64_t aux) const {
    return w_ == nullptr || (aux >= 0 && aux < Ew);
  }
  template <int EB>
  __device__ __forceinline__ void weights(const LaneTile& T,
                                          const int64_t (&)[EB],
                                          const int64_t (&)[EB],
                                          const int64_t (&aux)[EB],
                                          const bool (&ok)[EB],
                                          A (&w)[EB]) const {
#pragma unroll
    for (int b = 0; b < EB; ++b)
      w[b] = w_ == nullptr          ? A(1)
             : (ok[b] && T.uok) ? to_acc(w_[aux[b] * H + h])
                                    : A(0);
  }
};

// One warp per (row, feature tile); lanes split edges x heads x units (see
// TileLayout): lane (es, hs, cl) walks edges es, es + ES, ... of the row and
// accumulates its 16-byte units of values[col[e]] times the edge weight, then
// the ES edge slots are summed with shuffles and slot 0 stores. Rows with
// more than coop_edges(...) edges are shared by the 8 warps of the block (edges
// interleaved over the warps, partial sums combined in shared memory).
// PARTIAL: the split path's partials: block (w, tile) sums both slots of
// edge window w (window_part, utils.cuh) with its 8 warps into slot 2w + q
// of part; the non-partial launch skips rows over the split threshold and
// split_sum_kernel (utils.cuh) adds their partials in window order.
template <typename scalar_t, typename index_t, int V, bool PARTIAL>
__global__ void __launch_bounds__(kBlock)
    spmm_kernel(SpmmArgs<scalar_t, index_t> a, TileLayout L) {
  using A = acc_t<scalar_t>;
  __shared__ int64_t s_long[kWarpsPerBlock];
  __shared__ A s_red[kWarpsPerBlock * kWarp * V];
  const int64_t D = static_cast<int64_t>(L.H) * L.C;
  auto body = [&](int64_t row, int rank, int nranks, int64_t start,
                  int64_t end, int64_t slot) {
    const LaneTile T =
        decode_tile(L, V, row, static_cast<int>(blockIdx.y), lane_id());
    const int64_t i = T.row;
    SpmmWeight<scalar_t, index_t> fn;
    fn.w_ = a.weight;
    fn.wperm = a.wperm;
    fn.Ew = a.Ew;
    fn.H = L.H;
    fn.h = T.h;
    A acc[V];
    aggregate_row<V>(T, rank, nranks, start, end, a.col, a.Ns, D, a.values, fn,
                     s_red, acc);
    if (rank == 0) {
      if (PARTIAL)
        store_partial<V>(T, acc, a.part + slot * D);
      else
        store_units<V>(T, acc, a.out + i * D);
    }
  };
  run_rows_or_windows<PARTIAL>(a.sp, a.rowptr, a.N, a.E, a.coop, s_long, body);
}

// Split path, first part (make_split, utils.cuh): the window partials of
// the long rows (PARTIAL spmm_kernel over layout L) into a.part. The row
// kernel launched next must skip rows over a.sp.split;
// launch_split_combine then finishes them. `win` and `part` keep the
// buffers alive until the launches are queued. Nothing without long rows.
template <typename scalar_t, typename index_t>
void launch_split_partials(SpmmArgs<scalar_t, index_t>& a, const TileLayout& L,
                           bool vec, int64_t D, const at::TensorOptions& opts,
                           at::Tensor& win, at::Tensor& part, int64_t max_len) {
  a.sp = make_split(a.rowptr, a.N, a.E, opts, win, split_plan(), max_len);
  if (a.sp.nwin == 0) return;
  part = at::empty({2 * a.sp.nwin, D},
                   opts.dtype(opmath_type(c10::CppTypeToScalarType<scalar_t>::value)));
  a.part = part.data_ptr<acc_t<scalar_t>>();
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_v<scalar_t>(vec, [&](auto v) {
    constexpr int V = decltype(v)::value;
    spmm_kernel<scalar_t, index_t, V, true>
        <<<dim3(static_cast<unsigned>(a.sp.nwin), L.n_tiles), kBlock, 0,
           stream>>>(a, L);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

// Split path, last part: the long rows' outputs from their partials.
template <typename scalar_t, typename index_t>
void launch_split_combine(const SpmmArgs<scalar_t, index_t>& a, int64_t D) {
  launch_split_sum<scalar_t, index_t>(a.sp, a.rowptr, a.E, a.part, D, D, a.out);
}

// values viewed as [Ns, H, C]; out is [N, H, C]. Without weight the heads do
// not matter and the row is treated as one head of H * C channels.
template <typename scalar_t, typename index_t>
void launch_spmm(SpmmArgs<scalar_t, index_t> a, int64_t H, int64_t C,
                 bool weighted, const at::TensorOptions& opts,
                 int64_t max_len) {
  if (!weighted) {
    C = H * C;
    H = 1;
  }
  constexpr int VW = vec_width<scalar_t>();
  const bool vec = C % VW == 0 && aligned16(a.values) && aligned16(a.out);
  const TileLayout L = make_layout(H, C, vec ? VW : 1, /*channel_tiles=*/true);
  if (a.N * L.n_tiles == 0) return;
  const dim3 grid = row_grid(a.N, L.n_tiles);
  a.coop = coop_edges(a.N, L.n_tiles);
  const int64_t D = H * C;
  at::Tensor win, part;
  launch_split_partials(a, L, vec, D, opts, win, part, max_len);
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_v<scalar_t>(vec, [&](auto v) {
    constexpr int V = decltype(v)::value;
    spmm_kernel<scalar_t, index_t, V, false>
        <<<grid, kBlock, 0, stream>>>(a, L);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  launch_split_combine(a, D);
}

// ---------------------------------------------------------------------------
// segment_sum of narrow rows (H * sizeof(scalar_t) <= 32 bytes, e.g. the
// [E, heads] score gradients of the GAT backward). The engine above gives
// such a row a whole warp (a single 16-byte unit, 32 edge slots), which is
// latency-bound; here a row gets a group of G lanes and a warp several rows.

// A lane's pass over edges e, e + stride, ... < end: EB edges at a time, it
// loads their indices, then their rows of src (NU units of V elements: one
// 16-byte vector per unit when V > 1, else guarded scalars, u < H), and adds
// them to acc. perm == nullptr means j = e; j outside [0, Ns) contributes
// nothing (as in gather_accumulate).
template <int V, int NU, typename scalar_t, typename index_t>
__device__ __forceinline__ void seg_accumulate(
    int64_t e, int64_t end, int64_t stride, const index_t* __restrict__ perm,
    int64_t Ns, int H, const scalar_t* __restrict__ src,
    acc_t<scalar_t> (&acc)[V * NU]) {
  constexpr int EB = kSegEdgeBatch;
  constexpr bool kExact = V > 1 || NU == 1;  // H == V * NU
  const int64_t W = kExact ? int64_t(V * NU) : int64_t(H);  // src row stride
  for (; e < end; e += stride * EB) {
    int64_t j[EB];
    bool ok[EB];
#pragma unroll
    for (int b = 0; b < EB; ++b) {
      const int64_t eb = e + b * stride;
      ok[b] = eb < end;
      j[b] = 0;
      if (ok[b]) {
        j[b] = perm != nullptr ? static_cast<int64_t>(perm[eb]) : eb;
        ok[b] = j[b] >= 0 && j[b] < Ns;
      }
    }
    Vec<scalar_t, V> raw[EB][NU];
#pragma unroll
    for (int b = 0; b < EB; ++b)
#pragma unroll
      for (int u = 0; u < NU; ++u)
        raw[b][u] = (ok[b] && (kExact || u < H))
                        ? load_vec<scalar_t, V>(src + j[b] * W + u * V)
                        : zero_vec<scalar_t, V>();
#pragma unroll
    for (int b = 0; b < EB; ++b) {
      if (!ok[b]) continue;
#pragma unroll
      for (int u = 0; u < NU; ++u)
#pragma unroll
        for (int v = 0; v < V; ++v) acc[u * V + v] += vec_get(raw[b][u], v);
    }
  }
}

// One group of G = 2^g_log lanes per row: block b owns rows
// b * (kBlock / G) + t / G (thread t), kWarp / G rows per warp. Lane gl of a
// group walks edges start + gl, start + gl + G, ... (seg_accumulate) over the
// whole row width; the G partial sums are combined with xor shuffles (fixed
// order: deterministic) and lane 0 of the group stores. Rows over the split
// threshold (a.sp.split) are left to the split path. Rows with more than
// a.coop edges are first summed one after the other by the whole block
// (thread t takes edges start + t, start + t + kBlock, ...; warp sums by
// shuffles, then the 8 warp sums added in warp order in shared memory and
// threads h < H store element h); their groups skip them. Lanes without a
// row (row >= N) take part in every shuffle and barrier.
//
// __launch_bounds__(kBlock, 1): without a minimum of blocks ptxas capped
// these kernels at 32-48 registers and then spilled (32-byte rows) or issued
// the edge batch's index and row loads in dependent pairs (4 round trips per
// batch instead of 2, up to 16% slower); uncapped they take 40-65 registers
// (78 for 32-byte half vectors, 103 for 16 scalar halves), no spills.
template <typename scalar_t, typename index_t, int V, int NU>
__global__ void __launch_bounds__(kBlock, 1)
    segment_sum_narrow_kernel(SpmmArgs<scalar_t, index_t> a, int H,
                              int g_log) {
  using A = acc_t<scalar_t>;
  constexpr int K = V * NU;  // accumulators per lane (>= H)
  constexpr bool kExact = V > 1 || NU == 1;
  __shared__ unsigned s_long[kWarpsPerBlock];
  __shared__ A s_red[kWarpsPerBlock * K];
  const int G = 1 << g_log;
  const int gl = static_cast<int>(threadIdx.x) & (G - 1);
  const int lane = lane_id();
  const int wib = static_cast<int>(threadIdx.x) >> 5;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * (kBlock >> g_log);
  const int64_t row = row0 + (static_cast<int>(threadIdx.x) >> g_log);
  int64_t start = 0, end = 0;
  if (row < a.N) row_range(a.rowptr, row, a.E, start, end);
  const bool is_split = end - start > a.sp.split;  // the split path sums it
  if (is_split) end = start;
  const bool is_long = end - start > a.coop;
  // Bit (group leader lane) of each long row, per warp.
  const unsigned lm = __ballot_sync(kFullMask, is_long && gl == 0);
  if (lane == 0) s_long[wib] = lm;
  __syncthreads();
  for (int w = 0; w < kWarpsPerBlock; ++w) {  // block-uniform
    for (unsigned m = s_long[w]; m != 0; m &= m - 1) {
      const int b = __ffs(static_cast<int>(m)) - 1;
      const int64_t r = row0 + ((w * kWarp + b) >> g_log);
      int64_t s, t;
      row_range(a.rowptr, r, a.E, s, t);
      A acc[K];
#pragma unroll
      for (int k = 0; k < K; ++k) acc[k] = A(0);
      seg_accumulate<V, NU>(s + threadIdx.x, t, kBlock, a.col, a.Ns, H,
                            a.values, acc);
#pragma unroll
      for (int k = 0; k < K; ++k) acc[k] = xor_sum(acc[k], 1, kWarp);
      if (lane == 0) {
#pragma unroll
        for (int k = 0; k < K; ++k) s_red[wib * K + k] = acc[k];
      }
      __syncthreads();
      if (static_cast<int>(threadIdx.x) < H) {
        A sum = s_red[threadIdx.x];
        for (int q = 1; q < kWarpsPerBlock; ++q) sum += s_red[q * K + threadIdx.x];
        a.out[r * H + threadIdx.x] = from_acc<scalar_t>(sum);
      }
      __syncthreads();  // s_red is reused by the next long row
    }
  }
  if (is_long) end = start;  // done above
  A acc[K];
#pragma unroll
  for (int k = 0; k < K; ++k) acc[k] = A(0);
  seg_accumulate<V, NU>(start + gl, end, G, a.col, a.Ns, H, a.values, acc);
  for (int off = 1; off < G; off <<= 1) {  // K independent shuffles a round
#pragma unroll
    for (int k = 0; k < K; ++k) acc[k] += __shfl_xor_sync(kFullMask, acc[k], off);
  }
  if (gl != 0 || row >= a.N || is_long || is_split) return;
  if constexpr (V > 1) {
#pragma unroll
    for (int u = 0; u < NU; ++u) {
      Vec<scalar_t, V> o;
#pragma unroll
      for (int v = 0; v < V; ++v) vec_set(o, v, acc[u * V + v]);
      store_vec<scalar_t, V>(a.out + row * K + u * V, o);
    }
  } else {
#pragma unroll
    for (int k = 0; k < K; ++k)
      if (kExact || k < H) a.out[row * H + k] = from_acc<scalar_t>(acc[k]);
  }
}

// Lanes per row: G = next_pow2(ceil(E / (N * kSegEdgeBatch))) with perm
// (random gathers), half that without (contiguous src rows), at most 32: a
// row of average degree takes about one edge batch per lane with perm, two
// without. E counts the perm / src entries, an upper bound of the edges in
// rows (rowptr stays on the device). With perm and H >= 4 the time is that
// of the random 16-32-byte gathers: G and the edge batch change it little
// (benchmarks/RESULTS.md, "Numbers moved out of code comments").
inline int seg_group_log(int64_t E, int64_t N, bool perm) {
  const int64_t per_lane = kSegEdgeBatch * (perm ? 1 : 2);
  const int64_t g = ceil_div(E, std::max<int64_t>(N, 1) * per_lane);
  return log2_pow2(next_pow2(
      std::min<int64_t>(std::max<int64_t>(g, kSegMinGroup), kWarp)));
}

// Rows with more edges than this are summed by the whole block: a group on
// its own would need more than 8 edge batches (2 on grids of at most 4
// blocks per SM, which take as long as their longest row; cf. coop_edges).
inline int64_t seg_coop_edges(int64_t blocks, int G) {
  const int64_t batches = blocks <= int64_t(num_sms()) * 4 ? 2 : 8;
  return std::max<int64_t>(kWarp, batches * G * kSegEdgeBatch);
}

// The narrow kernel for rows of at most kSegMaxBytes (false: not narrow).
// Template choice: 16-byte vectors (V = vec_width, NU = H / V units) when H
// fills whole vectors and src / out are 16-byte aligned; else scalars
// (V = 1) with NU = 1, 4 or kSegMaxBytes / sizeof(scalar_t) >= H slots.
// Grid: one block per kBlock / G rows (row_grid over N / (kWarp / G) warps).
// Rows over the split threshold take the split path of the spmm engine
// (window partials, combined in window order) around the narrow launch.
template <typename scalar_t, typename index_t>
bool launch_segment_sum_narrow(SpmmArgs<scalar_t, index_t> a, int64_t H,
                               const at::TensorOptions& opts, int64_t max_len) {
  constexpr int S = static_cast<int>(sizeof(scalar_t));
  if (H < 1 || H * S > kSegMaxBytes) return false;
  constexpr int VW = vec_width<scalar_t>();
  const bool vec = H % VW == 0 && aligned16(a.values) && aligned16(a.out);
  const int g_log = seg_group_log(a.E, a.N, a.col != nullptr);
  const dim3 grid = row_grid(ceil_div(a.N, kWarp >> g_log), 1);
  a.coop = seg_coop_edges(grid.x, 1 << g_log);
  at::Tensor win, part;
  launch_split_partials(a, make_layout(1, H, vec ? VW : 1, /*channel_tiles=*/true),
                        vec, H, opts, win, part, max_len);
  auto stream = at::cuda::getCurrentCUDAStream();
  auto go = [&](auto v, auto nu) {
    constexpr int V = decltype(v)::value, NU = decltype(nu)::value;
    segment_sum_narrow_kernel<scalar_t, index_t, V, NU>
        <<<grid, kBlock, 0, stream>>>(a, static_cast<int>(H), g_log);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  using one = std::integral_constant<int, 1>;
  if (vec) {
    if (H == VW)
      go(std::integral_constant<int, VW>(), one());
    else  // H == 2 * VW (32 bytes)
      go(std::integral_constant<int, VW>(), std::integral_constant<int, 2>());
  } else if (H == 1) {
    go(one(), one());
  } else if (H <= 4) {
    go(one(), std::integral_constant<int, 4>());
  } else {
    go(one(), std::integral_constant<int, kSegMaxBytes / S>());
  }
  launch_split_combine(a, H);
  return true;
}

at::Tensor spmm_cuda(const at::Tensor& rowptr_in, const at::Tensor& col_in,
                     const c10::optional<at::Tensor>& weight_in,
                     const c10::optional<at::Tensor>& weight_perm_in,
                     const at::Tensor& values_in,
    const c10::optional<at::Tensor>& /*colptr*/,
    const c10::optional<at::Tensor>& /*csc_row*/,
    const c10::optional<at::Tensor>& /*csc_perm*/) {
  check_spmm(rowptr_in, col_in, weight_in, weight_perm_in, values_in);
  c10::cuda::CUDAGuard guard(values_in.device());
  const at::Tensor rowptr = rowptr_in.contiguous();
  const at::Tensor col = col_in.contiguous();
  const at::Tensor values = values_in.contiguous();
  at::Tensor weight, wperm;
  if (weight_in.has_value()) weight = weight_in->contiguous();
  if (weight_perm_in.has_value()) wperm = weight_perm_in->contiguous();
  const int64_t N = rowptr.numel() - 1;
  const int64_t H = values.size(1), C = values.size(2);
  at::Tensor out = at::empty({N, H, C}, values.options());
  if (out.numel() == 0) return out;
  PFA_DISPATCH_FLOATS(values.scalar_type(), "spmm_cuda", [&] {
    PFA_DISPATCH_INDEX(rowptr.scalar_type(), "spmm_cuda", [&] {
      SpmmArgs<scalar_t, index_t> a;
      a.rowptr = rowptr.data_ptr<index_t>();
      a.col = col.data_ptr<index_t>();
      a.weight = weight.defined() ? weight.data_ptr<scalar_t>() : nullptr;
      a.wperm = wperm.defined() ? wperm.data_ptr<index_t>() : nullptr;
      a.values = values.data_ptr<scalar_t>();
      a.out = out.data_ptr<scalar_t>();
      a.N = N;
      a.E = col.numel();
      a.Ns = values.size(0);
      a.Ew = weight.defined() ? weight.size(0) : 0;
      launch_spmm(a, H, C, weight.defined(), values.options(), -1);
    });
  });
  return out;
}

at::Tensor segment_sum_cuda(const at::Tensor& rowptr_in,
                            const c10::optional<at::Tensor>& perm_in,
                            const at::Tensor& src_in) {
  check_segment_sum(rowptr_in, perm_in, src_in);
  c10::cuda::CUDAGuard guard(src_in.device());
  const at::Tensor rowptr = rowptr_in.contiguous();
  const at::Tensor src = src_in.contiguous();
  at::Tensor perm;
  if (perm_in.has_value()) perm = perm_in->contiguous();
  const int64_t N = rowptr.numel() - 1;
  const int64_t H = src.size(1);
  at::Tensor out = at::empty({N, H}, src.options());
  if (out.numel() == 0) return out;
  PFA_DISPATCH_FLOATS(src.scalar_type(), "segment_sum_cuda", [&] {
    PFA_DISPATCH_INDEX(rowptr.scalar_type(), "segment_sum_cuda", [&] {
      SpmmArgs<scalar_t, index_t> a;
      a.rowptr = rowptr.data_ptr<index_t>();
      a.col = perm.defined() ? perm.data_ptr<index_t>() : nullptr;
      a.weight = nullptr;
      a.wperm = nullptr;
      a.values = src.data_ptr<scalar_t>();
      a.out = out.data_ptr<scalar_t>();
      a.N = N;
      a.E = perm.defined() ? perm.numel() : src.size(0);
      a.Ns = src.size(0);
      a.Ew = 0;
      // the rows of segment_sum are a CSR's (a fused op's hint)
      const int64_t max_len = length_hint().rows;
      if (!launch_segment_sum_narrow(a, H, src.options(), max_len))
        launch_spmm(a, 1, H, false, src.options(), max_len);
    });
  });
  return out;
}

}  // namespace
}  // namespace cuda
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, CUDA, m) {
  m.impl("spmm", &pyg_fastattn::cuda::spmm_cuda);
  m.impl("segment_sum", &pyg_fastattn::cuda::segment_sum_cuda);
}
