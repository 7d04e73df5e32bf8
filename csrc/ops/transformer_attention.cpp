// transformer_attention: input checks shared by the CPU and CUDA kernels,
// and the autograd kernel (C++, so forward and backward cost no Python).
// Schema, fakes and a Python twin of the autograd formula (for builds
// without this extension) live in pyg_fastattn/ops/transformer.py.
#include <torch/autograd.h>
#include <torch/csrc/autograd/variable.h>

#include "../common.h"
#include "autocast.h"
#include "autograd.h"

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

namespace {

using OptTensor = c10::optional<at::Tensor>;
using Outputs2 = std::tuple<at::Tensor, at::Tensor>;
using Outputs4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Outputs2 call_forward(const at::Tensor& rowptr, const at::Tensor& col,
                      const at::Tensor& query, const at::Tensor& key,
                      const at::Tensor& value, const OptTensor& edge_term,
                      const OptTensor& mask, double scale,
                      const OptTensor& colptr, const OptTensor& csc_row,
                      const OptTensor& csc_perm, int64_t max_row_len,
                      int64_t max_col_len, bool grads_in_place) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pyg_fastattn::transformer_attention", "")
          .typed<Outputs2(const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const OptTensor&,
                          const OptTensor&, double, const OptTensor&,
                          const OptTensor&, const OptTensor&, int64_t,
                          int64_t, bool)>();
  return op.call(rowptr, col, query, key, value, edge_term, mask, scale,
                 colptr, csc_row, csc_perm, max_row_len, max_col_len,
                 grads_in_place);
}

// The backward ops' arguments, in schema order.
#define PFA_TRANSFORMER_BWD_ARGS(KEY, VALUE, OUT)                              \
  const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, \
      const at::Tensor&, const at::Tensor&, KEY, VALUE, const OptTensor&,     \
      const OptTensor&, double, OUT, const at::Tensor&, const at::Tensor&,    \
      bool, int64_t, int64_t

Outputs4 call_backward(const std::vector<at::Tensor>& s, const OptTensor& e,
                       const OptTensor& m, double scale,
                       const at::Tensor& grad_out, bool need_edge,
                       int64_t max_row_len, int64_t max_col_len) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pyg_fastattn::transformer_attention_backward",
                             "")
          .typed<Outputs4(PFA_TRANSFORMER_BWD_ARGS(
              const at::Tensor&, const at::Tensor&, const at::Tensor&))>();
  return op.call(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], e, m, scale,
                 s[8], s[9], grad_out, need_edge, max_row_len, max_col_len);
}

at::Tensor call_backward_(std::vector<at::Tensor>& s, const OptTensor& e,
                          const OptTensor& m, double scale,
                          const at::Tensor& grad_out, bool need_edge,
                          int64_t max_row_len, int64_t max_col_len) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pyg_fastattn::transformer_attention_backward_",
                             "")
          .typed<at::Tensor(PFA_TRANSFORMER_BWD_ARGS(
              at::Tensor&, at::Tensor&, at::Tensor&))>();
  return op.call(s[0], s[1], s[2], s[3], s[4], s[5], s[6], s[7], e, m, scale,
                 s[8], s[9], grad_out, need_edge, max_row_len, max_col_len);
}
#undef PFA_TRANSFORMER_BWD_ARGS

const void* storage_of(const at::Tensor& t) {
  return t.defined() ? t.storage().data() : nullptr;
}

// out, key and value may take the gradients: plain tensors (not traced:
// fake and functional tensors get the out-of-place op; none of the six
// without storage: batched by vmap or is_grads_batched), contiguous, of one
// dtype, sharing memory with none of the other inputs.
bool may_overwrite(const at::Tensor& query, const at::Tensor& key,
                   const at::Tensor& value, const at::Tensor& edge_term,
                   const at::Tensor& out, const at::Tensor& grad_out) {
  for (const at::Tensor* t : {&query, &key, &value, &edge_term, &out,
                              &grad_out})
    if (t->defined() && !t->has_storage()) return false;
  for (const at::Tensor* t : {&out, &key, &value}) {
    if (is_traced(*t) || !t->is_contiguous() ||
        t->scalar_type() != key.scalar_type())
      return false;
  }
  const void* own[3] = {storage_of(out), storage_of(key), storage_of(value)};
  const void* other[3] = {storage_of(query), storage_of(edge_term),
                          storage_of(grad_out)};
  if (own[0] == own[1] || own[0] == own[2] || own[1] == own[2]) return false;
  for (const void* a : own)
    for (const void* b : other)
      if (a == b) return false;
  return true;
}

// Differentiable inputs (query, key, value, edge_term) by argument position.
constexpr std::array<int, 4> kGradArgs = {2, 3, 4, 5};
constexpr int kNumArgs = 14;

