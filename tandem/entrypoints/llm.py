"""Offline batch inference: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""
from __future__ import annotations

import itertools
import logging
from typing import Any, Optional, Sequence, Union

from tqdm import tqdm

from tandem.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine, RequestError
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PromptType = Union[str, Sequence[int]]


class LLM:
    """Load a model once, then run batches of prompts through the engine.

    Keyword arguments are ``EngineConfig`` fields (``max_num_seqs=...``,
    ``async_scheduling=False``, ...). ``model=None`` uses the embedded SmolLM2 GGUF.
    """

    def __init__(self, model: Optional[str] = None, **kwargs: Any) -> None:
        self.config = EngineConfig(model=model, **kwargs)
        self.engine = LLMEngine(self.config)
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: Optional[SamplingParams | Sequence[SamplingParams]] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = ([sampling_params] * len(prompts) if isinstance(sampling_params, SamplingParams)
                  else list(sampling_params))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        ids = []
        try:
            for p, sp in zip(prompts, params):
                rid = f"gen-{next(self._ids)}"
                self.engine.add_request(rid, p, sp)
                ids.append(rid)
        except Exception:
            for rid in ids:  # a bad prompt rejects the whole call, leaving nothing behind
                self.engine.abort_request(rid)
            self._run_until_idle()
            raise
        return self._run(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: Optional[SamplingParams | Sequence[SamplingParams]] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.engine.apply_chat_template(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while len(final) < len(ids):
                for out in self.engine.step():
                    if out.finished and out.request_id in wanted:
                        final[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                self.engine.abort_request(rid)
            self._run_until_idle()
            raise
        finally:
            bar.close()
        self._run_until_idle()
        results = [final[r] for r in ids]
        failed = [r for r in results if r.error is not None]
        if failed:
            raise RequestError(f"{len(failed)} request(s) failed in the engine: {failed[0].error}", results)
        return results

    def _run_until_idle(self) -> None:
        """Let in-flight steps of finished requests complete, so the next call starts clean."""
        while self.engine.core.has_work() and not self.engine._parents:
            self.engine.step()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
