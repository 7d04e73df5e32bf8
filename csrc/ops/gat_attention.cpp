// gat_attention: GAT's whole attention layer core in one op (and its
// backward): optionally h = x @ weight.t(), the per-node score terms
// a = <h, att> as one GEMM, the fused attention kernel (with the bias added
// in its store). Device-generic: the GEMMs are ATen's, the attention kernels
// are reached through the dispatcher (so a reference override is honoured).
// The schema lives in pyg_fastattn/ops/gat.py; the autograd kernel is here
// (C++, so forward and backward cost no Python), with a Python twin in gat.py
// for builds without this extension.
#include <torch/autograd.h>

#include <array>

#include "../common.h"
#include "autocast.h"
#include "autograd.h"

namespace pyg_fastattn {
#ifdef PFA_WITH_CUDA
namespace cuda {  // csrc/cuda/gat_score.cu
std::tuple<at::Tensor, at::Tensor> gat_score_cuda(const at::Tensor& h,
                                                  const at::Tensor& att_src,
                                                  const at::Tensor& att_dst);
std::tuple<at::Tensor, at::Tensor> gat_score_backward_cuda(
    const at::Tensor& h, at::Tensor& g_h, const at::Tensor& g_src,
    const at::Tensor& g_dst, const at::Tensor& att_src,
    const at::Tensor& att_dst);
}  // namespace cuda
#endif

namespace {

using OptTensor = c10::optional<at::Tensor>;

std::tuple<at::Tensor, at::Tensor> call_attention(
    const at::Tensor& rowptr, const at::Tensor& col, const OptTensor& a_src,
    const OptTensor& a_dst, const OptTensor& a_edge, const OptTensor& mask,
    const at::Tensor& values, double slope, const OptTensor& bias) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pyg_fastattn::attention", "")
          .typed<std::tuple<at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const OptTensor&,
              const OptTensor&, const OptTensor&, const OptTensor&,
              const at::Tensor&, double, const OptTensor&, const OptTensor&,
              const OptTensor&, const OptTensor&, const OptTensor&)>();
  return op.call(rowptr, col, a_src, a_dst, a_edge, mask, values, slope, bias,
                 c10::nullopt, c10::nullopt, c10::nullopt, c10::nullopt);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> call_attention_backward(
    const at::Tensor& rowptr, const at::Tensor& col, const at::Tensor& colptr,
    const at::Tensor& row, const at::Tensor& perm, const OptTensor& a_src,
    const OptTensor& a_dst, const OptTensor& a_edge, const OptTensor& mask,
    const at::Tensor& values, double slope, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& grad_out, bool grad_z_csr,
    const OptTensor& bias) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pyg_fastattn::attention_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, const at::Tensor&, const OptTensor&,
              const OptTensor&, const OptTensor&, const OptTensor&,
              const at::Tensor&, double, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, bool, const OptTensor&)>();
  return op.call(rowptr, col, colptr, row, perm, a_src, a_dst, a_edge, mask,
                 values, slope, out, lse, grad_out, grad_z_csr, bias);
}

at::Tensor call_segment_sum(const at::Tensor& rowptr, const OptTensor& perm,
                            const at::Tensor& src) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pyg_fastattn::segment_sum", "")
                       .typed<at::Tensor(const at::Tensor&, const OptTensor&,
                                         const at::Tensor&)>();
  return op.call(rowptr, perm, src);
}

// Block-diagonal [H * C, K * H] matrix of the score vectors att [K, H, C]:
// h.view(N, H * C) @ B = (h * att[k]).sum(-1) for each k side by side.
at::Tensor score_weight(const at::Tensor& att) {
  const int64_t K = att.size(0), H = att.size(1), C = att.size(2);
  at::Tensor B = at::zeros({H, C, K, H}, att.options());
  B.diagonal(0, 0, 3).copy_(att.permute({2, 0, 1}));
  return B.view({H * C, K * H});
}

