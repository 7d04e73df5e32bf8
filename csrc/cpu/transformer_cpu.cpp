// transformer_attention / transformer_attention_backward (CPU):
// TransformerConv's per-edge score scale * <query[i], key[j] + edge_term[e]>
// computed on the fly, row softmax and weighted aggregation of
// value[j] + edge_term[e], and the gradients. The row kernels are the ones
// of gatv2_cpu.cpp (row_attention.h) with this score.
#include <cmath>
#include <vector>

#include "row_attention.h"

namespace pyg_fastattn {
namespace {

using OptTensor = c10::optional<at::Tensor>;

// Contiguous inputs of both ops.
struct Inputs {
  at::Tensor rowptr, col, query, key, value, edge_term, mask;
};

Inputs contiguous_inputs(const at::Tensor& rowptr, const at::Tensor& col,
                         const at::Tensor& query, const at::Tensor& key,
                         const at::Tensor& value, const OptTensor& edge_term,
                         const OptTensor& mask) {
  return {rowptr.contiguous(), col.contiguous(), query.contiguous(),
          key.contiguous(), value.contiguous(),
          cpu::contiguous_or_undefined(edge_term),
          cpu::contiguous_or_undefined(mask)};
}

// Score policy (row_attention.h) for edge e = (j -> i), all heads: row(i)
// loads query[i] into buf [HC]; score() gives s[h] = scale * <query[i, h],
// k'[h]> and the value row v', with k' = key[j], v' = value[j] read in place,
// or (EDGE) k' = key[j] + edge_term[e], v' = value[j] + edge_term[e] formed
// in buf + HC and buf + 2 * HC.
template <typename scalar_t, bool EDGE>
struct DotScore {
  using acc_t = at::opmath_type<scalar_t>;
  static constexpr bool kEdge = EDGE;
  const scalar_t* query;      // [N, H, C]
  const scalar_t* key;        // [Ns, H, C]
  const scalar_t* value;      // [Ns, H, C]
  const scalar_t* edge_term;  // [E, H, C] (EDGE)
  int64_t Ns, H, C;
  acc_t scale;

  int64_t scratch() const { return (EDGE ? 3 : 1) * H * C; }

  template <typename index_t>
  PFA_FORCE_INLINE void prefetch(const index_t* cl, int64_t k, int64_t E) const {
    cpu::prefetch_ahead(cl, k, E, key, Ns, H * C);
    cpu::prefetch_ahead(cl, k, E, value, Ns, H * C);
  }

  void row(int64_t i, acc_t* buf) const {
    const int64_t HC = H * C;
    for (int64_t q = 0; q < HC; ++q) buf[q] = acc_t(query[i * HC + q]);
  }

  auto score(int64_t j, int64_t e, acc_t* buf, acc_t* s) const {
    const int64_t HC = H * C;
    const scalar_t* kj = key + j * HC;
    const scalar_t* vj = value + j * HC;
    if constexpr (EDGE) {
      acc_t *kp = buf + HC, *vp = buf + 2 * HC;
      const scalar_t* et = edge_term + e * HC;
      for (int64_t q = 0; q < HC; ++q) {
        const acc_t t = acc_t(et[q]);
        kp[q] = acc_t(kj[q]) + t;
        vp[q] = acc_t(vj[q]) + t;
      }
      for (int64_t h = 0; h < H; ++h)
        s[h] = scale * cpu::dot(buf + h * C, kp + h * C, C);
      return static_cast<const acc_t*>(vp);
    } else {
      for (int64_t h = 0; h < H; ++h)
        s[h] = scale * cpu::dot(buf + h * C, kj + h * C, C);
      return vj;
    }
  }

