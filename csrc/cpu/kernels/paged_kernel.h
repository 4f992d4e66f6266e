#pragma once
// Attention that reads keys and values from a paged cache through block tables, for a batch
// of sequences of different lengths: decode (one query per sequence) and chunked prefill
// (several), causal with the queries as the last tokens of each sequence, optionally with a
// sliding window, a logit softcap, ALiBi and attention sinks (PagedAttentionParams).
//
// One task per (sequence, kv heads, chunk of queries, split of the keys): decode takes a
// sequence's kv heads together, head by head within each key tile (plan_paged_tasks). The
// query heads of a GQA group are packed as rows of one query tile, so each K/V element is
// read once per group: for decode, the tile rows are the group's heads. Key tiles of 64
// tokens are gathered from whatever blocks hold them, so any block size works. With few
// tasks for the threads, long contexts are split and the partial results merged by
// logsumexp. A window narrows each task's keys to those its queries see: the key tiles
// before it are never visited, so a 4096-key window over 32k tokens reads 4096 keys. The
// sink joins a row's softmax when it is finished, or with key splits in their merge.
//
// paged_attention_kernel (at the end) runs in named steps: plan_paged_call and plan_task (the
// tasks, and each task's work items: key tiles, and within a tile its kv heads), start_task
// (q rows in, state cleared), then per work item the PrefetchSchedule's listing and requests,
// score_pass (S, the score modifications and masks, online softmax) and value_pass (O += P V),
// finish_task (the output, or a key split's partial output) and merge_split_outputs. Its tuning for
// each ISA class is PagedKernelTraits.
//
// Included by one translation unit per CPU ISA (kernels_<isa>.cpp).
#include <c10/util/Float8_e4m3fn.h>

#include <cstring>
#include <type_traits>
#include <utility>

#include "blocking.h"
#include "cpu/parallel.h"
#include "kernel_common.h"
#include "mha_ext/paged_cache.h"
#include "mha_ext/paged_params.h"
#include "mha_ext/score_mods.h"
#include "tile_gemm.h"

