"""The causal-LM top every model shares: lm_head (tied to the input embeddings or its own),
logits in float32 (optionally divided, Granite's ``logits_scaling``), and the check that a
checkpoint filled every parameter."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
from torch import nn

from pagefold.csrc import cpu_ops, gemv_registry
from pagefold.distributed.parallel_state import pp_is_last, tp_size
from pagefold.layers.decoder_stack import AbsentPart, DecoderStack
from pagefold.layers.vocab import gather_logits, lm_head_linear


class CausalLMHead(nn.Module):
    """Base of the ``*ForCausalLM`` classes: call ``init_head`` once the embeddings exist."""

    logits_divisor: float = 1.0

    def init_head(self, cfg, embed: nn.Embedding) -> None:
        """The head, on the last pipeline stage only (an ``AbsentPart`` elsewhere)."""
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.vocab_size = cfg.vocab_size
        if not pp_is_last():
            self.lm_head = AbsentPart()
            return
        self.lm_head = lm_head_linear(cfg.hidden_size, cfg.vocab_size)
        if self.tied:
            self.lm_head.weight = embed.weight

    def tie_head(self, embed: nn.Embedding) -> None:
        """Tie after all (a checkpoint without ``lm_head.weight``)."""
        self.tied = True
        if isinstance(self.lm_head, AbsentPart):
            return
        if isinstance(embed, AbsentPart):  # the last pipeline stage built no embeddings
            raise ValueError("the checkpoint has no lm_head.weight and its config does not tie "
                             "the embeddings: pipeline parallelism needs tie_word_embeddings "
                             "set in config.json for such a checkpoint")
        self.lm_head.weight = embed.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = gather_logits(self.lm_head(hidden), self.vocab_size)
        if self.logits_divisor != 1.0:
            logits = logits / self.logits_divisor
        return logits.float()

    def greedy_head(self, rows: int) -> tuple | None:
        """``(choice, weight, bias)``: the head's bf16 GEMV (a ``gemv_choice.Choice``) whose
        outputs, as they are, are this head's logits for ``rows`` rows, or None where they are
        not (an override of ``compute_logits``, a divisor, float32 sums, another product,
        vocabulary shards, a hook's terms, more rows than the GEMV takes). What
        :meth:`greedy_tokens` and the compiled greedy step (``decode_native.GreedyStep``)
        both compute through."""
        if type(self).compute_logits is not CausalLMHead.compute_logits or \
                self.logits_divisor != 1.0 or tp_size() != 1:
            return None
        lin = self.lm_head
        ready = getattr(lin, "pf_gemv", None)
        if (type(lin) is not nn.Linear or ready is None or ready[0] is not lin.weight
                or lin._forward_hooks or lin._forward_pre_hooks  # a hook's terms
                or ready[1] is not lin.bias or ready[2].fn is None or cpu_ops.kernels() is None
                or (lin.pf_float_out and ready[2].f32 is not None)):
            return None
        if not 1 <= rows <= ready[2].max_rows or lin.weight.shape[0] != self.vocab_size:
            return None  # above its rows compute_logits takes the GEMM path
        return ready[2], lin.weight, lin.bias

    def greedy_tokens(self, hidden: torch.Tensor) -> list[int] | None:
        """Each row's greedy token, ``Sampler.argmax(self.compute_logits(hidden))``, from the
        head's bf16 GEMV (:meth:`greedy_head`) and a compiled argmax (``pf_argmax_bf16``, the
        same first-maximum / first-NaN rule) without the float32 logits; None where
        :meth:`greedy_head` declines: the caller then takes the logits. The same bits: the
        float32 widening of bf16 values is exact."""
        head = self.greedy_head(hidden.shape[0] if hidden.dim() == 2 else 0)
        if head is None:
            return None
        y = gemv_registry.call(head[0].fn, hidden, head[1], head[2])
        if y is None:
            return None
        m, n = y.shape
        out = (ctypes.c_int64 * m)()
        if cpu_ops.kernels().pf_argmax_bf16(y.data_ptr(), m, n, n, out) != 0:
            return None
        return list(out)

    def greedy_run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx
                   ) -> Callable[[], list[int]] | None:
        """For a run of greedy decode steps over the same rows, whose first step this model's
        forward just ran natively in ``ctx`` (``decode_native``) and whose later ones advance
        ``input_ids``, ``positions`` and ``ctx``'s metadata in place: a callable making each
        later step's forward and :meth:`greedy_tokens` in one compiled call
        (``decode_native.GreedyStep``, the same kernels on the same values), or None where
        this model's step is not plainly the decoder stack's (a forward of its own, a stack
        that embeds or ends otherwise, a head :meth:`greedy_head` declines)."""
        stack = getattr(self, "model", None)
        if (not getattr(type(self).forward, "pf_stack_only", False)
                or not isinstance(stack, DecoderStack)):
            return None
        head = self.greedy_head(input_ids.shape[0])
        if head is None:
            return None
        return stack.greedy_run(input_ids, positions, ctx, head)

    @property
    def head_skip_prefixes(self) -> tuple[str, ...]:
        """Checkpoint prefixes to skip while loading (a tied head has no weight of its own)."""
        return ("lm_head.",) if self.tied else ()

    def check_loaded(self, loaded: set[str], complete: set[str] | frozenset = frozenset()
                     ) -> None:
        """Raise naming the parameters (or fused shards) no checkpoint tensor filled.

        ``loaded`` as ``load_into`` returns it (``name`` or ``name:shard``); ``complete``:
        parameters filled another way (stacked experts assembled from per-expert tensors)."""
        got = {n for n in loaded if ":" not in n} | set(complete)
        shards: dict[str, set[str]] = {}
        for n in loaded:
            if ":" in n:
                target, shard = n.split(":")
                shards.setdefault(target, set()).add(shard)
        missing = []
        for name, p in self.named_parameters():
            if name == "lm_head.weight" and self.tied:
                continue
            fused = getattr(p, "fused", None)
            if fused is not None and name in shards:
                missing += [f"{name}:{s}" for s in fused.shards if s not in shards[name]]
            elif name not in got and not getattr(p, "optional", False):
                missing.append(name)
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {missing[:8]}")
