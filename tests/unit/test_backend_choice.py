"""``backend = "auto"``: llama_cpp for a GGUF model on the CPU when llama-cpp-python is
installed and the options are its own, hf otherwise; each choice gives its reason."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from modelpool import ModelPool, PoolConfig
from modelpool.shared.errors import InvalidRequest, PreflightError
from modelpool.supervisor.backend_choice import (
    choose_backend,
    installed_llama_cpp,
    is_gguf_model,
    with_backend_chosen,
)

EMBEDDED = "embedded:smollm2-135m-instruct"


def test_a_gguf_model_on_the_cpu_with_llama_cpp_installed_runs_on_llama_cpp() -> None:
    choice = choose_backend(EMBEDDED, {}, ["cpu", "cpu"], llama_cpp_version="0.3.36")
    assert choice.backend == "llama_cpp"
    assert "llama-cpp-python 0.3.36 is installed" in choice.reason
    # llama_cpp's own options keep it there.
    assert choose_backend(EMBEDDED, {"threads": 2}, ["cpu"], llama_cpp_version="1").backend == (
        "llama_cpp"
    )


@pytest.mark.parametrize(
    ("model", "options", "devices", "version", "reason"),
    [
        (EMBEDDED, {}, ["cpu"], None, "llama-cpp-python is not installed"),
        (EMBEDDED, {}, ["cuda:0", "cpu"], "0.3.36", "on cuda:0"),
        (EMBEDDED, {}, ["cuda:0,cuda:1"], "0.3.36", "on cuda:0, cuda:1"),
        (EMBEDDED, {"dtype": "bfloat16"}, ["cpu"], "0.3.36", "backend_options dtype"),
        ("HuggingFaceTB/SmolLM2-135M-Instruct", {}, ["cpu"], "0.3.36", "not a GGUF model"),
    ],
)
def test_anything_else_runs_on_hf_and_says_why(
    model: str, options: dict[str, object], devices: list[str], version: str | None, reason: str
) -> None:
    choice = choose_backend(model, options, devices, llama_cpp_version=version)
    assert choice.backend == "hf"
    assert reason in choice.reason


def test_what_counts_as_a_gguf_model(tmp_path: Path) -> None:
    assert is_gguf_model(EMBEDDED, {})
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    assert is_gguf_model(str(gguf), {})
    assert is_gguf_model(str(tmp_path), {})  # a directory with a GGUF file and no config
    assert is_gguf_model(str(tmp_path), {"gguf_file": "m.gguf"})
    assert not is_gguf_model(str(tmp_path), {"gguf_file": "other.gguf"})
    (tmp_path / "config.json").write_text("{}")
    assert not is_gguf_model(str(tmp_path), {})  # a transformers directory (that has one too)
    assert not is_gguf_model(str(tmp_path / "config.json"), {})
    assert not is_gguf_model("owner/name", {})


def test_installed_llama_cpp_is_found_without_importing_it() -> None:
    import sys

    was_imported = "llama_cpp" in sys.modules
    version = installed_llama_cpp()
    assert ("llama_cpp" in sys.modules) == was_imported
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        assert version is None
    else:
        assert isinstance(version, str)


def test_the_pool_resolves_auto_fills_the_embedded_hf_options_and_keeps_the_reason() -> None:
    config = PoolConfig(model=EMBEDDED, backend_options={"dtype": "bfloat16"})
    resolved, reason = with_backend_chosen(config, ["cpu"])
    assert resolved.backend == "hf"
    assert resolved.backend_options == {"dtype": "bfloat16"}
    assert reason.startswith("auto: ")
    on_gpu, _ = with_backend_chosen(PoolConfig(model=EMBEDDED), ["cuda:0"])
    assert (on_gpu.backend, on_gpu.backend_options) == ("hf", {"dtype": "float32"})
    configured, why = with_backend_chosen(PoolConfig(model="m", backend="testing"), ["cpu"])
    assert configured.backend == "testing"
    assert why == "configured: backend = 'testing'"


def test_stats_say_auto_until_start_chose() -> None:
    stats = ModelPool(PoolConfig(model=EMBEDDED)).stats()
    assert stats.backend == "auto"
    assert stats.backend_reason is None
    assert stats.to_dict()["backend"] == "auto"


@pytest.mark.parametrize("backend", ["auto", "hf", "llama_cpp"])
def test_every_built_in_backend_refuses_an_unknown_parameter_before_dispatch(
    backend: str,
) -> None:
    pool = ModelPool(PoolConfig(model=EMBEDDED, backend=backend))
    with pytest.raises(InvalidRequest, match="max_tokens"):
        pool.submit("Hello", max_tokens=3)  # an OpenAI name, not a modelpool one


def test_start_logs_the_choice_once_the_checks_passed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = str(tmp_path / "nowhere")
    with caplog.at_level(logging.INFO, logger="modelpool.supervisor.pool"):
        with pytest.raises(PreflightError):
            ModelPool(PoolConfig(model=missing, devices=("cpu",))).start()
        assert not [m for m in caplog.messages if m.startswith("serving")]
        pool = ModelPool(
            PoolConfig(model="none", backend="testing", workers=1, devices=("cpu",))
        ).start()
        pool.close()
    assert pool.stats().backend_reason == "configured: backend = 'testing'"
