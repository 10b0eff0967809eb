"""The command's configuration layers: built-in < file < environment < flag, and their report."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import modelpool
from modelpool import PoolConfig, ServerConfig
from modelpool.cli import main
from modelpool.shared.config import (
    DEFAULT_MODEL,
    ConfigError,
    layered_config,
    parse_assignment,
)

REPO = Path(__file__).resolve().parents[2]
# A child interpreter imports the modelpool this test imported, wherever it runs from.
CHILD_ENV = {**os.environ, "PYTHONPATH": str(Path(modelpool.__file__).resolve().parents[1])}


def write(tmp_path: Path, text: str, name: str = "my.toml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# ---- built-ins -------------------------------------------------------------------------------


def test_no_file_serves_the_embedded_model_on_loopback_8000() -> None:
    effective = layered_config()
    assert effective.config_path is None
    # backend "auto": start() picks hf (and then float32) or llama_cpp (backend_choice).
    assert effective.pool == PoolConfig(model=DEFAULT_MODEL)
    assert effective.pool.backend == "auto"
    assert effective.server == ServerConfig()
    assert (effective.server.host, effective.server.port) == ("127.0.0.1", 8000)
    assert effective.server.api_key_env == "MODELPOOL_API_KEY"
    assert set(effective.sources.values()) == {"built-in"}


def test_the_shipped_default_toml_says_nothing_the_built_ins_do_not() -> None:
    path = REPO / "configs" / "default.toml"
    from_file = layered_config(path)
    built_in = layered_config()
    assert from_file.pool == built_in.pool
    assert from_file.server == built_in.server
    assert from_file.config_path == path.resolve()
    # Every value the file sets is the built-in one, key by key.
    flat_built_in = {**built_in.values(), **built_in.values()["server"]}
    data = tomllib.loads(path.read_text())
    for key, value in data.items():
        if isinstance(value, dict):
            for inner, item in value.items():
                assert built_in.values()[key][inner] == item, f"{key}.{inner}"
        else:
            assert flat_built_in[key] == value, key


def test_the_embedded_float32_is_only_for_the_embedded_model_on_hf(tmp_path: Path) -> None:
    assert layered_config(flags={"backend": "hf"}).pool.backend_options == {"dtype": "float32"}
    assert layered_config(flags={"backend": "hf"}).sources["backend_options.dtype"] == "built-in"
    assert layered_config(flags={"backend": "testing"}).pool.backend_options == {}
    assert layered_config().pool.backend_options == {}
    assert layered_config(flags={"model": "./mine"}).pool.backend_options == {}
    path = write(tmp_path, '[backend_options]\ndtype = "bfloat16"\n')
    chosen = layered_config(path)
    assert chosen.pool.backend_options == {"dtype": "bfloat16"}
    assert chosen.sources["backend_options.dtype"] == "file"


# ---- layering and sources --------------------------------------------------------------------


def test_each_layer_overrides_the_one_before_and_is_named_as_the_source(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        model = "./from-file"
        workers = 3
        spares = 1
        deadline_s = 9.0
        [retry]
        max_retries = 0
        [generation_defaults]
        temperature = 0.0
        [server]
        port = 9100
        host = "127.0.0.2"
        """,
    )
    effective = layered_config(
        path,
        environ={"MODELPOOL_WORKERS": "4", "MODELPOOL_PORT": "9200", "MODELPOOL_DEVICES": "cpu"},
        flags={"workers": 5, "server.host": "127.0.0.3", "spares": None},
    )
    pool, server = effective.pool, effective.server
    assert (pool.model, pool.workers, pool.spares, pool.deadline_s) == ("./from-file", 5, 1, 9.0)
    assert pool.devices == ("cpu",)
    assert pool.retry.max_retries == 0
    assert pool.retry.on == ("timeout", "crash")  # a table merges key by key
    assert pool.generation_defaults == {"temperature": 0.0}
    assert (server.host, server.port) == ("127.0.0.3", 9200)
    sources = effective.sources
    assert sources["model"] == "file"
    assert sources["workers"] == "flag"
    assert sources["spares"] == "file"  # a flag left unset does not count
    assert sources["devices"] == "environment"
    assert sources["server.port"] == "environment"
    assert sources["server.host"] == "flag"
    assert sources["retry.max_retries"] == "file"
    assert sources["retry.on"] == "built-in"
    assert sources["backend"] == "built-in"
    assert effective.origins["server.port"] == "environment MODELPOOL_PORT"
    assert effective.origins["model"] == f"file {path.resolve()}"