namespace mha_ext::cpu {
inline namespace CPU_CAPABILITY {

// The ISA class of this build of the kernels (kernels_<isa>.cpp sets CPU_CAPABILITY). The paged
// kernel is tuned per class, not per machine: each choice in PagedKernelTraits was measured on
// one CPU of its class, named beside the numbers (AVX-512: AMD Zen 5 or an Intel Xeon; AVX2:
// AMD Zen 1), and stands for the whole class until another CPU of it measures otherwise. The
// portable build takes AVX2's choices without AVX2's instructions.
enum class IsaClass { kPortable, kAvx2, kAvx512 };
constexpr IsaClass kIsaClass =
#if defined(CPU_CAPABILITY_AVX512)
    IsaClass::kAvx512;
#elif defined(CPU_CAPABILITY_AVX2)
    IsaClass::kAvx2;
#else
    IsaClass::kPortable;
#endif

// The paged kernel's tuning for this build's ISA class and a cache of scalar_t, in one place.
// Each choice says what it measured and with which benchmark:
//  - paged_bench (benchmarks/cpp/paged_bench.cpp, built by CMakeLists.txt as
//    build/cmake/paged_bench): paged_decode runs the kernel with the op's task plan on 8
//    sequences of 4096 tokens, blocks of 16, head dim 128, the cache read from memory, e.g.
//    32q/8kv fp32 (dtype:1 is bf16; OMP_NUM_THREADS=1 for one core):
//   build/cmake/paged_bench --benchmark_filter='paged_decode/batch:8/heads:32/kv_heads:8/.*dtype:0'
//    --shape=batch,heads,kv_heads,context,head_dim,dtype,block_size runs other shapes, e.g.
//    --shape=1,32,8,256,128,0,16 (2 MiB of fp32 K/V) for a cache that stays in L2 or L3. The
//    measurements "of the kernel called directly" or "of a harness" below were taken before
//    paged_bench existed, by harnesses that ran this same call.
//  - the suite: the op through Python, the decode of llama2-7b (32q/32kv), 32q/8kv and
//    llama2-70b (64q/8kv) heads at batch 8, context 4096:
//   python -m mha_ext.bench --suite paged_decode --dtype float32 bfloat16 --context 4096 --no-plots
// "a -> b" reads: the other choice a, this one b. "Check:" names the command that measures
// the choice again; "paged_bench F" stands for build/cmake/paged_bench --benchmark_filter=F.
template <typename scalar_t>
struct PagedKernelTraits {
  using acc_t = typename AccumulateType<scalar_t>::type;

  // Vector registers that the register blocking below plans for.
  static constexpr int kVectorRegisters = kIsaClass == IsaClass::kAvx512 ? 32 : 16;

  // Tile rows up to which the kernel reads keys and values row by row straight from the cache
  // (the direct path; blocking.h gives the measurement). One value for every ISA class: the
  // task planner, which runs before the ISA dispatch, decides with it which tasks take all of
  // a sequence's kv heads.
  static constexpr int64_t kDirectRows = cpu::kDirectRows;

  // Cached rows are requested this many positions before they are read. A sequence's blocks
  // lie anywhere in the cache and hold a few KiB per head, and the hardware prefetchers stop
  // at every page boundary: without the requests, decode read a bf16 cache at 40% of the
  // streaming bandwidth, most of the time spent waiting on loads that missed. Further ahead
  // is worse: the next tile's 64 K and V rows requested during this tile's value pass (a line
  // of each per slice step, none in the score loop) decoded fp32 32q/8kv at 9.5 GB/s against
  // 14.5 on Zen 1. There the hint (t0, t1, nta)
  // made no difference, so the requests likely all fill L1, which a tile's rows (64 KiB of
  // fp32 at head dim 128) overflow. Measured on AVX2 (Zen 1) only; every class takes it.
  // Check: paged_bench 'paged_decode/batch:8/heads:32/kv_heads:8/.*dtype:0'
  static constexpr int64_t kPrefetchRows = 16;

  // The direct path's value pass weights the tile rows in groups of at most this many, each
  // group reading the values again (from L1); the score pass takes all rows at once
  // (score_tile). With 16 registers an fp32 (or fp64) cache goes 4 rows at a time, whose
  // accumulators for a slice of O fit beside the value vectors. A bf16 cache is not split, as
  // each further read of a value converts it again (1.6x slower split, Zen 1), except where
  // that conversion is cheap (kWidenInPairs on AVX2: value_group_rows). AVX-512's 32 registers take
  // all rows. The 1.6x is from AVX2 (Zen 1); the rule is per class (16 or 32 registers).
  // Check: paged_bench 'paged_decode/batch:8/heads:64/kv_heads:8/' (8 rows)
  static constexpr int kValueRowGroup =
      kIsaClass == IsaClass::kAvx512 || !std::is_same_v<scalar_t, acc_t> ? int(kDirectRows) : 4;

  // Rows per group of the value pass for a tile of `rows` rows: kValueRowGroup's, but 8 rows
  // of a cache widened in pairs go as two groups of 4, whose accumulators fit the registers,
  // as reading each value twice costs only a load and two bit operations more (64q/8kv bf16
  // decode on Zen 1, medians of 8 rounds on two cores: 6.34 against 6.08 GB/s; 5 to 7 rows
  // lost 3-9% split). AVX2 class (AVX-512 takes the 8 rows at once).
  // Check: paged_bench 'paged_decode/batch:8/heads:64/kv_heads:8/.*dtype:1'
  static constexpr int value_group_rows(int rows) {
    return kIsaClass == IsaClass::kAvx2 && kWidenInPairs && rows == 8
               ? 4
               : std::min(rows, kValueRowGroup);
  }

  // Whether a direct tile of `rows` rows has its value pass request the next tile's key rows,
  // spread over the pass's steps, while its score pass requests only its own value rows. The
  // other plan requests both in the score pass (a key row kPrefetchRows ahead and the value
  // row of the key being scored) and leaves memory idle while the values pass, a third of an
  // fp32 4-row tile's time on Zen 1.
  // AVX2 class (Zen 1): fp32 tiles of up to 4 rows. 8 sequences, context 4096, fp32, two
  // threads, rounds alternating old and new builds; with score_keys' two chains, without
  // which this plan gained nothing: through the op (the suite's llama2-7b decode, one head
  // per kv head) median 19.4 against 16.9 GB/s, 32q/8kv 15.5 against 15.3 (within the
  // noise); a standalone harness of the kernel gave 17.8 against 16.0 and 16.0-16.5 against
  // 15.3-16.0.
  // 8-row tiles (llama2-70b, 10.1 against 10.8) and bf16 caches (8.9 against 9.6) are bound
  // by their arithmetic and lost to the value pass's extra work.
  // AVX-512 class: every tile, with kValuesRequestedTileAhead. Tiles of 2 or more rows on
  // Zen 5: fp32 32q/8kv from memory on one core, medians of 15 rounds alternating the builds
  // of a standalone harness, 13.2 -> 14.6 GB/s; through the op (the suite) on two cores
  // 21.5-27.1 -> 23.2-33.5 GB/s in alternating runs (the VM's streaming rate moved between 31
  // and 48 GB/s meanwhile).
  // 1-row tiles (one q head per kv head, llama2-7b's decode) joined on Zen 4 (family 25 model
  // 17), whose one-row score pass outran its requests 16 keys ahead: a bf16 cache from memory
  // at 13.8 GB/s on one core against 41 in L3. Alternating builds: the suite (below, --dtype
  // bfloat16), llama2-7b 25.4-29.1 -> 29.6-36.0 GB/s (65-71% -> 79-97% of the streaming read
  // measured beside it), --dtype float32 28.0-37.1 -> 32.0-38.1 GB/s (93-96% -> 97-107%);
  // 8q/8kv, 8 sequences x 4096 tokens on two threads, CPU time per key and kv head: bf16
  // 33.5-34.2 -> 24.9-28.8 ns, int8 16.3-17.1 -> 11.1-11.4, fp8 17.7-18.5 -> 16.5-16.8. Not
  // measured on Zen 5 or the Xeons.
  // Check: paged_bench 'paged_decode/batch:8/heads:32/kv_heads:(8|32)/.*dtype:0' (also with
  // OMP_NUM_THREADS=1) and the suite with --dtype float32 and bfloat16
  static constexpr bool value_pass_requests_keys(int64_t rows) {
    if constexpr (kIsaClass == IsaClass::kAvx512) {
      return true;
    } else {
      return sizeof(scalar_t) == 4 && rows <= kValueRowGroup;
    }
  }

  // Whether, where the value pass requests the next tile's keys, the score pass requests the
  // next tile's value rows too (the tile's own were requested a tile earlier, the first
  // tile's up front) rather than its own: every request then has a whole tile's work before
  // its use, and the two passes request alike. With AVX-512's faster score passes (bf16 dot
  // products, 16 sums per reduction) requests for a tile's own values came too close to their
  // use: bf16 32q/8kv from memory on two cores, harness medians of 11 rounds, 20.6 -> 23.5
  // GB/s; fp32 22.7 either way. AVX-512 class (Zen 5); not measured on AVX2, which keeps
  // requesting its own.
  // Check: paged_bench 'paged_decode/batch:8/heads:32/kv_heads:8/'
  static constexpr bool kValuesRequestedTileAhead = kIsaClass == IsaClass::kAvx512;

  // Whether the direct path widens a bf16 cache's rows to fp32 two vectors at a time
  // (widen_bf16_pairs). at::vec widens one vector's bf16 at a time by zero-extending them
  // (VPMOVZXWD, a shuffle, which Zen 1 runs on one of the two pipes its FMAs use) and
  // shifting; one load and two bit operations give two vectors, out of order (the even
  // elements, then the odd). The tile's q rows and O rows keep each whole group of two
  // vectors' elements in that order (reorder_pair_groups): a dot product or an elementwise sum
  // takes its terms in any order. Measured on Zen 1 (the kernel called directly, 8 sequences x
  // context 4096, a bf16 decode being bound by its arithmetic there): on
  // one core 32q/8kv 4.58 -> 5.22 GB/s, 32q/32kv 6.48 -> 7.38, 64q/8kv 2.86 -> 2.93 (8 rows,
  // whose accumulators leave no room for a second chain); on two, medians of 10 rounds
  // alternating the builds, 6.71 -> 7.36, 10.8 -> 12.9 and 5.77 -> 6.02. AVX-512 (Xeon model
  // 207, where keys are scored by FMAs, kScoreByBf16Dots): 64q/8kv from L3 on one core, 8
  // sequences x 1024 tokens, six alternating rounds, 2.50-2.66 -> 2.35-2.46 ms a step; the
  // paged_decode suite from memory on two cores, seven alternating runs, llama2-70b heads
  // median 20.1 -> 20.8 GB/s (15.7-20.6 -> 19.1-22.6), llama2-7b 24.0 -> 25.2 (23.1-24.8 ->
  // 24.3-25.5). With VDPBF16PS scoring the keys (Zen 5) only the value pass widens in pairs.
  // Every class but the portable build.
  // Check: paged_bench 'paged_decode/batch:8/.*dtype:1' (also with OMP_NUM_THREADS=1; on
  // AVX-512 CPUs also with MHA_EXT_CPU_ISA=avx2)
  static constexpr bool kWidenInPairs =
      kIsaClass != IsaClass::kPortable && std::is_same_v<scalar_t, c10::BFloat16>;

  // Whether the direct path scores a bf16 cache with AVX512-BF16 dot products of bf16 pairs
  // (where the CPU has them), q's rows kept in bf16 and the scale applied to the sums: one
  // instruction takes 32 elements of a key for a row, where widening them to fp32 takes two
  // conversions per 16 and then two FMAs per row, and the products are as exact (a bf16
  // product fits fp32). On Zen 5, one core, cache in L3: 32q/8kv 20.7 -> 32.5 GB/s, 64q/8kv
  // 13.2 -> 17.2. The value pass takes P rounded to bf16, as GPU FlashAttention's P V product
  // does, and two keys' rows as bf16 pairs for VDPBF16PS (accumulate_value_slice_bf16_pairs),
  // where fp32 weights took an FMA per row for each 16 elements of every key: on Zen 4, one
  // thread from L2 (8 sequences, context 512), builds alternated three times, 32q/8kv
  // 21.3-22.2 -> 16.6-17.7 ns per key and kv head, 64q/8kv 41.5-43.9 -> 30.6-31.6. The error
  // against float64 (benchmarks/kv_cache_accuracy.py, its bf16 rows, bf16 q and output)
  // went 0.52 -> 0.54% and 0.48 -> 0.50% on normal K/V, 1.30 -> 1.31% and 1.02 -> 1.01% with
  // outlier key channels: the bf16 output's own rounding dominates it. AVX-512 class, at the
  // avx512_bf16 level only (bf16_dots in paged_attention_kernel):
  // on the Xeons with AMX (the avx512_amx level) VDPBF16PS runs at a quarter of the FMA's
  // instruction rate (the peak probes: 145 against 300 GFLOP/s on two cores, model 207), and
  // the FMAs decoded faster from memory: the suite's bf16 cases on two cores, alternating
  // runs, model 207 idle, llama2-70b heads at 68-74% of the streaming read against 61-65%,
  // 32q/8kv 87-94% against 86%, llama2-7b 87-89% against 85%.
  // Check: OMP_NUM_THREADS=1 build/cmake/paged_bench --shape=1,32,8,1024,128,1,16
  // --shape=1,64,8,1024,128,1,16 (4 MiB of bf16 K/V); on AMX, python -m mha_ext.bench
  // --suite paged_decode --context 4096 --dtype bfloat16 with MHA_EXT_CPU_ISA=avx512_bf16
  // and without
  static constexpr bool kScoreByBf16Dots =
      kIsaClass == IsaClass::kAvx512 && std::is_same_v<scalar_t, c10::BFloat16>;

  // Whether the direct path scores an fp8 cache for a bf16 q with the same AVX512-BF16 dot
  // products, each key's codes converted to bf16 units (fp8_bf16_units: exact, as e4m3's
  // values all are bf16s) by integer operations, where the FMAs took them to fp32 through
  // VCVTPH2PS. On Zen 4 VCVTPH2PS converts 16 elements per 1.8 cycles against one FMA a cycle
  // (a loop of each, 8 independent chains), and an fp8 cache decoded slower than a bf16 one.
  // Zen 4 (family 25 model 17), bf16 q, 32q/8kv D128, runs before and after in one session:
  // one thread from L2 (context 512, 8 sequences), 30.2 -> 27.1 ns per key and kv head (a bf16
  // cache 21); from memory (kv_cache_speed.py below, context 4096) 0.81x -> 0.90x the bf16
  // cache's tokens/s; the suite on two cores 1.04x / 0.84x -> 1.25x / 1.29x. The value pass
  // keeps the fp32 FMAs (P stays fp32) but where fp8_by_tables() (kFp8ByTables). At the
  // avx512_bf16 level only, as kScoreByBf16Dots;
  // not measured on Zen 5.
  // Check: OMP_NUM_THREADS=1 python benchmarks/kv_cache_speed.py --rounds 3 --clock cpu
  // --formats bf16 fp8 --flat-contexts 0 0 [--in-cache --context 512]; python -m mha_ext.bench
  // --suite paged_decode --context 4096 --dtype bfloat16 --kv-cache-dtype fp8 --kv-cache-only
  static constexpr bool kScoreFp8ByBf16Dots =
      kIsaClass == IsaClass::kAvx512 && std::is_same_v<scalar_t, c10::Float8_e4m3fn>;

  // Whether fp8 codes are converted to bf16 or fp32 units by two byte-table look-ups
  // (AVX512-VBMI's VPERMI2B over 128 entries) and interleaves, 64 codes at a time
  // (fp8_bf16_units_by_tables), where fp8_by_tables(): in the score pass of
  // kScoreFp8ByBf16Dots, against fp8_bf16_units' seven operations per 32 codes (four of them
  // for the subnormals), and in the value pass (value_by_fp8_tables), against VCVTPH2PS. Both
  // exact; the tables leave the codes out of order within each 64, which q's rows
  // (fp8_table_order) and O's slices follow. Zen 4 (family 25 model 17), bf16 q, 32q/8kv D128,
  // builds alternated: standalone loops over codes in L1 (4 rows), the score pass 8.5 -> 6.5
  // ns per key and the value pass 12.8 -> 11.4; the decode on one thread from L2 (context 512,
  // 8 sequences, the script below with --in-cache) 8300 -> 10300 tokens/s (0.78x -> 0.92x the
  // bf16 cache's), from memory (context 4096) 0.84-0.85x -> 1.02-1.06x, on two threads 1.08 /
  // 1.11x -> 1.23 / 1.30x; one query head per kv head, one thread from L2, 17.7-18.0 -> 11.5-
  // 11.9 ns per key and kv head. AVX-512 class, at the avx512_bf16 level (fp8_by_tables: Zen 4
  // and 5, where VCVTPH2PS competes with the FMAs); on the Xeons with AMX, where VPERMI2B and
  // the interleaves issue on the port VCVTPH2PS uses, a widening by the same look-ups gained
  // nothing (model 167, docs/PERFORMANCE.md, "Tried and not landed"), and Ice Lake (the
  // avx512_vnni level) is not measured. Where the scores take the bf16 dots of a bf16 q
  // (kFp8TablePairs), the value pass takes P in bf16 and the codes of two keys interleaved
  // before the look-ups, as bf16 pairs for VDPBF16PS (accumulate_value_slice_fp8_pairs): 16
  // products per key and 4 rows where the fp32 units took 32 FMAs. Zen 4, the same shapes, one
  // thread, dec loop over paged_attention alternating the builds: 23.0-23.9 -> 17.9-18.0 ns per
  // key and kv head from L2, 23.2 -> 17.8-18.4 from memory; the suite below on two threads
  // 1.21x -> 1.53x the bf16 cache (one run each, a noisy hour). The error stays the format's
  // (benchmarks/kv_cache_accuracy.py, "fp8-bf16-q": kernel / simulation 1.00).
  // Check: OMP_NUM_THREADS=1 python benchmarks/kv_cache_speed.py --rounds 3 --clock cpu
  // --formats bf16 fp8 --flat-contexts 0 0 [--in-cache --context 512], and with
  // MHA_EXT_CPU_VBMI=0; python -m mha_ext.bench --suite paged_decode --context 4096 --dtype
  // bfloat16 --kv-cache-dtype int8 fp8 --kv-cache-only
  static constexpr bool kFp8ByTables =
      kIsaClass == IsaClass::kAvx512 && std::is_same_v<scalar_t, c10::Float8_e4m3fn>;

  // Whether the direct path multiplies an int8 cache in integers, for a bf16 or fp16 q: in both
  // passes dot products of int16 pairs, on AVX-512 AVX512-VNNI's VPDPWSSD, one instruction for 32
  // elements of one row, where converting 16 cached elements to fp32 took two and then an FMA per
  // row, on the two ports that the FMAs share; on AVX2 VPMADDWD and VPADDD for 16 elements, as many
  // instructions per product as the FMAs, but one widening per 16 cached elements where the
  // conversion to fp32 took four. The scores take q's rows rounded to integers on a power-of-two
  // step (quantize_query_rows: exact for a bf16 element within 8 binades of the row's largest, an
  // fp16 within 5, any other within 2^-15 of the largest); the values take P's rows (the value
  // scales folded in) rounded to integers on a step of the row's largest weight in the work item /
  // 32767 (quantize_probabilities): finer than the bf16 P of GPU FlashAttention for every weight
  // above 1/128 of that largest. Both stay far below the int8 format's own error (README: the
  // kernel's error is the simulated format's, q in bf16 or fp32 alike), and the outputs within the
  // accuracy rule of their dtype. An fp32 q keeps the fp32 FMAs, whose products are exact, as does
  // the avx512 level: AVX-512 CPUs without VNNI (Skylake-SP), where VPMADDWD + VPADDD read no
  // faster than the FMAs (Xeon model 167 with this path's VPDPWSSD replaced by them, one
  // thread, kv_cache_speed.py as below, two runs: 1.50 / 1.49x the bf16 cache against the
  // FMAs' 1.48 / 1.44x, and VPDPWSSD's 1.65-1.68x). AVX-512 class from the avx512_vnni level
  // on (Cascade Lake and Ice Lake Xeons, and every CPU with AVX512-BF16), and the AVX2 class.
  // Xeon model 207 (AMX class), bf16 q, B8 32q/8kv D128 context 4096 from memory, four
  // pairs of suite runs alternating MHA_EXT_CPU_ISA=avx512 (the fp32 FMAs of the same build):
  // 1.46-1.53x -> 1.55-1.62x the bf16 cache's tokens/s; one thread from L2 (context 128):
  // 1.11-1.12x -> 1.34-1.39x.
  // AVX2, measured at MHA_EXT_CPU_ISA=avx2 on Xeon model 167 (no AVX2-only CPU measured
  // yet), bf16 q, B8 32q/8kv D128, one thread, builds alternated: the cache in L3 (context
  // 512, a harness calling paged_attention) 40 -> 31-33 ns per key and kv head (8q/8kv
  // 21-22 -> 16, 64q/8kv 68 -> 56); from memory, OMP_NUM_THREADS=1 python
  // benchmarks/kv_cache_speed.py --rounds 5 --clock cpu --formats bf16 int8 --flat-contexts
  // 0 0, 1.12-1.13x -> 1.33-1.37x the bf16 cache's tokens/s (720 -> 860), and the suite's
  // own case timed by whole passes over its layers 1.10-1.12x -> 1.29-1.31x; the suite below,
  // one call per sample, read 1.31-1.37x with either build (docs/PERFORMANCE.md).
  // Check: python -m mha_ext.bench --suite paged_decode --context 4096 --dtype bfloat16
  // --kv-cache-dtype int8 --kv-cache-only (and OMP_NUM_THREADS=1 python
  // benchmarks/kv_cache_speed.py --in-cache --context 128 --formats bf16 int8), with
  // MHA_EXT_CPU_ISA=avx512 and avx512_vnni; on AVX2, against the previous build
  static constexpr bool kInt16Dots =
      kIsaClass != IsaClass::kPortable && std::is_same_v<scalar_t, int8_t>;

  // Keys scored together by the direct path for `rows` rows. AVX-512 class (Zen 5): enough
  // that their rows x keys dot products share one reduction tree: 16 for 2, 4 or 8 rows
  // (transposed_sums16, one vector of sums; 8 rows from L2 on one core 23.6 -> 26.0 GB/s
  // against 8 sums through horizontal_sums, 4 rows unchanged), at most 8 otherwise, and 8
  // keys for one row (16 decoded llama2-7b's heads 5-10% slower from memory). AVX2 class
  // (Zen 1): one, as more accumulators and keys would not fit 16 registers (and two keys of
  // an fp32 cache at a time for 4 rows, which fit, decoded 5-15% faster from L2 but 10-20%
  // slower from memory, with the row requests before each step or spread through its loop
  // alike); for int16_dots (kInt16Dots, whose keys are widened once, 16 elements to a
  // register), 4 or 2 keys where their accumulators and one register per key and one for q
  // fit: 32q/8kv from memory, one thread, at MHA_EXT_CPU_ISA=avx2 on Xeon model 167,
  // kv_cache_speed.py (as for kInt16Dots) two alternating pairs, 824-835 -> 844-846 tokens/s.
  // Check: paged_bench 'paged_decode/batch:8/' (from memory) and OMP_NUM_THREADS=1
  // build/cmake/paged_bench --shape=1,64,8,128,128,0,16 (8 rows, 1 MiB of fp32 K/V)
  static constexpr int keys_per_step(int rows, bool int16_dots = false) {
    if constexpr (kIsaClass == IsaClass::kAvx512) {
      return rows > 1 && 16 % rows == 0 ? 16 / rows : rows <= 8 ? 8 / rows : 1;
    } else {
      if (int16_dots) {
        for (int keys : {4, 2}) {
          if (keys * (rows + 1) + 1 <= kVectorRegisters) return keys;
        }
      }
      return 1;
    }
  }

  // Whether the direct path converts an fp8 cache's codes two vectors at a time
  // (load_two_vectors, in natural order): one sign extension of 32 bytes (AVX-512) to 16-bit
  // lanes, one shift and one mask give two vectors' fp16 bits, where a vector at a time takes
  // the three for one. Xeon model 167, one thread, bf16 q, 8 sequences, context 4096 from
  // memory (kv_cache_speed.py), two pairs of runs alternating the builds: 32q/32kv (one row per
  // kv head) 1.47 / 1.50x -> 1.59 / 1.62x the bf16 cache's tokens/s, 32q/8kv 1.34 / 1.36x ->
  // 1.42 / 1.38x; from L3 (context 512) one row 21.5 -> 18.3 ns per key and kv head, 4 and 8
  // rows unchanged (their time goes elsewhere than the conversion). The AVX2 kernels at
  // MHA_EXT_CPU_ISA=avx2 on the same Xeon (16 codes per sign extension), same runs: 32q/32kv
  // 1.25 / 1.25x -> 1.38 / 1.39x, 32q/8kv 1.11 / 1.14x -> 1.15 / 1.10x; not measured on an
  // AVX2-only CPU. Every class but the portable build.
  // Check: OMP_NUM_THREADS=1 python benchmarks/kv_cache_speed.py --rounds 3 --clock cpu
  // --formats bf16 fp8 --flat-contexts 0 0 [--heads 32 --kv-heads 32], also with
  // MHA_EXT_CPU_ISA=avx2
  static constexpr bool kConvertFp8InPairs =
      kIsaClass != IsaClass::kPortable && std::is_same_v<scalar_t, c10::Float8_e4m3fn>;

  // Vectors per score step of `keys` keys for `rows` rows: two for one key of an fp32 cache,
  // and for any keys of a bf16 cache widened in pairs (kWidenInPairs), where q's rows hold
  // each whole group of two vectors' elements in the pairs' order; for an fp8 cache converted
  // in pairs, where the keys' two vectors each, the accumulators and q's vector fit the
  // registers.
  static constexpr int score_step_vectors(int rows, int keys) {
    if (kConvertFp8InPairs) return 2 * keys + rows * keys + 1 <= kVectorRegisters ? 2 : 1;
    return kWidenInPairs || (keys == 1 && std::is_same_v<scalar_t, acc_t>) ? 2 : 1;
  }

  // Accumulator chains per dot product of `rows` rows: one key's rows FMAs per vector are too
  // few to cover the FMA latency, so a step's two vectors go to two chains where their
  // accumulators fit the registers beside the two key vectors and a q vector (not for 7 or 8
  // rows on AVX2). On Zen 1 that scores fp32 faster from cache (32q/8kv decode 11.4 against
  // 10.2 GB/s on one core); from memory it
  // pays only where the value pass requests the keys (value_pass_requests_keys), as a shorter
  // score pass that requests them all left more of the tile's time to the value pass without
  // reads (13.0 against 14.3 GB/s). Measured on AVX2 (Zen 1); AVX-512's steps of one key
  // (odd row counts) follow the same rule, and its steps of several keys take one chain (their
  // keys' products are independent already, and two chains would not fit the registers).
  // Check: OMP_NUM_THREADS=1 build/cmake/paged_bench --shape=1,32,8,256,128,0,16 (cache)
  // and paged_bench 'paged_decode/batch:8/heads:32/kv_heads:8/.*dtype:0' (memory)
  static constexpr int score_chains(int rows, int keys, int step_vectors) {
    return keys == 1 && step_vectors == 2 && 2 * rows + 3 <= kVectorRegisters ? 2 : 1;
  }

  // Whether score_tile spreads its row requests through the score loop of a step of `keys`
  // keys, a line of each row per 64 bytes of key, instead of requesting both rows before the
  // step. Measured on AVX2 (Zen 1): an fp32 key's 16 requests at once decoded 32q/8kv at
  // 12.1 GB/s, spread out at 15.0 (llama2-70b heads 10.2 -> 10.6); a bf16 key's 8 requests
  // lost 3% spread out. AVX2 class; not measured on AVX-512, whose steps score several keys.
  // Check: MHA_EXT_CPU_ISA=avx2 paged_bench 'paged_decode/batch:8/heads:(32|64)/kv_heads:8/'
  static constexpr bool request_rows_in_score_loop(int keys) {
    return kIsaClass != IsaClass::kAvx512 && keys == 1 && sizeof(scalar_t) == 4;
  }

  // Vectors per O slice of the value pass for `rows` rows: 4 where the accumulators, value
  // vectors and broadcast weight all fit the vector registers, else 2. On AVX2 (Zen 1), 4 rows
  // x 4 vectors spilled four accumulators to the stack, loaded and stored for every key (2
  // vectors: llama2-70b fp32 decode 1.06x, 32q/8kv bf16 1.05x). 8 bf16 rows not widened in
  // pairs keep 2 vectors and a few spills: with 1, each FMA needs a broadcast weight of its
  // own and the loads outnumber the FMAs (3% slower). The rule follows kVectorRegisters on
  // every class.
  // Check: paged_bench 'paged_decode/batch:8/heads:(32|64)/kv_heads:8/'
  static constexpr int value_vectors(int rows) {
    return rows * 4 + 4 + 1 <= kVectorRegisters ? 4 : 2;
  }

  // Whether the value pass of `rows` rows converts an fp8 cache's whole groups of 64 codes by
  // byte tables (fp8_float_units_by_tables, kFp8ByTables): where its O slice is 4 vectors and
  // the accumulators leave room for the tables, the sign mask and the zero (up to 5 rows).
  // Its codes come out with the 128-bit lanes of the slice's four vectors transposed, which
  // O's slice takes while in registers (8 shuffles a row at each end of the slice).
  static constexpr bool value_by_fp8_tables(int rows) {
    return kFp8ByTables && value_vectors(rows) == 4 && rows * 4 + 4 + 1 + 6 <= kVectorRegisters;
  }

  // value_vectors for the int16 value pass (kInt16Dots), whose key pairs take a vector per O
  // vector: on AVX2 8 rows x 2 vectors would not fit, and take one.
  static constexpr int int16_value_vectors(int rows) {
    return rows * 2 + 2 + 1 <= kVectorRegisters ? value_vectors(rows) : 1;
  }
};

// 8-bit caches (CacheFormat): the kernels read their elements as fp32 "units" and fold the
// rest of the dequantization into the scores and the output (dequantize_in_scores...).
template <typename cache_t>
constexpr bool kQuantizedCache =
    std::is_same_v<cache_t, int8_t> || std::is_same_v<cache_t, c10::Float8_e4m3fn>;

// The value of one unit of a cached element: an int8 loads as its integer; a float8_e4m3fn as
// its value / 2^8, which is what its bits read as an fp16 after one shift and one mask (the
// 4 exponent bits land in fp16's 5 with the bias 15 instead of 7). VCVTPH2PS converts that
// fp16 exactly, subnormals included, so e4m3's subnormals never become fp32 subnormals
// (a microcode assist per lane); the 2^8 joins the per-tensor scale. The NaN encoding reads
// as 480 (the append stores NaN only for a NaN input).
template <typename cache_t>
constexpr float kCacheUnit = std::is_same_v<cache_t, c10::Float8_e4m3fn> ? 256.f : 1.f;

// One cached element in units (kCacheUnit), for the kernels' scalar tails.
template <typename acc_t, typename cache_t>
C10_ALWAYS_INLINE acc_t cached_unit(cache_t x) {
  if constexpr (std::is_same_v<cache_t, c10::Float8_e4m3fn>) {
    return static_cast<acc_t>(static_cast<float>(x) * (1.f / 256.f));
  } else {
    return static_cast<acc_t>(x);
  }
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// float8_e4m3fn codes sign-extended to 16-bit lanes, as the fp16 bits of their units
// (kCacheUnit): shifted left by 7, the sign lands in bit 15 (and 14, cleared), exponent and
// mantissa in bits 7-13.
C10_ALWAYS_INLINE __m128i fp8_unit_halves(__m128i codes) {
  return _mm_and_si128(_mm_slli_epi16(codes, 7), _mm_set1_epi16(static_cast<int16_t>(0xBF80)));
}
C10_ALWAYS_INLINE __m256i fp8_unit_halves(__m256i codes) {
  return _mm256_and_si256(_mm256_slli_epi16(codes, 7),
                          _mm256_set1_epi16(static_cast<int16_t>(0xBF80)));
}
#endif
#if defined(CPU_CAPABILITY_AVX512)
C10_ALWAYS_INLINE __m512i fp8_unit_halves(__m512i codes) {
  return _mm512_and_si512(_mm512_slli_epi16(codes, 7),
                          _mm512_set1_epi16(static_cast<int16_t>(0xBF80)));
}

// The bf16 bits of m 2^-17 in word m < 8: the units of e4m3's codes of exponent 0 (zero and
// the subnormals m 2^-9), the other words 0.
inline constexpr std::array<int16_t, 32> kFp8SmallUnits = [] {
  std::array<int16_t, 32> bits{};
  for (int m = 1; m < 8; ++m) {
    const int top = m >= 4 ? 2 : m >= 2 ? 1 : 0;  // m = 1.f 2^top
    bits[m] = static_cast<int16_t>((127 - 17 + top) << 7 | ((m << (7 - top)) & 0x7F));
  }
  return bits;
}();

// float8_e4m3fn codes sign-extended to 16-bit lanes, as the bf16 bits of their units
// (kCacheUnit), exactly. Shifted left by 4, a code's sign lands in bit 15 and its exponent
// and mantissa in bits 4-10; 112 on the exponent rebiases e4m3's 7 to bf16's 127 less the
// units' 8. Codes of exponent 0, which have no implicit leading 1, take their units from
// kFp8SmallUnits (indexed by the code's low bits, the mantissa) with their sign.
C10_ALWAYS_INLINE __m512i fp8_bf16_units(__m512i codes) {
  const __m512i small_units = _mm512_loadu_si512(kFp8SmallUnits.data());
  const __m512i shifted = _mm512_slli_epi16(codes, 4);
  const __m512i sign = _mm512_set1_epi16(static_cast<int16_t>(0x8000));
  const __m512i normal =
      _mm512_add_epi16(_mm512_and_si512(shifted, _mm512_set1_epi16(static_cast<int16_t>(0x87F0))),
                       _mm512_set1_epi16(112 << 7));
  const __mmask32 exponent_zero = _mm512_testn_epi16_mask(codes, _mm512_set1_epi16(0x78));
  // A | (B & C): the table's magnitude with the code's sign
  const __m512i small =
      _mm512_ternarylogic_epi32(_mm512_permutexvar_epi16(codes, small_units), shifted, sign, 0xF8);
  return _mm512_mask_mov_epi16(normal, exponent_zero, small);
}

// The bf16 bits of the units (kCacheUnit) of the float8_e4m3fn magnitude codes 0-127, as two
// tables of 128 bytes: low[m] and high[m], the bits' low and high byte (the code 0x7F, NaN, as
// 480: see kCacheUnit).
struct Fp8UnitByteTables {
  std::array<uint8_t, 128> low{}, high{};
};
inline constexpr Fp8UnitByteTables kFp8UnitBytes = [] {
  Fp8UnitByteTables tables;
  for (int m = 0; m < 128; ++m) {
    const int exponent = m >> 3, mantissa = m & 7;
    // exponent 0: mantissa 2^-17 (kFp8SmallUnits), else 2^(exponent - 15) (1 + mantissa / 8)
    const int bits =
        exponent == 0 ? kFp8SmallUnits[mantissa] : (exponent + 112) << 7 | mantissa << 4;
    tables.low[m] = static_cast<uint8_t>(bits & 0xFF);
    tables.high[m] = static_cast<uint8_t>(bits >> 8);
  }
  return tables;
}();

// Whether this call converts fp8 codes by byte tables (PagedKernelTraits::kFp8ByTables): at
// the avx512_bf16 level, where the CPU's VBMI paths run.
inline bool fp8_by_tables() {
  return active_cpu_isa() == CpuIsa::kAvx512Bf16 && avx512_vbmi_enabled();
}

// Byte i of the result: table[index byte i & 127], table = [table_low, table_high] (128
// bytes). VPERMI2B, AVX512-VBMI, as assembly for the reason of add_bf16_pair_dots; it runs only
// where avx512_vbmi_enabled().
C10_ALWAYS_INLINE __m512i look_up_bytes(__m512i index, __m512i table_low, __m512i table_high) {
  asm("vpermi2b %2, %1, %0" : "+v"(index) : "v"(table_low), "v"(table_high));
  return index;
}

// 64 float8_e4m3fn codes as the bf16 bits of their units (kCacheUnit), exactly, in two
// vectors, by two byte-table look-ups (kFp8UnitBytes: low bytes in table_low..., high bytes in
// table_high...) and one byte interleave per 32: `first` holds codes 16k + [0, 8) of each
// 128-bit lane k, `second` codes 16k + [8, 16) (fp8_table_order). The code's sign joins the
// high byte.
struct Fp8ByteTables {
  __m512i low_first, low_second, high_first, high_second;  // kFp8UnitBytes' halves
};
C10_ALWAYS_INLINE Fp8ByteTables load_fp8_byte_tables() {
  return {_mm512_loadu_si512(kFp8UnitBytes.low.data()),
          _mm512_loadu_si512(kFp8UnitBytes.low.data() + 64),
          _mm512_loadu_si512(kFp8UnitBytes.high.data()),
          _mm512_loadu_si512(kFp8UnitBytes.high.data() + 64)};
}
C10_ALWAYS_INLINE void fp8_bf16_units_by_tables(__m512i codes, const Fp8ByteTables& tables,
                                                __m512i& first, __m512i& second) {
  const __m512i low = look_up_bytes(codes, tables.low_first, tables.low_second);
  // A | (B & C): the magnitude's high byte with the code's sign bit
  const __m512i high =
      _mm512_ternarylogic_epi32(look_up_bytes(codes, tables.high_first, tables.high_second), codes,
                                _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);
  first = _mm512_unpacklo_epi8(low, high);
  second = _mm512_unpackhi_epi8(low, high);
}

// 64 float8_e4m3fn codes as fp32 units (kCacheUnit), exactly, in units[0, 4):
// fp8_bf16_units_by_tables' bf16 bits widened, units[j] holding codes 16k + 4j + [0, 4) in 128-bit
// lane k: the 128-bit lanes of the four vectors in natural order, transposed (transpose_lanes_4x4).
C10_ALWAYS_INLINE void fp8_float_units_by_tables(const c10::Float8_e4m3fn* codes,
                                                 const Fp8ByteTables& tables,
                                                 at::vec::Vectorized<float>* units) {
  __m512i first, second;
  fp8_bf16_units_by_tables(_mm512_loadu_si512(codes), tables, first, second);
  const __m512i zero = _mm512_setzero_si512();
  units[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, first));
  units[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, first));
  units[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, second));
  units[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, second));
}

