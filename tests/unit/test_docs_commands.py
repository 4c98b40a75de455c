"""Every command in README.md and docs/operations.md is checked, fast: nothing is started (no Ray,
no server, no subprocess); each command is parsed by the real parser of the program it names.

- Fenced ``sh`` blocks, line by line (continuations joined, comments dropped; ``[...]`` marks an
  optional part, ``...`` more of the same, ``a|b`` alternatives; DIR, FILE, PORT, N, S and the
  like are placeholders):
  - ``pdserve``, ``.venv/bin/pdserve``, ``python -m pdserve``: ``pdserve.cli.main.main`` with
    ``argparse.ArgumentParser.parse_args`` stopped right after it parsed, so each subcommand's own
    parser (the one ``main`` builds) judges the arguments and nothing runs. A ``launch`` line's
    values then go through ``launch_config_from_args`` and ``EngineConfig`` (a policy name, a
    routing mode or a resource request the code refuses fails here too).
  - ``make TARGET [VAR=value]``: the target is in the Makefile; a variable's value is parsed as
    part of the recipe line that uses it (``make demo DEMO_ARGS=--keep-alive`` ->
    ``pdserve demo --keep-alive``).
  - ``python bench/NAME.py ...`` (a product module, ``pdserve.bench.NAME``) and ``python
    benchmarks/NAME.py ...`` (an experiment script, not in the wheel, imported as its run does:
    by bare name from its folder, see tests/conftest.py): that script's ``main`` with its parser
    stopped the same way.
  - ``ray SUBCOMMAND ...``: Ray's own command line (click), parsed, not invoked.
  - ``prometheus``, ``grafana-server``, ``curl``, ``cp``, ``export``, ``python3 -c``: see the list
    below; a request body given to ``curl`` goes through pdserve's OpenAI request parser, and the
    ``python3 -c`` half of the dashboard-install pipeline is run here.
  Any other program fails the test: add a check for it (and a line below).
- Inline commands (single-backtick spans) that start with ``pdserve ``, ``.venv/bin/pdserve ``,
  ``python -m pdserve`` or ``make ``: as above. A mere mention of a subcommand must not start
  with ``pdserve `` unless it parses (``pdserve generate`` alone does not: it needs a prompt).
- Inline flags (spans that start with ``--``): each is an option of some pdserve parser, of a
  benchmark script named in the files, or of ``ray start``, so a renamed flag fails here even where
  it is only mentioned.
- ``yaml`` blocks are ``pdserve launch --config`` files: loaded through the real config path.
- ``python`` blocks: the ``LLM`` example's keyword arguments are real ``EngineConfig`` and
  ``SamplingParams`` fields; the ``openai`` example compiles (it is run as below).
- Also: fenced blocks are labelled (sh, python, yaml, text); relative links point at files (and
  same-file anchors at headings) that exist; README.md is at most 150 lines and links
  docs/operations.md and docs/scheduling.md.

The other kinds of command, and the integration test that runs them (``INTEGRATION`` below; each
file must exist and contain its marker, so this list cannot silently rot):

- ``pdserve launch / generate / status / shutdown`` as processes: tests/integration/test_cli.py
  ``test_launch_generate_status_shutdown_of_a_model_by_hub_name`` (tests/integration/cli_session.py
  ``launch_generate_status_shutdown``); ``pdserve shutdown --port`` alone (no Ray joined):
  tests/integration/test_shutdown_by_port.py ``test_each_cluster_is_stopped_by_its_port_alone``;
  ``python -m pdserve``: test_cli.py
  ``test_python_dash_m_pdserve_is_the_pdserve_script``; ``make-tiny-model``, ``demo-scheduler``,
  ``demo`` and ``pip wheel --no-deps .``: tests/integration/test_packaging.py
  ``test_installed_wheel_runs_the_cli_from_another_directory``; ``pdserve top``:
  tests/integration/test_top.py ``test_top_once_and_status_in_80_columns``; ``pdserve bench serve``
  (gRPC and ``--backend openai``) and ``bench compare``: tests/integration/test_bench_serve.py
  ``test_bench_serve_replays_over_the_openai_api``.
- ``curl .../v1/completions``: cli_session.py ``launch_generate_status_shutdown`` (the same POST,
  with urllib). ``curl -sN .../v1/chat/completions`` with ``"stream": true``:
  tests/integration/test_http_api.py ``test_sse_framing_byte_for_byte``.
- the ``openai`` Python example: test_http_api.py
  ``test_openai_client_completions_and_chat_match_grpc_and_the_engine``.
- the offline ``LLM`` example: tests/integration/test_engine_parity.py
  ``test_text_prompts_round_trip_through_the_tokenizer``.
- ``ray start`` (many nodes) and ``pdserve launch --address`` with the resource flags:
  tests/integration/test_multinode.py ``test_cli_joins_the_token_cluster_and_shows_where_workers_run``
  (its nodes come from ``ray.cluster_utils.Cluster``, not from ``ray start``; the ``ray start``
  lines themselves are parsed here by Ray's parser).
- ``ray get-auth-token`` and the dashboard steps: tests/integration/test_dashboard_events.py
  ``test_a_person_finds_transfers_and_pauses_in_the_dashboard`` (it reads the token file that
  ``ray get-auth-token`` prints).
- ``prometheus --config.file=... --storage.tsdb.path=... --web.listen-address=...``:
  tests/integration/test_prometheus_scrape.py
  ``test_prometheus_scrapes_pdserve_through_rays_service_discovery`` (the same flags, with a config
  of its own; deploy/prometheus/prometheus.yml itself goes through promtool in
  tests/unit/test_deploy_files.py).

Run by no test (``UNRUN``; a new such kind must be added there on purpose): ``grafana-server``,
the ``cp`` of the dashboard into Ray's Grafana folder, the ``curl`` to Grafana's
``/api/dashboards/db``, and the ``export RAY_PROMETHEUS_HOST / RAY_GRAFANA_HOST /
RAY_GRAFANA_IFRAME_HOST`` + ``ray start --head --metrics-export-port`` embedding of the Metrics tab.
Here: the copied file exists, the variable names are ones Ray's dashboard reads, the
``python3 -c`` half runs, and test_deploy_files.py checks the dashboard JSON and provisioning.
"""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import importlib.util
import inspect
import io
import itertools
import json
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = ("README.md", "docs/operations.md")
README_MAX_LINES = 150
FENCE_LANGUAGES = {"sh", "python", "yaml", "text"}