// Gradient of att[k] [1, H, C] from P = h.view(N, H * C).t() @ g
// [H * C, K * H]: its k-th diagonal blocks (a tensor of its own).
at::Tensor score_weight_grad(const at::Tensor& P, int64_t H, int64_t C,
                             int64_t K, int64_t k) {
  return P.view({H, C, K, H}).diagonal(0, 0, 3).select(1, k).t().contiguous()
      .unsqueeze(0);
}

// [N, ...] as [N, prod(...)] (N may be 0).
at::Tensor flat(const at::Tensor& h) {
  int64_t width = 1;
  for (int64_t d = 1; d < h.dim(); ++d) width *= h.size(d);
  return h.reshape({h.size(0), width});
}

// Whether the score terms of both sides of h [N, H, C] go through the small
// graph kernels of gat_score.cu (one launch each way) instead of the
// block-diagonal GEMM and its helpers.
bool score_kernel(const at::Tensor& h, const at::Tensor& att_src,
                  const at::Tensor& att_dst) {
#ifdef PFA_WITH_CUDA
  return h.is_cuda() && h.is_contiguous() &&
         h.numel() <= kGatScoreKernelElems &&
         att_src.scalar_type() == h.scalar_type() &&
         att_dst.scalar_type() == h.scalar_type();
#else
  (void)h, (void)att_src, (void)att_dst;
  return false;
#endif
}

// "None" among tensor outputs: 1-D and empty (a real a_dst is [N, H], and
// N may be 0).
at::Tensor none_like(const at::Tensor& ref) { return at::empty({0}, ref.options()); }

OptTensor opt(const at::Tensor& t) {
  return t.defined() && t.dim() > 1 ? OptTensor(t) : c10::nullopt;
}

// h = x @ weight.t() as [Ns, H, C].
at::Tensor project(const at::Tensor& x, const at::Tensor& weight, int64_t H,
                   int64_t C) {
  return x_as_weight(x, weight).mm(weight.t()).view({-1, H, C});
}

void check_gat(const OptTensor& x, const OptTensor& weight,
               const OptTensor& h_src, const at::Tensor& att_src,
               const OptTensor& h_dst, const at::Tensor& att_dst,
               bool dst_is_src) {
  check_float(att_src, "att_src", 3);
  check_float(att_dst, "att_dst", 3);
  PFA_CHECK(att_src.size(0) == 1 && att_dst.sizes() == att_src.sizes(),
            "`att_src` and `att_dst` must have shape [1, H, C], got ",
            att_src.sizes(), " and ", att_dst.sizes());
  const int64_t HC = att_src.size(1) * att_src.size(2);
  if (weight.has_value()) {
    PFA_CHECK(x.has_value() && !h_src.has_value() && dst_is_src,
              "gat_attention: `weight` computes h from `x`: pass `x`, no "
              "`h_src`, and dst_is_src=True");
    check_float(*x, "x", 2);
    check_float(*weight, "weight", 2);
    if (!mixed_x(*x, *weight)) check_same_dtype(*x, *weight, "x", "weight");
    PFA_CHECK(weight->size(0) == HC && weight->size(1) == x->size(1),
              "`weight` must have shape [H * C, F] = [", HC, ", ", x->size(1),
              "], got ", weight->sizes());
  } else {
    PFA_CHECK(h_src.has_value(), "gat_attention needs `h_src` or `x` and `weight`");
    check_float(*h_src, "h_src", 3);
    PFA_CHECK(h_src->size(1) * h_src->size(2) == HC,
              "`h_src` must have H * C = ", HC, " features per node, got ",
              h_src->sizes());
  }
  if (h_dst.has_value()) {
    PFA_CHECK(!dst_is_src, "`h_dst` must be None with dst_is_src=True");
    check_float(*h_dst, "h_dst", 3);
    PFA_CHECK(h_dst->size(1) * h_dst->size(2) == HC,
              "`h_dst` must have H * C = ", HC, " features per node, got ",
              h_dst->sizes());
  }
}