// v[j]'s 128-bit lane k <-> v[k]'s lane j, for four vectors: its own inverse.
C10_ALWAYS_INLINE void transpose_lanes_4x4(at::vec::Vectorized<float>* v) {
  const __m512 low01 = _mm512_shuffle_f32x4(v[0], v[1], 0x44);  // lanes 0, 1 of v[0], of v[1]
  const __m512 high01 = _mm512_shuffle_f32x4(v[0], v[1], 0xEE);
  const __m512 low23 = _mm512_shuffle_f32x4(v[2], v[3], 0x44);
  const __m512 high23 = _mm512_shuffle_f32x4(v[2], v[3], 0xEE);
  v[0] = _mm512_shuffle_f32x4(low01, low23, 0x88);
  v[1] = _mm512_shuffle_f32x4(low01, low23, 0xDD);
  v[2] = _mm512_shuffle_f32x4(high01, high23, 0x88);
  v[3] = _mm512_shuffle_f32x4(high01, high23, 0xDD);
}

// Reorders each whole group of 64 elements of a bf16 row[0, dim) into the order
// fp8_bf16_units_by_tables leaves 64 codes in: elements 16k + [0, 8) for k = 0..3, then 16k + [8,
// 16). Elements past the last whole group stay in place.
inline void fp8_table_order(c10::BFloat16* row, int64_t dim) {
  for (int64_t group = 0; group + 64 <= dim; group += 64) {
    c10::BFloat16 copy[64];
    std::copy(row + group, row + group + 64, copy);
    for (int half = 0; half < 2; ++half) {
      for (int k = 0; k < 4; ++k) {
        std::copy(copy + 16 * k + 8 * half, copy + 16 * k + 8 * half + 8,
                  row + group + 32 * half + 8 * k);
      }
    }
  }
}
#endif

// The first `count` elements of an 8-bit cache row (at most a vector's worth) as fp32 units;
// lanes past count are 0.
template <typename cache_t>
C10_ALWAYS_INLINE at::vec::Vectorized<float> load_quantized_units(const cache_t* src,
                                                                  int64_t count) {
  constexpr int64_t kWidth = at::vec::Vectorized<float>::size();
  if (count < kWidth) {
    cache_t part[kWidth] = {};
    std::memcpy(part, src, count);
    return load_quantized_units(part, kWidth);
  }
#if defined(CPU_CAPABILITY_AVX512)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  if constexpr (std::is_same_v<cache_t, int8_t>) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  } else {
    return _mm512_cvtph_ps(fp8_unit_halves(_mm256_cvtepi8_epi16(bytes)));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src));
  if constexpr (std::is_same_v<cache_t, int8_t>) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  } else {
    return _mm256_cvtph_ps(fp8_unit_halves(_mm_cvtepi8_epi16(bytes)));
  }
#else
  float units[kWidth];
  for (int64_t i = 0; i < kWidth; ++i) units[i] = cached_unit<float>(src[i]);
  return at::vec::Vectorized<float>::loadu(units);
#endif
}

// load_as for cache rows: the first `count` elements (at most a vector's worth) as acc_t,
// in units (kCacheUnit) for an 8-bit cache.
template <typename acc_t, typename cache_t>
C10_ALWAYS_INLINE at::vec::Vectorized<acc_t> load_cached(const cache_t* src, int64_t count) {
  if constexpr (kQuantizedCache<cache_t>) {
    static_assert(std::is_same_v<acc_t, float>, "8-bit caches accumulate in fp32");
    return load_quantized_units(src, count);
  } else {
    return load_as<acc_t>(src, count);
  }
}

// Calls visit(location, i, in_block) for each run of positions [first, first + count) of a
// sequence that share a block: positions first + i .. first + i + in_block - 1, the first at
// `location`. The block table is looked up once per block, and only the first position is
// located by a 64-bit division (block_size is known only at run time): dividing per row, four
// times per key row with the prefetch, was a large part of decode's time per key.
template <typename Visit>
C10_ALWAYS_INLINE void for_each_block_run(const int32_t* block_table, int64_t block_size,
                                          int64_t first, int64_t count, Visit&& visit) {
  int64_t table_index = first / block_size, offset = first % block_size;
  for (int64_t i = 0; i < count; ++table_index, offset = 0) {
    const int64_t in_block = std::min(block_size - offset, count - i);
    visit(CacheSlot{block_table[table_index], offset}, i, in_block);
    i += in_block;
  }
}

// The cache rows of positions [first, first + count) of a sequence, for one kv head: rows[i]
// holds position first + i.
template <typename scalar_t>
void cache_rows(const scalar_t* cache, const CacheStrides& strides, const int32_t* block_table,
                int64_t block_size, int64_t kv_head, int64_t first, int64_t count,
                const scalar_t** rows) {
  for_each_block_run(block_table, block_size, first, count,
                     [&](CacheSlot location, int64_t i, int64_t in_block) {
                       const scalar_t* row = cache + cache_row_offset(strides, location, kv_head);
                       for (int64_t j = 0; j < in_block; ++j)
                         rows[i + j] = row + j * strides.offset;
                     });
}

// scales[i] = the int8 scale of position first + i of kv head `kv_head`, for i < count.
template <typename acc_t>
void cache_row_scales(const QuantScales& quant, const int32_t* block_table, int64_t block_size,
                      int64_t kv_head, int64_t first, int64_t count, acc_t* scales) {
  for_each_block_run(
      block_table, block_size, first, count, [&](CacheSlot location, int64_t i, int64_t in_block) {
        const float* row = quant.per_row + cache_row_offset(quant.strides, location, kv_head);
        for (int64_t j = 0; j < in_block; ++j) scales[i + j] = row[j * quant.strides.offset];
      });
}

// tile[r * ld + c] *= column_scales[c] for r < rows, c < cols.
template <typename acc_t>
void scale_columns(acc_t* tile, int64_t ld, int64_t rows, int64_t cols,
                   const acc_t* column_scales) {
  using Vec = at::vec::Vectorized<acc_t>;
  for (int64_t r = 0; r < rows; ++r) {
    at::vec::map2([](Vec x, Vec scale) { return x * scale; }, tile + r * ld, tile + r * ld,
                  column_scales, cols);
  }
}

// tile[r, c] *= row_factors[r] column_scales[c] for r < rows, c < cols.
template <typename acc_t>
void scale_rows_and_columns(acc_t* tile, int64_t ld, int64_t rows, int64_t cols,
                            const acc_t* row_factors, const acc_t* column_scales) {
  using Vec = at::vec::Vectorized<acc_t>;
  for (int64_t r = 0; r < rows; ++r) {
    const Vec factor(row_factors[r]);
    at::vec::map2([factor](Vec x, Vec scale) { return x * (factor * scale); }, tile + r * ld,
                  tile + r * ld, column_scales, cols);
  }
}

// Requests the 64-byte line holding *address into the caches.
C10_ALWAYS_INLINE void request_line(const void* address) {
#if defined(__x86_64__)
  // GCC 12 drops __builtin_prefetch from the row loops once inlined (no PREFETCH was left in
  // the kernels), so the instruction is written out.
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(address)));
#else
  __builtin_prefetch(address, 0, 2);
#endif
}

// Requests bytes [first_byte, end_byte) of a row, one 64-byte line at a time.
C10_ALWAYS_INLINE void request_bytes(const void* row, int64_t first_byte, int64_t end_byte) {
  const char* bytes = static_cast<const char*>(row);
  for (int64_t byte = first_byte; byte < end_byte; byte += 64) request_line(bytes + byte);
}

// Requests elements [first, dim) of a row.
template <typename scalar_t>
void prefetch_row(const scalar_t* row, int64_t dim, int64_t first = 0) {
  request_bytes(row, first * static_cast<int64_t>(sizeof(scalar_t)),
                dim * static_cast<int64_t>(sizeof(scalar_t)));
}

// Requests the int8 scales that cache_row_scales reads for positions [first, first + count)
// of kv head `kv_head`: each line once where a block's scales lie together (HND), each
// scale's line otherwise.
inline void request_row_scales(const QuantScales& quant, const int32_t* block_table,
                               int64_t block_size, int64_t kv_head, int64_t first, int64_t count) {
  for_each_block_run(
      block_table, block_size, first, count, [&](CacheSlot location, int64_t, int64_t in_block) {
        const float* row = quant.per_row + cache_row_offset(quant.strides, location, kv_head);
        if (quant.strides.offset == 1) {
          request_bytes(row, 0, in_block * static_cast<int64_t>(sizeof(float)));
        } else {
          for (int64_t j = 0; j < in_block; ++j) request_line(row + j * quant.strides.offset);
        }
      });
}

// One key tile of one kv head: keys [key0, key0 + cols); cols 0 marks the end of a task. A
// task's items go through its key tiles in order, and within a tile through its heads; "the
// next tile" below is the next item, the same keys of the next head where there is one.
struct WorkItem {
  int64_t key0 = 0;
  int64_t cols = 0;
  int64_t kv_head = 0;
};

// A key tile's cached rows: rows[i] for i < listed, the tile's own rows first and then up to
// kPrefetchRows rows of the next tile, which the tile's loop requests ahead of use.
template <typename scalar_t>
struct TileRows {
  static constexpr int64_t kPrefetchRows = PagedKernelTraits<scalar_t>::kPrefetchRows;
  const scalar_t* rows[kKeyBlock + kPrefetchRows];
  int64_t listed = 0;

  void prefetch(int64_t i, int64_t dim) const {
    if (i + kPrefetchRows < listed) prefetch_row(rows[i + kPrefetchRows], dim);
  }

  // The row that prefetch(i) requests; row i itself (already cached) where none is listed.
  const scalar_t* row_ahead(int64_t i) const {
    return i + kPrefetchRows < listed ? rows[i + kPrefetchRows] : rows[i];
  }
};

// Rows [0, count) of a tile copied like load_rows into dst [count, ld], an 8-bit cache's in
// units (kCacheUnit).
template <typename scalar_t, typename acc_t>
void gather_tile_rows(const TileRows<scalar_t>& tile, int64_t count, int64_t dim, acc_t* dst,
                      int64_t ld) {
  using Vec = at::vec::Vectorized<acc_t>;
  for (int64_t i = 0; i < count; ++i) {
    tile.prefetch(i, dim);
    if constexpr (kQuantizedCache<scalar_t>) {
      for (int64_t d = 0; d < dim; d += Vec::size()) {
        const int64_t lanes = std::min<int64_t>(Vec::size(), dim - d);
        load_cached<acc_t>(tile.rows[i] + d, lanes).store(dst + i * ld + d, lanes);
      }
    } else {
      load_rows(tile.rows[i], 0, 1, dim, dst + i * ld, ld);
    }
  }
}

// Rows whose lines a pass requests over `sweeps` sweeps through its keys: each sweep
// requests its share of every row's lines, row c's at key c, so that each key costs the same
// few requests and every line is asked for by the last sweep. The value pass requests the
// next tile's key rows so, a sweep per O slice and row group; the next tile never has more
// keys than this one (only a task's last key tile is short, and what follows it is the same
// tile of the next head). A running position through the lines, a few per key, spent a
// quarter of the value pass on its compares and branches (perf, fp32 32q/8kv decode from L2).
template <typename scalar_t>
struct SweepRequests {
  const scalar_t* const* rows = nullptr;
  int64_t count = 0;
  int64_t dim = 0;

  // Bytes [first, last) of each row, whole lines, that sweep `sweep` of `sweeps` requests.
  std::pair<int64_t, int64_t> share(int64_t sweep, int64_t sweeps) const {
    const int64_t lines = ceil_div(dim * static_cast<int64_t>(sizeof(scalar_t)), int64_t(64));
    return {sweep * lines / sweeps * 64, (sweep + 1) * lines / sweeps * 64};
  }
};

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// src[0, 2 * vector width) as fp32, the even elements in `even` and the odd ones in `odd`
// (even_bf16_elements).
C10_ALWAYS_INLINE void widen_bf16_pairs(const c10::BFloat16* src, at::vec::Vectorized<float>& even,
                                        at::vec::Vectorized<float>& odd) {
  const Bf16Pairs pairs = load_bf16_pairs(src);
  even = even_bf16_elements(pairs);
  odd = odd_bf16_elements(pairs);
}
#endif

// Reorders each whole group of two vectors' elements (kGroup) of row[0, dim) from natural
// order to the order widen_bf16_pairs gives (the group's even elements, then its odd ones) or,
// with to_pairs false, back. Elements past the last whole group stay in place. Once per tile
// row and task.
template <typename acc_t>
void reorder_pair_groups(acc_t* row, int64_t dim, bool to_pairs) {
  constexpr int64_t kGroup = 2 * at::vec::Vectorized<acc_t>::size();
  for (int64_t group = 0; group + kGroup <= dim; group += kGroup) {
    acc_t copy[kGroup];
    std::copy(row + group, row + group + kGroup, copy);
    for (int64_t i = 0; i < kGroup / 2; ++i) {
      if (to_pairs) {
        row[group + i] = copy[2 * i];
        row[group + kGroup / 2 + i] = copy[2 * i + 1];
      } else {
        row[group + 2 * i] = copy[i];
        row[group + 2 * i + 1] = copy[kGroup / 2 + i];
      }
    }
  }
}

// src[0, 2 * vector width) as two fp32 vectors, first and second, for a two-vector step: in
// natural order (in units for an fp8 cache), or in widen_bf16_pairs' order where
// PagedKernelTraits::kWidenInPairs.
template <typename scalar_t, typename acc_t>
C10_ALWAYS_INLINE void load_two_vectors(const scalar_t* src, at::vec::Vectorized<acc_t>& first,
                                        at::vec::Vectorized<acc_t>& second) {
  constexpr int64_t kWidth = at::vec::Vectorized<acc_t>::size();
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (PagedKernelTraits<scalar_t>::kWidenInPairs) {
    widen_bf16_pairs(src, first, second);
    return;
  }
#endif
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (PagedKernelTraits<scalar_t>::kConvertFp8InPairs) {
    const __m512i halves = fp8_unit_halves(
        _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src))));
    first = _mm512_cvtph_ps(_mm512_castsi512_si256(halves));
    second = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(halves, 1));
    return;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (PagedKernelTraits<scalar_t>::kConvertFp8InPairs) {
    const __m256i halves = fp8_unit_halves(
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src))));
    first = _mm256_cvtph_ps(_mm256_castsi256_si128(halves));
    second = _mm256_cvtph_ps(_mm256_extracti128_si256(halves, 1));
    return;
  }
#endif
  first = load_cached<acc_t>(src, kWidth);
  second = load_cached<acc_t>(src + kWidth, kWidth);
}