# Command kind -> (integration test file, a string it must contain).
INTEGRATION = {
    "pdserve (processes)": ("tests/integration/test_cli.py",
                            "def test_launch_generate_status_shutdown_of_a_model_by_hub_name"),
    "pdserve (session)": ("tests/integration/cli_session.py", "def launch_generate_status_shutdown"),
    "pdserve shutdown --port": ("tests/integration/test_shutdown_by_port.py",
                                "def test_each_cluster_is_stopped_by_its_port_alone"),
    "python -m pdserve": ("tests/integration/test_cli.py", "def test_python_dash_m_pdserve_is_the_pdserve_script"),
    "pdserve (installed wheel)": ("tests/integration/test_packaging.py",
                                  "def test_installed_wheel_runs_the_cli_from_another_directory"),
    "pdserve top": ("tests/integration/test_top.py", "def test_top_once_and_status_in_80_columns"),
    "pdserve bench": ("tests/integration/test_bench_serve.py", "def test_bench_serve_replays_over_the_openai_api"),
    "curl completions": ("tests/integration/cli_session.py", "def launch_generate_status_shutdown"),
    "curl chat stream": ("tests/integration/test_http_api.py", "def test_sse_framing_byte_for_byte"),
    "openai example": ("tests/integration/test_http_api.py",
                       "def test_openai_client_completions_and_chat_match_grpc_and_the_engine"),
    "LLM example": ("tests/integration/test_engine_parity.py",
                    "def test_text_prompts_round_trip_through_the_tokenizer"),
    "ray start": ("tests/integration/test_multinode.py",
                  "def test_cli_joins_the_token_cluster_and_shows_where_workers_run"),
    "ray get-auth-token": ("tests/integration/test_dashboard_events.py",
                           "def test_a_person_finds_transfers_and_pauses_in_the_dashboard"),
    "prometheus": ("tests/integration/test_prometheus_scrape.py",
                   "def test_prometheus_scrapes_pdserve_through_rays_service_discovery"),
}
# Kinds no test runs: listed, so that a new one is added on purpose (see the docstring).
UNRUN = {"grafana-server", "cp", "curl grafana api", "export"}

PDSERVE_PREFIXES = (("pdserve",), (".venv/bin/pdserve",), ("python", "-m", "pdserve"),
                    ("python3", "-m", "pdserve"), (".venv/bin/python", "-m", "pdserve"))