def test_modelpool_config_names_the_file_to_read(tmp_path: Path) -> None:
    path = write(tmp_path, "workers = 7\n")
    effective = layered_config(environ={"MODELPOOL_CONFIG": str(path)})
    assert effective.pool.workers == 7
    assert effective.config_path == path.resolve()
    other = write(tmp_path, "workers = 6\n", "other.toml")
    assert layered_config(other, environ={"MODELPOOL_CONFIG": str(path)}).pool.workers == 6


def test_a_named_file_that_is_missing_is_an_error_that_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    with pytest.raises(ConfigError, match=r"config file not found: .*nope\.toml.*--config"):
        layered_config(missing)
    with pytest.raises(ConfigError, match=r"not found: .*nope\.toml.*MODELPOOL_CONFIG"):
        layered_config(environ={"MODELPOOL_CONFIG": str(missing)})
    with pytest.raises(ConfigError, match="is a directory"):
        layered_config(tmp_path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("wrokers = 2\n", r"my\.toml: unknown key 'wrokers'"),
        ("workers = 0\n", r"my\.toml: workers must be >= 1"),
        ("[server]\nport = 70000\n", r"my\.toml: server\.port must be <= 65535"),
        ("retry = 3\n", r"my\.toml: retry must be a table"),
        ("workers = \n", r"my\.toml: invalid TOML"),
    ],
)
def test_a_bad_file_is_an_error_naming_the_file_and_key(
    tmp_path: Path, text: str, expected: str
) -> None:
    with pytest.raises(ConfigError, match=expected):
        layered_config(write(tmp_path, text))


def test_bad_environment_and_flags_are_named() -> None:
    with pytest.raises(ConfigError, match="MODELPOOL_WORKERS: cannot read 'many' as workers"):
        layered_config(environ={"MODELPOOL_WORKERS": "many"})
    with pytest.raises(ConfigError, match=r"^environment: server\.port must be"):
        layered_config(environ={"MODELPOOL_PORT": "-1"})
    with pytest.raises(ConfigError, match=r"^command line: workers must be >= 1"):
        layered_config(flags={"workers": 0})
    # An empty variable is not a setting.
    assert layered_config(environ={"MODELPOOL_WORKERS": " "}).sources["workers"] == "built-in"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("workers=4", ("workers", 4)),
        ("deadline_s = 2.5", ("deadline_s", 2.5)),
        ('retry.on=["crash"]', ("retry.on", ["crash"])),
        ("model=./my-model", ("model", "./my-model")),
        ('server.model_name="a b"', ("server.model_name", "a b")),
        ("backend_options.trust_remote_code=true", ("backend_options.trust_remote_code", True)),
    ],
)
def test_set_takes_toml_values_or_plain_strings(text: str, expected: tuple[str, object]) -> None:
    assert parse_assignment(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("workers", "KEY=VALUE"),
        ("=3", "KEY=VALUE"),
        ("retry=3", "is a table"),
        ("workers.x=3", "not a table"),
        ("a.b.c=1", "not a key"),
    ],
)
def test_set_rejects_what_is_not_an_assignment(text: str, expected: str) -> None:
    with pytest.raises(ConfigError, match=expected):
        parse_assignment(text)


# ---- the report ------------------------------------------------------------------------------


def test_to_toml_reads_back_as_the_same_configuration(tmp_path: Path) -> None:
    path = write(tmp_path, 'backend = "testing"\nmodel = "none"\nattempt_timeout_s = 3.0\n')
    effective = layered_config(
        path,
        environ={"MODELPOOL_SPARES": "2"},
        flags={"server.port": 9300, "backend_options.fail_load": "x y", "retry.on": ["crash"]},
    )
    shown = effective.to_toml()
    lines = shown.splitlines()
    assert "workers = 2  # built-in" in lines
    assert f'backend = "testing"  # file {path.resolve()}' in lines
    assert "spares = 2  # environment MODELPOOL_SPARES" in lines
    assert "port = 9300  # flag" in lines
    assert "# stall_timeout_s = (unset)  # built-in" in lines
    again = write(tmp_path, shown, "again.toml")
    reread = layered_config(again)
    assert reread.pool == effective.pool
    assert reread.server == effective.server


