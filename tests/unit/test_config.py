"""EngineConfig: validation at construction, and CLI flags generated from the dataclass."""
from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

from tandem.config import EngineConfig

pytestmark = pytest.mark.timeout(60)

FIELDS = {f.name: f for f in dataclasses.fields(EngineConfig)}
BOOL_FIELDS = [n for n, f in FIELDS.items() if f.type in ("bool", bool)]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem-test", exit_on_error=False)
    EngineConfig.add_cli_args(p)
    return p


# -- validation ---------------------------------------------------------------------------------
def test_defaults_are_valid():
    cfg = EngineConfig()
    assert cfg.block_size == 16 and cfg.max_concurrent_batches == 2
    assert EngineConfig(async_scheduling=False).max_concurrent_batches == 1


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(block_size=3), r"block_size must be a power of two.*got 3"),
    (dict(block_size=24), r"block_size must be a power of two.*got 24"),
    (dict(block_size=0), r"block_size must be a power of two.*got 0"),
    (dict(block_size=-4), r"block_size must be a power of two"),
    (dict(max_num_seqs=0), r"max_num_seqs must be >= 1, got 0"),
    (dict(max_num_seqs=-1), r"max_num_seqs must be >= 1"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\], got 1.5"),
    (dict(gpu_memory_utilization=0.0), r"gpu_memory_utilization must be in \(0, 1\]"),
    (dict(gpu_memory_utilization=-0.2), r"gpu_memory_utilization"),
    (dict(gpu_memory_utilization=float("nan")), r"gpu_memory_utilization"),
    (dict(dtype="int8"), r"dtype must be one of .*'int8'"),
    (dict(dtype="fp16"), r"dtype must be one of"),
    (dict(device="tpu"), r"device must be one of .*'tpu'"),
    (dict(executor="mpi"), r"executor must be one of .*"),
    (dict(tensor_parallel_size=2, executor="uniproc"), r"uniproc executor runs one rank"),
    (dict(num_kv_blocks=0), r"num_kv_blocks must be >= 1, got 0"),
    (dict(cpu_kv_cache_gib=0), r"cpu_kv_cache_gib must be > 0"),
    (dict(max_num_batched_tokens=0), r"max_num_batched_tokens must be >= 1"),
    (dict(max_model_len=0), r"max_model_len must be >= 1"),
    (dict(max_logprobs=-1), r"max_logprobs must be >= 0"),
    (dict(tensor_parallel_size=0), r"tensor_parallel_size must be >= 1"),
    (dict(rpc_timeout_s=0), r"rpc_timeout_s must be > 0"),
    (dict(model="/nonexistent/model/folder"), r"model path '/nonexistent/model/folder' does not exist"),
    (dict(enable_chunked_prefill=False, max_num_batched_tokens=512, max_model_len=1024),
     r"without chunked prefill, max_num_batched_tokens \(512\) must be >= max_model_len \(1024\)"),
])
def test_bad_values_raise_value_error_with_clear_message(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern) as ei:
        EngineConfig(**kwargs)
    assert str(ei.value).startswith("invalid engine config: ")


@pytest.mark.parametrize("kwargs", [
    dict(block_size=1), dict(block_size=2), dict(block_size=64),
    dict(max_num_seqs=1), dict(gpu_memory_utilization=1.0), dict(gpu_memory_utilization=0.01),
    dict(dtype="bfloat16"), dict(dtype="float16"), dict(dtype="float32"),
    dict(device="cpu"), dict(device="cuda"), dict(num_kv_blocks=1), dict(max_logprobs=0),
    dict(enable_chunked_prefill=False, max_num_batched_tokens=1024, max_model_len=1024),
    dict(enable_chunked_prefill=True, max_num_batched_tokens=16, max_model_len=1024),
    dict(enable_chunked_prefill=False, max_num_batched_tokens=16),  # max_model_len from the model
])
def test_good_values_accepted(kwargs):
    cfg = EngineConfig(**kwargs)
    for k, v in kwargs.items():
        assert getattr(cfg, k) == v


