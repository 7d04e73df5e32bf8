// Shared helpers for pyg_fastattn's C++/CUDA sources.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <string>
#include <type_traits>

namespace pyg_fastattn {
namespace detail {

// Check messages are assembled with std::to_string, never by streaming a
// number into a std::ostream: on the lent H200 image (torch 2.11.0+cu130,
// g++ 13.3) an extension that formats a number that way crashes (SIGSEGV)
// when the check fails, so a bad input killed the process instead of
// raising. Strings and these types only; anything else does not compile.
inline void msg_append(std::string& s, const char* v) { s += v; }
inline void msg_append(std::string& s, const std::string& v) { s += v; }
inline void msg_append(std::string& s, char v) { s += v; }
template <typename T, std::enable_if_t<std::is_arithmetic_v<T>, int> = 0>
void msg_append(std::string& s, T v) {
  s += std::to_string(v);
}
inline void msg_append(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}
inline void msg_append(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void msg_append(std::string& s, const c10::Device& v) { s += v.str(); }

template <typename... Args>
std::string msg(const Args&... args) {
  std::string s;
  (msg_append(s, args), ...);
  return s;
}

}  // namespace detail
}  // namespace pyg_fastattn

#define PFA_CHECK(cond, ...) \
  TORCH_CHECK(cond, ::pyg_fastattn::detail::msg("pyg_fastattn: ", __VA_ARGS__))

// Floating types every op takes. CPU kernels instantiate float/double (and
// may add half/bfloat16); CUDA kernels all four, accumulating in float.
#define PFA_DISPATCH_FLOATS(TYPE, NAME, ...)                                  \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::Half,                       \
                                  at::ScalarType::BFloat16, TYPE, NAME,       \
                                  __VA_ARGS__)

// int32 / int64 indices; the body sees `index_t`.
#define PFA_DISPATCH_INDEX(TYPE, NAME, ...) \
  AT_DISPATCH_INDEX_TYPES(TYPE, NAME, __VA_ARGS__)