class TransformerAttentionFunction
    : public OnceDifferentiableFunction<TransformerAttentionFunction> {
 public:
  static constexpr const char* kName = "transformer_attention";

  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const at::Tensor& rowptr,
      const at::Tensor& col, const at::Tensor& query, const at::Tensor& key,
      const at::Tensor& value, const OptTensor& edge_term,
      const OptTensor& mask, double scale, const OptTensor& colptr,
      const OptTensor& csc_row, const OptTensor& csc_perm,
      int64_t max_row_len, int64_t max_col_len, bool grads_in_place) {
    Outputs2 r;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      r = call_forward(rowptr, col, query, key, value, edge_term, mask, scale,
                       colptr, csc_row, csc_perm, max_row_len, max_col_len,
                       grads_in_place);
    }
    auto& [out, lse] = r;
    auto val = value_or_undefined;
    ctx->save_for_backward({rowptr, col, query, key, value, val(edge_term),
                            val(mask), keep_output(ctx, out), lse,
                            val(colptr), val(csc_row), val(csc_perm)});
    // needs_input_grad counts the tensors passed: edge_term's index is 5
    // after rowptr, col, query, key and value.
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["in_place"] = grads_in_place;
    save_attention_state(ctx, max_row_len, max_col_len);
    return {out, lse};
  }

  static torch::autograd::variable_list gradients(
      torch::autograd::AutogradContext* ctx,
      const torch::autograd::variable_list& grads) {
    torch::autograd::variable_list res(kNumArgs);
    if (!grads[0].defined()) return res;
    auto v = ctx->get_saved_variables();
    at::Tensor rowptr = v[0], col = v[1], query = v[2], key = v[3],
               value = v[4], edge_term = v[5], mask = v[6], out = v[7],
               lse = v[8], colptr = v[9], csc_row = v[10], csc_perm = v[11];
    const bool has_edge = edge_term.defined();
    const bool need_edge = has_edge && ctx->needs_input_grad(5);
    const double scale = ctx->saved_data["scale"].toDouble();
    const int64_t max_row = ctx->saved_data["max_row_len"].toInt();
    const int64_t max_col = ctx->saved_data["max_col_len"].toInt();
    const bool in_place = ctx->saved_data["in_place"].toBool();
    out = kept_output(ctx, out, [&] {
      return std::get<0>(call_forward(
          rowptr, col, query, key, value, defined_or_none(edge_term),
          defined_or_none(mask), scale, defined_or_none(colptr),
          defined_or_none(csc_row), defined_or_none(csc_perm), max_row,
          max_col, in_place));
    });
    if (!colptr.defined())
      std::tie(colptr, csc_row, csc_perm) =
          build_csc(rowptr, col, key.sym_size(0));
    const at::Tensor grad_out = grads[0].contiguous();
    const OptTensor e = defined_or_none(edge_term), m = defined_or_none(mask);
    std::vector<at::Tensor> s = {rowptr, col, colptr, csc_row, csc_perm,
                                 query,  key, value,  out,     lse};
    at::Tensor g_q, g_k, g_v, g_e;
    // In place only when autograd frees the graph after this backward
    // (no retain_graph or create_graph): nothing can read out, key and
    // value again.
    if (in_place &&
        !torch::autograd::get_current_graph_task_keep_graph() &&
        may_overwrite(query, key, value, edge_term, out, grad_out)) {
      g_e = call_backward_(s, e, m, scale, grad_out, need_edge, max_row,
                           max_col);
      for (const at::Tensor& t : {out, key, value})  // other saved views fail
        torch::autograd::impl::bump_version(t);
      g_q = out, g_k = key, g_v = value;
    } else {
      std::tie(g_q, g_k, g_v, g_e) = call_backward(
          s, e, m, scale, grad_out, need_edge, max_row, max_col);
    }
    const at::Tensor g[4] = {g_q, g_k, g_v, g_e};
    for (int k = 0; k < 4; ++k)
      if ((k < 3 || need_edge) && ctx->needs_input_grad(k + 2))
        res[kGradArgs[k]] = g[k];
    return res;
  }
};

Outputs2 transformer_attention_autograd(
    const at::Tensor& rowptr, const at::Tensor& col, const at::Tensor& query,
    const at::Tensor& key, const at::Tensor& value, const OptTensor& edge_term,
    const OptTensor& mask, double scale, const OptTensor& colptr,
    const OptTensor& csc_row, const OptTensor& csc_perm, int64_t max_row_len,
    int64_t max_col_len, bool grads_in_place) {
  auto r = TransformerAttentionFunction::apply(
      rowptr, col, query, key, value, edge_term, mask, scale, colptr, csc_row,
      csc_perm, max_row_len, max_col_len, grads_in_place);
  return {r[0], r[1].detach()};
}

}  // namespace
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, Autograd, m) {
  m.impl("transformer_attention",
         &pyg_fastattn::transformer_attention_autograd);
}

PFA_REGISTER_AUTOCAST("transformer_attention")