#if defined(CPU_CAPABILITY_AVX512)
// acc + the dot products of a's and b's bf16 pairs, one per fp32 lane (VDPBF16PS: exact
// products, fp32 sums). Written as assembly so that this translation unit, which also runs
// on AVX-512 CPUs without BF16, needs no target attribute; it runs only at the avx512_bf16
// level.
C10_ALWAYS_INLINE __m512 add_bf16_pair_dots(__m512 acc, __m512i a, __m512i b) {
  asm("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// acc + the dot products of a's and b's int16 pairs, one per int32 lane (VPDPWSSD, wrapping;
// kInt16Dots' int16 q rows and int8 keys sum to at most 2^23 per pair, under 2^31 over the
// op's largest head_dim, 256). Assembly for the same reason; it runs only where
// avx512_vnni_enabled().
C10_ALWAYS_INLINE __m512i add_int16_pair_dots(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpwssd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// The mask of a mask_t's lanes [0, n): all of them for n >= its width, none for n <= 0.
template <typename mask_t>
C10_ALWAYS_INLINE mask_t lanes_below(int64_t n) {
  constexpr int64_t kLanes = 8 * sizeof(mask_t);
  if (n >= kLanes) return static_cast<mask_t>(~uint64_t(0));
  return n <= 0 ? mask_t(0) : static_cast<mask_t>((uint64_t(1) << n) - 1);
}
#elif defined(CPU_CAPABILITY_AVX2)
// AVX-512's add_int16_pair_dots for AVX2 CPUs, which have no VNNI: VPMADDWD, then VPADDD.
// Within the same bounds the pair sums fit their int32 lanes (VPMADDWD wraps only for two
// pairs of -32768, which kInt16Dots' q rows and P rows never hold).
C10_ALWAYS_INLINE __m256i add_int16_pair_dots(__m256i acc, __m256i a, __m256i b) {
  return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
}
#endif

// What a one-key score step requests while it walks its key row: nothing, the value row of
// the key being scored, or that and the key row kPrefetchRows ahead (dim elements).
enum class ScoreLoopRequests { kNone, kValue, kKeyAheadAndValue };

template <typename scalar_t>
struct RowRequests {
  const scalar_t* key_ahead;
  const scalar_t* value;
  int64_t value_dim;
};

// scores[r * ld_s + j] = scale x the horizontal sum of acc[j * kRows + r] for r < kRows,
// j < kKeys; acc: vectors of acc_t, or on AVX-512 of int32 (kInt16Dots).
// On AVX-512, 16 sums reduce together into one vector (transposed_sums16), permuted so that
// each row's kKeys sums lie together and stored a row at a time.
template <int kRows, int kKeys, typename vec_t, typename acc_t>
C10_ALWAYS_INLINE void store_dot_products(const vec_t (&acc)[kKeys * kRows], acc_t scale,
                                          acc_t* scores, int64_t ld_s) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<vec_t, __m512i> && kRows * kKeys != 16) {
    at::vec::Vectorized<float> sums[kKeys * kRows];
    unrolled<kKeys * kRows>(
        [&](auto i) C10_ALWAYS_INLINE_ATTRIBUTE { sums[i] = _mm512_cvtepi32_ps(acc[i]); });
    return store_dot_products<kRows, kKeys>(sums, scale, scores, ld_s);
  }
  if constexpr (std::is_same_v<acc_t, float> && kRows * kKeys == 16) {
    __m512 sums = _mm512_mul_ps(transposed_sums16(acc), _mm512_set1_ps(scale));
    if constexpr (kRows != 4) {  // with 4 rows the transpose leaves row r's 4 sums in lane r
      // Element r * kKeys + j takes the sum of acc[i], i = j * kRows + r, at 4 (i % 4) + i / 4.
      static constexpr auto kOrder = [] {
        std::array<int, 16> order{};
        for (int r = 0; r < kRows; ++r) {
          for (int j = 0; j < kKeys; ++j)
            order[r * kKeys + j] = 4 * ((j * kRows + r) % 4) + (j * kRows + r) / 4;
        }
        return order;
      }();
      sums = _mm512_permutexvar_ps(_mm512_loadu_si512(kOrder.data()), sums);
    }
    unrolled<kRows>([&](auto r) C10_ALWAYS_INLINE_ATTRIBUTE {
      float* row = scores + r * ld_s;
      if constexpr (kKeys == 16) {
        _mm512_storeu_ps(row, sums);
      } else if constexpr (kKeys == 8) {
        _mm256_storeu_ps(row, _mm512_extractf32x8_ps(sums, r));
      } else if constexpr (kKeys == 4) {
        _mm_storeu_ps(row, _mm512_extractf32x4_ps(sums, r));
      } else {
        static_assert(kKeys == 2, "16 sums as kRows rows of kKeys");
        const __m128 lane = _mm512_extractf32x4_ps(sums, r / 2);
        if constexpr (r % 2 == 0) {
          _mm_storel_pi(reinterpret_cast<__m64*>(row), lane);
        } else {
          _mm_storeh_pi(reinterpret_cast<__m64*>(row), lane);
        }
      }
    });
    return;
  }
#endif
  if constexpr (std::is_same_v<vec_t, at::vec::Vectorized<acc_t>>) {
    acc_t sums[kKeys * kRows];
    horizontal_sums(acc, sums);
    for (int j = 0; j < kKeys; ++j) {
      for (int r = 0; r < kRows; ++r) scores[r * ld_s + j] = scale * sums[j * kRows + r];
    }
  }
}

// scores[r * ld_s + j] = q[r] . keys[j] for r < kRows, j < kKeys: each vector of a cached key
// is loaded and converted once for all rows. kRequests: which of `requests`' rows it requests.
template <int kRows, int kKeys, ScoreLoopRequests kRequests, typename q_t, typename scalar_t,
          typename acc_t>
C10_ALWAYS_INLINE void score_keys(const q_t* q, int64_t ld_q, const scalar_t* const* keys,
                                  int64_t dim, acc_t scale, acc_t* scores, int64_t ld_s,
                                  const RowRequests<scalar_t>& requests) {
  using Traits = PagedKernelTraits<scalar_t>;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (!std::is_same_v<q_t, acc_t>) {
    // Dot products of pairs, one instruction for 32 elements of a row: int16 q and int8 keys
    // (kInt16Dots) into int32 lanes, or bf16 q and bf16 keys (kScoreByBf16Dots) or fp8 keys
    // as bf16 units (kScoreFp8ByBf16Dots) into fp32 lanes.
    constexpr bool kInt16 = std::is_same_v<q_t, int16_t>;
    constexpr bool kFp8 = Traits::kScoreFp8ByBf16Dots;
    static_assert(kRequests == ScoreLoopRequests::kNone &&
                      (kInt16 ? Traits::kInt16Dots : Traits::kScoreByBf16Dots || kFp8),
                  "pair dot products");
    using Sums = std::conditional_t<kInt16, __m512i, at::vec::Vectorized<float>>;
    Sums acc[kKeys * kRows];  // acc[j * kRows + r]: part of q[r] . keys[j]
    unrolled<kKeys * kRows>([&](auto i) C10_ALWAYS_INLINE_ATTRIBUTE {
      if constexpr (kInt16) {
        acc[i] = _mm512_setzero_si512();
      } else {
        acc[i] = _mm512_setzero_ps();
      }
    });
    // 32 elements from d on, the lanes outside `lanes` zero (and not read).
    auto step = [&](int64_t d, __mmask32 lanes) C10_ALWAYS_INLINE_ATTRIBUTE {
      __m512i k[kKeys];
      unrolled<kKeys>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
        if constexpr (kInt16) {
          k[j] = _mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(lanes, keys[j] + d));
        } else if constexpr (kFp8) {
          k[j] = fp8_bf16_units(_mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(lanes, keys[j] + d)));
        } else {
          k[j] = _mm512_maskz_loadu_epi16(lanes, keys[j] + d);
        }
      });
      unrolled<kRows>([&](auto r) C10_ALWAYS_INLINE_ATTRIBUTE {
        const __m512i q_r = _mm512_maskz_loadu_epi16(lanes, q + r * ld_q + d);
        unrolled<kKeys>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
          if constexpr (kInt16) {
            acc[j * kRows + r] = add_int16_pair_dots(acc[j * kRows + r], q_r, k[j]);
          } else {
            acc[j * kRows + r] = add_bf16_pair_dots(acc[j * kRows + r], q_r, k[j]);
          }
        });
      });
    };
    int64_t d = 0;
    for (; d + 32 <= dim; d += 32) step(d, ~__mmask32(0));
    if (d < dim) step(d, lanes_below<__mmask32>(dim - d));
    store_dot_products<kRows, kKeys>(acc, scale, scores, ld_s);
    return;
  }
#elif defined(CPU_CAPABILITY_AVX2)
  if constexpr (std::is_same_v<q_t, int16_t>) {
    // int16 q and int8 keys (kInt16Dots), 16 elements of a row per step into int32 lanes; the
    // elements past the last whole 16 in scalars, as the FMA path's.
    static_assert(kRequests == ScoreLoopRequests::kNone && Traits::kInt16Dots, "pair dot products");
    __m256i acc[kKeys * kRows];  // acc[j * kRows + r]: part of q[r] . keys[j]
    unrolled<kKeys * kRows>([&](auto i)
                                C10_ALWAYS_INLINE_ATTRIBUTE { acc[i] = _mm256_setzero_si256(); });
    int64_t d = 0;
    for (; d + 16 <= dim; d += 16) {
      __m256i k[kKeys];
      unrolled<kKeys>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
        k[j] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(keys[j] + d)));
      });
      unrolled<kRows>([&](auto r) C10_ALWAYS_INLINE_ATTRIBUTE {
        const __m256i q_r = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + r * ld_q + d));
        unrolled<kKeys>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
          acc[j * kRows + r] = add_int16_pair_dots(acc[j * kRows + r], q_r, k[j]);
        });
      });
    }
    at::vec::Vectorized<float> sums[kKeys * kRows];
    unrolled<kKeys * kRows>(
        [&](auto i) C10_ALWAYS_INLINE_ATTRIBUTE { sums[i] = _mm256_cvtepi32_ps(acc[i]); });
    store_dot_products<kRows, kKeys>(sums, scale, scores, ld_s);
    for (; d < dim; ++d) {
      for (int j = 0; j < kKeys; ++j) {
        for (int r = 0; r < kRows; ++r)
          scores[r * ld_s + j] += scale * static_cast<acc_t>(q[r * ld_q + d] * keys[j][d]);
      }
    }
    return;
  }
#endif
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t kWidth = Vec::size();
  constexpr int kStepVectors = Traits::score_step_vectors(kRows, kKeys);
  // Each vector's loads come before its FMAs, row by row alternating chains: chain by chain,
  // the same plan read 15.2 against 16.5 GB/s (Zen 1, 32q/8kv fp32 decode from memory).
  constexpr int kChains = Traits::score_chains(kRows, kKeys, kStepVectors);
  Vec acc[kChains][kKeys * kRows];  // acc[chain][j * kRows + r]: part of q[r] . keys[j]
  unrolled<kChains * kKeys * kRows>([&](auto i) C10_ALWAYS_INLINE_ATTRIBUTE {
    acc[i / (kKeys * kRows)][i % (kKeys * kRows)] = Vec(acc_t(0));
  });
  auto request_lines = [&](int64_t d) C10_ALWAYS_INLINE_ATTRIBUTE {
    if constexpr (kRequests != ScoreLoopRequests::kNone) {
      if (d * static_cast<int64_t>(sizeof(scalar_t)) % 64 == 0) {
        if constexpr (kRequests == ScoreLoopRequests::kKeyAheadAndValue)
          request_line(requests.key_ahead + d);
        if (d < requests.value_dim) request_line(requests.value + d);
      }
    }
  };
  // `vectors` vectors from d on (kStepVectors, or one in natural order), vector v into chain
  // v % kChains.
  auto step = [&](int64_t d, auto vectors) C10_ALWAYS_INLINE_ATTRIBUTE {
    Vec k[vectors][kKeys];
    if constexpr (vectors == 2) {
      unrolled<kKeys>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
        load_two_vectors(keys[j] + d, k[0][j], k[1][j]);
      });
    } else {
      unrolled<kKeys>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
        k[0][j] = load_cached<acc_t>(keys[j] + d, kWidth);
      });
    }
    unrolled<kRows>([&](auto r) C10_ALWAYS_INLINE_ATTRIBUTE {
      unrolled<vectors>([&](auto v) C10_ALWAYS_INLINE_ATTRIBUTE {
        // One load of q's vector for the kKeys keys: given it as an FMA operand, GCC loads
        // it again for each key, and the loads outnumber the FMAs. With one key, the load
        // folded into the FMA is the same load in fewer instructions: on Zen 1 bf16 decode
        // ran 4-18% faster so (32q/8kv and llama2-70b heads), fp32 within the noise.
        Vec q_r = Vec::loadu(q + r * ld_q + d + v * kWidth);
        if constexpr (kKeys > 1) keep_in_register(q_r);
        constexpr int chain = v % kChains;
        unrolled<kKeys>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
          acc[chain][j * kRows + r] = at::vec::fmadd(q_r, k[v][j], acc[chain][j * kRows + r]);
        });
      });
    });
  };
  // Whole steps; the loops over rows and keys are written out (unrolled) so that acc lives
  // in registers.
  int64_t d = 0;
  for (; d + kStepVectors * kWidth <= dim; d += kStepVectors * kWidth) {
    request_lines(d);
    step(d, std::integral_constant<int, kStepVectors>{});
  }
  if constexpr (kStepVectors > 1) {
    for (; d + kWidth <= dim; d += kWidth) {
      request_lines(d);
      step(d, std::integral_constant<int, 1>{});
    }
  }
  if constexpr (kChains > 1) {
    unrolled<kKeys * kRows>([&](auto i)
                                C10_ALWAYS_INLINE_ATTRIBUTE { acc[0][i] = acc[0][i] + acc[1][i]; });
  }
  if constexpr (kRequests != ScoreLoopRequests::kNone) {  // the lines the loop did not reach
    const int64_t next = round_up(d * static_cast<int64_t>(sizeof(scalar_t)), int64_t(64)) /
                         static_cast<int64_t>(sizeof(scalar_t));
    if constexpr (kRequests == ScoreLoopRequests::kKeyAheadAndValue)
      prefetch_row(requests.key_ahead, dim, next);
    prefetch_row(requests.value, requests.value_dim, next);
  }
  store_dot_products<kRows, kKeys>(acc[0], acc_t(1), scores, ld_s);
  // The ragged end in scalars: as masked vectors, GCC kept acc on the stack (zeroed and
  // stored for every key) to share it between the two loops.
  for (; d < dim; ++d) {
    for (int j = 0; j < kKeys; ++j) {
      for (int r = 0; r < kRows; ++r)
        scores[r * ld_s + j] += q[r * ld_q + d] * cached_unit<acc_t>(keys[j][d]);
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// score_keys for an fp8 cache and a bf16 q (kScoreFp8ByBf16Dots) where fp8_by_tables():
// each whole 64 codes of a key converted by byte tables (fp8_bf16_units_by_tables), with q's
// rows in fp8_table_order, the rest of the row (under 64 elements) as score_keys converts it, q
// there in natural order. Keys are converted 4 at a time, whose two vectors each, the tables
// and the accumulators of 4 rows fit the registers. The same products as score_keys' (each
// exact in fp32), summed in another order.
template <int kRows, int kKeys>
C10_ALWAYS_INLINE void score_fp8_keys_by_tables(const c10::BFloat16* q, int64_t ld_q,
                                                const c10::Float8_e4m3fn* const* keys, int64_t dim,
                                                float scale, float* scores, int64_t ld_s) {
  constexpr int kGroupKeys = std::min(kKeys, 4);
  static_assert(kKeys % kGroupKeys == 0, "whole groups of keys");
  at::vec::Vectorized<float> acc[kKeys * kRows];  // acc[j * kRows + r]: part of q[r] . keys[j]
  unrolled<kKeys * kRows>(
      [&](auto i) C10_ALWAYS_INLINE_ATTRIBUTE { acc[i] = at::vec::Vectorized<float>(0.f); });
  auto add_dots = [&](int j, int r, __m512i q_part, __m512i k_part) C10_ALWAYS_INLINE_ATTRIBUTE {
    acc[j * kRows + r] = add_bf16_pair_dots(acc[j * kRows + r], q_part, k_part);
  };
  const Fp8ByteTables tables = load_fp8_byte_tables();
  int64_t d = 0;
  for (; d + 64 <= dim; d += 64) {
    unrolled<kKeys / kGroupKeys>([&](auto group) C10_ALWAYS_INLINE_ATTRIBUTE {
      __m512i first[kGroupKeys], second[kGroupKeys];
      unrolled<kGroupKeys>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
        fp8_bf16_units_by_tables(_mm512_loadu_si512(keys[group * kGroupKeys + j] + d), tables,
                                 first[j], second[j]);
      });
      unrolled<kRows>([&](auto r) C10_ALWAYS_INLINE_ATTRIBUTE {
        const __m512i q_first = _mm512_loadu_si512(q + r * ld_q + d);
        const __m512i q_second = _mm512_loadu_si512(q + r * ld_q + d + 32);
        unrolled<kGroupKeys>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
          add_dots(group * kGroupKeys + j, r, q_first, first[j]);
          add_dots(group * kGroupKeys + j, r, q_second, second[j]);
        });
      });
    });
  }
  for (; d < dim; d += 32) {
    const __mmask32 lanes = lanes_below<__mmask32>(dim - d);
    __m512i k[kKeys];
    unrolled<kKeys>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
      k[j] = fp8_bf16_units(_mm512_cvtepi8_epi16(_mm256_maskz_loadu_epi8(lanes, keys[j] + d)));
    });
    unrolled<kRows>([&](auto r) C10_ALWAYS_INLINE_ATTRIBUTE {
      const __m512i q_r = _mm512_maskz_loadu_epi16(lanes, q + r * ld_q + d);
      unrolled<kKeys>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE { add_dots(j, r, q_r, k[j]); });
    });
  }
  store_dot_products<kRows, kKeys>(acc, scale, scores, ld_s);
}
#endif

// S[r, c] = scale q[r] . k_c for r < kRows and the tile's keys c < cols (s_tile [kRows, ld_s]),
// the keys read in place; q is fp32 (pre-scaled, scale 1) or, for kScoreByBf16Dots, bf16. Value
// row value_rows[c] (c < values_listed) is requested as key c is scored: the tile's own (below)
// or the next tile's (kValuesRequestedTileAhead). Its own so that the rest of the score pass
// lies between the request and the value pass's read: requested kPrefetchRows rows ahead within
// the value pass, whose slices go through a row in a few cycles, the requests came too late and
// half of decode's samples (perf) sat on value loads. Key rows kPrefetchRows ahead are requested
// here too, unless the value pass requests them (value_pass_requests_keys). All rows are scored
// at once, each key read once: on AVX2 up to 8 rows' accumulators (one chain each) fit the
// registers. Measured on Zen 1 against 8 fp32 rows scored as two groups of 4, each reading the
// keys (the kernel called directly, 8 sequences x context 4096, medians of 5 rounds alternating
// the builds): 64q/8kv decode on one core 5.67 -> 6.17 GB/s from cache and 5.27 -> 5.73 from
// memory, on two 10.4 -> 11.0; 5-7 rows (40-56 query heads over 8 kv heads) 5-9% faster from
// cache. `score` is inlined by force: in the extension GCC left it out of line for 3 to 8 rows,
// a call per key (it did inline it in a standalone build of the kernel), and 64q/8kv through the
// op read 7.1-7.6 GB/s so against 9.8-11.0 inlined.
template <int kRows, bool kFp8Tables = false, typename q_t, typename scalar_t, typename acc_t>
void score_tile(const q_t* q, int64_t ld_q, acc_t scale, const TileRows<scalar_t>& keys,
                const scalar_t* const* value_rows, int64_t values_listed, int64_t cols, int64_t dim,
                int64_t dim_v, acc_t* s_tile, int64_t ld_s) {
  using Traits = PagedKernelTraits<scalar_t>;
  auto score = [&](auto kKeys, int64_t c) C10_ALWAYS_INLINE_ATTRIBUTE {
    constexpr bool kInLoop = Traits::request_rows_in_score_loop(kKeys);
    constexpr bool kKeysAhead = !Traits::value_pass_requests_keys(kRows);
    constexpr ScoreLoopRequests kRequests = !kInLoop     ? ScoreLoopRequests::kNone
                                            : kKeysAhead ? ScoreLoopRequests::kKeyAheadAndValue
                                                         : ScoreLoopRequests::kValue;
    RowRequests<scalar_t> requests{};
    if constexpr (kInLoop) {
      requests = {keys.row_ahead(c), value_rows[c], dim_v};
    } else {
      for (int j = 0; j < kKeys; ++j) {
        if constexpr (kKeysAhead) keys.prefetch(c + j, dim);
        if (c + j < values_listed) prefetch_row(value_rows[c + j], dim_v);
      }
    }
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (kFp8Tables) {
      return score_fp8_keys_by_tables<kRows, kKeys>(q, ld_q, keys.rows + c, dim, scale, s_tile + c,
                                                    ld_s);
    }
#endif
    score_keys<kRows, kKeys, kRequests>(q, ld_q, keys.rows + c, dim, scale, s_tile + c, ld_s,
                                        requests);
  };
  constexpr int kKeys = Traits::keys_per_step(kRows, std::is_same_v<q_t, int16_t>);
  int64_t c = 0;
  for (; c + kKeys <= cols; c += kKeys) score(std::integral_constant<int, kKeys>{}, c);
  for (; c < cols; ++c) score(std::integral_constant<int, 1>{}, c);
}

