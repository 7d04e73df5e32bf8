// transformer_attention on CUDA: TransformerConv's per-edge score
// scale * <query[i], key[j] + edge_term[e]> computed on the fly with an
// online row softmax and the aggregation of value[j] + edge_term[e]
// (gatv2_fwd.cuh, DOT). The backward is in transformer_backward.cu and
// transformer_bwd_cols.cu.
#include "gatv2_fwd.cuh"

namespace pyg_fastattn {
namespace cuda {
namespace gatv2 {
namespace {

std::tuple<at::Tensor, at::Tensor> transformer_attention_cuda(
    const at::Tensor& rowptr_in, const at::Tensor& col_in,
    const at::Tensor& query_in, const at::Tensor& key_in,
    const at::Tensor& value_in, const c10::optional<at::Tensor>& edge_term_in,
    const c10::optional<at::Tensor>& mask_in, double scale,
    const c10::optional<at::Tensor>& /*colptr*/,
    const c10::optional<at::Tensor>& /*csc_row*/,
    const c10::optional<at::Tensor>& /*csc_perm*/, int64_t max_row_len,
    int64_t /*max_col_len*/, bool /*grads_in_place*/) {
  check_transformer_attention(rowptr_in, col_in, query_in, key_in, value_in,
                              edge_term_in, mask_in);
  c10::cuda::CUDAGuard guard(key_in.device());
  const at::Tensor rowptr = rowptr_in.contiguous(), col = col_in.contiguous(),
                   query = query_in.contiguous(), key = key_in.contiguous(),
                   value = value_in.contiguous(),
                   edge_term = opt_contig(edge_term_in),
                   mask = opt_contig(mask_in);
  const int64_t N = rowptr.numel() - 1, H = key.size(1), C = key.size(2);
  at::Tensor out = at::empty({N, H, C}, key.options());
  at::Tensor lse = at::empty({N, H}, key.options().dtype(opmath_type(key.scalar_type())));
  if (N == 0 || H * C == 0) {
    lse.fill_(-std::numeric_limits<double>::infinity());
    return {out.zero_(), lse};
  }
  PFA_DISPATCH_FLOATS(key.scalar_type(), "transformer_attention_cuda", [&] {
    PFA_DISPATCH_INDEX(rowptr.scalar_type(), "transformer_attention_cuda", [&] {
      using A = acc_t<scalar_t>;
      auto a = make_dot_args<scalar_t, index_t>(rowptr, col, query, key, value,
                                                edge_term, mask, scale);
      a.out = out.data_ptr<scalar_t>();
      a.lse_out = lse.data_ptr<A>();
      constexpr int VW = gatv2_vec<scalar_t>();
      const bool vec = C % VW == 0 && all_aligned({a.x_l, a.x_r, a.value,
                                                   a.edge_term, a.out});
      run_forward<true>(a, H, C, vec, key.options(), max_row_len);
    });
  });
  return {out, lse};
}

}  // namespace
}  // namespace gatv2
}  // namespace cuda
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, CUDA, m) {
  m.impl("transformer_attention",
         &pyg_fastattn::cuda::gatv2::transformer_attention_cuda);
}
