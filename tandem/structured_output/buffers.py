"""Bitmask buffers used in turn: a fresh tensor a step would be fresh pages to fault in (and,
pinned, a slow page-locking call)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch


class BitmaskBuffers:
    """Two ``[rows, words]`` int32 buffers handed out in turn, each grown (never shrunk) to
    at least the rows asked for, doubling (a served batch grows a request at a time, and
    each growth is a pinned allocation on the engine thread); the caller makes sure a
    buffer's last reader is done before it comes round again (two steps later)."""

    def __init__(self, words: int, pinned: bool) -> None:
        self.words = words
        self.pinned = pinned
        self._bufs: list[Optional["torch.Tensor"]] = [None, None]
        self._turn = 0

    def next(self, rows: int) -> "torch.Tensor":
        import torch

        self._turn ^= 1
        buf = self._bufs[self._turn]
        if buf is None or buf.shape[0] < rows:
            size = max(rows, 64, 2 * (buf.shape[0] if buf is not None else 0))
            buf = torch.empty((size, self.words), dtype=torch.int32, pin_memory=self.pinned)
            self._bufs[self._turn] = buf
        return buf[:rows]
