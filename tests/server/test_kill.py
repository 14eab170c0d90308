"""SIGKILL the engine-core process under load: every open request ends with an error within
5 s, no client hangs, and the server (a half-alive server must not keep running) exits on
its own with status 1 and the reason, leaving nothing behind."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import openai
import pytest

from server_utils import ServerProcess

pytestmark = pytest.mark.timeout(600)

LONG = {"prompt": "t5 t6 t7", "max_tokens": 450, "temperature": 0, "extra_body": {"ignore_eos": True}}


def test_engine_core_killed_under_load(slow_model, tmp_path):
    srv = ServerProcess(slow_model, "--max-model-len", "512", "--num-kv-blocks", "256", tmp=tmp_path)
    try:
        ended = asyncio.run(_kill_under_load(srv))
        assert len(ended) == 10
        for what, after_kill in ended:
            assert what.startswith("error"), ended
            assert after_kill < 5.0, ended
        assert srv.proc.wait(30) == 1, srv.log.read_text()
    finally:
        code = srv.stop()
    assert code == 1
    assert "killed by SIGKILL" in srv.log.read_text()


async def _kill_under_load(srv: ServerProcess) -> list[tuple[str, float]]:
    killed_at: list[float] = []
    first_chunks = asyncio.Semaphore(0)

    async def stream(c: openai.AsyncOpenAI, model: str) -> tuple[str, float]:
        try:
            chunks = await c.completions.create(model=model, stream=True, **LONG)
            got_first = False
            async for _ in chunks:
                if not got_first:
                    got_first = True
                    first_chunks.release()
            return "finished", time.monotonic() - killed_at[0]
        except openai.APIError as e:
            return f"error: {e}", time.monotonic() - killed_at[0]

    async def whole(c: openai.AsyncOpenAI, model: str) -> tuple[str, float]:
        try:
            await c.completions.create(model=model, **LONG)
            return "finished", time.monotonic() - killed_at[0]
        except openai.APIError as e:
            return f"error: {e}", time.monotonic() - killed_at[0]

    async with openai.AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=60) as c:
        model = (await c.models.list()).data[0].id
        tasks = [asyncio.ensure_future(stream(c, model)) for _ in range(8)] + \
                [asyncio.ensure_future(whole(c, model)) for _ in range(2)]
        for _ in range(8):
            await asyncio.wait_for(first_chunks.acquire(), 120)
        await asyncio.sleep(0.5)  # the two non-streaming requests are running too
        killed_at.append(time.monotonic())
        os.kill(srv.core_pid, signal.SIGKILL)
        return await asyncio.wait_for(asyncio.gather(*tasks), 30)
