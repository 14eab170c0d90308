"""Incremental detokenization and stop-string detection.

The output processor feeds each request's newly sampled token ids into an
:class:`IncrementalDetokenizer`, which turns them into text one token at a time
and checks the request's stop strings.

Decoding is delegated to the ``tokenizers`` library: :class:`tokenizers.decoders.DecodeStream`
buffers tokens until they form complete UTF-8 text (byte-fallback / byte-level pieces of a
multi-byte character are never emitted as U+FFFD halves) and emits
``decode(context + ids)[len(decode(context)):]``. The stream is seeded with the last few
prompt ids, so SentencePiece-style decoders (Metaspace + ``Strip(' ', 1, 0)``) give the first
output token its leading space exactly as ``decode(prompt + output)`` minus ``decode(prompt)``
would, instead of stripping it as ``decode(output)`` does.

Tokenizers without a ``tokenizers`` backend (slow / Python tokenizers) fall back to the same
algorithm written over ``tokenizer.decode``.
"""

from __future__ import annotations

from typing import Any

try:
    from tokenizers import Tokenizer as _RustTokenizer
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - tokenizers is a hard dependency
    _RustTokenizer = None
    DecodeStream = None

__all__ = ["IncrementalDetokenizer"]

# Older tokenizers raise this from DecodeStream.step when re-decoding its window no longer
# starts with the text already emitted (vLLM recovers by restarting the stream; so do we).
# tokenizers 0.23 instead returns the whole re-decoded window in that case, which is why a
# prompt ending inside a multi-byte character is never used as stream context (see
# _prompt_context).
_INVALID_PREFIX_ERR_MSG = "Invalid prefix encountered"

# Prompt context used to seed the stream: the shortest suffix of at least this many tokens...
_MIN_PROMPT_CONTEXT = 4
# ...and at most this many, whose decode contains no U+FFFD (no split multi-byte character).
_MAX_PROMPT_CONTEXT = 24

_REPLACEMENT_CHAR = "\ufffd"


# Feeding at least this many ids at once to a fresh detokenizer decodes them in one call.
_AT_ONCE_MIN = 8


def _concatenative(backend: Any) -> bool:
    """Whether the backend's decoder makes ``decode(a + b)`` extend ``decode(a)`` by text
    that depends on ``b`` and a clean split point only, so that the stream's per-window
    differences add up to one difference of full decodes: a byte-level decoder (GPT-2,
    Llama 3, Qwen, SmolLM2: the text is the UTF-8 of the concatenated token bytes) or none
    (tokens joined by spaces). SentencePiece chains (``Strip``, ``Fuse``, byte fallback)
    are left to the stream."""
    from tokenizers import decoders

    decoder = backend.decoder
    return decoder is None or isinstance(decoder, decoders.ByteLevel)


