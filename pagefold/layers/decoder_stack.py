"""The decoder stack every converted model shares: embeddings -> decoder layers -> final norm,
and the seam where a pipeline stage cuts it.

A model's ``model`` / ``backbone`` module subclasses :class:`DecoderStack` and calls
``build_stack`` with its parts; the stack owns the forward: the native CPU decode step when it
applies (``decode_native``), else the layers one by one, then the final norm.

Pipeline stages (``distributed.parallel_state.pp_layers``): a stage builds only its
``[start, end)`` layers; the others are :class:`AbsentPart` placeholders (no parameters, so
``layers.{i}`` keeps its index for weight and cache names, and ``load_into`` skips their
checkpoint tensors). The first stage embeds, the last applies the final norm (and holds the
head); the embeddings also live on the last stage of a tied model (its head is them). A stage
that is not first receives ``x`` (and the residual stream, for models that carry one) from the
previous stage; one that is not last sends them on and returns them unnormed.

Invariant: at one stage the forward is exactly the loop the model files ran before (same
ops in the same order), so pipeline size 1 gives the same bits.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagefold.distributed.parallel_state import (
    pp_is_first,
    pp_is_last,
    pp_layers,
    pp_recv,
    pp_send,
    pp_size,
)
from pagefold.layers import decode_native

__all__ = ["AbsentPart", "DecoderStack", "stage_builds"]


class AbsentPart(nn.Module):
    """A part another pipeline stage holds: no parameters, never called. ``load_into`` skips
    checkpoint tensors under it (``pf_absent``)."""

    pf_absent = True

    def forward(self, *args, **kwargs):
        raise RuntimeError("this part of the model lives on another pipeline stage")


def stage_builds(layer_idx: int) -> bool:
    """True when this process's pipeline stage holds decoder layer ``layer_idx``."""
    span = pp_layers()
    return span is None or span[0] <= layer_idx < span[1]


