"""The transformers backend, in process, on the tiny random model.

The tiny model's output is gibberish but deterministic, and its byte-level
tokenizer makes it emit characters split across tokens as well as bytes that
never become a character, which is what the streaming checks need.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import FakeCall
from modelpool.shared.errors import InvalidRequest
from modelpool.shared.protocol import Prompt, TokenIds
from modelpool.tinymodel import build_tiny_model
from modelpool.worker.backends.hf.handler import HFHandler, load

# Greedy output of the tiny model for this prompt holds hiragana assembled
# from two tokens each (checked in test_multibyte_characters_are_never_split).
MULTIBYTE_PROMPT = "What is the capital"
PROMPTS = ["Hello", "Le café", "東京", MULTIBYTE_PROMPT, "😀", "x y z"]


@pytest.fixture(scope="module")
def handler(tiny_model_dir: Path) -> HFHandler:
    return load(str(tiny_model_dir))


def run(handler: HFHandler, prompt: Prompt, **params: Any) -> tuple[Any, FakeCall]:
    call = FakeCall(prompt, params)
    return handler.generate(call), call


def test_string_prompt_is_deterministic(handler: HFHandler) -> None:
    first, _ = run(handler, "Hello", max_new_tokens=12)
    second, _ = run(handler, "Hello", max_new_tokens=12)
    assert first.text and first.text == second.text
    assert first.prompt_tokens == len(handler.tokenizer("Hello")["input_ids"])
    assert first.completion_tokens == 12


def test_chat_messages_use_the_template(handler: HFHandler) -> None:
    messages: Prompt = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    generation, call = run(handler, messages, max_new_tokens=8)
    templated = handler.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert templated.endswith("<|assistant|>\n")
    expected = handler.tokenizer(templated, add_special_tokens=False)["input_ids"]
    assert generation.prompt_tokens == len(expected)
    assert "".join(call.chunks) == generation.text


def test_max_new_tokens_ends_with_length(handler: HFHandler) -> None:
    generation, _ = run(handler, "Hello", max_new_tokens=5)
    assert generation.finish_reason == "length"
    assert generation.completion_tokens == 5
    longer, _ = run(handler, "Hello", max_new_tokens=20)
    assert longer.text.startswith(generation.text.rstrip("\ufffd"))


def test_eos_ends_with_stop(handler: HFHandler) -> None:
    """finish_reason is "stop" exactly where transformers' own greedy generate ends in EOS."""
    eos_ids = handler.model.generation_config.eos_token_id
    eos_ids = set(eos_ids if isinstance(eos_ids, list) else [eos_ids])
    reached_eos = 0
    for prompt in PROMPTS:
        generation, _ = run(handler, prompt, max_new_tokens=40)
        input_ids = handler.tokenizer(prompt, return_tensors="pt")["input_ids"]
        output = handler.model.generate(input_ids, max_new_tokens=40, do_sample=False)
        new_tokens = output.shape[1] - input_ids.shape[1]
        if int(output[0, -1]) in eos_ids:
            reached_eos += 1
            assert generation.finish_reason == "stop", prompt
            assert generation.completion_tokens == new_tokens < 40, prompt
        else:
            assert generation.finish_reason == "length", prompt
    assert reached_eos, "no prompt reaches EOS within 40 tokens any more: add one that does"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_streamed_chunks_join_to_the_text(handler: HFHandler, prompt: str) -> None:
    generation, call = run(handler, prompt, max_new_tokens=32)
    assert "".join(call.chunks) == generation.text
    # An incomplete character is held back until the next token settles it;
    # only the final flush may end in one that never completed.
    assert not any(chunk.endswith("\ufffd") for chunk in call.chunks[:-1])


def test_multibyte_characters_are_never_split(handler: HFHandler) -> None:
    generation, call = run(handler, MULTIBYTE_PROMPT, max_new_tokens=24)
    tokenizer = handler.tokenizer
    input_ids = tokenizer(MULTIBYTE_PROMPT, return_tensors="pt")["input_ids"]
    generated = handler.model.generate(input_ids, max_new_tokens=24, do_sample=False)
    pieces = [tokenizer.decode([token]) for token in generated[0, input_ids.shape[1] :].tolist()]
    assembled = [
        char
        for char in generation.text
        if ord(char) > 127 and char != "\ufffd" and not any(char in piece for piece in pieces)
    ]
    assert assembled, "the prompt no longer yields a character split across tokens"
    assert "".join(call.chunks) == generation.text
    for char in assembled:
        assert any(char in chunk for chunk in call.chunks), f"{char!r} was split between chunks"


