"""EngineConfig: strict validation with one readable sentence per problem, and the memory check.

(The CLI flags generated from these fields are tested in tests/entrypoints/test_cli.py.)
"""
from __future__ import annotations

import os
import pickle

import pytest

from tandem.config import STEP_DEFAULTS, EngineConfig, StepLimits
from tandem.config import engine as engine_config
from tandem.validation import InvalidValuesError

pytestmark = pytest.mark.timeout(60)

# Today's defaults: the CLI, the Python API and the docs all depend on them.
DEFAULTS = dict(
    model=None, tokenizer=None, dtype="auto", device="auto", block_size=16, num_kv_blocks=None,
    gpu_memory_utilization=0.9, cpu_kv_cache_gib=1.0, max_num_seqs=None, max_num_batched_tokens=None,
    max_model_len=None, enable_prefix_caching=True, enable_chunked_prefill=True, async_scheduling=True,
    max_logprobs=20, seed=0, executor="auto", tensor_parallel_size=1, rpc_timeout_s=300.0,
    worker_cls="tandem.worker.worker.Worker", worker_start_timeout_s=600.0,
)


def test_defaults_unchanged():
    cfg = EngineConfig()
    for name, value in DEFAULTS.items():
        assert getattr(cfg, name) == value, name
    assert cfg.max_concurrent_batches == 2 and EngineConfig(async_scheduling=False).max_concurrent_batches == 1


@pytest.mark.parametrize("kwargs, expected", [
    (dict(), "uniproc"), (dict(tensor_parallel_size=2), "multiproc"),
    (dict(executor="ray", tensor_parallel_size=2), "ray"), (dict(executor="multiproc"), "multiproc"),
])
def test_resolved_executor(kwargs, expected):
    assert EngineConfig(**kwargs).resolved_executor == expected


# -- the step limits: the device's defaults where none were given --------------------------------
def test_step_limits_default_to_the_devices():
    """CUDA gets the tuned H200 figure (256/8192); the CPU keeps its small steps (64/2048)."""
    cfg = EngineConfig()
    assert cfg.step_limits("cuda") == StepLimits(max_num_seqs=256, max_num_batched_tokens=8192)
    assert cfg.step_limits("cpu") == StepLimits(max_num_seqs=64, max_num_batched_tokens=2048)
    assert STEP_DEFAULTS == {"cuda": (256, 8192), "cpu": (64, 2048)}


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_given_step_limits_always_win(device):
    assert EngineConfig(max_num_seqs=3, max_num_batched_tokens=100).step_limits(device) == (3, 100)
    assert EngineConfig(max_num_seqs=300).step_limits(device) == (300, STEP_DEFAULTS[device].max_num_batched_tokens)
    assert EngineConfig(max_num_batched_tokens=50).step_limits(device) == (STEP_DEFAULTS[device].max_num_seqs, 50)
    assert EngineConfig(max_num_seqs=None, max_num_batched_tokens=None).step_limits(device) == STEP_DEFAULTS[device]


def test_a_default_budget_below_max_model_len_is_refused_where_it_applies():
    """Without chunked prefill the budget must hold the longest prompt: the CPU's 2048 does not
    hold 4096 tokens, CUDA's 8192 does."""
    cfg = EngineConfig(enable_chunked_prefill=False, max_model_len=4096)
    assert cfg.step_limits("cuda").max_num_batched_tokens == 8192
    with pytest.raises(ValueError, match=r"without chunked prefill, max_num_batched_tokens \(2048, the cpu default\) "
                                         r"must be >= max_model_len \(4096\)"):
        cfg.step_limits("cpu")


def test_the_resolved_model_config_carries_the_limits(tiny_llama):
    """Resolved once, with the device: what the scheduler, the worker and the input checks read."""
    from tandem.models.model_config import resolve_model_config

    mc = resolve_model_config(EngineConfig(model=tiny_llama, device="cpu"))
    assert (mc.max_num_seqs, mc.max_num_batched_tokens) == (64, 2048)
    mc = resolve_model_config(EngineConfig(model=tiny_llama, device="cpu", max_num_seqs=5))
    assert (mc.max_num_seqs, mc.max_num_batched_tokens) == (5, 2048)


