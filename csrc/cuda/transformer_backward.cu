// transformer_attention_backward(_) on CUDA: the gradients of
// transformer_attention in a destination pass (gatv2_rows.cuh, DOT) and a
// source pass over the transpose (transformer_bwd_cols.cu), without atomics;
// the in-place form writes them over out, key and value.
#include "gatv2_rows.cuh"

namespace pyg_fastattn {
namespace cuda {
namespace gatv2 {
namespace {

// The gradients into g_q [N, H, C], g_k and g_v [Ns, H, C] (contiguous),
// which may be out, key and value themselves: pass 1 reads out[i] before it
// writes g_q[i], pass 2 reads key[j] and value[j] before it writes g_k[j] and
// g_v[j], and a split row or column is written by split_sum after the pass.
at::Tensor backward_into(
    const at::Tensor& rowptr_in, const at::Tensor& col_in,
    const at::Tensor& colptr_in, const at::Tensor& csc_row_in,
    const at::Tensor& csc_perm_in, const at::Tensor& query_in,
    const at::Tensor& key_in, const at::Tensor& value_in,
    const c10::optional<at::Tensor>& edge_term_in,
    const c10::optional<at::Tensor>& mask_in, double scale,
    const at::Tensor& out_in, const at::Tensor& lse_in,
    const at::Tensor& grad_out_in, bool need_edge, int64_t max_row_len,
    int64_t max_col_len, at::Tensor& g_q, at::Tensor& g_k, at::Tensor& g_v) {
  c10::cuda::CUDAGuard guard(key_in.device());
  const at::Tensor rowptr = rowptr_in.contiguous(), col = col_in.contiguous(),
                   colptr = colptr_in.contiguous(),
                   csc_row = csc_row_in.contiguous(),
                   csc_perm = csc_perm_in.contiguous(),
                   query = query_in.contiguous(), key = key_in.contiguous(),
                   value = value_in.contiguous(),
                   edge_term = opt_contig(edge_term_in),
                   mask = opt_contig(mask_in), fout = out_in.contiguous(),
                   lse = lse_in.contiguous(), grad_out = grad_out_in.contiguous();
  const int64_t N = rowptr.numel() - 1, E = col.numel(), H = key.size(1),
                C = key.size(2), HC = H * C;
  const bool want_edge = need_edge && edge_term.defined();
  const auto opts = key.options();
  at::Tensor g_e = want_edge ? at::empty({E, H, C}, opts) : at::empty({0}, opts);
  if (HC == 0) return g_e;
  if (N == 0) {  // no edge lies in a row
    g_e.zero_();
    g_k.zero_();
    g_v.zero_();
    return g_e;
  }
  PFA_DISPATCH_FLOATS(key.scalar_type(), "transformer_attention_backward_cuda", [&] {
    PFA_DISPATCH_INDEX(rowptr.scalar_type(), "transformer_attention_backward_cuda", [&] {
      auto a = make_dot_args<scalar_t, index_t>(rowptr, col, query, key, value,
                                                edge_term, mask, scale);
      set_backward_inputs(a, colptr, csc_row, csc_perm, fout, lse, grad_out);
      a.g_l = g_k.data_ptr<scalar_t>();
      a.g_r = g_q.data_ptr<scalar_t>();
      a.g_v = g_v.data_ptr<scalar_t>();
      a.g_e = want_edge ? g_e.data_ptr<scalar_t>() : nullptr;
      constexpr int VW = gatv2_vec<scalar_t>();
      const bool vec = C % VW == 0 &&
                       all_aligned({a.x_l, a.x_r, a.value, a.edge_term, a.fout,
                                    a.grad_out, a.g_l, a.g_r, a.g_v, a.g_e});
      run_backward<true>(a, H, C, vec, opts, nullptr, max_row_len,
                         max_col_len);
    });
  });
  return g_e;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
transformer_attention_backward_cuda(
    const at::Tensor& rowptr, const at::Tensor& col, const at::Tensor& colptr,
    const at::Tensor& csc_row, const at::Tensor& csc_perm,
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const c10::optional<at::Tensor>& edge_term,
    const c10::optional<at::Tensor>& mask, double scale, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& grad_out, bool need_edge,
    int64_t max_row_len, int64_t max_col_len) {
  check_transformer_attention_backward(rowptr, col, colptr, csc_row, csc_perm,
                                       query, key, value, edge_term, mask, out,
                                       lse, grad_out);
  const auto opts = key.options();
  at::Tensor g_q = at::empty(query.sizes(), opts);
  at::Tensor g_k = at::empty(key.sizes(), opts);
  at::Tensor g_v = at::empty(value.sizes(), opts);
  at::Tensor g_e = backward_into(rowptr, col, colptr, csc_row, csc_perm, query,
                                 key, value, edge_term, mask, scale, out, lse,
                                 grad_out, need_edge, max_row_len, max_col_len,
                                 g_q, g_k, g_v);
  return {g_q, g_k, g_v, g_e};
}

// In place: out becomes grad_query, key grad_key, value grad_value.
at::Tensor transformer_attention_backward_cuda_(
    const at::Tensor& rowptr, const at::Tensor& col, const at::Tensor& colptr,
    const at::Tensor& csc_row, const at::Tensor& csc_perm,
    const at::Tensor& query, at::Tensor& key, at::Tensor& value,
    const c10::optional<at::Tensor>& edge_term,
    const c10::optional<at::Tensor>& mask, double scale, at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& grad_out, bool need_edge,
    int64_t max_row_len, int64_t max_col_len) {
  check_transformer_attention_backward(rowptr, col, colptr, csc_row, csc_perm,
                                       query, key, value, edge_term, mask, out,
                                       lse, grad_out);
  TORCH_CHECK(out.is_contiguous() && key.is_contiguous() &&
                  value.is_contiguous(),
              "transformer_attention_backward_: `out`, `key` and `value` must "
              "be contiguous (they receive the gradients)");
  TORCH_CHECK(out.scalar_type() == key.scalar_type() &&
                  value.scalar_type() == key.scalar_type(),
              "transformer_attention_backward_: `out`, `key` and `value` must "
              "share a dtype");
  return backward_into(rowptr, col, colptr, csc_row, csc_perm, query, key,
                       value, edge_term, mask, scale, out, lse, grad_out,
                       need_edge, max_row_len, max_col_len, out, key, value);
}

}  // namespace
}  // namespace gatv2
}  // namespace cuda
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, CUDA, m) {
  m.impl("transformer_attention_backward",
         &pyg_fastattn::cuda::gatv2::transformer_attention_backward_cuda);
  m.impl("transformer_attention_backward_",
         &pyg_fastattn::cuda::gatv2::transformer_attention_backward_cuda_);
}