def test_streaming_matches_sampling_too(handler: HFHandler) -> None:
    first, call = run(handler, "Hello", max_new_tokens=24, temperature=1.0, seed=7)
    second, _ = run(handler, "Hello", max_new_tokens=24, temperature=1.0, seed=7)
    greedy, _ = run(handler, "Hello", max_new_tokens=24)
    assert first.text == second.text != greedy.text
    assert "".join(call.chunks) == first.text


def test_temperature_zero_is_greedy(handler: HFHandler) -> None:
    greedy, _ = run(handler, "Hello", max_new_tokens=16)
    zero, _ = run(handler, "Hello", max_new_tokens=16, temperature=0, top_p=0.5, seed=3)
    assert zero.text == greedy.text


@pytest.mark.parametrize("after", [1, 3])
def test_cancel_stops_within_one_step(handler: HFHandler, after: int) -> None:
    call = FakeCall("Hello", {"max_new_tokens": 60}, cancel_after_chunks=after)
    generation = handler.generate(call)
    assert generation.finish_reason == "cancelled"
    assert len(call.chunks) == after
    assert call.checks_after_cancel == 1
    assert generation.text == "".join(call.chunks)
    assert generation.completion_tokens is not None and generation.completion_tokens < 60


def test_cancelled_before_start_generates_nothing(handler: HFHandler) -> None:
    call = FakeCall("Hello", {"max_new_tokens": 8}, flag=True)
    generation = handler.generate(call)
    assert (generation.text, generation.finish_reason, generation.completion_tokens) == (
        "",
        "cancelled",
        0,
    )
    assert call.chunks == []


def test_handler_stays_usable_after_a_cancel(handler: HFHandler) -> None:
    expected, _ = run(handler, "Hello", max_new_tokens=12)  # before any cancel
    cancelled = handler.generate(FakeCall("Hello", {"max_new_tokens": 30}, cancel_after_chunks=2))
    assert cancelled.finish_reason == "cancelled"
    generation, _ = run(handler, "Hello", max_new_tokens=12)
    assert generation.text == expected.text and generation.finish_reason == "length"
    assert generation.completion_tokens == 12


@pytest.fixture(scope="module")
def baseline(handler: HFHandler) -> tuple[str, list[str]]:
    generation, call = run(handler, "Hello", max_new_tokens=40)
    assert generation.finish_reason == "length"
    return generation.text, call.chunks


def first_seen_at(text: str, start: int, length: int = 3) -> str:
    """A substring of ``text`` whose first occurrence begins at or after ``start``: a stop
    string derived from the model's own output, not hard-coded from one version of it."""
    for index in range(start, len(text) - length + 1):
        candidate = text[index : index + length]
        if text.index(candidate) == index and "\ufffd" not in candidate:
            return candidate
    raise AssertionError(f"no fresh substring after {start} in {text!r}")


