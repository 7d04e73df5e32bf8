// Helpers of the ops' C++ autograd kernels.
#pragma once

#include <ATen/ATen.h>
#include <ATen/SavedTensorHooks.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/graph_task.h>

#include <array>
#include <string>
#include <tuple>
#include <vector>

#include "../common.h"

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
// for the backward; no gradient is materialized for the outputs besides
// out. (Those outputs leave the autograd kernel detached rather than marked
// non-differentiable: compiled autograd rejects nodes with marked outputs.)
inline void save_attention_state(torch::autograd::AutogradContext* ctx,
                                 int64_t max_row_len, int64_t max_col_len) {
  ctx->saved_data["max_row_len"] = max_row_len;
  ctx->saved_data["max_col_len"] = max_col_len;
  ctx->set_materialize_grads(false);
}

// Tensors being traced (torch.compile, compiled autograd's proxies).
inline bool is_traced(const at::Tensor& t) {
  return t.key_set().has_any(c10::DispatchKeySet(
      {c10::DispatchKey::Python, c10::DispatchKey::Functionalize}));
}

// A tensor that a backward reads, kept in saved_data under `key` instead of
// save_for_backward, out of autograd's version check: the attention ops' out,
// which the layers often return as it is, so that an in-place op on the
// layer's output (relu_, +=), which PyG's layers allow, makes kept_tensor
// recompute it rather than the backward raise (a torch.compile trace sees
// the in-place op above functionalization, so traced tensors take the same
// route); and gat_attention's h, so that its backward can free h once the
// attention part is done. Under saved-tensor hooks (activation
// checkpointing, save_on_cpu), which must see every saved activation, t is
// saved as usual. Returns what save_for_backward takes in t's place.
inline at::Tensor keep_tensor(torch::autograd::AutogradContext* ctx,
                              const std::string& key, const at::Tensor& t) {
  if (at::SavedTensorDefaultHooks::get_hooks().has_value()) return t;
  ctx->saved_data[key] = t.detach();  // shares t's version counter
  ctx->saved_data[key + "_version"] = static_cast<int64_t>(t._version());
  ctx->saved_data[key + "_traced"] = is_traced(t);
  return at::Tensor();
}

inline at::Tensor keep_output(torch::autograd::AutogradContext* ctx,
                              const at::Tensor& out) {
  return keep_tensor(ctx, "out", out);
}

// In the backward: the kept tensor as the forward made it (`saved`:
// keep_tensor's result as saved), recomputed by `recompute` (its kernels
// are deterministic, so the bits are the forward's) when it changed in
// place since. A tensor traced here but not in the forward is compiled
// autograd's proxy, whose version says nothing: recomputed too (`proxy`,
// when given, tells the caller). Released from the context unless the graph
// is kept, as autograd releases saved variables.
template <typename Recompute>
at::Tensor kept_tensor(torch::autograd::AutogradContext* ctx,
                       const std::string& key, const at::Tensor& saved,
                       Recompute&& recompute, bool* proxy_out = nullptr) {
  if (proxy_out) *proxy_out = false;
  if (saved.defined()) return saved;
  const auto it = ctx->saved_data.find(key);
  PFA_CHECK(it != ctx->saved_data.end(), "the attention's saved `", key,
            "` was already released: call backward with retain_graph=True "
            "to backward twice");
  at::Tensor t = it->second.toTensor();
  const bool proxy =
      is_traced(t) && !ctx->saved_data[key + "_traced"].toBool();
  if (proxy || t._version() != ctx->saved_data[key + "_version"].toInt()) {
    at::AutoDispatchBelowADInplaceOrView guard;
    t = recompute();
  }
  if (!proxy && !torch::autograd::get_current_graph_task_keep_graph())
    ctx->saved_data.erase(it);
  if (proxy_out) *proxy_out = proxy;
  return t;
}

template <typename Recompute>
at::Tensor kept_output(torch::autograd::AutogradContext* ctx,
                       const at::Tensor& saved, Recompute&& recompute) {
  return kept_tensor(ctx, "out", saved, std::forward<Recompute>(recompute));
}

// The gradients of a backward as they are under create_graph (grad mode on
// in the backward): the same tensors, with a grad_fn that raises. Its graph
// inputs are the incoming gradients and the forward's saved tensors, so
// that differentiating those gradients (torch.autograd.grad included) meets
// it on the way to the forward's inputs.
class NoSecondDerivative
    : public torch::autograd::Function<NoSecondDerivative> {
 public:
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext* ctx, at::TensorList grads,
      at::TensorList graph_inputs, const std::string& op) {
    ctx->saved_data["op"] = op;
    return grads.vec();
  }

  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list) {
    const std::string op = ctx->saved_data["op"].toStringRef();
    PFA_CHECK(false, op.c_str(),
              " has no second derivative: differentiating its gradient "
              "(create_graph=True: double backward, gradient penalties) is "
              "not supported. Use the PyG layer for higher-order gradients.");
    return {};
  }
};

// A backward run as Python's @once_differentiable runs one: `compute`
// without grad mode, then under create_graph its gradients through
// NoSecondDerivative, so that a double backward raises a clear error rather
// than differentiating only the ATen parts of the backward.
template <typename Compute>
torch::autograd::variable_list once_differentiable(
    const char* op, torch::autograd::AutogradContext* ctx,
    const torch::autograd::variable_list& grads_out, Compute&& compute) {
  const bool create_graph = at::GradMode::is_enabled();
  torch::autograd::variable_list grads;
  {
    at::NoGradGuard no_grad;
    grads = compute();
  }
  if (!create_graph) return grads;
  std::vector<at::Tensor> defined, inputs;
  for (const at::Tensor& g : grads)
    if (g.defined()) defined.push_back(g);
  if (defined.empty()) return grads;
  for (const at::Tensor& t : grads_out)
    if (t.defined() && t.requires_grad()) inputs.push_back(t);
  for (const at::Tensor& t : ctx->get_saved_variables())
    if (t.defined() && t.requires_grad()) inputs.push_back(t);
  const torch::autograd::variable_list wrapped = NoSecondDerivative::apply(
      at::TensorList(defined), at::TensorList(inputs),
      std::string(op));
  size_t k = 0;
  for (at::Tensor& g : grads)
    if (g.defined()) g = wrapped[k++];
  return grads;
}

// The ops' autograd functions: T::forward, and T::gradients(ctx, grads) as
// the backward, run by once_differentiable (T::kName names the op).
template <class T>
struct OnceDifferentiableFunction : public torch::autograd::Function<T> {
  static torch::autograd::variable_list backward(
      torch::autograd::AutogradContext* ctx,
      torch::autograd::variable_list grads) {
    return once_differentiable(T::kName, ctx, grads,
                               [&] { return T::gradients(ctx, grads); });
  }
};

}  // namespace pyg_fastattn
