"""The model's attention entry point, `scaled_dot_product_attention`: torch's SDPA (GQA), except
where torch 2.13's CPU flash kernel is slow: bf16 on a CPU, whose attention there runs as explicit
matmuls (`matmul_attention`). agents/model/transformer.py, torch's attention over the KV cache
(agents/engine/cache_attention.py) and the trainer's shared-prefix attention all call it; measurements are in bench/RESULTS.md
('bench/vs_trl.py' for training, 'bench/generate.py' for the engine's prefills)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Score elements (batch x heads x queries x keys) up to which a CPU bf16 training attention
# runs as explicit matmuls: ~10 bytes each are held for backward, 320 MiB at this bound.
MATMUL_ATTENTION_MAX_SCORES = 1 << 25
# Score elements per piece of a CPU bf16 inference attention run as matmuls (rows at a time):
# 2 MiB of float32 scores, an L2's worth. Whole-batch score tensors of tens of MiB cost more in
# page faults (glibc maps and unmaps allocations that large) than the matmuls do.
MATMUL_INFERENCE_CHUNK_SCORES = 1 << 19


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles, with which torch's flash kernel runs bf16 fast."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def scaled_dot_product_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    matmul: bool | None = None,
    sinks: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention(..., enable_gqa=True)` (kwargs: its mask arguments), except:
    - with `sinks` [H] (gpt-oss's attention sinks), `attention_with_sinks`;
    - a CPU bf16 attention (bf16 inputs, or under bf16 autocast) of fewer than 256 queries that
      autograd will differentiate (the trainer's rows of RL episodes and shared-prefix remainders)
      is `matmul_attention` (bf16 matmuls, the softmax in float32), or, when its score tensor
      would pass MATMUL_ATTENTION_MAX_SCORES, float32 SDPA cast back to bf16: torch's CPU flash
      kernel is slow at those sizes, in bf16 most of all (bench/RESULTS.md, 'bench/vs_trl.py');
    - a bf16 inference attention on a CPU (the engine's prefills) is `matmul_attention` in pieces
      of MATMUL_INFERENCE_CHUNK_SCORES score elements where `matmul` says so (the engine's
      backend decides: bf16 on a CPU without AMX tiles; None asks the CPU here), unless one row's
      scores pass that size (bench/RESULTS.md, 'bench/generate.py')."""
    if sinks is not None:
        return attention_with_sinks(q, k, v, sinks, matmul=matmul, **kwargs)
    device = q.device.type
    autocast = torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else q.dtype
    if (
        device == "cpu"
        and dtype == torch.bfloat16
        and q.shape[-2] < 256
        and torch.is_grad_enabled()
        and (q.requires_grad or k.requires_grad or v.requires_grad)
    ):
        if q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2] <= MATMUL_ATTENTION_MAX_SCORES:
            return matmul_attention(q.to(dtype), k.to(dtype), v.to(dtype), **kwargs)
        mask = kwargs.get("attn_mask")
        if mask is not None and mask.is_floating_point():
            kwargs["attn_mask"] = mask.float()
        with torch.autocast(device, enabled=False):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True, **kwargs)
        return out.to(dtype)
    if device == "cpu" and q.dtype == dtype == torch.bfloat16 and not torch.is_grad_enabled():
        rows = MATMUL_INFERENCE_CHUNK_SCORES // (q.shape[1] * q.shape[2] * k.shape[2])
        if matmul is None:
            matmul = not cpu_has_amx()
        if rows and k.shape[0] == v.shape[0] == q.shape[0] and matmul:
            return matmul_attention_in_pieces(q, k, v, rows, **kwargs)
    return F.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kwargs)


def attention_with_sinks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sinks: torch.Tensor,
    *,
    matmul: bool | None = None,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """Attention with a learned sink logit per query head (gpt-oss, transformers' eager form):
    softmax over [scores, sink] with the sink's column dropped, so each row's weights sum to less
    than 1 and a head may attend to nothing. Computed as one more key whose k and v are zero, with
    the sink as its additive mask (q . 0 = 0, + sink): q [B, H, Lq, D], k/v [B, Hkv, Lk, D],
    attn_mask bool (True: attend) or additive, broadcastable to [B, H, Lq, Lk]; is_causal: query
    i sees keys 0..i (SDPA's). A sink that autograd differentiates runs as `matmul_attention` (the
    mask's gradient is the sink's)."""
    H, Lq = q.shape[1], q.shape[2]
    Lk = k.shape[2]
    if is_causal:
        attn_mask = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril()
    if attn_mask is None:
        bias = torch.zeros(1, 1, Lq, Lk, device=q.device)
    elif attn_mask.dtype == torch.bool:
        bias = torch.zeros(attn_mask.shape, device=q.device).masked_fill_(~attn_mask, float("-inf"))
    else:
        bias = attn_mask.float()
    bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    rows = bias.shape[0]
    sink = sinks.float().view(1, H, 1, 1).expand(rows, H, Lq, 1)
    bias = torch.cat([bias.expand(rows, H, Lq, Lk), sink], dim=-1)
    zero = k.new_zeros(k.shape[0], k.shape[1], 1, k.shape[3])
    k, v = torch.cat([k, zero], dim=2), torch.cat([v, zero.to(v.dtype)], dim=2)
    dtype = torch.get_autocast_dtype(q.device.type) if torch.is_autocast_enabled(q.device.type) else q.dtype
    if sinks.requires_grad and torch.is_grad_enabled():
        return matmul_attention(q.to(dtype), k.to(dtype), v.to(dtype), bias)
    return scaled_dot_product_attention(q, k, v, matmul=matmul, attn_mask=bias.to(dtype))


