"""Speculative decoding settings (``EngineConfig.speculative_config``), as in vLLM.

A proposer guesses the next ``num_speculative_tokens`` tokens of a request; the target
model scores them all in one forward pass and keeps the longest prefix it agrees with,
plus one token of its own. Output is exactly what plain decoding emits (greedy) or has
exactly its distribution (sampling): see ``tandem.worker.speculative``.

Methods:

* ``ngram`` (prompt lookup): find the latest earlier occurrence of the request's last
  ``n`` tokens (``prompt_lookup_max`` down to ``prompt_lookup_min``) and propose what
  followed it. No model; good on copy-heavy text (quoting, code edits, lists).
* ``draft_model``: a small model with the same vocabulary proposes greedily (run in the
  same worker, with its own KV cache).
"""
from __future__ import annotations

import os
from typing import Literal, Optional

from pydantic import Field, model_validator

from tandem.validation import StrictModel

MAX_SPECULATIVE_TOKENS = 16  # the verify step scores 1 + k positions per request


class SpeculativeConfig(StrictModel):
    """How (and whether) requests speculate. Validated like ``EngineConfig``."""

    what = "speculative config"

    method: Literal["ngram", "draft_model"] = Field(
        description="proposer: ngram (prompt lookup in the request's own tokens) or draft_model (a small model)")
    num_speculative_tokens: int = Field(
        ge=1, le=MAX_SPECULATIVE_TOKENS,
        description=f"tokens proposed per request per step (1..{MAX_SPECULATIVE_TOKENS})")
    prompt_lookup_min: int = Field(1, ge=1, le=64, description="ngram: shortest suffix looked up")
    prompt_lookup_max: int = Field(4, ge=1, le=64, description="ngram: longest suffix looked up (tried first)")
    model: Optional[str] = Field(None, description="draft_model: folder or .gguf file of the draft model")
    disable_by_batch_size: Optional[int] = Field(
        None, ge=1, description="speculate only in steps with fewer running requests than this "
                                "(large batches are compute-bound: verifying drafts there costs more than it saves)")

    @model_validator(mode="after")
    def _consistent(self) -> "SpeculativeConfig":
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.method == "draft_model":
            if self.model is None:
                raise ValueError("method 'draft_model' needs 'model' (the draft model's folder or .gguf file)")
            if not os.path.exists(self.model):
                raise ValueError(f"draft model path {self.model!r} does not exist (tandem loads local folders and "
                                 ".gguf files; it never downloads from a hub)")
        elif self.model is not None:
            raise ValueError(f"'model' is for method 'draft_model'; method {self.method!r} uses no model")
        return self