PYTHONS = ("python", "python3", ".venv/bin/python")
# Whole-token placeholders that must become a number for the parser; the others (DIR, FILE, KEY,
# NAME, HOST, HEAD_IP, ...) are fine as strings.
NUMERIC_PLACEHOLDERS = {"PORT": "50051", "N": "8", "S": "30"}


# ---------------------------------------------------------------------------- markdown

def _text(name: str) -> str:
    return (ROOT / name).read_text()


def _fenced_blocks(text: str) -> list[tuple[str, int, list[str]]]:
    """(language, line number of the first body line, body lines with the fence's indent removed)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\S*)\s*$", lines[i])
        if not m:
            i += 1
            continue
        indent, lang, start = len(m.group(1)), m.group(2), i + 1
        i += 1
        body = []
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        blocks.append((lang, start + 1, body))
        i += 1
    return blocks


def _prose(text: str) -> str:
    """The text with every fenced block blanked (line numbers kept)."""
    out, inside = [], False
    for line in text.splitlines():
        if re.match(r"^\s*```", line):
            inside = not inside
            out.append("")
        else:
            out.append("" if inside else line)
    return "\n".join(out)


def _inline_spans(text: str) -> list[tuple[int, str]]:
    """(line number, whitespace-normalised content) of every single-backtick span outside fences."""
    prose = _prose(text)
    return [(prose.count("\n", 0, m.start()) + 1, " ".join(m.group(1).split()))
            for m in re.finditer(r"`([^`]+)`", prose)]


def _shell_lines(body: list[str], first: int) -> list[tuple[int, str]]:
    """Continuation lines joined; blank and comment-only lines dropped."""
    out, pending, start = [], "", None
    for n, line in enumerate(body, first):
        if start is None:
            start = n
        stripped = line.rstrip()
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        pending += stripped
        if pending.strip() and not pending.strip().startswith("#"):
            out.append((start, pending.strip()))
        pending, start = "", None
    return out


def _split(line: str) -> list[list[str]]:
    """shlex words, comments dropped, split into the commands of a pipeline."""
    words = shlex.split(line, comments=True)
    return [list(g) for is_pipe, g in itertools.groupby(words, lambda w: w == "|") if not is_pipe]


def _commands() -> list[tuple[str, str]]:
    """(where, command line) of every shell line and inline command of both files."""
    found = []
    for name in FILES:
        text = _text(name)
        for lang, first, body in _fenced_blocks(text):
            if lang == "sh":
                found += [(f"{name}:{n}", line) for n, line in _shell_lines(body, first)]
        for n, span in _inline_spans(text):
            if span.startswith(("pdserve ", ".venv/bin/pdserve ", "python -m pdserve", "make ")):
                found.append((f"{name}:{n} (inline)", span))
    return found


def _blocks(lang: str) -> list[tuple[str, list[str]]]:
    return [(f"{name}:{first}", body) for name in FILES
            for block_lang, first, body in _fenced_blocks(_text(name)) if block_lang == lang]


# ---------------------------------------------------------------------------- parsers, stopped

class _Parsed(BaseException):
    """Raised by the patched ``parse_args`` once a parser has parsed: nothing after it runs."""

    def __init__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace) -> None:
        super().__init__(parser.prog)
        self.parser, self.namespace = parser, namespace


@contextlib.contextmanager
def _parsers_stop_after_parsing():
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        raise _Parsed(self, original(self, args, namespace))

    argparse.ArgumentParser.parse_args = parse_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args = original


def _run_parser(call, argv: list[str], what: str) -> argparse.Namespace | None:
    """``call()`` with parsers stopped; the namespace its parser produced. A usage error fails
    the test with argparse's message; ``--help`` (which exits 0) returns None."""
    err = io.StringIO()
    try:
        with _parsers_stop_after_parsing(), contextlib.redirect_stderr(err), \
                contextlib.redirect_stdout(io.StringIO()):
            result = call()
    except _Parsed as parsed:
        return parsed.namespace
    except SystemExit as exc:
        if exc.code == 0 and ("--help" in argv or "-h" in argv):
            return None
        pytest.fail(f"{what}: refused by its parser (exit {exc.code}):\n{err.getvalue()}")
    if not argv or argv in (["--help"], ["-h"]):
        assert result == 0, f"{what}: exit status {result}"
        return None
    pytest.fail(f"{what}: returned {result!r} without reaching an argument parser:\n{err.getvalue()}")


