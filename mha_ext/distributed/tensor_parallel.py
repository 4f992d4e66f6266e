"""Tensor-parallel MultiHeadAttention (Megatron-style) through torch.distributed.tensor.parallel.

Each rank of a 1-D device mesh of size W holds num_heads / W query heads and num_kv_heads / W
key/value heads: w_q, w_k and w_v are split by output rows (ColwiseParallel: a contiguous block
of heads per rank, so rank r's query heads use exactly rank r's kv heads under GQA), attention
runs on the local heads with no communication, and w_o is split by input columns
(RowwiseParallel: one all-reduce of the (B, S, d_model) output per forward, one of each input's
gradient per backward).
"""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from ..modules import MultiHeadAttention


def parallelize_attention(
    module: MultiHeadAttention, device_mesh: DeviceMesh
) -> MultiHeadAttention:
    """Shard `module`'s heads across `device_mesh` in place and return it.

    The projections' weights become DTensors (w_q / w_k / w_v sharded by rows, w_o by columns,
    w_o's bias replicated), the sinks (if any) a DTensor sharded by head, and the ALiBi slopes
    this rank's slice. module.num_heads and module.num_kv_heads become this rank's counts, which
    the forward reshapes by; a head_mask then has the local head count. Inputs and output stay
    plain (B, S, d_model) tensors replicated on every rank of the mesh. The weights come from
    the mesh's first rank (torch's src_data_rank=0), so the ranks need not build them alike.

    Args:
        module: an mha_ext.MultiHeadAttention, not parallelized yet.
        device_mesh: a 1-D mesh (for a 2-D mesh, pass its tensor-parallel dimension,
            mesh["tp"]); its size must divide num_heads and num_kv_heads.

    Context parallelism composes on another mesh dimension: set module.attention_function =
    context_parallel_attention_function(group=mesh["cp"].get_group()) and the module takes
    and returns this rank's sequence shards, (B, S / W_cp, d_model).
    """
    if not isinstance(module, MultiHeadAttention):
        raise TypeError(
            f"parallelize_attention: module must be an mha_ext.MultiHeadAttention, "
            f"got {type(module).__name__}"
        )
    if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 1:
        dims = getattr(device_mesh, "ndim", None)
        raise ValueError(
            f"parallelize_attention: device_mesh must be a 1-D DeviceMesh (a 2-D mesh's "
            f"tensor-parallel dimension, e.g. mesh['tp']), got {type(device_mesh).__name__} "
            f"with ndim {dims}"
        )
    if module.tensor_parallel_size != 1:
        raise ValueError(
            f"parallelize_attention: module is already split across "
            f"{module.tensor_parallel_size} ranks"
        )
    ranks = device_mesh.size()
    if module.num_heads % ranks or module.num_kv_heads % ranks:
        raise ValueError(
            f"parallelize_attention: the mesh size {ranks} must divide num_heads "
            f"{module.num_heads} and num_kv_heads {module.num_kv_heads} (each rank holds whole "
            f"heads)"
        )
    rank = device_mesh.get_local_rank()
    local_heads = module.num_heads // ranks
    parallelize_module(
        module,
        device_mesh,
        {
            "w_q": ColwiseParallel(),
            "w_k": ColwiseParallel(),
            "w_v": ColwiseParallel(),
            "w_o": RowwiseParallel(),
        },
    )
    if module.sinks is not None:
        # (num_heads,) -> this rank's (local_heads,) block of the same DTensor parameter, so
        # the optimizer sees DTensors only (torch's foreach kernels refuse a mix).
        module.sinks = nn.Parameter(distribute_tensor(module.sinks.data, device_mesh, [Shard(0)]))
    if module.alibi_slopes is not None:
        heads = slice(rank * local_heads, (rank + 1) * local_heads)
        module.alibi_slopes = module.alibi_slopes[heads].clone()  # (local_heads,) fp32
    module.num_heads = local_heads
    module.num_kv_heads //= ranks
    module.tensor_parallel_size = ranks
    return module