namespace pyg_fastattn {

// ---------------------------------------------------------------------------
// Tuning constants.
//
// Edge-balanced scheduling of long rows (CPU and CUDA, every CSR / CSC row
// kernel): a row (or CSC column) with more than kSplitEdges edges is cut into
// chunks of kSplitChunk edges, each processed by its own worker (a CUDA block,
// a CPU task) into a partial result (softmax max / sum, accumulator); the
// partials of a row are combined in chunk order (deterministic, no atomics).
// On CUDA the chunks are the global edge windows [w * chunk, (w + 1) * chunk)
// clipped to the row. Shorter rows keep the row-per-warp / block kernels.
constexpr int64_t kSplitEdges = 4096;
constexpr int64_t kSplitChunk = 2048;

// gat_attention on CUDA: graphs with h of at most this many elements take
// the score-term kernels of gat_score.cu (host-bound sizes: one launch
// instead of a GEMM and five helpers), larger ones the block-diagonal GEMM;
// the backward's column sums take at least kGatScoreRows rows per block.
constexpr int64_t kGatScoreKernelElems = int64_t(1) << 24;
constexpr int64_t kGatScoreRows = 64;
// When x needs no gradient the backward can fold the score terms' gradient
// through x (three more GEMMs and five helpers, less device traffic); up to
// this many elements of h it takes the score kernel instead (host-bound
// sizes, where each cuBLAS call costs more host time than its traffic).
constexpr int64_t kGatScoreThroughXElems = int64_t(1) << 23;

// CUDA edge_softmax one-pass path: score elements a lane holds in registers
// in the forward, and of each of out and grad_out in the backward (double:
// half as many). Rows whose span fits the lanes of their group (at most a
// warp) are read once and written once. Rows of more than
// kSoftmaxSplitElems / H edges (clamped to [kSplitChunk, kSplitEdges]) take
// the split path.
constexpr int kSoftmaxLaneElems = 20;
constexpr int kSoftmaxLaneElemsBwd = 12;
constexpr int64_t kSoftmaxSplitElems = 16384;

// Column sums of a [R, K] tensor (bias gradients, column_sum): on CUDA from
// this many rows a GEMV against ones, which reads the rows at near copy
// rate where sum(0)'s reduction kernel does not; below it, and on the CPU,
// sum(0).
constexpr int64_t kColumnSumGemvRows = 16384;

// CUDA attention forward, one head per lane, kernels for a fixed set of
// score terms (GAT, softmax_aggregate): resident blocks per SM they are
// compiled for (__launch_bounds__); their gathers need many rows in flight.
// The kernel that checks every term at run time (attention dropout, edge
// features) holds more registers.
constexpr int kAttnFwdBlocks = 4;
constexpr int kAttnFwdBlocksAny = 3;

// CUDA attention backward: resident blocks per SM its variants are compiled
// for (__launch_bounds__): the full kernel (mask, a_edge, streaming units),
// the lean ones (one head per lane, no mask), and the fp32 and bfloat16 lean
// kernels without per-edge terms (GAT): fp32 at 64 registers, with
// kAttnBwdNarrowBatch entries in flight so that nothing spills; bfloat16 at
// 80, where 64 spill.
constexpr int kAttnBwdBlocksFull = 2;
constexpr int kAttnBwdBlocksLean = 3;
constexpr int kAttnBwdBlocksLeanFp32 = 4;
constexpr int kAttnBwdBlocksLeanBf16 = 3;

// CUDA attention with one head per lane: each weight of an edge batch is
// computed by one lane of its head and shuffled to the others ("owner
// lanes"), where these say so; otherwise every lane computes every weight.
// kOwnerLanesBwdFp32: the float32 backward without per-edge terms;
// kOwnerLanesBwdOther: the other lean backward kernels (half types,
// softmax_aggregate's). PYG_FASTATTN_OWNER_LANES=0 / 1 (tests, A/B runs)
// turns them off / on everywhere; read at every launch.
constexpr bool kOwnerLanesFwd = true;
constexpr bool kOwnerLanesBwdFp32 = false;
constexpr bool kOwnerLanesBwdOther = false;

// CUDA: threads per block of every kernel except the graph builders
// (kGraphBlock).
constexpr int kBlock = 256;

// CUDA edge batches: edges whose loads a lane keeps in flight per iteration
// in the attention / spmm aggregation (kEdgeBatch), in sddmm_dot
// (kSddmmBatch: 2 * kSddmmBatch vector loads) and in the narrow-row
// segment_sum (kSegEdgeBatch).
constexpr int kEdgeBatch = 4;
constexpr int kSddmmBatch = 4;
constexpr int kSegEdgeBatch = 4;
// Narrow-row segment_sum (CUDA): rows of at most kSegMaxBytes bytes take a
// group of G lanes each (G at least kSegMinGroup), wider ones the
// warp-per-row engine.
constexpr int kSegMaxBytes = 32;
constexpr int kSegMinGroup = 1;

// An A/B switch: the environment variable `name` set to 0 / 1 overrides
// dflt (unset or empty: dflt). Read at every launch, so tests can flip it.
inline bool env_flag(const char* name, bool dflt) {
  const char* env = std::getenv(name);
  return (env == nullptr || *env == '\0') ? dflt : std::atoi(env) != 0;
}

inline bool owner_lanes(bool dflt) {
  return env_flag("PYG_FASTATTN_OWNER_LANES", dflt);
}

// The float32 lean attention backward with owner lanes and at least this
// many lanes a head can keep this many entries a lane in flight (at three
// blocks per SM instead of four); bwd_wide_batch() says whether it does:
// PYG_FASTATTN_BWD_WIDE=0 / 1 (tests, A/B runs) overrides the default.
constexpr int kAttnBwdWideBatch = 8;
constexpr bool kAttnBwdWideDefault = false;

inline bool bwd_wide_batch() {
  return env_flag("PYG_FASTATTN_BWD_WIDE", kAttnBwdWideDefault);
}

// The float32 lean attention backward without owner lanes: entries of a
// column a lane keeps in flight per batch, kAttnBwdNarrowBatch (no spills at
// kAttnBwdBlocksLeanFp32 blocks) or bwd_batch's 4 (spills there);
// bwd_narrow_batch() says which: PYG_FASTATTN_BWD_NARROW=0 / 1 (tests, A/B
// runs) overrides the default.
constexpr int kAttnBwdNarrowBatch = 2;
constexpr bool kAttnBwdNarrowDefault = true;

inline bool bwd_narrow_batch() {
  return env_flag("PYG_FASTATTN_BWD_NARROW", kAttnBwdNarrowDefault);
}

struct SplitPlan {
  int64_t split;  // rows with more edges than this are split (>= chunk)
  int64_t chunk;  // edges per chunk
};

// The plan of one launch (an op may pass its own threshold and chunk).
// PYG_FASTATTN_SPLIT_EDGES=n (tests) sets the threshold to n and the chunk
// to max(1, min(kSplitChunk, n / 2)), so that small graphs take the split
// path; read at every launch.
inline SplitPlan split_plan(int64_t split = kSplitEdges,
                            int64_t chunk = kSplitChunk) {
  SplitPlan p{split, chunk};
  if (const char* env = std::getenv("PYG_FASTATTN_SPLIT_EDGES")) {
    const long long n = std::atoll(env);
    if (n > 0) {
      p.split = n;
      p.chunk = std::max<int64_t>(1, std::min<int64_t>(kSplitChunk, n / 2));
    }
  }
  return p;
}

// The longest CSR row and CSC column of the graph that the current fused op
// runs on, when its caller knows them (-1: unknown). A fused op sets them
// (LengthHintGuard) around its inner ops; a CUDA split path is skipped (its
// mark, partial and combine launches: host time on small graphs) when no
// row is longer than its threshold, which changes no result, since the
// split path takes only such rows.
struct LengthHint {
  int64_t rows = -1;
  int64_t cols = -1;
};
inline LengthHint& length_hint() {
  thread_local LengthHint h;
  return h;
}
class LengthHintGuard {
 public:
  LengthHintGuard(int64_t rows, int64_t cols) : prev_(length_hint()) {
    length_hint() = LengthHint{rows, cols};
  }
  ~LengthHintGuard() { length_hint() = prev_; }
  LengthHintGuard(const LengthHintGuard&) = delete;
  LengthHintGuard& operator=(const LengthHintGuard&) = delete;