def _clean_args(words: list[str]) -> list[str]:
    """Optional-part brackets and ``...`` removed, numeric placeholders filled in."""
    out = []
    for word in words:
        if word.startswith("["):
            word = word[1:]
        while word.endswith("]") and word.count("]") > word.count("["):
            word = word[:-1]
        if word in ("", "...", "]"):
            continue
        out.append(NUMERIC_PLACEHOLDERS.get(word, word))
    return out


def _alternatives(args: list[str]) -> list[list[str]]:
    """``bench serve|compare`` -> both; only in the subcommand words before the first flag."""
    head = list(itertools.takewhile(lambda w: not w.startswith("-"), args))
    choices = [w.split("|") if "|" in w else [w] for w in head]
    return [list(combo) + args[len(head):] for combo in itertools.product(*choices)]


def _pdserve_args(words: list[str]) -> list[str] | None:
    for prefix in PDSERVE_PREFIXES:
        if tuple(words[:len(prefix)]) == prefix:
            return words[len(prefix):]
    return None


def _check_pdserve(args: list[str], where: str, monkeypatch, tmp_path) -> None:
    from pdserve.cli import main as cli

    for argv in _alternatives(_clean_args(args)):
        what = f"{where}: pdserve {' '.join(argv)}"
        namespace = _run_parser(lambda: cli.main(argv), argv, what)
        if namespace is not None and argv and argv[0] == "launch":
            _check_launch_values(namespace, what, monkeypatch, tmp_path)


def _check_launch_values(ns: argparse.Namespace, what: str, monkeypatch, tmp_path) -> None:
    """The values of a launch line through the real config path, with placeholder files made
    up: a key file with one key (and an admin key file with another), an empty --config file;
    TLS files are not read."""
    from pdserve.cli.main import launch_config_from_args
    from pdserve.cluster import auth
    from pdserve.workers.config import EngineConfig

    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    monkeypatch.setattr(auth.TlsFiles, "check", lambda self: None)
    ns = argparse.Namespace(**vars(ns))
    if ns.api_key_file is not None:
        ns.api_key_file = str(tmp_path / "keys")
        (tmp_path / "keys").write_text("# placeholder\npdk-docs-placeholder-key\n")
    if ns.admin_api_key_file is not None:  # another key: a key may not be both kinds
        ns.admin_api_key_file = str(tmp_path / "admin-keys")
        (tmp_path / "admin-keys").write_text("# placeholder\npdk-docs-placeholder-admin-key\n")
    if ns.config is not None:
        ns.config = str(tmp_path / "empty.yaml")
        (tmp_path / "empty.yaml").write_text("{}\n")
    try:
        cfg = launch_config_from_args(ns)
        for role in (cfg.context_engine, cfg.generation_engine):
            EngineConfig.from_kwargs({**cfg.engine, **role})
    except (ValueError, TypeError) as exc:
        pytest.fail(f"{what}: its values are refused: {exc}")


# A benchmark script's path as the documents write it: bench/NAME.py ships in the package,
# benchmarks/NAME.py is an experiment outside it. Script names are lower case, so a placeholder
# (`python benchmarks/NAME.py`) is not taken for a script.
BENCH_SCRIPT = re.compile(r"\b(bench|benchmarks)/([a-z0-9_]+)\.py\b")


def _bench_main(folder: str, name: str):
    """``main`` of FOLDER/NAME.py and whether it takes argv."""
    module = importlib.import_module(f"pdserve.bench.{name}" if folder == "bench" else name)
    assert Path(module.__file__).resolve() == ROOT / folder / f"{name}.py", (
        f"{folder}/{name}.py: importing {name} found {module.__file__}")
    main = module.main
    return main, bool(inspect.signature(main).parameters)


def _check_bench_script(path: str, args: list[str], where: str, monkeypatch) -> None:
    m = BENCH_SCRIPT.fullmatch(path)
    assert m and (ROOT / path).is_file(), f"{where}: no script {path}"
    main, takes_argv = _bench_main(m.group(1), m.group(2))
    argv = _clean_args(args)
    if takes_argv:
        _run_parser(lambda: main(argv), argv, f"{where}: {path} {' '.join(argv)}")
    else:
        monkeypatch.setattr(sys, "argv", [path, *argv])
        _run_parser(main, argv, f"{where}: {path} {' '.join(argv)}")


