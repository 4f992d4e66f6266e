"""A textbook reference of issue 29's score features (softcap, ALiBi, sinks) and of packed
(varlen) calls, for the CUDA tests: explicit score matrices as in mha_ext.reference, run in
float64 for the ground truth and in the kernel's dtype for the accuracy rule's baseline."""

import torch


def featured_attention(
    q,
    k,
    v,
    *,
    window=(-1, -1),
    bottom_right=False,
    scale=None,
    softcap=0.0,
    alibi_slopes=None,
    sinks=None,
    dropout_keep=None,
    dropout_p=0.0,
):
    """(out, lse) of one dense call. q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv);
    alibi_slopes (H,) or (B, H); sinks (H,); dropout_keep (B, H, Sq, Sk) bool. Sides of
    `window` are -1 for unbounded, counted from the diagonal bottom_right chooses."""
    batch, heads, seq_q, head_dim = q.shape
    seq_k = k.shape[2]
    group = heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (B, H, Sk, D)
    v = v.repeat_interleave(group, dim=1)  # (B, H, Sk, Dv)
    scale = head_dim**-0.5 if scale is None else scale
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, Sq, Sk)
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    rows = torch.arange(seq_q, device=q.device)[:, None]
    keys = torch.arange(seq_k, device=q.device)[None, :]
    diagonal = rows + (seq_k - seq_q if bottom_right else 0)  # (Sq, 1)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(scores.dtype).reshape(-1, heads, 1, 1)  # (1 or B, H, 1, 1)
        scores = scores - slopes * (diagonal - keys).abs().to(scores.dtype)
    left, right = window
    visible = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device)
    if left >= 0:
        visible &= keys >= diagonal - left
    if right >= 0:
        visible &= keys <= diagonal + right
    scores = scores.masked_fill(~visible, float("-inf"))
    logits = scores
    if sinks is not None:
        sink_column = sinks.to(scores.dtype).view(1, heads, 1, 1).expand(batch, heads, seq_q, 1)
        logits = torch.cat([scores, sink_column], dim=-1)
    # Rows that see nothing (no key, no sink): lse -inf and output 0, without NaN gradients.
    empty = (logits == float("-inf")).all(dim=-1)  # (B, H, Sq)
    lse = torch.logsumexp(logits.masked_fill(empty[..., None], 0.0), dim=-1)
    probs = torch.exp(scores - lse.masked_fill(empty, 0.0)[..., None])
    if dropout_keep is not None:
        probs = probs * dropout_keep / (1.0 - dropout_p)
    return torch.matmul(probs, v), lse.masked_fill(empty, float("-inf"))


def featured_attention_varlen(
    q, k, v, cu_seqlens_q, cu_seqlens_k, seqused_k=None, dropout_keep=None, **options
):
    """(out, lse) of one packed call, sequence by sequence: q (total_q, H, D), k/v (total_k,
    Hkv, D(v)); out (total_q, H, Dv), lse (H, total_q). alibi_slopes (batch, H) give each
    sequence its row; dropout_keep (batch, H, max_seqlen_q, max_seqlen_k) its corner."""
    outs, lses = [], []
    alibi_slopes = options.pop("alibi_slopes", None)
    for b in range(len(cu_seqlens_q) - 1):
        q_begin, q_end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        k_begin, k_end = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        if seqused_k is not None:
            k_end = k_begin + int(seqused_k[b])
        as_batch = [t.transpose(0, 1)[None] for t in (q[q_begin:q_end], k[k_begin:k_end])]
        value = v[k_begin:k_end].transpose(0, 1)[None]
        slopes = alibi_slopes
        if alibi_slopes is not None and alibi_slopes.dim() == 2:
            slopes = alibi_slopes[b]
        keep = None
        if dropout_keep is not None:
            keep = dropout_keep[b : b + 1, :, : q_end - q_begin, : k_end - k_begin]
        out, lse = featured_attention(
            *as_batch, value, alibi_slopes=slopes, dropout_keep=keep, **options
        )
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)
