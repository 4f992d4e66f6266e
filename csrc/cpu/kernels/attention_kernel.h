#pragma once
// FlashAttention-2 style attention on the CPU, forward and backward.
//
// Forward: one task per (batch, kv head, chunk of 64-row query blocks), holding up to 8
// (query head, query block) sub-blocks that share the kv head. Key/value blocks of 64 rows
// stream past them, each converted once for all sub-blocks; scores live only in a 64 x 64
// tile, an online softmax keeps each row's running max and sum, and the output accumulates
// in fp32 (fp64 for double). The logsumexp of each row is saved for the backward.
//
// Backward: one task per (batch, kv head, split of the key range). For each key block the
// task walks every query head of the GQA group and every query block that sees the keys,
// recomputes P from the saved logsumexp, and sums dK and dV in local tiles, so a group's
// gradients are reduced inside the kernel without expanded K/V. dQ goes to a per-split fp32
// workspace that a last pass sums; splits only exist when batch x kv heads is smaller than
// the thread count.
//
// bf16 on CPUs with AVX512-BF16 (the AVX-512 build): both directions run their products on
// torch's brgemm (AMX tiles where present) with bf16 operands, fp32 accumulation and the
// softmax in fp32; other dtypes and CPUs use the fp32 tile GEMMs above.
//
// Included by one translation unit per CPU ISA (kernels_<isa>.cpp).
#include <atomic>
#include <optional>
#include <vector>

#include "cpu/parallel.h"
#if defined(CPU_CAPABILITY_AVX512)
#include <ATen/native/CPUBlas.h>
#include <immintrin.h>
#endif

#include "blocking.h"
#include "kernel_common.h"
#include "mha_ext/attn_mask.h"
#include "mha_ext/key_window.h"
#include "mha_ext/philox.h"
#include "mha_ext/score_mods.h"
#include "mha_ext/sequences.h"
#include "tile_gemm.h"