def _check_ray(args: list[str], where: str) -> str:
    import click
    from ray.scripts.scripts import cli as ray_cli

    args = _clean_args(args)
    assert args and args[0] in ray_cli.commands, f"{where}: `ray {args[:1]}` is no ray command"
    try:
        ray_cli.commands[args[0]].make_context(f"ray {args[0]}", list(args[1:]))
    except click.ClickException as exc:
        pytest.fail(f"{where}: ray {' '.join(args)}: refused by Ray's parser: {exc.format_message()}")
    return f"ray {args[0]}"


def _makefile() -> tuple[set[str], dict[str, list[str]]]:
    """The Makefile's targets and, per variable, the recipe lines that use it."""
    targets, uses = set(), {}
    for line in (ROOT / "Makefile").read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_./%$()-][^:=\s]*(?:\s+[^:=\s]+)*)\s*:(?!=)", line)
        if m and not line.startswith("\t"):
            targets.update(m.group(1).split())
        if line.startswith("\t"):
            for var in re.findall(r"\$\((\w+)\)", line):
                uses.setdefault(var, []).append(line.strip())
    return targets, uses


def _check_make(args: list[str], where: str, monkeypatch, tmp_path) -> None:
    targets, uses = _makefile()
    assigned = [a for a in args if "=" in a]
    for target in (a for a in args if "=" not in a):
        assert target in targets, f"{where}: no Makefile target {target!r} (targets: {sorted(targets)})"
    for assignment in assigned:
        var, value = assignment.split("=", 1)
        assert var in uses, f"{where}: the Makefile's recipes use no $({var})"
        for recipe in uses[var]:
            line = recipe.replace("$(BIN)/", ".venv/bin/").replace(f"$({var})", value)
            line = re.sub(r"\$\(\w+\)", "", line)
            _check_line(line, f"{where} [{recipe}]", monkeypatch, tmp_path)


def _openai_api():
    return importlib.import_module("pdserve.cluster.front.openai.api")


def _check_curl(words: list[str], stdin: str | None, where: str) -> str:
    url = next((w for w in words if w.startswith(("http://", "https://"))), None)
    assert url, f"{where}: curl without a URL"
    body = None
    for flag, value in zip(words, words[1:]):
        if flag in ("-d", "--data", "--data-raw", "--data-binary"):
            body = stdin if value == "@-" else value
    path = re.sub(r"^https?://[^/]+", "", url)
    if path.endswith("/api/dashboards/db"):
        request = json.loads(body)
        assert request["overwrite"] is True and request["dashboard"]["uid"] == "pdserve", where
        return "curl grafana api"
    api = _openai_api()
    kind = {"/v1/completions": api.COMPLETIONS, "/v1/chat/completions": api.CHAT}.get(path)
    assert kind is not None, f"{where}: curl to {path}: no check for this endpoint"
    try:
        api.parse_request(json.loads(body), kind, "served-model")
    except api.ApiError as exc:
        pytest.fail(f"{where}: pdserve's OpenAI parser refuses the body: {exc}")
    streams = bool(json.loads(body).get("stream"))
    return {(api.COMPLETIONS, False): "curl completions",
            (api.CHAT, True): "curl chat stream"}.get((kind, streams), f"curl {path} stream={streams}")


def _ray_dashboard_source() -> str:
    spec = importlib.util.find_spec("ray")  # no import: only where Ray lies
    return (Path(spec.origin).parent / "dashboard" / "modules" / "metrics" / "metrics_head.py").read_text()


