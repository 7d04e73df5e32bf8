// gatv2_attention: input checks shared by the CPU and CUDA kernels, and the
// autograd kernel (C++, so forward and backward cost no Python). Schema,
// fakes and a Python twin of the autograd formula (for builds without this
// extension) live in pyg_fastattn/ops/gatv2.py.
#include <torch/autograd.h>

#include <array>

#include "../common.h"
#include "autocast.h"
#include "autograd.h"

namespace pyg_fastattn {

// rowptr [N+1]; col [E]; x_l [Ns, H, C]; x_r [N, H, C]; edge_term [E, H, C];
// att [H, C]; mask [E, H]; bias [H * C elements]. Float tensors share x_l's
// dtype.
void check_gatv2_attention(const at::Tensor& rowptr, const at::Tensor& col,
                           const at::Tensor& x_l, const at::Tensor& x_r,
                           const c10::optional<at::Tensor>& edge_term,
                           const at::Tensor& att,
                           const c10::optional<at::Tensor>& mask,
                           const c10::optional<at::Tensor>& bias) {
  check_rowptr(rowptr);
  check_index(col, rowptr, "col");
  check_float(x_l, "x_l", 3);
  check_same_device(rowptr, x_l, "rowptr", "x_l");
  const int64_t N = rowptr.numel() - 1, E = col.numel();
  check_rows(x_l, "x_l", x_r, "x_r", N, "one row per destination node", 3);
  if (edge_term.has_value())
    check_rows(x_l, "x_l", *edge_term, "edge_term", E, "one row per edge", 3);
  if (mask.has_value())
    check_rows(x_l, "x_l", *mask, "mask", E, "one row per edge", 2);
  check_float(att, "att", 2);
  check_same_device(x_l, att, "x_l", "att");
  check_same_dtype(x_l, att, "x_l", "att");
  check_size(att, 0, x_l.size(1), "att", "heads of `x_l`");
  check_size(att, 1, x_l.size(2), "att", "channels of `x_l`");
  if (bias.has_value()) {
    check_same_device(x_l, *bias, "x_l", "bias");
    check_same_dtype(x_l, *bias, "x_l", "bias");
    PFA_CHECK(bias->numel() == x_l.size(1) * x_l.size(2),
              "`bias` must have H * C = ", x_l.size(1) * x_l.size(2),
              " elements, got ", bias->numel());
  }
}

void check_gatv2_attention_backward(
    const at::Tensor& rowptr, const at::Tensor& col, const at::Tensor& colptr,
    const at::Tensor& csc_row, const at::Tensor& csc_perm,
    const at::Tensor& x_l, const at::Tensor& x_r,
    const c10::optional<at::Tensor>& edge_term, const at::Tensor& att,
    const c10::optional<at::Tensor>& mask,
    const c10::optional<at::Tensor>& bias, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& grad_out) {
  check_gatv2_attention(rowptr, col, x_l, x_r, edge_term, att, mask, bias);
  check_backward_state(rowptr, col, colptr, csc_row, csc_perm, x_l, "x_l", out,
                       lse, grad_out);
}

namespace {

using OptTensor = c10::optional<at::Tensor>;
using Outputs2 = std::tuple<at::Tensor, at::Tensor>;
using Outputs4 = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Outputs2 call_forward(const at::Tensor& rowptr, const at::Tensor& col,
                      const at::Tensor& x_l, const at::Tensor& x_r,
                      const OptTensor& edge_term, const at::Tensor& att,
                      const OptTensor& mask, double slope,
                      const OptTensor& bias, const OptTensor& colptr,
                      const OptTensor& csc_row, const OptTensor& csc_perm,
                      int64_t max_row_len, int64_t max_col_len) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pyg_fastattn::gatv2_attention", "")
          .typed<Outputs2(const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&,
                          const OptTensor&, const at::Tensor&,
                          const OptTensor&, double, const OptTensor&,
                          const OptTensor&, const OptTensor&,
                          const OptTensor&, int64_t, int64_t)>();
  return op.call(rowptr, col, x_l, x_r, edge_term, att, mask, slope, bias,
                 colptr, csc_row, csc_perm, max_row_len, max_col_len);
}

Outputs4 call_backward(const at::Tensor& rowptr, const at::Tensor& col,
                       const at::Tensor& colptr, const at::Tensor& csc_row,
                       const at::Tensor& csc_perm, const at::Tensor& x_l,
                       const at::Tensor& x_r, const OptTensor& edge_term,
                       const at::Tensor& att, const OptTensor& mask,
                       double slope, const OptTensor& bias,
                       const at::Tensor& out, const at::Tensor& lse,
                       const at::Tensor& grad_out, bool need_edge,
                       int64_t max_row_len, int64_t max_col_len) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pyg_fastattn::gatv2_attention_backward", "")
          .typed<Outputs4(const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const OptTensor&,
                          const at::Tensor&, const OptTensor&, double,
                          const OptTensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&, bool, int64_t,
                          int64_t)>();
  return op.call(rowptr, col, colptr, csc_row, csc_perm, x_l, x_r, edge_term,
                 att, mask, slope, bias, out, lse, grad_out, need_edge,
                 max_row_len, max_col_len);
}

