"""Qwen3.5's linear-attention layer, the gated delta rule (Gated DeltaNet), read top to bottom.

Per token t of a head, with a state S [dk, dv] that starts at 0 (or where a prefix left it):

    q_t, k_t  = l2-normalised (q_t also scaled by dk^-0.5)
    S        <- exp(g_t) S                          decay: g_t = -exp(A_log) softplus(a_t + dt_bias) <= 0
    S        <- S + k_t (beta_t (v_t - S^T k_t))^T  the delta rule: beta_t = sigmoid(b_t) of the error
    o_t       = S^T q_t

`gated_delta_recurrent` runs exactly that, a token at a time (decode). `gated_delta_chunked` gives
the same outputs for a whole sequence in chunks of C tokens: inside a chunk, with Gamma_t the
decay since the chunk's start and S_0 the state entering it, the updates d_t = beta_t (v_t -
Gamma_t S_0^T k_t - sum_{s<t} (Gamma_t / Gamma_s) (k_s . k_t) d_s) are one unit lower-triangular
solve, (I + A) D = beta V - beta Gamma K S_0 with A[t, s] = beta_t (Gamma_t / Gamma_s) (k_t . k_s)
for s < t; the outputs are o_t = Gamma_t S_0^T q_t + sum_{s<=t} (Gamma_t / Gamma_s) (q_t . k_s) d_s,
and the chunk leaves S_C = Gamma_C S_0 + sum_s (Gamma_C / Gamma_s) k_s d_s^T. The chunks run in
order; everything inside one is matmuls (training and prefill).

The layer (`GatedDeltaNet`, Hugging Face's names and shapes, `model.layers.{i}.linear_attn.*`):
x -> in_proj_qkv (q, k: linear_num_key_heads x linear_key_head_dim each; v: linear_num_value_heads
x linear_value_head_dim), a causal depthwise convolution of `linear_conv_kernel_dim` taps over
them with SiLU, in_proj_b -> beta, in_proj_a -> g; q and k repeated over the value heads they
serve; the rule above in float32; each value head's output RMS-normalised, scaled by `norm.weight`
and gated by SiLU(in_proj_z(x)); out_proj.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


def _l2_normalised(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def gated_delta_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule a token at a time. q, k [B, T, H, dk], v [B, T, H, dv], g, beta [B, T, H] (q and k
    normalised and scaled already); state [B, H, dk, dv] (None: zeros). -> (o [B, T, H, dv],
    the final state), in float32."""
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    s = q.new_zeros((B, H, dk, dv), dtype=torch.float32) if state is None else state.float()
    out = []
    for t in range(T):
        s = s * g[:, t].float().exp()[..., None, None]
        k_t = k[:, t].float()
        error = v[:, t].float() - torch.einsum("bhkv,bhk->bhv", s, k_t)
        s = s + k_t[..., None] * (beta[:, t].float()[..., None] * error)[..., None, :]
        out.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t].float()))
    return torch.stack(out, dim=1), s


