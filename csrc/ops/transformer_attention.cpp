// transformer_attention: input checks shared by the CPU and CUDA kernels.
// Schema, fake and autograd live in pyg_fastattn/ops/transformer.py.
#include "../common.h"
#include "autocast.h"

namespace pyg_fastattn {

void check_transformer_attention(const at::Tensor& rowptr,
                                 const at::Tensor& col,
                                 const at::Tensor& query,
                                 const at::Tensor& key,
                                 const at::Tensor& value,
                                 const c10::optional<at::Tensor>& edge_term,
                                 const c10::optional<at::Tensor>& mask) {
  check_rowptr(rowptr);
  check_index(col, rowptr, "col");
  check_float(key, "key", 3);
  check_same_device(rowptr, key, "rowptr", "key");
  const int64_t N = rowptr.numel() - 1, E = col.numel();
  check_rows(key, "key", query, "query", N, "one row per destination node", 3);
  check_rows(key, "key", value, "value", key.size(0),
             "one row per row of `key`", 3);
  if (edge_term.has_value())
    check_rows(key, "key", *edge_term, "edge_term", E, "one row per edge", 3);
  if (mask.has_value())
    check_rows(key, "key", *mask, "mask", E, "one row per edge", 2);
}

void check_transformer_attention_backward(
    const at::Tensor& rowptr, const at::Tensor& col, const at::Tensor& colptr,
    const at::Tensor& csc_row, const at::Tensor& csc_perm,
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const c10::optional<at::Tensor>& edge_term,
    const c10::optional<at::Tensor>& mask, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& grad_out) {
  check_transformer_attention(rowptr, col, query, key, value, edge_term, mask);
  check_backward_state(rowptr, col, colptr, csc_row, csc_perm, key, "key", out,
                       lse, grad_out);
}

}  // namespace pyg_fastattn

PFA_REGISTER_AUTOCAST("transformer_attention")
