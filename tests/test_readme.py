"""Every command of the README runs: the commands are read from README.md's code blocks at test
time, so a README edit is what gets tested.

Each unit (one command of a shell block, or one whole non-shell block) is either run by a test
below (``RUN``) or listed in ``SKIP`` with the reason; a block that neither knows fails
``test_every_readme_block_is_run_or_skipped_for_a_reason``. What is run, and checked:

- ``tandem generate --chat ...`` (the quick start): exit 0, "Paris" in stdout;
- the tensor-parallel ``tandem generate --executor multiproc --tensor-parallel-size 3 ...``:
  exit 0 and the same text as the same command on one rank;
- the ``Use`` Python snippet, as a script;
- the structured-outputs snippet (prints JSON of its schema) and ``tandem generate
  --structured-outputs '{"choice": ...}'`` (prints one of the choices);
- ``tandem serve`` on a free loopback port, then the ``curl`` example, the ``openai`` client
  snippet and ``tandem bench serve`` against it; then SIGINT: exit 0, no process left.

The README's test command is not run here (it runs this suite); ``.ci/run`` must run it.
"""
from __future__ import annotations

import json
import re
import shlex

import pytest

from proc_utils import free_port
from readme_utils import (ROOT, BackgroundServer, Command, Snippet, Unit, describe, option, readme_units, run,
                          run_python, without)

pytestmark = pytest.mark.slow

# Seconds for one command on a loaded two-core machine (the first use of the default model
# also converts its GGUF, ~30 s).
CMD_TIMEOUT_S = 420
SERVER_START_TIMEOUT_S = 300
README_PORT = "127.0.0.1:8000"  # the address the README's client examples use
TP_FLAGS = ("--executor", "--tensor-parallel-size")


def _cmd(u: Unit, *prefix: str) -> bool:
    """``u`` is a command without environment assignments whose argv starts with ``prefix``."""
    return isinstance(u, Command) and not u.env and u.argv[:len(prefix)] == prefix


def _python(u: Unit, marker: str) -> bool:
    """``u`` is a ``python`` block containing ``marker``."""
    return isinstance(u, Snippet) and u.lang == "python" and marker in u.text


# What the tests below run, by name: each must match exactly one README unit.
RUN = {
    "generate_chat": lambda u: _cmd(u, "tandem", "generate") and "--chat" in u.argv,
    "generate_tp": lambda u: _cmd(u, "tandem", "generate") and "--tensor-parallel-size" in u.argv,
    "serve": lambda u: _cmd(u, "tandem", "serve") and "--speculative-config" not in u.argv,
    "curl": lambda u: _cmd(u, "curl"),
    "bench_serve": lambda u: _cmd(u, "tandem", "bench", "serve"),
    "use_snippet": lambda u: (_python(u, "from tandem import LLM") and "StructuredOutputsParams" not in u.text
                              and "speculative_config" not in u.text),
    "spec_snippet": lambda u: _python(u, "speculative_config"),
    "generate_spec": lambda u: _cmd(u, "tandem", "generate") and "--speculative-config" in u.argv,
    "structured_snippet": lambda u: _python(u, "StructuredOutputsParams"),
    "generate_choice": lambda u: _cmd(u, "tandem", "generate") and "--structured-outputs" in u.argv,
    "openai_snippet": lambda u: _python(u, "from openai import OpenAI"),
}

# What is not run, each with the reason.
SKIP = [
    (lambda u: _cmd(u, "pip", "install"),
     "installs packages: the CI run executes the install (.ci/run, see test_ci_runs_the_readme_test_command)"),
    (lambda u: _cmd(u, "lint-imports") or _cmd(u, "ruff", "check") or _cmd(u, "mypy")
     or _cmd(u, "python3", "-m", "pytest"),
     "the README's test command: .ci/run runs it (test_ci_runs_the_readme_test_command); pytest would recurse"),
    (lambda u: _cmd(u, "ray", "start"),
     "starts a Ray cluster across several machines"),
    (lambda u: isinstance(u, Command) and u.env.get("RAY_ADDRESS") == "auto" and u.argv[:2] == ("tandem", "generate"),
     "needs a multi-machine Ray cluster and /models/qwen, which does not exist here"),
    (lambda u: isinstance(u, Snippet) and u.lang == "" and u.text.startswith("tandem/entrypoints/"),
     "the package layout: a diagram, not a command"),
    (lambda u: isinstance(u, Command) and "TOK" in u.env,
     "reads /v1/models' tokenizer folder for the client commands (tests/server/test_client_fields.py checks it)"),
    (lambda u: _cmd(u, "tandem", "serve") and "--speculative-config" in u.argv,
     "needs a draft model at /models/small, which does not exist here (tests/server/test_spec_decode_server.py "
     "serves with speculation)"),
    (lambda u: _cmd(u, "lm_eval") or _cmd(u, "guidellm") or _cmd(u, "aiperf"),
     "third-party clients, large optional installs: tests/server/test_client_tools.py runs them when installed"),
]