def _check_line(line: str, where: str, monkeypatch, tmp_path) -> list[str]:
    """Checks one shell line (a pipeline); returns the kinds of command it holds."""
    kinds, stdin = [], None
    for words in _split(line):
        args = _pdserve_args(words)
        if args is not None:
            _check_pdserve(args, where, monkeypatch, tmp_path)
            kinds.append("pdserve")
        elif words[0] == "make":
            _check_make(words[1:], where, monkeypatch, tmp_path)
            kinds.append("make")
        elif words[0] in PYTHONS and len(words) > 1 and words[1].startswith(("bench/", "benchmarks/")):
            _check_bench_script(words[1], words[2:], where, monkeypatch)
            kinds.append("bench script")
        elif words[0] in PYTHONS and words[1:2] == ["-c"]:
            out = io.StringIO()
            monkeypatch.chdir(ROOT)
            with contextlib.redirect_stdout(out):
                exec(compile(words[2], where, "exec"), {})  # the snippet only reads a repo file
            stdin = out.getvalue()
            kinds.append("python3 -c")
        elif words[0] == "ray":
            kinds.append(_check_ray(words[1:], where))
        elif words[0] == "curl":
            kinds.append(_check_curl(words, stdin, where))
        elif words[0] == "prometheus":
            source = (ROOT / INTEGRATION["prometheus"][0]).read_text()
            for word in words[1:]:
                flag, _, value = word.partition("=")
                assert flag.startswith("--") and f'"{flag}=' in source, (
                    f"{where}: {flag} is not what {INTEGRATION['prometheus'][0]} runs prometheus with")
                if flag == "--config.file":
                    assert (ROOT / value).is_file(), f"{where}: no {value}"
            kinds.append("prometheus")
        elif words[0] == "grafana-server":
            kinds.append("grafana-server")
        elif words[0] == "cp":
            assert (ROOT / words[1]).is_file(), f"{where}: cp: no {words[1]}"
            kinds.append("cp")
        elif words[0] == "export":
            name = words[1].split("=", 1)[0]
            if name.startswith("RAY_"):
                assert name in _ray_dashboard_source(), f"{where}: Ray's dashboard reads no {name}"
            kinds.append("export")
        else:
            pytest.fail(f"{where}: no check for the program {words[0]!r}: add one "
                        f"(and its integration test) to {Path(__file__).name}")
    return kinds


# ---------------------------------------------------------------------------- the tests