class DecoderStack(nn.Module):
    """Base of a model's embeddings + layers + final norm (see the module docstring).

    Subclasses set ``residual_stream`` when their layers take and return ``(x, residual)``
    (the fused add + norm style), and may override ``run_layer`` (another layer signature),
    ``final_norm`` and ``native_output`` (how the native step's ``(out, residual)`` ends)."""

    residual_stream: bool = False
    # False for stacks that never took the native decode step (kept on the module path).
    native_decode: bool = True
    # ``forward`` hands every layer's input to ``ctx.capture_layer_input`` when the step asks
    # (``ctx.aux_layers``: an EAGLE-3 drafter reads chosen layers' inputs).
    captures_layer_inputs: bool = True

    def build_stack(self, num_layers: int, make_layer: Callable[[int], nn.Module],
                    make_embed: Callable[[], nn.Module], make_norm: Callable[[], nn.Module],
                    *, hidden_size: int, tied: bool = False, embed_name: str = "embed_tokens",
                    norm_name: str = "norm") -> None:
        """Build this stage's parts; ``tied``: the head is the embeddings (the last stage keeps
        them). Parts are made in the order embeddings, layers, norm (parameter order)."""
        first, last = pp_is_first(), pp_is_last()
        self._embed_name, self._norm_name = embed_name, norm_name
        self.hidden_size = hidden_size
        self.hidden_dtype = torch.get_default_dtype()  # what stages hand each other
        setattr(self, embed_name, make_embed() if first or (last and tied) else AbsentPart())
        self.layers = nn.ModuleList(make_layer(i) if stage_builds(i) else AbsentPart()
                                    for i in range(num_layers))
        setattr(self, norm_name, make_norm() if last else AbsentPart())
        span = pp_layers() or (0, num_layers)
        # A plain list (not a registered module: the parameters keep their one name).
        self.__dict__["own_layers"] = list(self.layers)[span[0]:span[1]]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return getattr(self, self._embed_name)(input_ids)

    @property
    def token_embedding(self) -> nn.Module:
        """The token embedding table itself, without a model's scaling of its rows (what an
        EAGLE / MTP drafter shares with its target)."""
        return getattr(self, self._embed_name)

    def embed_inputs(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        """The first stage's input rows: the token embeddings (a multimodal model overrides
        this to place its encoder's rows, ``ctx.mm_embeds``)."""
        return self.embed(input_ids)

    def _native(self, layers, x: torch.Tensor, positions: torch.Tensor, ctx,
                final_norm: nn.Module | None = None):
        # The native step takes 1-D positions and token embeddings only (no M-RoPE rows, no
        # image rows placed in the step).
        if (not self.native_decode or positions.dim() != 1
                or getattr(ctx, "mm_embeds", None) is not None):
            return None
        return decode_native.run(self, layers, x, positions, ctx, final_norm)

    def run_layer(self, layer: nn.Module, positions: torch.Tensor, x: torch.Tensor,
                  residual: torch.Tensor | None, ctx) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.residual_stream:
            return layer(positions, x, ctx, residual)
        return layer(positions, x, ctx), None

    def capture_input(self, ctx, index: int, x: torch.Tensor,
                      residual: torch.Tensor | None) -> None:
        """Hand layer ``index``'s input to the step (``ctx.capture_layer_input``): the
        residual stream, ``x`` plus ``residual`` for the fused add + norm style. A stack whose
        second stream is not a residual overrides this."""
        ctx.capture_layer_input(index, x, residual)

    def final_norm(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        norm = getattr(self, self._norm_name)
        if residual is None:
            return norm(x)
        return norm(x, residual)[0]

    def native_output(self, out: torch.Tensor, residual: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The native step's ``(last part's output, residual)`` as this stack's stream."""
        if self.residual_stream:
            return out, residual
        return out + residual, None

    def native_final(self, out: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return getattr(self, self._norm_name)(out, residual)[0]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:
        if pp_size() > 1:
            return self._stage_forward(input_ids, positions, ctx)
        x = self.embed_inputs(input_ids, ctx)
        # Small CPU decode steps: the same kernels in one C call (decode_native, same bits).
        # The default native_final (the final norm's fused add + norm) runs in the same C
        # call; a stack that overrides it gets the (output, residual) pair.
        fused = type(self).native_final is DecoderStack.native_final
        native = self._native(self.layers, x, positions, ctx,
                              getattr(self, self._norm_name) if fused else None)
        if native is not None:
            return native if isinstance(native, torch.Tensor) else self.native_final(*native)
        residual = None
        capture = getattr(ctx, "aux_layers", None) is not None
        for i, layer in enumerate(self.layers):
            if capture:  # an EAGLE-3 drafter reads this step's layer inputs
                self.capture_input(ctx, i, x, residual)
            x, residual = self.run_layer(layer, positions, x, residual, ctx)
        return self.final_norm(x, residual)

    def greedy_run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx, head: tuple):
        """``CausalLMHead.greedy_run``'s step for this stack (``head``: the head's
        ``greedy_head``), or None unless :meth:`forward` is this class's, embedding with a
        plain table lookup (an ``embed_inputs`` marked ``pf_images_only`` differs from it only
        by image rows, which a native step never has) and ending in the fused final norm, on
        one pipeline stage."""
        cls, emb = type(self), self.token_embedding
        if (pp_size() > 1 or cls.forward is not DecoderStack.forward
                or cls.embed is not DecoderStack.embed
                or not (cls.embed_inputs is DecoderStack.embed_inputs
                        or getattr(cls.embed_inputs, "pf_images_only", False))
                or cls.native_final is not DecoderStack.native_final
                or type(emb) is not nn.Embedding or emb.max_norm is not None
                or emb._forward_hooks or emb._forward_pre_hooks):
            return None
        return decode_native.greedy_run(self, input_ids, positions, ctx,
                                        getattr(self, self._norm_name), emb.weight, head)

    def _stage_forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx
                       ) -> torch.Tensor:
        """One pipeline stage: receive (or embed), this stage's layers, send (or norm)."""
        residual = None
        if pp_is_first():
            x = self.embed_inputs(input_ids, ctx)
            native = self._native(self.own_layers, x, positions, ctx)
        else:
            n = int(input_ids.shape[0])
            parts = 2 if self.residual_stream else 1
            got = pp_recv((parts, n, self.hidden_size), self.hidden_dtype, input_ids.device)
            x, residual = (got[0], got[1]) if self.residual_stream else (got[0], None)
            native = None  # the native step starts from embeddings (no incoming residual)
        if native is not None:
            x, residual = self.native_output(*native)
        else:
            for layer in self.own_layers:
                x, residual = self.run_layer(layer, positions, x, residual, ctx)
        if pp_is_last():
            return self.final_norm(x, residual)
        if self.residual_stream:
            if residual is None:  # a stage of no layers before any layer ran
                residual = torch.zeros_like(x)
            pp_send(torch.stack([x, residual]))
        else:
            pp_send(x.unsqueeze(0))
        return x
