"""Token counting for building workloads: a local tokenizer folder, or the server itself.

The benchmark must know prompt and output lengths in the *server's* tokens. Asking the
server (``/tokenize``, ``/detokenize``, which tandem, vLLM and SGLang serve) needs nothing
on the client and can never disagree with the server; a local ``--tokenizer`` folder avoids
the round trips for large datasets. Both sit behind one small async interface so the
dataset code does not care which it has.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Optional, Protocol, Sequence

if TYPE_CHECKING:
    import aiohttp

logger = logging.getLogger(__name__)


class TokenizerError(RuntimeError):
    """A tokenizer could not be loaded or the server could not tokenize; one-line message."""


class BenchTokenizer(Protocol):
    """What the dataset builders need from a tokenizer."""

    vocab_size: Optional[int]

    async def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text, without special tokens (BOS etc.)."""

    async def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        """Text of each id list."""


class LocalTokenizer:
    """A Hugging Face tokenizer from a local folder (never downloads)."""

    def __init__(self, path: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as e:  # pragma: no cover - transformers is a tandem dependency
            raise TokenizerError(f"--tokenizer needs transformers ({e})") from None
        try:
            self._tok: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as e:  # OSError, ValueError, ... : the message is what matters
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise TokenizerError(f"cannot load tokenizer from {path!r}: {first}") from None
        self.vocab_size: Optional[int] = len(self._tok)

    async def encode(self, texts: Sequence[str]) -> list[list[int]]:
        return [list(self._tok.encode(t, add_special_tokens=False)) for t in texts]

    async def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        return [self._tok.decode(list(i)) for i in ids]


class ServerTokenizer:
    """Tokenizes through the server's ``/tokenize`` and ``/detokenize`` endpoints.

    Sends ``add_special_tokens: false`` as vLLM does; a server that refuses unknown fields
    (HTTP 400/422) is asked again with the bare ``{"prompt": ...}`` form, once, and that
    form is kept from then on.
    """

    def __init__(self, session: "aiohttp.ClientSession", base_url: str, model: Optional[str],
                 headers: Optional[dict[str, str]] = None, concurrency: int = 32) -> None:
        self._session = session
        self._base = base_url.rstrip("/")
        self._model = model
        self._headers = dict(headers or {})
        self._sem = asyncio.Semaphore(concurrency)
        self._bare = False
        self.vocab_size: Optional[int] = None

    async def _post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        import aiohttp

        try:
            async with self._sem, self._session.post(self._base + path, json=body,
                                                     headers=self._headers) as resp:
                if resp.status != 200:
                    return resp.status, (await resp.text())[:300]
                return 200, await resp.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
            raise TokenizerError(f"server {path} failed: {type(e).__name__}: {e}") from None

    async def _call(self, path: str, full: dict[str, Any], bare: dict[str, Any]) -> Any:
        """POST ``full`` (``bare`` once the server has refused extra fields); return the JSON."""
        if not self._bare:
            status, data = await self._post(path, full)
            if status in (400, 422):
                logger.info("%s refused extra fields (HTTP %d); sending the bare form", path, status)
                self._bare = True
        if self._bare:
            status, data = await self._post(path, bare)
        if status != 200:
            raise TokenizerError(f"server {path} failed: HTTP {status}: {' '.join(str(data).split())}")
        return data

    async def _tokenize(self, text: str) -> list[int]:
        full: dict[str, Any] = {"prompt": text, "add_special_tokens": False}
        if self._model:
            full["model"] = self._model
        data = await self._call("/tokenize", full, {"prompt": text})
        try:
            return [int(t) for t in data["tokens"]]
        except (KeyError, TypeError, ValueError):
            raise TokenizerError(f"server /tokenize answered without a token list: {str(data)[:200]}") from None

    async def _detokenize(self, ids: Sequence[int]) -> str:
        bare: dict[str, Any] = {"tokens": [int(i) for i in ids]}
        full = dict(bare, model=self._model) if self._model else bare
        data = await self._call("/detokenize", full, bare)
        try:
            return str(data["prompt"])
        except (KeyError, TypeError):
            raise TokenizerError(f"server /detokenize answered without a prompt: {str(data)[:200]}") from None

    async def encode(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        first = [await self._tokenize(texts[0])]  # settles the request form before fanning out
        return first + list(await asyncio.gather(*(self._tokenize(t) for t in texts[1:])))

    async def decode(self, ids: Sequence[Sequence[int]]) -> list[str]:
        if not ids:
            return []
        first = [await self._detokenize(ids[0])]
        return first + list(await asyncio.gather(*(self._detokenize(i) for i in ids[1:])))
