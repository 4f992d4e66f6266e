"""Hugging Face transformers on mha_ext's kernels: attn_implementation="mha_ext".

    import mha_ext.integrations.transformers as mha_ext_hf
    mha_ext_hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="mha_ext")

register() adds two entries under the name "mha_ext":
- the attention function (AttentionInterface), which the models' attention layers call with
  q (B, H, Sq, D) and k, v (B, Hkv, Sk, D) and which returns (B, Sq, H, D);
- the mask function (AttentionMaskInterface). Without it transformers builds no mask at all
  for an unknown implementation, and padding would be silently ignored. The masks it builds:
    None            plain causal or sliding-window causal attention with no padding: the
                    attention function runs mha_ext's fused causal / window paths;
    (B, Sk) bool    the same with padding, True = attend: it becomes a (B, 1, 1, Sk) key mask
                    beside the fused causal / window paths (O(B * Sk), nothing dense);
    4-D             every other pattern (packed position_ids, chunked attention, masks
                    combined with or_mask/and_mask functions, static caches): transformers'
                    dense boolean mask, which the attention function applies as it is.
It also lets transformers' continuous batching accept "mha_ext" (see
_allow_in_continuous_batching).

The attention function's paths, in the order transformers' flash-attention path takes them:
1. a (B, Sk) padding mask: mha_ext.attention with the (B, 1, 1, Sk) key mask beside the
   fused causal / window paths;
2. packed sequences -- cu_seq_lens_q / cu_seq_lens_k given (continuous batching,
   DataCollatorWithFlattening(return_flash_attn_kwargs=True)), or batch-1 position_ids that
   restart without a cache -- run through mha_ext.attention_varlen, each sequence alone,
   causal and windowed per sequence. A 4-D mask built for the same packing is not needed
   there and is not applied (as in transformers' flash-attention path);
3. otherwise mha_ext.attention: with a 4-D mask the mask alone decides which keys a query
   sees (as in "sdpa" and "eager"); with none, causal (bottom-right) and the sliding window
   come from the layer.
Softcap (Gemma 2), attention sinks s_aux (gpt-oss), scaling and dropout apply on every path;
grouped kv heads are read in place, never repeated.
"""

import functools
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..functional import attention, attention_varlen

try:
    from transformers import AttentionInterface
    from transformers.generation.continuous_batching import ContinuousBatchingManager
    from transformers.masking_utils import (
        AttentionMaskInterface,
        causal_mask_function,
        prepare_padding_mask,
        sdpa_mask,
    )
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "mha_ext.integrations.transformers needs Hugging Face transformers >= 5.0: "
        "pip install 'mha_ext[transformers]'"
    ) from error

NAME = "mha_ext"


def register() -> None:
    """Registers attn_implementation="mha_ext" with transformers (attention and mask
    functions) and lets continuous batching (generate_batch) run it. Idempotent."""
    AttentionInterface.register(NAME, mha_ext_attention_forward)
    AttentionMaskInterface.register(NAME, mha_ext_mask)
    _allow_in_continuous_batching()


