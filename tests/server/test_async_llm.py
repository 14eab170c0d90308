"""AsyncLLM without HTTP: the same outputs as the offline engine with the core in a thread or
in its own process; aborts free blocks; a dead or hung core fails every pending request."""
from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from proc_utils import pid_alive
from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.engine.async_llm import AsyncLLM
from tandem.engine.inproc_client import start_inproc
from tandem.engine.messages import EngineDeadError

pytestmark = pytest.mark.timeout(300)

ENGINE = dict(max_model_len=256, num_kv_blocks=128, block_size=16)


def workload() -> list[tuple[list[int], SamplingParams]]:
    return [
        ([5, 6, 7], SamplingParams(temperature=0, max_tokens=12)),
        ([9, 20, 21, 22], SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=10, logprobs=2)),
        ([30, 31], SamplingParams(temperature=0, max_tokens=16, stop=["t40", "t41"], ignore_eos=True)),
        ([8] * 20, SamplingParams(temperature=0.8, seed=9, max_tokens=8, min_tokens=4, stop_token_ids=[50])),
        ([44, 45, 46], SamplingParams(temperature=0, max_tokens=6, presence_penalty=1.0, repetition_penalty=1.2)),
    ]


async def run_all(engine: AsyncLLM) -> list:
    async def one(i: int, prompt: list[int], sp: SamplingParams):
        last = None
        async for out in engine.generate(f"r{i}", prompt, sp):
            last = out
        return last

    return await asyncio.gather(*(one(i, p, sp) for i, (p, sp) in enumerate(workload())))


