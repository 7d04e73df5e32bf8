// gatv2_attention_backward on CUDA: the gradients of gatv2_attention in a
// destination pass (gatv2_rows.cuh) and a source pass over the transpose
// (gatv2_bwd_cols.cu), without atomics.
#include "gatv2_rows.cuh"

namespace pyg_fastattn {
namespace cuda {
namespace gatv2 {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
gatv2_attention_backward_cuda(
    const at::Tensor& rowptr_in, const at::Tensor& col_in,
    const at::Tensor& colptr_in, const at::Tensor& csc_row_in,
    const at::Tensor& csc_perm_in, const at::Tensor& x_l_in,
    const at::Tensor& x_r_in, const c10::optional<at::Tensor>& edge_term_in,
    const at::Tensor& att_in, const c10::optional<at::Tensor>& mask_in,
    double negative_slope, const c10::optional<at::Tensor>& bias_in,
    const at::Tensor& out_in, const at::Tensor& lse_in,
    const at::Tensor& grad_out_in, bool need_edge, int64_t max_row_len,
    int64_t max_col_len) {
  check_gatv2_attention_backward(rowptr_in, col_in, colptr_in, csc_row_in,
                                 csc_perm_in, x_l_in, x_r_in, edge_term_in,
                                 att_in, mask_in, bias_in, out_in, lse_in,
                                 grad_out_in);
  c10::cuda::CUDAGuard guard(x_l_in.device());
  const at::Tensor rowptr = rowptr_in.contiguous(), col = col_in.contiguous(),
                   colptr = colptr_in.contiguous(),
                   csc_row = csc_row_in.contiguous(),
                   csc_perm = csc_perm_in.contiguous(),
                   x_l = x_l_in.contiguous(), x_r = x_r_in.contiguous(),
                   att = att_in.contiguous(), edge_term = opt_contig(edge_term_in),
                   mask = opt_contig(mask_in), bias = opt_contig(bias_in),
                   fout = out_in.contiguous(),
                   lse = lse_in.contiguous(), grad_out = grad_out_in.contiguous();
  const int64_t N = rowptr.numel() - 1, E = col.numel(), Ns = x_l.size(0),
                H = x_l.size(1), C = x_l.size(2), HC = H * C;
  const bool want_edge = need_edge && edge_term.defined();
  const auto opts = x_l.options();
  at::Tensor g_l = at::empty({Ns, H, C}, opts);
  at::Tensor g_r = at::empty({N, H, C}, opts);
  at::Tensor g_e = want_edge ? at::empty({E, H, C}, opts) : at::empty({0}, opts);
  at::Tensor g_att = at::empty({H, C}, opts);
  if (HC == 0) return {g_l, g_r, g_e, g_att};
  if (N == 0) {  // no edge lies in a row
    g_att.zero_();
    g_e.zero_();
  }
  if (N == 0 && Ns > 0) g_l.zero_();
  if (N == 0) return {g_l, g_r, g_e, g_att};
  PFA_DISPATCH_FLOATS(x_l.scalar_type(), "gatv2_attention_backward_cuda", [&] {
    PFA_DISPATCH_INDEX(rowptr.scalar_type(), "gatv2_attention_backward_cuda", [&] {
      auto a = make_args<scalar_t, index_t>(rowptr, col, x_l, x_r, edge_term,
                                            att, mask, bias, negative_slope);
      set_backward_inputs(a, colptr, csc_row, csc_perm, fout, lse, grad_out);
      a.g_l = g_l.data_ptr<scalar_t>();
      a.g_r = g_r.data_ptr<scalar_t>();
      a.g_e = want_edge ? g_e.data_ptr<scalar_t>() : nullptr;
      constexpr int VW = gatv2_vec<scalar_t>();
      const bool vec = C % VW == 0 &&
                       all_aligned({a.x_l, a.x_r, a.edge_term, a.att, a.bias,
                                    a.fout, a.grad_out, a.g_l, a.g_r, a.g_e});
      run_backward<false>(a, H, C, vec, opts, &g_att, max_row_len,
                          max_col_len);
    });
  });
  return {g_l, g_r, g_e, g_att};
}

}  // namespace
}  // namespace gatv2
}  // namespace cuda
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, CUDA, m) {
  m.impl("gatv2_attention_backward",
         &pyg_fastattn::cuda::gatv2::gatv2_attention_backward_cuda);
}
