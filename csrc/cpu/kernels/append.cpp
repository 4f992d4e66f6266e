// The CPU append kernel (see kernels.h).
#include "cpu/parallel.h"

#include <cstring>

#include "cpu/kernels/kernels.h"
#include "mha_ext/paged_cache.h"

namespace mha_ext::cpu {

// Appending is a copy of each (token, kv head) row into its slot: no arithmetic, so one
// portable loop serves every dtype.
void paged_kv_append(const PagedAppendParams& p) {
  const char* key = static_cast<const char*>(p.key);
  const char* value = static_cast<const char*>(p.value);
  char* k_cache = static_cast<char*>(p.k_cache);
  char* v_cache = static_cast<char*>(p.v_cache);
  const int64_t bytes = p.element_size;
  parallel_for(0, p.num_tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      if (p.slot_mapping[t] < 0) continue;  // padding token
      const CacheSlot slot = slot_location(p.slot_mapping[t], p.block_size);
      for (int64_t h = 0; h < p.num_kv_heads; ++h) {
        std::memcpy(k_cache + (slot.block * p.k_cache_strides.block + h * p.k_cache_strides.head +
                               slot.offset * p.k_cache_strides.offset) *
                                  bytes,
                    key + (t * p.key_strides.token + h * p.key_strides.head) * bytes,
                    p.head_dim * bytes);
        std::memcpy(v_cache + (slot.block * p.v_cache_strides.block + h * p.v_cache_strides.head +
                               slot.offset * p.v_cache_strides.offset) *
                                  bytes,
                    value + (t * p.value_strides.token + h * p.value_strides.head) * bytes,
                    p.head_dim_v * bytes);
      }
    }
  });
}

}  // namespace mha_ext::cpu
