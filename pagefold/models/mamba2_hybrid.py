"""The Mamba-2 mixer shared by Nemotron-H, GraniteMoeHybrid (Granite 4.0-H) and Bamba.

The three transformers mixers compute identical math and name their weights identically
(``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``); only the config
field names differ, which :class:`Mamba2Config` absorbs. For a flat batch of T new tokens:

    zxbcdt = in_proj(x)                        (T, I + conv_dim + H), conv_dim = I + 2 G N
    z, xBC, dt = split(zxbcdt, [I, conv_dim, H])
    xBC = silu(causal_conv1d(xBC))             rolling conv state (N_req, conv_dim, K-1)
    x, B, C = split(xBC, [I, G N, G N])        x -> (T, H, P), B/C -> (T, G, N)
    dt' = clamp(softplus(dt + dt_bias), dt_limit)
    y = SSD(x, dt', A = -exp(A_log), B, C) + D x      state (N_req, H, P, N) float32
    out = out_proj(GatedRMSNorm(y, z))         gate before the norm, groups of I // G channels

The layer named ``layers.{i}`` loads its request states once per step, runs the kernels and
stores the states back (conv in the model dtype, ssm in the cache's SSM dtype).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagefold.distributed.parallel_state import tp_size
from pagefold.executor.forward_context import ForwardContext, StateMetadata
from pagefold.layers.linear import column_linear, row_linear, shard_rows
from pagefold.layers.mamba.gated_norm import GatedRMSNorm
from pagefold.layers.native_record import Step, bf16_vector, linears
from pagefold.ops.ssd import mamba2_mixer

__all__ = ["Mamba2Config", "Mamba2Mixer"]


def dt_limit(cfg) -> tuple[float, float]:
    """The prompt path's dt clamp of every Mamba-2 config: ``time_step_limit``, else none
    (transformers' rule for Mamba2, Bamba, GraniteMoeHybrid, Falcon-H1 and, from 5.25,
    Nemotron-H)."""
    lo, hi = getattr(cfg, "time_step_limit", None) or (0.0, math.inf)
    return float(lo), float(hi)


@dataclass(frozen=True, slots=True)
class Mamba2Config:
    """Shapes and options of one Mamba-2 mixer, independent of the checkpoint's field names.

    ``intermediate == num_heads * head_dim``; ``num_heads % n_groups == 0``.
    ``dt_limit`` is the (min, max) clamp of the discretised time step on the prompt path.
    """

    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    conv_kernel: int
    chunk_size: int
    eps: float
    dt_limit: tuple[float, float] = (0.0, math.inf)
    proj_bias: bool = False
    conv_bias: bool = True
    activation: str = "silu"

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.state_size

    @classmethod
    def from_nemotron_h(cls, cfg) -> Mamba2Config:
        """NemotronHConfig: the prompt path clamps dt to ``time_step_limit`` (transformers >=
        5.25, as Bamba; earlier versions clamped at ``(time_step_min, inf)``, which real
        checkpoints' ``time_step_limit`` of ``(0, inf)`` does not ask for)."""
        return cls(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.mamba_num_heads,
            head_dim=cfg.mamba_head_dim,
            n_groups=cfg.n_groups,
            state_size=cfg.ssm_state_size,
            conv_kernel=cfg.conv_kernel,
            chunk_size=cfg.chunk_size,
            eps=cfg.layer_norm_epsilon,
            dt_limit=dt_limit(cfg),
            proj_bias=bool(getattr(cfg, "use_bias", False)),
            conv_bias=bool(getattr(cfg, "use_conv_bias", True)),
            activation=getattr(cfg, "mamba_hidden_act", "silu"),
        )

    @classmethod
    def from_bamba_like(cls, cfg) -> Mamba2Config:
        """BambaConfig / GraniteMoeHybridConfig: ``mamba_*`` fields, ``time_step_limit``."""
        intermediate = int(cfg.mamba_expand * cfg.hidden_size)
        head_dim = cfg.mamba_d_head
        if head_dim in (None, "auto"):
            head_dim = intermediate // cfg.mamba_n_heads
        if head_dim * cfg.mamba_n_heads != intermediate:
            raise ValueError(f"mamba_n_heads * mamba_d_head ({cfg.mamba_n_heads} * {head_dim}) != "
                             f"mamba_expand * hidden_size ({intermediate})")
        return cls(
            hidden_size=cfg.hidden_size,
            num_heads=cfg.mamba_n_heads,
            head_dim=int(head_dim),
            n_groups=cfg.mamba_n_groups,
            state_size=cfg.mamba_d_state,
            conv_kernel=cfg.mamba_d_conv,
            chunk_size=cfg.mamba_chunk_size,
            eps=cfg.rms_norm_eps,
            dt_limit=dt_limit(cfg),
            proj_bias=bool(getattr(cfg, "mamba_proj_bias", False)),
            conv_bias=bool(getattr(cfg, "mamba_conv_bias", True)),
            activation=getattr(cfg, "hidden_act", "silu"),
        )


def _clamped_token_mask(meta: StateMetadata, num_tokens: int, device: torch.device,
                        verify: bool = False) -> torch.Tensor:
    """(T,) bool: True for tokens on transformers' prompt path (dt clamped).

    transformers takes its single-token recurrent path -- which does not clamp dt -- exactly
    when a forward call feeds one token to a sequence that already has a state; every other
    call goes through the chunked scan, which clamps. A request's tokens this step are
    therefore clamped unless the request has one token and an initial state.
    """
    cu = meta.cu_seqlens
    counts = (cu[1:] - cu[:-1]).to(device)
    decode = (counts == 1) & meta.has_initial_state.to(device)
    if verify and meta.spec_rows is not None:
        # A verify chunk stands for 1 + k single-token decode steps (no clamp in transformers).
        decode = decode | meta.spec_rows.to(device)
    return torch.repeat_interleave(~decode, counts, output_size=num_tokens)


class Mamba2Mixer(nn.Module):
    """Mamba-2 mixer over a flat token batch; parameters named as in transformers.

    ``forward(x (T, hidden), ctx) -> (T, hidden)`` in ``x.dtype``. ``layer_name`` must be the
    cache layer name ``f"layers.{i}"`` (the state layer of that index).
    """

    # Prefix-cache checkpoints requested in ``ctx`` are taken inside the kernels.
    captures_checkpoints = True

    def __init__(self, mcfg: Mamba2Config, layer_name: str) -> None:
        super().__init__()
        if mcfg.activation not in ("silu", "swish"):
            raise ValueError(f"Mamba-2 mixer activation {mcfg.activation!r} is not supported "
                             "(the conv kernel implements silu)")
        if mcfg.num_heads % mcfg.n_groups:
            raise ValueError(f"mamba heads {mcfg.num_heads} not divisible by groups "
                             f"{mcfg.n_groups}")
        # Tensor parallelism: this rank's heads and B/C groups (a group's heads stay together).
        # A single group is shared: every rank keeps B and C whole and the gated norm, whose
        # group then spans the ranks, sums its statistics over them.
        tp = tp_size()
        if mcfg.num_heads % tp:
            raise ValueError(f"mamba heads ({mcfg.num_heads}) is not divisible by "
                             f"tensor_parallel_size {tp}")
        if mcfg.n_groups % tp and mcfg.n_groups != 1:
            raise ValueError(f"n_groups ({mcfg.n_groups}) must be 1 or divisible by "
                             f"tensor_parallel_size {tp}")
        full = mcfg
        shared_group = tp > 1 and mcfg.n_groups == 1
        gparts = 1 if shared_group else tp
        mcfg = dataclasses.replace(mcfg, num_heads=mcfg.num_heads // tp,
                                   n_groups=1 if shared_group else mcfg.n_groups // tp)
        self.cfg = mcfg
        self.layer_name = layer_name
        inter, conv_dim, heads = mcfg.intermediate, mcfg.conv_dim, mcfg.num_heads
        fi, fgn, fh = full.intermediate, full.n_groups * full.state_size, full.num_heads
        # The checkpoint's in_proj rows: z | x | B | C | dt, each block cut over the ranks.
        self.in_proj = column_linear(mcfg.hidden_size, [fi, fi, fgn, fgn, fh],
                                     bias=mcfg.proj_bias, what="Mamba-2 in_proj",
                                     parts={"": [tp, tp, gparts, gparts, tp]})
        # Depthwise conv kept as an nn.Conv1d so the checkpoint's (C, 1, K) weight loads by name;
        # the varlen kernels read it as (C, K).
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, mcfg.conv_kernel, groups=conv_dim,
                                bias=mcfg.conv_bias, padding=mcfg.conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.zeros(heads))
        self.D = nn.Parameter(torch.ones(heads))
        self.norm = GatedRMSNorm(inter, eps=mcfg.eps, group_size=inter // mcfg.n_groups,
                                 spans_ranks=shared_group)
        self.out_proj = row_linear(fi, mcfg.hidden_size, bias=mcfg.proj_bias,
                                   what="Mamba-2 out_proj")
        conv_parts = [tp, gparts, gparts]
        shard_rows(self.conv1d.weight, [fi, fgn, fgn], "Mamba-2 conv channels", conv_parts)
        if self.conv1d.bias is not None:
            shard_rows(self.conv1d.bias, [fi, fgn, fgn], "Mamba-2 conv channels", conv_parts)
        for p in (self.dt_bias, self.A_log, self.D):
            shard_rows(p, [fh], "mamba heads")
        shard_rows(self.norm.weight, [fi], "Mamba-2 norm")
        # in_proj's checkpoint blocks and the parts each is cut in (Falcon-H1 cuts its per-channel
        # multipliers the same way); whether the one B/C group is shared by the ranks.
        self.tp_blocks = ([fi, fi, fgn, fgn, fh], [tp, tp, gparts, gparts, tp])
        self.shared_group = shared_group

    def _dt(self, dt: torch.Tensor, meta: StateMetadata, verify: bool = False) -> torch.Tensor:
        """(T, H) discretised float32 time step, clamped the way transformers clamps it.

        transformers' single-token decode path (``selective_state_update``) applies no dt limit
        while its prompt path (``mamba2_chunk_scan``) does. A clamp at a positive minimum
        (Nemotron-H's ``time_step_min`` of 1e-3 before transformers 5.25) is reached by random
        and real weights, so clamping decode tokens would change generated tokens versus
        transformers. We mirror it per token: see
        :func:`_clamped_token_mask`.
        """
        out = F.softplus(dt.float() + self.dt_bias.float())
        lo, hi = self.cfg.dt_limit
        if (lo <= 0.0 and hi == math.inf) or meta.all_decode:
            return out
        clamped = out.clamp(min=lo, max=hi)
        mask = _clamped_token_mask(meta, out.shape[0], out.device, verify)
        return torch.where(mask[:, None], clamped, out)

    def native_record(self, hidden: int) -> tuple | None:
        """The native decode step's record: the kernels :meth:`forward` calls on CPU decode
        rows (in_proj, ``pf_mamba2_decode`` with the arguments ``ops.ssd.cpu.mamba2_decode``
        passes, the gated norm in its bf16 gate-first form, out_proj); None unless they take
        the weights as they are."""
        c, n = self.cfg, self.norm
        w, b = self.conv1d.weight, self.conv1d.bias
        lin = linears(self.in_proj, self.out_proj, hidden, c.intermediate)
        if (lin is None or self.shared_group or not bf16_vector(w)
                or (b is not None and not bf16_vector(b))
                or lin["n0"] != c.intermediate + c.conv_dim + c.num_heads
                or n.norm_before_gate or n.spans_ranks or not bf16_vector(n.weight)):
            return None
        conv_w = w.view(c.conv_dim, c.conv_kernel)
        # As ops.ssd.cpu.mamba2_decode passes them: float32 copies, kept with the record.
        dt_bias = self.dt_bias.detach().float().contiguous()
        d_skip = self.D.detach().float().contiguous()
        self.native_keep = (conv_w, dt_bias, d_skip)
        return "mamba2", {
            **lin, "conv_dim": c.conv_dim, "conv_k": c.conv_kernel, "ssm_heads": c.num_heads,
            "ssm_head_dim": c.head_dim, "ssm_groups": c.n_groups, "ssm_state": c.state_size,
            "conv_w": conv_w.data_ptr(), "conv_b": b.data_ptr() if b is not None else 0,
            "dt_bias": dt_bias.data_ptr(), "d_skip": d_skip.data_ptr(),
            "gnorm_w": n.weight.data_ptr(), "gnorm_group": n.group_size,
        }, {"eps2": float(n.eps)}

    def native_dyn(self, step: Step) -> list[int] | None:
        c = self.cfg
        return step.state_dyn(self.layer_name, self.A_log, (c.conv_dim, c.conv_kernel - 1),
                              (c.num_heads, c.head_dim, c.state_size), (torch.float32,))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        c = self.cfg
        t = x.shape[0]
        inter = c.intermediate
        z, xbc, dt = self.in_proj(x).split([inter, c.conv_dim, c.num_heads], dim=-1)
        meta = ctx.state(self.layer_name)[1]
        y = mamba2_mixer(ctx, self.layer_name, xbc, dt,
                         conv_weight=self.conv1d.weight.view(c.conv_dim, c.conv_kernel),
                         conv_bias=self.conv1d.bias, dt_bias=self.dt_bias, A_log=self.A_log,
                         D=self.D, discretize=lambda d, verify: self._dt(d, meta, verify),
                         num_heads=c.num_heads, head_dim=c.head_dim, n_groups=c.n_groups,
                         state_size=c.state_size, chunk_size=c.chunk_size,
                         model_dtype=x.dtype)
        y = self.norm(y.reshape(t, inter), z)
        return self.out_proj(y.to(x.dtype))