 private:
  LengthHint prev_;
};

// Accumulation type: float for half/bfloat16/float, double for double.
inline at::ScalarType opmath_type(at::ScalarType t) {
  return t == at::kDouble ? at::kDouble : at::kFloat;
}

// Metadata checks only (rank, dtype, device, sizes). They never read tensor
// data, so they cost no host synchronization. Index *values* (range, order,
// rowptr[-1] == E) are validated once in Python (pyg_fastattn/ops/_checks.py)
// and kernels clamp every index they read, so bad input can never read or
// write out of bounds.
void check_rowptr(const at::Tensor& rowptr, const char* name = "rowptr");
void check_index(const at::Tensor& index, const at::Tensor& rowptr,
                 const char* name);
void check_float(const at::Tensor& t, const char* name, int64_t dim);
void check_same_device(const at::Tensor& ref, const at::Tensor& t,
                       const char* ref_name, const char* name);
void check_same_dtype(const at::Tensor& ref, const at::Tensor& t,
                      const char* ref_name, const char* name);
void check_size(const at::Tensor& t, int64_t dim, int64_t size,
                const char* name, const char* what);
// t: `rows` rows (what: their meaning) of ref's heads (and channels when
// dim == 3), ref's dtype and device.
void check_rows(const at::Tensor& ref, const char* ref_name,
                const at::Tensor& t, const char* name, int64_t rows,
                const char* what, int64_t dim);
// What a fused attention backward reads besides the forward's inputs: the
// transpose (colptr [Ns + 1], csc_row and csc_perm [E]), out and grad_out
// [N, H, C] like src [Ns, H, C], lse [N, H] in src's opmath type.
void check_backward_state(const at::Tensor& rowptr, const at::Tensor& col,
                          const at::Tensor& colptr, const at::Tensor& csc_row,
                          const at::Tensor& csc_perm, const at::Tensor& src,
                          const char* src_name, const at::Tensor& out,
                          const at::Tensor& lse, const at::Tensor& grad_out);

// Per-op checks; each is defined in csrc/ops/<op>.cpp next to its schema and
// called first by the CPU and the CUDA kernel of that op.
void check_edge_softmax(const at::Tensor& rowptr, const at::Tensor& scores);
void check_edge_softmax_backward(const at::Tensor& rowptr,
                                 const at::Tensor& out,
                                 const at::Tensor& grad_out);
void check_sddmm_dot(const at::Tensor& a, const at::Tensor& b,
                     const at::Tensor& a_idx, const at::Tensor& b_idx);
void check_spmm(const at::Tensor& rowptr, const at::Tensor& col,
                const c10::optional<at::Tensor>& weight,
                const c10::optional<at::Tensor>& weight_perm,
                const at::Tensor& values);
void check_segment_sum(const at::Tensor& rowptr,
                       const c10::optional<at::Tensor>& perm,
                       const at::Tensor& src);
void check_attention(const at::Tensor& rowptr, const at::Tensor& col,
                     const c10::optional<at::Tensor>& a_src,
                     const c10::optional<at::Tensor>& a_dst,
                     const c10::optional<at::Tensor>& a_edge,
                     const c10::optional<at::Tensor>& mask,
                     const at::Tensor& values,
                     const c10::optional<at::Tensor>& bias);
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
                              const c10::optional<at::Tensor>& bias);

}  // namespace pyg_fastattn