def sliding_causal_mask(
    queries: int, keys: int, window: int, device: torch.device | str, offset: int | None = None
) -> torch.Tensor:
    """bool [queries, keys], True where a query may look: query t, at key position offset + t
    (default keys - queries: the queries are the last keys), sees key j when j <= offset + t and
    j > offset + t - window, i.e. its own position and the window - 1 before it (transformers'
    sliding mask, `kv_idx > q_idx - sliding_window`)."""
    offset = keys - queries if offset is None else offset
    position = offset + torch.arange(queries, device=device)[:, None]
    key = torch.arange(keys, device=device)[None, :]
    return (key <= position) & (key > position - window)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal self-attention of q [B, H, T, D] over k/v [B, Hkv, T, D] (a training forward), each
    query seeing only the last `window` positions up to its own where `window` is set; `sinks`:
    `attention_with_sinks`."""
    T = q.shape[2]
    if window is None or window >= T:
        return scaled_dot_product_attention(q, k, v, sinks=sinks, is_causal=True)
    mask = sliding_causal_mask(T, T, window, q.device)
    return scaled_dot_product_attention(q, k, v, sinks=sinks, attn_mask=mask)


def matmul_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + mask) v, GQA, as two batched matmuls in the inputs' dtype with the
    scaling, mask and softmax in float32 (as HF's eager attention under bf16). q [B, H, Lq, D], k/v
    [B, Hkv, Lk, D]; attn_mask boolean (True: attend) or additive, broadcastable to [B, H, Lq, Lk];
    is_causal: query i sees keys 0..i. A masked score is float32's lowest value rather than -inf,
    so a row with every key masked averages v instead of giving NaN."""
    B, H, Lq, D = q.shape
    kv_heads, Lk = k.shape[1], k.shape[2]
    groups = H // kv_heads
    if is_causal:
        attn_mask = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril()
    # A float32 bias, so the scores it is added to are float32.
    if attn_mask is None:
        bias = torch.zeros(Lq, Lk, device=q.device)
    elif attn_mask.dtype == torch.bool:
        bias = torch.zeros(attn_mask.shape, device=q.device)
        bias.masked_fill_(~attn_mask, torch.finfo(torch.float32).min)
    else:
        bias = attn_mask.float()
    # [b, h, Lq, Lk] -> [b, Hkv or 1, G or 1, Lq, Lk], broadcast by the add below: an expanded
    # bias's strides cost the add several times over.
    bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    bias = bias.unsqueeze(2) if bias.shape[1] == 1 else bias.unflatten(1, (kv_heads, groups))
    with torch.autocast(q.device.type, enabled=False):
        # The G query heads of a kv head are rows of one matmul: each key is read once.
        scores = torch.matmul(q.reshape(B, kv_heads, groups * Lq, D), k.transpose(-1, -2))
        scores = torch.add(bias, scores.view(B, kv_heads, groups, Lq, Lk), alpha=D**-0.5)
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.matmul(probs.view(B, kv_heads, groups * Lq, Lk), v).view(B, H, Lq, D)


def matmul_attention_in_pieces(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rows: int,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """`matmul_attention`, `rows` batch rows at a time (inference: nothing is kept for backward),
    so its score tensors stay small."""
    if is_causal:
        attn_mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if rows >= q.shape[0]:
        return matmul_attention(q, k, v, attn_mask)
    out = torch.empty_like(q)
    for start in range(0, q.shape[0], rows):
        piece = slice(start, start + rows)
        mask = attn_mask
        if mask is not None and mask.dim() == 4 and mask.shape[0] > 1:
            mask = mask[piece]
        out[piece] = matmul_attention(q[piece], k[piece], v[piece], mask)
    return out


__all__ = [
    "MATMUL_ATTENTION_MAX_SCORES",
    "MATMUL_INFERENCE_CHUNK_SCORES",
    "attention_with_sinks",
    "causal_attention",
    "cpu_has_amx",
    "matmul_attention",
    "matmul_attention_in_pieces",
    "scaled_dot_product_attention",
    "sliding_causal_mask",
]
