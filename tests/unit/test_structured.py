"""Structured outputs, the supervisor's side: every form of the request becomes one checked
grammar text, and what llguidance cannot honour is refused naming the keyword and its path
(modelpool.shared.structured, and the HTTP bodies through server.core.generation_body)."""

from __future__ import annotations

import json
import sys
from typing import Any, Literal

import pydantic
import pytest

from modelpool.server.core.generation_body import parse_chat, parse_completion
from modelpool.server.http import ApiError
from modelpool.shared.errors import GrammarEngineMissing, GrammarError, InvalidRequest
from modelpool.shared.grammar import COMPILE_TIMEOUT_PARAM, GRAMMAR_PARAM
from modelpool.shared.structured import (
    constrain,
    grammar_for_body,
    grammar_for_response_format,
    json_schema_grammar_fragment,
)

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


class Person(pydantic.BaseModel):
    name: str
    age: int


def embedded_schema(grammar: str) -> Any:
    assert grammar.startswith("start: %json "), grammar
    return json.loads(grammar.removeprefix("start: %json "))


def test_every_form_of_a_schema_gives_the_same_compact_grammar() -> None:
    openai_form = {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}}
    by_dict = grammar_for_response_format(openai_form)
    assert by_dict is not None
    assert grammar_for_response_format(SCHEMA) == by_dict
    schema = embedded_schema(by_dict)
    assert schema["x-guidance"] == {"whitespace_flexible": False}
    from_model = embedded_schema(grammar_for_response_format(Person) or "")
    assert from_model["required"] == ["name", "age"]
    assert embedded_schema(grammar_for_response_format({"type": "json_object"}) or "")["type"] == (
        "object"
    )
    assert grammar_for_response_format({"type": "text"}) is None
    assert grammar_for_response_format(None) is None


@pytest.mark.parametrize(
    ("schema", "param", "keyword"),
    [
        (
            {"type": "object", "properties": {"x": {"type": "string", "format": "nope"}}},
            "properties.x.format",
            "format",
        ),
        (
            {"type": "object", "properties": {"not": {"type": "array", "uniqueItems": True}}},
            "properties.not.uniqueItems",
            "uniqueItems",
        ),
        (
            {"type": "object", "properties": {"a": {"anyOf": [{"type": "null"}, {"not": {}}]}}},
            "properties.a.anyOf[1].not",
            "not",
        ),
        (
            {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}},
            "properties.a.$ref",
            "$ref",
        ),
        (
            {"type": "array", "items": {"type": "string", "pattern": "(?<=a)b"}},
            "items.pattern",
            "pattern",
        ),
    ],
)
def test_a_keyword_the_engine_cannot_honour_is_refused_at_its_path(
    schema: dict[str, Any], param: str, keyword: str
) -> None:
    where = "response_format.json_schema.schema"
    with pytest.raises(GrammarError) as caught:
        grammar_for_response_format(
            {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        )
    assert caught.value.param == f"{where}.{param}"
    assert caught.value.keyword == keyword
    assert keyword in str(caught.value)
    assert isinstance(caught.value, InvalidRequest)


def test_malformed_response_formats_are_refused_by_name() -> None:
    with pytest.raises(GrammarError) as caught:
        grammar_for_response_format({"type": "xml"})
    assert caught.value.param == "response_format.type"
    with pytest.raises(GrammarError) as caught:
        grammar_for_response_format({"type": "json_schema", "json_schema": "nope"})
    assert caught.value.param == "response_format.json_schema"
    with pytest.raises(GrammarError) as caught:
        grammar_for_response_format(
            {"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": "yes"}}
        )
    assert caught.value.param == "response_format.json_schema.strict"
    with pytest.raises(GrammarError):
        grammar_for_response_format(42)


def test_vllm_structured_outputs_and_guided_fields() -> None:
    assert grammar_for_body({"structured_outputs": {"choice": ["yes", "no"]}}) == (
        'start: "yes" | "no"'
    )
    assert grammar_for_body({"guided_choice": ["yes", "no"]}) == 'start: "yes" | "no"'
    assert grammar_for_body({"structured_outputs": {"regex": r"\d+"}}) == r"start: /\d+/"
    guided = grammar_for_body({"guided_json": SCHEMA})
    assert guided is not None and embedded_schema(guided)["required"] == ["name", "age"]
    assert grammar_for_body({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}})
    with pytest.raises(GrammarError) as caught:
        grammar_for_body({"structured_outputs": {"regex": "(?=a)"}})
    assert caught.value.param == "structured_outputs.regex"
    with pytest.raises(GrammarError) as caught:
        grammar_for_body({"structured_outputs": {"structural_tag": "x"}})
    assert caught.value.param == "structured_outputs.structural_tag"
    with pytest.raises(GrammarError) as caught:
        grammar_for_body({"guided_regex": "a", "response_format": {"type": "json_object"}})
    assert "only one" in str(caught.value)


def test_the_fragment_for_a_bigger_grammar_is_checked_too() -> None:
    fragment = json_schema_grammar_fragment(SCHEMA, param="tools[0].function.parameters")
    assert fragment.startswith("%json {")
    with pytest.raises(GrammarError) as caught:
        json_schema_grammar_fragment(
            {"type": "object", "properties": {"q": {"not": {}}}},
            param="tools[0].function.parameters",
        )
    assert caught.value.param == "tools[0].function.parameters.properties.q.not"