// O[r] += sum over c < cols of P[r, c] v_c for r < kRows (P's rows kKeyBlock apart), on O's
// columns [d0, d0 + kVectors vectors): O's slice stays in registers while the tile's values
// pass by. kFull: the slice lies inside dim; otherwise its vectors are cut at dim (lanes past
// it read and add 0). Full slices are their own instantiation so that their loads carry no
// lane-count checks (GCC kept a compare and branch per load in the loop over keys).
// kRequestAhead: at key c, bytes `share` of ahead's row c.
//
// P's fixed row stride lets every weight's load address P from one register. With a run-time
// stride each row took a pointer of its own, which for 8 rows GCC kept in vector registers and
// moved back before every load: llama2-70b's heads (64q/8kv, bf16, context 4096, batch 8)
// decoded at 54-59% of the streaming read against 61-63% now (Xeon model 207, three
// alternating runs of the suite: python -m mha_ext.bench --suite paged_decode --context 4096
// --dtype bfloat16 --models llama2-70b --kv-cache-dtype).
template <int kRows, int kVectors, bool kFull, bool kRequestAhead, bool kFp8Tables = false,
          typename scalar_t, typename acc_t>
C10_ALWAYS_INLINE void accumulate_value_slice(const acc_t* p_tile,
                                              const scalar_t* const* value_rows, int64_t cols,
                                              int64_t dim, int64_t d0, acc_t* o, int64_t ld_o,
                                              const SweepRequests<scalar_t>& ahead,
                                              std::pair<int64_t, int64_t> share) {
  using Vec = at::vec::Vectorized<acc_t>;
  constexpr int64_t kWidth = Vec::size();
  int64_t width[kVectors];  // valid lanes of each vector of the slice (0 past dim)
  for (int j = 0; j < kVectors; ++j)
    width[j] = kFull ? kWidth : std::clamp<int64_t>(dim - d0 - j * kWidth, 0, kWidth);
  Vec acc[kRows * kVectors];  // acc[r * kVectors + j]
  unrolled<kRows * kVectors>([&](auto i) C10_ALWAYS_INLINE_ATTRIBUTE {
    constexpr int r = i / kVectors, j = i % kVectors;
    acc[i] = Vec::loadu(o + r * ld_o + d0 + j * kWidth, width[j]);
  });
#if defined(CPU_CAPABILITY_AVX512)
  // kFp8Tables: the codes converted by fp8_float_units_by_tables, 64 at a time, and O's
  // slice kept in their order while it is in registers.
  static_assert(!kFp8Tables || (kFull && kVectors % 4 == 0), "whole groups of 64 codes");
  [[maybe_unused]] Fp8ByteTables tables;
  if constexpr (kFp8Tables) {
    tables = load_fp8_byte_tables();
    unrolled<kRows * kVectors / 4>(
        [&](auto g) C10_ALWAYS_INLINE_ATTRIBUTE { transpose_lanes_4x4(acc + 4 * g); });
  }
#endif
  for (int64_t c = 0; c < cols; ++c) {
    if constexpr (kRequestAhead) {
      if (c < ahead.count) request_bytes(ahead.rows[c], share.first, share.second);
    }
    Vec v[kVectors];
    if constexpr (kFp8Tables) {
#if defined(CPU_CAPABILITY_AVX512)
      unrolled<kVectors / 4>([&](auto g) C10_ALWAYS_INLINE_ATTRIBUTE {
        fp8_float_units_by_tables(value_rows[c] + d0 + 64 * g, tables, v + 4 * g);
      });
#endif
    } else if constexpr (PagedKernelTraits<scalar_t>::kWidenInPairs ||
                         PagedKernelTraits<scalar_t>::kConvertFp8InPairs) {
      static_assert(kVectors % 2 == 0, "pairs of vectors");
      unrolled<kVectors / 2>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
        const scalar_t* pair = value_rows[c] + d0 + 2 * j * kWidth;
        if (kFull || width[2 * j + 1] == kWidth) {  // a whole pair group (bf16: in O's order)
          load_two_vectors(pair, v[2 * j], v[2 * j + 1]);
        } else {
          v[2 * j] = load_cached<acc_t>(pair, width[2 * j]);
          v[2 * j + 1] = load_cached<acc_t>(pair + kWidth, width[2 * j + 1]);
        }
      });
    } else {
      unrolled<kVectors>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
        v[j] = load_cached<acc_t>(value_rows[c] + d0 + j * kWidth, width[j]);
      });
    }
    unrolled<kRows>([&](auto r) C10_ALWAYS_INLINE_ATTRIBUTE {
      const Vec weight(p_tile[r * kKeyBlock + c]);
      unrolled<kVectors>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
        acc[r * kVectors + j] = at::vec::fmadd(weight, v[j], acc[r * kVectors + j]);
      });
    });
  }
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (kFp8Tables) {  // back to O's order
    unrolled<kRows * kVectors / 4>(
        [&](auto g) C10_ALWAYS_INLINE_ATTRIBUTE { transpose_lanes_4x4(acc + 4 * g); });
  }
#endif
  unrolled<kRows * kVectors>([&](auto i) C10_ALWAYS_INLINE_ATTRIBUTE {
    constexpr int r = i / kVectors, j = i % kVectors;
    acc[i].store(o + r * ld_o + d0 + j * kWidth, width[j]);
  });
}

// The pairwise value passes' walk (int16, fp8 by bf16 pairs) over a tile's keys in pairs:
// add_keys(c, value_rows[c], value_rows[c + 1]) for c = 0, 2, ..., and an odd last key with nullptr
// for its partner (whose weight is then 0). With kRequestAhead, bytes `share` of ahead's rows c and
// c + 1 are requested first.
template <bool kRequestAhead, typename scalar_t, typename AddKeys>
C10_ALWAYS_INLINE void for_each_key_pair(const scalar_t* const* value_rows, int64_t cols,
                                         const SweepRequests<scalar_t>& ahead,
                                         std::pair<int64_t, int64_t> share, AddKeys&& add_keys) {
  int64_t c = 0;
  for (; c + 2 <= cols; c += 2) {
    if constexpr (kRequestAhead) {
      if (c < ahead.count) request_bytes(ahead.rows[c], share.first, share.second);
      if (c + 1 < ahead.count) request_bytes(ahead.rows[c + 1], share.first, share.second);
    }
    add_keys(c, value_rows[c], value_rows[c + 1]);
  }
  if (c < cols) {  // an odd last key: its pair's second weight is 0
    if constexpr (kRequestAhead) {
      if (c < ahead.count) request_bytes(ahead.rows[c], share.first, share.second);
    }
    add_keys(c, value_rows[c], nullptr);
  }
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// The products of one key pair in the pairwise value passes: acc[r * kVectors + j] =
// add_dots(acc[r * kVectors + j], pairs[j], weights of row r) for r < kRows, the weights
// P[r, c] and P[r, c + 1] (16-bit, p_rows [kRows, kKeyBlock]) broadcast as one word to every
// 32-bit lane of pair_t (__m512i on AVX-512, __m256i on AVX2).
template <int kRows, int kVectors, typename acc_t, typename pair_t, typename weight_t,
          typename AddDots>
C10_ALWAYS_INLINE void add_key_pair_products(acc_t* acc, const pair_t (&pairs)[kVectors],
                                             const weight_t* p_rows, int64_t c,
                                             AddDots&& add_dots) {
  static_assert(sizeof(weight_t) == 2, "two weights to a 32-bit word");
  unrolled<kRows>([&](auto r) C10_ALWAYS_INLINE_ATTRIBUTE {
    int32_t word;  // P[r, c] and P[r, c + 1]
    std::memcpy(&word, p_rows + r * kKeyBlock + c, sizeof(word));
#if defined(CPU_CAPABILITY_AVX512)
    const pair_t weights = _mm512_set1_epi32(word);
#else
    const pair_t weights = _mm256_set1_epi32(word);
#endif
    unrolled<kVectors>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
      acc[r * kVectors + j] = add_dots(acc[r * kVectors + j], pairs[j], weights);
    });
  });
}
#endif

#if defined(CPU_CAPABILITY_AVX512)
// P's rows (s_tile [rows, kKeyBlock]) rounded to bf16, nearest even (p_bf16 [rows, kKeyBlock]),
// for the value passes by bf16 pairs: each row's [0, cols) and, for an odd cols, a zero after
// them, the odd last key's partner weight.
inline void round_probabilities_to_bf16(const float* s_tile, int64_t rows, int64_t cols,
                                        c10::BFloat16* p_bf16) {
  for (int64_t r = 0; r < rows; ++r) {
    round_to_bf16(s_tile + r * kKeyBlock, p_bf16 + r * kKeyBlock, cols);
    if (cols % 2 != 0) p_bf16[r * kKeyBlock + cols] = c10::BFloat16(0.f);
  }
}

// (x, y) -> (x's 128-bit lanes 0, y's 0, x's 2, y's 2; x's 1, y's 1, x's 3, y's 3): its own
// inverse.
C10_ALWAYS_INLINE void interleave_lanes_2x2(at::vec::Vectorized<float>& x,
                                            at::vec::Vectorized<float>& y) {
  const __m512 even = _mm512_shuffle_f32x4(x, y, 0x88);  // x0 x2 y0 y2
  const __m512 odd = _mm512_shuffle_f32x4(x, y, 0xDD);   // x1 x3 y1 y3
  x = _mm512_shuffle_f32x4(even, even, 0xD8);
  y = _mm512_shuffle_f32x4(odd, odd, 0xD8);
}

// accumulate_value_slice for an fp8 cache whose scores took bf16 dots (kFp8TablePairs): O[r] +=
// sum over c < cols of P_bf16[r, c] v_c on O's columns [d0, d0 + 16 kVectors), by VDPBF16PS
// over pairs of keys. A pair's two rows of codes are interleaved byte by byte (two unpacks)
// before the byte tables convert them (fp8_bf16_units_by_tables), so that each fp32 lane, one
// column, takes P[r, c] v_c[d] + P[r, c + 1] v_c+1[d] from one broadcast word of P's row: half
// the multiplies of the fp32 FMAs over the units, each product exact, with P in bf16 as GPU
// FlashAttention's P V product takes it. The columns come out of order, which O's slice takes
// while in registers: with 4 vectors (64 columns), vector j's 128-bit lane k holds columns
// 16k + 4j + [0, 4) (fp8_float_units_by_tables' order); with 2 (32 columns, for 6 to 8 rows,
// whose accumulators leave room for no more), the codes go through the tables as two 256-bit
// unpacks side by side and vector j's lane k holds columns (0, 16, 8, 24)[k] + 4j + [0, 4)
// (interleave_lanes_2x2). kRequestAhead: at keys c, c + 1, bytes `share` of ahead's rows.
template <int kRows, int kVectors, bool kRequestAhead>
C10_ALWAYS_INLINE void accumulate_value_slice_fp8_pairs(
    const c10::BFloat16* p_bf16, const c10::Float8_e4m3fn* const* value_rows, int64_t cols,
    int64_t d0, float* o, int64_t ld_o, const SweepRequests<c10::Float8_e4m3fn>& ahead,
    std::pair<int64_t, int64_t> share) {
  static_assert(kVectors == 4 || kVectors == 2, "slices of 64 or 32 columns");
  using Vec = at::vec::Vectorized<float>;
  auto reorder = [](Vec* slice) C10_ALWAYS_INLINE_ATTRIBUTE {  // O's order <-> the pairs'
    if constexpr (kVectors == 4) {
      transpose_lanes_4x4(slice);
    } else {
      interleave_lanes_2x2(slice[0], slice[1]);
    }
  };
  Vec acc[kRows * kVectors];  // acc[r * kVectors + j]
  unrolled<kRows>([&](auto r) C10_ALWAYS_INLINE_ATTRIBUTE {
    unrolled<kVectors>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
      acc[r * kVectors + j] = Vec::loadu(o + r * ld_o + d0 + 16 * j);
    });
    reorder(acc + kVectors * r);
  });
  const Fp8ByteTables tables = load_fp8_byte_tables();
  auto add_keys = [&](int64_t c, const c10::Float8_e4m3fn* first,
                      const c10::Float8_e4m3fn* second) C10_ALWAYS_INLINE_ATTRIBUTE {
    __m512i pairs[kVectors];
    if constexpr (kVectors == 4) {
      const __m512i a = _mm512_loadu_si512(first + d0);
      const __m512i b =
          second == nullptr ? _mm512_setzero_si512() : _mm512_loadu_si512(second + d0);
      fp8_bf16_units_by_tables(_mm512_unpacklo_epi8(a, b), tables, pairs[0], pairs[1]);
      fp8_bf16_units_by_tables(_mm512_unpackhi_epi8(a, b), tables, pairs[2], pairs[3]);
    } else {
      const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + d0));
      const __m256i b = second == nullptr
                            ? _mm256_setzero_si256()
                            : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second + d0));
      const __m512i codes = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_unpacklo_epi8(a, b)),
                                               _mm256_unpackhi_epi8(a, b), 1);
      fp8_bf16_units_by_tables(codes, tables, pairs[0], pairs[1]);
    }
    add_key_pair_products<kRows>(acc, pairs, p_bf16, c,
                                 [](Vec sum, __m512i a, __m512i b) C10_ALWAYS_INLINE_ATTRIBUTE {
                                   return Vec(add_bf16_pair_dots(sum, a, b));
                                 });
  };
  for_each_key_pair<kRequestAhead>(value_rows, cols, ahead, share, add_keys);
  unrolled<kRows>([&](auto r) C10_ALWAYS_INLINE_ATTRIBUTE {
    reorder(acc + kVectors * r);
    unrolled<kVectors>([&](auto j) C10_ALWAYS_INLINE_ATTRIBUTE {
      acc[r * kVectors + j].store(o + r * ld_o + d0 + 16 * j);
    });
  });
}

// accumulate_value_slice for a bf16 cache whose scores took bf16 dots (kBf16Pairs): O[r] +=
// sum over c < cols of P_bf16[r, c] v_c on O's columns [d0, d0 + 16 kVectors), whole groups of
// 32 columns in widen_bf16_pairs' order (even columns, then odd), by VDPBF16PS over pairs of
// keys. A key pair's rows are interleaved by a shift and a blend per vector, each 32-bit lane
// taking one column of both keys (the even columns' lanes the low halves of the rows' words,
// the odd columns' the high halves), so that it takes P[r, c] v_c[d] + P[r, c + 1] v_c+1[d] from
// one broadcast word of P's row: half the multiplies of the fp32 FMAs, each product exact.
// kRequestAhead: at keys c, c + 1, bytes `share` of ahead's rows.
template <int kRows, int kVectors, bool kRequestAhead>
C10_ALWAYS_INLINE void accumulate_value_slice_bf16_pairs(const c10::BFloat16* p_bf16,
                                                         const c10::BFloat16* const* value_rows,
                                                         int64_t cols, int64_t d0, float* o,
                                                         int64_t ld_o,
                                                         const SweepRequests<c10::BFloat16>& ahead,
                                                         std::pair<int64_t, int64_t> share) {
  static_assert(kVectors % 2 == 0, "whole groups of 32 columns");
  using Vec = at::vec::Vectorized<float>;
  constexpr __mmask32 kHighHalves = 0xAAAAAAAA;
  Vec acc[kRows * kVectors];  // acc[r * kVectors + j]
  unrolled<kRows * kVectors>([&](auto i) C10_ALWAYS_INLINE_ATTRIBUTE {
    constexpr int r = i / kVectors, j = i % kVectors;
    acc[i] = Vec::loadu(o + r * ld_o + d0 + 16 * j);
  });
  auto add_keys = [&](int64_t c, const c10::BFloat16* first,
                      const c10::BFloat16* second) C10_ALWAYS_INLINE_ATTRIBUTE {
    __m512i pairs[kVectors];
    unrolled<kVectors / 2>([&](auto g) C10_ALWAYS_INLINE_ATTRIBUTE {
      const __m512i a = _mm512_loadu_si512(first + d0 + 32 * g);
      const __m512i b =
          second == nullptr ? _mm512_setzero_si512() : _mm512_loadu_si512(second + d0 + 32 * g);
      pairs[2 * g] = _mm512_mask_blend_epi16(kHighHalves, a, _mm512_slli_epi32(b, 16));
      pairs[2 * g + 1] = _mm512_mask_blend_epi16(kHighHalves, _mm512_srli_epi32(a, 16), b);
    });
    add_key_pair_products<kRows>(acc, pairs, p_bf16, c,
                                 [](Vec sum, __m512i a, __m512i b) C10_ALWAYS_INLINE_ATTRIBUTE {
                                   return Vec(add_bf16_pair_dots(sum, a, b));
                                 });
  };
  for_each_key_pair<kRequestAhead>(value_rows, cols, ahead, share, add_keys);
  unrolled<kRows * kVectors>([&](auto i) C10_ALWAYS_INLINE_ATTRIBUTE {
    constexpr int r = i / kVectors, j = i % kVectors;
    acc[i].store(o + r * ld_o + d0 + 16 * j);
  });
}
#endif