def summary(outs) -> list:
    return [[(c.text, c.token_ids, c.finish_reason, c.stop_reason, None if c.logprobs is None else len(c.logprobs))
             for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    with LLM(tiny_llama, **ENGINE) as llm:
        prompts, params = zip(*workload())
        return summary(llm.generate(list(prompts), list(params), use_tqdm=False))


@pytest.mark.parametrize("core", ["thread", "process"])
def test_same_outputs_as_offline(tiny_llama, reference, core):
    async def main():
        config = EngineConfig(model=tiny_llama, **ENGINE)
        engine = AsyncLLM.start(config) if core == "process" else start_inproc(config)
        try:
            outs = await run_all(engine)
            assert all(o.finished and o.error is None for o in outs)
            return summary(outs)
        finally:
            await engine.shutdown()

    assert asyncio.run(main()) == reference


def test_abort_frees_blocks_and_stop_strings_stop_the_core(tiny_llama):
    async def main():
        engine = start_inproc(EngineConfig(model=tiny_llama, **ENGINE))
        try:
            n = 0
            async for _ in engine.generate("long", [5, 6], SamplingParams(max_tokens=200, ignore_eos=True)):
                n += 1
                if n == 3:
                    break  # leaving the iterator aborts the request
            await wait_idle(engine)
            first = None
            async for out in engine.generate("g", [30, 31], SamplingParams(temperature=0, max_tokens=3)):
                first = out
            word = first.outputs[0].text.split()[1]
            async for out in engine.generate("s", [30, 31], SamplingParams(temperature=0, max_tokens=200, stop=[word],
                                                                          ignore_eos=True)):
                pass
            assert out.outputs[0].finish_reason == "stop" and len(out.outputs[0].token_ids) == 2
            await wait_idle(engine)  # the core stopped the request too, long before 200 tokens
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_shutdown_returns_while_batches_are_queued(tiny_llama):
    """Regression: ``shutdown`` cancels the output handler while batches (here heartbeats)
    are already queued. ``asyncio.wait_for`` (before Python 3.12) then returns the batch and
    swallows the cancellation, and the handler used to read the core's heartbeats forever:
    ``shutdown`` never returned (what hung the structured-outputs test across the process)."""
    from tandem.engine.engine_core import EngineCore
    from tandem.engine.inproc_client import InprocEngineCoreClient
    from tandem.engine.prepare import prepare_model

    async def main():
        config = EngineConfig(model=tiny_llama, **ENGINE)
        model_config = prepare_model(config)
        client = InprocEngineCoreClient(EngineCore(config, model_config), heartbeat_s=0.002)
        engine = AsyncLLM(config, client, model_config.info)
        async for out in engine.generate("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4)):
            pass
        assert out.finished and out.error is None
        time.sleep(0.1)  # the loop is blocked: heartbeats pile up in the client's queue
        await asyncio.sleep(0)  # the handler starts on the backlog; shutdown catches it mid-read
        stopping = asyncio.ensure_future(engine.shutdown())
        done, _ = await asyncio.wait({stopping}, timeout=10)
        if not done:  # stop the core so that the handler (and this test) can end
            await asyncio.to_thread(client.shutdown)
            await stopping
        assert done, "AsyncLLM.shutdown did not return within 10 s"

    asyncio.run(main())


async def wait_idle(engine: AsyncLLM, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        s = engine.latest_stats
        if s.num_running == 0 and s.num_waiting == 0 and s.num_free_kv_blocks == s.num_kv_blocks:
            return
        assert time.monotonic() < deadline, f"still busy after {timeout_s} s: {s}"
        await asyncio.sleep(0.02)


def test_bad_requests_are_refused_before_the_core(tiny_llama):
    async def main():
        engine = start_inproc(EngineConfig(model=tiny_llama, max_model_len=256, num_kv_blocks=4, block_size=16))
        try:
            with pytest.raises(ValueError, match="max_model_len"):
                engine.add_request("a", [5] * 300, SamplingParams())
            with pytest.raises(ValueError, match="KV blocks"):
                engine.add_request("b", [5], SamplingParams(max_tokens=100))  # 7 blocks; the cache has 4
            engine.add_request("c", [5], SamplingParams(max_tokens=2))
            with pytest.raises(ValueError, match="already in use"):
                engine.add_request("c", [5], SamplingParams(max_tokens=2))
            await wait_idle(engine)
        finally:
            await engine.shutdown()

    asyncio.run(main())


def test_killed_core_fails_every_pending_request(tiny_llama):
    async def main():
        engine = AsyncLLM.start(EngineConfig(model=tiny_llama, **ENGINE))
        pid = engine.client.pid
        try:
            streams = [engine.add_request(f"k{i}", [5, 6 + i], SamplingParams(max_tokens=240, ignore_eos=True))
                       for i in range(4)]
            for s in streams:
                await s.__anext__()
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            finals = [await asyncio.wait_for(last(s), 5) for s in streams]
            assert time.monotonic() - t0 < 5
            assert all(f.error is not None and "SIGKILL" in f.error for f in finals)
            assert all(c.finish_reason == "error" for f in finals for c in f.outputs)
            assert not engine.is_running
            with pytest.raises(EngineDeadError):
                engine.add_request("late", [5], SamplingParams())
        finally:
            await engine.shutdown()
        assert not pid_alive(pid)

    asyncio.run(main())


def test_hung_core_fails_pending_requests_and_is_killed(tiny_llama, monkeypatch):
    """A step that runs past rpc_timeout_s is a hung core; a slow one that heartbeats is not."""
    here = str(Path(__file__).parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))

    async def main():
        config = EngineConfig(model=tiny_llama, worker_cls="hang_worker.HangWorker", rpc_timeout_s=6.0, **ENGINE)
        engine = AsyncLLM.start(config, hang_timeout_s=2.0)  # no message for 2 s: frozen
        pid = engine.client.pid
        try:
            slow = engine.add_request("slow", [5, 98], SamplingParams(max_tokens=2))  # a 4 s step
            assert (await last(slow)).error is None
            stuck = engine.add_request("stuck", [5, 99], SamplingParams(max_tokens=2))
            t0 = time.monotonic()
            final = await asyncio.wait_for(last(stuck), 30)
            assert "hung" in final.error and 6 < time.monotonic() - t0 < 20, final.error
            assert not engine.is_running
        finally:
            await engine.shutdown()
        assert not pid_alive(pid)

    asyncio.run(main())


def test_shutdown_ends_live_streams(tiny_llama):
    async def main():
        engine = AsyncLLM.start(EngineConfig(model=tiny_llama, **ENGINE))
        pid = engine.client.pid
        stream = engine.add_request("x", [5, 6], SamplingParams(max_tokens=240, ignore_eos=True))
        await stream.__anext__()
        await engine.shutdown()
        rest = [o async for o in stream]  # ends (closed), does not hang
        assert all(not o.finished for o in rest)
        assert not pid_alive(pid)

    asyncio.run(main())


async def last(stream):
    out = None
    async for out in stream:
        pass
    return out


def test_structured_outputs_across_the_core_process(tiny_llama):
    """A constrained request runs in the engine-core process (the grammar library is loaded
    there only); one whose regex does not compile ends with the compiler's message marked
    ``error_kind="invalid_request"`` (what a server answers with 400), and the core goes on."""
    from tandem.sampling_params import StructuredOutputsParams
    from tandem.types.engine_output import INVALID_REQUEST

    good = SamplingParams(temperature=0, max_tokens=8,
                          structured_outputs=StructuredOutputsParams(choice=["t2t3", "t4"]))
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="(t2"))

    async def last(engine: AsyncLLM, rid: str, sp: SamplingParams):
        out = None
        async for out in engine.generate(rid, [5, 6, 7], sp):
            pass
        return out

    async def main():
        engine = AsyncLLM.start(EngineConfig(model=tiny_llama, **ENGINE))
        try:
            return await asyncio.gather(last(engine, "good", good), last(engine, "bad", bad))
        finally:
            await engine.shutdown()

    ok, refused = asyncio.run(main())
    assert ok.error is None and ok.outputs[0].text.replace(" ", "") in ("t2t3", "t4")
    assert refused.error_kind == INVALID_REQUEST and refused.outputs[0].finish_reason == "error"
    assert refused.error.startswith("the regex does not compile") and "\n" not in refused.error