namespace mha_ext::cpu {
inline namespace CPU_CAPABILITY {

// Whether the scores take modifications beyond hiding keys, which apply to scaled scores:
// kernels that would fold the scale into the exp must scale S first.
inline bool scores_modified(const AttentionForwardParams& p) {
  return p.mask.kind == MaskKind::kAdditive || p.mods.softcap > 0.0 ||
         p.mods.alibi_slopes != nullptr;
}

// Turns one row of scaled dot products (scale * q).k for keys [key0, key0 + cols) into
// scores: the softcap and the ALiBi bias (score_mods.h), plus an additive mask, and -inf
// wherever the window or a boolean mask hides the key. The forward and the backward both
// call this, so they see the same scores. softcap_grad, when the backward passes it, gets
// the softcap's derivative d capped / d s = 1 - (capped / softcap)^2 of each visible column.
template <typename scalar_t, typename acc_t>
void mask_scores_row(acc_t* s, int64_t cols, const AttentionForwardParams& p, int64_t batch,
                     int64_t head, int64_t row, int64_t key0, acc_t* softcap_grad = nullptr) {
  constexpr acc_t kMinusInf = -std::numeric_limits<acc_t>::infinity();
  const KeyRange visible = visible_keys(p.window, row, p.seq_k);
  const int64_t begin = std::clamp<int64_t>(visible.begin - key0, 0, cols);
  const int64_t end = std::clamp<int64_t>(visible.end - key0, begin, cols);
  std::fill(s, s + begin, kMinusInf);
  std::fill(s + end, s + cols, kMinusInf);
  if (softcap_grad != nullptr) {  // hidden keys get P = 0, and a finite derivative
    std::fill(softcap_grad, softcap_grad + begin, acc_t(0));
    std::fill(softcap_grad + end, softcap_grad + cols, acc_t(0));
  }

  if (p.mods.softcap > 0.0) {
    softcap_row(s + begin, end - begin, static_cast<acc_t>(p.mods.softcap),
                softcap_grad == nullptr ? nullptr : softcap_grad + begin);
  }
  if (p.mods.alibi_slopes != nullptr) {
    alibi_row(s + begin, end - begin, alibi_slope<acc_t>(p.mods, batch, head),
              static_cast<acc_t>(row + p.window.diagonal_offset - key0 - begin));
  }

  const AttnMaskParams& mask = p.mask;
  if (mask.kind == MaskKind::kNone) return;
  const int64_t offset = mask_offset(mask, batch, head, row, key0);
  if (mask.kind == MaskKind::kBool) {
    const bool* keep = static_cast<const bool*>(mask.data) + offset;
    for (int64_t c = begin; c < end; ++c) {
      if (!keep[c * mask.col_stride]) s[c] = kMinusInf;
    }
  } else {
    const scalar_t* bias = static_cast<const scalar_t*>(mask.data) + offset;
    for (int64_t c = begin; c < end; ++c) s[c] += static_cast<acc_t>(bias[c * mask.col_stride]);
  }
}

// mask_scores_row for rows [row0, row0 + rows) of a score tile s_tile [rows, ld] (and its
// softcap derivatives softcap_grad [rows, ld] where given), skipped when the scores are not
// modified and every row sees every key of the tile (the window's bounds both grow with the
// row, so the first row's end and the last row's begin decide).
template <typename scalar_t, typename acc_t>
void mask_scores_tile(acc_t* s_tile, int64_t ld, int64_t rows, int64_t cols,
                      const AttentionForwardParams& p, int64_t batch, int64_t head, int64_t row0,
                      int64_t key0, acc_t* softcap_grad = nullptr) {
  const bool all_visible = p.mask.kind == MaskKind::kNone && !scores_modified(p) &&
                           visible_keys(p.window, row0, p.seq_k).end >= key0 + cols &&
                           visible_keys(p.window, row0 + rows - 1, p.seq_k).begin <= key0;
  if (all_visible) return;
  for (int64_t r = 0; r < rows; ++r) {
    mask_scores_row<scalar_t>(s_tile + r * ld, cols, p, batch, head, row0 + r, key0,
                              softcap_grad == nullptr ? nullptr : softcap_grad + r * ld);
  }
}

// Multiplies kept entries of one probability row by 1 / (1 - p) and zeroes dropped ones.
template <typename acc_t>
void apply_dropout_row(acc_t* row_values, int64_t cols, const DropoutParams& dropout, int64_t batch,
                       int64_t head, int64_t row, int64_t key0) {
  const acc_t keep_scale = static_cast<acc_t>(dropout.keep_scale);
  int64_t c = 0;
  while (c < cols) {
    const int64_t col = key0 + c;
    const Philox4x32 bits =
        dropout_bits(dropout.seed, dropout.batch_offset + batch, head, row, col);
    for (int64_t lane = col & 3; lane < 4 && c < cols; ++lane, ++c) {
      row_values[c] =
          dropout_word_kept(dropout, bits.word[lane]) ? row_values[c] * keep_scale : acc_t(0);
    }
  }
}

// A forward task owns up to this many (query head, query block) sub-blocks that share one
// kv head, and converts/transposes each K/V tile once for all of them: the query blocks of
// one head, or the heads of a GQA group. perf put the per-tile K^T transpose at 9% of the
// fp32 forward when every 64-row block redid it.
constexpr int64_t kMaxSubBlocks = 8;

// Rows of the bands in which the fp32 forward and backward compute a tile that an edge of the
// window crosses: a causal diagonal tile costs 5/8 of a whole one in 16-row bands (the band's
// last row sees 16, 32, 48 or 64 of its columns), and so does a sliding window's far edge.
// The backward's products that sum over the rows (dV, dK) go in bands of as many columns.
constexpr int64_t kEdgeBandRows = 16;

// Whether an edge of the window crosses the tile of rows [row0, row0 + rows) and keys [key0,
// key0 + cols): the first row's window ends before the tile's last key, or the last row's
// begins after its first (both bounds grow with the row).
inline bool window_edge_crosses(const KeyWindow& window, int64_t row0, int64_t rows, int64_t key0,
                                int64_t cols, int64_t seq_k) {
  return visible_keys(window, row0, seq_k).end < key0 + cols ||
         visible_keys(window, row0 + rows - 1, seq_k).begin > key0;
}

// The columns [begin, end) of the tile of keys [key0, key0 + cols) that some row of [row0, row0 +
// rows) sees, widened to multiples of `step` (and clipped to the tile): empty when none does.
inline KeyRange band_columns(const KeyWindow& window, int64_t row0, int64_t rows, int64_t key0,
                             int64_t cols, int64_t seq_k, int64_t step) {
  const int64_t begin = visible_keys(window, row0, seq_k).begin;
  const int64_t end = visible_keys(window, row0 + rows - 1, seq_k).end;
  return {std::clamp<int64_t>(begin - key0, 0, cols) / step * step,
          std::min(cols, round_up(end - key0, step))};
}

// How the forward splits into tasks (batch, kv head, chunk of query blocks).
struct ForwardPlan {
  int64_t group;            // query heads per kv head
  int64_t q_blocks;         // query blocks of kQueryBlock rows
  int64_t blocks_per_task;  // query blocks per chunk
  int64_t chunks;           // chunks per (batch, kv head)
  int64_t sub_blocks;       // (query head, query block) sub-blocks per task
};

inline ForwardPlan plan_forward(const AttentionForwardParams& p) {
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t q_blocks = ceil_div(p.seq_q, kQueryBlock);
  // Query blocks per task: as many as fit kMaxSubBlocks with the whole group, fewer while
  // that would leave fewer than two tasks per thread.
  int64_t blocks_per_task = std::max<int64_t>(1, std::min(q_blocks, kMaxSubBlocks / group));
  while (blocks_per_task > 1 && p.batch * p.num_kv_heads * ceil_div(q_blocks, blocks_per_task) <
                                    2 * at::get_num_threads()) {
    --blocks_per_task;
  }
  const int64_t chunks = ceil_div(q_blocks, blocks_per_task);
  return {group, q_blocks, blocks_per_task, chunks, group * blocks_per_task};
}

// One forward task: (batch, kv head, chunk of query blocks) and its sub-blocks. Sub-block i
// is query head kv_head * group + i / blocks over query block first_block + i % blocks: a
// head's blocks come one after another, so their rows are consecutive in q and in the
// sub-blocks' tiles.
struct ForwardTask {
  const AttentionForwardParams& p;
  const ForwardPlan& plan;
  int64_t batch, kv_head, first_block, blocks;

  ForwardTask(const AttentionForwardParams& params, const ForwardPlan& forward_plan, int64_t task)
      : p(params), plan(forward_plan) {
    batch = task / (p.num_kv_heads * plan.chunks);
    kv_head = task / plan.chunks % p.num_kv_heads;
    first_block = task % plan.chunks * plan.blocks_per_task;
    blocks = std::min(plan.blocks_per_task, plan.q_blocks - first_block);
  }
  int64_t sub_blocks() const { return blocks * plan.group; }
  int64_t head(int64_t i) const { return kv_head * plan.group + i / blocks; }
  int64_t row0(int64_t i) const { return (first_block + i % blocks) * kQueryBlock; }
  int64_t rows(int64_t i) const { return std::min(kQueryBlock, p.seq_q - row0(i)); }
  // Both window bounds grow with the row: a query block's keys run from its first row's
  // begin to its last row's end, and the task's from its first block to its last. Key tiles
  // start at multiples of kKeyBlock.
  int64_t key_begin() const {
    return visible_keys(p.window, first_block * kQueryBlock, p.seq_k).begin / kKeyBlock * kKeyBlock;
  }
  int64_t key_end() const {
    return visible_keys(p.window, std::min(p.seq_q, (first_block + blocks) * kQueryBlock) - 1,
                        p.seq_k)
        .end;
  }
  // Whether some row of sub-block i sees a key of [key0, key0 + cols).
  bool sees(int64_t i, int64_t key0, int64_t cols) const {
    return key0 < visible_keys(p.window, row0(i) + rows(i) - 1, p.seq_k).end &&
           key0 + cols > visible_keys(p.window, row0(i), p.seq_k).begin;
  }
  // How many of the keys [key0, key0 + cols) come before the end of sub-block i's window:
  // the columns of the tile that sub-block has to compute.
  int64_t cols_seen(int64_t i, int64_t key0, int64_t cols) const {
    return std::min(cols, visible_keys(p.window, row0(i) + rows(i) - 1, p.seq_k).end - key0);
  }
  // How many sub-blocks from i on (one head's consecutive blocks) see the tile [key0, key0 +
  // cols) and compute the same columns of it, so that one product can take all their rows;
  // 0 when sub-block i sees none of the tile.
  int64_t alike_run(int64_t i, int64_t key0, int64_t cols) const {
    if (!sees(i, key0, cols)) return 0;
    const int64_t seen = cols_seen(i, key0, cols);
    int64_t run = 1;
    while (i + run < sub_blocks() && head(i + run) == head(i) && sees(i + run, key0, cols) &&
           cols_seen(i + run, key0, cols) == seen) {
      ++run;
    }
    return run;
  }
  // Rows of sub-blocks [i, i + run).
  int64_t rows(int64_t i, int64_t run) const { return (run - 1) * kQueryBlock + rows(i + run - 1); }
  template <typename scalar_t>
  const scalar_t* kv_rows(const void* data, const RowStrides& strides) const {
    return static_cast<const scalar_t*>(data) + batch * strides.batch + kv_head * strides.head;
  }
};

// Starts the online softmax of a task's sub-blocks: zero outputs and sums, max -inf. Only
// the rows a sub-block has: a decode step's single query row would otherwise zero 64. Each
// row has sum_lanes partial sums in row_sum.
template <typename acc_t>
void reset_rows(const ForwardTask& task, int64_t ld_dv, acc_t* o_tiles, acc_t* row_max,
                acc_t* row_sum, int64_t sum_lanes = 1) {
  for (int64_t i = 0; i < task.sub_blocks(); ++i) {
    const int64_t first = i * kQueryBlock, rows = task.rows(i);
    std::fill(o_tiles + first * ld_dv, o_tiles + (first + rows) * ld_dv, acc_t(0));
    std::fill(row_max + first, row_max + first + rows, -std::numeric_limits<acc_t>::infinity());
    std::fill(row_sum + first * sum_lanes, row_sum + (first + rows) * sum_lanes, acc_t(0));
  }
}

// Writes the task's normalised outputs and logsumexps. row_max is in units of max_unit (1,
// or ln 2 for a max kept in log2 units).
template <typename scalar_t, typename acc_t>
void finish_rows(const ForwardTask& task, int64_t ld_dv, const acc_t* o_tiles, const acc_t* row_max,
                 const acc_t* row_sum, int64_t sum_lanes = 1, double max_unit = 1.0) {
  const AttentionForwardParams& p = task.p;
  for (int64_t i = 0; i < task.sub_blocks(); ++i) {
    const int64_t head = task.head(i), row0 = task.row0(i);
    scalar_t* out = static_cast<scalar_t*>(p.out) + task.batch * p.out_strides.batch +
                    head * p.out_strides.head + row0 * p.out_strides.row;
    acc_t* lse = static_cast<acc_t*>(p.lse) + lse_offset(p, task.batch, head) + row0;
    const double sink = sink_logit<acc_t>(p.sinks, head);
    for (int64_t r = 0; r < task.rows(i); ++r) {
      const int64_t row = i * kQueryBlock + r;
      const acc_t* partial_sums = row_sum + row * sum_lanes;
      const acc_t sum = std::accumulate(partial_sums, partial_sums + sum_lanes, acc_t(0));
      lse[r] = finish_row(o_tiles + row * ld_dv, p.head_dim_v, row_max[row] * max_unit, sum,
                          out + r * p.out_strides.row, sink);
    }
  }
}

template <typename scalar_t>
void attention_forward_kernel(const AttentionForwardParams& p) {
  using acc_t = typename AccumulateType<scalar_t>::type;
  using Vec = at::vec::Vectorized<acc_t>;
  const ForwardPlan plan = plan_forward(p);
  // Row strides of the fp32 tiles, padded to whole vectors.
  const int64_t ld_d = round_up(p.head_dim, Vec::size());
  const int64_t ld_dv = round_up(p.head_dim_v, Vec::size());
  const int64_t sub_rows = plan.sub_blocks * kQueryBlock;
  const int64_t scratch_size = sub_rows * ld_d + p.head_dim * kKeyBlock + kKeyBlock * ld_dv +
                               kQueryBlock * kKeyBlock + sub_rows * ld_dv + 2 * sub_rows +
                               kKeyBlock * p.head_dim;

  parallel_tasks(p.batch * p.num_kv_heads * plan.chunks, [&](ClaimedTasks& tasks) {
    acc_t* q_tiles = thread_scratch<acc_t>(scratch_size);  // [sub_blocks, kQueryBlock, ld_d]
    acc_t* kt_tile = q_tiles + sub_rows * ld_d;            // [head_dim, kKeyBlock]
    acc_t* v_tile = kt_tile + p.head_dim * kKeyBlock;      // [kKeyBlock, ld_dv]
    acc_t* s_tile = v_tile + kKeyBlock * ld_dv;            // [kQueryBlock, kKeyBlock]
    acc_t* o_tiles = s_tile + kQueryBlock * kKeyBlock;     // [sub_blocks, kQueryBlock, ld_dv]
    acc_t* row_max_log2 = o_tiles + sub_rows * ld_dv;      // [sub_blocks, kQueryBlock]
    acc_t* row_sum = row_max_log2 + sub_rows;              // [sub_blocks, kQueryBlock]
    acc_t* staging = row_sum + sub_rows;                   // [kKeyBlock, head_dim]

    for (const int64_t index : tasks) {
      const ForwardTask task(p, plan, index);
      const int64_t batch = task.batch;
      const scalar_t* k = task.kv_rows<scalar_t>(p.k, p.k_strides);
      const scalar_t* v = task.kv_rows<scalar_t>(p.v, p.v_strides);
      for (int64_t i = 0; i < task.sub_blocks(); ++i) {
        const scalar_t* q = static_cast<const scalar_t*>(p.q) + batch * p.q_strides.batch +
                            task.head(i) * p.q_strides.head + task.row0(i) * p.q_strides.row;
        load_rows(q, p.q_strides.row, task.rows(i), p.head_dim, q_tiles + i * kQueryBlock * ld_d,
                  ld_d, static_cast<acc_t>(p.scale));
      }
      reset_rows(task, ld_dv, o_tiles, row_max_log2, row_sum);

      const int64_t key_end = task.key_end();
      for (int64_t key0 = task.key_begin(); key0 < key_end; key0 += kKeyBlock) {
        const int64_t cols = std::min(kKeyBlock, p.seq_k - key0);
        load_rows_transposed(k + key0 * p.k_strides.row, p.k_strides.row, cols, p.head_dim, kt_tile,
                             kKeyBlock, staging);
        load_rows(v + key0 * p.v_strides.row, p.v_strides.row, cols, p.head_dim_v, v_tile, ld_dv);

        for (int64_t i = 0; i < task.sub_blocks(); ++i) {
          if (!task.sees(i, key0, cols)) continue;
          const int64_t head = task.head(i), rows = task.rows(i);
          // A tile that either side of the window crosses (the causal diagonal, a sliding
          // window's far edge) goes in bands of rows, each computing only the vectors of
          // columns that some row of it sees.
          const int64_t band =
              window_edge_crosses(p.window, task.row0(i), rows, key0, cols, p.seq_k) ? kEdgeBandRows
                                                                                     : rows;
          for (int64_t band_row = 0; band_row < rows; band_row += band) {
            const int64_t row0 = task.row0(i) + band_row,
                          band_rows = std::min(band, rows - band_row);
            // The band's columns [lo, hi) of the tile, in whole vectors
            const auto [lo, hi] =
                band_columns(p.window, row0, band_rows, key0, cols, p.seq_k, Vec::size());
            if (hi <= lo) continue;                            // the band sees none of the tile
            const int64_t first = i * kQueryBlock + band_row;  // the band's row in the task's tiles
            const acc_t* q_band = q_tiles + first * ld_d;
            acc_t* o_band = o_tiles + first * ld_dv;
            acc_t* s_band = s_tile + lo;
            // S = Q K^T   [band_rows, hi - lo]
            tile_gemm<false>(band_rows, hi - lo, p.head_dim, q_band, ld_d, kt_tile + lo, kKeyBlock,
                             s_band, kKeyBlock);
            mask_scores_tile<scalar_t>(s_band, kKeyBlock, band_rows, hi - lo, p, batch, head, row0,
                                       key0 + lo);
            online_softmax_tile(s_band, kKeyBlock, band_rows, hi - lo, row_max_log2 + first,
                                row_sum + first, o_band, ld_dv, p.head_dim_v);
            // Dropout acts on the normalised probabilities, after their sum was taken.
            for (int64_t r = 0; p.dropout.enabled && r < band_rows; ++r) {
              apply_dropout_row(s_band + r * kKeyBlock, hi - lo, p.dropout, batch, head, row0 + r,
                                key0 + lo);
            }
            // O += P V   [band_rows, head_dim_v]
            tile_gemm<true>(band_rows, p.head_dim_v, hi - lo, s_band, kKeyBlock,
                            v_tile + lo * ld_dv, ld_dv, o_band, ld_dv);
          }
        }
      }
      finish_rows<scalar_t>(task, ld_dv, o_tiles, row_max_log2, row_sum, /*sum_lanes=*/1,
                            /*max_unit=*/kLn2);
    }
  });
}

// The dQ partial sums [seq_q, head_dim] of key split `split` for (batch, head) in
// p.grad_q_accum.
template <typename acc_t>
acc_t* grad_q_partial_sums(const AttentionBackwardParams& p, int64_t split, int64_t batch,
                           int64_t head) {
  return static_cast<acc_t*>(p.grad_q_accum) + split * p.grad_q_accum_split_stride +
         lse_offset(p, batch, head) * p.head_dim;
}

// One backward task: (batch, kv head, split of the key blocks), the key blocks
// [first_block, end_block) of that split, and its kv head's rows of K, V, dK and dV.
template <typename scalar_t>
struct BackwardTask {
  int64_t batch, kv_head, split, first_block, end_block;
  const scalar_t *k, *v;
  scalar_t *grad_k, *grad_v;

  BackwardTask(const AttentionBackwardParams& p, int64_t task) {
    const int64_t splits = p.num_kv_splits, key_blocks = ceil_div(p.seq_k, kKeyBlock);
    batch = task / (p.num_kv_heads * splits);
    kv_head = task / splits % p.num_kv_heads;
    split = task % splits;
    first_block = split * key_blocks / splits;
    end_block = (split + 1) * key_blocks / splits;
    k = static_cast<const scalar_t*>(p.k) + offset(p.k_strides);
    v = static_cast<const scalar_t*>(p.v) + offset(p.v_strides);
    grad_k = static_cast<scalar_t*>(p.grad_k) + offset(p.grad_k_strides);
    grad_v = static_cast<scalar_t*>(p.grad_v) + offset(p.grad_v_strides);
  }

 private:
  int64_t offset(const RowStrides& strides) const {
    return batch * strides.batch + kv_head * strides.head;
  }
};

// P = exp(score_scale * S - lse), as 2^(score_scale log2(e) S - lse log2(e)), in place over
// the rows of a tile whose scores are masked (p_tile [rows, ld]); a row with lse -inf saw no
// key and gets P = 0. Both backward kernels recompute P this way; the fp32 one passes
// score_scale 1 (its Q was scaled on load).
template <typename acc_t>
void probs_from_lse(acc_t* p_tile, int64_t ld, int64_t rows, int64_t cols, const acc_t* lse,
                    acc_t score_scale) {
  const acc_t scale_log2 = static_cast<acc_t>(score_scale * kLog2e);
  for (int64_t r = 0; r < rows; ++r) {
    acc_t* s = p_tile + r * ld;
    const acc_t row_lse = lse[r];
    if (row_lse == -std::numeric_limits<acc_t>::infinity()) {
      std::fill(s, s + cols, acc_t(0));
      continue;
    }
    exp2_row(s, cols, scale_log2, static_cast<acc_t>(-row_lse * kLog2e));
  }
}

// The probabilities dV sees: P itself, or with dropout a copy in pd_tile with the dropped
// entries zeroed and the kept ones scaled.
template <typename acc_t>
const acc_t* dropped_probs(const acc_t* p_tile, acc_t* pd_tile, int64_t ld, int64_t rows,
                           int64_t cols, const DropoutParams& dropout, int64_t batch, int64_t head,
                           int64_t row0, int64_t key0) {
  if (!dropout.enabled) return p_tile;
  std::copy(p_tile, p_tile + rows * ld, pd_tile);
  for (int64_t r = 0; r < rows; ++r) {
    apply_dropout_row(pd_tile + r * ld, cols, dropout, batch, head, row0 + r, key0);
  }
  return pd_tile;
}

// One row of dS = P * (dP * dropout - delta), in place over dP.
template <typename acc_t>
void softmax_grad_row(acc_t* ds, const acc_t* p_row, int64_t cols, acc_t row_delta,
                      const DropoutParams& dropout, int64_t batch, int64_t head, int64_t row,
                      int64_t key0) {
  using Vec = at::vec::Vectorized<acc_t>;
  if (dropout.enabled) apply_dropout_row(ds, cols, dropout, batch, head, row, key0);
  at::vec::map2([row_delta](Vec prob, Vec dprob) { return prob * (dprob - Vec(row_delta)); }, ds,
                p_row, ds, cols);
}

// delta[b, h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d] - dlse[b, h, i]: the row term of
// dS = P * (dP - delta), including the gradient that reaches the logsumexp output.
template <typename scalar_t, typename acc_t>
void compute_delta(const AttentionBackwardParams& p) {
  using Vec = at::vec::Vectorized<acc_t>;
  parallel_for(0, p.batch * p.num_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t batch = bh / p.num_heads, head = bh % p.num_heads;
      const scalar_t* out = static_cast<const scalar_t*>(p.out) + batch * p.out_strides.batch +
                            head * p.out_strides.head;
      const scalar_t* grad_out = static_cast<const scalar_t*>(p.grad_out) +
                                 batch * p.grad_out_strides.batch + head * p.grad_out_strides.head;
      acc_t* delta = static_cast<acc_t*>(p.delta) + lse_offset(p, batch, head);
      const acc_t* grad_lse =
          p.grad_lse ? static_cast<const acc_t*>(p.grad_lse) + lse_offset(p, batch, head) : nullptr;
      for (int64_t i = 0; i < p.seq_q; ++i) {
        const scalar_t* o_row = out + i * p.out_strides.row;
        const scalar_t* do_row = grad_out + i * p.grad_out_strides.row;
        Vec dot_vec(acc_t(0));
        for (int64_t d = 0; d < p.head_dim_v; d += Vec::size()) {
          const int64_t count = std::min<int64_t>(Vec::size(), p.head_dim_v - d);
          dot_vec = at::vec::fmadd(load_as<acc_t>(o_row + d, count),
                                   load_as<acc_t>(do_row + d, count), dot_vec);
        }
        const acc_t dot = horizontal_sum(dot_vec);
        delta[i] = grad_lse ? dot - grad_lse[i] : dot;
      }
    }
  });
}

