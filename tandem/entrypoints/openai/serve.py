"""``tandem serve``: the OpenAI-compatible server's command line and process launcher.

``add_serve_args`` adds the server flags and every engine flag (mirroring ``EngineConfig``)
to a parser; ``serve_main`` starts the engine core process (which resolves the model: this
process never imports torch), then serves:

* with one API-server process, in this process (``api_server.serve_app``);
* with several (``--api-server-count N``), in N child processes
  (``server_process.py``) that each bind the port with ``SO_REUSEPORT`` (the kernel spreads
  new connections over them) and talk to the one engine core over their own channel. This
  process holds the port (bound, not listening, so a second server cannot take it), watches
  the children and the core, and stops them all: one that dies takes the whole server down
  with a non-zero status, since a half-alive server must not keep running.

SIGINT/SIGTERM stop the server gracefully: no new connections, in-flight requests get
``--shutdown-timeout-s`` to finish (then they are aborted), the engine core and its workers
exit, and so does the process, with status 0.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Optional

from tandem.config import EngineConfig
from tandem.engine.async_llm import DEFAULT_HANG_TIMEOUT_S
from tandem.entrypoints.openai.tool_parsers import TOOL_PARSERS

if TYPE_CHECKING:
    from tandem.engine.core_client import CoreProcess
    from tandem.entrypoints.openai.serving import ServerSettings

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_AUTO_MAX_SERVERS = 8
_CHILD_START_TIMEOUT_S = 300.0  # a loaded two-core machine imports slowly


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def auto_api_server_count(device: str, cores: Optional[int] = None) -> int:
    """``--api-server-count auto``: on CUDA one API-server process per two cores (the engine core
    and its workers need the rest), at most 8; on the CPU one, since the model itself needs the cores."""
    if device != "cuda":
        return 1
    return max(1, min(_AUTO_MAX_SERVERS, (cores or usable_cores()) // 2))


def parse_api_server_count(value: str) -> Optional[int]:
    """``auto`` -> None; else a count >= 1 (``ValueError`` with one sentence otherwise)."""
    if value == "auto":
        return None
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"--api-server-count must be a whole number >= 1 or 'auto', got {value!r}") from None
    if count < 1:
        raise ValueError(f"--api-server-count must be >= 1 (or 'auto'), got {count}")
    return count


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF model folder or .gguf file (same as --model); default: the embedded "
                             "SmolLM2-135M-Instruct")
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 for every interface)")
    g.add_argument("--port", type=int, default=8000)
    cores = usable_cores()
    g.add_argument("--api-server-count", default="auto", metavar="N|auto",
                   help="API-server processes (HTTP, tokenization, detokenization) sharing the port and the one "
                        f"engine core; auto: min({_AUTO_MAX_SERVERS}, cores // 2) on CUDA, which is "
                        f"{auto_api_server_count('cuda', cores)} on this machine ({cores} cores), and 1 on the CPU")
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $TANDEM_API_KEY, else none)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="model name(s) clients use in 'model' (default: the model argument)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='let tool_choice "auto" (the default when a request gives tools) parse tool calls out '
                        "of the model's text with --tool-call-parser; without it, \"auto\" is refused")
    g.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                   help="how the model writes tool calls: hermes (<tool_call>{...}</tool_call>: Hermes, Qwen 2.5) "
                        "or llama3_json (Llama 3.1/3.2 JSON)")
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
    1 when the engine core or a server process cannot start or dies, 130 on Ctrl-C during the start."""
    from tandem.engine.core_client import CoreProcess
    from tandem.engine.messages import EngineStartError
    from tandem.entrypoints.openai.torch_free import hide_torch

    hide_torch()  # this process serves (with one API server) or supervises: never torch
    try:
        config, settings, count = _settings_from_args(args)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:  # the port first: a taken one fails in a second, not after the model has loaded
        sock = reserve_port(args.host, args.port)
    except OSError as e:
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    try:
        try:
            core = CoreProcess(config)
        except ValueError as e:  # the model files, the machine or the flags: the core's one line
            print(f"error: {e}", file=sys.stderr)
            return 2
        except EngineStartError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:  # Ctrl-C while the model loads: the core process is already stopped
            return 130
        if count is None:
            count = auto_api_server_count(core.model.device)
        if count > usable_cores():
            logger.warning("--api-server-count %d is more than the %d usable cores: the processes will compete "
                           "for them", count, usable_cores())
        print(f"tandem: {count} API-server process{'es' if count > 1 else ''}"
              f"{' (auto)' if args.api_server_count == 'auto' else ''}, engine core pid {core.pid}",
              file=sys.stderr, flush=True)
        if count == 1:
            return _serve_here(args, config, settings, core, sock)
        return ApiServerPool(args, config, settings, core, count).run()
    finally:
        sock.close()


