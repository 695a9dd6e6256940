"""Per-layer cache specs: the single source of every cache size in pagefold.

Each layer that keeps per-sequence state declares one spec. Specs are frozen and hashable:
layers with *equal* specs are grouped together (see ``kv_cache_planner``), and a spec's
``manager_kind`` names the per-type cache policy (full attention, sliding window, fixed state)
that the cache manager instantiates for its group. The scheduler never looks inside a spec.

Byte layouts
------------
* Attention page (one layer, one block): ``[block_size, 2, num_kv_heads, head_dim]`` of
  ``dtype`` (K and V of each token side by side).
  ``page_bytes(block_size) = block_size * bytes_per_token``.
* State (one layer, one sequence): its components laid out back to back in a flat byte
  array, each component starting at an offset aligned to 16 bytes. In pagefold's layout the
  flat array is cut into ``ceil(state_bytes / page_bytes)`` pool pages (the last one padded).

Tensor parallelism: a spec is one rank's. Where known, ``split`` (a ``TPSplit``, not part of a
spec's equality) says how the rank's tensor was cut from the full-width one: along which axis,
in which row blocks, each cut into ``min(units, tp)`` parts (fewer parts than ranks: the part
is replicated, rank ``r`` keeping part ``r * parts // tp``, as ``layers.linear.RowCut`` loads
weights). ``transfer.reshard`` moves pages between engines of different TP sizes with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import prod

import torch

_ALIGN = 16


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def align_up(n: int, a: int = _ALIGN) -> int:
    return cdiv(n, a) * a


@dataclass(frozen=True, slots=True)
class TPSplit:
    """How one rank's tensor is cut from the full-width tensor along ``axis``: the full axis is
    ``blocks`` laid back to back, each ``(full extent, unit)``; a block of ``u = full / unit``
    units is cut in ``parts = min(u, tp)`` equal parts and rank ``r`` keeps part
    ``r * parts // tp`` (parts < tp: replicated). Each rank's axis is its parts of every block
    in order. ``unit == full`` marks a block every rank keeps whole."""

    axis: int
    blocks: tuple[tuple[int, int], ...]


class _KVPages:
    """Page arithmetic shared by the attention specs (K and V rows per token)."""

    __slots__ = ()

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * dtype_size(self.dtype)

    def page_bytes(self, block_size: int) -> int:
        return block_size * self.bytes_per_token

    def page_shape(self, block_size: int) -> tuple[int, ...]:
        """One layer's page as the attention kernels index it."""
        return (block_size, 2, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True, slots=True)
class FullAttentionSpec(_KVPages):
    """K and V rows for every token of the sequence."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    split: TPSplit | None = field(default=None, compare=False)  # page_shape's head axis

    manager_kind = "full_attention"


@dataclass(frozen=True, slots=True)
class SlidingWindowSpec(_KVPages):
    """K and V rows for the last ``window`` tokens; older blocks go back to the pool."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    window: int
    split: TPSplit | None = field(default=None, compare=False)

    manager_kind = "sliding_window"


@dataclass(frozen=True, slots=True)
class ChunkedLocalAttentionSpec(_KVPages):
    """K and V rows for the tokens of the current attention chunk (Llama-4's local layers).

    A query at position ``p`` reads keys ``[p - p % chunk, p]``: the sequence is cut into
    chunks of ``chunk`` tokens and attention never crosses a chunk start, so blocks wholly
    before the current chunk go back to the pool (a chunked-attention dialect of the sliding
    window, whose reach restarts at every chunk instead of trailing the query)."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    chunk: int
    split: TPSplit | None = field(default=None, compare=False)

    manager_kind = "chunked_local"


@dataclass(frozen=True, slots=True)
class StateComponent:
    """One tensor of a recurrent layer's per-sequence state, e.g. the conv window or the SSM."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    split: TPSplit | None = field(default=None, compare=False)

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * dtype_size(self.dtype)


@dataclass(frozen=True, slots=True)
class StateSpec:
    """A fixed-size per-sequence state (Gated DeltaNet, Mamba-2): overwritten in place each step.

    ``components`` are laid out in order at 16-byte-aligned offsets; ``kind`` names the layer
    family (``"gdn"`` or ``"mamba2"``) for logs and for the planner's vLLM arithmetic.
    """

    kind: str
    components: tuple[StateComponent, ...]

    manager_kind = "state"

    @property
    def offsets(self) -> tuple[int, ...]:
        offs, pos = [], 0
        for c in self.components:
            offs.append(pos)
            pos = align_up(pos + c.nbytes)
        return tuple(offs)

    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's state in one layer (aligned components, no page padding)."""
        last = self.components[-1]
        return self.offsets[-1] + last.nbytes

    @property
    def unpadded_bytes(self) -> int:
        return sum(c.nbytes for c in self.components)

    def component(self, name: str) -> StateComponent:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(name)


@dataclass(frozen=True, slots=True)
class MLASpec:
    """Multi-head latent attention (Kimi Linear's MLA): each token keeps one compressed row of
    ``latent_dim`` values (the normalised KV latent and the shared rope key), not per-head K and
    V; heads are expanded from it at attention time. Page: ``(block_size, latent_dim)``.
    Managed like full attention (every token kept, pages shared by prefix and forks)."""

    latent_dim: int
    dtype: torch.dtype
    split: TPSplit | None = field(default=None, compare=False)  # replicated: unit == full

    manager_kind = "full_attention"

    @property
    def bytes_per_token(self) -> int:
        return self.latent_dim * dtype_size(self.dtype)

    def page_bytes(self, block_size: int) -> int:
        return block_size * self.bytes_per_token

    def page_shape(self, block_size: int) -> tuple[int, ...]:
        return (block_size, self.latent_dim)


LayerSpec = FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec | StateSpec | MLASpec


def is_attention(spec: LayerSpec) -> bool:
    return isinstance(spec, FullAttentionSpec | SlidingWindowSpec | ChunkedLocalAttentionSpec
                      | MLASpec)


def first_key(spec: LayerSpec, position: int) -> int:
    """The first key position a query at ``position`` reads under ``spec``'s attention:
    ``position - window + 1`` (sliding window), the chunk start (chunked local), else 0."""
    if isinstance(spec, SlidingWindowSpec):
        return max(0, position - spec.window + 1)
    if isinstance(spec, ChunkedLocalAttentionSpec):
        return position - position % spec.chunk
    return 0