def _backend_of(tokenizer: Any):
    """The underlying ``tokenizers.Tokenizer`` of a fast tokenizer, or None."""
    if _RustTokenizer is not None and isinstance(tokenizer, _RustTokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        backend = getattr(tokenizer, "_tokenizer", None)
    if _RustTokenizer is not None and isinstance(backend, _RustTokenizer):
        return backend
    return None


def _prompt_context(decode, prompt_token_ids: list[int]) -> tuple[list[int], list[int]]:
    """Split the prompt's tail into ``(context, pending)``.

    ``context``: the last few prompt ids to seed the decode stream with (vLLM's rule: the
    shortest suffix of at least 4 ids whose decode has no U+FFFD, capped at 24 ids).
    ``pending``: trailing prompt ids that end inside a multi-byte character (at most 4, as a
    UTF-8 character has at most 4 bytes). They must not be part of the context -- once output
    tokens complete the character, DecodeStream would find that its decoded window no longer
    starts with the context's text (which ended in U+FFFD) and emit the whole window, prompt
    text included. Instead they are stepped through the stream like output tokens, and the
    prompt's share of the text they produce is dropped (see IncrementalDetokenizer).
    """
    n = len(prompt_token_ids)
    end = n
    for j in range(0, min(4, n) + 1):
        window = prompt_token_ids[max(0, n - j - _MAX_PROMPT_CONTEXT): n - j]
        if not decode(window).endswith(_REPLACEMENT_CHAR):
            end = n - j
            break
    head, pending = prompt_token_ids[:end], list(prompt_token_ids[end:])
    if len(head) <= _MIN_PROMPT_CONTEXT:
        return list(head), pending
    for i in range(_MIN_PROMPT_CONTEXT, min(len(head), _MAX_PROMPT_CONTEXT) + 1):
        suffix = head[-i:]
        if _REPLACEMENT_CHAR not in decode(suffix):
            return list(suffix), pending
    # Every candidate contains U+FFFD (e.g. the prompt itself has one): a capped suffix is fine;
    # a replacement char inside the context is harmless as long as it is not at its end.
    return list(head[-min(len(head), _MAX_PROMPT_CONTEXT):]), pending


class _FastStream:
    """``tokenizers.decoders.DecodeStream`` with recovery from its invalid-prefix error."""

    def __init__(self, backend, context: list[int], skip_special_tokens: bool):
        self._backend = backend
        self._skip = skip_special_tokens
        try:
            self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        except TypeError:  # older tokenizers: no ``ids=``; prime the stream by stepping.
            self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for tid in context:
                self.step(tid)

    def reseeded(self, context: list[int]) -> "_FastStream":
        """A new stream over the same backend whose next step follows ``context``."""
        return _FastStream(self._backend, context, self._skip)

    def step(self, token_id: int) -> str | None:
        try:
            return self._stream.step(self._backend, token_id)
        except (OverflowError, TypeError):  # invalid (e.g. negative) id: emit nothing
            return None
        except Exception as e:  # tokenizers raises a plain Exception
            if _INVALID_PREFIX_ERR_MSG not in str(e):
                raise
            self._stream = DecodeStream(skip_special_tokens=self._skip)
            return self._stream.step(self._backend, token_id)


class _DecodeDiffStream:
    """The DecodeStream algorithm over ``tokenizer.decode`` (for tokenizers without a backend).

    Keeps a small window of ids; emits ``decode(window)[len(decode(prefix)):]`` once that text
    is longer than the already-emitted prefix and does not end in U+FFFD (an incomplete
    multi-byte character), then slides the window so that it starts at the tokens just read.
    """

    def __init__(self, tokenizer, context: list[int], skip_special_tokens: bool,
                 spaces_between_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._spaces = spaces_between_special_tokens
        self._ids = list(context)
        self._prefix = self._decode(self._ids)
        self._read_index = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip,
                                      spaces_between_special_tokens=self._spaces)

    def step(self, token_id: int) -> str | None:
        self._ids.append(token_id)
        text = self._decode(self._ids)
        if len(text) <= len(self._prefix) or text.endswith(_REPLACEMENT_CHAR):
            return None
        if not text.startswith(self._prefix):  # non-monotonic decode: restart from this token
            self._ids = [token_id]
            self._prefix = ""
            self._read_index = 0
            text = self._decode(self._ids)
            if not text or text.endswith(_REPLACEMENT_CHAR):
                return None
        new_text = text[len(self._prefix):]
        self._ids = self._ids[self._read_index:]
        self._prefix = self._decode(self._ids)
        self._read_index = len(self._ids)
        return new_text


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, token by token, and checks stop strings."""

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Empty stop strings would match everywhere; ignore them.
        self.stop: list[str] = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        # vLLM's rule: while unfinished, hold back text that could still become a stop string.
        if self.stop and not include_stop_str_in_output:
            self.stop_buffer_length = max(len(s) for s in self.stop) - 1
        else:
            self.stop_buffer_length = 0

        self._token_ids: list[int] = []
        self._text = ""
        self._last_output_text_offset = 0
        #: The stop string that ended generation, or None.
        self.stop_str_matched: str | None = None

        prompt_token_ids = list(prompt_token_ids or [])
        backend = _backend_of(tokenizer) if DecodeStream is not None else None
        if backend is not None:
            def decode(ids: list[int]) -> str:
                return backend.decode(ids, skip_special_tokens=skip_special_tokens) if ids else ""
        else:
            def decode(ids: list[int]) -> str:
                return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        spaces_between_special_tokens=spaces_between_special_tokens) if ids else ""
        context, pending = _prompt_context(decode, prompt_token_ids)
        self._decode = decode
        # Where ids arrive many at once (a lazy caller's first catch-up), one decode call
        # can stand in for a stream step per id; see _update_at_once.
        self._at_once_context: list[int] | None = None
        if backend is not None:  # the Rust decoder writes special tokens as they are (as HF's fast tokenizers do)
            self._stream = _FastStream(backend, context, skip_special_tokens)
            if not pending and _concatenative(backend):
                self._at_once_context = list(context)
        else:
            self._stream = _DecodeDiffStream(tokenizer, context, skip_special_tokens, spaces_between_special_tokens)

        # Text of the prompt that the stream has yet to emit: when the prompt ends inside a
        # multi-byte character, the complete prompt text before that character comes out together
        # with the character once output tokens complete it; it is dropped from the output then.
        self._owed_prompt_text = ""
        if pending:
            emitted = "".join(c for c in map(self._stream.step, pending) if c)
            ctx_text = decode(context)
            full_text = decode(context + pending).rstrip(_REPLACEMENT_CHAR)
            if full_text.startswith(ctx_text + emitted):
                self._owed_prompt_text = full_text[len(ctx_text) + len(emitted):]

    # ------------------------------------------------------------------ decoding
    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; decode incrementally; return the stop string that matched (and stop
        consuming), else None.

        After a match, output_text is truncated: it ends just before the stop string, or just
        after it when include_stop_str_in_output. Tokens passed after a match (in this call or a
        later one) are ignored, so output_token_ids ends with the token that completed the stop
        string.
        """
        if self.stop_str_matched is not None:
            return None
        if not self.stop and not self._owed_prompt_text:
            # Nothing to match and no prompt text to drop: the loop below reduced to its
            # essentials, for a lazy caller that feeds a request's ids in one call.
            ids = [int(t) for t in new_token_ids]
            if self._at_once_context is not None and not self._token_ids and len(ids) >= _AT_ONCE_MIN:
                if self._update_at_once(ids):
                    return None
            self._at_once_context = None
            self._token_ids += ids
            self._text += "".join([c for c in map(self._stream.step, ids) if c])
            return None
        for token_id in new_token_ids:
            token_id = int(token_id)
            self._token_ids.append(token_id)
            chunk = self._stream.step(token_id)
            if not chunk:
                continue
            if self._owed_prompt_text:
                owed, self._owed_prompt_text = self._owed_prompt_text, ""
                if chunk.startswith(owed):
                    chunk = chunk[len(owed):]
                    if not chunk:
                        continue
            self._text += chunk
            if self.stop and self._check_stop_strings(len(chunk)):
                return self.stop_str_matched
        return None

    def _update_at_once(self, ids: list[int]) -> bool:
        """The first ids of a request without stop strings, in one decode call: the text a
        stream step per id would emit, ``decode(context + ids)[len(decode(context)):]``, when
        that is sure to be the same (see ``_concatenative``; the text must not end inside a
        character, which the stream would hold back). The stream is then reseeded after
        ``ids``, for any later ids. False (nothing changed) where the shortcut does not hold."""
        context = self._at_once_context
        assert context is not None
        self._at_once_context = None
        if any(t < 0 for t in ids):  # invalid ids: the stream's own handling (it skips them)
            return False
        try:
            full = self._decode(context + ids)
        except (OverflowError, TypeError, ValueError):
            return False
        head = self._decode(context)
        if not full.startswith(head) or full.endswith(_REPLACEMENT_CHAR):
            return False
        assert isinstance(self._stream, _FastStream)
        self._stream = self._stream.reseeded((context + ids)[-_MAX_PROMPT_CONTEXT:])
        self._token_ids += ids
        self._text += full[len(head):]
        return True

    def _check_stop_strings(self, new_char_count: int) -> bool:
        """Look for a stop string in the newly added text (plus len(stop)-1 characters before
        it). The earliest match in the text wins (ties: the one that ends first). Truncates the
        text and records the match."""
        text = self._text
        best: tuple[int, int, str] | None = None
        for stop_str in self.stop:
            start = max(0, len(text) - new_char_count - len(stop_str) + 1)
            idx = text.find(stop_str, start)
            if idx == -1:
                continue
            cand = (idx, idx + len(stop_str), stop_str)
            if best is None or cand[:2] < best[:2]:
                best = cand
        if best is None:
            return False
        idx, end, stop_str = best
        self._text = text[:end] if self.include_stop_str_in_output else text[:idx]
        self.stop_str_matched = stop_str
        return True

    # ------------------------------------------------------------------ outputs
    @property
    def output_text(self) -> str:
        """Full decoded text so far (after trimming at a stop string)."""
        return self._text

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self._token_ids)

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """For streaming: text not yet returned (delta=True) or all text (delta=False).

        While not finished (and no stop string has matched yet), the last
        ``len(longest stop string) - 1`` characters are held back when stop strings exist and
        include_stop_str_in_output is False, since they could still become the start of a stop
        string.
        """
        finished = finished or self.stop_str_matched is not None
        buffer_length = 0 if finished else self.stop_buffer_length
        text = self._text
        length = max(0, len(text) - buffer_length)
        if not delta:
            return text[:length]
        last_offset = self._last_output_text_offset
        if last_offset < length:
            self._last_output_text_offset = length
            return text[last_offset:length]
        return ""

    def __repr__(self) -> str:
        return (
            f"IncrementalDetokenizer(num_tokens={len(self._token_ids)}, "
            f"text={self._text[-40:]!r}, stopped={self.stop_str_matched!r})"
        )
