"""``tandem serve``: the OpenAI-compatible server's command line.

``add_serve_args`` adds the server flags and every engine flag (mirroring ``EngineConfig``)
to a parser; ``serve_main`` starts the engine core, then uvicorn. SIGINT/SIGTERM stop the
server gracefully: no new connections, in-flight requests get ``--shutdown-timeout-s`` to
finish (then they are aborted), the engine core and its workers exit, and so does the
process, with status 0.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

from tandem.config import EngineConfig
from tandem.engine.async_llm import DEFAULT_HANG_TIMEOUT_S

if TYPE_CHECKING:
    from tandem.engine.async_llm import AsyncLLM
    from tandem.entrypoints.openai.serving import ServerSettings

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF model folder or .gguf file (same as --model); default: the embedded "
                             "SmolLM2-135M-Instruct")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $TANDEM_API_KEY, else none)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use in 'model' (default: the model argument)")
    g.add_argument("--chat-template", default=None,
                   help="file with a Jinja chat template to use instead of the tokenizer's")
    g.add_argument("--max-n", type=int, default=16, help="largest 'n' (choices per prompt) a request may ask for")
    g.add_argument("--max-prompts", type=int, default=64, help="most prompts in one /v1/completions request")
    g.add_argument("--max-request-body-bytes", type=int, default=4 << 20, help="larger request bodies get 413")
    g.add_argument("--shutdown-timeout-s", type=float, default=10.0,
                   help="on SIGINT/SIGTERM, how long in-flight requests may run before they are aborted")
    g.add_argument("--engine-hang-timeout-s", type=float, default=DEFAULT_HANG_TIMEOUT_S,
                   help="declare the engine core frozen (and fail its requests) after this long without any "
                        "message; it sends a heartbeat every second, and a step that runs longer than "
                        "--rpc-timeout-s counts as hung")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    EngineConfig.add_cli_args(parser.add_argument_group("engine (as EngineConfig)"))


def serve_main(args: argparse.Namespace) -> int:
    """Run the server until SIGINT/SIGTERM: 0 on a clean stop, 2 on bad arguments or model files,
    1 when the engine core or the server cannot start, 130 on Ctrl-C during the start."""
    from tandem.engine.async_llm import AsyncLLM
    from tandem.engine.messages import EngineStartError
    from tandem.entrypoints.llm import prepare_model
    from tandem.entrypoints.openai.metrics import PrometheusStatLogger

    try:
        config, settings = _settings_from_args(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:  # the port first: a taken one fails in a second, not after the model has loaded
        sock = _listen_socket(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    stat_logger = PrometheusStatLogger(settings.served_model_names[0])
    try:
        model_config = prepare_model(config)  # the model files and the machine, before any process starts
        engine = AsyncLLM(config, model_config, stat_logger=stat_logger, hang_timeout_s=args.engine_hang_timeout_s)
    except (ValueError, OSError) as e:
        sock.close()
        print(f"error: {e}", file=sys.stderr)
        return 2
    except EngineStartError as e:
        sock.close()
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C while the model loads: the core process is already stopped
        sock.close()
        return 130
    return _serve(args, engine, settings, stat_logger, sock)


def _settings_from_args(args: argparse.Namespace) -> tuple[EngineConfig, "ServerSettings"]:
    """The engine config and the server settings the flags give (ValueError/OSError if they are bad)."""
    from tandem.entrypoints.openai.serving import ServerSettings

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    config = EngineConfig.from_cli_args(args)
    chat_template = _read_template(args.chat_template)
    for flag in ("max_n", "max_prompts", "max_request_body_bytes"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    settings = ServerSettings(served_model_names=names, api_key=args.api_key or os.environ.get("TANDEM_API_KEY"),
                              max_n=args.max_n, max_prompts=args.max_prompts,
                              max_body_bytes=args.max_request_body_bytes, chat_template=chat_template)
    return config, settings


def _serve(args: argparse.Namespace, engine: "AsyncLLM", settings: "ServerSettings", stat_logger: Any,
           sock: socket.socket) -> int:
    """Serve on ``sock`` until SIGINT/SIGTERM, then stop the engine: 0, or 1 if uvicorn never started."""
    import uvicorn

    from tandem.entrypoints.openai.api_server import build_app

    name = settings.served_model_names[0]

    @asynccontextmanager
    async def lifespan(_: object) -> AsyncIterator[None]:
        print(f"tandem: serving {name} on http://{args.host}:{args.port} (OpenAI API under /v1)",
              file=sys.stderr, flush=True)
        yield
        await engine.shutdown()

    app = build_app(engine, settings, stat_logger, lifespan=lifespan)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                                           timeout_graceful_shutdown=args.shutdown_timeout_s))

    async def run() -> None:
        try:
            await server.serve(sockets=[sock])
        finally:  # uvicorn never started (e.g. the port is taken): the lifespan did not stop the engine
            await engine.shutdown()

    # uvicorn handles SIGINT/SIGTERM while it serves and raises them again once it has shut
    # down; by then everything is stopped, so these no-op handlers let the process exit 0.
    previous = {sig: signal.signal(sig, _ignore) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        asyncio.run(run())
    finally:
        sock.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1


def _listen_socket(host: str, port: int) -> socket.socket:
    """A bound TCP socket for ``host:port`` (IPv4 or IPv6, as the host resolves); uvicorn listens on it."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


def _ignore(signum: int, frame: object) -> None:
    """Signal handler that does nothing (the server has already shut down)."""


def _read_template(path: Optional[str]) -> Optional[str]:
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem serve", description="OpenAI-compatible server")
    add_serve_args(parser)
    return serve_main(parser.parse_args(argv))