def gated_delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor | None = None,
    chunk: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over chunks of `chunk` tokens (module doc): the same arguments and results as
    `gated_delta_recurrent`."""
    B, T, H, dk = k.shape
    dv = v.shape[-1]
    pad = -T % chunk
    # [B, H, chunks, C, ...], float32; padding at the end decays nothing (g 0) and writes nothing (beta 0).
    q, k, v = (F.pad(x.float(), (0, 0, 0, 0, 0, pad)).transpose(1, 2) for x in (q, k, v))
    g, beta = (F.pad(x.float(), (0, 0, 0, pad)).transpose(1, 2) for x in (g, beta))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, H, n, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(B, H, n, chunk), beta.reshape(B, H, n, chunk)
    log_decay = g.cumsum(-1)  # log Gamma_t inside each chunk
    decay = log_decay.exp()[..., None]  # Gamma_t
    ratio = log_decay[..., :, None] - log_decay[..., None, :]  # log Gamma_t / Gamma_s
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    ratio = ratio.masked_fill(~lower, float("-inf")).exp()  # 0 above the diagonal
    strict = ratio.masked_fill(torch.eye(chunk, dtype=torch.bool, device=q.device), 0.0)
    system = torch.eye(chunk, device=q.device) + beta[..., None] * (k @ k.transpose(-1, -2)) * strict
    # D = U - W S_0: U from the values, W from the keys (decayed from the chunk's start).
    u = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, beta[..., None] * decay * k, upper=False, unitriangular=True)
    attention = (q @ k.transpose(-1, -2)) * ratio  # (q_t . k_s) Gamma_t / Gamma_s, s <= t
    q_decayed = q * decay
    k_to_end = k * (log_decay[..., -1:] - log_decay).exp()[..., None]
    chunk_decay = log_decay[..., -1].exp()
    s = q.new_zeros((B, H, dk, dv)) if state is None else state.float()
    out = torch.empty_like(v)
    for c in range(n):
        d = u[:, :, c] - w[:, :, c] @ s
        out[:, :, c] = q_decayed[:, :, c] @ s + attention[:, :, c] @ d
        s = chunk_decay[:, :, c, None, None] * s + k_to_end[:, :, c].transpose(-1, -2) @ d
    out = out.reshape(B, H, n * chunk, dv)[:, :, :T].transpose(1, 2)
    return out, s


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head's output, scaled by `weight` (plain: it starts at 1), gated by
    SiLU(gate), in float32 (HF's Qwen3_5RMSNormGated)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)).to(dtype)
        return (self.weight * normed * F.silu(gate.float())).to(dtype)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention mixer (module doc). `forward(x)`: whole sequences from a zero
    state (training; right padding is harmless, the rule is causal), or, with the engine's
    `cache`, from each row's state kept there (`cache.recur`, which calls `mix`)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = cfg.linear_key_dim, cfg.linear_value_dim
        h, conv_dim, taps = cfg.hidden_size, cfg.linear_conv_dim, cfg.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, taps, groups=conv_dim, bias=False, padding=taps - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, h, bias=False)
        self.in_proj_qkv = nn.Linear(h, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(h, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(h, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(h, self.num_v_heads, bias=False)

    def forward(self, x: torch.Tensor, cache: object | None = None) -> torch.Tensor:
        if cache is None:
            return self.mix(x)[0]
        recur = getattr(cache, "recur", None)
        if recur is None:
            raise ValueError(
                "a Gated DeltaNet layer carries a recurrent state, not k/v: this cache keeps none "
                "(the trainer's shared-prefix attention computes such rows whole)"
            )
        return recur(self.layer_idx, self, x)

    def initial_state(self, rows: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A zero conv window [rows, channels, taps - 1] (`like`'s dtype) and state [rows, Hv, dk,
        dv] (float32): where every sequence starts."""
        taps = self.conv1d.kernel_size[0]
        window = like.new_zeros((rows, self.conv1d.in_channels, taps - 1))
        state = like.new_zeros(
            (rows, self.num_v_heads, self.head_k_dim, self.head_v_dim), dtype=torch.float32
        )
        return window, state

    def mix(
        self,
        x: torch.Tensor,
        window: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] from conv `window` [B, channels, taps - 1] (the inputs before x) and
        `state` [B, Hv, dk, dv] (None: zeros) -> (out [B, T, hidden], each row's window and state
        after its first lengths[b] tokens (None: all T; the tokens after are padding, which
        changes neither)). One token is a recurrent step; more run in chunks."""
        B, T, _ = x.shape
        if window is None or state is None:
            window, state = self.initial_state(B, x)
        mixed = torch.cat([window.to(x.dtype), self.in_proj_qkv(x).transpose(1, 2)], dim=-1)  # [B, C, K-1+T]
        taps = window.shape[-1] + 1
        if lengths is None:
            window = mixed[..., -(taps - 1) :] if taps > 1 else window
        else:  # each row's last taps - 1 inputs before its padding
            ends = lengths.to(x.device)[:, None] + torch.arange(taps - 1, device=x.device)
            window = mixed.gather(-1, ends[:, None, :].expand(-1, mixed.shape[1], -1))
        mixed = F.silu(F.conv1d(mixed, self.conv1d.weight, groups=mixed.shape[1])).transpose(1, 2)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(B, T, self.num_k_heads, self.head_k_dim)
        k = k.reshape(B, T, self.num_k_heads, self.head_k_dim)
        v = v.reshape(B, T, self.num_v_heads, self.head_v_dim)
        beta = torch.sigmoid(self.in_proj_b(x))
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        if lengths is not None:  # padding: no decay (g 0), no write (beta 0)
            real = torch.arange(T, device=x.device)[None, :] < lengths.to(x.device)[:, None]
            beta, g = beta * real[..., None], g * real[..., None]
        repeat = self.num_v_heads // self.num_k_heads
        if repeat > 1:  # each key head serves `repeat` value heads
            q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
        q = _l2_normalised(q.float()) * self.head_k_dim**-0.5
        k = _l2_normalised(k.float())
        rule = gated_delta_recurrent if T == 1 else gated_delta_chunked
        out, state = rule(q, k, v, g, beta, state)
        z = self.in_proj_z(x).reshape(B, T, self.num_v_heads, self.head_v_dim)
        out = self.norm(out.to(x.dtype), z)
        return self.out_proj(out.reshape(B, T, self.value_dim)), window, state


__all__ = ["GatedDeltaNet", "GatedRMSNorm", "gated_delta_chunked", "gated_delta_recurrent"]
