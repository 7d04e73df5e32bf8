// attention: fused score, row softmax and weighted aggregation (GAT's core).
#include "../common.h"
#include "autocast.h"

namespace pyg_fastattn {

// rowptr [N+1]; col [E]; a_src [Ns, H]; a_dst [N, H]; a_edge [E, H];
// mask [E, H]; values [Ns, H, C]. a_src/a_dst/a_edge/mask are optional, but
// at least one of a_src/a_dst/a_edge is given. All float tensors share
// values' dtype.
void check_attention(const at::Tensor& rowptr, const at::Tensor& col,
                     const c10::optional<at::Tensor>& a_src,
                     const c10::optional<at::Tensor>& a_dst,
                     const c10::optional<at::Tensor>& a_edge,
                     const c10::optional<at::Tensor>& mask,
                     const at::Tensor& values,
                     const c10::optional<at::Tensor>& bias) {
  check_rowptr(rowptr);
  check_index(col, rowptr, "col");
  check_float(values, "values", 3);
  check_same_device(rowptr, values, "rowptr", "values");
  PFA_CHECK(a_src.has_value() || a_dst.has_value() || a_edge.has_value(),
            "attention needs at least one of `a_src`, `a_dst`, `a_edge`");
  const int64_t H = values.size(1);
  const int64_t N = rowptr.numel() - 1;
  struct Arg { const c10::optional<at::Tensor>* t; const char* name; int64_t rows; const char* what; };
  const Arg args[] = {{&a_src, "a_src", values.size(0), "one row per source node"},
                      {&a_dst, "a_dst", N, "one row per destination node"},
                      {&a_edge, "a_edge", col.numel(), "one row per edge"},
                      {&mask, "mask", col.numel(), "one row per edge"}};
  for (const auto& arg : args) {
    if (!arg.t->has_value()) continue;
    const at::Tensor& t = **arg.t;
    check_float(t, arg.name, 2);
    check_same_device(rowptr, t, "rowptr", arg.name);
    check_same_dtype(values, t, "values", arg.name);
    check_size(t, 0, arg.rows, arg.name, arg.what);
    check_size(t, 1, H, arg.name, "heads of `values`");
  }
  if (bias.has_value()) {
    check_same_device(rowptr, *bias, "rowptr", "bias");
    check_same_dtype(values, *bias, "values", "bias");
    PFA_CHECK(bias->numel() == H * values.size(2),
              "`bias` must have H * C = ", H * values.size(2),
              " elements, got ", bias->numel());
  }
}

void check_attention_backward(const at::Tensor& rowptr, const at::Tensor& col,
                              const at::Tensor& colptr, const at::Tensor& row,
                              const at::Tensor& perm,
                              const c10::optional<at::Tensor>& a_src,
                              const c10::optional<at::Tensor>& a_dst,
                              const c10::optional<at::Tensor>& a_edge,
                              const c10::optional<at::Tensor>& mask,
                              const at::Tensor& values, const at::Tensor& out,
                              const at::Tensor& lse,
                              const at::Tensor& grad_out,
                              const c10::optional<at::Tensor>& bias) {
  check_attention(rowptr, col, a_src, a_dst, a_edge, mask, values, bias);
  const int64_t N = rowptr.numel() - 1;
  check_index(colptr, rowptr, "colptr");
  check_size(colptr, 0, values.size(0) + 1, "colptr", "one entry per source node plus one");
  for (auto* t : {&row, &perm}) {
    const char* name = t == &row ? "row" : "perm";
    check_index(*t, rowptr, name);
    check_size(*t, 0, col.numel(), name, "one entry per edge");
  }
  for (auto* t : {&out, &grad_out}) {
    const char* name = t == &out ? "out" : "grad_out";
    check_float(*t, name, 3);
    check_same_device(rowptr, *t, "rowptr", name);
    check_same_dtype(values, *t, "values", name);
    PFA_CHECK(t->size(0) == N && t->size(1) == values.size(1) &&
                  t->size(2) == values.size(2),
              "`", name, "` must have shape [", N, ", ", values.size(1), ", ",
              values.size(2), "], got ", t->sizes());
  }
  check_float(lse, "lse", 2);
  check_same_device(rowptr, lse, "rowptr", "lse");
  PFA_CHECK(lse.scalar_type() == opmath_type(values.scalar_type()),
            "`lse` must have dtype ", opmath_type(values.scalar_type()));
  PFA_CHECK(lse.size(0) == N && lse.size(1) == values.size(1),
            "`lse` must have shape [", N, ", ", values.size(1), "], got ",
            lse.sizes());
}

}  // namespace pyg_fastattn

PFA_REGISTER_AUTOCAST("attention")