// Returns (out [N, H, C], lse [N, H], h [Ns, H, C] when computed from x
// (else empty), a_src [Ns, H], a_dst [N, H] (empty without a target term)).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>
gat_attention(const at::Tensor& rowptr, const at::Tensor& col,
              const at::Tensor& /*colptr*/, const at::Tensor& /*csc_row*/,
              const at::Tensor& /*csc_perm*/, const at::Tensor& /*csc_inv*/,
              const OptTensor& x, const OptTensor& weight,
              const OptTensor& h_src, const at::Tensor& att_src,
              const OptTensor& h_dst, const at::Tensor& att_dst,
              const OptTensor& a_edge, const OptTensor& mask,
              const OptTensor& bias, double negative_slope, bool dst_is_src,
              int64_t max_row_len, int64_t max_col_len) {
  check_gat(x, weight, h_src, att_src, h_dst, att_dst, dst_is_src);
  const LengthHintGuard hint(max_row_len, max_col_len);
  const int64_t H = att_src.size(1), C = att_src.size(2), HC = H * C;
  const at::Tensor h = weight.has_value()
                           ? project(*x, *weight, H, C)
                           : h_src->reshape({-1, H, C}).contiguous();
  const int64_t Ns = h.size(0);
  at::Tensor a_src, a_dst;
  if (dst_is_src && score_kernel(h, att_src, att_dst)) {
#ifdef PFA_WITH_CUDA
    std::tie(a_src, a_dst) = cuda::gat_score_cuda(h, att_src, att_dst);
#endif
  } else if (dst_is_src) {  // one GEMM for both terms
    const at::Tensor a = h.view({Ns, HC}).mm(score_weight(at::cat({att_src, att_dst})));
    a_src = a.slice(1, 0, H).contiguous();
    a_dst = a.slice(1, H, 2 * H).contiguous();
  } else {
    a_src = h.view({Ns, HC}).mm(score_weight(att_src));
    if (h_dst.has_value()) a_dst = flat(*h_dst).mm(score_weight(att_dst));
  }
  auto [out, lse] = call_attention(rowptr, col, a_src, opt(a_dst), a_edge,
                                   mask, h, negative_slope, bias);
  return {out, lse, weight.has_value() ? h : none_like(h), a_src,
          a_dst.defined() ? a_dst : none_like(h)};
}

// The backward in two parts: backward_values reads h (the attention
// backward and the score terms), backward_inputs does not (the GEMMs of x
// and weight, the bias), so that the autograd kernel can free h between
// them. The op gat_attention_backward runs both.
//
// With `weight`, no gradient for x and F <= 2 * H * C, the score terms'
// gradient goes through x: M = x.t() @ g_a [F, 2H] gives grad_weight =
// g_h.t() @ x + B @ M.t() and grad_att from weight @ M; one GEMM reading x
// replaces h.t() @ g_a and the update g_h += g_a @ B.t(). Small h (at most
// kGatScoreThroughXElems) takes the score kernel instead.
struct ValueGrads {
  at::Tensor g_h;  // [Ns, H, C]; with the score terms unless through_x
  at::Tensor g_z;  // a_edge's gradient (CSR order) when wanted
  at::Tensor g_a;  // through_x: the score terms' gradient [Ns, 2H]
  at::Tensor g_h_dst, g_att_src, g_att_dst;
  at::TensorOptions h_options;  // of the absent gradients (1-D and empty)
  bool through_x = false;
};

