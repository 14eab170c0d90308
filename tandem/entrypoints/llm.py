"""Offline batch inference: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

Everything a user can get wrong is refused here or in the engine's input processor with a
message that names the problem, before any of it reaches the engine core: the model files
and the machine are checked before the weights load (``tandem.engine.prepare``), the shape of each
call's arguments before any request is added. A refused call leaves the ``LLM`` usable.
"""
from __future__ import annotations

import itertools
import numbers
from typing import Any, Optional, Sequence, Union

from tqdm import tqdm

from tandem.config import EngineConfig, ModelConfig
from tandem.engine.llm_engine import LLMEngine, RequestError
from tandem.engine.prepare import prepare_model
from tandem.interrupts import gated_signals
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.types.engine_output import INVALID_REQUEST
from tandem.validation import show

PromptType = Union[str, Sequence[int]]
Conversation = list[dict[str, Any]]

# -- the shape of each call's arguments ---------------------------------------------------------
def normalize_prompts(prompts: Any) -> list[PromptType]:
    """A prompt or a list of them, as a list; token ids checked to be ints.

    Wrong argument types raise ``TypeError``; wrong values (no prompt, a float among
    token ids) ``ValueError``. A list whose first item is a number is one token-id prompt.
    """
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise TypeError("prompts must be a string, a list of token ids, or a list of those; "
                        f"got {type(prompts).__name__} {show(prompts)}")
    if not prompts:
        raise ValueError("no prompts given: pass at least one prompt")
    if isinstance(prompts[0], numbers.Number):
        return [_token_ids(prompts, 0)]
    return [p if isinstance(p, str) else _token_ids(p, i) for i, p in enumerate(prompts)]


def _token_ids(prompt: Any, index: int) -> list[int]:
    if not isinstance(prompt, (list, tuple)):
        raise TypeError(f"prompt {index} must be a string or a list of token ids, "
                        f"got {type(prompt).__name__} {show(prompt)}")
    ids = []
    for pos, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise ValueError(f"prompt {index}: token ids must be integers, got {type(t).__name__} {show(t)} "
                             f"at position {pos}")
        ids.append(int(t))  # numpy / torch integers become plain ints
    return ids


def normalize_sampling_params(sampling_params: Any, count: int) -> list[SamplingParams]:
    """One ``SamplingParams`` per prompt; a dict of fields is refused with the fix."""
    if sampling_params is None:
        return [SamplingParams()] * count
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if isinstance(sampling_params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in sampling_params):
        if len(sampling_params) != count:
            raise ValueError(f"got {count} prompts but {len(sampling_params)} sampling params")
        return list(sampling_params)
    kind = type(sampling_params).__name__
    if isinstance(sampling_params, (list, tuple)):
        kind += " holding " + ", ".join(sorted({type(p).__name__ for p in sampling_params}))
    hint = "; build one with SamplingParams(**fields)" if isinstance(sampling_params, dict) else ""
    raise TypeError(f"sampling_params must be a SamplingParams (or a list of them), got {kind}{hint}")


