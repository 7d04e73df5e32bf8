// gatv2_attention / gatv2_attention_backward (CPU): GATv2's per-edge score
// att . leaky_relu(x_l[j] + x_r[i] + edge_term[e]) computed on the fly, row
// softmax and weighted aggregation, and the gradients.
#include <cmath>
#include <limits>
#include <vector>

#include "row_attention.h"

namespace pyg_fastattn {
namespace {

using OptTensor = c10::optional<at::Tensor>;

// Contiguous inputs of both ops.
struct Inputs {
  at::Tensor rowptr, col, x_l, x_r, edge_term, att, mask;
};

Inputs contiguous_inputs(const at::Tensor& rowptr, const at::Tensor& col,
                         const at::Tensor& x_l, const at::Tensor& x_r,
                         const OptTensor& edge_term, const at::Tensor& att,
                         const OptTensor& mask) {
  return {rowptr.contiguous(), col.contiguous(), x_l.contiguous(),
          x_r.contiguous(), cpu::contiguous_or_undefined(edge_term),
          att.contiguous(), cpu::contiguous_or_undefined(mask)};
}

// GATv2's score policy (row_attention.h) for edge e = (j -> i), all heads:
// row(i) loads x_r[i] into buf [HC]; score() forms z = x_l[j] + x_r[i]
// (+ edge_term[e]) into buf + HC and s[h] = sum_c att[h, c] * leaky(z[h, c]),
// the value row being x_l[j].
template <typename scalar_t>
struct Score {
  using acc_t = at::opmath_type<scalar_t>;
  const scalar_t* x_l;        // [Ns, H, C]
  const scalar_t* x_r;        // [N, H, C]
  const scalar_t* edge_term;  // [E, H, C] or nullptr
  const acc_t* att;           // [H, C] in acc_t
  int64_t Ns, H, C;
  acc_t slope;

  int64_t scratch() const { return 2 * H * C; }  // x_r[i], z

  template <typename index_t>
  PFA_FORCE_INLINE void prefetch(const index_t* cl, int64_t k, int64_t E) const {
    cpu::prefetch_ahead(cl, k, E, x_l, Ns, H * C);
  }

  void row(int64_t i, acc_t* buf) const {
    const int64_t HC = H * C;
    for (int64_t q = 0; q < HC; ++q) buf[q] = acc_t(x_r[i * HC + q]);
  }

