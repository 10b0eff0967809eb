"""The checks before any worker starts (modelpool.supervisor.preflight): each mistake is one
line, at once.

Through the library (the typed error, and how long ``start()`` took) and through the
real CLI (the exit status and every line it printed): a hub id that is not cached while
offline, a model directory without its tokenizer, GPUs this machine does not have, and
the daemon's port in use. A hub model that is cached loads with the workers offline.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from e2e_support import modelpool_command

from fake_nvml import FakeGpu, FakeNvml, NVMLError_LibraryNotFound
from helpers import assert_no_children, slack
from modelpool import DeviceError, ModelLoadFailed, ModelPool, ModelSourceError, PoolConfig
from modelpool.supervisor.gpu import GpuProbe
from modelpool.supervisor.preflight import HUB_OFFLINE_ENV, check_model_source

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes")

HUB_ID = "modelpool-tests/tiny-llama"
# Hosts with a GPU see none: the device cases read the same everywhere.
NO_GPU_ENV = {"CUDA_VISIBLE_DEVICES": ""}
TESTING_DAEMON = ("--backend", "testing", "--model", "none", "--devices", "cpu")


def hf_config(model: str, **overrides: Any) -> PoolConfig:
    values: dict[str, Any] = {"model": model, "backend": "hf", "workers": 2, "devices": ["cpu"]}
    values.update(overrides)
    return PoolConfig(**values)


def start_fails_at_once(pool: ModelPool, error: type[Exception]) -> Exception:
    """``start()`` raises ``error`` before any worker exists, in well under a second."""
    started = time.monotonic()
    with pytest.raises(error) as info:
        pool.start()
    elapsed = time.monotonic() - started
    assert elapsed < slack(0.5), elapsed
    assert pool.stats().counters["respawns"] == 0
    assert not pool.stats().workers
    assert_no_children(timeout=0.5)
    return info.value


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*modelpool_command(), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        check=False,
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The CLI failed with status 1 and printed exactly one line, the ``modelpool:`` one."""
    assert result.returncode == 1, result.stderr
    lines = (result.stdout + result.stderr).splitlines()
    assert len(lines) == 1 and lines[0].startswith("modelpool: "), lines
    return lines[0]


# ---- the model --------------------------------------------------------------------------------


def test_a_directory_without_a_tokenizer_names_what_is_missing(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    partial = tmp_path / "no-tokenizer"
    partial.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tiny_model_dir / name, partial / name)
    error = start_fails_at_once(ModelPool(hf_config(str(partial))), ModelSourceError)
    assert isinstance(error, ModelLoadFailed)  # what the workers would have ended in
    message = str(error)
    assert str(partial) in message and "no tokenizer (tokenizer.json" in message, message
    assert "config.json" not in message and "weights" not in message, message

    line = one_line_error(run_cli("generate", "--model", str(partial), "--devices", "cpu", "hi"))
    assert line.startswith("modelpool: model directory ") and "tokenizer" in line


