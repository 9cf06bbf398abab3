"""The `pdflow` command line, run as a real subprocess: help, version, validate, and bad files that
`validate` and `run` both refuse with status 2 before anything starts. No model is loaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdflow import __version__
from pdflow.testing.server import topology_text

REPO = Path(__file__).parents[1]
DEFAULT = REPO / "topology.toml"


def pdflow(*args: str, cache: Path | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if cache is not None:
        env["PDFLOW_CACHE_DIR"] = str(cache)
    return subprocess.run(
        [sys.executable, "-m", "pdflow.cli", *args],
        capture_output=True, text=True, timeout=120, cwd=cwd, env=env,
    )


def test_help_lists_the_commands() -> None:
    result = pdflow("--help")
    assert result.returncode == 0, result.stderr
    for command in ("run", "validate", "models"):
        assert f"    {command} " in result.stdout, command
    assert "--version" in result.stdout
    assert "pdflow validate topology.toml" in result.stdout  # the examples


def test_a_command_builds_only_its_own_arguments_and_the_help_is_the_same() -> None:
    code = ("import sys; from pdflow import cli; parser = cli._parser('validate'); parser.parse_args(['validate']); "
            "print(sorted(m for m in sys.modules if m.startswith(('pdflow.bench', 'pdflow.plan', 'pdflow.simulate'))), "
            "parser.format_help() == cli._parser().format_help())")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[] True", result.stderr
    for command in ("bench", "plan", "simulate", "profile", "trace"):  # each still has its whole tree
        result = pdflow(command, "--help")
        assert result.returncode == 0 and "options:" in result.stdout and len(result.stdout.splitlines()) > 5, command


def test_no_command_is_a_usage_error() -> None:
    result = pdflow()
    assert result.returncode == 2
    assert "usage: pdflow" in result.stderr and "COMMAND" in result.stderr


def test_run_help() -> None:
    result = pdflow("run", "--help")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("usage: pdflow run")
    for text in ("topology", "--log-format", "console", "json", "--log-level", "debug", "info",
                 "warning", "error", "SIGINT"):
        assert text in out, text


def test_validate_help() -> None:
    result = pdflow("validate", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: pdflow validate")
    assert "topology" in result.stdout and "status 2" in result.stdout


def test_models_help() -> None:
    result = pdflow("models", "--help")
    assert result.returncode == 0, result.stderr
    assert "pull" in result.stdout and "list" in result.stdout and "PDFLOW_CACHE_DIR" in result.stdout
    result = pdflow("models", "pull", "--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: pdflow models pull")
    for text in ("name", "--force", "--quiet", "pdflow models list"):
        assert text in result.stdout, text


def test_version() -> None:
    result = pdflow("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"pdflow {__version__}"


def test_console_script_is_installed() -> None:
    script = Path(sys.executable).parent / "pdflow"
    if not script.exists():
        pytest.skip(f"no console script next to {sys.executable} (pdflow is not installed in this environment)")
    result = subprocess.run([str(script), "--version"], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout.strip()) == (0, f"pdflow {__version__}")


def test_validate_imports_no_stage_kind_the_pipeline_wires_itself(tmp_path: Path) -> None:
    """Built-in stages wired as the pipeline wires them, an egress stage's tokens included, are
    checked without importing their classes (and torch: about 2.5 s of a validate), and so are the
    stores and prefills a multi-host pipeline pairs on each host, KV codecs and a speculative
    proposer (built to check their options); a stage whose outputs are wired otherwise is
    imported, to check them against its class."""
    egress = tmp_path / "egress.toml"
    egress.write_text("[stages.egress]\n")
    colocated = tmp_path / "colocated.toml"
    colocated.write_text('[engine]\nmode = "colocated"\n\n[stages.egress]\n')
    rewired = tmp_path / "rewired.toml"
    rewired.write_text('[stages.egress]\n\n[stages.decode.outputs]\ntokens = "ingress"\n')
    code = ("import sys; from pdflow import cli\n"
            "for path in sys.argv[1:]:\n"
            "    try:\n        cli.main(['validate', path])\n"
            "    except SystemExit as exc:\n        print('exit', exc.code)\n"
            "    print('torch' in sys.modules)\n")
    hosts = REPO / "topologies" / "multi-host.toml"
    codecs = tmp_path / "codecs.toml"  # int8 on every link, and head-prune (with its calibration) into decode
    codecs.write_text(topology_text(20000, codec="int8", decode_codec="head-prune",
                                    decode_codec_options={"pruned": "0.2/4.1/7.0/12.1/25.0"}))
    speculative = tmp_path / "speculative.toml"  # a proposer built to check its options
    speculative.write_text('[speculative]\nmethod = "ngram"\nnum_tokens = 4\n')
    paths = [str(path) for path in (egress, colocated, hosts, codecs, speculative, rewired)]
    result = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    imported = [line for line in result.stdout.splitlines() if line in ("True", "False")]
    assert imported == ["False", "False", "False", "False", "False", "True"], (result.stdout, result.stderr)
    assert "exit" not in result.stdout, result.stderr  # all six valid


def test_validate_the_default_topology() -> None:
    if (os.cpu_count() or 1) < 2:
        pytest.skip("the default topology pins decode to core 1, which this machine does not have")
    result = pdflow("validate", str(DEFAULT))
    assert result.returncode == 0, result.stderr
    assert f"{DEFAULT}: valid" in result.stdout
    for text in ("model: smollm2", "kv-shuttle", "data :5640", "link prefill -> kv_shuttle: tcp",
                 "link kv_shuttle -> decode: tcp"):
        assert text in result.stdout, text


def test_validate_says_how_kv_in_device_memory_meets_each_link(tmp_path: Path) -> None:
    """Prefill and decode on a GPU, every link over tcp (host memory only): each side is staged,
    and validate says how; on the CPU there is nothing to say."""
    text = DEFAULT.read_text().replace('cores = [0]\ndevice = "cpu"', 'cores = []\ndevice = "cuda:0"')
    (tmp_path / "gpu.toml").write_text(text.replace('cores = [1]\ndevice = "cpu"', 'cores = []\ndevice = "cuda:0"'))
    result = pdflow("validate", str(tmp_path / "gpu.toml"))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    at = lines.index("  link prefill -> kv_shuttle: tcp")
    assert lines[at + 1].startswith("    prefill on cuda:0: staged: copied to host through a bounded pool of pinned")
    assert lines[at + 2].startswith("  link")  # kv-shuttle's store is in host memory: nothing staged there
    at = lines.index("  link kv_shuttle -> decode: tcp")
    assert lines[at + 1] == ("    decode on cuda:0: staged: landed in host memory by tcp, then copied to cuda:0 off "
                             "the event loop")
    if (os.cpu_count() or 1) >= 2:
        assert "staged" not in pdflow("validate", str(DEFAULT)).stdout


def test_validate_a_relative_path(tmp_path: Path) -> None:
    (tmp_path / "small.toml").write_text("[server]\nport = 8123\n")
    result = pdflow("validate", "small.toml", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"{tmp_path / 'small.toml'}: valid" in result.stdout  # reported as an absolute path


# (file name, text, line, key, part of the message)
BAD_FILES = [
    ("unknown_key.toml", '[limits]\nmax_batch = 4\nmax_bacth = 8\n', 3, "limits.max_bacth",
     "unknown key 'max_bacth'; did you mean 'max_batch'?"),
    ("wrong_type.toml", '[server]\nhost = "127.0.0.1"\nport = "8000"\n', 3, "server.port",
     'expected an integer, got string "8000"'),
    ("wrong_type_nested.toml", '[stages.decode]\nreplicas = 1\ncores = "1"\n', 3, "stages.decode.cores",
     "expected an array"),
    ("port_clash.toml", "# egress on decode's port\n[stages.egress]\nport = 5540\n", 3, "stages.egress.port",
     "port 5540 is also used by stages.decode.port"),
    ("unknown_transport.toml",
     '[[links]]\nsrc = "prefill"\ndst = "kv_shuttle"\ntransport = "carrier-pigeon"\n', 4,
     "links[0].transport", "carrier-pigeon"),
    ("syntax.toml", "[model]\nsource = smollm2\n", 2, "model.source", "invalid TOML"),
]


@pytest.mark.parametrize(("name", "text", "line", "key", "message"), BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_validate_a_bad_file(tmp_path: Path, name: str, text: str, line: int, key: str, message: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    result = pdflow("validate", str(path))
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert f"{path}:{line}: {key}: " in result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert "valid" not in result.stdout


def test_run_refuses_a_bad_file_before_starting_anything(tmp_path: Path) -> None:
    path = tmp_path / "port_clash.toml"
    path.write_text("[stages.egress]\nport = 5540\n")
    cache = tmp_path / "cache"
    result = pdflow("run", str(path), "--log-level", "debug", cache=cache)
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert f"{path}:2: stages.egress.port: " in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    assert not cache.exists() or not any(cache.iterdir()), "run went on to pull the model"
    # exactly what validate says
    assert pdflow("validate", str(path)).stderr == result.stderr


@pytest.mark.parametrize("command", ["validate", "run"])
def test_missing_file(tmp_path: Path, command: str) -> None:
    path = tmp_path / "nowhere" / "topology.toml"
    result = pdflow(command, str(path), cache=tmp_path / "cache")
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert str(path) in result.stderr
    assert "cannot read the topology file" in result.stderr and "No such file" in result.stderr
    assert "Traceback" not in result.stderr


def test_keys_new_writes_a_secret_only_its_owner_reads_and_never_overwrites(tmp_path: Path) -> None:
    from pdflow.config.pipeline import SecurityConfig
    from pdflow.security.keys import SECRET_BYTES, SecretError, load_pipeline_secret

    key = tmp_path / "pipeline.key"
    result = pdflow("keys", "new", str(key))
    assert result.returncode == 0, result.stderr
    assert (key.stat().st_mode & 0o777) == 0o600 and "secret_file" in result.stdout
    secret = load_pipeline_secret(SecurityConfig(secret_file=key))
    assert len(secret) == SECRET_BYTES and secret.hex() not in result.stdout + result.stderr
    again = pdflow("keys", "new", str(key))
    assert again.returncode == 1 and "exists" in again.stderr
    assert load_pipeline_secret(SecurityConfig(secret_file=key)) == secret
    key.chmod(0o644)
    with pytest.raises(SecretError, match="chmod 600"):
        load_pipeline_secret(SecurityConfig(secret_file=key))
    key.write_text("abcd")
    key.chmod(0o600)
    with pytest.raises(SecretError, match="the secret has 2 bytes; at least 32 are needed"):
        load_pipeline_secret(SecurityConfig(secret_file=key))
    assert load_pipeline_secret(SecurityConfig()) != load_pipeline_secret(SecurityConfig())  # fresh each run


def test_run_refuses_a_topology_whose_secret_cannot_be_read(tmp_path: Path) -> None:
    topology = tmp_path / "topology.toml"
    topology.write_text('[security]\nsecret_env = "PDFLOW_NO_SUCH_SECRET"\n')
    result = pdflow("run", str(topology))
    assert result.returncode == 1
    assert "PDFLOW_NO_SUCH_SECRET is not set" in result.stderr


# --- topology overrides: `pdflow run [TOPOLOGY] --model --port --bind ... --set` ----------------

def _loaded(*argv: str):
    from pdflow import cli

    args = cli._parser().parse_args(["run", *argv])
    return cli._load(args), args


def test_flags_override_the_topology_and_validate_shows_them() -> None:
    result = pdflow("validate", "topology.toml", "--port", "8001", "--bind", "0.0.0.0", "--served-model-name", "mine",
                    "--max-model-len", "2048", "--set", "stages.decode.replicas=2", "--set", "limits.max_batch=3")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "served as 'mine'" in out and "context 2048 tokens at most" in out
    assert "HTTP API: http://0.0.0.0:8001" in out and "decode      x2" in out


def test_flags_without_a_topology_change_the_defaults() -> None:
    topology, _ = _loaded("--port", "8123", "--set", 'router.policy="round_robin"')
    assert topology.server.port == 8123 and topology.router.policy == "round_robin"
    assert topology.stages.keys() >= {"ingress", "prefill", "kv_shuttle", "decode"}
    assert topology.model.context(8192) == 8192 and _loaded("--max-model-len", "100")[0].model.context(8192) == 100


@pytest.mark.parametrize("argv,fragment", [
    (("--port", "abc"), "(defaults): server.port: expected an integer, got string \"abc\" (given by --port abc)"),
    (("--set", "server.port=70000"), "server.port: expected an integer >= 1 and <= 65535, got 70000 "
                                     "(given by --set server.port=70000)"),
    (("--set", "nonsense"), "--set nonsense: expected KEY.PATH=VALUE"),
    (("--set", "server.port.x=1"), 'server.port: expected an integer, got table {"x": 1} (given by --set server.port.x=1)'),
    (("topology.toml", "--set", "server.port.x=1"), "--set server.port.x=1: server.port is not a table"),
    (("--set", "model.colour=1"), "model.colour"),
    (("--max-model-len", "0"), "model.max_model_len: expected an integer >= 1"),
    (("--model", "./no/such/model"), "does not exist (given by --model ./no/such/model)"),
])
def test_a_bad_override_names_its_flag(argv: tuple[str, ...], fragment: str, capsys) -> None:
    with pytest.raises(SystemExit) as info:
        _loaded(*argv)
    assert info.value.code == 2
    assert fragment in capsys.readouterr().err


def test_host_is_the_bind_address_and_a_host_name_is_still_the_node(capsys) -> None:
    topology, args = _loaded("--host", "0.0.0.0")
    assert topology.server.host == "0.0.0.0" and args.node is None
    hosts = str(REPO / "topologies" / "multi-host.toml")
    name = next(iter(_loaded(hosts)[0].hosts))
    topology, args = _loaded(hosts, "--host", name)
    assert args.node == name and args.host is None and topology.server.host != name
    assert f"use --node {name}" in capsys.readouterr().err
