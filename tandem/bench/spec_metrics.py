"""Speculative decoding's acceptance during a benchmark run, from the server's /metrics.

The counters (``tandem:spec_decode_num_drafts``, ``_num_draft_tokens``,
``_num_accepted_tokens``, ``_num_accepted_tokens_per_pos``; vLLM's ``vllm:`` names too) are
totals since the server started, so a run reads them before and after and reports the
difference. A server without them (no speculation, or no /metrics) gives None: the summary
then has no speculative-decoding section.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Optional

logger = logging.getLogger(__name__)

_LINE = re.compile(r'^(?:tandem|vllm):spec_decode_(num_drafts|num_draft_tokens|num_accepted_tokens'
                   r'|num_accepted_tokens_per_pos)(?:_total)?(\{[^}]*\})?\s+([0-9.eE+-]+)$')
_POSITION = re.compile(r'position="(\d+)"')


@dataclass
class SpecCounters:
    num_drafts: float = 0.0
    num_draft_tokens: float = 0.0
    num_accepted_tokens: float = 0.0
    accepted_per_position: dict[int, float] = field(default_factory=dict)

    def minus(self, before: "SpecCounters") -> "SpecCounters":
        return SpecCounters(self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
                            self.num_accepted_tokens - before.num_accepted_tokens,
                            {p: n - before.accepted_per_position.get(p, 0.0)
                             for p, n in self.accepted_per_position.items()})

    def to_dict(self) -> dict[str, Any]:
        drafts = self.num_drafts
        return {
            "num_drafts": int(drafts), "num_draft_tokens": int(self.num_draft_tokens),
            "num_accepted_tokens": int(self.num_accepted_tokens),
            "acceptance_rate": self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0,
            # Tokens each verify step emits per request: the accepted drafts and one more.
            "mean_acceptance_length": 1.0 + self.num_accepted_tokens / drafts if drafts else 0.0,
            "acceptance_rate_per_position": [self.accepted_per_position[p] / drafts if drafts else 0.0
                                             for p in sorted(self.accepted_per_position)],
        }


def parse_spec_counters(text: str) -> Optional[SpecCounters]:
    """The counters in a Prometheus exposition (summed over label sets), or None if absent."""
    out = SpecCounters()
    seen = False
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if not m:
            continue
        seen = True
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "num_accepted_tokens_per_pos":
            pm = _POSITION.search(labels)
            if pm:
                pos = int(pm.group(1))
                out.accepted_per_position[pos] = out.accepted_per_position.get(pos, 0.0) + value
        else:
            setattr(out, name, getattr(out, name) + value)
    return out if seen else None


async def fetch_spec_counters(session: Any, base_url: str, headers: dict[str, str]) -> Optional[SpecCounters]:
    """The server's counters now, or None (no /metrics, or no speculation there)."""
    try:
        async with session.get(base_url.rstrip("/") + "/metrics", headers=headers) as resp:
            if resp.status != 200:
                return None
            return parse_spec_counters(await resp.text())
    except Exception as e:  # a benchmark never fails for want of metrics
        logger.debug("no /metrics: %s", e)
        return None
