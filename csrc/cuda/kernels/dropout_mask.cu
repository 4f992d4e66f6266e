// The dropout keep-mask on the GPU, drawn with the same Philox counters as the CPU kernels
// (mha_ext/philox.h), so one seed gives one mask on every backend.
#include <algorithm>

#include "cuda/kernels/launchers.h"
#include "mha_ext/philox.h"

namespace mha_ext::cuda {
namespace {

constexpr int kThreads = 256;

// One thread per group of 4 keys in a row: one Philox call yields the group's 4 words.
// A grid-stride loop with int64 indices covers masks of more than 2^31 groups.
__global__ void dropout_mask_kernel(bool* keep, const int64_t* seed, DropoutParams dropout,
                                    int64_t num_heads, int64_t seq_q, int64_t seq_k,
                                    int64_t total_groups) {
  dropout.seed = static_cast<uint64_t>(*seed);
  const int64_t groups_per_row = (seq_k + 3) / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t group = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       group < total_groups; group += stride) {
    const int64_t row = group / groups_per_row;
    const int64_t col0 = group % groups_per_row * 4;
    const int64_t batch = row / (num_heads * seq_q);
    const int64_t head = row / seq_q % num_heads;
    const Philox4x32 bits = dropout_bits(dropout.seed, batch, head, row % seq_q, col0);
    for (int lane = 0; lane < 4 && col0 + lane < seq_k; ++lane) {
      keep[row * seq_k + col0 + lane] = dropout_word_kept(dropout, bits.word[lane]);
    }
  }
}

}  // namespace

cudaError_t launch_dropout_mask(bool* keep, const int64_t* seed, const DropoutParams& dropout,
                                int64_t batch, int64_t num_heads, int64_t seq_q, int64_t seq_k,
                                cudaStream_t stream) {
  const int64_t total_groups = batch * num_heads * seq_q * ((seq_k + 3) / 4);
  if (total_groups == 0) return cudaSuccess;
  // 65535 blocks of 256 threads saturate any current GPU; the loop covers the rest.
  const int64_t blocks = std::min<int64_t>((total_groups + kThreads - 1) / kThreads, 65535);
  dropout_mask_kernel<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(
      keep, seed, dropout, num_heads, seq_q, seq_k, total_groups);
  return cudaGetLastError();
}

}  // namespace mha_ext::cuda
