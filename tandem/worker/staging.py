"""One host-to-device copy per step: a pinned staging buffer packed with numpy.

A step's host inputs (positions, slots, block-table updates, sampling parameters, ...) are
written as numpy arrays into consecutive, 16-byte-aligned segments of one pinned buffer of
32-bit words; ``upload()`` copies the used prefix to the device in one non-blocking copy,
and each segment is then read on the device as a typed view (``int32``, ``int64`` or
``float32``) of the device buffer.

Why this is safe without waiting:
* the copy is queued on the compute stream, so it runs after every kernel of the previous
  step that reads the device buffer — one device buffer suffices;
* the host side alternates between two pinned buffers, and a buffer is rewritten only
  after the event recorded behind its last copy has fired (normally long ago).

CUDA graphs read their inputs from fixed offsets of the same device buffer: a decode step
packs its segments in a layout that depends only on the padded batch size, so a graph
captured for that size finds this step's values where it read them at capture.

On the CPU there is nothing to copy: the "device" buffer is the host buffer being packed.
It alternates between two all the same, so that a step packed ahead of the previous
step's sampling call (``ModelRunner.prepare``) leaves the inputs that call reads intact.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

_DTYPES = {np.dtype(np.int32): torch.int32, np.dtype(np.int64): torch.int64, np.dtype(np.float32): torch.float32}


class Segment:
    """Where one array sits in the buffer: word offset, element count, dtype."""

    __slots__ = ("offset", "count", "dtype")

    def __init__(self, offset: int, count: int, dtype: np.dtype) -> None:
        self.offset, self.count, self.dtype = offset, count, dtype


class StagingBuffer:
    def __init__(self, capacity_words: int, device: torch.device) -> None:
        self.device = device
        self.capacity = capacity_words
        self.cuda = device.type == "cuda"
        self._hosts = [torch.zeros(capacity_words, dtype=torch.int32, pin_memory=self.cuda) for _ in range(2)]
        self._events: list[Optional[torch.cuda.Event]] = [None, None]
        self.device_buf = (torch.zeros(capacity_words, dtype=torch.int32, device=device) if self.cuda
                           else self._hosts[0])
        self._cur = 0
        self._np = self._hosts[0].numpy()
        self.offset = 0

    # -- packing ---------------------------------------------------------------------------
    def begin(self, at: int = 0) -> None:
        """Start packing a step at word ``at`` (after a fixed-layout region, if any)."""
        self._cur ^= 1
        if self.cuda:
            ev = self._events[self._cur]
            if ev is not None and not ev.query():
                ev.synchronize()  # the copy that last read this host buffer is not done yet
        else:
            self.device_buf = self._hosts[self._cur]
        self._np = self._hosts[self._cur].numpy()
        self.offset = at

    def reserve(self, count: int, dtype: np.dtype | type, at: Optional[int] = None) -> tuple[Segment, np.ndarray]:
        """A segment of ``count`` elements and the numpy view to fill it through."""
        dt = np.dtype(dtype)
        words = count * dt.itemsize // 4
        start = self.offset if at is None else at
        # 16-byte alignment: int64 views need 8, and Triton specializes its kernels on
        # whether each pointer argument is 16-byte aligned (a shifted segment would make
        # it compile another variant just-in-time, in the middle of serving).
        start += -start % 4
        end = start + words
        if end > self.capacity:
            raise OverflowError(f"staging buffer of {self.capacity} words is too small ({end} needed)")
        if at is None:
            self.offset = end
        view = self._np[start:end].view(dt)
        return Segment(start, count, dt), view

    def put(self, arr: np.ndarray, at: Optional[int] = None) -> Segment:
        seg, view = self.reserve(arr.size, arr.dtype, at)
        view[:] = arr.reshape(-1)
        return seg

    def host_view(self, seg: Segment) -> np.ndarray:
        """The numpy view of a segment in the buffer being packed (a value to write into a
        segment reserved earlier in this step, before ``upload``)."""
        words = seg.count * seg.dtype.itemsize // 4
        return self._np[seg.offset:seg.offset + words].view(seg.dtype)

    def upload(self) -> None:
        """Copy everything packed since ``begin(0)`` to the device (one non-blocking copy)."""
        if not self.cuda:
            return
        n = self.offset + (-self.offset % 4)
        host = self._hosts[self._cur]
        self.device_buf[:n].copy_(host[:n], non_blocking=True)
        ev = self._events[self._cur] or torch.cuda.Event()
        ev.record()
        self._events[self._cur] = ev

    # -- reading on the device -------------------------------------------------------------
    def view(self, seg: Segment) -> torch.Tensor:
        """The device tensor of a segment (int32, int64 or float32)."""
        words = seg.count * seg.dtype.itemsize // 4
        return self.device_buf[seg.offset:seg.offset + words].view(_DTYPES[seg.dtype])


class BitmaskStager:
    """A constrained step's token bitmask, laid out by sampled row, onto the device.

    On CUDA the rows are assembled in one of two pinned buffers (allocated on the first
    constrained step, sized for ``max_rows``) and copied without blocking into one device
    buffer, as the staging buffer does: a pinned buffer is rewritten only after the copy that
    last read it has finished. (A copy from pageable memory may wait for the stream, i.e.
    for the forward pass the bitmask is meant to overlap.) A laid-out bitmask that is
    already pinned (the engine core fills pinned buffers when this worker runs in its
    process) is copied from where it is. On the CPU the host rows are used as they are.

    ``stage_rows`` moves only the constrained rows (with a 152k vocabulary a row is 19 KB:
    a batch of 256 where a fifth is constrained would otherwise copy 4.9 MB, mostly ones)
    and scatters them on the device; the mask is then applied to those rows only.
    ``stage`` lays out every row (speculative decoding's extra flag column needs ones in
    unconstrained rows).
    """

    def __init__(self, max_rows: int, device: torch.device) -> None:
        self.max_rows = max_rows
        self.device = device
        self.cuda = device.type == "cuda"
        self._hosts: list[torch.Tensor] = []
        self._events: list[Optional[torch.cuda.Event]] = [None, None]
        self._device_buf: Optional[torch.Tensor] = None
        self._cur = 0
        # stage_rows: pinned row indices, and the device rows scattered by sampled row.
        self._host_idx: list[torch.Tensor] = []
        self._device_idx: Optional[torch.Tensor] = None
        self._device_by_row: Optional[torch.Tensor] = None

    def stage_rows(self, bitmask: torch.Tensor, rows: Optional[list[int]], num_rows: int
                   ) -> tuple[torch.Tensor, Optional[torch.Tensor | list[int]]]:
        """The mask by sampled row on the device, and which rows to mask: row ``rows[i]``
        is ``bitmask[i]`` (``rows`` None: row ``i``, every row listed); other rows are left
        undefined and must not be masked. The indices are None when every row is listed in
        order, a device tensor on CUDA, a list on the CPU (what xgrammar's kernels take)."""
        k, words = bitmask.shape
        if rows is None or (k == num_rows and rows == list(range(num_rows))):
            assert k == num_rows
            return (self.stage(bitmask, None, num_rows) if self.cuda else bitmask), None
        if not self.cuda:
            by_row = torch.empty((num_rows, words), dtype=torch.int32)
            by_row[rows] = bitmask
            return by_row, rows
        host = self._pinned_source(bitmask, self._pinned(words)[:k])
        idx = self._host_idx[self._cur][:k]
        idx.copy_(torch.as_tensor(rows, dtype=torch.int64))
        assert self._device_buf is not None and self._device_idx is not None and self._device_by_row is not None
        dev, dev_idx = self._device_buf[:k], self._device_idx[:k]
        dev.copy_(host, non_blocking=True)
        dev_idx.copy_(idx, non_blocking=True)
        self._record()
        by_row = self._device_by_row[:num_rows]
        by_row.index_copy_(0, dev_idx, dev)
        return by_row, dev_idx

    def allocate(self, words: int) -> None:
        """The buffers for rows of ``words`` words (kept while the width stays: the masked
        sampling graphs read the device ones). The index buffer starts at the scratch row
        (``max_rows``) so that a graph's warm-up reads valid indices."""
        if self._hosts and self._hosts[0].shape[1] == words:
            return
        self._hosts = [torch.empty((self.max_rows, words), dtype=torch.int32, pin_memory=True) for _ in range(2)]
        self._host_idx = [torch.empty(self.max_rows, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self._device_buf = torch.empty((self.max_rows, words), dtype=torch.int32, device=self.device)
        self._device_idx = torch.full((self.max_rows,), self.max_rows, dtype=torch.int64, device=self.device)
        self._device_by_row = torch.empty((self.max_rows + 1, words), dtype=torch.int32, device=self.device)

    def _pinned(self, words: int) -> torch.Tensor:
        """The next pinned buffer, once the copy that last read it is done (buffers are
        (re)allocated for a new row width)."""
        self.allocate(words)
        self._cur ^= 1
        ev = self._events[self._cur]
        if ev is not None and not ev.query():
            ev.synchronize()  # the copy that last read this pinned buffer is not done yet
        return self._hosts[self._cur]

    # -- the masked sampling graphs' inputs (CUDA) ---------------------------------------
    def graph_buffers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows ``[max_rows, words]``, their sampled rows ``[max_rows]``, the mask by
        sampled row ``[max_rows + 1, words]``, the last a scratch row): what a masked
        sampling graph reads, at fixed addresses (``allocate`` first)."""
        assert self._device_buf is not None and self._device_idx is not None and self._device_by_row is not None
        return self._device_buf, self._device_idx, self._device_by_row

    def stage_for_graph(self, bitmask: torch.Tensor, rows: Optional[list[int]], size: int) -> None:
        """Copy a step's bitmask rows and their sampled rows (``rows``; None: ``0..k-1``)
        into ``graph_buffers`` for a graph of ``size`` rows: index entries ``k..size-1``
        point at the scratch row, so the graph's scatter leaves the other rows unmasked."""
        k, words = bitmask.shape
        host = self._pinned_source(bitmask, self._pinned(words)[:k])
        idx = self._host_idx[self._cur].numpy()
        idx[:k] = np.arange(k) if rows is None else rows
        idx[k:size] = self.max_rows
        src, dev_idx, _ = self.graph_buffers()
        if k:
            src[:k].copy_(host, non_blocking=True)
        dev_idx[:size].copy_(self._host_idx[self._cur][:size], non_blocking=True)
        self._record()

    @staticmethod
    def _pinned_source(bitmask: torch.Tensor, host: torch.Tensor) -> torch.Tensor:
        """Where the device copy reads ``bitmask`` from: itself when it is pinned (filled by
        the engine core in this process, which keeps the buffer until the step after next
        has returned its tokens, so the copy, queued before that step's sampling, is done
        before a refill), else ``host`` after copying it there."""
        return bitmask if bitmask.is_pinned() else host.copy_(bitmask)

    def _record(self) -> None:
        ev = self._events[self._cur] or torch.cuda.Event()
        ev.record()
        self._events[self._cur] = ev

    def stage(self, bitmask: torch.Tensor, rows: Optional[list[int]], num_rows: int) -> torch.Tensor:
        """``[num_rows, words]`` on the device: row ``rows[i]`` is ``bitmask[i]`` (``rows`` None:
        ``bitmask`` is already laid out), every other row all ones (unconstrained)."""
        words = bitmask.shape[1]
        if not self.cuda:
            if rows is None:
                return bitmask
            full = torch.full((num_rows, words), -1, dtype=torch.int32)
            full[rows] = bitmask
            return full
        host = self._pinned(words)[:num_rows]
        if rows is None:
            host = self._pinned_source(bitmask, host)
        else:
            host.fill_(-1)
            host[rows] = bitmask
        assert self._device_buf is not None
        dev = self._device_buf[:num_rows]
        dev.copy_(host, non_blocking=True)
        self._record()
        return dev
