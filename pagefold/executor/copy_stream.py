"""Page swaps between the device pool and the pinned host pool on a separate CUDA stream.

On CUDA a swap gathers the pages on a copy stream that first waits for the compute stream
(every earlier write to those pages is done), moves them through pinned memory with
non-blocking copies, and makes the compute stream wait for the copy stream before it runs on
(no later kernel overwrites a page still being read out, or reads one still coming in). The
host side of a swap-out is complete when :meth:`CopyStream.to_host` returns (the host pool is
read by the CPU); a swap-in returns as soon as it is queued. Pinned host tensors handed to
non-blocking copies are kept alive by torch's caching host allocator until their copies end.

Elsewhere (CPU pools, tests) the same calls are plain synchronous row copies.
"""

from __future__ import annotations

import torch


class CopyStream:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def to_host(self, pool: torch.Tensor, host: torch.Tensor, dev_rows: torch.Tensor,
                host_rows: torch.Tensor) -> None:
        """``host[host_rows] = pool[dev_rows]`` (rows of equal width)."""
        if self.stream is None:
            host.index_copy_(0, host_rows, pool.index_select(0, dev_rows).to("cpu"))
            return
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            rows = pool.index_select(0, dev_rows)
            staged = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            staged.copy_(rows, non_blocking=True)
        compute.wait_stream(self.stream)  # the pages may be reused only after the gather
        self.stream.synchronize()  # the host copy below reads the staged rows
        host.index_copy_(0, host_rows, staged)

    def to_device(self, pool: torch.Tensor, host: torch.Tensor, dev_rows: torch.Tensor,
                  host_rows: torch.Tensor) -> None:
        """``pool[dev_rows] = host[host_rows]``; ordered before later compute-stream work."""
        if self.stream is None:
            pool.index_copy_(0, dev_rows, host.index_select(0, host_rows).to(pool.device))
            return
        compute = torch.cuda.current_stream(self.device)
        staged = host.index_select(0, host_rows).pin_memory()
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            rows = staged.to(self.device, non_blocking=True)
            pool.index_copy_(0, dev_rows, rows)
            rows.record_stream(self.stream)
        compute.wait_stream(self.stream)