def mha_ext_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Optional[Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    is_causal: Optional[bool] = None,
    s_aux: Optional[Tensor] = None,
    position_ids: Optional[Tensor] = None,
    cu_seq_lens_q: Optional[Tensor] = None,
    cu_seq_lens_k: Optional[Tensor] = None,
    max_length_q: Optional[int] = None,
    max_length_k: Optional[int] = None,
    **kwargs,
) -> Tuple[Tensor, None]:
    """transformers' attention-function contract on mha_ext.

    Args:
        query: (B, H, Sq, D); key: (B, Hkv, Sk, D); value: (B, Hkv, Sk, Dv), Hkv dividing H.
        attention_mask: None, a (B, Sk) padding mask (True / 1 = attend) or a 4-D mask
            broadcastable to (B, H, Sq, Sk), bool (True = attend) or additive; see the
            module docstring for what each means.
        dropout, scaling: the attention dropout probability and the score scale.
        sliding_window: a query sees itself and the sliding_window - 1 keys before it
            (both sides when not causal), as in transformers' masks.
        softcap: Gemma 2's attention logit softcap. s_aux: (H,) attention-sink logits.
        is_causal: overrides module.is_causal (continuous batching passes it).
        position_ids, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k: packed
            sequences, as transformers passes them to flash attention.

    Returns:
        (out (B, Sq, H, Dv), None): mha_ext returns no attention weights.
    """
    _reject_unsupported(kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = _window(sliding_window, causal)
    options = dict(
        scale=scaling,
        window=window,
        dropout_p=dropout,
        softcap=0.0 if softcap is None else float(softcap),
        sinks=s_aux,
    )
    if attention_mask is not None and attention_mask.dim() == 2:
        # Padding comes before packing, as in transformers' flash-attention path.
        key_mask = _key_mask(attention_mask, key)
    else:
        packed = _packed_sequences(
            query, key, position_ids, cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k
        )
        if packed is not None:
            return _varlen_attention(query, key, value, packed, causal, options), None
        key_mask = attention_mask
        if attention_mask is not None:
            if attention_mask.dim() != 4:
                raise ValueError(
                    f"mha_ext attention: attention_mask must be None, (batch, kv_len) or 4-D, "
                    f"got shape {tuple(attention_mask.shape)}"
                )
            # transformers' 4-D masks hold the whole pattern, causality and window included.
            causal, options["window"] = False, None
            if attention_mask.dtype != torch.bool:
                key_mask = attention_mask.to(query.dtype)
    # (B, H, Sq, Dv) in query's memory order: a (B, Sq, H, D) view's transpose costs no copy.
    out = attention(
        query,
        key,
        value,
        causal="bottom_right" if causal else None,
        attn_mask=key_mask,
        **options,
    )
    return out.transpose(1, 2).contiguous(), None


def mha_ext_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset=0,
    kv_offset: int = 0,
    mask_function=causal_mask_function,
    attention_mask: Optional[Tensor] = None,
    local_size: Optional[int] = None,
    allow_is_causal_skip: bool = True,
    allow_is_bidirectional_skip: bool = False,
    use_vmap: bool = False,
    device="cpu",
    **kwargs,
) -> Optional[Tensor]:
    """transformers' mask-function contract (AttentionMaskInterface) for "mha_ext".

    Returns None or a (batch, kv_length) padding mask when mha_ext's fused paths give the
    pattern exactly: plain causal or sliding-window causal (transformers allows skipping
    the dense mask: no or/and/packing overlay), the queries being the last keys. Otherwise
    the dense (batch, 1, q_length, kv_length) boolean mask that "sdpa" would get.
    """
    queries_are_last_keys = isinstance(q_offset, int) and q_offset + q_length == (
        kv_offset + kv_length
    )
    if (
        allow_is_causal_skip
        and queries_are_last_keys
        and _fused_pattern(mask_function, local_size, device)
    ):
        if attention_mask is None:
            return None
        padding_mask = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        padding_mask = padding_mask[:, kv_offset : kv_offset + kv_length]  # (B, kv_length)
        # All-true padding is no padding: skip the key mask (one host sync, as sdpa_mask's).
        if not torch.compiler.is_compiling() and bool(padding_mask.all()):
            return None
        return padding_mask
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        mask_function=mask_function,
        attention_mask=attention_mask,
        local_size=local_size,
        allow_is_causal_skip=False,  # None means bottom-right causal here, not sdpa's top-left
        allow_is_bidirectional_skip=allow_is_bidirectional_skip,
        use_vmap=use_vmap,
        device=device,
    )


def _fused_pattern(mask_function, local_size: Optional[int], device) -> bool:
    """Whether mask_function is the causal pattern (local_size None) or the sliding-window
    causal pattern of local_size keys, i.e. what mha_ext's causal / window paths compute.

    transformers passes local_size both for sliding windows and for chunked attention
    (Llama 4); the chunked pattern hides keys a window shows, so the function is probed at a
    query local_size and keys 0, 1, local_size, local_size + 1, where the sliding window
    answers hidden, seen, seen, hidden and the chunked pattern hides key 1.
    """
    if local_size is None:
        return mask_function is causal_mask_function
    zero = torch.zeros((), dtype=torch.long, device=device)
    keys = torch.tensor([0, 1, local_size, local_size + 1], device=device)
    seen = mask_function(zero, zero, zero + local_size, keys)
    return seen.tolist() == [False, True, True, False]


def _window(sliding_window: Optional[int], causal: bool) -> Optional[Tuple[int, int]]:
    """mha_ext's (left, right) window for transformers' sliding_window: a query sees the
    sliding_window - 1 keys before it (and after it when not causal)."""
    if sliding_window is None:
        return None
    if not isinstance(sliding_window, int) or sliding_window < 1:
        raise ValueError(
            f"mha_ext attention: sliding_window must be an int >= 1, got {sliding_window!r}"
        )
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def _key_mask(padding_mask: Tensor, key: Tensor) -> Tensor:
    """(B, 1, 1, Sk) bool key mask of a (B, Sk) padding mask."""
    batch, kv_length = key.shape[0], key.shape[2]
    if padding_mask.shape[0] not in (1, batch) or padding_mask.shape[1] != kv_length:
        raise ValueError(
            f"mha_ext attention: the padding mask has shape {tuple(padding_mask.shape)}, "
            f"expected ({batch}, {kv_length}) for keys of shape {tuple(key.shape)}"
        )
    return padding_mask.bool()[:, None, None, :]