def test_help_states_both_devices_defaults():
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        text = EngineConfig.model_fields[name].description
        cuda, cpu = STEP_DEFAULTS["cuda"]._asdict()[name], STEP_DEFAULTS["cpu"]._asdict()[name]
        assert f"{cuda} on CUDA" in text and f"{cpu} on the CPU" in text, text


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=1048576), "block_size must be a power of two <= 256, got 1048576"),
    (dict(block_size=512), "block_size must be a power of two <= 256, got 512"),
    (dict(block_size=24), "block_size must be a power of two <= 256, got 24"),
    (dict(block_size=0), "block_size must be a power of two <= 256, got 0"),
    (dict(block_size=-4), "block_size must be a power of two <= 256, got -4"),
    (dict(block_size=True), "block_size must be an integer, got bool True"),
    (dict(block_size=16.0), "block_size must be an integer, got float 16.0"),
    (dict(max_num_seqs="8"), "max_num_seqs must be an integer, got str '8'"),
    (dict(max_num_seqs=0), "max_num_seqs must be an integer >= 1, got 0"),
    (dict(max_num_batched_tokens="lots"), "max_num_batched_tokens must be an integer, got str 'lots'"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens must be an integer >= 1, got 0"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in (0, 1], got 1.5"),
    (dict(gpu_memory_utilization=0.0), "gpu_memory_utilization must be in (0, 1], got 0.0"),
    (dict(gpu_memory_utilization=float("nan")), "gpu_memory_utilization must be a finite number, got float nan"),
    (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization must be a number, got str '0.5'"),
    (dict(cpu_kv_cache_gib=float("inf")), "cpu_kv_cache_gib must be a finite number, got float inf"),
    (dict(cpu_kv_cache_gib=0), "cpu_kv_cache_gib must be > 0, got 0"),
    (dict(dtype="int8"), "dtype must be one of 'auto', 'float32', 'bfloat16' or 'float16', got 'int8'"),
    (dict(device="tpu"), "device must be one of 'auto', 'cpu' or 'cuda', got 'tpu'"),
    (dict(executor="mpi"), "executor must be one of 'auto', 'uniproc', 'multiproc' or 'ray', got 'mpi'"),
    (dict(num_kv_blocks=0), "num_kv_blocks must be an integer >= 1, got 0"),
    (dict(max_model_len=0), "max_model_len must be an integer >= 1, got 0"),
    (dict(max_logprobs=-1), "max_logprobs must be an integer >= 0, got -1"),
    (dict(tensor_parallel_size=0), "tensor_parallel_size must be an integer >= 1, got 0"),
    (dict(rpc_timeout_s=0), "rpc_timeout_s must be > 0, got 0"),
    (dict(seed=2**63), "seed must be an integer in [-9223372036854775808, 9223372036854775807]"),
    (dict(enable_prefix_caching="yes"), "enable_prefix_caching must be true or false, got str 'yes'"),
    (dict(enable_prefix_caching=1), "enable_prefix_caching must be true or false, got int 1"),
    (dict(worker_cls="Worker"), "worker_cls must be a dotted path package.module.Class, got 'Worker'"),
    (dict(model="/nonexistent/model/folder"), "model path '/nonexistent/model/folder' does not exist"),
    (dict(tokenizer="/nonexistent/tok"), "tokenizer path '/nonexistent/tok' does not exist"),
    (dict(max_num_seq=8), "unknown option 'max_num_seq' (did you mean 'max_num_seqs'?)"),
    (dict(tensor_parallel_size=2, executor="uniproc"),
     "the uniproc executor runs one rank; tensor_parallel_size=2 needs executor 'multiproc' or 'ray'"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=1024),
     "without chunked prefill, max_num_batched_tokens (512) must be >= max_model_len (1024)"),
])
def test_bad_values_name_field_and_value(kwargs, message):
    with pytest.raises(InvalidValuesError) as ei:
        EngineConfig(**kwargs)
    text = str(ei.value)
    assert isinstance(ei.value, ValueError)
    assert text.startswith("invalid engine config: ") and message in text, text
    assert "\n" not in text and "pydantic" not in text


def test_unknown_keyword_without_close_match_lists_the_fields():
    with pytest.raises(ValueError, match=r"unknown option 'frobnicate' \(valid names: async_scheduling, "):
        EngineConfig(frobnicate=1)


