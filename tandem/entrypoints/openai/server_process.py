"""One API-server process of ``tandem serve --api-server-count N``:
``python -m tandem.entrypoints.openai.server_process <ipc dir> <client index>``.

Started by the launcher (``serve.ApiServerPool``) through ``tandem.ipc.start_child``: the
channel secret on stdin (kept open: EOF means the launcher is gone, and so is this process),
everything else in ``ServerStartup``, a file in the engine core's private 0700 directory
(the API key is in it, so never on argv). The process binds the port with ``SO_REUSEPORT``
beside its siblings, connects to the engine core as front end ``<client index>``, and serves
until SIGTERM (a graceful stop, as ``tandem serve`` does) or until the engine core dies
(its requests fail with 500 and it exits with status 1). It writes ``ready <RSS bytes>`` to
its stdout once it serves (and ``torch=1`` if torch was imported after all).

It imports neither torch nor the model code (import-linter's contract in pyproject.toml
keeps it so, and ``torch_free.hide_torch`` keeps a transformers release that would import
torch from doing so): tokenizer, chat template, HTTP and the engine client are all it needs.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass

from tandem import ipc
from tandem.config import EngineConfig, ModelInfo
from tandem.engine.core_client import CoreAddress
from tandem.entrypoints.openai.serving import ServerSettings
from tandem.entrypoints.openai.torch_free import hide_torch

MODULE = "tandem.entrypoints.openai.server_process"
STARTUP_FILE = "api-server-startup"


@dataclass
class ServerStartup:
    config: EngineConfig
    settings: ServerSettings
    model: ModelInfo
    num_kv_blocks: int
    core: CoreAddress
    host: str
    port: int
    log_level: str
    shutdown_timeout_s: float
    hang_timeout_s: float


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def main(argv: list[str]) -> int:
    hide_torch()
    ipc.read_secret()  # the core's secret, also in the startup file; read it so stdin is the parent-death pipe
    where = ipc.PrivateDir(argv[0])
    index = int(argv[1])
    ipc.exit_with_parent(cleanup=lambda: None)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher decides; SIGTERM stops gracefully
    logging.basicConfig(level=os.environ.get("TANDEM_LOG_LEVEL", "WARNING").upper(),
                        format=f"%(levelname)s api-server-{index}[{os.getpid()}] %(name)s: %(message)s")
    with open(os.path.join(where.path, STARTUP_FILE), "rb") as f:
        startup = ipc.decode(f.read(), ServerStartup)

    from tandem.engine.async_llm import AsyncLLM
    from tandem.engine.core_client import ProcessEngineCoreClient
    from tandem.entrypoints.openai.api_server import serve_app
    from tandem.entrypoints.openai.metrics import PrometheusStatLogger
    from tandem.entrypoints.openai.serve import reuseport_socket

    stat_logger = PrometheusStatLogger(startup.settings.served_model_names[0])
    client = ProcessEngineCoreClient(startup.core, startup.num_kv_blocks, index)
    engine = AsyncLLM(startup.config, client, startup.model, stat_logger=stat_logger,
                      hang_timeout_s=startup.hang_timeout_s)
    sock = reuseport_socket(startup.host, startup.port)
    sock.listen(2048)

    def ready() -> None:
        imported = sys.modules.get("torch") is not None  # (hide_torch leaves None there)
        if imported:  # something imported it: a slower start and ~0.5 GB more per process
            logging.getLogger(__name__).warning("torch was imported in this API-server process")
        print(f"ready {_rss_bytes()} torch={int(imported)}", flush=True)

    try:
        return serve_app(engine, startup.settings, stat_logger, sock, host=startup.host, port=startup.port,
                         log_level=startup.log_level, shutdown_timeout_s=startup.shutdown_timeout_s,
                         on_ready=ready, announce=False, server_index=index)
    finally:
        sock.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