template <typename scalar_t>
void attention_backward_kernel(const AttentionBackwardParams& p) {
  using acc_t = typename AccumulateType<scalar_t>::type;
  using Vec = at::vec::Vectorized<acc_t>;
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t splits = p.num_kv_splits;
  const int64_t ld_d = round_up(p.head_dim, Vec::size());
  const int64_t ld_dv = round_up(p.head_dim_v, Vec::size());
  const int64_t tile = kQueryBlock * kKeyBlock;
  const bool softcap = p.mods.softcap > 0.0;
  const int64_t scratch_size = kQueryBlock * ld_d + kQueryBlock * ld_dv + kKeyBlock * ld_d +
                               p.head_dim * kKeyBlock + p.head_dim_v * kKeyBlock + 4 * tile +
                               kKeyBlock * ld_d + kKeyBlock * ld_dv + kKeyBlock * p.head_dim_v;
  const acc_t scale = static_cast<acc_t>(p.scale);

  parallel_tasks(p.batch * p.num_kv_heads * splits, [&](ClaimedTasks& tasks) {
    acc_t* q_tile = thread_scratch<acc_t>(scratch_size);  // [kQueryBlock, ld_d]
    acc_t* do_tile = q_tile + kQueryBlock * ld_d;         // [kQueryBlock, ld_dv]
    acc_t* k_tile = do_tile + kQueryBlock * ld_dv;        // [kKeyBlock, ld_d]
    acc_t* kt_tile = k_tile + kKeyBlock * ld_d;           // [head_dim, kKeyBlock]
    acc_t* vt_tile = kt_tile + p.head_dim * kKeyBlock;    // [head_dim_v, kKeyBlock]
    acc_t* p_tile = vt_tile + p.head_dim_v * kKeyBlock;   // [kQueryBlock, kKeyBlock] P
    acc_t* pd_tile = p_tile + tile;                // [kQueryBlock, kKeyBlock] P after dropout
    acc_t* ds_tile = pd_tile + tile;               // [kQueryBlock, kKeyBlock] dP, then dS
    acc_t* softcap_grad_tile = ds_tile + tile;     // [kQueryBlock, kKeyBlock]
    acc_t* dk_tile = softcap_grad_tile + tile;     // [kKeyBlock, ld_d]
    acc_t* dv_tile = dk_tile + kKeyBlock * ld_d;   // [kKeyBlock, ld_dv]
    acc_t* staging = dv_tile + kKeyBlock * ld_dv;  // [kKeyBlock, head_dim_v]

    for (const int64_t index : tasks) {
      const BackwardTask<scalar_t> task(p, index);
      const int64_t batch = task.batch, kv_head = task.kv_head, split = task.split;
      // The group's dQ partial sums in this split start at 0 (the workspace comes uncleared).
      for (int64_t head = kv_head * group; head < (kv_head + 1) * group; ++head) {
        acc_t* grad_q_accum = grad_q_partial_sums<acc_t>(p, split, batch, head);
        std::fill(grad_q_accum, grad_q_accum + p.seq_q * p.head_dim, acc_t(0));
      }

      for (int64_t block = task.first_block; block < task.end_block; ++block) {
        const int64_t key0 = block * kKeyBlock;
        const int64_t cols = std::min(kKeyBlock, p.seq_k - key0);
        load_rows(task.k + key0 * p.k_strides.row, p.k_strides.row, cols, p.head_dim, k_tile, ld_d);
        transpose_tile(k_tile, ld_d, cols, p.head_dim, kt_tile, kKeyBlock);
        load_rows_transposed(task.v + key0 * p.v_strides.row, p.v_strides.row, cols, p.head_dim_v,
                             vt_tile, kKeyBlock, staging);
        std::fill(dk_tile, dk_tile + cols * ld_d, acc_t(0));
        std::fill(dv_tile, dv_tile + cols * ld_dv, acc_t(0));
        const KeyRange seeing = rows_seeing_keys(p.window, key0, key0 + cols, p.seq_q);

        for (int64_t head = kv_head * group; head < (kv_head + 1) * group; ++head) {
          const acc_t* lse = static_cast<const acc_t*>(p.lse) + lse_offset(p, batch, head);
          const acc_t* delta = static_cast<const acc_t*>(p.delta) + lse_offset(p, batch, head);
          acc_t* grad_q_accum = grad_q_partial_sums<acc_t>(p, split, batch, head);
          for (int64_t row0 = seeing.begin; row0 < seeing.end; row0 += kQueryBlock) {
            const int64_t rows = std::min(kQueryBlock, seeing.end - row0);
            // Scaled on load: S = (scale Q) K^T, and dK = dS^T (scale Q) needs no rescaling.
            load_rows(static_cast<const scalar_t*>(p.q) + batch * p.q_strides.batch +
                          head * p.q_strides.head + row0 * p.q_strides.row,
                      p.q_strides.row, rows, p.head_dim, q_tile, ld_d, scale);
            load_rows(static_cast<const scalar_t*>(p.grad_out) + batch * p.grad_out_strides.batch +
                          head * p.grad_out_strides.head + row0 * p.grad_out_strides.row,
                      p.grad_out_strides.row, rows, p.head_dim_v, do_tile, ld_dv);

            // A tile that either side of the window crosses goes in square bands of
            // kEdgeBandRows: P, dP, dS and dQ in bands of rows, each over the columns some row
            // of it sees, and dV and dK (sums over the rows) in bands of columns, each over the
            // rows that see some column of it. A band of columns reads P and dS only where
            // the bands of rows computed them: the rows that see one of its columns.
            const int64_t band = window_edge_crosses(p.window, row0, rows, key0, cols, p.seq_k)
                                     ? kEdgeBandRows
                                     : std::max(rows, cols);
            for (int64_t band_row = 0; band_row < rows; band_row += band) {
              const int64_t first_row = row0 + band_row,
                            band_rows = std::min(band, rows - band_row);
              // The band's columns [lo, hi) of the tile, in whole bands
              const auto [lo, hi] =
                  band_columns(p.window, first_row, band_rows, key0, cols, p.seq_k, band);
              if (hi <= lo) continue;                            // the band sees none of the tile
              const int64_t offset = band_row * kKeyBlock + lo;  // of the band in the tiles
              acc_t* softcap_grad = softcap ? softcap_grad_tile + offset : nullptr;
              // P = exp(S - lse), recomputed from the saved logsumexp   [band_rows, hi - lo]
              tile_gemm<false>(band_rows, hi - lo, p.head_dim, q_tile + band_row * ld_d, ld_d,
                               kt_tile + lo, kKeyBlock, p_tile + offset, kKeyBlock);
              mask_scores_tile<scalar_t>(p_tile + offset, kKeyBlock, band_rows, hi - lo, p, batch,
                                         head, first_row, key0 + lo, softcap_grad);
              probs_from_lse(p_tile + offset, kKeyBlock, band_rows, hi - lo, lse + first_row,
                             acc_t(1));
              // dP = dO V^T   [band_rows, hi - lo]
              tile_gemm<false>(band_rows, hi - lo, p.head_dim_v, do_tile + band_row * ld_dv, ld_dv,
                               vt_tile + lo, kKeyBlock, ds_tile + offset, kKeyBlock);
              // dS = P * (dP * dropout - delta), through the softcap's derivative
              for (int64_t r = 0; r < band_rows; ++r) {
                acc_t* ds = ds_tile + offset + r * kKeyBlock;
                softmax_grad_row(ds, p_tile + offset + r * kKeyBlock, hi - lo, delta[first_row + r],
                                 p.dropout, batch, head, first_row + r, key0 + lo);
                if (softcap) {
                  at::vec::map2([](Vec grad, Vec derivative) { return grad * derivative; }, ds, ds,
                                softcap_grad + r * kKeyBlock, hi - lo);
                }
              }
              // dQ += dS K   [band_rows, head_dim]  (scaled when the splits are summed)
              tile_gemm<true>(band_rows, p.head_dim, hi - lo, ds_tile + offset, kKeyBlock,
                              k_tile + lo * ld_d, ld_d, grad_q_accum + first_row * p.head_dim,
                              p.head_dim);
            }
            const acc_t* pd = dropped_probs(p_tile, pd_tile, kKeyBlock, rows, cols, p.dropout,
                                            batch, head, row0, key0);
            for (int64_t c0 = 0; c0 < cols; c0 += band) {
              const int64_t width = std::min(band, cols - c0);
              // The rows [r_lo, r_hi) of the tile that see a column of the band
              const KeyRange seeing_band =
                  rows_seeing_keys(p.window, key0 + c0, key0 + c0 + width, p.seq_q);
              const int64_t r_lo = std::max(seeing_band.begin, row0) - row0;
              const int64_t r_hi = std::min(seeing_band.end, row0 + rows) - row0;
              if (r_hi <= r_lo) continue;
              const int64_t offset = r_lo * kKeyBlock + c0;
              // dV += P_dropped^T dO   [width, head_dim_v]
              tile_gemm<true, true>(width, p.head_dim_v, r_hi - r_lo, pd + offset, kKeyBlock,
                                    do_tile + r_lo * ld_dv, ld_dv, dv_tile + c0 * ld_dv, ld_dv);
              // dK += dS^T (scale Q)   [width, head_dim]
              tile_gemm<true, true>(width, p.head_dim, r_hi - r_lo, ds_tile + offset, kKeyBlock,
                                    q_tile + r_lo * ld_d, ld_d, dk_tile + c0 * ld_d, ld_d);
            }
          }
        }
        for (int64_t c = 0; c < cols; ++c) {
          store_row(dk_tile + c * ld_d, p.head_dim, acc_t(1),
                    task.grad_k + (key0 + c) * p.grad_k_strides.row);
          store_row(dv_tile + c * ld_dv, p.head_dim_v, acc_t(1),
                    task.grad_v + (key0 + c) * p.grad_v_strides.row);
        }
      }
    }
  });
}