def check_messages(messages: Any) -> Conversation:
    """A conversation: a non-empty list of ``{"role": str, "content": str}`` dicts."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects, "
                         f"got {type(messages).__name__} {show(messages)}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"message {i} must be an object with 'role' and 'content', "
                             f"got {type(m).__name__} {show(m)}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise ValueError(f"message {i} needs a string {key!r}, got {show(m.get(key))}")
    return messages


def normalize_conversations(messages: Any) -> list[Conversation]:
    """One conversation (a list of message dicts) or a list of conversations, as a list."""
    if isinstance(messages, list) and messages and all(isinstance(c, list) for c in messages):
        return [check_messages(c) for c in messages]
    return [check_messages(messages)]


class LLM:
    """Load a model once, then run batches of prompts through the engine.

    Keyword arguments are ``EngineConfig`` fields (``max_num_seqs=...``,
    ``async_scheduling=False``, ...); an unknown one is refused with the closest field
    named. ``model=None`` uses the embedded SmolLM2 GGUF.
    """

    def __init__(self, model: Optional[str] = None, **kwargs: Any) -> None:
        self._start(EngineConfig(model=model, **kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig, model_config: Optional[ModelConfig] = None) -> "LLM":
        """An ``LLM`` for a validated config; ``model_config`` from ``prepare_model`` saves resolving twice."""
        llm = cls.__new__(cls)
        llm._start(config, model_config)
        return llm

    def _start(self, config: EngineConfig, model_config: Optional[ModelConfig] = None) -> None:
        self.config = config
        self.engine = LLMEngine(config, model_config=model_config or prepare_model(config))
        self._ids = itertools.count()

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: Optional[SamplingParams | Sequence[SamplingParams]] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion. A bad prompt or parameter rejects the whole call
        (``ValueError``/``TypeError`` naming the prompt) and leaves nothing running. An
        interrupt (Ctrl-C, or any handler's exception) stops the call and leaves nothing
        running either: the same ``LLM`` serves the next call as if this one never was."""
        prompt_list = normalize_prompts(prompts)
        params = normalize_sampling_params(sampling_params, len(prompt_list))
        with gated_signals():  # interrupts wait out the engine's bookkeeping (tandem/interrupts.py)
            ids: list[str] = []
            try:
                for i, (p, sp) in enumerate(zip(prompt_list, params)):
                    rid = f"gen-{next(self._ids)}"
                    ids.append(rid)  # before adding: an interrupt inside the add still aborts it
                    try:
                        self.engine.check_structured_outputs(sp)
                        self.engine.add_request(rid, p, sp)
                    except ValueError as e:
                        if len(prompt_list) == 1:
                            raise
                        raise ValueError(f"prompt {i}: {e}") from e
                # In the try too: an interrupt between the adds and ``_run``'s own guard
                # (the progress bar takes a while to build) still aborts the requests.
                return self._run(ids, use_tqdm)
            except BaseException:
                self._abort(ids)  # a bad prompt or an interrupt leaves nothing behind
                raise

    def chat(
        self,
        messages: Conversation | list[Conversation],
        sampling_params: Optional[SamplingParams | Sequence[SamplingParams]] = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        convs = normalize_conversations(messages)
        prompts = [self.engine.apply_chat_template(c) for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        wanted = set(ids)
        bar: Optional[tqdm] = None
        try:
            bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
            while len(final) < len(ids):
                for out in self.engine.step(final_only=True):
                    if out.finished and out.request_id in wanted:
                        final[out.request_id] = out
                        bar.update(1)
        except BaseException:
            self._abort(ids)
            raise
        finally:
            if bar is not None:
                bar.close()
        self._run_until_idle()
        results = [final[r] for r in ids]
        failed = [r for r in results if r.error is not None]
        refused = [(i, r) for i, r in enumerate(results) if r.error_kind == INVALID_REQUEST]
        if refused:  # the request's own fault (checked up front: a safety net)
            i, r = refused[0]
            raise ValueError(r.error if len(results) == 1 else f"prompt {i}: {r.error}")
        if failed:
            raise RequestError(f"{len(failed)} request(s) failed in the engine: {failed[0].error}", results)
        return results

    def _abort(self, ids: list[str]) -> None:
        """Stop the call's requests and finish its in-flight steps: nothing is left running."""
        for rid in ids:
            self.engine.abort_request(rid)
        self._run_until_idle()

    def _run_until_idle(self) -> None:
        """Let in-flight steps of finished requests complete, so the next call starts clean."""
        while self.engine.has_only_leftover_steps():
            self.engine.step()

    def spec_decode_stats(self) -> dict[str, Any]:
        """Speculative decoding's totals since start: ``spec_num_drafts`` (proposals
        verified), ``spec_num_draft_tokens``, ``spec_num_accepted_tokens``,
        ``spec_accepted_per_position`` (the names of ``/metrics``' counters); and
        ``acceptance_rate``. Empty without ``speculative_config``."""
        stats = self.engine.core.spec_decode_stats()
        if stats:
            drafted = stats["spec_num_draft_tokens"]
            stats["acceptance_rate"] = stats["spec_num_accepted_tokens"] / drafted if drafted else 0.0
        return stats

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