def test_existing_model_path_accepted(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    assert EngineConfig(model=str(folder)).model == str(folder)
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert EngineConfig(model=str(gguf)).model == str(gguf)


def test_all_errors_reported_together():
    with pytest.raises(ValueError) as ei:
        EngineConfig(block_size=3, max_num_seqs=0, gpu_memory_utilization=1.5, dtype="int8")
    msg = str(ei.value)
    for name in ("block_size", "max_num_seqs", "gpu_memory_utilization", "dtype"):
        assert name in msg


def test_validate_can_be_rerun_after_changes():
    cfg = EngineConfig()
    cfg.block_size = 12
    with pytest.raises(ValueError, match="block_size"):
        cfg.validate()


# -- CLI mirroring ---------------------------------------------------------------------------------
def test_every_field_has_a_flag_with_help():
    parser = make_parser()
    actions = {a.dest: a for a in parser._actions}
    for name, f in FIELDS.items():
        assert flag(name) in parser._option_string_actions, f"no CLI flag for field {name}"
        action = parser._option_string_actions[flag(name)]
        assert action.dest == name
        assert action.help and action.help == f.metadata["help"]
        assert action.default == f.default
    # and nothing beyond the fields (plus -h)
    assert set(actions) - {"help"} == set(FIELDS)


def test_choices_mirrored():
    parser = make_parser()
    for name, f in FIELDS.items():
        if "choices" in f.metadata:
            assert tuple(parser._option_string_actions[flag(name)].choices) == tuple(f.metadata["choices"])
    with pytest.raises((SystemExit, argparse.ArgumentError)):
        parser.parse_args(["--dtype", "int8"])


@pytest.mark.parametrize("name", BOOL_FIELDS)
def test_booleans_have_no_forms(name):
    assert BOOL_FIELDS and set(BOOL_FIELDS) >= {"enable_prefix_caching", "enable_chunked_prefill",
                                                "async_scheduling"}
    parser = make_parser()
    assert "--no-" + flag(name)[2:] in parser._option_string_actions
    default = FIELDS[name].default
    assert getattr(parser.parse_args([]), name) is default
    assert getattr(parser.parse_args([flag(name)]), name) is True
    assert getattr(parser.parse_args(["--no-" + flag(name)[2:]]), name) is False
    cfg = EngineConfig.from_cli_args(parser.parse_args(["--no-" + flag(name)[2:]]))
    assert getattr(cfg, name) is False


def test_defaults_round_trip():
    assert EngineConfig.from_cli_args(make_parser().parse_args([])) == EngineConfig()


def test_all_values_round_trip(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    values = dict(
        model=str(model), tokenizer=str(tmp_path / "tok"), dtype="bfloat16", device="cpu", block_size=32,
        num_kv_blocks=123, gpu_memory_utilization=0.55, cpu_kv_cache_gib=2.5, max_num_seqs=7,
        max_num_batched_tokens=4096, max_model_len=2048, enable_prefix_caching=False,
        enable_chunked_prefill=False, async_scheduling=False, max_logprobs=5, seed=42,
        executor="multiproc", tensor_parallel_size=2, rpc_timeout_s=12.5, worker_start_timeout_s=99.0,
        worker_cls="tandem.worker.worker.Worker",
    )
    assert set(values) == set(FIELDS), "update this test when a field is added"
    argv = []
    for name, v in values.items():
        if isinstance(v, bool):
            argv.append(flag(name) if v else "--no-" + flag(name)[2:])
        else:
            argv += [flag(name), str(v)]
    args = make_parser().parse_args(argv)
    cfg = EngineConfig.from_cli_args(args)
    assert cfg == EngineConfig(**values)
    for name, v in values.items():
        got = getattr(cfg, name)
        assert got == v and type(got) is type(v), (name, got, v)


def test_optional_fields_parse_to_their_types():
    args = make_parser().parse_args(["--num-kv-blocks", "9", "--max-model-len", "77"])
    assert args.num_kv_blocks == 9 and args.max_model_len == 77
    args = make_parser().parse_args([])
    assert args.num_kv_blocks is None and args.max_model_len is None and args.model is None


def test_bad_cli_values_fail_validation():
    parser = make_parser()
    with pytest.raises(ValueError, match="block_size"):
        EngineConfig.from_cli_args(parser.parse_args(["--block-size", "12"]))
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig.from_cli_args(parser.parse_args(["--gpu-memory-utilization", "1.5"]))
    with pytest.raises(ValueError, match="without chunked prefill"):
        EngineConfig.from_cli_args(parser.parse_args(
            ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "100", "--max-model-len", "200"]))
    with pytest.raises((SystemExit, argparse.ArgumentError)):
        parser.parse_args(["--max-num-seqs", "many"])


def test_flag_names_are_kebab_case():
    for opt in make_parser()._option_string_actions:
        assert re.fullmatch(r"-h|--help|--[a-z0-9]+(-[a-z0-9]+)*", opt), opt


@pytest.mark.parametrize("kwargs", [dict(max_num_seqs="8"), dict(max_num_seqs=2.5),
                                    dict(gpu_memory_utilization=None), dict(max_num_batched_tokens=None)])
def test_wrongly_typed_values_raise_value_error(kwargs):
    (name,) = kwargs
    with pytest.raises(ValueError, match=name):
        EngineConfig(**kwargs)