// dQ = scale * (sum over the key splits of the partial sums in grad_q_accum).
template <typename scalar_t>
void finish_grad_q(const AttentionBackwardParams& p) {
  using acc_t = typename AccumulateType<scalar_t>::type;
  using Vec = at::vec::Vectorized<acc_t>;
  const acc_t scale = static_cast<acc_t>(p.scale);
  parallel_for(0, p.batch * p.num_heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t batch = bh / p.num_heads, head = bh % p.num_heads;
      scalar_t* grad_q = static_cast<scalar_t*>(p.grad_q) + batch * p.grad_q_strides.batch +
                         head * p.grad_q_strides.head;
      acc_t* accum = grad_q_partial_sums<acc_t>(p, 0, batch, head);
      for (int64_t i = 0; i < p.seq_q; ++i) {
        acc_t* row = accum + i * p.head_dim;
        for (int64_t split = 1; split < p.num_kv_splits; ++split) {
          const acc_t* partial = row + split * p.grad_q_accum_split_stride;
          at::vec::map2([](Vec a, Vec b) { return a + b; }, row, row, partial, p.head_dim);
        }
        store_row(row, p.head_dim, scale, grad_q + i * p.grad_q_strides.row);
      }
    }
  });
}

#if defined(CPU_CAPABILITY_AVX512)
// bf16 forward on torch's brgemm micro-kernels (oneDNN; AMX tiles where the CPU has them,
// AVX512-BF16 otherwise): S = Q K^T and O += P V take bf16 operands with fp32
// accumulation, the softmax stays in fp32 as in the generic kernel, and P is rounded to
// bf16 for the second product, as GPU FlashAttention does. The same task layout as
// attention_forward_kernel: each K/V tile is packed once for all sub-blocks of a task.
//
// brgemm wants B in pairs along the reduction dim ("VNNI": element (k, n) at
// [k / 2][n][k % 2]). For K^T that is a 32-bit transpose of the K tile (a pair of head dims
// is one 32-bit word of a K row); for V it interleaves consecutive rows.

