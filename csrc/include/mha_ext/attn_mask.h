#pragma once
// Where attn_mask holds the entry of (batch, head, query row, key col), shared by every
// backend: broadcast dims have stride 0 (see AttnMaskParams).
#include <cstdint>

#include "mha_ext/attention_params.h"
#include "mha_ext/macros.h"

namespace mha_ext {

MHA_EXT_BEGIN_ISA_NAMESPACE

MHA_EXT_HOST_DEVICE int64_t mask_offset(const AttnMaskParams& mask, int64_t batch, int64_t head,
                                        int64_t row, int64_t col) {
  return batch * mask.batch_stride + head * mask.head_stride + row * mask.row_stride +
         col * mask.col_stride;
}

MHA_EXT_END_ISA_NAMESPACE

}  // namespace mha_ext