# ---- the command -----------------------------------------------------------------------------


def test_version_flag_prints_the_one_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.strip() == f"modelpool {modelpool.__version__}"
    assert importlib.metadata.version("modelpool") == modelpool.__version__


def test_config_show_prints_toml_with_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MODELPOOL_WORKERS", "3")
    path = write(tmp_path, "[server]\nport = 9001\n")
    assert main(["config", "--show", "--config", str(path), "--host", "127.0.0.9"]) == 0
    out = capsys.readouterr().out
    data = tomllib.loads(out)
    assert data["model"] == DEFAULT_MODEL
    assert data["workers"] == 3
    assert data["server"]["port"] == 9001
    assert data["server"]["host"] == "127.0.0.9"
    assert "workers = 3  # environment MODELPOOL_WORKERS" in out
    assert f"port = 9001  # file {path.resolve()}" in out
    assert 'host = "127.0.0.9"  # flag' in out
    assert 'model = "embedded:smollm2-135m-instruct"  # built-in' in out

    assert main(["config", "--json", "--set", "retry.max_retries=0"]) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["config_file"] is None
    assert document["values"]["retry"]["max_retries"] == 0
    assert document["sources"]["retry.max_retries"] == "flag"
    assert document["sources"]["workers"] == "environment"


def test_the_command_reports_a_missing_config_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    for command in (["serve"], ["generate", "hi"], ["config"]):
        assert main([*command, "--config", "missing.toml"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("modelpool: config file not found: missing.toml"), err


# A fresh interpreter in which the named top-level modules cannot be imported: what a
# core install without the server (or embedded) extra looks like.
_WITHOUT = """
import importlib.abc, sys
class Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, Missing())
"""


def _run_without(
    blocked: set[str], code: str, tmp_path: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _WITHOUT.format(blocked=blocked) + code],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        cwd=tmp_path,
        env={**CHILD_ENV, **(env or {})},
    )


SERVER_EXTRA = {"fastapi", "uvicorn", "httptools", "prometheus_client", "httpx", "rich"}
EMBEDDED_EXTRA = {"gguf", "accelerate"}


def test_the_library_imports_without_the_server_extra(tmp_path: Path) -> None:
    result = _run_without(
        SERVER_EXTRA | EMBEDDED_EXTRA,
        "import modelpool\n"
        "from modelpool import ModelPool, PoolConfig, PoolError, ServerConfig\n"
        "import modelpool.cli, modelpool.supervisor.pool, modelpool.supervisor.loop\n"
        "import modelpool.worker.process\n"
        "print(modelpool.__version__)\n",
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == modelpool.__version__


def test_serve_without_the_server_extra_names_it(tmp_path: Path) -> None:
    result = _run_without(
        {"fastapi"},
        "from modelpool.cli import main\n"
        "raise SystemExit(main(['serve', '--backend', 'testing', '--model', 'none']))\n",
        tmp_path,
    )
    assert result.returncode == 1
    assert "pip install 'modelpool[server]'" in result.stderr, result.stderr
    assert "fastapi" in result.stderr


def test_preparing_the_embedded_model_without_its_extra_names_it(tmp_path: Path) -> None:
    # An empty MODELPOOL_HOME: the embedded model is not prepared there yet. On hf: "auto"
    # reads the GGUF file as it is on llama_cpp where llama-cpp-python is installed.
    env = {"MODELPOOL_HOME": str(tmp_path / "home")}
    for argv in (["generate", "--backend", "hf", "hi"], ["prepare-model"]):
        result = _run_without(
            {"gguf"},
            f"from modelpool.cli import main\nraise SystemExit(main({argv!r}))\n",
            tmp_path,
            env,
        )
        assert result.returncode == 1, result.stderr
        assert "pip install 'modelpool[embedded]'" in result.stderr, result.stderr
    assert not (tmp_path / "home" / "models").exists()


def test_python_dash_m_modelpool_is_the_same_command(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "modelpool", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
        env=CHILD_ENV,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"modelpool {modelpool.__version__}"
    usage = subprocess.run(
        [sys.executable, "-m", "modelpool", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=tmp_path,
        env=CHILD_ENV,
    )
    assert usage.returncode == 0
    assert usage.stdout.startswith("usage: modelpool ")
    assert "config" in usage.stdout