def _packed_sequences(
    query: Tensor,
    key: Tensor,
    position_ids: Optional[Tensor],
    cu_seq_lens_q: Optional[Tensor],
    cu_seq_lens_k: Optional[Tensor],
    max_length_q: Optional[int],
    max_length_k: Optional[int],
) -> Optional[Tuple[Tensor, Tensor, int, int]]:
    """(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) int32 when the batch rows
    hold packed sequences, else None.

    Given cu_seq_lens, those. Otherwise batch-1 position_ids, with no cached keys, that do
    not run on by one somewhere: a sequence starts at index 0 and wherever a position is not
    its predecessor + 1, as transformers' packed masks split them.
    """
    if (cu_seq_lens_q is None) != (cu_seq_lens_k is None):
        raise ValueError(
            "mha_ext attention: cu_seq_lens_q and cu_seq_lens_k come together, got only "
            + ("cu_seq_lens_q" if cu_seq_lens_k is None else "cu_seq_lens_k")
        )
    if cu_seq_lens_q is not None:
        cu_q, cu_k = cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32)
        max_q = int(cu_q.diff().max()) if max_length_q is None else int(max_length_q)
        max_k = int(cu_k.diff().max()) if max_length_k is None else int(max_length_k)
        return cu_q, cu_k, max_q, max_k
    seq_len = query.shape[2]
    one_row = position_ids is not None and position_ids.numel() == seq_len  # not M-RoPE's (3, ...)
    if not one_row or query.shape[0] != 1 or seq_len < 2 or key.shape[2] != seq_len:
        return None
    positions = position_ids.reshape(-1)
    restarts = torch.nonzero(positions.diff() != 1).flatten() + 1
    if restarts.numel() == 0:
        return None
    ends = restarts.new_tensor([0, seq_len])
    cu_seqlens = torch.cat([ends[:1], restarts, ends[1:]]).to(torch.int32)
    max_seqlen = int(cu_seqlens.diff().max())
    return cu_seqlens, cu_seqlens, max_seqlen, max_seqlen


def _varlen_attention(
    query: Tensor, key: Tensor, value: Tensor, packed, causal: bool, options: dict
) -> Tensor:
    """Packed attention: (B, H, S, D) rows flattened to (B * S, H, D), out (B, S, H, Dv)."""
    cu_q, cu_k, max_q, max_k = packed
    batch, heads, seq_q, _ = query.shape
    # (B, H, S, D) -> (B * S, H, D): a view for a transposed (B, S, H, D) projection.
    q, k, v = (x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in (query, key, value))
    out = attention_varlen(
        q, k, v, cu_q, cu_k, max_q, max_k, causal="bottom_right" if causal else None, **options
    )
    return out.view(batch, seq_q, heads, out.shape[-1])


def _reject_unsupported(kwargs: dict) -> None:
    """Clear errors for what transformers may ask that mha_ext does not do."""
    if kwargs.get("output_attentions"):
        raise ValueError(
            "mha_ext attention: output_attentions=True needs the attention weights, which the "
            'fused kernels never form; use attn_implementation="eager" for them'
        )
    if kwargs.get("position_bias") is not None:
        raise ValueError(
            "mha_ext attention: position_bias (T5-style learned biases) is not supported; "
            'use attn_implementation="sdpa" or "eager"'
        )
    if kwargs.get("block_table") is not None:
        raise ValueError(
            "mha_ext attention: transformers' block-table decode path (flash_attn_with_kvcache "
            "on a paged cache) is not supported; continuous batching's index path is"
        )


def _allow_in_continuous_batching() -> None:
    """Lets ContinuousBatchingManager keep a model on "mha_ext".

    transformers 5.24's manager accepts only "paged|eager", "sdpa" and names containing
    "flash" (switch_to_cb_friendly_attn raises ValueError for any other), and a "flash" name
    makes from_config / set_attn_implementation load a flash-attn package or Hub kernel. Its
    index path needs nothing the attention function lacks: it writes the paged cache itself,
    then calls the attention function with the sequences' keys gathered, cu_seq_lens_q / _k,
    max_length_q / _k and is_causal=True, and no mask for implementations other than
    "paged|eager" / "sdpa". So the check is wrapped to leave a model on "mha_ext" as it is
    and to defer to transformers for every other name.
    """
    check = ContinuousBatchingManager.switch_to_cb_friendly_attn
    if getattr(check, "_keeps_mha_ext", False):
        return

    @functools.wraps(check)
    def switch_to_cb_friendly_attn(self, model, *args, **kwargs):
        if model.config._attn_implementation == NAME:
            return None
        return check(self, model, *args, **kwargs)

    switch_to_cb_friendly_attn._keeps_mha_ext = True
    ContinuousBatchingManager.switch_to_cb_friendly_attn = switch_to_cb_friendly_attn
