"""Runner side of image inputs: encoder outputs per request, and each step's image rows.

The vision encoder runs once per image of a request, on the first step whose chunk reaches one
of the image's placeholder tokens; its output is kept (per request, per image) across the
request's later chunks, so chunked prefill may cut anywhere inside an image's tokens (except
for a model whose image tokens attend both ways: see ``bidirectional_spans``), and is
dropped when the request finishes or is preempted (a preempted request encodes again when it
comes back, unless its prefix-cache hit already covers the image). An image whose tokens all
come from a prefix-cache hit is never encoded.

For M-RoPE models the step's rotary positions are rewritten from the request's
:class:`~pagefold.multimodal.inputs.MultiModalInputs`: its prompt positions as given, later
positions shifted by ``mrope_delta``. A step whose three position rows agree everywhere (text
and decode rows) passes plain (T,) positions, so the decode paths see what they always see.
"""

from __future__ import annotations

import torch

from pagefold.distributed.parallel_state import broadcast_tensor
from pagefold.executor.runner_state import CachedRequestState

__all__ = ["EncoderCache"]


class EncoderCache:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.outputs: dict[str, dict[int, torch.Tensor]] = {}
        self.num_encoded = 0  # images encoded so far (tests and metrics)

    def forget(self, req_ids: list[str]) -> None:
        for rid in req_ids:
            self.outputs.pop(rid, None)

    def _encoded(self, r: CachedRequestState, idx: int) -> torch.Tensor:
        per_req = self.outputs.setdefault(r.req_id, {})
        out = per_req.get(idx)
        if out is None:
            f = r.mm_inputs.features[idx]
            pixels = f.pixel_tensor().to(next(self.model.visual.parameters()).device)
            # Every tensor-parallel rank runs the (replicated) tower; rank 0's rows are then
            # everyone's, so the ranks' residual streams stay bit-identical.
            out = self.model.encode_images(pixels, [tuple(f.grid_thw)]).contiguous()
            out = per_req[idx] = broadcast_tensor(out)
            if out.shape[0] != f.length:
                raise RuntimeError(f"image {idx} of request {r.req_id}: the encoder gave "
                                   f"{out.shape[0]} embeddings for {f.length} tokens")
            self.num_encoded += 1
        return out

    @staticmethod
    def bidirectional_spans(reqs: list[CachedRequestState], starts: list[int],
                            counts: list[int]) -> list[tuple[int, int, int]] | None:
        """``(request index, first position, end position)`` of this step's image tokens whose
        image attends both ways (``MultiModalInputs.bidirectional``), for ``build_inputs``;
        None when there are none."""
        spans = []
        for i, (r, s, n) in enumerate(zip(reqs, starts, counts)):
            mm = r.mm_inputs
            if mm is not None and mm.bidirectional:
                for f in mm.features:
                    lo, hi = max(s, f.offset), min(s + n, f.offset + f.length)
                    if lo < hi:
                        spans.append((i, lo, hi))
        return spans or None

    def step_inputs(self, reqs: list[CachedRequestState], starts: list[int],
                    counts: list[int], positions: torch.Tensor
                    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """This step's rotary positions ((T,) or (3, T)) and image rows (flat row indices,
        embeddings) for the requests ``reqs`` computing ``counts[i]`` tokens from
        ``starts[i]``; ``positions`` are the plain (T,) positions of the step."""
        rows: list[torch.Tensor] = []
        embeds: list[torch.Tensor] = []
        shifted = None  # (T,) positions with the later-position deltas added
        patches: list[tuple[int, torch.Tensor]] = []  # (flat row, (3, k) prompt positions)
        flat = 0
        for r, s, n in zip(reqs, starts, counts):
            mm = r.mm_inputs
            if mm is not None:
                for idx, f in enumerate(mm.features):
                    lo, hi = max(s, f.offset), min(s + n, f.offset + f.length)
                    if lo < hi:
                        out = self._encoded(r, idx)
                        rows.append(torch.arange(flat + lo - s, flat + hi - s))
                        embeds.append(out[lo - f.offset:hi - f.offset])
                table = mm.mrope_positions
                if table is not None:
                    p = len(table[0])
                    if s < p:  # prompt rows: from the table (decode steps never build it)
                        a = min(s + n, p)
                        patches.append((flat, torch.tensor([row[s:a] for row in table])))
                    if s + n > p and mm.mrope_delta:
                        if shifted is None:
                            shifted = positions.clone()
                        shifted[flat + max(s, p) - s:flat + n] += mm.mrope_delta
            flat += n
        if shifted is not None:
            positions = shifted
        if patches:
            pos3 = positions.expand(3, -1).clone()
            for at, block in patches:
                pos3[:, at:at + block.shape[1]] = block.to(pos3.device)
            positions = pos3[0] if bool((pos3 == pos3[0]).all()) else pos3
        if not rows:
            return positions, None
        dev = positions.device
        return positions, (torch.cat(rows).to(dev), torch.cat(embeds))