ValueGrads backward_values(
    const at::Tensor& grad_out, const at::Tensor& rowptr, const at::Tensor& col,
    const at::Tensor& colptr, const at::Tensor& csc_row,
    const at::Tensor& csc_perm, const at::Tensor& csc_inv, const OptTensor& x,
    const OptTensor& weight, const at::Tensor& h, const at::Tensor& att_src,
    const OptTensor& h_dst, const at::Tensor& att_dst, const at::Tensor& a_src,
    const at::Tensor& a_dst_, const OptTensor& a_edge, const OptTensor& mask,
    const OptTensor& bias, const at::Tensor& out, const at::Tensor& lse,
    double negative_slope, bool dst_is_src,
    const std::array<bool, 8>& output_mask) {
  const int64_t H = att_src.size(1), C = att_src.size(2), HC = H * C;
  const int64_t Ns = h.size(0);
  const bool need_x = output_mask[0],
             need_edge = output_mask[6] && a_edge.has_value();
  const OptTensor a_dst = opt(a_dst_);
  // The ops below run under no autograd (no double backward): skip their
  // Autograd kernels (segment_sum's is Python, host time on every call).
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  auto [g_h, g_z, g_src] = call_attention_backward(
      rowptr, col, colptr, csc_row, csc_perm, a_src, a_dst, a_edge, mask, h,
      negative_slope, out, lse, grad_out.contiguous(), need_edge, bias);
  at::Tensor g_dst;  // CSR row sums; csc_inv maps CSR positions to CSC order
  if (a_dst.has_value())
    g_dst = call_segment_sum(rowptr, need_edge ? OptTensor() : OptTensor(csc_inv), g_z);
  ValueGrads r;
  r.h_options = h.options();
  r.g_z = need_edge ? g_z : at::Tensor();
  g_z = at::Tensor();  // free before the GEMMs
  at::Tensor g_h2 = g_h.view({Ns, HC});
  const bool kernel = dst_is_src && g_h.is_contiguous() &&
                      score_kernel(h, att_src, att_dst);
  // Through x when x is no wider than about h: a wide x (Cora's 1433
  // features) costs more to read than g_h's update.
  r.through_x = weight.has_value() && !need_x && x->size(1) <= 2 * HC &&
                !(kernel && h.numel() <= kGatScoreThroughXElems);
  if (kernel && !r.through_x) {
#ifdef PFA_WITH_CUDA
    std::tie(r.g_att_src, r.g_att_dst) = cuda::gat_score_backward_cuda(
        h, g_h, g_src, g_dst, att_src, att_dst);
#endif
  } else if (dst_is_src) {
    const at::Tensor g_a = at::cat({g_src, g_dst}, 1);
    if (r.through_x) {
      r.g_a = g_a;
    } else {
      g_h2.addmm_(g_a, score_weight(at::cat({att_src, att_dst})).t());
      const at::Tensor P = flat(h).t().mm(g_a);
      // two outputs with storage of their own (compilers reuse output buffers)
      r.g_att_src = score_weight_grad(P, H, C, 2, 0);
      r.g_att_dst = score_weight_grad(P, H, C, 2, 1);
    }
  } else {
    g_h2.addmm_(g_src, score_weight(att_src).t());
    r.g_att_src = score_weight_grad(flat(h).t().mm(g_src), H, C, 1, 0);
    if (g_dst.defined()) {
      r.g_h_dst = g_dst.mm(score_weight(att_dst).t()).view(h_dst->sizes());
      r.g_att_dst = score_weight_grad(flat(*h_dst).t().mm(g_dst), H, C, 1, 0);
    }
  }
  r.g_h = g_h;
  return r;
}