def test_readme_is_at_most_150_lines():
    n = len(_text("README.md").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; move detail to docs/operations.md"


def test_readme_links_operations_and_scheduling():
    links = {target for _, target in _links(_text("README.md"))}
    for doc in ("docs/operations.md", "docs/scheduling.md"):
        assert doc in links, f"README.md does not link {doc}"


def _links(text: str) -> list[tuple[int, str]]:
    prose = _prose(text)
    return [(prose.count("\n", 0, m.start()) + 1, m.group(1))
            for m in re.finditer(r"\]\(([^)\s]+)\)", prose)]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


@pytest.mark.parametrize("name", FILES)
def test_relative_links_point_at_files_that_exist(name):
    text, base = _text(name), (ROOT / name).parent
    anchors = {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", _prose(text), re.M)}
    bad = []
    for line, target in _links(text):
        if re.match(r"^[a-z]+:", target):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        if not path:
            if anchor not in anchors:
                bad.append(f"{name}:{line}: #{anchor} is no heading here")
        elif not (base / path).exists():
            bad.append(f"{name}:{line}: {target} does not exist")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name", FILES)
def test_fenced_blocks_are_labelled(name):
    bad = [f"{name}:{first}: ```{lang}" for lang, first, _ in _fenced_blocks(_text(name))
           if lang not in FENCE_LANGUAGES]
    assert not bad, f"label every fenced block with one of {sorted(FENCE_LANGUAGES)}:\n" + "\n".join(bad)


COMMANDS = _commands()


@pytest.mark.parametrize("where,line", COMMANDS, ids=[f"{w} {l[:60]}" for w, l in COMMANDS])
def test_command(where, line, monkeypatch, tmp_path):
    for kind in _check_line(line, where, monkeypatch, tmp_path):
        assert kind in {"pdserve", "make", "bench script", "python3 -c"} | set(INTEGRATION) | UNRUN, (
            f"{where}: a {kind!r} command that no test runs: map it in INTEGRATION or UNRUN")


def test_both_files_have_commands_of_each_checked_kind():
    """The extraction itself works: it finds the commands these files are known to hold."""
    lines = [line for _, line in COMMANDS]
    for needle in ("pdserve launch", "pdserve generate", "pdserve status", "pdserve shutdown",
                   "pdserve top", "make demo", "make test", "ray start", "prometheus ", "curl "):
        assert any(needle in line for line in lines), needle


@pytest.mark.parametrize("kind", sorted(INTEGRATION))
def test_integration_tests_named_for_other_commands_exist(kind):
    path, marker = INTEGRATION[kind]
    assert (ROOT / path).is_file(), f"{kind}: {path} is gone; update INTEGRATION and the docstring"
    assert marker in (ROOT / path).read_text(), f"{kind}: {path} no longer has {marker!r}"
    assert marker.removeprefix("def ") in __doc__, (
        f"{kind}: the docstring's list does not name {marker}")


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    found = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _option_strings(sub)
    return found


@pytest.fixture(scope="module")
def known_flags() -> set[str]:
    """Every option of every pdserve subcommand, of the benchmark scripts the files name, and of
    ``ray start``."""
    from pdserve.cli import main as cli

    flags: set[str] = set()
    original = argparse.ArgumentParser.parse_args

    def record(self, args=None, namespace=None):
        flags.update(_option_strings(self))
        raise _Parsed(self, argparse.Namespace())

    scripts = sorted({m.groups() for name in FILES for m in BENCH_SCRIPT.finditer(_text(name))})
    calls = [lambda c=c: cli.main([c, "--help"]) for c in cli.COMMANDS]
    for folder, script in scripts:
        main, takes_argv = _bench_main(folder, script)
        calls.append((lambda m=main: m(["--help"])) if takes_argv else main)
    argparse.ArgumentParser.parse_args = record
    try:
        for call in calls:
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    call()
            except _Parsed:
                pass
    finally:
        argparse.ArgumentParser.parse_args = original
    from ray.scripts.scripts import cli as ray_cli

    for param in ray_cli.commands["start"].params:
        flags.update(o for o in param.opts if o.startswith("--"))
    return flags


@pytest.mark.parametrize("name", FILES)
def test_inline_flags_are_real_options(name, known_flags):
    bad = []
    for line, span in _inline_spans(_text(name)):
        if not span.startswith("--"):
            continue
        for word in span.split():
            for flag in word.split("/"):
                flag = flag.split("=", 1)[0]
                if flag.startswith("--") and flag not in known_flags:
                    bad.append(f"{name}:{line}: {flag} (in `{span}`)")
    assert not bad, "options no parser knows:\n" + "\n".join(bad)


@pytest.mark.parametrize("where,body", _blocks("yaml"), ids=[w for w, _ in _blocks("yaml")])
def test_yaml_blocks_are_launch_config_files(where, body, monkeypatch, tmp_path):
    from pdserve.cli.main import add_launch_arguments, launch_config_from_args
    from pdserve.workers.config import EngineConfig

    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)
    path = tmp_path / "cluster.yaml"
    path.write_text("\n".join(body) + "\n")
    parser = argparse.ArgumentParser()
    add_launch_arguments(parser)
    try:
        cfg = launch_config_from_args(parser.parse_args(["--config", str(path)]))
        for role in (cfg.context_engine, cfg.generation_engine):
            EngineConfig.from_kwargs({**cfg.engine, **role})
    except (ValueError, TypeError) as exc:
        pytest.fail(f"{where}: `pdserve launch --config` refuses this file: {exc}")


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == name]


@pytest.mark.parametrize("where,body", _blocks("python"), ids=[w for w, _ in _blocks("python")])
def test_python_blocks(where, body):
    source = "\n".join(body)
    tree = ast.parse(source, where)
    if "from pdserve import LLM" in source:
        from pdserve.workers.config import EngineConfig
        from pdserve.workers.runner.sampling import SamplingParams

        (llm,) = _calls(tree, "LLM")
        EngineConfig.from_kwargs({k.arg: ast.literal_eval(k.value) for k in llm.keywords})
        for call in _calls(tree, "SamplingParams"):
            SamplingParams(**{k.arg: ast.literal_eval(k.value) for k in call.keywords})
    elif "from openai import OpenAI" in source:
        import openai  # a test extra

        params = set(inspect.signature(openai.OpenAI.__init__).parameters)
        for call in _calls(tree, "OpenAI"):
            unknown = {k.arg for k in call.keywords} - params
            assert not unknown, f"{where}: OpenAI() takes no {sorted(unknown)}"
    else:
        pytest.fail(f"{where}: a Python block with no check: add one")


@pytest.mark.parametrize("name", FILES)
def test_inline_client_calls_use_real_keywords(name):
    from pdserve.cluster.client import Client

    params = set(inspect.signature(Client.__init__).parameters)
    for line, span in _inline_spans(_text(name)):
        if span.startswith("pdserve.Client("):
            call = ast.parse(span.split(".generate(")[0]).body[0].value
            unknown = {k.arg for k in call.keywords} - params
            assert not unknown, f"{name}:{line}: Client() takes no {sorted(unknown)}"