  // k' of edge (j -> i) after score(j, e, buf, s).
  auto key_row(int64_t j, const acc_t* buf) const {
    if constexpr (EDGE) {
      return buf + H * C;
    } else {
      return key + j * H * C;
    }
  }
};

// f(policy) with the policy of the inputs (with or without edge_term).
template <typename scalar_t, typename F>
void with_score(const Inputs& in, double scale, const F& f) {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* q = in.query.const_data_ptr<scalar_t>();
  const scalar_t* k = in.key.const_data_ptr<scalar_t>();
  const scalar_t* v = in.value.const_data_ptr<scalar_t>();
  const int64_t Ns = in.key.size(0), H = in.key.size(1), C = in.key.size(2);
  if (in.edge_term.defined())
    f(DotScore<scalar_t, true>{q, k, v, in.edge_term.const_data_ptr<scalar_t>(),
                               Ns, H, C, acc_t(scale)});
  else
    f(DotScore<scalar_t, false>{q, k, v, nullptr, Ns, H, C, acc_t(scale)});
}

// Per-channel loops with restrict pointers so that they vectorize (each
// element on its own: the same values as the scalar loop).
// y += a * x.
template <typename acc_t, typename T>
inline void axpy(acc_t a, const T* __restrict x, int64_t n,
                 acc_t* __restrict y) {
  for (int64_t c = 0; c < n; ++c) y[c] += a * acc_t(x[c]);
}

// grad_edge_term of one head: gs * q + p * grad_out.
template <typename scalar_t, typename acc_t>
inline void edge_head_grads(acc_t gs, const acc_t* __restrict q, acc_t p,
                            const scalar_t* __restrict go, int64_t C,
                            scalar_t* __restrict ge) {
  for (int64_t c = 0; c < C; ++c)
    ge[c] = scalar_t(gs * q[c] + p * acc_t(go[c]));
}

// The forward of row_attention.h (attend_rows) with the dot-product score.
std::tuple<at::Tensor, at::Tensor> transformer_attention_cpu(
    const at::Tensor& rowptr_, const at::Tensor& col_,
    const at::Tensor& query_, const at::Tensor& key_,
    const at::Tensor& value_, const OptTensor& edge_term_,
    const OptTensor& mask_, double scale, const OptTensor& /*colptr*/,
    const OptTensor& /*csc_row*/, const OptTensor& /*csc_perm*/,
    int64_t /*max_row_len*/, int64_t /*max_col_len*/,
    bool /*grads_in_place*/) {
  check_transformer_attention(rowptr_, col_, query_, key_, value_, edge_term_,
                              mask_);
  const Inputs in = contiguous_inputs(rowptr_, col_, query_, key_, value_,
                                      edge_term_, mask_);
  const int64_t N = in.rowptr.numel() - 1, E = in.col.numel(),
                Ns = in.key.size(0), H = in.key.size(1), C = in.key.size(2);
  at::Tensor out = at::empty({N, H, C}, in.key.options());
  at::Tensor lse = at::empty(
      {N, H}, in.key.options().dtype(opmath_type(in.key.scalar_type())));
  PFA_DISPATCH_INDEX(in.rowptr.scalar_type(), "transformer_attention_cpu", [&] {
    PFA_DISPATCH_FLOATS(in.key.scalar_type(), "transformer_attention_cpu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const cpu::RowGraph<scalar_t, index_t> g{
          in.rowptr.const_data_ptr<index_t>(), in.col.const_data_ptr<index_t>(),
          N, E, Ns, H, C, cpu::data_or_null<scalar_t>(in.mask), nullptr};
      with_score<scalar_t>(in, scale, [&](const auto& pol) {
        cpu::attend_rows(pol, g, out.data_ptr<scalar_t>(), lse.data_ptr<acc_t>());
      });
    });
  });
  return {out, lse};
}