// The kernels read k and v rows (and the backward grad_out rows) as 32-bit pairs in place.
inline bool bf16_brgemm_usable(const AttentionForwardParams& p, const AttentionWorkspaces& w,
                               bool backward = false) {
  auto even_rows = [](const void* data, const RowStrides& strides) {
    return reinterpret_cast<uintptr_t>(data) % 4 == 0 && strides.batch % 2 == 0 &&
           strides.head % 2 == 0 && strides.row % 2 == 0;
  };
  // brgemm runs bf16 on AMX or AVX512-BF16 (every AMX CPU has the latter), and the
  // roundings to bf16 below use AVX512-BF16.
  const bool forward_ok = avx512_bf16_enabled() && p.dtype == DType::kBFloat16 &&
                          p.head_dim % 2 == 0 && even_rows(p.q, p.q_strides) &&
                          even_rows(p.k, p.k_strides) && even_rows(p.v, p.v_strides);
  // The forward packs K and V into the caller's workspace.
  if (!backward) return forward_ok && w.kv_pairs != nullptr;
  // The backward also transposes V as pairs of value dims, reads dO rows in place and writes
  // Q^T and dO^T to the caller's workspace.
  const auto& b = static_cast<const AttentionBackwardParams&>(p);
  return forward_ok && p.head_dim_v % 2 == 0 && even_rows(b.grad_out, b.grad_out_strides) &&
         w.q_grad_out_transposed != nullptr;
}

// B operand from rows: word (r / 2, c) of dst [ceil(rows / 2), ld] holds element c of rows r
// and r + 1 of src (a zero row pads an odd count).
inline void pack_row_pairs(const c10::BFloat16* src, int64_t src_stride, int64_t rows, int64_t cols,
                           uint32_t* dst, int64_t ld) {
  for (int64_t r = 0; r < rows; r += 2) {
    const uint16_t* first = reinterpret_cast<const uint16_t*>(src + r * src_stride);
    const uint16_t* second = reinterpret_cast<const uint16_t*>(src + (r + 1) * src_stride);
    uint32_t* out = dst + r / 2 * ld;
    if (r + 1 < rows) {
      for (int64_t c = 0; c < cols; ++c) out[c] = first[c] | static_cast<uint32_t>(second[c]) << 16;
    } else {
      for (int64_t c = 0; c < cols; ++c) out[c] = first[c];
    }
  }
}

// B operand from columns: word (c / 2, r) of dst [cols / 2, ld] holds elements c and c + 1 of
// row r of src, i.e. a 32-bit transpose of src's rows (cols even, src 4-byte aligned).
inline void pack_column_pairs(const c10::BFloat16* src, int64_t src_stride, int64_t rows,
                              int64_t cols, uint32_t* dst, int64_t ld) {
  transpose_tile(reinterpret_cast<const float*>(src), src_stride / 2, rows, cols / 2,
                 reinterpret_cast<float*>(dst), ld);
}

// Keys per tile of the bf16 kernel. Each brgemm call has a fixed cost and loads and stores
// its fp32 result tiles (S, and O for O += P V), which 128-key tiles spread over twice the
// products. At head_dim 64, S = 1024, non-causal: 1.2x faster than 64-key tiles. At head_dim
// 128 (Xeon model 207, the forward suite's llama2-70b heads, 64q / 8kv, two alternating runs
// of `python -m mha_ext.bench --suite forward --models llama2-70b --dtype bfloat16 --seq 1024
// 4096`): against torch SDPA 0.91-1.03x -> 1.13-1.39x non-causal and 1.08-1.15x -> 1.31-1.55x
// causal; S 128-512 no slower. (An earlier kernel, before the shared K/V tiles and the
// sub-blocks' shared brgemm calls, had run causal attention 0.85x with them there.)
// Up to head_dim 64, 256-key tiles: a score's products there are half as many, so the calls'
// fixed costs weigh twice as much (Xeon model 207, the forward suite's gpt2-small heads,
// bf16, alternating runs of `python -m mha_ext.bench --suite forward --models gpt2-small
// --dtype bfloat16 --seq 128 512 1024 4096`: 945-983 -> 1123-1185 GFLOP/s at S 1024, causal
// 679-690 -> 731-813; S 512 861-871 -> 956-986, S 4096 1278-1282 -> 1443-1468; S 128 the
// same). 512-key tiles ran 0.8x of 256 at head_dim 64, and 256 no faster at head_dim 128
// (llama2-70b S 1024: 1556-1594 against 1608-1620 GFLOP/s, causal 997-1029 against
// 1003-1090). On Xeon model 167, 128- and 256-key tiles read alike at head_dim 64 (the same
// suite, two alternating pairs: 819-826 against 826-862 GFLOP/s at S 1024).
inline int64_t bf16_key_tile(int64_t head_dim) {
  static_assert(kMaxBf16KeyTile == 256, "kv_pairs_size sizes the workspace for these tiles");
  return head_dim <= 64 ? 256 : head_dim <= 128 ? 128 : 64;
}

// Layout of a packed key tile, and of the kv_pairs workspace, which holds one per (batch, kv
// head, key tile) in that order: K^T pairs [head_dim / 2, key_tile] (word (d / 2, c) = head dims d,
// d + 1 of key c), then V pairs [key_tile / 2, head_dim_v] (word (c / 2, d) = dim d of keys
// c, c + 1).
struct PackedKvTiles {
  int64_t key_tile, key_tiles;   // keys per tile, tiles per (batch, kv head)
  int64_t kt_words, tile_words;  // 32-bit words of a tile's K^T pairs, of the whole tile
  uint32_t* pairs;               // the kv_pairs workspace

  PackedKvTiles(const AttentionForwardParams& p, int64_t keys_per_tile, void* kv_pairs)
      : key_tile(keys_per_tile),
        key_tiles(ceil_div(p.seq_k, keys_per_tile)),
        kt_words(p.head_dim / 2 * keys_per_tile),
        tile_words(kt_words + keys_per_tile / 2 * p.head_dim_v),
        pairs(static_cast<uint32_t*>(kv_pairs)) {}
  // The tile of keys from key0 (a multiple of key_tile) of (batch, kv head) in kv_pairs.
  uint32_t* tile(const AttentionForwardParams& p, int64_t batch, int64_t kv_head,
                 int64_t key0) const {
    const int64_t index = (batch * p.num_kv_heads + kv_head) * key_tiles + key0 / key_tile;
    return pairs + index * tile_words;
  }
};

// Packs the tile of keys [key0, key0 + key_tile) of (batch, kv head) into dst (layout.tile_words).
inline void pack_kv_tile(const AttentionForwardParams& p, const PackedKvTiles& layout,
                         int64_t batch, int64_t kv_head, int64_t key0, uint32_t* dst) {
  using scalar_t = c10::BFloat16;
  const int64_t cols = std::min(layout.key_tile, p.seq_k - key0);
  const scalar_t* k = static_cast<const scalar_t*>(p.k) + batch * p.k_strides.batch +
                      kv_head * p.k_strides.head + key0 * p.k_strides.row;
  const scalar_t* v = static_cast<const scalar_t*>(p.v) + batch * p.v_strides.batch +
                      kv_head * p.v_strides.head + key0 * p.v_strides.row;
  pack_column_pairs(k, p.k_strides.row, cols, p.head_dim, dst, layout.key_tile);
  pack_row_pairs(v, p.v_strides.row, cols, p.head_dim_v, dst + layout.kt_words, p.head_dim_v);
}

// The packed tiles of a call's kv_pairs workspace where several tasks (chunks of query
// blocks) read each tile: the first task to need a tile packs it there, once for all of them
// (packed per task, every chunk redid them, up to 16 times per tile at S 1024, 4-8% of the
// llama2-70b forward). Packing on first use, inside the tasks' parallel region, instead of in
// a region of its own before them spares each call a second region, whose wake-up and join
// cost whole scheduler ticks when other processes load the cores, and writes each tile
// while the task that packs it still has it in cache (B1 H8 S2048 D128, 2 threads, the 2
// cores loaded by other processes, medians of 30 alternating calls: window (256, 0) 18-23 ->
// 15 ms, causal 30-38 -> 24-25 ms; on quiet cores the same within noise).
class SharedKvTiles {
 public:
  SharedKvTiles(const AttentionForwardParams& p, const PackedKvTiles& layout)
      : p_(p), layout_(layout), state_(p.batch * p.num_kv_heads * layout.key_tiles) {}

  // The packed tile of keys from key0 of (batch, kv head). A tile another thread is packing
  // at that moment is packed again into spare ([layout.tile_words]) rather than waited for:
  // the packer may be descheduled. Both copies hold the same words.
  const uint32_t* tile(int64_t batch, int64_t kv_head, int64_t key0, uint32_t* spare) {
    std::atomic<uint8_t>& state =
        state_[(batch * p_.num_kv_heads + kv_head) * layout_.key_tiles + key0 / layout_.key_tile];
    uint32_t* shared = layout_.tile(p_, batch, kv_head, key0);
    if (state.load(std::memory_order_acquire) == kPacked) return shared;
    uint8_t unpacked = kUnpacked;
    if (!state.compare_exchange_strong(unpacked, kPacking, std::memory_order_acquire)) {
      if (unpacked == kPacked) return shared;
      pack_kv_tile(p_, layout_, batch, kv_head, key0, spare);
      return spare;
    }
    pack_kv_tile(p_, layout_, batch, kv_head, key0, shared);
    state.store(kPacked, std::memory_order_release);
    return shared;
  }

 private:
  static constexpr uint8_t kUnpacked = 0, kPacking = 1, kPacked = 2;
  const AttentionForwardParams& p_;
  const PackedKvTiles& layout_;
  std::vector<std::atomic<uint8_t>> state_;  // per (batch, kv head, key tile), kUnpacked first
};