def test_a_directory_without_config_or_weights_names_both(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{}")
    message = str(start_fails_at_once(ModelPool(hf_config(str(tmp_path))), ModelSourceError))
    assert "has no config.json, no weights (*.safetensors or pytorch_model*.bin)" in message


def test_a_missing_directory_and_a_missing_gguf_file(tiny_model_dir: Path) -> None:
    missing = str(start_fails_at_once(ModelPool(hf_config("./no/such/model")), ModelSourceError))
    assert "model directory './no/such/model' does not exist" in missing
    config = hf_config(str(tiny_model_dir), backend_options={"gguf_file": "model.gguf"})
    error = start_fails_at_once(ModelPool(config), ModelSourceError)
    assert "has no file 'model.gguf'" in str(error)


def test_a_hub_id_not_cached_while_offline_fails_once_without_workers(tmp_path: Path) -> None:
    line = one_line_error(
        run_cli(
            "serve",
            "--model",
            HUB_ID,
            "--port",
            "0",
            env={"HF_HUB_CACHE": str(tmp_path), HUB_OFFLINE_ENV: "1"},
        )
    )
    assert f"hub model '{HUB_ID}' is not in the local cache and HF_HUB_OFFLINE is set" in line
    assert f"hf download {HUB_ID}" in line


def cache_as_hub_model(model_dir: Path, cache: Path) -> None:
    """Lay ``model_dir`` out in a hub cache as huggingface_hub does: HUB_ID at one commit."""
    repo = cache / ("models--" + HUB_ID.replace("/", "--"))
    commit = "0" * 40
    shutil.copytree(model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)


def test_a_cached_hub_model_needs_no_network_in_the_workers(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache_as_hub_model(tiny_model_dir, tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv(HUB_OFFLINE_ENV, "1")
    import huggingface_hub.constants as hub_constants

    # huggingface_hub reads both when it is imported, which may have happened already.
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    assert check_model_source(HUB_ID, "hf", {}) == {HUB_OFFLINE_ENV: "1"}
    assert check_model_source(HUB_ID, "testing", {}) == {}  # another backend's model is its own


@pytest.mark.slow
def test_a_cached_hub_model_is_served_with_the_workers_offline(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The real CLI, a hub id, the workers' own hub client: they load from the cache."""
    cache_as_hub_model(tiny_model_dir, tmp_path)
    result = run_cli(
        "generate",
        "--model",
        HUB_ID,
        "--backend",
        "hf",
        "--devices",
        "cpu",
        "--workers",
        "1",
        "--spares",
        "0",
        "--raw",
        "--max-tokens",
        "3",
        "--json",
        "Hello",
        env={"HF_HUB_CACHE": str(tmp_path), HUB_OFFLINE_ENV: "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert '"completion_tokens": 3' in result.stdout


# ---- devices ----------------------------------------------------------------------------------


def no_driver() -> GpuProbe:
    return GpuProbe(FakeNvml(init_error=NVMLError_LibraryNotFound()))


@pytest.mark.parametrize(
    ("devices", "shown"),
    [(["cuda:0"], "devices: device 'cuda:0'"), ([["cuda:0", "cuda:1"]], "devices: group")],
    ids=["one-gpu", "group"],
)
def test_gpus_on_a_machine_without_a_driver_are_a_value_error(
    devices: list[Any], shown: str
) -> None:
    config = PoolConfig(model="none", backend="testing", workers=1, spares=0, devices=devices)
    error = start_fails_at_once(ModelPool(config, gpu_probe=no_driver()), DeviceError)
    assert isinstance(error, ValueError)
    assert str(error).startswith(shown), error
    assert "no NVIDIA GPU is usable here" in str(error) and 'use "cpu"' in str(error)


def test_gpus_per_worker_without_gpus_is_a_value_error() -> None:
    config = PoolConfig(model="none", backend="testing", workers=1, spares=0, gpus_per_worker=2)
    error = start_fails_at_once(ModelPool(config, gpu_probe=no_driver()), DeviceError)
    assert str(error).startswith("gpus_per_worker: no GPU visible"), error


@pytest.mark.skipif(
    not importlib.metadata.version("torch").endswith("+cpu"),
    reason="needs the CPU-only build of torch",
)
def test_a_gpu_for_the_cpu_build_of_torch_is_refused(tiny_model_dir: Path) -> None:
    probe = GpuProbe(FakeNvml([FakeGpu(name="GPU Zero", uuid="GPU-aaaa1111")]))
    config = hf_config(str(tiny_model_dir), workers=1, spares=0, devices=["cuda:0"])
    error = start_fails_at_once(ModelPool(config, gpu_probe=probe), DeviceError)
    assert "is the CPU-only build" in str(error), error


@pytest.mark.parametrize(
    ("args", "shown"),
    [
        (("--devices", "cuda:0"), "modelpool: devices: device 'cuda:0' does not exist"),
        (("--set", "gpus_per_worker=2"), "modelpool: gpus_per_worker: "),
    ],
    ids=["cuda", "gpus_per_worker"],
)
def test_the_cli_says_device_errors_in_one_line(args: tuple[str, ...], shown: str) -> None:
    result = run_cli("serve", "--port", "0", *args, env=NO_GPU_ENV)
    assert one_line_error(result).startswith(shown)


# ---- the daemon's port ------------------------------------------------------------------------


def test_a_port_in_use_is_said_before_any_worker_starts() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        started = time.monotonic()
        result = run_cli("serve", "--port", str(port), *TESTING_DAEMON, "--workers", "1")
        elapsed = time.monotonic() - started
    line = one_line_error(result)
    assert line == (
        f"modelpool: cannot listen on 127.0.0.1:{port}: Address already in use: "
        "stop what uses it, or choose another with --port"
    )
    # The interpreter and the server's imports; no pool was started.
    assert elapsed < slack(2.0), elapsed
