#pragma once
// Tile sizes of the CPU attention kernels, also needed by the op layer to size workspaces.
#include <cstdint>

namespace mha_ext::cpu {

// Rows of the query and key blocks that the kernels tile attention into. 64 x 64 tiles: for
// head_dim 128 the forward's Q, K^T, V, S and O tiles take 144 KiB of fp32 scratch, well
// inside a core's 1 MiB L2, and each K/V tile converted to fp32 serves 64 query rows.
constexpr int64_t kQueryBlock = 64;
constexpr int64_t kKeyBlock = 64;

}  // namespace mha_ext::cpu
