// linear (y = x @ weight.t() + bias) and column_sum: the layers' Linear
// with its bias gradient as a column sum that reads [N, K] at near copy
// rate on CUDA (kColumnSumGemvRows). Schema, fakes and the fallback autograd
// live in pyg_fastattn/ops/linear.py; the Autograd kernel is here.
#include <torch/autograd.h>

#include "../common.h"
#include "autocast.h"
#include "autograd.h"

namespace pyg_fastattn {

using OptTensor = c10::optional<at::Tensor>;

at::Tensor column_sum(const at::Tensor& src) {
  PFA_CHECK(src.dim() == 2, "`src` must be 2-D, got shape ", src.sizes());
  PFA_CHECK(at::isFloatingType(src.scalar_type()),
            "`src` must be a floating-point tensor, got ", src.scalar_type());
  if (src.is_cuda() && src.size(0) >= kColumnSumGemvRows)
    return src.t().mv(at::ones({src.size(0)}, src.options()));
  return src.sum(0);
}

namespace {

// x [R, F], weight [K, F], bias [K] or None, one dtype and device (x may
// be float32 beside a 16-bit weight: mixed_x).
void check_linear(const at::Tensor& x, const at::Tensor& weight,
                  const OptTensor& bias) {
  check_float(x, "x", 2);
  check_float(weight, "weight", 2);
  check_same_device(x, weight, "x", "weight");
  if (!mixed_x(x, weight)) check_same_dtype(x, weight, "x", "weight");
  check_size(x, 1, weight.size(1), "x", "in_features of `weight`");
  if (bias.has_value()) {
    check_float(*bias, "bias", 1);
    check_same_device(weight, *bias, "weight", "bias");
    check_same_dtype(weight, *bias, "weight", "bias");
    check_size(*bias, 0, weight.size(0), "bias", "out_features of `weight`");
  }
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& weight,
                  const OptTensor& bias) {
  check_linear(x, weight, bias);
  return at::linear(x_as_weight(x, weight), weight, bias);
}

// Gradients of (x, weight, bias); an empty tensor where output_mask is false.
std::vector<at::Tensor> linear_backward(const at::Tensor& grad_out,
                                        const at::Tensor& x,
                                        const at::Tensor& weight,
                                        std::array<bool, 3> output_mask) {
  check_linear(x, weight, c10::nullopt);
  check_float(grad_out, "grad_out", 2);
  check_same_device(x, grad_out, "x", "grad_out");
  check_same_dtype(weight, grad_out, "weight", "grad_out");
  check_size(grad_out, 0, x.size(0), "grad_out", "rows of `x`");
  check_size(grad_out, 1, weight.size(0), "grad_out", "out_features of `weight`");
  const at::Tensor g = grad_out.contiguous();
  auto e = [&] { return x.new_empty({0}); };  // one each: outputs never alias
  return {output_mask[0] ? grad_x(g, weight, x.scalar_type()) : e(),
          output_mask[1] ? g.t().mm(x_as_weight(x, weight)) : e(),
          output_mask[2] ? column_sum(g) : e()};
}

at::Tensor column_sum_op(const at::Tensor& src) { return column_sum(src); }

at::Tensor call_linear(const at::Tensor& x, const at::Tensor& weight,
                       const OptTensor& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("pyg_fastattn::linear", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&,
                                         const OptTensor&)>();
  return op.call(x, weight, bias);
}

std::vector<at::Tensor> call_linear_backward(const at::Tensor& grad_out,
                                             const at::Tensor& x,
                                             const at::Tensor& weight,
                                             std::array<bool, 3> output_mask) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("pyg_fastattn::linear_backward", "")
          .typed<std::vector<at::Tensor>(const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, std::array<bool, 3>)>();
  return op.call(grad_out, x, weight, output_mask);
}

class LinearFunction
    : public OnceDifferentiableFunction<LinearFunction> {
 public:
  static constexpr const char* kName = "linear";

  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, const at::Tensor& x,
      const at::Tensor& weight, const OptTensor& bias) {
    at::Tensor y;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      y = call_linear(x, weight, bias);
    }
    ctx->save_for_backward({x, weight});
    ctx->saved_data["has_bias"] = bias.has_value();
    return {y};
  }

  static torch::autograd::variable_list gradients(
      torch::autograd::AutogradContext* ctx,
      const torch::autograd::variable_list& grads) {
    torch::autograd::variable_list res(3);
    if (!grads[0].defined()) return res;
    const auto saved = ctx->get_saved_variables();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const std::array<bool, 3> mask = {ctx->needs_input_grad(0),
                                      ctx->needs_input_grad(1),
                                      has_bias && ctx->needs_input_grad(2)};
    const auto g = call_linear_backward(grads[0], saved[0], saved[1], mask);
    for (int k = 0; k < 3; ++k)
      if (mask[k]) res[k] = g[k];
    return res;
  }
};

at::Tensor linear_autograd(const at::Tensor& x, const at::Tensor& weight,
                           const OptTensor& bias) {
  return LinearFunction::apply(x, weight, bias)[0];
}

}  // namespace
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, Autograd, m) {
  m.impl("linear", &pyg_fastattn::linear_autograd);
}

TORCH_LIBRARY_IMPL(pyg_fastattn, CPU, m) {
  m.impl("linear", &pyg_fastattn::linear);
  m.impl("linear_backward", &pyg_fastattn::linear_backward);
  m.impl("column_sum", &pyg_fastattn::column_sum_op);
}

#ifdef PFA_WITH_CUDA
TORCH_LIBRARY_IMPL(pyg_fastattn, CUDA, m) {
  m.impl("linear", &pyg_fastattn::linear);
  m.impl("linear_backward", &pyg_fastattn::linear_backward);
  m.impl("column_sum", &pyg_fastattn::column_sum_op);
}
#endif

PFA_REGISTER_AUTOCAST_KEEP("linear", 0, 1)  // x beside weight
