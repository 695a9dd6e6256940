"""The Mamba-1 mixer shared by Jamba, Mamba (MambaForCausalLM) and Falcon-Mamba.

The three transformers mixers compute the same selective SSM and name their weights alike
(``in_proj``, ``conv1d``, ``x_proj``, ``dt_proj``, ``A_log``, ``D``, ``out_proj``); they differ
only in how dt, B and C are normalised after ``x_proj`` (:class:`Mamba1Config.dt_norm`). For a
flat batch of T new tokens::

    xs, z = split(in_proj(x), 2)                      (T, I) each
    xs = silu(causal_conv1d(xs))                      conv state (I, K - 1)
    dt_r, B, C = split(x_proj(xs), [R, N, N])
    dt_r, B, C = norm(dt_r), norm(B), norm(C)         per ``dt_norm`` (none for Mamba)
    dt = dt_proj.weight @ dt_r                        the bias goes inside the softplus
    y = selective_scan(xs, dt, A = -exp(A_log), B, C, D, z)     ssm state (I, N) float32
    out = out_proj(y)

The layer's state is ``StateSpec(kind="mamba1")`` (``core/spec_families.mamba1_state``):
``conv (I, K - 1)`` in the model dtype and ``ssm (I, N)``.

Tensor parallelism (as vLLM's Mamba-1): the I channels split over the ranks -- in_proj's xs
and z rows, conv channels, ``A_log``, ``D``, ``dt_proj`` rows and the states --; ``x_proj``
is row-parallel (its dt/B/C read every channel: one all-reduce), so the dt/B/C norms see the
full vectors on every rank; ``out_proj`` is row-parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagefold.executor.forward_context import ForwardContext
from pagefold.layers.linear import column_linear, row_linear, shard_rows
from pagefold.layers.norm import RMSNorm, WeightlessRMSNorm
from pagefold.ops.conv1d import causal_conv1d
from pagefold.ops.selective_scan import selective_scan

__all__ = ["DT_NORMS", "Mamba1Config", "Mamba1Mixer"]

# How dt, B and C are normalised after x_proj: not at all (Mamba), RMS norms with learned
# weights ``dt_layernorm`` / ``b_layernorm`` / ``c_layernorm`` (Jamba), RMS norms without
# weights (Falcon-Mamba).
DT_NORMS = ("none", "rms", "weightless")


@dataclass(frozen=True, slots=True)
class Mamba1Config:
    """Shapes and options of one Mamba-1 mixer, independent of the checkpoint's field names.

    ``intermediate`` is the full channel count I (all ranks); ``dt_rank`` is R.
    """

    hidden_size: int
    intermediate: int
    state_size: int
    dt_rank: int
    conv_kernel: int
    proj_bias: bool
    conv_bias: bool
    dt_norm: str = "none"
    norm_eps: float = 1e-6
    activation: str = "silu"
    what: str = "Mamba-1 channels"  # named when the channels do not split over the ranks


class Mamba1Mixer(nn.Module):
    """A Mamba-1 mixer; ``layer_name`` is its state layer."""

    def __init__(self, cfg: Mamba1Config, layer_name: str) -> None:
        super().__init__()
        if cfg.activation not in ("silu", "swish"):
            raise ValueError(f"Mamba-1 activation {cfg.activation!r} is not supported")
        if cfg.dt_norm not in DT_NORMS:
            raise ValueError(f"Mamba-1 dt_norm {cfg.dt_norm!r}: expected one of {DT_NORMS}")
        self.layer_name = layer_name
        h, full, what = cfg.hidden_size, cfg.intermediate, cfg.what
        self.state_size = n = cfg.state_size
        self.rank = r = cfg.dt_rank
        self.kernel = cfg.conv_kernel
        self.in_proj = column_linear(h, [full, full], bias=cfg.proj_bias, what=what)  # xs | z
        self.inter = inter = self.in_proj.out_features // 2  # this rank's channels
        self.conv1d = nn.Conv1d(inter, inter, self.kernel, groups=inter, bias=cfg.conv_bias,
                                padding=self.kernel - 1)
        self.x_proj = row_linear(full, r + 2 * n, bias=False, what=what)
        self.dt_proj = column_linear(r, full, bias=True, what=what)
        self.A_log = nn.Parameter(torch.zeros(inter, n))
        self.D = nn.Parameter(torch.ones(inter))
        for p in (*self.conv1d.parameters(), self.A_log, self.D):
            shard_rows(p, [full], what)
        self.out_proj = row_linear(full, h, bias=cfg.proj_bias, what=what)
        self.normed = cfg.dt_norm != "none"
        if cfg.dt_norm == "rms":
            self.dt_layernorm = RMSNorm(r, cfg.norm_eps)
            self.b_layernorm = RMSNorm(n, cfg.norm_eps)
            self.c_layernorm = RMSNorm(n, cfg.norm_eps)
        elif cfg.dt_norm == "weightless":
            self.dt_layernorm = WeightlessRMSNorm(cfg.norm_eps)
            self.b_layernorm = WeightlessRMSNorm(cfg.norm_eps)
            self.c_layernorm = WeightlessRMSNorm(cfg.norm_eps)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        xs, z = self.in_proj(x).chunk(2, dim=-1)
        _, meta = ctx.state(self.layer_name)
        states = ctx.load_states(self.layer_name)
        weight = self.conv1d.weight.view(self.inter, self.kernel)
        # A verify step keeps the states after every token (conv window and ssm): the commit
        # selects the accepted one.
        xs, conv = causal_conv1d(xs, weight, self.conv1d.bias, states["conv"], meta.cu_seqlens,
                                 activation="silu", decode=meta.all_decode, verify=ctx.verify)
        dt, b, c = self.x_proj(xs).split([self.rank, self.state_size, self.state_size], dim=-1)
        if self.normed:
            dt, b, c = self.dt_layernorm(dt), self.b_layernorm(b), self.c_layernorm(c)
        dt = dt @ self.dt_proj.weight.t()
        y, ssm = selective_scan(xs, dt, -torch.exp(self.A_log.float()), b, c, self.D, z,
                                states["ssm"], meta.cu_seqlens, dt_bias=self.dt_proj.bias,
                                dt_softplus=True, decode=meta.all_decode, verify=ctx.verify)
        if ctx.verify:
            ctx.store_token_states(self.layer_name, {"conv": conv, "ssm": ssm})
        else:
            ctx.store_states(self.layer_name, {"conv": conv, "ssm": ssm})
        return self.out_proj(y.to(x.dtype))