// Gradients of (x, weight, h_src, att_src, h_dst, att_dst, a_edge, bias);
// an empty tensor where output_mask is false or the input was None. (`v`'s
// g_h is moved out.)
std::vector<at::Tensor> backward_inputs(
    ValueGrads& v, const at::Tensor& grad_out, const OptTensor& x,
    const OptTensor& weight, const at::Tensor& att_src,
    const at::Tensor& att_dst, const OptTensor& bias,
    const std::array<bool, 8>& output_mask) {
  const int64_t H = att_src.size(1), C = att_src.size(2), HC = H * C;
  const bool need_x = output_mask[0], need_w = output_mask[1];
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  at::Tensor g_h = std::move(v.g_h);
  at::Tensor g_x, g_w;
  if (weight.has_value()) {
    const at::Tensor g_h2 = g_h.view({g_h.size(0), HC});
    // x in weight's dtype (a cast when x is mixed), only where it is read
    at::Tensor xw =
        v.through_x || need_w ? x_as_weight(*x, *weight) : at::Tensor();
    if (v.through_x) {
      const at::Tensor M = xw.t().mm(v.g_a);
      if (need_w)
        g_w = g_h2.t().mm(xw).addmm_(
            score_weight(at::cat({att_src, att_dst})), M.t());
      const at::Tensor P = weight->mm(M);
      v.g_att_src = score_weight_grad(P, H, C, 2, 0);
      v.g_att_dst = score_weight_grad(P, H, C, 2, 1);
    } else if (need_w) {
      g_w = g_h2.t().mm(xw);
    }
    xw = at::Tensor();  // free a cast of x before g_x
    if (need_x) g_x = grad_x(g_h2, *weight, x->scalar_type());
  }
  at::Tensor g_bias;
  if (output_mask[7] && bias.has_value())  // the column sum
    g_bias = column_sum(grad_out.reshape({-1, HC})).view(bias->sizes());
  const at::Tensor e = at::empty({0}, v.h_options);
  auto or_empty = [&](const at::Tensor& t, bool want) {
    return want && t.defined() ? t : e;
  };
  return {or_empty(g_x, need_x),
          or_empty(g_w, need_w),
          or_empty(weight.has_value() ? at::Tensor() : g_h, output_mask[2]),
          or_empty(v.g_att_src, output_mask[3]),
          or_empty(v.g_h_dst, output_mask[4]),
          or_empty(v.g_att_dst, output_mask[5]),
          or_empty(v.g_z, output_mask[6]),
          or_empty(g_bias, output_mask[7])};
}

std::vector<at::Tensor> gat_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& rowptr, const at::Tensor& col,
    const at::Tensor& colptr, const at::Tensor& csc_row,
    const at::Tensor& csc_perm, const at::Tensor& csc_inv, const OptTensor& x,
    const OptTensor& weight, const at::Tensor& h, const at::Tensor& att_src,
    const OptTensor& h_dst, const at::Tensor& att_dst, const at::Tensor& a_src,
    const at::Tensor& a_dst, const OptTensor& a_edge, const OptTensor& mask,
    const OptTensor& bias, const at::Tensor& out, const at::Tensor& lse,
    double negative_slope, bool dst_is_src, std::array<bool, 8> output_mask,
    int64_t max_row_len, int64_t max_col_len) {
  const LengthHintGuard hint(max_row_len, max_col_len);
  ValueGrads v = backward_values(
      grad_out, rowptr, col, colptr, csc_row, csc_perm, csc_inv, x, weight, h,
      att_src, h_dst, att_dst, a_src, a_dst, a_edge, mask, bias, out, lse,
      negative_slope, dst_is_src, output_mask);
  return backward_inputs(v, grad_out, x, weight, att_src, att_dst, bias,
                         output_mask);
}

using Outputs5 =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

Outputs5 call_gat_attention(
    const at::Tensor& rowptr, const at::Tensor& col, const at::Tensor& colptr,
    const at::Tensor& csc_row, const at::Tensor& csc_perm,
    const at::Tensor& csc_inv, const OptTensor& x, const OptTensor& weight,
    const OptTensor& h_src, const at::Tensor& att_src, const OptTensor& h_dst,
    const at::Tensor& att_dst, const OptTensor& a_edge, const OptTensor& mask,
    const OptTensor& bias, double slope, bool dst_is_src, int64_t max_row_len,
    int64_t max_col_len) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pyg_fastattn::gat_attention", "")
          .typed<Outputs5(const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&,
                          const at::Tensor&, const at::Tensor&,
                          const OptTensor&, const OptTensor&, const OptTensor&,
                          const at::Tensor&, const OptTensor&,
                          const at::Tensor&, const OptTensor&,
                          const OptTensor&, const OptTensor&, double, bool,
                          int64_t, int64_t)>();
  return op.call(rowptr, col, colptr, csc_row, csc_perm, csc_inv, x, weight,
                 h_src, att_src, h_dst, att_dst, a_edge, mask, bias, slope,
                 dst_is_src, max_row_len, max_col_len);
}

