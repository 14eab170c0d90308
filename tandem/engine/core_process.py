"""The engine core in its own process: ``python -m tandem.engine.core_process <ipc dir>``.

Started by ``ProcessEngineCoreClient`` through ``tandem.ipc.start_child`` (tandem's own
entry point, the secret on stdin, stdin kept open as the parent-death pipe) and driven over
one private, authenticated ``tandem.ipc.Channel``. Protocol, front end (F) and core (C):

1. F -> C ``CoreStartup`` (engine config, model config, heartbeat interval);
2. C -> F ``CoreReady`` (the KV cache size, or the error that stopped the start);
3. then F -> C ``CoreInput`` (adds/aborts, batched; ``shutdown`` last) and C -> F one
   ``CoreOutputBatch`` per step that produced outputs, plus idle snapshots and heartbeats
   (``EngineCoreLoop``).

The core ignores SIGINT: a Ctrl-C in a terminal reaches the whole process group, and the
front end, not the core, decides how in-flight requests end. It exits after ``shutdown``,
or at once when its parent is gone (stdin at EOF), taking its workers with it.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import traceback
from dataclasses import dataclass
from typing import Optional

from tandem import ipc
from tandem.config import EngineConfig
from tandem.engine.core_loop import EngineCoreLoop
from tandem.engine.messages import CoreInput

logger = logging.getLogger(__name__)

MODULE = "tandem.engine.core_process"
FRONT_ENDPOINT, CORE_ENDPOINT = "front", "core"


@dataclass
class CoreStartup:
    config: EngineConfig
    model_config: ipc.WireModelConfig
    heartbeat_s: float


@dataclass
class CoreReady:
    num_kv_blocks: int
    error: Optional[str] = None  # the start failed: why, with the core's traceback


def main(argv: list[str]) -> int:
    secret = ipc.read_secret()
    where = ipc.PrivateDir(argv[0])
    ipc.exit_with_parent(cleanup=where.remove)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("TANDEM_LOG_LEVEL", "WARNING").upper(),
                        format=f"%(levelname)s engine-core[{os.getpid()}] %(name)s: %(message)s")
    import zmq

    from tandem.engine.engine_core import EngineCore

    ctx = zmq.Context()
    chan = ipc.Channel(ctx, secret, local=where.address(CORE_ENDPOINT), remote=where.address(FRONT_ENDPOINT))
    try:
        startup = chan.recv(CoreStartup)
        try:
            core = EngineCore(startup.config, startup.model_config.to_config())
        except Exception as e:
            chan.send(CoreReady(0, error="".join(traceback.format_exception(type(e), e, e.__traceback__))))
            return 1
        try:
            chan.send(CoreReady(core.kv_cache.num_blocks))

            def recv(timeout_s: float) -> Optional[CoreInput]:
                if timeout_s <= 0:
                    return chan.try_recv(CoreInput)
                try:
                    return chan.recv(CoreInput, timeout_s=timeout_s)
                except TimeoutError:
                    return None

            EngineCoreLoop(core, recv, chan.send, startup.heartbeat_s).run()
        finally:
            core.shutdown()
        return 0
    finally:
        chan.close(linger_s=1.0)  # let the last batch (or the start error) reach the front end
        ctx.term()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
