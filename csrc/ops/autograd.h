// Helpers of the ops' C++ autograd kernels.
#pragma once

#include <ATen/ATen.h>
#include <torch/autograd.h>

#include <array>
#include <tuple>
#include <vector>

namespace pyg_fastattn {

// The transpose (colptr, row, perm) of a CSR graph for a backward whose
// caller passed none: csr_to_csc's ATen ops (pyg_fastattn/ops/csr.py), which
// fake tensors (tracing) and symbolic sizes run too.
inline std::tuple<at::Tensor, at::Tensor, at::Tensor> build_csc(
    const at::Tensor& rowptr, const at::Tensor& col,
    const c10::SymInt& num_cols) {
  const c10::SymInt N = rowptr.sym_numel() - 1, E = col.sym_numel();
  const at::ScalarType dt = rowptr.scalar_type();
  const at::Tensor pos = at::arange(c10::Scalar(E), rowptr.options());
  const at::Tensor row = at::searchsorted(rowptr.slice(0, 1).contiguous(),
                                          pos, dt == at::kInt, true);
  const at::Tensor key = col.masked_fill(row.ge(c10::Scalar(N)),
                                         c10::Scalar(num_cols));
  const at::Tensor perm = at::argsort(key, true);
  const at::Tensor bounds =
      at::arange(c10::Scalar(num_cols + 1), key.options());
  const at::Tensor colptr =
      at::searchsorted(key.index_select(0, perm), bounds).to(dt);
  return {colptr, row.index_select(0, perm).to(dt), perm.to(dt)};
}

inline at::Tensor value_or_undefined(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? *t : at::Tensor();
}

inline c10::optional<at::Tensor> defined_or_none(const at::Tensor& t) {
  return t.defined() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

// needs_input_grad counts only the tensors that were passed: the position
// among them of each differentiable argument (by its argument index in
// grad_args), or -1 where it was None.
template <size_t N, size_t K>
std::vector<int64_t> grad_edges(const std::array<bool, N>& given,
                                const std::array<int, K>& grad_args) {
  std::vector<int64_t> edge(K, -1);
  for (size_t k = 0; k < K; ++k) {
    if (!given[grad_args[k]]) continue;
    int64_t n = 0;
    for (int i = 0; i < grad_args[k]; ++i) n += given[i];
    edge[k] = n;
  }
  return edge;
}

// In the backward: which of the K differentiable inputs need a gradient,
// from the positions grad_edges gave (saved as "edge").
template <size_t K>
std::array<bool, K> needed_grads(torch::autograd::AutogradContext* ctx) {
  const auto edge = ctx->saved_data["edge"].toIntVector();
  std::array<bool, K> need{};
  for (size_t k = 0; k < K; ++k)
    need[k] = edge[k] >= 0 && ctx->needs_input_grad(edge[k]);
  return need;
}

// What the attention ops' forward keeps besides tensors: the length hints
// for the backward; lse gets no gradient, and none is materialized for it.
inline void save_attention_state(torch::autograd::AutogradContext* ctx,
                                 const at::Tensor& lse, int64_t max_row_len,
                                 int64_t max_col_len) {
  ctx->saved_data["max_row_len"] = max_row_len;
  ctx->saved_data["max_col_len"] = max_col_len;
  ctx->mark_non_differentiable({lse});
  ctx->set_materialize_grads(false);
}

}  // namespace pyg_fastattn