def handlers(u: Unit) -> list[str]:
    """Names of the RUN entries and reasons of the SKIP entries that claim ``u``."""
    return [name for name, m in RUN.items() if m(u)] + [reason for m, reason in SKIP if m(u)]


def the(name: str) -> Unit:
    """The one README unit that ``RUN[name]`` runs."""
    found = [u for u in readme_units() if RUN[name](u)]
    assert len(found) == 1, f"README should have exactly one {name} example, has {[str(u) for u in found]}"
    return found[0]


def with_port(text: str, port: int) -> str:
    """The README's server address (127.0.0.1:8000) replaced by ``port``; it must be there."""
    assert README_PORT in text, f"expected {README_PORT} in {text!r}"
    return text.replace(README_PORT, f"127.0.0.1:{port}")


# -- the README itself --------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_every_readme_block_is_run_or_skipped_for_a_reason():
    units = readme_units()
    assert units, "no code blocks found in README.md"
    unknown = [str(u) for u in units if not handlers(u)]
    assert not unknown, f"README commands that no test runs or skips (add them to RUN or SKIP): {unknown}"
    twice = {str(u): handlers(u) for u in units if len(handlers(u)) > 1}
    assert not twice, f"README commands claimed more than once: {twice}"
    for name in RUN:
        the(name)


@pytest.mark.timeout(60)
def test_the_parser_reads_blocks_commands_and_comments():
    text = ("x\n```bash\n# c\nA=1 tandem serve  # note\npip install -e \".[test]\" && tool --a 'b c' \\\n  -d x\n```\n"
            "```python\nprint(1)\n```\n```\nplain\n```\n")
    units = readme_units(text)
    assert [str(u) for u in units[:3]] == ["A=1 tandem serve", "pip install -e '.[test]'", "tool --a 'b c' -d x"]
    assert units[0].env == {"A": "1"} and units[1].source == units[2].source
    assert [(u.lang, u.text) for u in units[3:]] == [("python", "print(1)\n"), ("", "plain\n")]
    with pytest.raises(ValueError, match="never closed"):
        readme_units("```bash\nls\n")


@pytest.mark.timeout(60)
def test_ci_runs_the_readme_test_command():
    lines = {u.source for u in readme_units() if _cmd(u, "python3", "-m", "pytest")}
    assert len(lines) == 1, f"README should have exactly one test command line, has {lines}"
    (readme_line,) = lines
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert readme_line in ci, \
        f".ci/run does not run the README's test command:\n{readme_line}\nit has:\n" + "\n".join(ci)


# -- offline ------------------------------------------------------------------------------

@pytest.mark.timeout(600)
def test_quick_start_generate_answers_paris(tmp_path):
    r = run(the("generate_chat").argv, CMD_TIMEOUT_S, cwd=tmp_path)
    assert r.returncode == 0, describe(r)
    assert "Paris" in r.stdout, describe(r)


@pytest.mark.timeout(900)
def test_tensor_parallel_example_matches_one_rank(tmp_path):
    tp = the("generate_tp").argv
    assert int(option(tp, "--tensor-parallel-size") or 1) > 1, f"not a tensor-parallel example: {tp}"
    r = run(tp, CMD_TIMEOUT_S, cwd=tmp_path)
    assert r.returncode == 0, describe(r)
    one = run(without(tp, *TP_FLAGS), CMD_TIMEOUT_S, cwd=tmp_path)
    assert one.returncode == 0, describe(one)
    assert r.stdout.strip(), describe(r)
    assert r.stdout == one.stdout, f"tensor-parallel output differs from one rank:\n{describe(r)}\n{describe(one)}"