// ---------------------------------------------------------------------------
// gatv2_attention (csrc/ops/gatv2_attention.cpp, csrc/cpu/gatv2_cpu.cpp,
// csrc/cuda/gatv2.cu).
namespace pyg_fastattn {

// CPU backward: rows are cut into this many fixed groups of about equal
// edge count; each group writes one partial of grad_att, summed in group
// order, so the result does not depend on the thread count.
constexpr int64_t kGatv2CpuGroups = 256;
// CUDA backward, destination pass: this many blocks at most (a fixed grid,
// rows strided over its warps); one grad_att partial per block.
constexpr int64_t kGatv2CudaBwdBlocks = 2048;
// CUDA: split path of the gatv2 kernels (one warp walks a row's edges one
// by one, so long rows are split sooner than kSplitEdges). A window of
// kGatv2SplitChunk edges goes to one block; the window partials take
// 2 * E / chunk rows of H * C accumulators whenever E exceeds the split.
constexpr int64_t kGatv2SplitEdges = 2048;
constexpr int64_t kGatv2SplitChunk = 2048;
// CUDA: edges whose gathers a warp of the gatv2 / transformer kernels
// (forward and both backward passes) issues before using them. One: a
// larger batch's registers cost more occupancy than its gathers in flight
// gain (benchmarks/RESULTS.md).
constexpr int kGatv2EdgeBatch = 1;
// CUDA: with one, two or four slots a lane (aligned rows of 32- or 16-bit
// floats) the gatv2 / transformer kernels can gather through a ring of
// kGatv2AsyncStages stages in shared memory (cp.async), kGatv2AsyncStages - 1
// edges ahead of the edge they compute, so that the rows of several edges
// are in flight without registers to hold them.
// By default they do for 32-bit floats where one gathered table (rows x
// H x C) is larger than the L2 cache; gatv2_async(dflt):
// PYG_FASTATTN_GATV2_ASYNC=0 / 1 (tests, A/B runs) overrides that;
// gatv2_stages(): PYG_FASTATTN_GATV2_STAGES=2..8 overrides the stages.
constexpr int kGatv2AsyncStages = 4;

inline bool gatv2_async(bool dflt) {
  return env_flag("PYG_FASTATTN_GATV2_ASYNC", dflt);
}

// Resident blocks per SM that the ASYNC backward kernels with one slot a
// lane are compiled for (launch bounds: at most 80 registers for three
// blocks, 64 for four, where the others spill); the forward stays within 64
// without a bound, and kernels of several slots have none.
constexpr int kGatv2AsyncBlocksRows = 3;       // destination pass, both
constexpr int kGatv2AsyncBlocksCols = 4;       // gatv2 source pass, float32
constexpr int kGatv2AsyncBlocksColsOther = 3;  // the other source passes

inline int gatv2_stages() {
  const char* env = std::getenv("PYG_FASTATTN_GATV2_STAGES");
  const int n = (env == nullptr || *env == '\0') ? kGatv2AsyncStages
                                                 : std::atoi(env);
  return n < 2 ? 2 : (n > 8 ? 8 : n);
}

void check_gatv2_attention(const at::Tensor& rowptr, const at::Tensor& col,
                           const at::Tensor& x_l, const at::Tensor& x_r,
                           const c10::optional<at::Tensor>& edge_term,
                           const at::Tensor& att,
                           const c10::optional<at::Tensor>& mask,
                           const c10::optional<at::Tensor>& bias);
void check_gatv2_attention_backward(
    const at::Tensor& rowptr, const at::Tensor& col, const at::Tensor& colptr,
    const at::Tensor& csc_row, const at::Tensor& csc_perm,
    const at::Tensor& x_l, const at::Tensor& x_r,
    const c10::optional<at::Tensor>& edge_term, const at::Tensor& att,
    const c10::optional<at::Tensor>& mask,
    const c10::optional<at::Tensor>& bias, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& grad_out);

}  // namespace pyg_fastattn