// O[r] += sum over c < cols of P[r, c] v_c for r < kRows (p_tile [kRows, kKeyBlock]), reading
// the tile's value rows in place (score_tile requested them), a group of rows and a slice of O at a
// time. Where the value pass requests the next tile's keys (value_pass_requests_keys), `next_keys`'
// lines are requested spread over the pass. Given p_bf16 (P as round_probabilities_to_bf16
// left it, for an fp8 cache's kFp8TablePairs or a bf16 cache's kBf16Pairs), each whole slice
// of columns goes by bf16 pairs, the columns past them by fp32 weights: an fp8 cache's
// (accumulate_value_slice_fp8_pairs) all rows at once, in slices of 64 columns for up to 5
// rows, whose accumulators, the tables and a pair's four vectors fit the registers, and of 32
// for 6 to 8; a bf16 cache's (accumulate_value_slice_bf16_pairs) in the fp32 weights' slices.
template <int kRows, typename scalar_t, typename acc_t>
void accumulate_values(const acc_t* p_tile, const scalar_t* const* value_rows, int64_t cols,
                       int64_t dim, acc_t* o, int64_t ld_o,
                       const SweepRequests<scalar_t>& next_keys,
                       [[maybe_unused]] const c10::BFloat16* p_bf16 = nullptr) {
  using Traits = PagedKernelTraits<scalar_t>;
  constexpr int kGroupRows = Traits::value_group_rows(kRows);
  constexpr int kVectors = Traits::value_vectors(kGroupRows);
  constexpr int kGroups = ceil_div(kRows, kGroupRows);
  constexpr bool kRequestAhead = Traits::value_pass_requests_keys(kRows);
  const int64_t slice_width = kVectors * at::vec::Vectorized<acc_t>::size();
  int64_t sweeps = ceil_div(dim, slice_width) * kGroups;
  auto slice = [&](auto kFull, auto kFp8Tables, int64_t d0, int64_t first_sweep)
                   C10_ALWAYS_INLINE_ATTRIBUTE {
                     unrolled<kGroups>([&](auto group) C10_ALWAYS_INLINE_ATTRIBUTE {
                       constexpr int r0 = group * kGroupRows;
                       accumulate_value_slice<std::min(kGroupRows, kRows - r0), kVectors, kFull,
                                              kRequestAhead, kFp8Tables>(
                           p_tile + r0 * kKeyBlock, value_rows, cols, dim, d0, o + r0 * ld_o, ld_o,
                           next_keys, next_keys.share(first_sweep + group, sweeps));
                     });
                   };
  int64_t d0 = 0, sweep = 0;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (Traits::kFp8ByTables) {
    if (p_bf16 != nullptr) {
      constexpr int kPairVectors = kRows <= 5 ? 4 : 2;
      constexpr int64_t kPairColumns = 16 * kPairVectors;
      sweeps = dim / kPairColumns + (dim % kPairColumns != 0 ? kGroups : 0);
      for (; d0 + kPairColumns <= dim; d0 += kPairColumns, ++sweep) {
        accumulate_value_slice_fp8_pairs<kRows, kPairVectors, kRequestAhead>(
            p_bf16, value_rows, cols, d0, o, ld_o, next_keys, next_keys.share(sweep, sweeps));
      }
    }
  }
  if constexpr (Traits::kScoreByBf16Dots) {  // a bf16 cache
    if (p_bf16 != nullptr) {
      for (; d0 + slice_width <= dim; d0 += slice_width, sweep += kGroups) {
        unrolled<kGroups>([&](auto group) C10_ALWAYS_INLINE_ATTRIBUTE {
          constexpr int r0 = group * kGroupRows;
          accumulate_value_slice_bf16_pairs<std::min(kGroupRows, kRows - r0), kVectors,
                                            kRequestAhead>(p_bf16 + r0 * kKeyBlock, value_rows,
                                                           cols, d0, o + r0 * ld_o, ld_o, next_keys,
                                                           next_keys.share(sweep + group, sweeps));
        });
      }
    }
  }
  if constexpr (Traits::value_by_fp8_tables(kGroupRows)) {
    if (fp8_by_tables()) {
      for (; d0 + slice_width <= dim; d0 += slice_width, sweep += kGroups)
        slice(std::true_type{}, std::true_type{}, d0, sweep);
    }
  }
#endif
  for (; d0 + slice_width <= dim; d0 += slice_width, sweep += kGroups)
    slice(std::true_type{}, std::false_type{}, d0, sweep);
  if (d0 < dim) slice(std::false_type{}, std::false_type{}, d0, sweep);
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// The largest magnitude of row[0, count) in fp32 (row: fp32, bf16 or fp16), NaN where the row
// holds a NaN, for kInt16Dots' integer steps.
template <typename in_t>
float largest_magnitude(const in_t* row, int64_t count) {
  constexpr int64_t kWidth = at::vec::Vectorized<float>::size();
#if defined(CPU_CAPABILITY_AVX512)
  __m512 largest = _mm512_setzero_ps();
  __mmask16 unordered = 0;
  for (int64_t c = 0; c < count; c += kWidth) {
    const __m512 x = load_as<float>(row + c, std::min<int64_t>(kWidth, count - c));
    largest = _mm512_max_ps(largest, _mm512_abs_ps(x));
    unordered |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  }
  return unordered != 0 ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(largest);
#else
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 largest = _mm256_setzero_ps();
  __m256 unordered = _mm256_setzero_ps();
  for (int64_t c = 0; c < count; c += kWidth) {
    const __m256 x = load_as<float>(row + c, std::min<int64_t>(kWidth, count - c));
    largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, x));
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  }
  if (_mm256_movemask_ps(unordered) != 0) return std::numeric_limits<float>::quiet_NaN();
  float lanes[kWidth];
  _mm256_storeu_ps(lanes, largest);
  return *std::max_element(lanes, lanes + kWidth);
#endif
}

// dst[0, count) = x's first count lanes rounded to the nearest integer, saturated to int16
// (count at most the vector's width).
C10_ALWAYS_INLINE void store_int16_units(at::vec::Vectorized<float> x, int64_t count,
                                         int16_t* dst) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm256_mask_storeu_epi16(dst, lanes_below<__mmask16>(count),
                           _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(x)));
#else
  const __m256i words = _mm256_cvtps_epi32(x);
  const __m128i units =
      _mm_packs_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
  if (count == 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst), units);
  } else {
    int16_t lanes[8];
    _mm_storeu_si128(reinterpret_cast<__m128i*>(lanes), units);
    std::copy(lanes, lanes + count, dst);
  }
#endif
}

// For PagedKernelTraits::kInt16Dots: P's rows (the value scales folded in, s_tile [rows,
// kKeyBlock]) as int16 on a step of the row's largest / 32767, p_int16 [rows, kKeyBlock] (zero
// past cols, up to the next vector), and the steps in row_step [rows]. False, with p_int16
// unused, where a row holds a NaN or an infinity (a NaN or infinite scale), which the fp32
// value pass must propagate.
inline bool quantize_probabilities(const float* s_tile, int64_t rows, int64_t cols,
                                   int16_t* p_int16, float* row_step) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t kWidth = Vec::size();
  for (int64_t r = 0; r < rows; ++r) {
    const float* probs = s_tile + r * kKeyBlock;
    const float row_max = largest_magnitude(probs, cols);  // P >= 0
    if (!std::isfinite(row_max)) return false;
    row_step[r] = row_max / 32767.f;
    const Vec to_units(row_max > 0.f ? 32767.f / row_max : 0.f);
    int16_t* units = p_int16 + r * kKeyBlock;
    for (int64_t c = 0; c < cols; c += kWidth) {
      const Vec x = Vec::loadu(probs + c, std::min<int64_t>(kWidth, cols - c));
      store_int16_units(x * to_units, kWidth, units + c);
    }
  }
  return true;
}

#if defined(CPU_CAPABILITY_AVX512)
// accumulate_value_slice for PagedKernelTraits::kInt16Dots: O[r] += row_step[r] sum over c <
// cols of P_int16[r, c] v_c on O's columns [d0, d0 + kVectors x 16), by VPDPWSSD over pairs of
// keys. A pair's two value rows are interleaved byte by byte and widened to int16 (two unpacks
// of 32 bytes and two widenings per 32 columns), so that each int32 lane, one column, takes
// P[r, c] v_c[d] + P[r, c + 1] v_c+1[d] from one broadcast word of P's row. The unpacks work
// within 128-bit lanes: of 32 columns, the first vector takes 0-7 and 16-23, the second 8-15
// and 24-31, put back in order once per slice. The int32 sums (at most 64 keys x 32767 x 128
// < 2^28) join O in fp32 once per slice. kFull as in accumulate_value_slice; kRequestAhead: at
// keys c, c + 1, bytes `share` of ahead's rows.
template <int kRows, int kVectors, bool kFull, bool kRequestAhead>
C10_ALWAYS_INLINE void accumulate_value_slice_int16(const int16_t* p_int16, const float* row_step,
                                                    const int8_t* const* value_rows, int64_t cols,
                                                    int64_t dim, int64_t d0, float* o, int64_t ld_o,
                                                    const SweepRequests<int8_t>& ahead,
                                                    std::pair<int64_t, int64_t> share) {
  static_assert(kVectors % 2 == 0, "32 columns per pair of vectors");
  constexpr int kChunks = kVectors / 2;
  __mmask32 columns[kChunks];  // valid columns of each 32
  for (int h = 0; h < kChunks; ++h)
    columns[h] = kFull ? ~__mmask32(0) : lanes_below<__mmask32>(dim - d0 - 32 * h);
  __m512i acc[kRows * kVectors];  // acc[r * kVectors + j]
  unrolled<kRows * kVectors>([&](auto i)
                                 C10_ALWAYS_INLINE_ATTRIBUTE { acc[i] = _mm512_setzero_si512(); });
  auto add_keys = [&](int64_t c, const int8_t* first,
                      const int8_t* second) C10_ALWAYS_INLINE_ATTRIBUTE {
    __m512i pairs[kVectors];
    unrolled<kChunks>([&](auto h) C10_ALWAYS_INLINE_ATTRIBUTE {
      const __m256i a = _mm256_maskz_loadu_epi8(columns[h], first + d0 + 32 * h);
      const __m256i b = second == nullptr
                            ? _mm256_setzero_si256()
                            : _mm256_maskz_loadu_epi8(columns[h], second + d0 + 32 * h);
      pairs[2 * h] = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(a, b));
      pairs[2 * h + 1] = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(a, b));
    });
    add_key_pair_products<kRows>(acc, pairs, p_int16, c,
                                 [](__m512i sum, __m512i a, __m512i b) C10_ALWAYS_INLINE_ATTRIBUTE {
                                   return add_int16_pair_dots(sum, a, b);
                                 });
  };
  for_each_key_pair<kRequestAhead>(value_rows, cols, ahead, share, add_keys);
  unrolled<kRows * kChunks>([&](auto i) C10_ALWAYS_INLINE_ATTRIBUTE {
    constexpr int r = i / kChunks, h = i % kChunks;
    const __m512i& low = acc[r * kVectors + 2 * h];       // columns 0-7, 16-23 of the 32
    const __m512i& high = acc[r * kVectors + 2 * h + 1];  // 8-15, 24-31
    const __m512i in_order[2] = {_mm512_shuffle_i32x4(low, high, 0x44),
                                 _mm512_shuffle_i32x4(low, high, 0xEE)};
    unrolled<2>([&](auto half) C10_ALWAYS_INLINE_ATTRIBUTE {
      constexpr int j = 2 * h + half;
      const __mmask16 lanes = kFull ? __mmask16(0xFFFF) : lanes_below<__mmask16>(dim - d0 - 16 * j);
      float* out = o + r * ld_o + d0 + 16 * j;
      const __m512 sum = _mm512_cvtepi32_ps(in_order[half]);
      _mm512_mask_storeu_ps(
          out, lanes,
          _mm512_fmadd_ps(sum, _mm512_set1_ps(row_step[r]), _mm512_maskz_loadu_ps(lanes, out)));
    });
  });
}

#else
// accumulate_value_slice_int16 for AVX2: O[r] += row_step[r] sum over c < cols of P_int16[r, c]
// v_c on O's columns [d0, d0 + kVectors x 8), all inside dim, by VPMADDWD over pairs of keys.
// A pair's two value rows are interleaved byte by byte (one unpack per 8 columns) and widened
// to int16 pairs in column order. The rest as on AVX-512.
template <int kRows, int kVectors, bool kRequestAhead>
C10_ALWAYS_INLINE void accumulate_value_slice_int16(const int16_t* p_int16, const float* row_step,
                                                    const int8_t* const* value_rows, int64_t cols,
                                                    int64_t d0, float* o, int64_t ld_o,
                                                    const SweepRequests<int8_t>& ahead,
                                                    std::pair<int64_t, int64_t> share) {
  __m256i acc[kRows * kVectors];  // acc[r * kVectors + j]
  unrolled<kRows * kVectors>([&](auto i)
                                 C10_ALWAYS_INLINE_ATTRIBUTE { acc[i] = _mm256_setzero_si256(); });
  auto add_keys = [&](int64_t c, const int8_t* first,
                      const int8_t* second) C10_ALWAYS_INLINE_ATTRIBUTE {
    __m256i pairs[kVectors];
    if constexpr (kVectors == 1) {
      const __m128i a = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(first + d0));
      const __m128i b = second == nullptr
                            ? _mm_setzero_si128()
                            : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(second + d0));
      pairs[0] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b));
    } else {
      unrolled<kVectors / 2>([&](auto h) C10_ALWAYS_INLINE_ATTRIBUTE {
        const int64_t d = d0 + 16 * h;
        const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(first + d));
        const __m128i b = second == nullptr
                              ? _mm_setzero_si128()
                              : _mm_loadu_si128(reinterpret_cast<const __m128i*>(second + d));
        pairs[2 * h] = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(a, b));
        pairs[2 * h + 1] = _mm256_cvtepi8_epi16(_mm_unpackhi_epi8(a, b));
      });
    }
    add_key_pair_products<kRows>(acc, pairs, p_int16, c,
                                 [](__m256i sum, __m256i a, __m256i b) C10_ALWAYS_INLINE_ATTRIBUTE {
                                   return add_int16_pair_dots(sum, a, b);
                                 });
  };
  for_each_key_pair<kRequestAhead>(value_rows, cols, ahead, share, add_keys);
  unrolled<kRows * kVectors>([&](auto i) C10_ALWAYS_INLINE_ATTRIBUTE {
    constexpr int r = i / kVectors, j = i % kVectors;
    float* out = o + r * ld_o + d0 + 8 * j;
    _mm256_storeu_ps(out, _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[i]), _mm256_set1_ps(row_step[r]),
                                          _mm256_loadu_ps(out)));
  });
}

// The columns [d0, dim) that AVX2's whole vectors leave over (fewer than 8), in scalars.
template <int kRows>
void accumulate_value_columns_int16(const int16_t* p_int16, const float* row_step,
                                    const int8_t* const* value_rows, int64_t cols, int64_t dim,
                                    int64_t d0, float* o, int64_t ld_o) {
  for (int r = 0; r < kRows; ++r) {
    for (int64_t d = d0; d < dim; ++d) {
      int32_t sum = 0;
      for (int64_t c = 0; c < cols; ++c) sum += p_int16[r * kKeyBlock + c] * value_rows[c][d];
      o[r * ld_o + d] += row_step[r] * static_cast<float>(sum);
    }
  }
}
#endif

// accumulate_values for PagedKernelTraits::kInt16Dots (all rows in one group: value_group_rows
// of an int8 cache on both classes), P as quantize_probabilities left it.
template <int kRows>
void accumulate_values_int16(const int16_t* p_int16, const float* row_step,
                             const int8_t* const* value_rows, int64_t cols, int64_t dim, float* o,
                             int64_t ld_o, const SweepRequests<int8_t>& next_keys) {
  using Traits = PagedKernelTraits<int8_t>;
  static_assert(Traits::value_group_rows(kRows) == kRows, "one group of rows");
  constexpr int kVectors = Traits::int16_value_vectors(kRows);
  constexpr bool kRequestAhead = Traits::value_pass_requests_keys(kRows);
  constexpr int64_t kWidth = at::vec::Vectorized<float>::size();
  const int64_t slice_width = kVectors * kWidth;
#if defined(CPU_CAPABILITY_AVX512)
  const int64_t sweeps = ceil_div(dim, slice_width);
  auto slice = [&](auto kFull, int64_t d0) C10_ALWAYS_INLINE_ATTRIBUTE {
    accumulate_value_slice_int16<kRows, kVectors, kFull, kRequestAhead>(
        p_int16, row_step, value_rows, cols, dim, d0, o, ld_o, next_keys,
        next_keys.share(d0 / slice_width, sweeps));
  };
  int64_t d0 = 0;
  for (; d0 + slice_width <= dim; d0 += slice_width) slice(std::true_type{}, d0);
  if (d0 < dim) slice(std::false_type{}, d0);
#else
  // Whole slices, then single vectors, then the last columns in scalars (unrequested: the
  // sweeps are the vector steps).
  const int64_t whole_slices = dim / slice_width;
  const int64_t single_vectors = dim % slice_width / kWidth;
  const int64_t sweeps = std::max<int64_t>(whole_slices + single_vectors, 1);
  int64_t d0 = 0, sweep = 0;
  for (; d0 + slice_width <= dim; d0 += slice_width, ++sweep) {
    accumulate_value_slice_int16<kRows, kVectors, kRequestAhead>(p_int16, row_step, value_rows,
                                                                 cols, d0, o, ld_o, next_keys,
                                                                 next_keys.share(sweep, sweeps));
  }
  for (; d0 + kWidth <= dim; d0 += kWidth, ++sweep) {
    accumulate_value_slice_int16<kRows, 1, kRequestAhead>(p_int16, row_step, value_rows, cols, d0,
                                                          o, ld_o, next_keys,
                                                          next_keys.share(sweep, sweeps));
  }
  if (d0 < dim)
    accumulate_value_columns_int16<kRows>(p_int16, row_step, value_rows, cols, dim, d0, o, ld_o);
#endif
}
#endif

// Calls kernel(std::integral_constant<int, rows>) for rows in [1, kDirectRows].
template <typename Kernel>
void dispatch_direct_rows(int64_t rows, Kernel&& kernel) {
  switch (rows) {
    case 1: return kernel(std::integral_constant<int, 1>{});
    case 2: return kernel(std::integral_constant<int, 2>{});
    case 3: return kernel(std::integral_constant<int, 3>{});
    case 4: return kernel(std::integral_constant<int, 4>{});
    case 5: return kernel(std::integral_constant<int, 5>{});
    case 6: return kernel(std::integral_constant<int, 6>{});
    case 7: return kernel(std::integral_constant<int, 7>{});
    default: return kernel(std::integral_constant<int, kDirectRows>{});
  }
}

// A kv head's part of a task: its tile rows' queries, output and softmax state.
template <typename scalar_t, typename acc_t>
struct HeadState {
  acc_t* q;              // [rows, ld_d], pre-scaled
  c10::BFloat16* q_raw;  // [rows, ld_d]: a bf16 q's rows as given, for the bf16 dots
  int16_t* q_int16;      // [rows, ld_d], the same memory: q's rows quantized (kInt16Dots)
  acc_t* q_row_factor;   // [rows]: what the int16 dot products take to scores
  acc_t* o;              // [rows, ld_dv]
  acc_t* row_max_log2;   // [rows]
  acc_t* row_sum;        // [rows]
};

// How the direct path multiplies: fp32 FMAs (over the pre-scaled q), the score pass's bf16
// dot products of PagedKernelTraits::kScoreByBf16Dots and kScoreFp8ByBf16Dots (kFp8TablePairs:
// the fp8 codes converted by byte tables, kFp8ByTables), or both passes' int16 dot products of
// kInt16Dots.
enum class DirectDots { kFloat, kBf16Pairs, kFp8TablePairs, kInt16Pairs };

// How a call divides its work into tasks, and the scratch each thread needs for them. A task
// is (sequence, group of kv heads, chunk of queries, key split), numbered in that order, the
// split fastest; the CPU backend's plan (plan_paged_tasks, blocking.h) chose the kv heads per task
// and the splits.
struct PagedCallPlan {
  int64_t group = 0;             // query heads per kv head
  int64_t queries_per_tile = 0;  // queries of one sequence a task takes, at most
  int64_t tile_rows = 0;         // rows of the largest task's tile: queries x group
  int64_t q_chunks = 0;          // query chunks of the sequence with the most queries
  int64_t splits = 0;            // key splits of each chunk
  int64_t heads_per_task = 0;    // kv heads a task takes together
  int64_t head_groups = 0;       // tasks that divide a sequence's kv heads
  int64_t ld_d = 0;              // row stride of the scratch's q rows
  int64_t ld_dv = 0;             // row stride of its O rows
  int64_t head_state_size = 0;   // scratch elements of one kv head's HeadState
  int64_t scratch_size = 0;      // scratch elements of one thread
  int64_t tasks = 0;
};