// The differentiable inputs (x_l, x_r, edge_term, att, bias) by argument
// position.
constexpr std::array<int, 5> kGradArgs = {2, 3, 4, 5, 8};
constexpr int kNumArgs = 14;

class GATv2AttentionFunction
    : public OnceDifferentiableFunction<GATv2AttentionFunction> {
 public:
  static constexpr const char* kName = "gatv2_attention";

  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const at::Tensor& rowptr,
      const at::Tensor& col, const at::Tensor& x_l, const at::Tensor& x_r,
      const OptTensor& edge_term, const at::Tensor& att,
      const OptTensor& mask, double slope, const OptTensor& bias,
      const OptTensor& colptr, const OptTensor& csc_row,
      const OptTensor& csc_perm, int64_t max_row_len, int64_t max_col_len) {
    // Which tensors were passed (see grad_edges).
    const std::array<bool, kNumArgs> given = {
        true, true, true, true, edge_term.has_value(), true, mask.has_value(),
        false, bias.has_value(), colptr.has_value(), csc_row.has_value(),
        csc_perm.has_value(), false, false};
    const std::vector<int64_t> edge = grad_edges(given, kGradArgs);
    Outputs2 r;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      r = call_forward(rowptr, col, x_l, x_r, edge_term, att, mask, slope,
                       bias, colptr, csc_row, csc_perm, max_row_len,
                       max_col_len);
    }
    auto& [out, lse] = r;
    auto val = value_or_undefined;
    ctx->save_for_backward({rowptr, col, x_l, x_r, val(edge_term), att,
                            val(mask), val(bias), keep_output(ctx, out), lse,
                            val(colptr), val(csc_row), val(csc_perm)});
    ctx->saved_data["slope"] = slope;
    ctx->saved_data["edge"] = edge;
    save_attention_state(ctx, max_row_len, max_col_len);
    return {out, lse};
  }

  static torch::autograd::variable_list gradients(
      torch::autograd::AutogradContext* ctx,
      const torch::autograd::variable_list& grads) {
    torch::autograd::variable_list res(kNumArgs);
    if (!grads[0].defined()) return res;
    const auto need = needed_grads<kGradArgs.size()>(ctx);
    auto v = ctx->get_saved_variables();
    at::Tensor rowptr = v[0], col = v[1], x_l = v[2], x_r = v[3],
               edge_term = v[4], att = v[5], mask = v[6], bias = v[7],
               out = v[8], lse = v[9], colptr = v[10], csc_row = v[11],
               csc_perm = v[12];
    const double slope = ctx->saved_data["slope"].toDouble();
    const int64_t max_row = ctx->saved_data["max_row_len"].toInt();
    const int64_t max_col = ctx->saved_data["max_col_len"].toInt();
    out = kept_output(ctx, out, [&] {
      return std::get<0>(call_forward(
          rowptr, col, x_l, x_r, defined_or_none(edge_term), att,
          defined_or_none(mask), slope, defined_or_none(bias),
          defined_or_none(colptr), defined_or_none(csc_row),
          defined_or_none(csc_perm), max_row, max_col));
    });
    if (!colptr.defined())
      std::tie(colptr, csc_row, csc_perm) =
          build_csc(rowptr, col, x_l.sym_size(0));
    const at::Tensor grad_out = grads[0].contiguous();
    auto [g_l, g_r, g_e, g_att] = call_backward(
        rowptr, col, colptr, csc_row, csc_perm, x_l, x_r,
        defined_or_none(edge_term), att, defined_or_none(mask), slope,
        defined_or_none(bias), out, lse, grad_out, need[2], max_row, max_col);
    at::Tensor g_bias;
    if (need[4]) {  // the column sum (the op: it has a fake for tracing)
      static auto column_sum_op =
          c10::Dispatcher::singleton()
              .findSchemaOrThrow("pyg_fastattn::column_sum", "")
              .typed<at::Tensor(const at::Tensor&)>();
      g_bias = column_sum_op
                   .call(grad_out.reshape_symint(
                       {c10::SymInt(-1), bias.sym_numel()}))
                   .view_symint(bias.sym_sizes());
    }
    const at::Tensor g[5] = {g_l, g_r, g_e, g_att, g_bias};
    for (size_t k = 0; k < need.size(); ++k)
      if (need[k]) res[kGradArgs[k]] = g[k];
    return res;
  }
};

Outputs2 gatv2_attention_autograd(
    const at::Tensor& rowptr, const at::Tensor& col, const at::Tensor& x_l,
    const at::Tensor& x_r, const OptTensor& edge_term, const at::Tensor& att,
    const OptTensor& mask, double slope, const OptTensor& bias,
    const OptTensor& colptr, const OptTensor& csc_row,
    const OptTensor& csc_perm, int64_t max_row_len, int64_t max_col_len) {
  auto r = GATv2AttentionFunction::apply(rowptr, col, x_l, x_r, edge_term,
                                         att, mask, slope, bias, colptr,
                                         csc_row, csc_perm, max_row_len,
                                         max_col_len);
  return {r[0], r[1].detach()};
}

}  // namespace
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, Autograd, m) {
  m.impl("gatv2_attention", &pyg_fastattn::gatv2_attention_autograd);
}

PFA_REGISTER_AUTOCAST("gatv2_attention")