std::vector<at::Tensor> call_gat_attention_backward(
    const at::Tensor& grad_out, const std::vector<at::Tensor>& s, double slope,
    bool dst_is_src, std::array<bool, 8> output_mask, int64_t max_row_len,
    int64_t max_col_len) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pyg_fastattn::gat_attention_backward", "")
          .typed<decltype(gat_attention_backward)>();
  auto o = [&](size_t i) { return s[i].defined() ? OptTensor(s[i]) : c10::nullopt; };
  return op.call(grad_out, s[0], s[1], s[2], s[3], s[4], s[5], o(6), o(7),
                 s[8], s[9], o(10), s[11], s[12], s[13], o(14), o(15), o(16),
                 s[17], s[18], slope, dst_is_src, output_mask, max_row_len,
                 max_col_len);
}

// The differentiable inputs (x, weight, h_src, att_src, h_dst, att_dst,
// a_edge, bias) by their position among gat_attention's arguments.
constexpr std::array<int, 8> kGradArgs = {6, 7, 8, 9, 10, 11, 12, 14};
constexpr int kNumArgs = 19;

class GATAttentionFunction
    : public OnceDifferentiableFunction<GATAttentionFunction> {
 public:
  static constexpr const char* kName = "gat_attention";

  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const at::Tensor& rowptr,
      const at::Tensor& col, const at::Tensor& colptr,
      const at::Tensor& csc_row, const at::Tensor& csc_perm,
      const at::Tensor& csc_inv, const OptTensor& x, const OptTensor& weight,
      const OptTensor& h_src, const at::Tensor& att_src,
      const OptTensor& h_dst, const at::Tensor& att_dst,
      const OptTensor& a_edge, const OptTensor& mask, const OptTensor& bias,
      double slope, bool dst_is_src, int64_t max_row_len, int64_t max_col_len) {
    // Which tensors were passed (see grad_edges).
    const std::array<bool, kNumArgs> given = {
        true, true, true, true, true, true, x.has_value(),
        weight.has_value(), h_src.has_value(), true, h_dst.has_value(), true,
        a_edge.has_value(), mask.has_value(), bias.has_value(), false, false,
        false, false};
    const std::vector<int64_t> edge = grad_edges(given, kGradArgs);
    Outputs5 r;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      r = call_gat_attention(rowptr, col, colptr, csc_row, csc_perm, csc_inv,
                             x, weight, h_src, att_src, h_dst, att_dst, a_edge,
                             mask, bias, slope, dst_is_src, max_row_len,
                             max_col_len);
    }
    auto& [out, lse, h, a_src, a_dst] = r;
    auto val = [](const OptTensor& t) { return t.has_value() ? *t : at::Tensor(); };
    ctx->save_for_backward(
        {rowptr, col, colptr, csc_row, csc_perm, csc_inv, val(x), val(weight),
         weight.has_value() ? keep_tensor(ctx, "h", h) : val(h_src), att_src,
         val(h_dst), att_dst,
         a_src, a_dst, val(a_edge), val(mask), val(bias),
         keep_output(ctx, out), lse});
    ctx->saved_data["slope"] = slope;
    ctx->saved_data["dst_is_src"] = dst_is_src;
    ctx->saved_data["edge"] = edge;
    save_attention_state(ctx, max_row_len, max_col_len);
    return {out, lse, h, a_src, a_dst};
  }

  static torch::autograd::variable_list gradients(
      torch::autograd::AutogradContext* ctx,
      const torch::autograd::variable_list& grads) {
    torch::autograd::variable_list res(kNumArgs);
    if (!grads[0].defined()) return res;
    const std::array<bool, 8> output_mask = needed_grads<8>(ctx);
    std::vector<at::Tensor> s = ctx->get_saved_variables();
    const double slope = ctx->saved_data["slope"].toDouble();
    const bool dst_is_src = ctx->saved_data["dst_is_src"].toBool();
    const int64_t max_row = ctx->saved_data["max_row_len"].toInt();
    const int64_t max_col = ctx->saved_data["max_col_len"].toInt();
    s[17] = kept_output(ctx, s[17], [&] {
      auto o = [&](size_t i) { return defined_or_none(s[i]); };
      const OptTensor h_src = s[7].defined() ? c10::nullopt : o(8);
      return std::get<0>(call_gat_attention(
          s[0], s[1], s[2], s[3], s[4], s[5], o(6), o(7), h_src, s[9], o(10),
          s[11], o(14), o(15), o(16), slope, dst_is_src, max_row, max_col));
    });
    // h computed from x: kept out of save_for_backward (keep_tensor), so
    // that it is freed between the two parts of the backward below (unless
    // the graph is kept), before the GEMMs of x and weight.
    bool proxy = false;
    if (s[7].defined()) {
      const int64_t H = s[9].size(1), C = s[9].size(2);
      s[8] = kept_tensor(ctx, "h", s[8],
                         [&] { return project(s[6], s[7], H, C); }, &proxy);
    }
    // Traced (torch.compile, compiled autograd) or batched (vmap) tensors
    // take the op, one node with its own batching rule.
    bool plain = !proxy;
    for (const at::Tensor& t : s)
      plain = plain && (!t.defined() || (t.has_storage() && !is_traced(t)));
    plain = plain && grads[0].has_storage() && !is_traced(grads[0]);
    std::vector<at::Tensor> g;
    if (!plain) {
      g = call_gat_attention_backward(grads[0], s, slope, dst_is_src,
                                      output_mask, max_row, max_col);
    } else {
      const LengthHintGuard hint(max_row, max_col);
      auto o = [&](size_t i) { return defined_or_none(s[i]); };
      ValueGrads v = backward_values(
          grads[0], s[0], s[1], s[2], s[3], s[4], s[5], o(6), o(7), s[8],
          s[9], o(10), s[11], s[12], s[13], o(14), o(15), o(16), s[17], s[18],
          slope, dst_is_src, output_mask);
      s[8] = at::Tensor();
      g = backward_inputs(v, grads[0], o(6), o(7), s[9], s[11], o(16),
                          output_mask);
    }
    // (an absent gradient is none_like's 1-D empty tensor; an input with
    // no rows, x of a graph without nodes, gets its empty gradient, as
    // autograd gives PyG's layer)
    for (size_t k = 0; k < output_mask.size(); ++k)
      if (output_mask[k] && (g[k].sym_numel() != 0 || g[k].dim() != 1))
        res[kGradArgs[k]] = g[k];
    return res;
  }
};