@pytest.mark.parametrize("name, edge, past", [
    ("block_size", 256, 257), ("block_size", 1, 0), ("max_num_seqs", 1, 0), ("num_kv_blocks", 1, 0),
    ("gpu_memory_utilization", 1.0, 1.0001), ("max_logprobs", 0, -1), ("tensor_parallel_size", 1, 0),
    ("seed", 2**63 - 1, 2**63), ("seed", -(2**63), -(2**63) - 1),
])
def test_ranges_are_inclusive_exactly_at_their_edges(name, edge, past):
    """Accepted at the edge, refused one step past it: the bound is where the docs say."""
    assert getattr(EngineConfig(**{name: edge}), name) == edge
    with pytest.raises(ValueError, match=name):
        EngineConfig(**{name: past})


def test_int_for_float_field_becomes_float():
    cfg = EngineConfig(rpc_timeout_s=5, cpu_kv_cache_gib=2)
    assert type(cfg.rpc_timeout_s) is float and type(cfg.cpu_kv_cache_gib) is float


def test_every_problem_reported_together():
    with pytest.raises(ValueError) as ei:
        EngineConfig(block_size=3, max_num_seqs=0, gpu_memory_utilization=1.5, dtype="int8", bogus=1)
    problems = ei.value.problems
    assert len(problems) == 5
    for start in ("block_size", "max_num_seqs", "gpu_memory_utilization", "dtype", "unknown option 'bogus'"):
        assert sum(p.startswith(start) for p in problems) == 1, (start, problems)


def test_assignment_is_validated_and_leaves_the_old_value():
    cfg = EngineConfig()
    cfg.block_size = 32
    assert cfg.block_size == 32
    with pytest.raises(ValueError, match="block_size must be a power of two <= 256, got 12"):
        cfg.block_size = 12
    assert cfg.block_size == 32
    with pytest.raises(ValueError, match="uniproc executor runs one rank"):
        cfg.executor, cfg.tensor_parallel_size = "uniproc", 2


def test_existing_paths_accepted(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert EngineConfig(model=str(folder), tokenizer=str(folder)).model == str(folder)
    assert EngineConfig(model=str(gguf)).model == str(gguf)


def test_round_trips_through_pickle_and_dump(tmp_path):
    cfg = EngineConfig(model=str(tmp_path), block_size=32, dtype="bfloat16", seed=7, num_kv_blocks=9)
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    assert EngineConfig.model_validate(cfg.model_dump()) == cfg
    assert cfg != EngineConfig(model=str(tmp_path))


def test_model_validate_errors_are_readable_too():
    with pytest.raises(InvalidValuesError, match="max_num_seqs must be an integer >= 1, got 0"):
        EngineConfig.model_validate({"max_num_seqs": 0})


def test_every_field_is_described():
    for name, field in EngineConfig.model_fields.items():
        assert field.description and len(field.description) > 10, name


# -- memory before allocation -------------------------------------------------------------------
def test_available_memory_is_read():
    """The kernel's MemAvailable, in bytes (read again here: it moves a little between reads)."""
    if not os.path.exists("/proc/meminfo"):
        pytest.skip("no /proc/meminfo on this platform")
    available = engine_config.available_memory_bytes()
    with open("/proc/meminfo", encoding="ascii") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert available is not None and 0 < available <= total
    assert abs(available - kib * 1024) <= 0.1 * kib * 1024, (available, kib)


def test_available_memory_falls_back_to_sysconf(monkeypatch):
    def no_proc(*args, **kwargs):
        raise OSError("no /proc here")

    monkeypatch.setattr("builtins.open", no_proc)
    available = engine_config.available_memory_bytes()
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert available is not None and 0 < available <= total


def test_cpu_memory_refused_above_what_is_available(monkeypatch):
    monkeypatch.setattr(engine_config, "available_memory_bytes", lambda: 4 << 30)
    engine_config.check_cpu_memory(3.5)
    with pytest.raises(ValueError, match=r"cpu_kv_cache_gib needs 30.00 GiB, but only 4.00 GiB of memory is "
                                         r"available on this machine \(MemAvailable\)"):
        engine_config.check_cpu_memory(30)


def test_cpu_memory_unchecked_when_unknown(monkeypatch):
    monkeypatch.setattr(engine_config, "available_memory_bytes", lambda: None)
    engine_config.check_cpu_memory(1e6)


def test_real_machine_refuses_a_petabyte():
    if engine_config.available_memory_bytes() is None:
        pytest.skip("available memory unknown on this platform")
    with pytest.raises(ValueError, match="GiB of memory is available"):
        engine_config.check_cpu_memory(1 << 20)
