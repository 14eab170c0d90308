"""Logprobs in the shapes clients read: OpenAI's legacy completions object (which lm-eval's
``local-completions`` parses for log-likelihoods) and vLLM's ``prompt_logprobs`` list.

JSON has no infinity, so a logprob of ``-inf`` (a token a bias or a mask ruled out) is sent
as -9999.0, as OpenAI and vLLM do.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

from tandem.outputs import PositionLogprobs

_FLOOR = -9999.0


def clamp(logprob: float) -> float:
    return max(logprob, _FLOOR)


def legacy_logprobs(token_ids: Sequence[int], positions: Sequence[Optional[PositionLogprobs]], text_offset: int,
                    decode: Callable[[int], str]) -> dict[str, Any]:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` for ``token_ids``, whose
    logprobs are ``positions`` (one per token; None where there is none, as for a prompt's first
    token, which then gets ``null`` logprob and top_logprobs). ``decode`` spells a token that has
    no logprob entry."""
    tokens: list[str] = []
    token_logprobs: list[Optional[float]] = []
    tops: list[Optional[dict[str, float]]] = []
    offsets: list[int] = []
    for tid, pos in zip(token_ids, positions):
        if pos is None:
            text = decode(tid)
            token_logprobs.append(None)
            tops.append(None)
        else:
            chosen = pos[tid]
            text = chosen.decoded_token or ""
            token_logprobs.append(clamp(chosen.logprob))
            tops.append({lp.decoded_token or "": clamp(lp.logprob) for lp in pos.values()})
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs_json(plps: Optional[Sequence[Optional[PositionLogprobs]]]) -> Optional[list[Any]]:
    """vLLM's ``prompt_logprobs``: per prompt token, None (the first) or ``{token id: {"logprob",
    "rank", "decoded_token"}}`` holding the prompt token and the top-k (JSON keys are strings)."""
    if plps is None:
        return None
    return [None if pos is None else
            {str(tid): {"logprob": clamp(lp.logprob), "rank": lp.rank, "decoded_token": lp.decoded_token}
             for tid, lp in pos.items()}
            for pos in plps]