def _serve_here(args: argparse.Namespace, config: EngineConfig, settings: "ServerSettings", core: "CoreProcess",
                sock: socket.socket) -> int:
    """One API server, in this process, on the reserved socket."""
    from tandem.engine.async_llm import AsyncLLM
    from tandem.entrypoints.openai.api_server import serve_app
    from tandem.entrypoints.openai.metrics import PrometheusStatLogger

    stat_logger = PrometheusStatLogger(settings.served_model_names[0])
    try:
        engine = AsyncLLM(config, core.connect(0, owner=True), core.model, stat_logger=stat_logger,
                          hang_timeout_s=args.engine_hang_timeout_s)
    except BaseException:
        core.shutdown(timeout_s=0.0)
        raise
    sock.listen(2048)
    return serve_app(engine, settings, stat_logger, sock, host=args.host, port=args.port,
                     log_level=args.uvicorn_log_level, shutdown_timeout_s=args.shutdown_timeout_s)


def _settings_from_args(args: argparse.Namespace) -> tuple[EngineConfig, "ServerSettings", Optional[int]]:
    """The engine config, the server settings and the API-server count (None: auto) the flags
    give (ValueError/OSError if they are bad)."""
    from tandem.entrypoints.openai.serving import ServerSettings

    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    config = EngineConfig.from_cli_args(args)
    count = parse_api_server_count(args.api_server_count)
    chat_template = _read_template(args.chat_template)
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (" + " or ".join(sorted(TOOL_PARSERS))
                         + ")")
    for flag in ("max_n", "max_prompts", "max_request_body_bytes"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    names = args.served_model_name or [args.model or DEFAULT_MODEL_NAME]
    settings = ServerSettings(served_model_names=names, api_key=args.api_key or os.environ.get("TANDEM_API_KEY"),
                              max_n=args.max_n, max_prompts=args.max_prompts,
                              max_body_bytes=args.max_request_body_bytes, chat_template=chat_template,
                              tool_call_parser=args.tool_call_parser if args.enable_auto_tool_choice else None)
    return config, settings, count


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with ``SO_REUSEPORT``, not listening yet.

    The port is first bound without ``SO_REUSEPORT``, so a port another program (or another
    tandem server) holds is refused here; the reservation then keeps it, and the API-server
    processes join it with ``SO_REUSEPORT`` (only listening sockets get connections)."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    probe = socket.socket(family, kind, proto)
    try:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(addr)
        bound = probe.getsockname()
    finally:
        probe.close()
    return reuseport_socket(host, bound[1], family)


def reuseport_socket(host: str, port: int, family: Optional[int] = None) -> socket.socket:
    """A socket bound to ``host:port`` with ``SO_REUSEADDR`` and ``SO_REUSEPORT`` (not listening)."""
    fam, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family or fam, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(addr)
    except OSError:
        sock.close()
        raise
    return sock


class ApiServerPool:
    """N API-server processes over one engine core, watched from the launcher."""

    def __init__(self, args: argparse.Namespace, config: EngineConfig, settings: "ServerSettings",
                 core: "CoreProcess", count: int) -> None:
        self.args = args
        self.config = config
        self.settings = settings
        self.core = core
        self.count = count
        self.procs: list[subprocess.Popen] = []
        self._signal: Optional[int] = None

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                self._start_children()
            except RuntimeError as e:
                print(f"error: {e}", file=sys.stderr)
                self._stop_children(timeout_s=5.0)
                return 1
            if self._signal is None:
                print(f"tandem: serving {self.settings.served_model_names[0]} on "
                      f"http://{self.args.host}:{self.args.port} (OpenAI API under /v1)", file=sys.stderr, flush=True)
            return self._watch()
        finally:
            self._stop_children(timeout_s=self.args.shutdown_timeout_s + 10.0)
            self.core.shutdown()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, frame: object) -> None:
        self._signal = signum

    def _start_children(self) -> None:
        from tandem import ipc
        from tandem.entrypoints.openai.metrics import MULTIPROC_ENV
        from tandem.entrypoints.openai.server_process import MODULE, STARTUP_FILE, ServerStartup

        private = self.core.private_dir
        metrics_dir = os.path.join(private, "metrics")
        os.makedirs(metrics_dir, mode=0o700, exist_ok=True)
        startup = ServerStartup(config=self.config, settings=self.settings, model=self.core.model,
                                num_kv_blocks=self.core.num_kv_blocks, core=self.core.address,
                                host=self.args.host, port=self.args.port, log_level=self.args.uvicorn_log_level,
                                shutdown_timeout_s=self.args.shutdown_timeout_s,
                                hang_timeout_s=self.args.engine_hang_timeout_s)
        path = os.path.join(private, STARTUP_FILE)
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
            f.write(ipc.encode(startup))
        env = {**os.environ, MULTIPROC_ENV: metrics_dir}
        started = time.monotonic()
        secret = self.core.address.secret
        for i in range(self.count):
            self.procs.append(ipc.start_child(MODULE, [private, str(i + 1)], secret, env=env,
                                              stdout=subprocess.PIPE))
        for i, proc in enumerate(self.procs):
            self._wait_ready(i, proc, started)

    def _wait_ready(self, i: int, proc: subprocess.Popen, started: float) -> None:
        """Each child writes one line to its stdout once it serves: ``ready <rss bytes> torch=<0|1>``."""
        import select

        assert proc.stdout is not None
        deadline = started + _CHILD_START_TIMEOUT_S
        while True:
            if self._signal is not None:
                return
            ready, _, _ = select.select([proc.stdout], [], [], 0.2)
            if ready:
                line = proc.stdout.readline().decode(errors="replace").split()
                if line[:1] == ["ready"]:
                    rss = int(line[1]) / (1 << 20) if len(line) > 1 else 0.0
                    torch = " (torch imported!)" if "torch=1" in line else ""
                    print(f"tandem: API server {i + 1}/{self.count} (pid {proc.pid}) ready in "
                          f"{time.monotonic() - started:.1f} s, RSS {rss:.0f} MiB{torch}", file=sys.stderr, flush=True)
                    return
            if proc.poll() is not None:
                raise RuntimeError(f"API server {i + 1} (pid {proc.pid}) exited with code {proc.returncode} "
                                   "while starting (its error is in the log above)")
            if self.core.exit_reason() is not None:
                raise RuntimeError(f"{self.core.exit_reason()} while the API servers started")
            if time.monotonic() > deadline:
                raise RuntimeError(f"API server {i + 1} did not start within {_CHILD_START_TIMEOUT_S:.0f} s")

    def _watch(self) -> int:
        """Until a signal (0), or until a process dies (1)."""
        while self._signal is None:
            for i, proc in enumerate(self.procs):
                if proc.poll() is not None:
                    print(f"error: API server {i + 1} (pid {proc.pid}) exited with code {proc.returncode}: "
                          "stopping the server", file=sys.stderr, flush=True)
                    return 1
            reason = self.core.exit_reason()
            if reason is not None:
                print(f"error: {reason}: the API servers fail their requests and stop", file=sys.stderr, flush=True)
                self._wait_children(timeout_s=10.0)
                return 1
            time.sleep(0.1)
        return 0

    def _wait_children(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass

    def _stop_children(self, timeout_s: float) -> None:
        """SIGTERM (each drains its requests within --shutdown-timeout-s), then SIGKILL."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        self._wait_children(timeout_s)
        for proc in self.procs:
            if proc.poll() is None:
                logger.warning("API server (pid %d) did not stop within %.0f s: killing it", proc.pid, timeout_s)
                proc.kill()
                proc.wait()
            if proc.stdin is not None and not proc.stdin.closed:
                proc.stdin.close()
            if proc.stdout is not None:
                proc.stdout.close()


def _read_template(path: Optional[str]) -> Optional[str]:
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return f.read()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem serve", description="OpenAI-compatible server")
    add_serve_args(parser)
    return serve_main(parser.parse_args(argv))
