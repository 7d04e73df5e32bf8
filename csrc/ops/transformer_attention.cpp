// transformer_attention: input checks shared by the CPU and CUDA kernels.
// Schema, fake and autograd live in pyg_fastattn/ops/transformer.py.
#include "../common.h"

namespace pyg_fastattn {
namespace {

// t: `rows` rows (what: their meaning) of key's heads (and channels when
// dim == 3), key's dtype and device.
void check_rows(const at::Tensor& key, const at::Tensor& t, const char* name,
                int64_t rows, const char* what, int64_t dim) {
  check_float(t, name, dim);
  check_same_device(key, t, "key", name);
  check_same_dtype(key, t, "key", name);
  check_size(t, 0, rows, name, what);
  check_size(t, 1, key.size(1), name, "heads of `key`");
  if (dim == 3) check_size(t, 2, key.size(2), name, "channels of `key`");
}

}  // namespace

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
  check_rows(key, query, "query", N, "one row per destination node", 3);
  check_rows(key, value, "value", key.size(0), "one row per row of `key`", 3);
  if (edge_term.has_value())
    check_rows(key, *edge_term, "edge_term", E, "one row per edge", 3);
  if (mask.has_value()) check_rows(key, *mask, "mask", E, "one row per edge", 2);
}

void check_transformer_attention_backward(
    const at::Tensor& rowptr, const at::Tensor& col, const at::Tensor& colptr,
    const at::Tensor& csc_row, const at::Tensor& csc_perm,
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const c10::optional<at::Tensor>& edge_term,
    const c10::optional<at::Tensor>& mask, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& grad_out) {
  check_transformer_attention(rowptr, col, query, key, value, edge_term, mask);
  const int64_t N = rowptr.numel() - 1;
  check_index(colptr, rowptr, "colptr");
  check_size(colptr, 0, key.size(0) + 1, "colptr",
             "one entry per source node plus one");
  check_index(csc_row, rowptr, "csc_row");
  check_size(csc_row, 0, col.numel(), "csc_row", "one entry per edge");
  check_index(csc_perm, rowptr, "csc_perm");
  check_size(csc_perm, 0, col.numel(), "csc_perm", "one entry per edge");
  check_rows(key, out, "out", N, "one row per destination node", 3);
  check_rows(key, grad_out, "grad_out", N, "one row per destination node", 3);
  check_float(lse, "lse", 2);
  check_same_device(rowptr, lse, "rowptr", "lse");
  PFA_CHECK(lse.scalar_type() == opmath_type(key.scalar_type()),
            "`lse` must have dtype ", opmath_type(key.scalar_type()), ", got ",
            lse.scalar_type());
  PFA_CHECK(lse.size(0) == N && lse.size(1) == key.size(1),
            "`lse` must have shape [", N, ", ", key.size(1), "], got ",
            lse.sizes());
}

}  // namespace pyg_fastattn
