#pragma once
// Tile sizes of the CPU attention kernels, also needed by the op layer to size workspaces.
#include <cstdint>

namespace mha_ext::cpu {

// Rows of the query and key blocks that the kernels tile attention into. 64 x 64 tiles: at
// head_dim 128 a forward task's Q and O tiles for its up to 8 sub-blocks plus one K^T, V
// and S tile take about 600 KiB of fp32 scratch, inside a core's L2, and each K/V tile
// converted to fp32 serves up to 8 x 64 query rows. 128-key tiles measured slower here.
constexpr int64_t kQueryBlock = 64;
constexpr int64_t kKeyBlock = 64;

}  // namespace mha_ext::cpu