// Pass 1, by destination row (reduce_rows on rowptr): per edge the score
// and alpha = exp(s - lse), g = mask * <grad_out[i], v'>, grad_s = alpha *
// (g - <grad_out[i], out[i]>); scale * grad_s and p = alpha * mask kept in
// [E, H] each, grad_query[i] += scale * grad_s * k', grad_edge_term[e] =
// scale * grad_s * query[i] + p * grad_out[i].
// Pass 2, by source over the transpose (reduce_rows on colptr): for each
// out-edge e = (j -> i), grad_key[j] += scale * grad_s[e] * query[i] and
// grad_value[j] += p[e] * grad_out[i].
// Long rows and columns are cut into fixed chunks whose partials are summed
// in chunk order; every output has one writer and a fixed summation order:
// bitwise equal for any thread count.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
transformer_attention_backward_cpu(
    const at::Tensor& rowptr_, const at::Tensor& col_, const at::Tensor& colptr_,
    const at::Tensor& csc_row_, const at::Tensor& csc_perm_,
    const at::Tensor& query_, const at::Tensor& key_, const at::Tensor& value_,
    const OptTensor& edge_term_, const OptTensor& mask_, double scale,
    const at::Tensor& out_, const at::Tensor& lse_, const at::Tensor& grad_out_,
    bool need_edge, int64_t /*max_row_len*/, int64_t /*max_col_len*/) {
  check_transformer_attention_backward(rowptr_, col_, colptr_, csc_row_,
                                       csc_perm_, query_, key_, value_,
                                       edge_term_, mask_, out_, lse_, grad_out_);
  const Inputs in = contiguous_inputs(rowptr_, col_, query_, key_, value_,
                                      edge_term_, mask_);
  const at::Tensor colptr = colptr_.contiguous(), csc_row = csc_row_.contiguous(),
                   csc_perm = csc_perm_.contiguous(), out = out_.contiguous(),
                   lse = lse_.contiguous(), grad_out = grad_out_.contiguous();
  const int64_t N = in.rowptr.numel() - 1, E = in.col.numel(),
                Ns = in.key.size(0), H = in.key.size(1), C = in.key.size(2),
                HC = H * C;
  const bool want_edge = need_edge && in.edge_term.defined();
  const auto opts = in.key.options();
  at::Tensor g_q = at::empty({N, H, C}, opts);
  at::Tensor g_k = at::empty({Ns, H, C}, opts);
  at::Tensor g_v = at::empty({Ns, H, C}, opts);
  at::Tensor g_e = want_edge ? at::empty({E, H, C}, opts) : at::empty({0}, opts);
  const auto acc_opts = opts.dtype(opmath_type(in.key.scalar_type()));
  at::Tensor grad_s = at::empty({E, H}, acc_opts);  // scale * grad_s
  at::Tensor prob = at::empty({E, H}, acc_opts);    // alpha * mask
  PFA_DISPATCH_INDEX(in.rowptr.scalar_type(), "transformer_attention_backward_cpu", [&] {
    const index_t* rp = in.rowptr.const_data_ptr<index_t>();
    // A CSC entry pointing outside every row reads 0.
    cpu::zero_outside_rows(grad_s, rp, N);
    cpu::zero_outside_rows(prob, rp, N);
    if (want_edge) cpu::zero_outside_rows(g_e, rp, N);
    PFA_DISPATCH_FLOATS(in.key.scalar_type(), "transformer_attention_backward_cpu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const cpu::RowGraph<scalar_t, index_t> gr{
          rp, in.col.const_data_ptr<index_t>(), N, E, Ns, H, C,
          cpu::data_or_null<scalar_t>(in.mask), nullptr};
      const index_t* cp = colptr.const_data_ptr<index_t>();
      const index_t* rw = csc_row.const_data_ptr<index_t>();
      const index_t* pm = csc_perm.const_data_ptr<index_t>();
      const scalar_t* qy = in.query.const_data_ptr<scalar_t>();
      const scalar_t* o = out.const_data_ptr<scalar_t>();
      const scalar_t* go = grad_out.const_data_ptr<scalar_t>();
      const acc_t* l = lse.const_data_ptr<acc_t>();
      acc_t* gs_ptr = grad_s.data_ptr<acc_t>();
      acc_t* p_ptr = prob.data_ptr<acc_t>();
      scalar_t* gq_ptr = g_q.data_ptr<scalar_t>();
      scalar_t* gk_ptr = g_k.data_ptr<scalar_t>();
      scalar_t* gv_ptr = g_v.data_ptr<scalar_t>();
      scalar_t* ge_ptr = want_edge ? g_e.data_ptr<scalar_t>() : nullptr;
      const acc_t sc = acc_t(scale);

      // ---- pass 1: by destination row
      with_score<scalar_t>(in, scale, [&](const auto& pol) {
        // Edges [b, e) of row i: writes grad_s, p and grad_edge_term, adds
        // scale * grad_s * k' to gq [HC].
        auto row_segment = [&](int64_t i, int64_t b, int64_t e, acc_t* gq,
                               acc_t* buf) {
          const scalar_t* go_i = go + i * HC;
          auto tail = [&](int64_t k, int64_t j, const acc_t* sb,
                          const acc_t* gsv, const acc_t* pv, acc_t*) {
            const auto* kp = pol.key_row(j, sb);
            for (int64_t h = 0; h < H; ++h) {
              const acc_t gs = sc * gsv[h];
              gs_ptr[k * H + h] = gs;
              p_ptr[k * H + h] = pv[h];
              axpy(gs, kp + h * C, C, gq + h * C);
            }
            if (ge_ptr)
              for (int64_t h = 0; h < H; ++h)
                edge_head_grads(gs_ptr[k * H + h], sb + h * C, pv[h],
                                go_i + h * C, C, ge_ptr + k * HC + h * C);
          };
          auto skip = [&](int64_t k) {
            std::fill(gs_ptr + k * H, gs_ptr + (k + 1) * H, acc_t(0));
            std::fill(p_ptr + k * H, p_ptr + (k + 1) * H, acc_t(0));
            if (ge_ptr)
              std::fill(ge_ptr + k * HC, ge_ptr + (k + 1) * HC, scalar_t(0));
          };
          cpu::backward_row_segment(pol, gr, o, go, l, i, b, e, buf, tail,
                                    skip);
        };
        cpu::reduce_rows<acc_t>(
            rp, N, E, HC, cpu::backward_row_scratch(pol, H), 2 * HC,
            row_segment, [&](int64_t i, const acc_t* gq) {
              for (int64_t q = 0; q < HC; ++q) gq_ptr[i * HC + q] = scalar_t(gq[q]);
            });
      });

      // ---- pass 2: by source over the transpose
      // CSC entries [b, end) of column j: adds scale * grad_s * query[i] to
      // acc [0, HC) and p * grad_out[i] to acc [HC, 2 HC).
      auto col_segment = [&](int64_t j, int64_t b, int64_t end, acc_t* acc,
                             acc_t*) {
        for (int64_t k = b; k < end; ++k) {
          const int64_t i = rw[k], e = pm[k];
          cpu::prefetch_ahead(rw, k, E, qy, N, HC);
          cpu::prefetch_ahead(rw, k, E, go, N, HC);
          if (i < 0 || i >= N || e < 0 || e >= E) continue;
          for (int64_t h = 0; h < H; ++h) {
            axpy(gs_ptr[e * H + h], qy + i * HC + h * C, C, acc + h * C);
            axpy(p_ptr[e * H + h], go + i * HC + h * C, C, acc + HC + h * C);
          }
        }
      };
      cpu::reduce_rows<acc_t>(
          cp, Ns, E, 2 * HC, 0, 2 * HC, col_segment,
          [&](int64_t j, const acc_t* acc) {
            for (int64_t q = 0; q < HC; ++q) {
              gk_ptr[j * HC + q] = scalar_t(acc[q]);
              gv_ptr[j * HC + q] = scalar_t(acc[HC + q]);
            }
          });
    });
  });
  return {g_q, g_k, g_v, g_e};
}