// The call's tasks and scratch sizes, from the params and the CPU backend's plan.
template <typename acc_t>
PagedCallPlan plan_paged_call(const PagedAttentionParams& p, const PagedTaskPlan& tasks) {
  const int64_t width = at::vec::Vectorized<acc_t>::size();
  PagedCallPlan plan;
  plan.group = p.num_heads / p.num_kv_heads;
  plan.queries_per_tile = paged_queries_per_tile(p);
  plan.tile_rows = paged_task_rows(p);
  plan.q_chunks = ceil_div(std::max<int64_t>(p.max_queries_per_seq, 1), plan.queries_per_tile);
  plan.splits = p.num_kv_splits;
  plan.heads_per_task = std::clamp<int64_t>(tasks.kv_heads_per_task, 1, p.num_kv_heads);
  plan.head_groups = ceil_div(p.num_kv_heads, plan.heads_per_task);
  plan.ld_d = round_up(p.head_dim, width);
  plan.ld_dv = round_up(p.head_dim_v, width);
  plan.head_state_size =
      2 * plan.tile_rows * plan.ld_d + plan.tile_rows * plan.ld_dv + 3 * plan.tile_rows;
  plan.scratch_size = plan.heads_per_task * plan.head_state_size + p.head_dim * kKeyBlock +
                      kKeyBlock * plan.ld_dv + plan.tile_rows * kKeyBlock + kKeyBlock * p.head_dim +
                      2 * kKeyBlock + plan.tile_rows * kKeyBlock / 2 + plan.tile_rows;
  plan.tasks = p.batch * plan.head_groups * plan.q_chunks * plan.splits;
  return plan;
}

// One thread's scratch for its tasks, laid out by PagedCallPlan: the HeadState of each of a
// task's kv heads, then the score tile and the gathered path's tiles. thread_scratch keeps it
// between calls.
template <typename scalar_t, typename acc_t>
struct PagedScratch {
  const PagedCallPlan& plan;
  acc_t* head_states;     // [heads_per_task, head_state_size]
  acc_t* kt_tile;         // [head_dim, kKeyBlock]
  acc_t* v_tile;          // [kKeyBlock, ld_dv]
  acc_t* s_tile;          // [tile_rows, kKeyBlock]
  acc_t* staging;         // [kKeyBlock, head_dim]
  acc_t* k_row_scales;    // [kKeyBlock]: an int8 cache's scales of the item's key rows
  acc_t* v_row_scales;    // [kKeyBlock]: and of its value rows
  int16_t* p_int16;       // [tile_rows, kKeyBlock]: P quantized for kInt16Dots
  c10::BFloat16* p_bf16;  // [tile_rows, kKeyBlock], the same memory: P in bf16 (kFp8TablePairs)
  acc_t* p_row_step;      // [tile_rows]: and the step of each of its rows

  PagedScratch(const PagedCallPlan& call, int64_t head_dim)
      : plan(call),
        head_states(thread_scratch<acc_t>(call.scratch_size)),
        kt_tile(head_states + call.heads_per_task * call.head_state_size),
        v_tile(kt_tile + head_dim * kKeyBlock),
        s_tile(v_tile + kKeyBlock * call.ld_dv),
        staging(s_tile + call.tile_rows * kKeyBlock),
        k_row_scales(staging + kKeyBlock * head_dim),
        v_row_scales(k_row_scales + kKeyBlock),
        p_int16(reinterpret_cast<int16_t*>(v_row_scales + kKeyBlock)),
        p_bf16(reinterpret_cast<c10::BFloat16*>(p_int16)),
        p_row_step(v_row_scales + kKeyBlock + call.tile_rows * kKeyBlock / 2) {}

  // The state of the task's i-th kv head.
  HeadState<scalar_t, acc_t> head(int64_t i) const {
    acc_t* base = head_states + i * plan.head_state_size;
    HeadState<scalar_t, acc_t> state;
    state.q = base;
    state.q_raw = reinterpret_cast<c10::BFloat16*>(base + plan.tile_rows * plan.ld_d);
    state.q_int16 = reinterpret_cast<int16_t*>(base + plan.tile_rows * plan.ld_d);
    state.o = base + 2 * plan.tile_rows * plan.ld_d;
    state.row_max_log2 = state.o + plan.tile_rows * plan.ld_dv;
    state.row_sum = state.row_max_log2 + plan.tile_rows;
    state.q_row_factor = state.row_sum + plan.tile_rows;
    return state;
  }
};

// One task's share of the call (plan_task): the tile rows of a chunk of one sequence's
// queries, for its kv heads [head_begin, head_end), over the keys of its split. Row r of a
// kv head's tile is query first_query + r / group of the sequence, query head
// kv_head * group + r % group.
struct PagedTask {
  int64_t seq = 0;
  int64_t split = 0;
  int64_t head_begin = 0;
  int64_t head_end = 0;
  int64_t q_begin = 0;      // q's row of the sequence's first query
  int64_t first_query = 0;  // the chunk's first query, counted within the sequence
  int64_t rows = 0;         // the chunk's queries x group; 0 past the sequence's queries
  int64_t seq_len = 0;      // the sequence's cached tokens
  int64_t num_queries = 0;  // the sequence's queries, its last tokens
  KeyRange keys{0, 0};      // the split's keys
  const int32_t* block_table = nullptr;
  bool direct = false;          // rows <= kDirectRows: cached K and V rows read in place
  bool widen_in_pairs = false;  // the direct path's q and O rows in widen_bf16_pairs' order

  // The task's work items go through its key tiles in order, and within a tile through its
  // kv heads (plan_paged_tasks).
  WorkItem first_item() const {
    return {keys.begin, std::min(kKeyBlock, keys.end - keys.begin), head_begin};
  }

  // The item after `item`; cols 0 after the last.
  WorkItem following(const WorkItem& item) const {
    if (item.kv_head + 1 < head_end) return WorkItem{item.key0, item.cols, item.kv_head + 1};
    const int64_t key0 = item.key0 + kKeyBlock;
    return WorkItem{key0, std::clamp<int64_t>(keys.end - key0, 0, kKeyBlock), head_begin};
  }
};

// Task number `index` of the call (PagedCallPlan): its sequence, kv heads, queries and keys.
template <typename scalar_t>
PagedTask plan_task(const PagedAttentionParams& p, const PagedCallPlan& plan, int64_t index) {
  const int64_t seq = index / (plan.head_groups * plan.q_chunks * plan.splits);
  const int64_t head_group = index / (plan.q_chunks * plan.splits) % plan.head_groups;
  const int64_t chunk = index / plan.splits % plan.q_chunks;
  PagedTask task;
  task.seq = seq;
  task.split = index % plan.splits;
  task.head_begin = head_group * plan.heads_per_task;
  task.head_end = std::min(task.head_begin + plan.heads_per_task, p.num_kv_heads);
  task.q_begin = p.cu_seqlens_q[seq];
  task.num_queries = p.cu_seqlens_q[seq + 1] - task.q_begin;
  task.first_query = chunk * plan.queries_per_tile;
  if (task.first_query >= task.num_queries) return task;
  const int64_t queries = std::min(plan.queries_per_tile, task.num_queries - task.first_query);
  task.rows = queries * plan.group;
  task.seq_len = p.seq_lens[seq];
  const int64_t last_query = task.first_query + queries - 1;
  const KeyRange keys =
      paged_chunk_keys(task.seq_len, task.num_queries, task.first_query, last_query, p.window_left);
  task.keys = split_key_range(keys, task.split, plan.splits, kKeyBlock);
  task.block_table = p.block_tables + seq * p.block_table_stride;
  task.direct = task.rows <= kDirectRows;
  task.widen_in_pairs = task.direct && PagedKernelTraits<scalar_t>::kWidenInPairs;
  return task;
}

// The factors an 8-bit cache's units (kCacheUnit) take to their values beyond the int8 row
// scales: the per-tensor scale times the unit. The key's multiplies the q rows' pre-scale,
// the value's the output rows when a task finishes; 1 for other caches.
template <typename cache_t>
double key_unit_factor(const PagedAttentionParams& p) {
  return static_cast<double>(p.k_scales.per_tensor) * kCacheUnit<cache_t>;
}
template <typename cache_t>
double value_unit_factor(const PagedAttentionParams& p) {
  return static_cast<double>(p.v_scales.per_tensor) * kCacheUnit<cache_t>;
}