inline void attention_forward_bf16_brgemm(const AttentionForwardParams& p,
                                          const AttentionWorkspaces& w) {
  using scalar_t = c10::BFloat16;
  using Vec = at::vec::Vectorized<float>;
  const int64_t key_tile = bf16_key_tile(p.head_dim);
  const ForwardPlan plan = plan_forward(p);
  // Where several tasks (chunks of query blocks) read each key tile, they share one packed
  // copy (SharedKvTiles); a single chunk packs each tile into its own scratch as it goes.
  const PackedKvTiles layout(p, key_tile, w.kv_pairs);
  const bool shared_tiles = plan.chunks > 1;
  std::optional<SharedKvTiles> shared;
  if (shared_tiles) shared.emplace(p, layout);
  const int64_t ld_dv = round_up(p.head_dim_v, Vec::size());
  const int64_t sub_rows = plan.sub_blocks * kQueryBlock;
  const float scale = static_cast<float>(p.scale);
  const bool fold_scale = !scores_modified(p) && scale > 0.f;
  // fp32 words: S [sub_rows, key_tile], P in bf16 [sub_rows, key_tile] (half the words),
  // O accumulators [sub_rows, ld_dv], row max in log2 units [sub_rows], partial row sums
  // [sub_rows, kSumLanes], fp32 P of one sub-block for dropout [kQueryBlock, key_tile], the
  // task's own packed tile.
  const int64_t scratch_size = sub_rows * key_tile + sub_rows * key_tile / 2 + sub_rows * ld_dv +
                               sub_rows + sub_rows * kSumLanes + kQueryBlock * key_tile +
                               layout.tile_words;

  parallel_tasks(p.batch * p.num_kv_heads * plan.chunks, [&](ClaimedTasks& tasks) {
    float* s_tiles = thread_scratch<float>(scratch_size);  // [sub_rows, key_tile]
    scalar_t* p_tiles =
        reinterpret_cast<scalar_t*>(s_tiles + sub_rows * key_tile);  // [sub_rows, key_tile]
    float* o_tiles = reinterpret_cast<float*>(p_tiles + sub_rows * key_tile);  // [sub_rows, ld_dv]
    float* row_max_log2 = o_tiles + sub_rows * ld_dv;                          // [sub_rows]
    float* row_sums = row_max_log2 + sub_rows;               // [sub_rows, kSumLanes]
    float* dropout_probs = row_sums + sub_rows * kSumLanes;  // [kQueryBlock, key_tile]
    uint32_t* own_tile =
        reinterpret_cast<uint32_t*>(dropout_probs + kQueryBlock * key_tile);  // [layout.tile_words]

    for (const int64_t index : tasks) {
      const ForwardTask task(p, plan, index);
      const int64_t batch = task.batch;
      reset_rows(task, ld_dv, o_tiles, row_max_log2, row_sums, kSumLanes);

      // With ALiBi a row's scores grow towards its diagonal, the last keys it sees: taken
      // from the last tile back, a row meets its max first, where in key order nearly every
      // tile raised it and took softmax_tile_to_probs' second pass (the forward at S 1024 ran
      // 1.5x plain attention's time that way).
      const int64_t first_tile = task.key_begin() / key_tile * key_tile;
      const int64_t tiles = ceil_div(task.key_end() - first_tile, key_tile);
      const bool last_tile_first = p.mods.alibi_slopes != nullptr;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t key0 = first_tile + (last_tile_first ? tiles - 1 - t : t) * key_tile;
        const int64_t cols = std::min(key_tile, p.seq_k - key0);
        if (!shared_tiles) pack_kv_tile(p, layout, batch, task.kv_head, key0, own_tile);
        // [head_dim / 2, key_tile]
        const uint32_t* kt_pairs =
            shared_tiles ? shared->tile(batch, task.kv_head, key0, own_tile) : own_tile;
        const uint32_t* v_pairs = kt_pairs + layout.kt_words;  // [key_tile / 2, head_dim_v]

        // The sub-blocks' products go in two runs, all S = Q K^T and then all O += P V:
        // brgemm reconfigures the AMX tiles whenever consecutive calls change shape. A head's
        // consecutive blocks that compute the same columns share each call (every call has a
        // fixed cost).
        for (int64_t i = 0, run = 0; i < task.sub_blocks(); i += std::max<int64_t>(run, 1)) {
          run = task.alike_run(i, key0, cols);
          if (run == 0) continue;
          const scalar_t* q = static_cast<const scalar_t*>(p.q) + batch * p.q_strides.batch +
                              task.head(i) * p.q_strides.head + task.row0(i) * p.q_strides.row;
          // S = Q K^T   [rows, cols] of sub-blocks [i, i + run), straight from q's rows
          at::native::cpublas::brgemm(task.rows(i, run), task.cols_seen(i, key0, cols), p.head_dim,
                                      p.q_strides.row, key_tile, key_tile, false, q,
                                      reinterpret_cast<const scalar_t*>(kt_pairs),
                                      s_tiles + i * kQueryBlock * key_tile, true);
        }
        for (int64_t i = 0; i < task.sub_blocks(); ++i) {
          if (!task.sees(i, key0, cols)) continue;
          const int64_t head = task.head(i), row0 = task.row0(i), rows = task.rows(i);
          const int64_t cols_i = task.cols_seen(i, key0, cols), even_cols_i = round_up(cols_i, 2);
          float* s_tile = s_tiles + i * kQueryBlock * key_tile;
          // An additive mask adds to scaled scores; otherwise the exp applies the scale.
          for (int64_t r = 0; !fold_scale && r < rows; ++r) {
            float* s = s_tile + r * key_tile;
            at::vec::map([scale](Vec x) { return x * Vec(scale); }, s, s, cols_i);
          }
          mask_scores_tile<scalar_t>(s_tile, key_tile, rows, cols_i, p, batch, head, row0, key0);
          // P [rows, key_tile] in bf16, zero past cols_i (the pad column included)
          scalar_t* p_tile = p_tiles + i * kQueryBlock * key_tile;
          float* row_max_log2_i = row_max_log2 + i * kQueryBlock;
          float* row_sums_i = row_sums + i * kQueryBlock * kSumLanes;
          float* o_tile = o_tiles + i * kQueryBlock * ld_dv;
          const float score_scale = fold_scale ? scale : 1.f;
          if (!p.dropout.enabled) {
            softmax_tile_to_probs(s_tile, key_tile, rows, cols_i, score_scale, row_max_log2_i,
                                  row_sums_i, o_tile, ld_dv, p.head_dim_v, p_tile, key_tile);
          } else {
            // Dropout applies to fp32 P after the sums took it; then P rounds once.
            softmax_tile_to_probs(s_tile, key_tile, rows, cols_i, score_scale, row_max_log2_i,
                                  row_sums_i, o_tile, ld_dv, p.head_dim_v, dropout_probs, key_tile);
            for (int64_t r = 0; r < rows; ++r) {
              float* probs = dropout_probs + r * key_tile;
              apply_dropout_row(probs, cols_i, p.dropout, batch, head, row0 + r, key0);
              round_to_bf16(probs, p_tile + r * key_tile, even_cols_i);
            }
          }
        }
        for (int64_t i = 0, run = 0; i < task.sub_blocks(); i += std::max<int64_t>(run, 1)) {
          run = task.alike_run(i, key0, cols);
          if (run == 0) continue;
          // O += P V   [rows, head_dim_v] of sub-blocks [i, i + run)
          at::native::cpublas::brgemm(
              task.rows(i, run), p.head_dim_v, round_up(task.cols_seen(i, key0, cols), 2), key_tile,
              p.head_dim_v, ld_dv, true, p_tiles + i * kQueryBlock * key_tile,
              reinterpret_cast<const scalar_t*>(v_pairs), o_tiles + i * kQueryBlock * ld_dv, true);
        }
      }

      finish_rows<scalar_t>(task, ld_dv, o_tiles, row_max_log2, row_sums, kSumLanes,
                            /*max_unit=*/kLn2);
    }
    at::native::cpublas::brgemm_release(true);  // the AMX tile state of this thread
  });
}

// Row pairs from two rows' bf16 values as VCVTNE2PS2BF16 leaves them (row r's 16 in the low
// half, row r + 1's in the high): word c holds column c of row r and, above it, of row r + 1.
inline __m512i interleave_row_halves(__m512i halves) {
  alignas(64) static constexpr uint16_t kInterleave[32] = {
      0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  return _mm512_permutexvar_epi16(_mm512_load_si512(kInterleave), halves);
}

// B operand from fp32 rows, rounded to bf16 (nearest even): word (r / 2, c) of dst
// [ceil(rows / 2), ld] holds element c of rows r and r + 1 of src [rows, ld_src] (a zero row
// pads an odd count). 16 words per step: both rows' vectors convert into one, and a word
// shuffle interleaves them.
__attribute__((target("avx512bf16"))) inline void round_to_row_pairs(const float* src,
                                                                     int64_t ld_src, int64_t rows,
                                                                     int64_t cols, uint32_t* dst,
                                                                     int64_t ld) {
  for (int64_t r = 0; r < rows; r += 2) {
    const float* first = src + r * ld_src;
    const float* second = first + ld_src;
    const bool has_second = r + 1 < rows;
    uint32_t* out = dst + r / 2 * ld;
    for (int64_t c = 0; c < cols; c += 16) {
      const __mmask16 lanes = first_lanes(cols - c);
      const __m512 low = _mm512_maskz_loadu_ps(lanes, first + c);
      const __m512 high =
          has_second ? _mm512_maskz_loadu_ps(lanes, second + c) : _mm512_setzero_ps();
      const __m512i halves = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low));
      _mm512_mask_storeu_epi32(out + c, lanes, interleave_row_halves(halves));
    }
  }
}

