"""modelpool.shared.tool_formats: each family's call syntax read (whole, and streamed in
pieces split anywhere), its grammar checked by llguidance's matcher on a tiny model with
the family's chat template and special tokens, and ``auto`` detection on those models."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelpool.shared.config import PoolConfig
from modelpool.shared.errors import MalformedToolCall
from modelpool.shared.tool_formats import detect_tool_parser, marker_tokens, resolve_tool_parser
from modelpool.shared.tools import (
    ArgumentsDelta,
    CallOpened,
    CallReader,
    ToolCall,
    ToolPlan,
    parse_tool_request,
    read_answer,
    render_chat,
)
from tool_families import FAMILIES, SAMPLE_CALLS, build_family_model

PARAMETERS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo"]},
        "days": {"type": "integer", "enum": [1, 2, 3]},
    },
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMETERS}}
NOTE = {
    "type": "function",
    "function": {
        "name": "note",
        "parameters": {
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
        },
    },
}


def plan(
    parser: str,
    choice: Any = None,
    parallel: bool = True,
    tokens: tuple[tuple[str, int], ...] = (),
) -> ToolPlan:
    body: dict[str, Any] = {"tools": [WEATHER, NOTE], "parallel_tool_calls": parallel}
    if choice is not None:
        body["tool_choice"] = choice
    parsed = parse_tool_request(body)
    assert parsed is not None
    return parsed.bound(parser, "tiny-" + parser, tokens)


def streamed(reader: CallReader, text: str, cuts: list[int]) -> list[Any]:
    pieces = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    return [event for piece in pieces for event in reader.feed(piece)] + reader.finish()


def split(events: list[Any]) -> tuple[str, list[dict[str, Any]]]:
    content = "".join(event for event in events if isinstance(event, str))
    calls = [json.loads(e.arguments) for e in events if isinstance(e, ToolCall)]
    return content, calls


@pytest.mark.parametrize("parser", list(FAMILIES))
def test_each_syntax_reads_the_same_whole_and_split_anywhere(parser: str) -> None:
    family = FAMILIES[parser]
    expected = SAMPLE_CALLS[:1] if parser == "gpt_oss" else SAMPLE_CALLS
    content, calls = read_answer(plan(parser), family.sample)
    assert [json.loads(call.arguments) for call in calls] == expected
    assert content == (None if parser == "llama3_json" else "Checking. ")
    every = random.Random(parser)
    for cuts in [list(range(1, len(family.sample)))] + [
        sorted(every.sample(range(1, len(family.sample)), 6)) for _ in range(30)
    ]:
        got = split(streamed(CallReader(plan(parser)), family.sample, cuts))
        assert got == ((content or ""), expected), cuts


# Each family's sample, and the other forms a syntax reads: Mistral's NAME[ARGS] calls,
# Qwen3-Coder's <function=...> without <tool_call> around it.
STREAMED_SAMPLES = [
    *((parser, family.sample) for parser, family in FAMILIES.items()),
    (
        "mistral",
        'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'
        '[TOOL_CALLS]note [CALL_ID]a1b2[ARGS] {"text": "two lines\\nof text"}',
    ),
    (
        "qwen3_coder",
        'Checking. <function=note>\n<parameter=text>\n"quoted" two\nlines\n</parameter>\n'
        "</function>",
    ),
]


@pytest.mark.parametrize(("parser", "text"), STREAMED_SAMPLES)
def test_arguments_stream_as_written_split_anywhere(parser: str, text: str) -> None:
    """Each call opened once its name is read, its arguments' pieces adding up to the
    call's ``arguments`` (as the model wrote them; Qwen3-Coder's, the JSON its parameters
    make), at every split of the text."""
    every = random.Random(parser)
    for cuts in [list(range(1, len(text)))] + [
        sorted(every.sample(range(1, len(text)), 6)) for _ in range(30)
    ]:
        events = streamed(CallReader(plan(parser), stream_arguments=True), text, cuts)
        calls = [e for e in events if isinstance(e, ToolCall)]
        opened = [e for e in events if isinstance(e, CallOpened)]
        assert calls
        assert [(o.index, o.id, o.name) for o in opened] == [(c.index, c.id, c.name) for c in calls]
        for call in calls:
            assert call.streamed
            pieces = [e.text for e in events if isinstance(e, ArgumentsDelta) and e.id == call.id]
            assert "".join(pieces) == call.arguments
            # Each piece goes out before its call is whole.
            assert events.index(call) > max(
                i for i, e in enumerate(events) if isinstance(e, ArgumentsDelta) and e.id == call.id
            )
        # Whole, the same arguments' text.
        assert [c.arguments for c in read_answer(plan(parser), text)[1]] == [
            c.arguments for c in calls
        ]


@pytest.mark.parametrize("parser", list(FAMILIES))
def test_text_without_a_call_is_content_in_every_syntax(parser: str) -> None:
    for text in ["Just text.", "a <tool b [TOOL c to=x {not at the start}", ""]:
        assert read_answer(plan(parser), text) == (text, [])
        reader = CallReader(plan(parser))
        assert split(streamed(reader, text, list(range(1, len(text))))) == (text, [])


MALFORMED = {
    "hermes": [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>',
        '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa',
    ],
    "llama3_json": [
        '{"name": "get_weather", "parameters": {"city": "Paris"}',
        '<|python_tag|>{"parameters": {"city": "Paris"}}',
        '{"name": "get_weather", "parameters": {"city": "Paris", "days": 9}}',
    ],
    "mistral": [
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}',
        "[TOOL_CALLS]get_weather{}",
        '[TOOL_CALLS]get_weather[ARGS]{"city": 3}',
    ],
    "qwen3_coder": [
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",
        "<tool_call>\n<function=get_weather>\n<parameter=days>\ntwo\n</parameter>\n"
        "</function>\n</tool_call>",
        "<tool_call>\nget_weather(city='Paris')\n</tool_call>",
    ],
    "gpt_oss": [
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "P',
        "<|channel|>commentary to=functions.get_weather json",
        '<|channel|>commentary to=functions.nope json<|message|>{"city": "Paris"}<|call|>',
    ],
}


@pytest.mark.parametrize(("parser", "text"), [(p, t) for p, ts in MALFORMED.items() for t in ts])
def test_a_call_that_cannot_be_read_is_an_error_naming_the_model(parser: str, text: str) -> None:
    # Llama's bare "{" opens a call only at the start of the answer.
    text = text if parser == "llama3_json" else "Sure. " + text
    with pytest.raises(MalformedToolCall) as whole:
        read_answer(plan(parser), text)
    assert whole.value.model == "tiny-" + parser and whole.value.parser == parser
    assert "tiny-" + parser in whole.value.message
    reader = CallReader(plan(parser))
    with pytest.raises(MalformedToolCall):
        streamed(reader, text, list(range(1, len(text))))


def test_the_other_forms_each_family_writes_are_read() -> None:
    forms = {
        "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]note[ARGS]'
        '{"text": "hi"}',
        "llama3_json": '  {"name": "get_weather", "arguments": {"city": "Paris"}};'
        '{"name": "note", "parameters": "{\\"text\\": \\"hi\\"}"}',
        "qwen3_coder": "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n<function=note>\n<parameter=text>\nhi\n</parameter>\n</function>",
        "gpt_oss": "<|start|>assistant to=functions.get_weather<|channel|>commentary json"
        '<|message|>{"city": "Paris"}',
    }
    for parser, text in forms.items():
        content, calls = read_answer(plan(parser), text)
        assert content is None, parser
        names = [call.name for call in calls]
        assert names == (["get_weather"] if parser == "gpt_oss" else ["get_weather", "note"])


def test_tool_choice_none_reads_no_calls() -> None:
    text = FAMILIES["mistral"].sample
    assert read_answer(plan("mistral", "none"), text) == (text, [])


def test_a_model_whose_files_are_not_there_yet_is_read_again(tmp_path: Path) -> None:
    model = tmp_path / "downloading"
    model.mkdir()
    assert resolve_tool_parser("auto", str(model)) == "hermes"
    assert marker_tokens(str(model)) == ()
    config = {
        "chat_template": FAMILIES["mistral"].template,
        "added_tokens_decoder": {"5": {"content": "[TOOL_CALLS]", "special": True}},
    }
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    assert resolve_tool_parser("auto", str(model)) == "mistral"
    assert marker_tokens(str(model)) == (("[TOOL_CALLS]", 5),)


@pytest.fixture(scope="module")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    root = tmp_path_factory.mktemp("families")
    yield {parser: build_family_model(root, family) for parser, family in FAMILIES.items()}


@pytest.mark.slow
def test_auto_detects_each_family_from_its_chat_template(family_models: dict[str, Path]) -> None:
    for parser, path in family_models.items():
        assert resolve_tool_parser("auto", str(path)) == parser
        assert resolve_tool_parser("mistral", str(path)) == "mistral"
        bound = plan("hermes").for_model(PoolConfig(model=str(path)), "served")
        assert (bound.parser, bound.model) == (parser, "served")
        assert bound.marker_tokens == marker_tokens(str(path))
    # A template with no tool-call markers, or no model files: Hermes, as before.
    assert detect_tool_parser("{{ messages[0].content }}") is None
    assert resolve_tool_parser("auto", "none") == "hermes"
    assert PoolConfig(model="m").tool_parser == "auto"
    with pytest.raises(ValueError, match="tool_parser must be one of"):
        PoolConfig(model="m", tool_parser="xml")


@pytest.mark.parametrize("parser", ["mistral", "qwen3_coder"])
def test_auto_reads_a_gguf_files_embedded_template(tmp_path: Path, parser: str) -> None:
    gguf = pytest.importorskip("gguf")
    path = tmp_path / f"{parser}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_chat_template(FAMILIES[parser].template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert resolve_tool_parser("auto", str(path)) == parser
    # A missing GGUF, or a corrupt one: Hermes.
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF\x03\x00")
    assert resolve_tool_parser("auto", str(tmp_path / "none.gguf")) == "hermes"
    assert resolve_tool_parser("auto", str(corrupt)) == "hermes"


@pytest.mark.slow
def test_each_template_renders_the_tools_and_a_history_in_its_own_syntax(
    family_models: dict[str, Path],
) -> None:
    from transformers import AutoTokenizer

    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
    }
    messages = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "sunny"},
    ]
    for parser, path in family_models.items():
        tokenizer = AutoTokenizer.from_pretrained(str(path))
        text = render_chat(tokenizer, messages, plan(parser).template_tools())
        assert "get_weather" in text and "sunny" in text, parser
        history = text[text.index("Weather?") :]
        # The call of the history, rendered by the template, reads back as that call.
        assert any(
            marker in history
            for marker in ("<tool_call>", "[TOOL_CALLS]", "to=functions.", '"parameters"')
        )


def _accepts(grammar: str, text: str, tokenizer: Any) -> bool:
    import llguidance
    import llguidance.hf

    matcher = llguidance.LLMatcher(
        llguidance.hf.from_tokenizer(tokenizer), llguidance.LLMatcher.grammar_from_lark(grammar)
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.consume_tokens(ids) and matcher.is_accepting() and not matcher.is_error()


@pytest.mark.slow
@pytest.mark.parametrize("parser", list(FAMILIES))
def test_each_grammar_holds_the_model_to_valid_calls_in_its_syntax(
    parser: str, family_models: dict[str, Path]
) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(family_models[parser]))
    # The markers that are special tokens of this model are written as those tokens.
    tokens = marker_tokens(str(family_models[parser]))
    assert bool(tokens) == (parser != "llama3_json")
    good = GOOD[parser]
    required = plan(parser, "required", tokens=tokens).grammar()
    auto = plan(parser, tokens=tokens).grammar()
    named = plan(
        parser, {"type": "function", "function": {"name": "note"}}, tokens=tokens
    ).grammar()
    assert required is not None and auto is not None and named is not None
    assert _accepts(required, good, tokenizer)
    assert _accepts(auto, good, tokenizer)
    plain = "Plain text, no call."
    if parser == "gpt_oss":
        plain = (
            "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>"
            + plain
        )
        assert (
            _accepts(auto, plain.replace("<|channel|>final", "<|channel|>analysis"), tokenizer)
            is False
        )
        # Thinking ended (the model's end or the worker's close): analysis is not reopened.
        analysis = "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant"
        assert not _accepts(auto, analysis + plain, tokenizer)
        assert _accepts(required, analysis + good, tokenizer)
        assert not _accepts(required, analysis + analysis + good, tokenizer)
    assert _accepts(auto, plain, tokenizer)
    assert not _accepts(required, "Plain text, no call.", tokenizer)
    assert not _accepts(required, good.replace("Paris", "Rome"), tokenizer)
    assert not _accepts(named, good, tokenizer)
    assert _accepts(named, NOTE_CALL[parser], tokenizer)
    # Every text the grammar lets through reads back as the call.
    content, calls = read_answer(plan(parser, "required"), good)
    assert content is None
    assert [json.loads(call.arguments) for call in calls] == [{"city": "Paris", "days": 2}]


# What each grammar writes: get_weather(Paris, 2), note("two lines\nof text").
GOOD = {
    "hermes": '<tool_call>{"name": "get_weather", "arguments": {"city":"Paris","days":2}}'
    "</tool_call>",
    "llama3_json": '{"name": "get_weather", "parameters": {"city":"Paris","days":2}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city":"Paris","days":2}}]',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
    "gpt_oss": "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city":"Paris","days":2}<|call|>',
}
NOTE_CALL = {
    "hermes": '<tool_call>{"name": "note", "arguments": {"text":"two lines\\nof text"}}'
    "</tool_call>",
    "llama3_json": '{"name": "note", "parameters": {"text":"two lines\\nof text"}}',
    "mistral": '[TOOL_CALLS][{"name": "note", "arguments": {"text":"two lines\\nof text"}}]',
    "qwen3_coder": "<tool_call>\n<function=note>\n<parameter=text>\ntwo lines\nof text\n"
    "</parameter>\n</function>\n</tool_call>",
    "gpt_oss": "<|channel|>commentary to=functions.note <|constrain|>json<|message|>"
    '{"text":"two lines\\nof text"}<|call|>',
}
