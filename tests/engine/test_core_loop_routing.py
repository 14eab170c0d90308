"""The engine core loop with several front ends (as ``tandem serve --api-server-count N`` runs it),
on a real tiny-model core in this process: each front end receives exactly its own requests'
outputs, a duplicate request id is refused to its sender only, a front end that says goodbye
has its requests aborted (no KV block held), and heartbeats reach every front end."""
from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict

import pytest

from tandem import SamplingParams
from tandem.config import EngineConfig
from tandem.engine.core_loop import EngineCoreLoop
from tandem.engine.engine_core import EngineCore
from tandem.engine.messages import CoreInput, CoreOutputBatch, EngineCoreRequest
from tandem.engine.prepare import prepare_model

pytestmark = pytest.mark.timeout(120)


def request(rid: str, max_tokens: int = 6) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [5, 6, 7], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                             [1], max_tokens)


class Harness:
    """A loop in a thread; inputs through a queue, batches recorded per front end."""

    def __init__(self, model: str) -> None:
        config = EngineConfig(model=model, num_kv_blocks=64, block_size=16, max_model_len=256)
        self.core = EngineCore(config, prepare_model(config))
        self.inputs: queue.SimpleQueue[CoreInput] = queue.SimpleQueue()
        self.batches: dict[int, list[CoreOutputBatch]] = defaultdict(list)
        self.lock = threading.Lock()
        self.loop = EngineCoreLoop(self.core, self._recv, self._send, heartbeat_s=0.2)
        self.thread = threading.Thread(target=self.loop.run, daemon=True)
        self.thread.start()

    def _recv(self, timeout_s: float):
        try:
            return self.inputs.get(timeout=timeout_s) if timeout_s > 0 else self.inputs.get_nowait()
        except queue.Empty:
            return None

    def _send(self, client: int, batch: CoreOutputBatch) -> None:
        with self.lock:
            self.batches[client].append(batch)

    def outputs_of(self, client: int) -> dict[str, list]:
        with self.lock:
            out: dict[str, list] = defaultdict(list)
            for b in self.batches[client]:
                for o in b.outputs:
                    out[o.req_id].append(o)
            return out

    def wait(self, cond, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.02)

    def stop(self) -> None:
        self.inputs.put(CoreInput(shutdown=True))
        self.thread.join(30)
        self.core.shutdown()


def finished(outs: dict[str, list], rid: str) -> bool:
    return any(o.finish_reason is not None for o in outs.get(rid, []))


def test_outputs_go_to_their_front_end_only(tiny_llama):
    h = Harness(tiny_llama)
    try:
        h.inputs.put(CoreInput(client_index=1, hello=True))
        h.inputs.put(CoreInput(client_index=2, hello=True))
        h.inputs.put(CoreInput(adds=[request("a1"), request("a2")], client_index=1))
        h.inputs.put(CoreInput(adds=[request("b1")], client_index=2))
        h.wait(lambda: all(finished(h.outputs_of(1), r) for r in ("a1", "a2")) and finished(h.outputs_of(2), "b1"))
        one, two = h.outputs_of(1), h.outputs_of(2)
        assert set(one) == {"a1", "a2"} and set(two) == {"b1"}
        for outs in (one["a1"], one["a2"], two["b1"]):
            assert sum(len(o.new_token_ids) for o in outs) == 6  # every token arrived, once
        # A duplicate of a running id is refused to its sender, and only to it.
        h.inputs.put(CoreInput(adds=[request("c", max_tokens=200)], client_index=1))
        h.wait(lambda: "c" in h.outputs_of(1))
        h.inputs.put(CoreInput(adds=[request("c")], client_index=2))
        h.wait(lambda: "c" in h.outputs_of(2))
        assert "already running" in (h.outputs_of(2)["c"][0].error or "")
        # Goodbye: the leaving front end's requests are aborted; the other's go on.
        h.inputs.put(CoreInput(client_index=1, goodbye=True))
        h.wait(lambda: not h.core.has_work())
        assert h.core.kv_cache.num_free_blocks == h.core.kv_cache.num_blocks
        assert not finished(h.outputs_of(1), "c")
        assert h.loop.clients == [2]
        def beats() -> list[CoreOutputBatch]:
            with h.lock:
                return [b for b in h.batches[2] if b.heartbeat]

        h.wait(lambda: bool(beats()))  # every 0.2 s, to every front end still there
        assert beats()[-1].stats.num_kv_blocks == 64
    finally:
        h.stop()