// q's row r of the task's tile for kv head `kv_head`.
template <typename q_t>
const q_t* task_query_row(const PagedAttentionParams& p, const PagedTask& task, int64_t group,
                          int64_t kv_head, int64_t r) {
  return static_cast<const q_t*>(p.q) +
         (task.q_begin + task.first_query + r / group) * p.q_strides.token +
         (kv_head * group + r % group) * p.q_strides.head;
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// For kInt16Dots: each of the task's q rows as integers on a power-of-two step, the largest
// magnitude in [2^14, 2^15) steps (a bf16 or fp16 element there is a multiple of 16 steps, so
// none rounds past 32767), and the factor that takes their dot products with the cached
// integers to pre-scaled scores: step x the softmax scale x key_unit_factor. False, with
// nothing to use, where a row holds an infinity or a NaN, which the fp32 path must propagate,
// or is all below 2^-100 (a step whose inverse fp32 cannot hold).
template <typename q_t, typename scalar_t, typename acc_t>
bool quantize_query_rows(const PagedAttentionParams& p, const PagedTask& task,
                         const PagedScratch<scalar_t, acc_t>& scratch) {
  using Vec = at::vec::Vectorized<float>;
  constexpr int64_t kWidth = Vec::size();
  const double q_scale = p.scale * key_unit_factor<scalar_t>(p);
  const int64_t group = scratch.plan.group, ld_d = scratch.plan.ld_d, dim = p.head_dim;
  for (int64_t kv_head = task.head_begin; kv_head < task.head_end; ++kv_head) {
    const HeadState<scalar_t, acc_t> state = scratch.head(kv_head - task.head_begin);
    for (int64_t r = 0; r < task.rows; ++r) {
      const q_t* q_row = task_query_row<q_t>(p, task, group, kv_head, r);
      const float absmax = largest_magnitude(q_row, dim);
      if (!std::isfinite(absmax)) return false;
      int exponent = 0;  // absmax = m 2^exponent, m in [0.5, 1)
      std::frexp(absmax, &exponent);
      const int step_exponent = absmax > 0.f ? exponent - 15 : 0;
      if (step_exponent < -115) return false;
      const Vec to_units(std::ldexp(1.f, -step_exponent));  // exact
      int16_t* units = state.q_int16 + r * ld_d;
      for (int64_t d = 0; d < dim; d += kWidth) {
        const int64_t count = std::min<int64_t>(kWidth, dim - d);
        store_int16_units(load_as<float>(q_row + d, count) * to_units, count, units + d);
      }
      state.q_row_factor[r] = static_cast<acc_t>(std::ldexp(q_scale, step_exponent));
    }
  }
  return true;
}
#endif

// Loads each of the task's kv heads' q rows (q_t) into its state, pre-scaled by the softmax
// scale and key_unit_factor (in bf16 as given for kScoreByBf16Dots, quantized for
// kInt16Dots; in widen_bf16_pairs' order where the task widens in pairs), and clears
// the heads' outputs and softmax states. Returns the dots the task scores with: `dots`, or
// kFloat where q's rows cannot be quantized.
template <typename q_t, typename scalar_t, typename acc_t>
DirectDots start_task(const PagedAttentionParams& p, const PagedTask& task,
                      const PagedScratch<scalar_t, acc_t>& scratch, DirectDots dots) {
  const auto q_scale = static_cast<acc_t>(p.scale * key_unit_factor<scalar_t>(p));
  constexpr acc_t kMinusInf = -std::numeric_limits<acc_t>::infinity();
  const int64_t group = scratch.plan.group, ld_d = scratch.plan.ld_d, ld_dv = scratch.plan.ld_dv;
  if (!task.direct) dots = DirectDots::kFloat;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (PagedKernelTraits<scalar_t>::kInt16Dots) {
    if (dots == DirectDots::kInt16Pairs && !quantize_query_rows<q_t>(p, task, scratch))
      dots = DirectDots::kFloat;
  }
#endif
  for (int64_t kv_head = task.head_begin; kv_head < task.head_end; ++kv_head) {
    const HeadState<scalar_t, acc_t> state = scratch.head(kv_head - task.head_begin);
    for (int64_t r = 0; r < task.rows && dots != DirectDots::kInt16Pairs; ++r) {
      const q_t* q_row = task_query_row<q_t>(p, task, group, kv_head, r);
      if constexpr (std::is_same_v<q_t, c10::BFloat16>) {  // bf16 dots score a bf16 q
        if (dots == DirectDots::kBf16Pairs || dots == DirectDots::kFp8TablePairs) {
          std::copy(q_row, q_row + p.head_dim, state.q_raw + r * ld_d);
#if defined(CPU_CAPABILITY_AVX512)
          if (dots == DirectDots::kFp8TablePairs)
            fp8_table_order(state.q_raw + r * ld_d, p.head_dim);
#endif
          continue;
        }
      }
      load_rows(q_row, 0, 1, p.head_dim, state.q + r * ld_d, ld_d, q_scale);
      if (task.widen_in_pairs) reorder_pair_groups(state.q + r * ld_d, p.head_dim, true);
    }
    std::fill(state.o, state.o + task.rows * ld_dv, acc_t(0));
    std::fill(state.row_max_log2, state.row_max_log2 + task.rows, kMinusInf);
    std::fill(state.row_sum, state.row_sum + task.rows, acc_t(0));
  }
  return dots;
}

// Which cached rows a task requests ahead of their use, and when. The direct path requests
// each value row as its key is scored (score_tile), and each key row either kPrefetchRows
// ahead in the score loop or, where value_pass_requests_keys, during the previous item's
// value pass (spread over the pass, SweepRequests); there, with kValuesRequestedTileAhead,
// the score pass requests the next item's value rows instead of its own. The gathered path
// requests rows kPrefetchRows ahead as it copies them into its tiles (gather_tile_rows).
// An int8 cache's K and V scales are requested an item ahead, as the item starts: read
// unrequested, their misses held 8% of a decode's samples (perf, Zen 4, 32q/8kv).
// Per work item: start_item before the score pass, keys_for_value_pass before the value pass.
template <typename scalar_t>
struct PrefetchSchedule {
  using Traits = PagedKernelTraits<scalar_t>;
  const PagedAttentionParams& p;
  const PagedTask& task;
  const bool keys_in_value_pass;           // the value pass requests the next item's key rows
  const bool values_ahead;                 // and the score pass the next item's value rows
  TileRows<scalar_t> k_rows;               // the item's cached key rows (and some of the next's)
  TileRows<scalar_t> v_rows;               // the item's cached value rows (and some of the next's)
  const scalar_t* next_values[kKeyBlock];  // the next item's value rows, where values_ahead
  const scalar_t* const* value_requests = nullptr;  // the value rows the score pass requests
  int64_t values_requested = 0;

  PrefetchSchedule(const PagedAttentionParams& params, const PagedTask& t)
      : p(params),
        task(t),
        keys_in_value_pass(t.direct && Traits::value_pass_requests_keys(t.rows)),
        values_ahead(keys_in_value_pass && Traits::kValuesRequestedTileAhead) {}

  // rows[0, item.cols) the item's cached rows, then, where `ahead`, up to kPrefetchRows
  // rows of `next` for the loops that request rows that far ahead.
  void list_rows(const void* cache, const CacheStrides& strides, const WorkItem& item,
                 const WorkItem& next, bool ahead, TileRows<scalar_t>& listed) const {
    listed.listed = list_item_rows(cache, strides, item, item.cols, listed.rows);
    if (ahead) {
      const int64_t extra = std::min(Traits::kPrefetchRows, next.cols);
      listed.listed += list_item_rows(cache, strides, next, extra, listed.rows + item.cols);
    }
  }

  // rows[0, count) the cached rows of the item's first `count` keys; returns count.
  int64_t list_item_rows(const void* cache, const CacheStrides& strides, const WorkItem& item,
                         int64_t count, const scalar_t** rows) const {
    cache_rows(static_cast<const scalar_t*>(cache), strides, task.block_table, p.block_size,
               item.kv_head, item.key0, count, rows);
    return count;
  }

  // Lists the item's rows and the value rows its score pass requests. Rows of the next item
  // are listed only for the loops that request them kPrefetchRows ahead: the gathered path's
  // copies, and the direct score pass's keys where the value pass does not request them.
  // Past the first item, the value pass that requested the keys listed them in k_rows (and
  // the score pass that requested the values in next_values). The first item's rows, which
  // no earlier pass requested, are requested here.
  void start_item(const WorkItem& item, const WorkItem& next, bool is_first) {
    const int64_t cols = item.cols;
    if (!keys_in_value_pass || is_first) {
      list_rows(p.k_cache, p.k_cache_strides, item, next, !keys_in_value_pass, k_rows);
    }
    if (!values_ahead || is_first) {
      list_rows(p.v_cache, p.v_cache_strides, item, next, !task.direct, v_rows);
    } else {
      std::copy(next_values, next_values + cols, v_rows.rows);
      v_rows.listed = cols;
    }
    value_requests = v_rows.rows;
    values_requested = cols;
    if (values_ahead) {
      values_requested = next.cols;
      list_item_rows(p.v_cache, p.v_cache_strides, next, next.cols, next_values);
      value_requests = next_values;
    }
    if (keys_in_value_pass && is_first) {
      for (int64_t i = 0; i < cols; ++i) prefetch_row(k_rows.rows[i], p.head_dim);
      if (values_ahead) {
        for (int64_t i = 0; i < cols; ++i) prefetch_row(v_rows.rows[i], p.head_dim_v);
      }
    }
    if (p.format == CacheFormat::kInt8) {  // the scales the next item's score pass reads
      for (const QuantScales* quant : {&p.k_scales, &p.v_scales}) {
        if (is_first)
          request_row_scales(*quant, task.block_table, p.block_size, item.kv_head, item.key0, cols);
        request_row_scales(*quant, task.block_table, p.block_size, next.kv_head, next.key0,
                           next.cols);
      }
    }
  }

  // The next item's key rows for this item's value pass to request, listed in k_rows for
  // the next item's score pass (this item's keys are scored by now); none where the value
  // pass requests no keys.
  SweepRequests<scalar_t> keys_for_value_pass(const WorkItem& next) {
    SweepRequests<scalar_t> next_keys;
    if (keys_in_value_pass && next.cols > 0) {
      k_rows.listed = list_item_rows(p.k_cache, p.k_cache_strides, next, next.cols, k_rows.rows);
      next_keys = {k_rows.rows, k_rows.listed, p.head_dim};
    }
    return next_keys;
  }
};

// s[0, count) = softcapped(s) (score_mods.h), a vector at a time: the same formula, with
// Sleef's tanh (within 1 ulp of std::tanh) in place of a call per score.
template <typename acc_t>
void softcap_scores(acc_t* s, int64_t count, acc_t softcap) {
  using Vec = at::vec::Vectorized<acc_t>;
  at::vec::map([softcap](Vec x) { return Vec(softcap) * (x / Vec(softcap)).tanh(); }, s, s, count);
}

// Applies the score modifications (score_mods.h: softcap, then ALiBi with the distance
// position - key) to the scores of the keys each tile row sees, and hides the others (-inf):
// the keys past its query and, with a window, those before it. s_tile [rows, kKeyBlock] holds
// the item's scores of q pre-scaled on load. Each modification is decided once per row,
// outside the loops over keys, so a call without them costs two fills per row.
template <typename acc_t>
void modify_and_mask_scores(const PagedAttentionParams& p, const PagedTask& task,
                            const WorkItem& item, int64_t group, acc_t* s_tile) {
  constexpr acc_t kMinusInf = -std::numeric_limits<acc_t>::infinity();
  const acc_t softcap = static_cast<acc_t>(p.mods.softcap);
  const int64_t diagonal_offset = task.seq_len - task.num_queries;  // query i's position - i
  for (int64_t r = 0; r < task.rows; ++r) {
    acc_t* s = s_tile + r * kKeyBlock;
    const int64_t query = task.first_query + r / group;
    const KeyRange visible =
        paged_visible_keys(task.seq_len, task.num_queries, query, p.window_left);
    const int64_t begin = std::clamp<int64_t>(visible.begin - item.key0, 0, item.cols);
    const int64_t end = std::clamp<int64_t>(visible.end - item.key0, begin, item.cols);
    std::fill(s, s + begin, kMinusInf);
    std::fill(s + end, s + item.cols, kMinusInf);
    if (softcap > acc_t(0)) softcap_scores(s + begin, end - begin, softcap);
    if (p.mods.alibi_slopes != nullptr) {
      const int64_t head = item.kv_head * group + r % group;
      const acc_t slope = alibi_slope<acc_t>(p.mods, task.seq, head);
      for (int64_t c = begin; c < end; ++c)
        s[c] += alibi_bias(slope, query, item.key0 + c, diagonal_offset);
    }
  }
}

// The score pass of one work item: S = Q K^T over the item's keys into s_tile [rows, cols],
// modified and masked (modify_and_mask_scores), then folded into the rows' online softmax, which
// leaves P in s_tile and rescales O. The direct path scores the cached key rows in place
// (score_tile, which also requests the schedule's value rows); the gathered path copies them
// into a K^T tile for the GEMM.
template <typename scalar_t, typename acc_t>
void score_pass(const PagedAttentionParams& p, const PagedTask& task, const WorkItem& item,
                const HeadState<scalar_t, acc_t>& state, const PrefetchSchedule<scalar_t>& schedule,
                const PagedScratch<scalar_t, acc_t>& scratch, DirectDots dots) {
  const int64_t rows = task.rows, cols = item.cols, ld_d = scratch.plan.ld_d;
  acc_t* s_tile = scratch.s_tile;  // [rows, kKeyBlock]
  if (task.direct) {
    // S = Q K^T from the cached key rows: no K^T tile to build.
    dispatch_direct_rows(rows, [&](auto kRows) {
      if constexpr (PagedKernelTraits<scalar_t>::kInt16Dots) {
        if (dots == DirectDots::kInt16Pairs) {
          return score_tile<kRows>(state.q_int16, ld_d, acc_t(1), schedule.k_rows,
                                   schedule.value_requests, schedule.values_requested, cols,
                                   p.head_dim, p.head_dim_v, s_tile, kKeyBlock);
        }
      }
      if constexpr (PagedKernelTraits<scalar_t>::kScoreByBf16Dots ||
                    PagedKernelTraits<scalar_t>::kScoreFp8ByBf16Dots) {
        const auto scale = static_cast<acc_t>(p.scale * key_unit_factor<scalar_t>(p));
#if defined(CPU_CAPABILITY_AVX512)
        if constexpr (PagedKernelTraits<scalar_t>::kFp8ByTables) {
          if (dots == DirectDots::kFp8TablePairs) {
            return score_tile<kRows, true>(state.q_raw, ld_d, scale, schedule.k_rows,
                                           schedule.value_requests, schedule.values_requested, cols,
                                           p.head_dim, p.head_dim_v, s_tile, kKeyBlock);
          }
        }
#endif
        if (dots == DirectDots::kBf16Pairs) {
          return score_tile<kRows>(state.q_raw, ld_d, scale, schedule.k_rows,
                                   schedule.value_requests, schedule.values_requested, cols,
                                   p.head_dim, p.head_dim_v, s_tile, kKeyBlock);
        }
      }
      score_tile<kRows>(state.q, ld_d, acc_t(1), schedule.k_rows, schedule.value_requests,
                        schedule.values_requested, cols, p.head_dim, p.head_dim_v, s_tile,
                        kKeyBlock);
    });
  } else {
    gather_tile_rows(schedule.k_rows, cols, p.head_dim, scratch.staging, p.head_dim);
    transpose_tile(scratch.staging, p.head_dim, cols, p.head_dim, scratch.kt_tile, kKeyBlock);
    // S = Q K^T   [rows, cols]
    tile_gemm<false>(rows, cols, p.head_dim, state.q, ld_d, scratch.kt_tile, kKeyBlock, s_tile,
                     kKeyBlock);
  }
  const bool row_scales = p.format == CacheFormat::kInt8;
  if (row_scales) {  // dequantize the keys in the scores: s = scale_k[c] (q . k_int8[c])
    cache_row_scales(p.k_scales, task.block_table, p.block_size, item.kv_head, item.key0, cols,
                     scratch.k_row_scales);
    if (dots == DirectDots::kInt16Pairs) {  // and q's: s = scale_q[r] scale_k[c] (q_int16 . k_int8)
      scale_rows_and_columns(s_tile, kKeyBlock, rows, cols, state.q_row_factor,
                             scratch.k_row_scales);
    } else {
      scale_columns(s_tile, kKeyBlock, rows, cols, scratch.k_row_scales);
    }
  }
  modify_and_mask_scores(p, task, item, scratch.plan.group, s_tile);
  online_softmax_tile(s_tile, kKeyBlock, rows, cols, state.row_max_log2, state.row_sum, state.o,
                      scratch.plan.ld_dv, p.head_dim_v);
  if (row_scales) {  // and the values in P: O += (P[:, c] scale_v[c]) v_int8[c]
    cache_row_scales(p.v_scales, task.block_table, p.block_size, item.kv_head, item.key0, cols,
                     scratch.v_row_scales);
    scale_columns(s_tile, kKeyBlock, rows, cols, scratch.v_row_scales);
  }
}

// The value pass of one work item: O += P V over the item's keys (P in s_tile from the score
// pass). The direct path reads the cached value rows in place (accumulate_values),
// requesting next_keys' lines on the way; the gathered path copies them into a V tile for
// the GEMM.
template <typename scalar_t, typename acc_t>
void value_pass(const PagedAttentionParams& p, const PagedTask& task, const WorkItem& item,
                const HeadState<scalar_t, acc_t>& state, const TileRows<scalar_t>& values,
                const SweepRequests<scalar_t>& next_keys,
                const PagedScratch<scalar_t, acc_t>& scratch, DirectDots dots) {
  const int64_t cols = item.cols, ld_dv = scratch.plan.ld_dv;
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if constexpr (PagedKernelTraits<scalar_t>::kInt16Dots) {
    if (dots == DirectDots::kInt16Pairs &&
        quantize_probabilities(scratch.s_tile, task.rows, cols, scratch.p_int16,
                               scratch.p_row_step)) {
      return dispatch_direct_rows(task.rows, [&](auto kRows) {
        accumulate_values_int16<kRows>(scratch.p_int16, scratch.p_row_step, values.rows, cols,
                                       p.head_dim_v, state.o, ld_dv, next_keys);
      });
    }
  }
#endif
  const c10::BFloat16* p_bf16 = nullptr;  // P in bf16 for the value passes by bf16 pairs
#if defined(CPU_CAPABILITY_AVX512)
  using Traits = PagedKernelTraits<scalar_t>;
  if constexpr (Traits::kFp8ByTables || Traits::kScoreByBf16Dots) {
    if ((Traits::kFp8ByTables && dots == DirectDots::kFp8TablePairs) ||
        (Traits::kScoreByBf16Dots && dots == DirectDots::kBf16Pairs)) {
      round_probabilities_to_bf16(scratch.s_tile, task.rows, cols, scratch.p_bf16);
      p_bf16 = scratch.p_bf16;
    }
  }
#endif
  if (task.direct) {
    // O += P V, the cached value rows read in place.
    dispatch_direct_rows(task.rows, [&](auto kRows) {
      accumulate_values<kRows>(scratch.s_tile, values.rows, cols, p.head_dim_v, state.o, ld_dv,
                               next_keys, p_bf16);
    });
  } else {
    gather_tile_rows(values, cols, p.head_dim_v, scratch.v_tile, ld_dv);
    // O += P V   [rows, head_dim_v]
    tile_gemm<true>(task.rows, p.head_dim_v, cols, scratch.s_tile, kKeyBlock, scratch.v_tile, ld_dv,
                    state.o, ld_dv);
  }
}

// Runs a started task's work items in order, each a score pass and a value pass, with the
// prefetch schedule's listing and requests before each.
template <typename scalar_t, typename acc_t>
void run_task_items(const PagedAttentionParams& p, const PagedTask& task,
                    const PagedScratch<scalar_t, acc_t>& scratch, DirectDots dots) {
  PrefetchSchedule<scalar_t> schedule(p, task);
  const WorkItem first = task.first_item();
  for (WorkItem item = first; item.cols > 0;) {
    const WorkItem next = task.following(item);
    const bool is_first = item.key0 == first.key0 && item.kv_head == first.kv_head;
    const HeadState<scalar_t, acc_t> state = scratch.head(item.kv_head - task.head_begin);
    schedule.start_item(item, next, is_first);
    score_pass(p, task, item, state, schedule, scratch, dots);
    value_pass(p, task, item, state, schedule.v_rows, schedule.keys_for_value_pass(next), scratch,
               dots);
    item = next;
  }
}

// finish_row with the sink joined to the row's softmax: out = o / (row_sum + e^(sink - max))
// and lse = log(e^sink + e^(the row's lse)), which merge_softmax_states gives for the row and
// a state of logsumexp `sink` whose output is 0 (a sink carries no value). A row that saw no
// key gets output 0 and lse = sink.
template <typename scalar_t, typename acc_t>
acc_t finish_row_with_sink(const acc_t* o_row, int64_t head_dim_v, double row_max, acc_t row_sum,
                           acc_t sink, scalar_t* out_row) {
  const bool empty = row_sum == acc_t(0);
  const acc_t row_lse = empty
                            ? -std::numeric_limits<acc_t>::infinity()
                            : static_cast<acc_t>(row_max + static_cast<double>(std::log(row_sum)));
  const MergedState<acc_t> merged = merge_softmax_states(row_lse, sink);
  store_row(o_row, head_dim_v, empty ? acc_t(0) : merged.weight_a / row_sum, out_row);
  return merged.lse;
}

// Writes a finished task's rows (out: q_t): with one key split, the normalised output and its
// logsumexp, the sink joined where there are sinks; with several, this split's normalised partial
// output and logsumexp in the workspaces, which merge_split_outputs folds together once every task
// is done. An 8-bit cache's value_unit_factor scales the output rows first.
template <typename q_t, typename scalar_t, typename acc_t>
void finish_task(const PagedAttentionParams& p, const PagedTask& task,
                 const PagedScratch<scalar_t, acc_t>& scratch) {
  using Vec = at::vec::Vectorized<acc_t>;
  const int64_t group = scratch.plan.group, splits = scratch.plan.splits;
  const auto value_factor = static_cast<acc_t>(value_unit_factor<scalar_t>(p));
  for (int64_t kv_head = task.head_begin; kv_head < task.head_end; ++kv_head) {
    const HeadState<scalar_t, acc_t> state = scratch.head(kv_head - task.head_begin);
    for (int64_t r = 0; r < task.rows; ++r) {
      acc_t* o_row = state.o + r * scratch.plan.ld_dv;
      if (task.widen_in_pairs) reorder_pair_groups(o_row, p.head_dim_v, false);
      if (value_factor != acc_t(1)) {
        at::vec::map([value_factor](Vec x) { return x * Vec(value_factor); }, o_row, o_row,
                     p.head_dim_v);
      }
      const int64_t token = task.q_begin + task.first_query + r / group;
      const int64_t head = kv_head * group + r % group;
      const int64_t lse_index = token * p.num_heads + head;
      const double row_max = state.row_max_log2[r] * kLn2;
      if (splits == 1) {
        q_t* out =
            static_cast<q_t*>(p.out) + token * p.out_strides.token + head * p.out_strides.head;
        static_cast<acc_t*>(p.lse)[lse_index] =
            p.sinks == nullptr
                ? finish_row(o_row, p.head_dim_v, row_max, state.row_sum[r], out)
                : finish_row_with_sink(o_row, p.head_dim_v, row_max, state.row_sum[r],
                                       sink_logit<acc_t>(p.sinks, head), out);
      } else {
        const int64_t partial_index = task.split * p.total_q * p.num_heads + lse_index;
        acc_t* partial = static_cast<acc_t*>(p.partial_out) + partial_index * p.head_dim_v;
        static_cast<acc_t*>(p.partial_lse)[partial_index] =
            finish_row(o_row, p.head_dim_v, row_max, state.row_sum[r], partial);
      }
    }
  }
}

// Folds the key splits' partial results into the output, one (token, head) row at a time, in
// split order: out and lse as one attention over all the keys (merge_softmax_states), and
// then, once, the head's sink: a state of logsumexp sink and output 0.
template <typename scalar_t>
void merge_split_outputs(const PagedAttentionParams& p) {
  using acc_t = typename AccumulateType<scalar_t>::type;
  using Vec = at::vec::Vectorized<acc_t>;
  const acc_t* partial_out = static_cast<const acc_t*>(p.partial_out);  // [splits, rows, dim_v]
  const acc_t* partial_lse = static_cast<const acc_t*>(p.partial_lse);  // [splits, rows]
  const int64_t rows = p.total_q * p.num_heads, dim_v = p.head_dim_v;
  parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    acc_t* merged = thread_scratch<acc_t>(dim_v);
    for (int64_t index = begin; index < end; ++index) {
      acc_t lse = partial_lse[index];
      std::copy(partial_out + index * dim_v, partial_out + (index + 1) * dim_v, merged);
      for (int64_t split = 1; split < p.num_kv_splits; ++split) {
        const MergedState<acc_t> state =
            merge_softmax_states(lse, partial_lse[split * rows + index]);
        const acc_t* other = partial_out + (split * rows + index) * dim_v;
        at::vec::map2(
            [&state](Vec a, Vec b) { return a * Vec(state.weight_a) + b * Vec(state.weight_b); },
            merged, merged, other, dim_v);
        lse = state.lse;
      }
      const int64_t token = index / p.num_heads, head = index % p.num_heads;
      acc_t weight = 1;
      if (p.sinks != nullptr) {
        const MergedState<acc_t> state =
            merge_softmax_states(lse, sink_logit<acc_t>(p.sinks, head));
        weight = state.weight_a;
        lse = state.lse;
      }
      store_row(
          merged, dim_v, weight,
          static_cast<scalar_t*>(p.out) + token * p.out_strides.token + head * p.out_strides.head);
      static_cast<acc_t*>(p.lse)[index] = lse;
    }
  });
}

// Paged attention in one ISA build for queries and outputs of q_t and a cache of scalar_t (q_t,
// or an 8-bit format): the tasks in parallel, each started, run item by item and finished, then
// the key splits merged.
template <typename q_t, typename scalar_t>
void paged_attention_kernel(const PagedAttentionParams& p, const PagedTaskPlan& tasks) {
  using Traits = PagedKernelTraits<scalar_t>;
  using acc_t = typename Traits::acc_t;
  const PagedCallPlan plan = plan_paged_call<acc_t>(p, tasks);
  DirectDots dots = DirectDots::kFloat;
#if defined(CPU_CAPABILITY_AVX512)
  constexpr bool kBf16Dots = Traits::kScoreByBf16Dots ||
                             (Traits::kScoreFp8ByBf16Dots && std::is_same_v<q_t, c10::BFloat16>);
  if (kBf16Dots && active_cpu_isa() == CpuIsa::kAvx512Bf16) {
    dots = Traits::kFp8ByTables && fp8_by_tables() ? DirectDots::kFp8TablePairs
                                                   : DirectDots::kBf16Pairs;
  }
  if (Traits::kInt16Dots && sizeof(q_t) == 2 && avx512_vnni_enabled())
    dots = DirectDots::kInt16Pairs;
#elif defined(CPU_CAPABILITY_AVX2)
  if (Traits::kInt16Dots && sizeof(q_t) == 2) dots = DirectDots::kInt16Pairs;
#endif
  parallel_tasks(plan.tasks, [&](ClaimedTasks& tasks) {
    const PagedScratch<scalar_t, acc_t> scratch(plan, p.head_dim);
    for (const int64_t index : tasks) {
      const PagedTask task = plan_task<scalar_t>(p, plan, index);
      if (task.rows == 0) continue;
      const DirectDots task_dots = start_task<q_t>(p, task, scratch, dots);
      run_task_items(p, task, scratch, task_dots);
      finish_task<q_t>(p, task, scratch);
    }
  });
  if (plan.splits > 1) merge_split_outputs<q_t>(p);
}

template <typename scalar_t>
void merge_states_kernel(const MergeStatesParams& p) {
  using acc_t = typename AccumulateType<scalar_t>::type;
  parallel_for(0, p.rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const MergedState<acc_t> state = merge_softmax_states(
          static_cast<const acc_t*>(p.lse_a)[row], static_cast<const acc_t*>(p.lse_b)[row]);
      const scalar_t* a = static_cast<const scalar_t*>(p.out_a) + row * p.out_a_stride;
      const scalar_t* b = static_cast<const scalar_t*>(p.out_b) + row * p.out_b_stride;
      scalar_t* out = static_cast<scalar_t*>(p.out) + row * p.out_stride;
      for (int64_t d = 0; d < p.head_dim; ++d) {
        // A side with weight 0 contributes nothing, even when its output holds garbage.
        const acc_t from_a =
            state.weight_a == acc_t(0) ? acc_t(0) : state.weight_a * static_cast<acc_t>(a[d]);
        const acc_t from_b =
            state.weight_b == acc_t(0) ? acc_t(0) : state.weight_b * static_cast<acc_t>(b[d]);
        out[d] = static_cast<scalar_t>(from_a + from_b);
      }
      static_cast<acc_t*>(p.lse)[row] = state.lse;
    }
  });
}

void paged_attention(const PagedAttentionParams& params, const PagedTaskPlan& plan) {
  dispatch_dtype(params.dtype, [&](auto tag) {
    using q_t = decltype(tag);
    if constexpr (std::is_same_v<q_t, double>) {  // the op layer gives 8-bit caches no fp64 q
      paged_attention_kernel<q_t, q_t>(params, plan);
    } else {
      switch (params.format) {
        case CacheFormat::kInt8: return paged_attention_kernel<q_t, int8_t>(params, plan);
        case CacheFormat::kFloat8E4M3:
          return paged_attention_kernel<q_t, c10::Float8_e4m3fn>(params, plan);
        case CacheFormat::kPlain: return paged_attention_kernel<q_t, q_t>(params, plan);
      }
    }
  });
}

void merge_attention_states(const MergeStatesParams& params) {
  dispatch_dtype(params.dtype, [&](auto tag) { merge_states_kernel<decltype(tag)>(params); });
}

}  // namespace CPU_CAPABILITY
}  // namespace mha_ext::cpu