// The bf16 backward's elementwise step over a tile, one pass per two rows: P = exp(score_scale
// S - lse) over the masked scores in p_tile (P written back where keep_probs is set, for
// dropout's copy), dS = P * (dP - delta) from dp_tile, and the bf16 operands the products
// take: P and dS in row pairs (p_pairs, ds_pairs [ceil(rows / 2), ld], a zero row padding an
// odd count) and dS as it is (ds_bf16 [rows, ld], a zero column padding an odd count). The
// arithmetic of probs_from_lse and softmax_grad_row, with the exp taken as softmax_exp2 of
// (score_scale log2 e) S - lse log2 e, as the bf16 forward does; one pass instead of five
// saves reloading P and dS four times. softcap_grad [rows, ld], where given, multiplies dS
// (the softcap's derivative, see mask_scores_row).
__attribute__((target("avx512bf16"))) inline void probs_and_score_grads(
    float* p_tile, const float* dp_tile, int64_t ld, int64_t rows, int64_t cols, const float* lse,
    const float* delta, float score_scale, bool keep_probs, const float* softcap_grad,
    uint32_t* p_pairs, uint32_t* ds_pairs, c10::BFloat16* ds_bf16) {
  const __m512 scale = _mm512_set1_ps(static_cast<float>(score_scale * kLog2e));
  const int64_t even_cols = round_up(cols, 2);
  for (int64_t r = 0; r < rows; r += 2) {
    const int64_t pair_rows = std::min<int64_t>(2, rows - r);
    // 2^(scale s + bias) with bias -lse log2 e (rounded once), or -inf for a row that saw no
    // key (lse -inf): P = 0.
    __m512 bias[2], row_delta[2];
    for (int64_t j = 0; j < 2; ++j) {
      const bool saw_keys = j < pair_rows && lse[r + j] != -std::numeric_limits<float>::infinity();
      bias[j] = _mm512_set1_ps(saw_keys ? static_cast<float>(-lse[r + j] * kLog2e)
                                        : -std::numeric_limits<float>::infinity());
      row_delta[j] = _mm512_set1_ps(j < pair_rows ? delta[r + j] : 0.f);
    }
    for (int64_t c = 0; c < even_cols; c += 16) {
      const __mmask16 lanes = first_lanes(cols - c);
      const __mmask16 even_lanes = first_lanes(even_cols - c);
      __m512 probs[2], grads[2];
      for (int64_t j = 0; j < 2; ++j) {
        probs[j] = grads[j] = _mm512_setzero_ps();
        if (j == pair_rows) continue;
        float* p_row = p_tile + (r + j) * ld + c;
        // Lanes past cols stay 0, so the pad column and the pairs' tails hold zeros.
        probs[j] = _mm512_maskz_mov_ps(
            lanes,
            softmax_exp2(_mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, p_row), scale, bias[j])));
        if (keep_probs) _mm512_mask_storeu_ps(p_row, lanes, probs[j]);
        const __m512 dp = _mm512_maskz_loadu_ps(lanes, dp_tile + (r + j) * ld + c);
        grads[j] = _mm512_mul_ps(probs[j], _mm512_sub_ps(dp, row_delta[j]));
        if (softcap_grad != nullptr) {
          grads[j] = _mm512_mul_ps(grads[j],
                                   _mm512_maskz_loadu_ps(lanes, softcap_grad + (r + j) * ld + c));
        }
      }
      // One conversion per 32 values: the low half holds row r, the high half row r + 1.
      const __m512i p_words = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(probs[1], probs[0]));
      const __m512i ds_words = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(grads[1], grads[0]));
      _mm256_mask_storeu_epi16(ds_bf16 + r * ld + c, even_lanes, _mm512_castsi512_si256(ds_words));
      if (pair_rows == 2) {
        _mm256_mask_storeu_epi16(ds_bf16 + (r + 1) * ld + c, even_lanes,
                                 _mm512_extracti64x4_epi64(ds_words, 1));
      }
      _mm512_mask_storeu_epi32(p_pairs + r / 2 * ld + c, lanes, interleave_row_halves(p_words));
      _mm512_mask_storeu_epi32(ds_pairs + r / 2 * ld + c, lanes, interleave_row_halves(ds_words));
    }
  }
}

// dst[c * ld_dst + r] = src[r * ld_src + c] for r < rows, c < cols, in at::vec's 32 x 32 bf16
// register blocks.
inline void transpose_bf16(const c10::BFloat16* src, int64_t ld_src, int64_t rows, int64_t cols,
                           c10::BFloat16* dst, int64_t ld_dst) {
  for (int64_t r = 0; r < rows; r += 32) {
    for (int64_t c = 0; c < cols; c += 32) {
      at::vec::transpose_mxn<c10::BFloat16>(src + r * ld_src + c, ld_src, dst + c * ld_dst + r,
                                            ld_dst,
                                            static_cast<int>(std::min<int64_t>(32, rows - r)),
                                            static_cast<int>(std::min<int64_t>(32, cols - c)));
    }
  }
}

// Q^T [head_dim, transposed_row_length] of batch x head bh in the q_grad_out_transposed
// workspace; its dO^T [head_dim_v, transposed_row_length] follows.
inline c10::BFloat16* transposed_rows(const AttentionBackwardParams& p,
                                      const AttentionWorkspaces& w, int64_t bh) {
  return static_cast<c10::BFloat16*>(w.q_grad_out_transposed) +
         bh * (p.head_dim + p.head_dim_v) * transposed_row_length(p.seq_q);
}

// Fills the q_grad_out_transposed workspace: Q^T and dO^T of every query block, the columns
// past seq_q zero (a run of odd length reads one as the pair of its last row).
inline void transpose_q_grad_out(const AttentionBackwardParams& p, const AttentionWorkspaces& w) {
  using scalar_t = c10::BFloat16;
  const int64_t q_blocks = ceil_div(p.seq_q, kQueryBlock), dims = p.head_dim + p.head_dim_v;
  const int64_t ld = transposed_row_length(p.seq_q);
  parallel_for(0, p.batch * p.num_heads * q_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t index = begin; index < end; ++index) {
      const int64_t bh = index / q_blocks, batch = bh / p.num_heads, head = bh % p.num_heads;
      const int64_t row0 = index % q_blocks * kQueryBlock,
                    rows = std::min(kQueryBlock, p.seq_q - row0);
      scalar_t* q_t = transposed_rows(p, w, bh) + row0;  // [head_dim, ld] from column row0
      scalar_t* grad_out_t = q_t + p.head_dim * ld;      // [head_dim_v, ld] from column row0
      transpose_bf16(static_cast<const scalar_t*>(p.q) + batch * p.q_strides.batch +
                         head * p.q_strides.head + row0 * p.q_strides.row,
                     p.q_strides.row, rows, p.head_dim, q_t, ld);
      transpose_bf16(static_cast<const scalar_t*>(p.grad_out) + batch * p.grad_out_strides.batch +
                         head * p.grad_out_strides.head + row0 * p.grad_out_strides.row,
                     p.grad_out_strides.row, rows, p.head_dim_v, grad_out_t, ld);
      for (int64_t d = 0; rows < kQueryBlock && d < dims; ++d) {
        std::fill(q_t + d * ld + rows, q_t + d * ld + kQueryBlock, scalar_t(0.f));
      }
    }
  });
}

// Query blocks whose P and dS one dK^T and one dV^T product take. brgemm's accumulating
// products load and store their fp32 result tiles on every call; over a single 64-row block
// that traffic is as large as the products' own.
constexpr int64_t kBackwardChunkBlocks = 4;