@pytest.mark.timeout(600)
def test_use_snippet_runs(tmp_path):
    r = run_python(the("use_snippet").text, tmp_path / "use.py", CMD_TIMEOUT_S)
    assert r.returncode == 0, describe(r)
    assert r.stdout.strip(), describe(r)


@pytest.mark.timeout(600)
def test_structured_outputs_snippet_prints_json_of_its_schema(tmp_path):
    r = run_python(the("structured_snippet").text, tmp_path / "structured.py", CMD_TIMEOUT_S)
    assert r.returncode == 0, describe(r)
    person = json.loads(r.stdout)
    assert set(person) == {"name", "age"} and isinstance(person["age"], int), describe(r)


@pytest.mark.timeout(600)
def test_choice_example_answers_one_of_the_choices(tmp_path):
    argv = the("generate_choice").argv
    choices = json.loads(option(argv, "--structured-outputs"))["choice"]
    r = run(argv, CMD_TIMEOUT_S, cwd=tmp_path)
    assert r.returncode == 0, describe(r)
    assert r.stdout.strip() in choices, describe(r)


@pytest.mark.timeout(600)
def test_speculative_decoding_examples(tmp_path):
    """The Python snippet prints its answer and counts that verified drafts; the command's
    text equals the same command without speculation."""
    r = run_python(the("spec_snippet").text, tmp_path / "spec.py", CMD_TIMEOUT_S)
    assert r.returncode == 0, describe(r)
    stats = r.stdout.strip().splitlines()[-1]
    assert "'spec_num_drafts'" in stats and "'acceptance_rate'" in stats, describe(r)
    argv = the("generate_spec").argv
    spec = run(argv, CMD_TIMEOUT_S, cwd=tmp_path)
    assert spec.returncode == 0, describe(spec)
    plain = run(without(argv, "--speculative-config"), CMD_TIMEOUT_S, cwd=tmp_path)
    assert plain.returncode == 0 and spec.stdout == plain.stdout and spec.stdout.strip(), describe(spec)


# -- the server: started once, used by the client examples, stopped by the last test ---------

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The README's ``tandem serve`` on a free port (``--port`` added), healthy; killed with
    everything it started at the end whatever happened (the last test stops it cleanly)."""
    serve = the("serve")
    assert option(serve.argv, "--port") is None, f"the README's serve command sets its own port: {serve}"
    port = free_port()
    srv = BackgroundServer([*serve.argv, "--port", str(port)], tmp_path_factory.mktemp("serve") / "server.log")
    srv.port = port
    try:
        srv.wait_healthy(f"http://127.0.0.1:{port}/health", SERVER_START_TIMEOUT_S)
        yield srv
    finally:
        srv.kill()


@pytest.mark.timeout(600)
def test_curl_example(server, tmp_path):
    curl = the("curl")
    argv = shlex.split(with_port(shlex.join(curl.argv), server.port))
    r = run(argv, CMD_TIMEOUT_S, cwd=tmp_path)
    assert r.returncode == 0, describe(r)
    body = json.loads(r.stdout)
    content = body["choices"][0]["message"]["content"]
    assert isinstance(content, str) and content.strip(), body


@pytest.mark.timeout(600)
def test_openai_client_snippet(server, tmp_path):
    source = with_port(the("openai_snippet").text, server.port)
    r = run_python(source, tmp_path / "client.py", CMD_TIMEOUT_S)
    assert r.returncode == 0, describe(r)
    assert r.stdout.strip(), describe(r)


@pytest.mark.timeout(600)
def test_bench_serve_example(server, tmp_path):
    bench = the("bench_serve").argv
    assert option(bench, "--base-url") is None and option(bench, "--port") is None, bench
    r = run([*bench, "--base-url", f"http://127.0.0.1:{server.port}"], CMD_TIMEOUT_S, cwd=tmp_path)
    assert r.returncode == 0, describe(r)
    ok = re.search(r"^Successful requests:\s+(\d+)", r.stdout, re.M)
    assert ok, describe(r)
    assert int(ok.group(1)) == int(option(bench, "--num-prompts")), describe(r)


@pytest.mark.timeout(600)
def test_serve_stops_on_sigint_and_leaves_nothing(server):
    code, left = server.interrupt(timeout=120)
    assert code == 0, f"tandem serve exited with {code} on SIGINT:\n{server.output()}"
    assert not left, f"processes left by tandem serve: {left}"
