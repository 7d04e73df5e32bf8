// spmm and segment_sum on CUDA (the aggregation engine of aggregate.cuh).
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
};

// w(e, h) = weight[wperm[e] or e, h], or 1 without weight.
template <typename scalar_t, typename index_t, int KHQ>
struct SpmmWeight {
  const scalar_t* __restrict__ w_;
  const index_t* __restrict__ wperm;
  int64_t Ew;
  int H;
  int h[KHQ];
  __device__ __forceinline__ bool edge(int64_t e, int64_t& aux) const {
    if (w_ == nullptr) return true;
    aux = wperm != nullptr ? static_cast<int64_t>(wperm[e]) : e;
    return aux >= 0 && aux < Ew;
  }
  __device__ __forceinline__ acc_t<scalar_t> weight_of(int64_t aux,
                                                       int kh) const {
    return to_acc(w_[aux * H + h[kh]]);
  }
  __device__ __forceinline__ acc_t<scalar_t> weight(int64_t, int64_t,
                                                    int64_t aux,
                                                    int kh) const {
    return w_ == nullptr ? acc_t<scalar_t>(1) : weight_of(aux, kh);
  }
};

// One warp per (row, feature tile); lanes split edges x heads x units (see
// TileLayout): lane (es, hs, cl) walks edges es, es + ES, ... of the row and
// accumulates its 16-byte units of values[col[e]] times the edge weight, then
// the ES edge slots are summed with shuffles and slot 0 stores. Rows with
// more than coop_edges(...) edges are shared by the 8 warps of the block (edges
// interleaved over the warps, partial sums combined in shared memory).
template <typename scalar_t, typename index_t, int V, int KHQ>
__global__ void __launch_bounds__(kBlock)
    spmm_kernel(SpmmArgs<scalar_t, index_t> a, TileLayout L) {
  using A = acc_t<scalar_t>;
  __shared__ int64_t s_long[kWarpsPerBlock];
  __shared__ A s_red[kWarpsPerBlock * kWarp * KHQ * V];
  const int64_t D = static_cast<int64_t>(L.H) * L.C;
  run_rows(a.rowptr, a.N, a.E, a.coop, s_long, [&](int64_t row, int rank, int nranks) {
    const LaneTile<KHQ> T =
        decode_tile<KHQ>(L, V, row, static_cast<int>(blockIdx.y), lane_id());
    const int64_t i = T.row;
    int64_t start, end;
    row_range(a.rowptr, i, a.E, start, end);
    SpmmWeight<scalar_t, index_t, KHQ> fn;
    fn.w_ = a.weight;
    fn.wperm = a.wperm;
    fn.Ew = a.Ew;
    fn.H = L.H;
#pragma unroll
    for (int kh = 0; kh < KHQ; ++kh) fn.h[kh] = T.h[kh];
    A acc[KHQ][V];
    zero_acc<V, KHQ>(acc);
    gather_accumulate<V, KHQ>(T, rank, nranks, start, end, a.col, a.Ns, D,
                              a.values, fn, acc);
    reduce_edge_slots<V, KHQ>(T, acc);
    if (nranks > 1) block_sum<V, KHQ>(acc, s_red, rank, nranks);
    if (rank == 0) store_units<V, KHQ>(T, acc, a.out + i * D);
  });
}

// values viewed as [Ns, H, C]; out is [N, H, C]. Without weight the heads do
// not matter and the row is treated as one head of H * C channels.
template <typename scalar_t, typename index_t>
void launch_spmm(SpmmArgs<scalar_t, index_t> a, int64_t H, int64_t C,
                 bool weighted) {
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
  auto stream = at::cuda::getCurrentCUDAStream();
  dispatch_vk<scalar_t>(vec, L.khq, [&](auto v, auto k) {
    spmm_kernel<scalar_t, index_t, decltype(v)::value, decltype(k)::value>
        <<<grid, kBlock, 0, stream>>>(a, L);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor spmm_cuda(const at::Tensor& rowptr_in, const at::Tensor& col_in,
                     const c10::optional<at::Tensor>& weight_in,
                     const c10::optional<at::Tensor>& weight_perm_in,
                     const at::Tensor& values_in) {
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
      launch_spmm(a, H, C, weight.defined());
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
      launch_spmm(a, 1, H, false);
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