def test_stop_string_cuts_the_text(handler: HFHandler, baseline: tuple[str, list[str]]) -> None:
    text, _ = baseline
    stop = first_seen_at(text, len(text) // 2)
    generation, call = run(handler, "Hello", max_new_tokens=40, stop=stop)
    assert generation.finish_reason == "stop"
    assert generation.stop_sequence == stop
    assert generation.text == text[: text.index(stop)]
    assert "".join(call.chunks) == generation.text
    assert generation.completion_tokens is not None and generation.completion_tokens < 40


def test_stop_string_across_chunks(handler: HFHandler, baseline: tuple[str, list[str]]) -> None:
    text, chunks = baseline
    # The last character of one chunk and the first of the next: the stop
    # string is only complete one token after it starts.
    stop = chunks[2][-1] + chunks[3][0]
    generation, call = run(handler, "Hello", max_new_tokens=40, stop=[stop])
    assert generation.text == text[: text.index(stop)]
    assert generation.finish_reason == "stop"
    assert "".join(call.chunks) == generation.text


def test_earliest_of_several_stops_wins(
    handler: HFHandler, baseline: tuple[str, list[str]]
) -> None:
    text, _ = baseline
    early = first_seen_at(text, len(text) // 4)
    late = first_seen_at(text, text.index(early) + len(early) + 1)
    generation, _ = run(handler, "Hello", max_new_tokens=40, stop=[late, early])
    assert generation.text == text[: text.index(early)]
    assert generation.stop_sequence == early


def test_held_back_stop_prefix_is_released(
    handler: HFHandler, baseline: tuple[str, list[str]]
) -> None:
    text, _ = baseline
    # Every occurrence of ``prefix`` in the text could start this stop string, so it is
    # held back from streaming; the string never completes, so all of it must come out.
    prefix = first_seen_at(text, len(text) // 4)
    stop = prefix + "\x00\x01"
    assert stop not in text
    generation, call = run(handler, "Hello", max_new_tokens=40, stop=stop)
    assert generation.text == text
    assert generation.finish_reason == "length"
    assert generation.stop_sequence is None
    assert "".join(call.chunks) == text


def test_top_k_one_samples_the_greedy_choice(handler: HFHandler) -> None:
    greedy, _ = run(handler, "Hello", max_new_tokens=12)
    sampled = {"max_new_tokens": 12, "temperature": 1.5, "seed": 3}
    narrowed, _ = run(handler, "Hello", **sampled, top_k=1)
    assert narrowed.text == greedy.text
    # 0 is off: the whole vocabulary is a candidate again (at this temperature, on a
    # random tiny model, the sample leaves the greedy path).
    unlimited, _ = run(handler, "Hello", **sampled, top_k=0)
    assert unlimited.text != greedy.text


def test_invalid_params_are_refused(handler: HFHandler) -> None:
    with pytest.raises(InvalidRequest, match="max_tokens"):
        handler.generate(FakeCall("Hello", {"max_tokens": 3}))
    with pytest.raises(InvalidRequest, match="max_tokens"):
        handler.validate({"max_tokens": 3})


def test_chat_prompt_without_template_is_refused(handler: HFHandler) -> None:
    template = handler.tokenizer.chat_template
    handler.tokenizer.chat_template = None
    try:
        with pytest.raises(InvalidRequest, match="chat template"):
            handler.generate(FakeCall([{"role": "user", "content": "hi"}]))
    finally:
        handler.tokenizer.chat_template = template


def test_chat_template_option_replaces_the_tokenizers(tiny_model_dir: Path) -> None:
    plain = load(
        str(tiny_model_dir), chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    generation = plain.generate(
        FakeCall([{"role": "user", "content": "Hello"}], {"max_new_tokens": 4})
    )
    assert generation.prompt_tokens == len(
        plain.tokenizer("Hello", add_special_tokens=False)["input_ids"]
    )


def test_empty_prompt_starts_from_bos(handler: HFHandler) -> None:
    generation, _ = run(handler, "", max_new_tokens=3)
    assert generation.prompt_tokens == 1 and generation.completion_tokens == 3


def test_gpt2_architecture(tmp_path: Path) -> None:
    gpt2 = load(str(build_tiny_model(tmp_path / "tiny-gpt2", arch="gpt2")))
    generation, call = run(gpt2, "Le café", max_new_tokens=10)
    assert generation.completion_tokens == 10
    assert "".join(call.chunks) == generation.text


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"bogus": 1}, "bogus"),
        ({"torch_dtype": "float32"}, "torch_dtype"),
        ({"dtype": "float33"}, "dtype"),
        ({"torch_threads": 0}, "torch_threads"),
        ({"trust_remote_code": "yes"}, "trust_remote_code"),
        ({"max_memory": {"gpu0": "1GiB"}}, "max_memory"),
        ({"max_memory": {"0": "lots"}}, "max_memory"),
        ({"max_memory": {"0": 0}}, "max_memory"),
        ({"max_memory": ["1GiB"]}, "max_memory"),
    ],
)
def test_bad_options_raise_value_error(
    tiny_model_dir: Path, options: dict[str, Any], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        load(str(tiny_model_dir), **options)


@pytest.fixture
def threads_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    import torch

    before = torch.get_num_threads()
    yield monkeypatch
    torch.set_num_threads(before)


def test_threads_come_from_the_environment(
    tiny_model_dir: Path, threads_env: pytest.MonkeyPatch
) -> None:
    import torch

    threads_env.setenv("MODELPOOL_TORCH_THREADS", "1")
    load(str(tiny_model_dir), dtype="float32")
    assert torch.get_num_threads() == 1
    threads_env.setenv("MODELPOOL_TORCH_THREADS", "many")
    with pytest.raises(ValueError, match="MODELPOOL_TORCH_THREADS"):
        load(str(tiny_model_dir))


def _reference_logprobs(handler: HFHandler, ids: list[int]) -> list[float]:
    """Each token's logprob given those before it, from one plain forward pass."""
    import torch

    with torch.inference_mode():
        logits = handler.model(input_ids=torch.tensor([ids])).logits[0].float()
    table = torch.log_softmax(logits, dim=-1)
    return [float(table[position - 1, ids[position]]) for position in range(1, len(ids))]


def test_no_logprobs_unless_asked(handler: HFHandler) -> None:
    generation, _ = run(handler, "Hello", max_new_tokens=4)
    assert generation.logprobs is None and generation.prompt_logprobs is None


def test_logprobs_of_generated_tokens(handler: HFHandler) -> None:
    plain, _ = run(handler, "Hello", max_new_tokens=6)
    generation, _ = run(handler, "Hello", max_new_tokens=6, logprobs=3)
    assert generation.text == plain.text  # asking for logprobs changes nothing generated
    entries = generation.logprobs
    assert len(entries) == generation.completion_tokens == 6
    prompt_ids = handler.tokenizer("Hello")["input_ids"]
    reference = _reference_logprobs(handler, prompt_ids + [e.token_id for e in entries])
    for entry, expected in zip(entries, reference[len(prompt_ids) - 1 :], strict=True):
        assert entry.logprob == pytest.approx(expected, abs=1e-4)
        assert len(entry.top) == 3
        # Greedy: the chosen token is the likeliest, and the alternatives are sorted.
        assert entry.top[0][0] == entry.token_id
        alternatives = [lp for _, _, lp in entry.top]
        assert alternatives == sorted(alternatives, reverse=True)
    assert "".join(e.token for e in entries) == generation.text


def test_prompt_logprobs_and_scoring_the_prompt_alone(handler: HFHandler) -> None:
    ids = handler.tokenizer("The capital of France is Paris")["input_ids"]
    generation, call = run(handler, TokenIds(tuple(ids)), max_new_tokens=0, prompt_logprobs=1)
    assert generation.text == "" and call.chunks == []
    assert generation.finish_reason == "length"
    assert generation.prompt_tokens == len(ids) and generation.completion_tokens == 0
    entries = generation.prompt_logprobs
    assert [e.token_id for e in entries] == ids
    assert entries[0].logprob is None and entries[0].top == ()
    reference = _reference_logprobs(handler, ids)
    assert [e.logprob for e in entries[1:]] == pytest.approx(reference, abs=1e-4)


def test_token_id_prompt_equals_its_text(handler: HFHandler) -> None:
    ids = handler.tokenizer("Le café")["input_ids"]
    from_text, _ = run(handler, "Le café", max_new_tokens=8)
    from_ids, _ = run(handler, TokenIds(tuple(ids)), max_new_tokens=8)
    assert from_ids.text == from_text.text


def test_bad_token_ids_and_logprob_counts_are_refused(handler: HFHandler) -> None:
    with pytest.raises(InvalidRequest, match="vocabulary"):
        run(handler, TokenIds((1, 10**9)))
    for params in ({"logprobs": 21}, {"logprobs": -1}, {"max_new_tokens": 0}):
        with pytest.raises(InvalidRequest):
            run(handler, "Hello", **params)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_scoring_the_prompt_leaves_the_generation_unchanged(
    handler: HFHandler, prompt: str
) -> None:
    # The prompt's forward pass hands its cache to generate(): same tokens, same scores.
    plain, _ = run(handler, prompt, max_new_tokens=5, logprobs=1)
    scored, call = run(handler, prompt, max_new_tokens=5, logprobs=1, prompt_logprobs=1)
    assert scored.text == plain.text == "".join(call.chunks)
    assert [e.token_id for e in scored.logprobs] == [e.token_id for e in plain.logprobs]
    assert [e.logprob for e in scored.logprobs] == pytest.approx(
        [e.logprob for e in plain.logprobs], abs=1e-4
    )
    assert len(scored.prompt_logprobs) == scored.prompt_tokens


def test_device_map_and_gguf_file_reach_transformers_or_are_refused_by_name(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded: list[dict[str, Any]] = []
    tokenizers: list[dict[str, Any]] = []
    original_model = AutoModelForCausalLM.from_pretrained
    original_tokenizer = AutoTokenizer.from_pretrained

    def spy_model(model: str, **kwargs: Any) -> Any:
        loaded.append(kwargs)
        return original_model(model, **kwargs)

    def spy_tokenizer(model: str, **kwargs: Any) -> Any:
        tokenizers.append(kwargs)
        return original_tokenizer(model, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy_model)
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", spy_tokenizer)
    handler = load(str(tiny_model_dir), device="cpu", dtype="float32", device_map="cpu")
    assert loaded[-1]["device_map"] == "cpu"
    assert run(handler, "Hello", max_new_tokens=3)[0].completion_tokens == 3
    with pytest.raises(ValueError, match="device_map"):
        load(str(tiny_model_dir), device_map=5)
    with pytest.raises(ValueError, match="gguf_file"):
        load(str(tiny_model_dir), gguf_file=3)
    # A GGUF file is read by the tokenizer and the model alike; one that is not there
    # fails the load (a worker reports that as ModelLoadFailed).
    with pytest.raises(Exception, match=r"absent\.gguf"):
        load(str(tiny_model_dir), gguf_file="absent.gguf")
    assert tokenizers[-1]["gguf_file"] == "absent.gguf"


def test_max_memory_and_a_gpu_group_load_through_accelerate(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained
    seen: list[dict[str, Any]] = []

    def spy(model: str, **kwargs: Any) -> Any:
        seen.append({**kwargs, "max_memory": dict(kwargs.get("max_memory") or {})})
        return original(model, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    # On a CPU machine the only device accelerate can fill is "cpu"; on a GPU group the
    # same option caps each GPU ("0", "1": the worker's own numbering).
    handler = load(str(tiny_model_dir), device="cpu", dtype="float32", max_memory={"cpu": "2GiB"})
    assert seen[-1]["device_map"] == "auto" and seen[-1]["max_memory"] == {"cpu": "2GiB"}
    assert handler.model.device.type == "cpu"
    generation, _ = run(handler, "Hello", max_new_tokens=4)
    assert generation.completion_tokens == 4
    # A worker that owns two GPUs is spread over them; the keys are normalised for accelerate.
    with pytest.raises(Exception):  # noqa: B017 - no GPU here: accelerate's own error
        load(
            str(tiny_model_dir), device="cuda:0,cuda:1", max_memory={"cuda:0": 1 << 30, "1": "1GiB"}
        )
    assert seen[-1]["device_map"] == "auto"
    assert seen[-1]["max_memory"] == {0: 1 << 30, 1: "1GiB"}


LIBRARY_WARNINGS = """
import logging, sys
logging.basicConfig(stream=sys.stdout, format="root %(name)s: %(message)s")
from huggingface_hub.utils import logging as hub_logging
from transformers.utils import logging as transformers_logging
from modelpool.worker.backends.hf.handler import library_logs_through_root
library_logs_through_root()
hub_logging.get_logger("huggingface_hub.file_download").warning("hub warning")
transformers_logging.get_logger("transformers.modeling_utils").warning("transformers warning")
"""


def test_library_warnings_reach_the_root_handler_once_each() -> None:
    """In a worker the root handler forwards to the supervisor: huggingface_hub's warnings
    came out twice (its handler, then the root's) and transformers' bare, unnamed."""
    result = subprocess.run(
        [sys.executable, "-c", LIBRARY_WARNINGS],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert (result.stdout + result.stderr).splitlines() == [
        "root huggingface_hub.file_download: hub warning",
        "root transformers.modeling_utils: transformers warning",
    ]


def test_a_deadline_during_a_long_prefill_never_kills_the_worker(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Issue 40: the one-call path (max_batch_size=1) read no cancel flag during the prefill,
    so a prompt whose prefill outlasted ``cancel_grace_s`` got its worker killed when its
    deadline passed. Here the prefill takes 40 layers x 0.05 s = 2 s, ten times the grace:
    the request ends with its deadline error, and the worker stays (no kill, same pid)."""
    import json
    import shutil

    from helpers import make_config, workers
    from modelpool import ModelPool
    from modelpool.shared.errors import DeadlineExceeded

    deep = tmp_path / "tiny-deep"
    shutil.copytree(tiny_model_dir, deep)
    config_file = deep / "config.json"
    config = json.loads(config_file.read_text())
    # Layers beyond the checkpoint's two start from random weights: gibberish, as before.
    config["num_hidden_layers"] = 40
    config.pop("layer_types", None)
    config_file.write_text(json.dumps(config))
    pool_config = make_config(
        model=str(deep),
        backend="reliability_backends:slow_prefill",
        backend_options={"dtype": "float32", "torch_threads": 1},
        workers=1,
        max_batch_size=1,
        cancel_grace_s=0.2,
        startup_timeout_s=120.0,
    )
    with ModelPool(pool_config) as pool:
        (before,) = workers(pool)
        for _ in range(2):
            with pytest.raises(DeadlineExceeded):
                pool.generate("The quick brown fox " * 8, deadline_s=0.5, max_new_tokens=4)
        assert pool.generate("Hi", max_new_tokens=2).completion_tokens == 2
        stats = pool.stats()
        (after,) = stats.workers
        assert after.pid == before.pid
        assert stats.counters["kills"] == 0 and stats.counters["cancel_escalations"] == 0
        assert stats.counters["respawns"] == 0