// The in-place form: pass 1 reads every row of out, and pass 2 every key and
// value row, through the [E, H] buffers, so the gradients are computed apart
// and copied over.
at::Tensor transformer_attention_backward_cpu_(
    const at::Tensor& rowptr, const at::Tensor& col, const at::Tensor& colptr,
    const at::Tensor& csc_row, const at::Tensor& csc_perm,
    const at::Tensor& query, at::Tensor& key, at::Tensor& value,
    const OptTensor& edge_term, const OptTensor& mask, double scale,
    at::Tensor& out, const at::Tensor& lse, const at::Tensor& grad_out,
    bool need_edge, int64_t max_row_len, int64_t max_col_len) {
  auto g = transformer_attention_backward_cpu(
      rowptr, col, colptr, csc_row, csc_perm, query, key, value, edge_term,
      mask, scale, out, lse, grad_out, need_edge, max_row_len, max_col_len);
  out.copy_(std::get<0>(g));
  key.copy_(std::get<1>(g));
  value.copy_(std::get<2>(g));
  return std::get<3>(g);
}

}  // namespace
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, CPU, m) {
  m.impl("transformer_attention", &pyg_fastattn::transformer_attention_cpu);
  m.impl("transformer_attention_backward",
         &pyg_fastattn::transformer_attention_backward_cpu);
  m.impl("transformer_attention_backward_",
         &pyg_fastattn::transformer_attention_backward_cpu_);
}