// ---------------------------------------------------------------------------
// transformer_attention (csrc/ops/transformer_attention.cpp,
// csrc/cpu/transformer_cpu.cpp, csrc/cuda).
namespace pyg_fastattn {

// rowptr [N+1]; col [E]; query [N, H, C]; key, value [Ns, H, C];
// edge_term [E, H, C]; mask [E, H]. Float tensors share key's dtype and
// device.
void check_transformer_attention(const at::Tensor& rowptr,
                                 const at::Tensor& col,
                                 const at::Tensor& query,
                                 const at::Tensor& key,
                                 const at::Tensor& value,
                                 const c10::optional<at::Tensor>& edge_term,
                                 const c10::optional<at::Tensor>& mask);
// The forward's checks, the transpose (colptr [Ns + 1], csc_row [E],
// csc_perm [E]), out and grad_out [N, H, C], lse [N, H] in opmath.
void check_transformer_attention_backward(
    const at::Tensor& rowptr, const at::Tensor& col, const at::Tensor& colptr,
    const at::Tensor& csc_row, const at::Tensor& csc_perm,
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const c10::optional<at::Tensor>& edge_term,
    const c10::optional<at::Tensor>& mask, const at::Tensor& out,
    const at::Tensor& lse, const at::Tensor& grad_out);

}  // namespace pyg_fastattn

// ---------------------------------------------------------------------------
// csr_build / csc_build (csrc/ops/graph.cpp, csrc/cpu/graph_cpu.cpp,
// csrc/cuda/graph.cu).
namespace pyg_fastattn {

// The native builds write int32 indices: edges (with added loops) and node
// counts must stay below this (larger graphs take the Python path).
constexpr int64_t kGraphIndexLimit = 2147483647;  // 2^31 - 1
// CUDA: threads per block and most blocks per launch of the per-element
// kernels (grid-stride loops beyond that).
constexpr int kGraphBlock = 256;
constexpr int64_t kGraphMaxBlocks = 8192;
// graph_lengths: blocks at most (each ends with one atomic per maximum).
constexpr unsigned kGraphLengthBlocks = 512;
// CUDA: positions per thread of the tiled kernels (a block's tile holds
// kGraphBlock * kGraphItems consecutive positions).
constexpr int kGraphItems = 8;
// CUDA: the sort paths write pointer entries at key boundaries; a run of
// empty rows longer than this sends the whole pointer to a binary search.
constexpr int64_t kGraphPtrGap = 64;
// CUDA: bytes of inv that csc_build scatters per pass (the slice stays in L2;
// PYG_FASTATTN_INV_PASS_BYTES=n, tests, sets n).
constexpr int64_t kGraphInvPassBytes = int64_t(16) << 20;

// csr_build's status bits: a source outside [0, num_src), a destination
// outside [0, num_dst), a destination smaller than the one before it (set
// for input declared sorted, and always on the CPU).
constexpr int32_t kGraphBadSrc = 1;
constexpr int32_t kGraphBadDst = 2;
constexpr int32_t kGraphUnsorted = 4;

void check_csr_build(const at::Tensor& src, const at::Tensor& dst,
                     int64_t num_src, int64_t num_dst, bool add_self_loops);
void check_csc_build(const at::Tensor& rowptr, const at::Tensor& col,
                     int64_t num_cols);
void check_graph_lengths(const at::Tensor& rowptr, const at::Tensor& colptr);

}  // namespace pyg_fastattn

// ---------------------------------------------------------------------------
// linear and column_sum (csrc/ops/linear.cpp): the layers' Linear, with its
// bias gradient as column_sum.
namespace pyg_fastattn {

// [R, K] -> [K]; see kColumnSumGemvRows. Deterministic either way.
at::Tensor column_sum(const at::Tensor& src);

}  // namespace pyg_fastattn
