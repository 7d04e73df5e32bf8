// gatv2_attention on CUDA: GATv2's per-edge score
// att . leaky_relu(x_l[j] + x_r[i] + edge_term[e]) computed on the fly with
// an online row softmax and the weighted aggregation (gatv2_fwd.cuh). The
// backward is in gatv2_backward.cu and gatv2_bwd_cols.cu.
#include "gatv2_fwd.cuh"

namespace pyg_fastattn {
namespace cuda {
namespace gatv2 {
namespace {

std::tuple<at::Tensor, at::Tensor> gatv2_attention_cuda(
    const at::Tensor& rowptr_in, const at::Tensor& col_in,
    const at::Tensor& x_l_in, const at::Tensor& x_r_in,
    const c10::optional<at::Tensor>& edge_term_in, const at::Tensor& att_in,
    const c10::optional<at::Tensor>& mask_in, double negative_slope,
    const c10::optional<at::Tensor>& bias_in,
    const c10::optional<at::Tensor>& /*colptr*/,
    const c10::optional<at::Tensor>& /*csc_row*/,
    const c10::optional<at::Tensor>& /*csc_perm*/, int64_t max_row_len,
    int64_t /*max_col_len*/) {
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
      constexpr int VW = gatv2_vec<scalar_t>();
      const bool vec = C % VW == 0 && all_aligned({a.x_l, a.x_r, a.edge_term,
                                                   a.att, a.bias, a.out});
      run_forward<false>(a, H, C, vec, x_l.options(), max_row_len);
    });
  });
  return {out, lse};
}

}  // namespace
}  // namespace gatv2
}  // namespace cuda
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, CUDA, m) {
  m.impl("gatv2_attention", &pyg_fastattn::cuda::gatv2::gatv2_attention_cuda);
}