Outputs5 gat_attention_autograd(
    const at::Tensor& rowptr, const at::Tensor& col, const at::Tensor& colptr,
    const at::Tensor& csc_row, const at::Tensor& csc_perm,
    const at::Tensor& csc_inv, const OptTensor& x, const OptTensor& weight,
    const OptTensor& h_src, const at::Tensor& att_src, const OptTensor& h_dst,
    const at::Tensor& att_dst, const OptTensor& a_edge, const OptTensor& mask,
    const OptTensor& bias, double slope, bool dst_is_src, int64_t max_row_len,
    int64_t max_col_len) {
  auto r = GATAttentionFunction::apply(rowptr, col, colptr, csc_row, csc_perm,
                                       csc_inv, x, weight, h_src, att_src,
                                       h_dst, att_dst, a_edge, mask, bias,
                                       slope, dst_is_src, max_row_len,
                                       max_col_len);
  return {r[0], r[1].detach(), r[2].detach(), r[3].detach(), r[4].detach()};
}

}  // namespace
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, Autograd, m) {
  m.impl("gat_attention", &pyg_fastattn::gat_attention_autograd);
}

TORCH_LIBRARY_IMPL(pyg_fastattn, CPU, m) {
  m.impl("gat_attention", &pyg_fastattn::gat_attention);
  m.impl("gat_attention_backward", &pyg_fastattn::gat_attention_backward);
}

#ifdef PFA_WITH_CUDA
TORCH_LIBRARY_IMPL(pyg_fastattn, CUDA, m) {
  m.impl("gat_attention", &pyg_fastattn::gat_attention);
  m.impl("gat_attention_backward", &pyg_fastattn::gat_attention_backward);
}
#endif

PFA_REGISTER_AUTOCAST_KEEP("gat_attention", 6, 7)  // x beside weight