// bf16 backward on brgemm, the same task layout and arithmetic as attention_backward_kernel
// with bf16 operands and fp32 accumulation in all five products; P and dS are rounded to
// bf16 for the products that take them, as GPU FlashAttention's backward does. The key
// gradients accumulate transposed, dK^T += Q^T dS and dV^T += dO^T P, so the per-tile
// operands are P and dS in row pairs (an interleave of two rows) rather than P^T and dS^T
// (a transpose of the whole tile, which took a quarter of the backward); Q^T and dO^T are
// written once per call by transpose_q_grad_out, and those two products each take a chunk
// of query blocks at once. Per key block K^T, V^T and K are packed once (column pairs,
// column pairs, row pairs); S and dP read q and dO rows in place.
inline void attention_backward_bf16_brgemm(const AttentionBackwardParams& p,
                                           const AttentionWorkspaces& w) {
  using scalar_t = c10::BFloat16;
  using Vec = at::vec::Vectorized<float>;
  transpose_q_grad_out(p, w);
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t splits = p.num_kv_splits;
  const int64_t d = p.head_dim, dv = p.head_dim_v;
  const int64_t chunk_rows = kBackwardChunkBlocks * kQueryBlock,
                chunk_tile = chunk_rows * kKeyBlock;
  const int64_t ld_t = transposed_row_length(p.seq_q);
  const float scale = static_cast<float>(p.scale);
  const bool fold_scale = !scores_modified(p) && scale > 0.f;
  // 32-bit words: packed K^T, V^T, K; fp32 P, dropped P, dP / dS of a chunk; bf16 P and dS
  // in row pairs and dS as it is (half a word each); fp32 dK^T and dV^T accumulators and the
  // staging of their transposes.
  const bool softcap = p.mods.softcap > 0.0;
  const int64_t scratch_size = (d / 2) * kKeyBlock + (dv / 2) * kKeyBlock + kKeyBlock / 2 * d +
                               4 * chunk_tile + 3 * chunk_tile / 2 + (d + dv) * kKeyBlock +
                               kKeyBlock * std::max(d, dv);

  parallel_tasks(p.batch * p.num_kv_heads * splits, [&](ClaimedTasks& tasks) {
    uint32_t* kt_pairs =
        reinterpret_cast<uint32_t*>(thread_scratch<float>(scratch_size));  // [d / 2, kKeyBlock]
    uint32_t* vt_pairs = kt_pairs + d / 2 * kKeyBlock;                     // [dv / 2, kKeyBlock]
    uint32_t* k_pairs = vt_pairs + dv / 2 * kKeyBlock;                     // [kKeyBlock / 2, d]
    float* p_tile =
        reinterpret_cast<float*>(k_pairs + kKeyBlock / 2 * d);  // [chunk_rows, kKeyBlock] P
    float* pd_tile = p_tile + chunk_tile;             // [chunk_rows, kKeyBlock] P after dropout
    float* ds_tile = pd_tile + chunk_tile;            // [chunk_rows, kKeyBlock] dP, then dS
    float* softcap_grad_tile = ds_tile + chunk_tile;  // [chunk_rows, kKeyBlock]
    uint32_t* p_pairs =
        reinterpret_cast<uint32_t*>(softcap_grad_tile + chunk_tile);  // [chunk_rows / 2, kKeyBlock]
    uint32_t* ds_pairs = p_pairs + chunk_tile / 2;  // [chunk_rows / 2, kKeyBlock] dS
    scalar_t* ds_bf16 =
        reinterpret_cast<scalar_t*>(ds_pairs + chunk_tile / 2);        // [chunk_rows, kKeyBlock] dS
    float* dkt_tile = reinterpret_cast<float*>(ds_bf16 + chunk_tile);  // [d, kKeyBlock]
    float* dvt_tile = dkt_tile + d * kKeyBlock;                        // [dv, kKeyBlock]
    float* staging = dvt_tile + dv * kKeyBlock;                        // [kKeyBlock, max(d, dv)]

    for (const int64_t index : tasks) {
      const BackwardTask<scalar_t> task(p, index);
      const int64_t batch = task.batch, kv_head = task.kv_head, split = task.split;
      // The dQ rows [written_begin, written_end) of the group's heads in this split's partial
      // sums hold what earlier key blocks added (whole query blocks): a block's first product
      // writes its rows, later ones add to them, and the rows no key block reaches are
      // zeroed at the end. Clearing the whole workspace first took 2% of the backward.
      int64_t written_begin = p.seq_q, written_end = 0;

      for (int64_t block = task.first_block; block < task.end_block; ++block) {
        const int64_t key0 = block * kKeyBlock;
        const int64_t cols = std::min(kKeyBlock, p.seq_k - key0), even_cols = round_up(cols, 2);
        pack_column_pairs(task.k + key0 * p.k_strides.row, p.k_strides.row, cols, d, kt_pairs,
                          kKeyBlock);
        pack_column_pairs(task.v + key0 * p.v_strides.row, p.v_strides.row, cols, dv, vt_pairs,
                          kKeyBlock);
        pack_row_pairs(task.k + key0 * p.k_strides.row, p.k_strides.row, cols, d, k_pairs, d);
        std::fill(dkt_tile, dkt_tile + (d + dv) * kKeyBlock, 0.f);  // and dvt_tile
        const KeyRange seeing = rows_seeing_keys(p.window, key0, key0 + cols, p.seq_q);
        // Whole query blocks, so that each block's dQ rows are written whole: rows of the
        // first and last block that see none of these keys get P = 0 and add nothing.
        const int64_t rows_begin = seeing.begin / kQueryBlock * kQueryBlock;
        const int64_t rows_end = seeing.begin < seeing.end
                                     ? std::min(p.seq_q, round_up(seeing.end, kQueryBlock))
                                     : rows_begin;

        for (int64_t head = kv_head * group; head < (kv_head + 1) * group; ++head) {
          const int64_t bh = batch * p.num_heads + head;
          const float* lse = static_cast<const float*>(p.lse) + lse_offset(p, batch, head);
          const float* delta = static_cast<const float*>(p.delta) + lse_offset(p, batch, head);
          float* grad_q_accum = grad_q_partial_sums<float>(p, split, batch, head);
          const scalar_t* q_t = transposed_rows(p, w, bh);  // [d, ld_t]
          const scalar_t* grad_out_t = q_t + d * ld_t;      // [dv, ld_t]
          for (int64_t chunk0 = rows_begin; chunk0 < rows_end; chunk0 += chunk_rows) {
            const int64_t chunk_end = std::min(chunk0 + chunk_rows, rows_end);
            const int64_t rows = chunk_end - chunk0;
            const scalar_t* q = static_cast<const scalar_t*>(p.q) + batch * p.q_strides.batch +
                                head * p.q_strides.head + chunk0 * p.q_strides.row;
            const scalar_t* grad_out =
                static_cast<const scalar_t*>(p.grad_out) + batch * p.grad_out_strides.batch +
                head * p.grad_out_strides.head + chunk0 * p.grad_out_strides.row;
            // Each product takes the whole chunk (brgemm has a fixed cost per call), in an order
            // that keeps consecutive calls the same shape where the head dims match (S and dP,
            // then dQ, then dV^T and dK^T): brgemm reloads the AMX tile configuration whenever
            // the shape changes.
            // P = exp(scale S - lse), recomputed from the saved logsumexp   [rows, cols]
            at::native::cpublas::brgemm(rows, cols, d, p.q_strides.row, kKeyBlock, kKeyBlock, false,
                                        q, reinterpret_cast<const scalar_t*>(kt_pairs), p_tile,
                                        true);
            // dP = dO V^T   [rows, cols]
            at::native::cpublas::brgemm(rows, cols, dv, p.grad_out_strides.row, kKeyBlock,
                                        kKeyBlock, false, grad_out,
                                        reinterpret_cast<const scalar_t*>(vt_pairs), ds_tile, true);
            for (int64_t r = 0; !fold_scale && r < rows; ++r) {
              float* s = p_tile + r * kKeyBlock;
              at::vec::map([scale](Vec x) { return x * Vec(scale); }, s, s, cols);
            }
            mask_scores_tile<scalar_t>(p_tile, kKeyBlock, rows, cols, p, batch, head, chunk0, key0,
                                       softcap ? softcap_grad_tile : nullptr);
            // With dropout, dS = P * (dP * dropout - delta): dP takes its dropout first.
            for (int64_t r = 0; p.dropout.enabled && r < rows; ++r) {
              apply_dropout_row(ds_tile + r * kKeyBlock, cols, p.dropout, batch, head, chunk0 + r,
                                key0);
            }
            // P and dS = P * (dP - delta), in the layouts the products below take
            probs_and_score_grads(p_tile, ds_tile, kKeyBlock, rows, cols, lse + chunk0,
                                  delta + chunk0, fold_scale ? scale : 1.f,
                                  /*keep_probs=*/p.dropout.enabled,
                                  softcap ? softcap_grad_tile : nullptr, p_pairs, ds_pairs,
                                  ds_bf16);
            // dV sees the dropped probabilities: their pairs replace those of P.
            if (p.dropout.enabled) {
              const float* pd = dropped_probs(p_tile, pd_tile, kKeyBlock, rows, cols, p.dropout,
                                              batch, head, chunk0, key0);
              round_to_row_pairs(pd, kKeyBlock, rows, cols, p_pairs, kKeyBlock);
            }
            // dQ += dS K   [rows, d]  (scaled when the splits are summed): into the blocks an
            // earlier key block wrote, and writing the others
            const int64_t added_end = std::clamp(written_end, chunk0, chunk_end);
            if (added_end > chunk0) {
              at::native::cpublas::brgemm(
                  added_end - chunk0, d, even_cols, kKeyBlock, d, d, /*add_C=*/true, ds_bf16,
                  reinterpret_cast<const scalar_t*>(k_pairs), grad_q_accum + chunk0 * d, true);
            }
            if (chunk_end > added_end) {
              at::native::cpublas::brgemm(
                  chunk_end - added_end, d, even_cols, kKeyBlock, d, d, /*add_C=*/false,
                  ds_bf16 + (added_end - chunk0) * kKeyBlock,
                  reinterpret_cast<const scalar_t*>(k_pairs), grad_q_accum + added_end * d, true);
            }
            // An odd row count ends on the zero row of the pairs.
            const int64_t depth = round_up(rows, 2);
            // dV^T += dO^T P_dropped   [dv, cols]
            at::native::cpublas::brgemm(dv, cols, depth, ld_t, kKeyBlock, kKeyBlock, true,
                                        grad_out_t + chunk0,
                                        reinterpret_cast<const scalar_t*>(p_pairs), dvt_tile, true);
            // dK^T += Q^T dS   [d, cols]  (scaled on the store)
            at::native::cpublas::brgemm(d, cols, depth, ld_t, kKeyBlock, kKeyBlock, true,
                                        q_t + chunk0, reinterpret_cast<const scalar_t*>(ds_pairs),
                                        dkt_tile, true);
          }
        }
        // Key blocks reach query rows in order (both window bounds grow with the key), so
        // what the task has written stays one run of rows.
        if (rows_begin < rows_end) {
          written_begin = std::min(written_begin, rows_begin);
          written_end = rows_end;
        }
        transpose_tile(dkt_tile, kKeyBlock, d, cols, staging, d);
        for (int64_t c = 0; c < cols; ++c) {
          store_row(staging + c * d, d, scale, task.grad_k + (key0 + c) * p.grad_k_strides.row);
        }
        transpose_tile(dvt_tile, kKeyBlock, dv, cols, staging, dv);
        for (int64_t c = 0; c < cols; ++c) {
          store_row(staging + c * dv, dv, 1.f, task.grad_v + (key0 + c) * p.grad_v_strides.row);
        }
      }
      for (int64_t head = kv_head * group; head < (kv_head + 1) * group; ++head) {
        float* grad_q_accum = grad_q_partial_sums<float>(p, split, batch, head);
        std::fill(grad_q_accum, grad_q_accum + written_begin * d, 0.f);
        std::fill(grad_q_accum + std::max(written_begin, written_end) * d,
                  grad_q_accum + p.seq_q * d, 0.f);
      }
    }
    at::native::cpublas::brgemm_release(true);  // the AMX tile state of this thread
  });
}
#endif

// The ISA's entry points, declared for the dispatcher in kernels.h.
void attention_forward(const AttentionForwardParams& params,
                       const AttentionWorkspaces& workspaces) {
#if defined(CPU_CAPABILITY_AVX512)
  if (bf16_brgemm_usable(params, workspaces)) {
    return attention_forward_bf16_brgemm(params, workspaces);
  }
#endif
  dispatch_dtype(params.dtype, [&](auto tag) { attention_forward_kernel<decltype(tag)>(params); });
}

void attention_backward(const AttentionBackwardParams& params,
                        const AttentionWorkspaces& workspaces) {
  dispatch_dtype(params.dtype, [&](auto tag) {
    using scalar_t = decltype(tag);
    compute_delta<scalar_t, typename AccumulateType<scalar_t>::type>(params);
#if defined(CPU_CAPABILITY_AVX512)
    if (std::is_same_v<scalar_t, c10::BFloat16> &&
        bf16_brgemm_usable(params, workspaces, /*backward=*/true)) {
      attention_backward_bf16_brgemm(params, workspaces);
    } else {
      attention_backward_kernel<scalar_t>(params);
    }
#else
    attention_backward_kernel<scalar_t>(params);
#endif
    finish_grad_q<scalar_t>(params);
  });
}

}  // namespace CPU_CAPABILITY
}  // namespace mha_ext::cpu
