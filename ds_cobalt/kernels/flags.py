"""Per-chunk ready flags for the overlap scheduler (local tokens first, each remote chunk when it lands).

The communication stream calls `mark_ready(c)` right after chunk c's receive; the compute stream calls
`wait(c)` before computing on chunk c. Two parts:

- The flag: `flags_C[c]` (device int32) is set to the current epoch after the receive, in stream order.
  cupy backend: the 1-thread kernel `cuda/chunk_flags.cu::set_chunk_flag` (system-scope fences);
  torch backend: `flags_C[c].fill_(epoch)` on the same stream. Flags are never cleared: every step calls
  `new_epoch()` and "ready" means `flags_C[c] >= epoch`, so there is no reset race.
- The wait. Preferred: `cuStreamWaitValue32(compute stream, &flags_C[c], epoch, GEQ)`, a device-side wait
  that needs no host bookkeeping. CuPy (14.2) does not expose that driver call, so today the wait is the
  event-based fallback: `mark_ready` also records a `torch.cuda.Event` on the communication stream and
  `wait` makes the compute stream wait on it (`Stream.wait_event`, also device-side, no host sync). It
  needs `mark_ready(c)` to be *enqueued* (host order) before `wait(c)`, which the scheduler does anyway;
  `wait` raises otherwise instead of silently waiting on last step's event. `wait_mode` says which is used.
On CPU tensors (tests) there are no streams: `mark_ready` sets the flag and `wait` checks it.
"""

from __future__ import annotations

import torch

__all__ = ["ChunkReadyFlags"]


class ChunkReadyFlags:
    """`num_chunks` ready flags on `device`; see the module docstring. Build with `ops.chunk_ready_flags`."""

    def __init__(self, num_chunks: int, device: torch.device | str, backend: str) -> None:
        if num_chunks < 0:
            raise ValueError(f"num_chunks must be >= 0, got {num_chunks}")
        if backend not in ("torch", "cupy"):
            raise ValueError(f"backend must be 'torch' or 'cupy' here, got {backend!r}")
        self.device = torch.device(device)
        self.backend = backend
        self.flags_C = torch.zeros(num_chunks, dtype=torch.int32, device=self.device)
        self.epoch = 0
        self._marked = [0] * num_chunks  # host view: epoch in which mark_ready(c) was last enqueued
        self._events: list[torch.cuda.Event] = []
        self._wait_value = None
        if self.device.type == "cuda":
            self._events = [torch.cuda.Event() for _ in range(num_chunks)]
            if backend == "cupy":
                from .cupy_backend import stream_wait_value32

                self._wait_value = stream_wait_value32()
        self.wait_mode = ("host" if self.device.type != "cuda"
                          else "stream_wait_value32" if self._wait_value is not None else "event")

    @property
    def num_chunks(self) -> int:
        return self.flags_C.shape[0]

    def new_epoch(self) -> int:
        """Start a new round (one per step); returns the value that means "ready" in it."""
        self.epoch += 1
        return self.epoch

    def mark_ready(self, chunk: int, stream: torch.cuda.Stream | None = None) -> None:
        """Enqueue "chunk landed" on `stream` (default: current), after the chunk's receive."""
        self._check(chunk)
        if self.device.type != "cuda":
            self.flags_C[chunk] = self.epoch
        else:
            stream = stream or torch.cuda.current_stream(self.device)
            with torch.cuda.stream(stream):
                if self.backend == "cupy":
                    from .cupy_backend import set_chunk_flag

                    set_chunk_flag(self.flags_C, chunk, self.epoch)
                else:
                    self.flags_C[chunk].fill_(self.epoch)
                self._events[chunk].record(stream)
        self._marked[chunk] = self.epoch

    def wait(self, chunk: int, stream: torch.cuda.Stream | None = None) -> None:
        """Make `stream` (default: current) wait until chunk `chunk` of the current epoch has landed."""
        self._check(chunk)
        if self.wait_mode == "stream_wait_value32":
            stream = stream or torch.cuda.current_stream(self.device)
            address = self.flags_C.data_ptr() + 4 * chunk
            self._wait_value(stream.cuda_stream, address, self.epoch, 0x1)  # 0x1 = CU_STREAM_WAIT_VALUE_GEQ
            return
        if self._marked[chunk] != self.epoch:
            raise RuntimeError(f"wait({chunk}) before mark_ready({chunk}) was enqueued in epoch {self.epoch}; "
                               f"the {self.wait_mode!r} wait needs the mark first (host order)")
        if self.wait_mode == "event":
            (stream or torch.cuda.current_stream(self.device)).wait_event(self._events[chunk])
        elif int(self.flags_C[chunk]) < self.epoch:
            raise RuntimeError(f"chunk {chunk} not ready in epoch {self.epoch}")

    def is_ready(self, chunk: int) -> bool:
        """Host-side, non-blocking: has chunk `chunk` of the current epoch landed?"""
        self._check(chunk)
        if self._marked[chunk] != self.epoch:
            return False
        return self._events[chunk].query() if self._events else int(self.flags_C[chunk]) >= self.epoch

    def _check(self, chunk: int) -> None:
        if not 0 <= chunk < self.num_chunks:
            raise ValueError(f"chunk must be in [0, {self.num_chunks}), got {chunk}")
        if self.epoch == 0:
            raise RuntimeError("call new_epoch() before marking or waiting (epoch 0 means 'never ready')")
