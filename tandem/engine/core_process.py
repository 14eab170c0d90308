"""The engine core in its own process: ``python -m tandem.engine.core_process <ipc dir>``.

Started by ``CoreProcess`` (``core_client.py``) through ``tandem.ipc.start_child`` (tandem's
own entry point, the secret on stdin, stdin kept open as the parent-death pipe); its
start-up messages live in ``core_protocol.py``. It binds
one authenticated ``tandem.ipc.Channel`` at ``core`` in the private directory, and talks to
its parent (``control``) and to every front end (``front-<i>``) through it. Protocol:

1. control -> core ``CoreStartup`` (the engine config, the heartbeat interval);
2. core -> control ``CoreReady``: the model as resolved here (``ModelInfo``) and the KV
   cache size, or the error that stopped the start. The core resolves the model and
   converts a GGUF itself, so that the API-server processes never import torch;
3. then each front end ``i`` sends ``CoreInput`` (``hello`` first; adds/aborts, batched;
   ``goodbye`` if it leaves early) and receives ``CoreOutputBatch``es: its own requests'
   outputs, one batch per step, plus idle snapshots and heartbeats (``EngineCoreLoop``).
   ``CoreInput(shutdown=True)``, from the parent or a sole front end, stops the core.

Batches to a front end are sent without blocking: one that is gone or stuck loses its
messages (and its requests are aborted when it says goodbye) instead of stalling the step
loop that every other front end depends on.

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
from typing import Optional

from tandem import ipc
from tandem.engine.core_protocol import CONTROL_ENDPOINT, CORE_ENDPOINT, CoreReady, CoreStartup, front_endpoint
from tandem.engine.messages import CoreInput, CoreOutputBatch

logger = logging.getLogger(__name__)

def main(argv: list[str]) -> int:
    secret = ipc.read_secret()
    where = ipc.PrivateDir(argv[0])
    ipc.exit_with_parent(cleanup=where.remove)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=os.environ.get("TANDEM_LOG_LEVEL", "WARNING").upper(),
                        format=f"%(levelname)s engine-core[{os.getpid()}] %(name)s: %(message)s")
    import zmq

    from tandem.engine.core_loop import EngineCoreLoop
    from tandem.engine.engine_core import EngineCore
    from tandem.engine.prepare import prepare_model

    ctx = zmq.Context()
    chan = ipc.Channel(ctx, secret, local=where.address(CORE_ENDPOINT), remote=where.address(CONTROL_ENDPOINT))
    try:
        startup = chan.recv(CoreStartup)
        try:
            model_config = prepare_model(startup.config)
        except (ValueError, OSError) as e:
            chan.send(CoreReady(error=str(e), bad_input=True))
            return 2
        try:
            core = EngineCore(startup.config, model_config)
        except Exception as e:
            chan.send(CoreReady(error="".join(traceback.format_exception(type(e), e, e.__traceback__))))
            return 1
        try:
            chan.send(CoreReady(core.kv_cache.num_blocks, model_config.info))
            peers: dict[int, int] = {}  # front end index -> channel peer
            dropped = 0

            def recv(timeout_s: float) -> Optional[CoreInput]:
                if timeout_s <= 0:
                    return chan.try_recv(CoreInput)
                try:
                    return chan.recv(CoreInput, timeout_s=timeout_s)
                except TimeoutError:
                    return None

            def send(client: int, batch: CoreOutputBatch) -> None:
                nonlocal dropped
                peer = peers.get(client)
                if peer is None:
                    peer = peers[client] = chan.connect(where.address(front_endpoint(client)))
                if not chan.send_encoded(ipc.encode(batch), peer, block=False):
                    dropped += 1
                    (logger.warning if dropped == 1 else logger.debug)(
                        "front end %d is not reading: dropped a batch (%d so far)", client, dropped)

            EngineCoreLoop(core, recv, send, startup.heartbeat_s).run()
        finally:
            core.shutdown()
        return 0
    finally:
        chan.close(linger_s=1.0)  # let the last batch (or the start error) reach the front ends
        ctx.term()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
