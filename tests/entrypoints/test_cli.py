"""``tandem generate``: flags generated from EngineConfig and SamplingParams, same defaults as
the Python API, and what the user sees on success, on a mistake, and on Ctrl-C."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import tandem
from tandem import LLM, SamplingParams
from tandem.config import EngineConfig
from tandem.entrypoints import cli

pytestmark = pytest.mark.timeout(300)

MODELS = [(EngineConfig, {}), (SamplingParams, cli.SAMPLING_DESTS)]


def generate_parser():
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if a.dest == "command"]
    return sub.choices["generate"]


def parse(*argv: str):
    return cli.build_parser().parse_args(["generate", *argv])


def flag(name: str, dests: dict[str, str]) -> str:
    return "--" + dests.get(name, name).replace("_", "-")


# -- flags mirror the fields ---------------------------------------------------------------------
@pytest.mark.parametrize("model_cls, dests", MODELS)
def test_every_field_has_a_flag_with_its_description(model_cls, dests):
    actions = generate_parser()._option_string_actions
    for name, field in model_cls.model_fields.items():
        action = actions[flag(name, dests)]
        assert action.dest == dests.get(name, name)
        assert action.help.startswith(field.description), name


@pytest.mark.parametrize("model_cls, dests", MODELS)
def test_cli_defaults_are_the_python_api_defaults(model_cls, dests):
    assert model_cls.from_cli_args(parse(), dests) == model_cls()


def test_sampling_defaults_are_not_the_old_cli_ones():
    """The CLI used to default to temperature 0 and 64 tokens while SamplingParams said 1.0 and 16."""
    sp = SamplingParams.from_cli_args(parse(), cli.SAMPLING_DESTS)
    assert (sp.temperature, sp.max_tokens) == (1.0, 16)


def test_help_shows_every_default_and_the_new_flags(capsys):
    assert cli.main(["generate", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for text in ("--temperature TEMPERATURE randomness of sampling; 0 = greedy (default: 1.0)",
                 "(default: 16)", "--logprobs", "--min-tokens", "--stop-token-ids", "--include-stop-str-in-output",
                 "--sampling-seed", "--block-size", "(a power of two, at most 256) (default: 16)"):
        assert text in out, text
    generate = generate_parser()
    for action in generate._actions:
        if action.option_strings and action.dest != "help":
            assert action.help, action.option_strings


def test_engine_seed_and_request_seed_are_different_flags():
    args = parse("--seed", "3", "--sampling-seed", "5")
    assert EngineConfig.from_cli_args(args).seed == 3
    assert SamplingParams.from_cli_args(args, cli.SAMPLING_DESTS).seed == 5
    actions = generate_parser()._option_string_actions
    assert "engine-wide" in actions["--seed"].help and "not the per-request" in actions["--seed"].help
    assert "per-request" in actions["--sampling-seed"].help


@pytest.mark.parametrize("model_cls, dests", MODELS)
def test_booleans_have_no_forms(model_cls, dests):
    bools = [n for n, f in model_cls.model_fields.items() if f.annotation is bool]
    assert bools
    for name in bools:
        dest = dests.get(name, name)
        on, off = flag(name, dests), "--no-" + flag(name, dests)[2:]
        assert getattr(parse(on), dest) is True and getattr(parse(off), dest) is False
        assert getattr(model_cls.from_cli_args(parse(off), dests), name) is False


def test_lists_repeat_and_optionals_take_none():
    args = parse("--stop", "a", "--stop", "b c", "--stop-token-ids", "3", "--stop-token-ids", "4",
                 "--max-tokens", "none", "--num-kv-blocks", "None", "--logprobs", "2")
    sp = SamplingParams.from_cli_args(args, cli.SAMPLING_DESTS)
    assert sp.stop == ["a", "b c"] and sp.stop_token_ids == [3, 4] and sp.max_tokens is None and sp.logprobs == 2
    assert EngineConfig.from_cli_args(args).num_kv_blocks is None
    assert parse().stop == [] and parse().stop == []  # the default list is never shared and appended to


def test_all_values_round_trip(tmp_path):
    engine = dict(
        model=str(tmp_path), tokenizer=str(tmp_path), dtype="bfloat16", device="cpu", block_size=32,
        num_kv_blocks=123, gpu_memory_utilization=0.55, cpu_kv_cache_gib=2.5, max_num_seqs=7,
        max_num_batched_tokens=4096, max_model_len=2048, enable_prefix_caching=False, enable_chunked_prefill=False,
        async_scheduling=False, max_logprobs=5, seed=42, executor="multiproc", tensor_parallel_size=2,
        rpc_timeout_s=12.5, worker_start_timeout_s=99.0, worker_cls="tandem.worker.worker.Worker",
    )
    sampling = dict(n=2, temperature=0.5, top_p=0.9, top_k=7, min_p=0.1, repetition_penalty=1.2,
                    frequency_penalty=-0.5, presence_penalty=0.5, seed=-9, max_tokens=33, min_tokens=2,
                    stop=["x"], stop_token_ids=[9], ignore_eos=True, logprobs=3, prompt_logprobs=1,
                    include_stop_str_in_output=True, skip_special_tokens=False, spaces_between_special_tokens=False,
                    detokenize=False,
                    logit_bias={5: -100.0, 7: 2.5}, structured_outputs={"regex": "[ab]+"})
    assert set(sampling) == set(SamplingParams.model_fields), "update this test when a field is added"
    argv: list[str] = []
    for values, dests in ((engine, {}), (sampling, cli.SAMPLING_DESTS)):
        for name, v in values.items():
            f = flag(name, dests)
            if isinstance(v, bool):
                argv.append(f if v else "--no-" + f[2:])
            elif isinstance(v, dict):
                argv += [f, json.dumps(v)]
            else:
                for item in v if isinstance(v, list) else [v]:
                    argv += [f, str(item)]
    args = parse(*argv)
    cfg, sp = EngineConfig.from_cli_args(args), SamplingParams.from_cli_args(args, cli.SAMPLING_DESTS)
    assert sp == SamplingParams(**sampling)
    for name, v in engine.items():
        got = getattr(cfg, name)
        assert got == v and type(got) is type(v), (name, got, v)


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tandem {tandem.__version__}"


@pytest.mark.parametrize("argv, message", [
    (["generate", "--max-num-seq", "3"], "error: unknown flag '--max-num-seq' (did you mean '--max-num-seqs'?)"),
    (["generate", "--temprature=0"], "error: unknown flag '--temprature' (did you mean '--temperature'?)"),
    (["generate", "--dtype", "int8"], "error: argument --dtype: invalid choice: 'int8'"),
    (["generate", "--max-num-seqs", "many"], "error: argument --max-num-seqs: invalid int value: 'many'"),
    (["generate", "--temperature", "nan"], "error: invalid sampling params: temperature must be a finite number"),
    (["generate", "--block-size", "1048576"],
     "error: invalid engine config: block_size must be a power of two <= 256, got 1048576"),
    ([], "error: the following arguments are required: command"),
])
def test_usage_mistakes_are_one_line_and_status_2(capsys, argv, message):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


# -- runs on a tiny model --------------------------------------------------------------------------
SMALL_CACHE = ["--num-kv-blocks", "256"]  # the default 1 GiB CPU cache is far more than a tiny model needs


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(["generate", *argv, *SMALL_CACHE])
    out, err = capsys.readouterr()
    return rc, out, err


def test_cli_answers_like_the_api(tiny_llama, capsys):
    rc, out, err = run(capsys, "--model", tiny_llama, "--prompt", "t5 t6 t7", "--prompt", "t9",
                       "--temperature", "0", "--max-tokens", "5", "--ignore-eos", "--quiet")
    assert rc == 0, err
    with LLM(tiny_llama, num_kv_blocks=256) as llm:
        want = llm.generate(["t5 t6 t7", "t9"], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                            use_tqdm=False)
    assert out.splitlines() == [o.outputs[0].text for o in want]
    assert len(out.splitlines()[0].split()) == 5


def test_jsonl_in_and_out_with_per_row_sampling(tiny_llama, tmp_path, capsys):
    inp, outp = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"prompt": "t5 t6", "sampling_params": {"max_tokens": 3}}) + "\n\n" +
                   json.dumps({"prompt": [7, 8, 9]}) + "\n" + json.dumps("t4") + "\n")
    rc, out, err = run(capsys, "--model", tiny_llama, "--input", str(inp), "--output", str(outp),
                       "--temperature", "0", "--max-tokens", "2", "--ignore-eos", "--quiet")
    assert rc == 0, err
    rows = [json.loads(line) for line in outp.read_text().splitlines()]
    assert [len(r["token_ids"]) for r in rows] == [3, 2, 2]
    assert rows[1]["prompt"] == [7, 8, 9] and rows[2]["prompt"] == "t4" and out == ""


def test_json_lines_on_stdout(tiny_llama, capsys):
    rc, out, _ = run(capsys, "--model", tiny_llama, "--prompt", "t5", "--n", "2", "--sampling-seed", "1",
                     "--max-tokens", "2", "--ignore-eos", "--json", "--quiet")
    assert rc == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert len(rows) == 2 and all(r["finish_reason"] == "length" for r in rows)


def test_output_checked_before_the_model_loads(tiny_llama, tmp_path, capsys, monkeypatch):
    """A bad --output fails at once; the engine is never built (results are not lost after a long run)."""
    def boom(*a, **k):
        raise AssertionError("the engine was built before --output was checked")

    monkeypatch.setattr(LLM, "from_config", boom)
    rc, _, err = run(capsys, "--model", tiny_llama, "--prompt", "t5", "--output", str(tmp_path / "no" / "x.jsonl"))
    assert rc == 2 and "is not an existing folder" in err
    target = tmp_path / "new.jsonl"
    monkeypatch.undo()
    rc, _, err = run(capsys, "--model", tiny_llama, "--prompt", "", "--output", str(target))
    assert rc == 2 and not target.exists(), "the writability probe must not leave a file behind"


def test_prompt_checks_happen_before_the_weights_load(tiny_llama, capsys, monkeypatch):
    monkeypatch.setattr(LLM, "from_config", lambda *a, **k: pytest.fail("weights loaded for a bad prompt"))
    rc, _, err = run(capsys, "--model", tiny_llama, "--prompt", "t5", "--prompt", " ".join(["t5"] * 600))
    assert rc == 2 and err.startswith("error: --prompt #2: the prompt has 600 tokens, but max_model_len is 512")


def test_debug_shows_the_traceback(tiny_llama, capsys):
    rc, _, err = run(capsys, "--model", tiny_llama, "--prompt", "", "--debug")
    assert rc == 2 and "Traceback (most recent call last)" in err
    assert err.rstrip().splitlines()[-1].startswith("error: --prompt #1: the prompt is empty")
    rc, _, err = run(capsys, "--model", tiny_llama, "--prompt", "")
    assert rc == 2 and "Traceback" not in err and err.count("\n") == 1


def test_ctrl_c_is_status_130_without_traceback(tiny_llama, capsys, monkeypatch):
    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(LLM, "generate", interrupted)
    rc, _, err = run(capsys, "--model", tiny_llama, "--prompt", "t5", "--quiet")
    assert rc == 130 and err == "error: interrupted\n"


def test_internal_errors_say_so_and_point_to_debug(tiny_llama, capsys, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("something inside broke")

    monkeypatch.setattr(LLM, "generate", broken)
    rc, _, err = run(capsys, "--model", tiny_llama, "--prompt", "t5", "--quiet")
    assert rc == 1
    assert err == ("error: internal error (RuntimeError): something inside broke "
                   "(rerun with --debug for the traceback)\n")


# -- the real process: exit status and stderr as a shell sees them -----------------------------------
def test_process_exit_status_for_a_mistake(tiny_llama):
    p = subprocess.run([sys.executable, "-m", "tandem.entrypoints.cli", "generate", "--model", tiny_llama,
                        "--prompt", "t5", "--max-model-len", "100000"], capture_output=True, text=True, timeout=240)
    err = p.stderr
    assert p.returncode == 2, err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == "error: max_model_len 100000 exceeds the model's context length 512"