  const scalar_t* score(int64_t j, int64_t e, acc_t* buf, acc_t* s) const {
    const int64_t HC = H * C;
    const acc_t* xr_i = buf;
    acc_t* z = buf + HC;
    const scalar_t* xl = x_l + j * HC;
    if (edge_term) {
      const scalar_t* et = edge_term + e * HC;
      for (int64_t q = 0; q < HC; ++q)
        z[q] = acc_t(xl[q]) + xr_i[q] + acc_t(et[q]);
    } else {
      for (int64_t q = 0; q < HC; ++q) z[q] = acc_t(xl[q]) + xr_i[q];
    }
    for (int64_t h = 0; h < H; ++h) {
      acc_t v = 0;
      const acc_t* zh = z + h * C;
      const acc_t* ah = att + h * C;
      for (int64_t c = 0; c < C; ++c) v += ah[c] * cpu::leaky(zh[c], slope);
      s[h] = v;
    }
    return xl;
  }
};

template <typename scalar_t>
std::vector<at::opmath_type<scalar_t>> to_acc(const scalar_t* p, int64_t n) {
  return std::vector<at::opmath_type<scalar_t>>(p, p + n);
}

// The forward of row_attention.h (attend_rows) with GATv2's score.
std::tuple<at::Tensor, at::Tensor> gatv2_attention_cpu(
    const at::Tensor& rowptr_, const at::Tensor& col_, const at::Tensor& x_l_,
    const at::Tensor& x_r_, const OptTensor& edge_term_,
    const at::Tensor& att_, const OptTensor& mask_, double negative_slope,
    const OptTensor& bias_, const OptTensor& /*colptr*/,
    const OptTensor& /*csc_row*/, const OptTensor& /*csc_perm*/,
    int64_t /*max_row_len*/, int64_t /*max_col_len*/) {
  check_gatv2_attention(rowptr_, col_, x_l_, x_r_, edge_term_, att_, mask_,
                        bias_);
  const Inputs in =
      contiguous_inputs(rowptr_, col_, x_l_, x_r_, edge_term_, att_, mask_);
  const at::Tensor bias = cpu::contiguous_or_undefined(bias_);
  const int64_t N = in.rowptr.numel() - 1, E = in.col.numel(),
                Ns = in.x_l.size(0), H = in.x_l.size(1), C = in.x_l.size(2),
                HC = H * C;
  at::Tensor out = at::empty({N, H, C}, in.x_l.options());
  at::Tensor lse = at::empty(
      {N, H}, in.x_l.options().dtype(opmath_type(in.x_l.scalar_type())));
  PFA_DISPATCH_INDEX(in.rowptr.scalar_type(), "gatv2_attention_cpu", [&] {
    PFA_DISPATCH_FLOATS(in.x_l.scalar_type(), "gatv2_attention_cpu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const std::vector<acc_t> att = to_acc(in.att.const_data_ptr<scalar_t>(), HC);
      const Score<scalar_t> score{in.x_l.const_data_ptr<scalar_t>(),
                                  in.x_r.const_data_ptr<scalar_t>(),
                                  cpu::data_or_null<scalar_t>(in.edge_term),
                                  att.data(), Ns, H, C, acc_t(negative_slope)};
      const cpu::RowGraph<scalar_t, index_t> g{
          in.rowptr.const_data_ptr<index_t>(), in.col.const_data_ptr<index_t>(),
          N, E, Ns, H, C, cpu::data_or_null<scalar_t>(in.mask),
          cpu::data_or_null<scalar_t>(bias)};
      cpu::attend_rows(score, g, out.data_ptr<scalar_t>(), lse.data_ptr<acc_t>());
    });
  });
  return {out, lse};
}

// Per-channel loops of one head in the backward, with restrict pointers
// so that they vectorize (each element on its own: the same values as the
// scalar loop).
// Row pass: gz = leaky'(z) * gs * att, gatt += gs * leaky(z).
template <typename acc_t>
inline void row_head_grads(const acc_t* __restrict z, const acc_t* __restrict att,
                           acc_t gs, acc_t slope, int64_t C,
                           acc_t* __restrict gz, acc_t* __restrict gatt) {
  for (int64_t c = 0; c < C; ++c) {
    gz[c] = cpu::leaky_grad(z[c], slope, gs * att[c]);
    gatt[c] += gs * cpu::leaky(z[c], slope);
  }
}

template <typename acc_t>
inline void add_into(acc_t* __restrict dst, const acc_t* __restrict src,
                     int64_t n) {
  for (int64_t q = 0; q < n; ++q) dst[q] += src[q];
}

// Column pass: gxl += p * grad_out + leaky'(z) * gs * att, z = x_l[j] +
// x_r[i] (+ edge_term[e], when et is not null) formed as score() does.
template <typename scalar_t, typename acc_t>
inline void col_head_grads(const scalar_t* __restrict xl,
                           const scalar_t* __restrict xr,
                           const scalar_t* __restrict et,
                           const acc_t* __restrict att,
                           const scalar_t* __restrict go, acc_t p, acc_t gs,
                           acc_t slope, int64_t C, acc_t* __restrict gxl) {
  if (et) {
    for (int64_t c = 0; c < C; ++c) {
      const acc_t z = acc_t(xl[c]) + acc_t(xr[c]) + acc_t(et[c]);
      gxl[c] += p * acc_t(go[c]) + cpu::leaky_grad(z, slope, gs * att[c]);
    }
  } else {
    for (int64_t c = 0; c < C; ++c) {
      const acc_t z = acc_t(xl[c]) + acc_t(xr[c]);
      gxl[c] += p * acc_t(go[c]) + cpu::leaky_grad(z, slope, gs * att[c]);
    }
  }
}

// Row r goes to group g when its cost rowptr[r] + r lies in
// [g * width, (g + 1) * width): fixed groups of about equal work.
template <typename index_t>
int64_t first_row_of_cost(const index_t* rowptr, int64_t N, int64_t E,
                          int64_t c) {
  int64_t lo = 0, hi = N;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (cpu::clamp64(rowptr[mid], 0, E) + mid < c) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// Pass 1, by destination row, over kGatv2CpuGroups fixed row groups (taken
// by threads from a shared counter): per edge the score and alpha = exp(s -
// lse), g = mask * <grad_out[i], x_l[j]>, grad_s = alpha * (g - <grad_out[i],
// out[i] - bias>) (kept in [E, H]), grad_z = grad_s * att * leaky'(z) summed
// into grad_x_r[i] (and stored as grad_edge_term[e]), grad_s * leaky(z) into
// the group's grad_att partial. Rows over the split threshold are skipped by
// the groups and cut into fixed chunks, each with its own grad_x_r and
// grad_att partial; a long row sums its grad_x_r partials in chunk order,
// and grad_att = the group partials in group order, then the chunk partials
// in chunk order.
// p = alpha * mask is kept in [E, H] too.
// Pass 2, by source over the transpose (parallel_rows on colptr): for each
// out-edge e = (j -> i), z again for leaky'(z), and grad_x_l[j] += p[e] *
// grad_out[i] + grad_z; long columns are cut
// into chunks whose partials are summed in chunk order. Every output has one
// writer and a fixed summation order: bitwise equal for any thread count.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>
gatv2_attention_backward_cpu(
    const at::Tensor& rowptr_, const at::Tensor& col_, const at::Tensor& colptr_,
    const at::Tensor& csc_row_, const at::Tensor& csc_perm_,
    const at::Tensor& x_l_, const at::Tensor& x_r_, const OptTensor& edge_term_,
    const at::Tensor& att_, const OptTensor& mask_, double negative_slope,
    const OptTensor& bias_, const at::Tensor& out_, const at::Tensor& lse_,
    const at::Tensor& grad_out_, bool need_edge, int64_t /*max_row_len*/,
    int64_t /*max_col_len*/) {
  check_gatv2_attention_backward(rowptr_, col_, colptr_, csc_row_, csc_perm_,
                                 x_l_, x_r_, edge_term_, att_, mask_, bias_,
                                 out_, lse_, grad_out_);
  const Inputs in =
      contiguous_inputs(rowptr_, col_, x_l_, x_r_, edge_term_, att_, mask_);
  const at::Tensor colptr = colptr_.contiguous(), csc_row = csc_row_.contiguous(),
                   csc_perm = csc_perm_.contiguous(), out = out_.contiguous(),
                   lse = lse_.contiguous(), grad_out = grad_out_.contiguous(),
                   bias = cpu::contiguous_or_undefined(bias_);
  const int64_t N = in.rowptr.numel() - 1, E = in.col.numel(),
                Ns = in.x_l.size(0), H = in.x_l.size(1), C = in.x_l.size(2),
                HC = H * C;
  const bool want_edge = need_edge && in.edge_term.defined();
  const auto opts = in.x_l.options();
  at::Tensor g_l = at::empty({Ns, H, C}, opts);
  at::Tensor g_r = at::empty({N, H, C}, opts);
  at::Tensor g_e = want_edge ? at::empty({E, H, C}, opts) : at::empty({0}, opts);
  at::Tensor g_att = at::empty({H, C}, opts);
  const auto acc_opts = opts.dtype(opmath_type(in.x_l.scalar_type()));
  at::Tensor grad_s = at::empty({E, H}, acc_opts);
  at::Tensor prob = at::empty({E, H}, acc_opts);  // alpha * mask
  const int64_t G = std::max<int64_t>(1, std::min<int64_t>(kGatv2CpuGroups, N));
  at::Tensor partial = at::zeros({G, HC}, acc_opts);
  PFA_DISPATCH_INDEX(in.rowptr.scalar_type(), "gatv2_attention_backward_cpu", [&] {
    // A CSC entry pointing outside every row reads 0.
    cpu::zero_outside_rows(grad_s, in.rowptr.const_data_ptr<index_t>(), N);
    cpu::zero_outside_rows(prob, in.rowptr.const_data_ptr<index_t>(), N);
    if (want_edge) cpu::zero_outside_rows(g_e, in.rowptr.const_data_ptr<index_t>(), N);
    PFA_DISPATCH_FLOATS(in.x_l.scalar_type(), "gatv2_attention_backward_cpu", [&] {
      using acc_t = at::opmath_type<scalar_t>;
      const std::vector<acc_t> att = to_acc(in.att.const_data_ptr<scalar_t>(), HC);
      const acc_t slope = acc_t(negative_slope);
      const Score<scalar_t> score{in.x_l.const_data_ptr<scalar_t>(),
                                  in.x_r.const_data_ptr<scalar_t>(),
                                  cpu::data_or_null<scalar_t>(in.edge_term),
                                  att.data(), Ns, H, C, slope};
      const index_t* rp = in.rowptr.const_data_ptr<index_t>();
      const cpu::RowGraph<scalar_t, index_t> gr{
          rp, in.col.const_data_ptr<index_t>(), N, E, Ns, H, C,
          cpu::data_or_null<scalar_t>(in.mask), cpu::data_or_null<scalar_t>(bias)};
      const index_t* cp = colptr.const_data_ptr<index_t>();
      const index_t* rw = csc_row.const_data_ptr<index_t>();
      const index_t* pm = csc_perm.const_data_ptr<index_t>();
      const scalar_t* xr = in.x_r.const_data_ptr<scalar_t>();
      const scalar_t* o = out.const_data_ptr<scalar_t>();
      const scalar_t* go = grad_out.const_data_ptr<scalar_t>();
      const acc_t* l = lse.const_data_ptr<acc_t>();
      acc_t* gs_ptr = grad_s.data_ptr<acc_t>();
      acc_t* p_ptr = prob.data_ptr<acc_t>();
      acc_t* part = partial.data_ptr<acc_t>();
      scalar_t* gl_ptr = g_l.data_ptr<scalar_t>();
      scalar_t* gr_ptr = g_r.data_ptr<scalar_t>();
      scalar_t* ge_ptr = want_edge ? g_e.data_ptr<scalar_t>() : nullptr;

      // ---- pass 1: by destination row
      // Edges [b, e) of row i: writes grad_s and grad_edge_term, adds grad_z
      // to gxr [HC] and grad_s * leaky(z) to gatt [HC]. buf: S scratch.
      const int64_t S = cpu::backward_row_scratch(score, H) + HC;  // + grad_z
      auto row_segment = [&](int64_t i, int64_t b, int64_t e, acc_t* gxr,
                             acc_t* gatt, acc_t* buf) {
        auto tail = [&](int64_t k, int64_t, const acc_t* sb, const acc_t* gsv,
                        const acc_t* pv, acc_t* zl) {
          const acc_t* z = sb + HC;
          for (int64_t h = 0; h < H; ++h) gs_ptr[k * H + h] = gsv[h];
          for (int64_t h = 0; h < H; ++h) p_ptr[k * H + h] = pv[h];
          for (int64_t h = 0; h < H; ++h)
            row_head_grads(z + h * C, att.data() + h * C, gsv[h], slope, C,
                           zl + h * C, gatt + h * C);
          add_into(gxr, zl, HC);
          if (ge_ptr) {
            scalar_t* ge_k = ge_ptr + k * HC;
            for (int64_t q = 0; q < HC; ++q) ge_k[q] = scalar_t(zl[q]);
          }
        };
        auto skip = [&](int64_t k) {
          std::fill(gs_ptr + k * H, gs_ptr + (k + 1) * H, acc_t(0));
          std::fill(p_ptr + k * H, p_ptr + (k + 1) * H, acc_t(0));
          if (ge_ptr) std::fill(ge_ptr + k * HC, ge_ptr + (k + 1) * HC, scalar_t(0));
        };
        cpu::backward_row_segment(score, gr, o, go, l, i, b, e, buf, tail, skip);
      };
      const cpu::SplitRows sp = cpu::split_rows(rp, N, E);
      const int64_t total = N + E, width = (total + G - 1) / G;
      cpu::parallel_tasks(G, [&](int64_t g) {
        std::vector<acc_t> buf(HC + S);
        acc_t *gxr = buf.data(), *scratch = gxr + HC;
        const int64_t r0 = first_row_of_cost(rp, N, E, g * width);
        const int64_t r1 = first_row_of_cost(rp, N, E, std::min(total, (g + 1) * width));
        for (int64_t i = r0; i < r1; ++i) {
          const auto [b, e] = cpu::row_range(rp, i, E);
          if (sp.is_long(b, e)) continue;  // split below
          std::fill(gxr, gxr + HC, acc_t(0));
          row_segment(i, b, e, gxr, part + g * HC, scratch);
          for (int64_t q = 0; q < HC; ++q) gr_ptr[i * HC + q] = scalar_t(gxr[q]);
        }
      });
      // Long rows: one partial {grad_x_r, grad_att} per chunk.
      const int64_t P = 2 * HC;
      std::vector<acc_t> rpart(sp.chunks() * P, acc_t(0));
      cpu::parallel_chunks(sp, rp, E, [&](int64_t, int64_t i, int64_t b,
                                           int64_t e, int64_t q) {
        std::vector<acc_t> buf(S);
        acc_t* p = rpart.data() + q * P;
        row_segment(i, b, e, p, p + HC, buf.data());
      });
      cpu::parallel_long_rows(sp, [&](int64_t k, int64_t i) {
        std::vector<acc_t> buf(P);
        cpu::sum_chunks(sp, k, rpart.data(), P, buf.data());
        for (int64_t q = 0; q < HC; ++q) gr_ptr[i * HC + q] = scalar_t(buf[q]);
      });
      scalar_t* ga = g_att.data_ptr<scalar_t>();
      for (int64_t q = 0; q < HC; ++q) {
        acc_t v = 0;
        for (int64_t g = 0; g < G; ++g) v += part[g * HC + q];
        for (int64_t c = 0; c < sp.chunks(); ++c) v += rpart[c * P + HC + q];
        ga[q] = scalar_t(v);
      }

      // ---- pass 2: by source over the transpose
      // CSC entries [b, end) of column j: adds their grad_x_l terms to gxl
      // [HC].
      auto col_segment = [&](int64_t j, int64_t b, int64_t end, acc_t* gxl,
                             acc_t*) {
        const scalar_t* xl_j = score.x_l + j * HC;
        for (int64_t k = b; k < end; ++k) {
          const int64_t i = rw[k], e = pm[k];
          cpu::prefetch_ahead(rw, k, E, go, N, HC);
          cpu::prefetch_ahead(rw, k, E, xr, N, HC);
          if (i < 0 || i >= N || e < 0 || e >= E) continue;
          const scalar_t *go_i = go + i * HC, *xr_i = xr + i * HC;
          const scalar_t* et_e =
              score.edge_term ? score.edge_term + e * HC : nullptr;
          for (int64_t h = 0; h < H; ++h) {
            if (!cpu::has_weight(l[i * H + h])) continue;
            const int64_t o = h * C;
            col_head_grads(xl_j + o, xr_i + o, et_e ? et_e + o : nullptr,
                           att.data() + o, go_i + o, p_ptr[e * H + h],
                           gs_ptr[e * H + h], slope, C, gxl + o);
          }
        }
      };
      cpu::reduce_rows<acc_t>(
          cp, Ns, E, HC, 0, 2 * HC, col_segment,
          [&](int64_t j, const acc_t* gxl) {
            for (int64_t q = 0; q < HC; ++q) gl_ptr[j * HC + q] = scalar_t(gxl[q]);
          });
    });
  });
  return {g_l, g_r, g_e, g_att};
}

}  // namespace
}  // namespace pyg_fastattn

TORCH_LIBRARY_IMPL(pyg_fastattn, CPU, m) {
  m.impl("gatv2_attention", &pyg_fastattn::gatv2_attention_cpu);
  m.impl("gatv2_attention_backward", &pyg_fastattn::gatv2_attention_backward_cpu);
}
