"""The engine-core process's start-up messages and endpoint names, shared by the core
(``core_process.py``) and its parent and front ends (``core_client.py``) without importing
the core's own code (torch): see ``core_process.py`` for the protocol."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from tandem.config import EngineConfig, ModelInfo

MODULE = "tandem.engine.core_process"
CORE_ENDPOINT, CONTROL_ENDPOINT = "core", "control"


def front_endpoint(client_index: int) -> str:
    """The endpoint name where front end ``client_index`` receives the core's batches."""
    return f"front-{client_index}"


@dataclass
class CoreStartup:
    config: EngineConfig
    heartbeat_s: float


@dataclass
class CoreReady:
    num_kv_blocks: int = 0
    model: Optional[ModelInfo] = None
    error: Optional[str] = None  # the start failed: why (with the core's traceback unless bad_input)
    bad_input: bool = False  # the error is the user's (model files, flags): one line, exit status 2
