#pragma once
// The CPU paged_attention op's run setup, shared with the C++ benchmark so that it times the
// plan the op runs.
#include "paged_checks.h"

namespace mha_ext::cpu {

// Plans the run for this process's thread count (plan_paged_tasks: kv heads per task, key
// splits) into params and allocates the outputs and split workspaces it needs.
PagedAttentionOutputs prepare_paged_run(PagedAttentionParams& params, const at::Tensor& q);

}  // namespace mha_ext::cpu