def test_the_library_keyword_becomes_the_grammar_and_its_bound() -> None:
    plain = {"max_new_tokens": 8}
    assert constrain(plain, 5.0) is plain
    params = constrain({"max_new_tokens": 8, "response_format": Person}, 5.0)
    assert "response_format" not in params
    assert params[COMPILE_TIMEOUT_PARAM] == 5.0
    assert embedded_schema(params[GRAMMAR_PARAM])["required"] == ["name", "age"]
    assert constrain({"grammar": 'start: "a"', COMPILE_TIMEOUT_PARAM: 1.0}, 5.0) == {
        "grammar": 'start: "a"',
        COMPILE_TIMEOUT_PARAM: 1.0,
    }
    with pytest.raises(GrammarError, match="unknown name"):
        constrain({"grammar": "start: nowhere"}, 5.0)
    with pytest.raises(GrammarError, match="not both"):
        constrain({"grammar": 'start: "a"', "response_format": SCHEMA}, 5.0)


def test_http_bodies_carry_the_grammar_or_a_400_pointing_into_the_schema() -> None:
    messages = [{"role": "user", "content": "hi"}]
    chat = parse_chat(
        {
            "messages": messages,
            "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
        }
    )
    assert embedded_schema(chat.params[GRAMMAR_PARAM])["required"] == ["name", "age"]
    completion = parse_completion({"prompt": "x", "structured_outputs": {"choice": ["a"]}})
    assert completion.params[GRAMMAR_PARAM] == 'start: "a"'
    assert GRAMMAR_PARAM not in parse_chat({"messages": messages}).params
    assert (
        GRAMMAR_PARAM
        not in parse_chat({"messages": messages, "response_format": {"type": "text"}}).params
    )
    bad = {"type": "object", "properties": {"x": {"type": "string", "format": "nope"}}}
    with pytest.raises(ApiError) as caught:
        parse_chat(
            {
                "messages": messages,
                "response_format": {"type": "json_schema", "json_schema": {"schema": bad}},
            }
        )
    assert caught.value.status == 400
    assert caught.value.param == "response_format.json_schema.schema.properties.x.format"


def test_one_of_is_refused_unless_a_discriminator_makes_it_exclusive() -> None:
    class Cat(pydantic.BaseModel):
        kind: Literal["cat"]
        lives: int

    class Dog(pydantic.BaseModel):
        kind: Literal["dog"]
        good: bool

    class Pet(pydantic.BaseModel):
        pet: Cat | Dog = pydantic.Field(discriminator="kind")

    assert '"coerce_one_of": true' in (grammar_for_response_format(Pet) or "")
    overlapping = {"properties": {"n": {"oneOf": [{"type": "integer"}, {"minimum": 0}]}}}
    with pytest.raises(GrammarError) as caught:
        grammar_for_response_format(overlapping)
    assert caught.value.param == "response_format.properties.n.oneOf"


def test_without_llguidance_a_constrained_request_is_a_typed_refusal(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)  # import llguidance raises
    with pytest.raises(GrammarEngineMissing, match=r"modelpool\[structured\]"):
        constrain({"response_format": SCHEMA}, 5.0)
    assert constrain({"max_new_tokens": 4}, 5.0) == {"max_new_tokens": 4}


# ---- bounds on the work of a check -----------------------------------------------------------


def test_a_schema_past_a_work_bound_is_refused_naming_it() -> None:
    from modelpool.shared.errors import SchemaTooComplex
    from modelpool.shared.structured import MAX_CHOICE_ITEMS, MAX_SCHEMA_NODES, checked_inline

    wide = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2500)}}
    with pytest.raises(SchemaTooComplex) as nodes:
        grammar_for_response_format(wide)
    assert nodes.value.bound == "schema_nodes" and str(MAX_SCHEMA_NODES) in nodes.value.message
    crossed = {
        "type": "string",
        "allOf": [{"anyOf": [{"pattern": f"a{j}.*"}, {"pattern": f".*b{j}"}]} for j in range(9)],
    }
    with pytest.raises(SchemaTooComplex) as branches:
        grammar_for_response_format(crossed)
    assert branches.value.bound == "allof_branches" and branches.value.param == (
        "response_format.allOf"
    )
    choices = [f"c{i}" for i in range(MAX_CHOICE_ITEMS + 1)]
    with pytest.raises(SchemaTooComplex) as many:
        grammar_for_body({"guided_choice": choices})
    assert many.value.bound == "choices"
    # Through the HTTP parsing: a typed 400 naming the bound.
    with pytest.raises(ApiError) as refused:
        parse_chat({"messages": [{"role": "user", "content": "x"}], "guided_choice": choices})
    assert refused.value.code == "schema_too_complex"
    assert refused.value.body()["error"]["bound"] == "choices"
    # Inline (the daemon's check threads), a request's checks share CHECK_BOUND_S.
    assert checked_inline(grammar_for_body, {"guided_choice": choices[:10]}) is not None
