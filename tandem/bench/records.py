"""One request's measurement, as the client saw it.

Kept apart from :mod:`tandem.bench.client` (which needs aiohttp) so that the metrics code
and its tests can build records by hand without any HTTP library.

All times are ``time.perf_counter()`` seconds: monotonic and high resolution, and only
differences between them are ever reported.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RequestRecord:
    """What happened to one benchmark request.

    ``chunk_times`` holds the arrival time of every streamed chunk that carried non-empty
    content; the first one defines TTFT and the gaps between the rest are the inter-token
    latencies (a chunk may hold several tokens, which is what a user of the stream sees).
    """

    index: int = -1
    success: bool = False
    error: str = ""
    status: Optional[int] = None  # HTTP status, None when no response arrived
    start_time: float = 0.0
    end_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    output_tokens_from_usage: bool = False  # False: counted from content chunks instead
    generated_text: str = ""

    @property
    def ttft(self) -> Optional[float]:
        """Seconds from sending to the first non-empty content chunk."""
        return self.chunk_times[0] - self.start_time if self.chunk_times else None

    @property
    def itl(self) -> list[float]:
        """Seconds between consecutive content chunks (empty with fewer than two)."""
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2el(self) -> float:
        """End-to-end latency in seconds: sending to the end of the response."""
        return self.end_time - self.start_time

    @property
    def tpot(self) -> Optional[float]:
        """Mean seconds per output token after the first, or None with fewer than two
        tokens (where it is undefined)."""
        ttft = self.ttft
        if ttft is None or self.output_tokens < 2:
            return None
        return (self.e2el - ttft) / (self.output_tokens - 1)
