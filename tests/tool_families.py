"""Chat templates of the model families whose tool-call syntax the pool speaks, small ones
modelled on the real ones (their tool sections, call and result rendering, special
tokens), and tiny random models that carry them: detection and rendering run on these as
on the real models, without weights to download.

``SAMPLES`` holds, per family, what such a model writes: text, then two calls of
``get_weather`` in its own syntax.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelpool.tinymodel import build_tiny_model

QWEN25 = """\
{%- if tools %}<|im_start|>system
{{ messages[0].content if messages[0].role == 'system' else 'You are Qwen.' }}

# Tools

You may call one or more functions to assist with the user query.
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA31 = """\
{{- bos_token }}<|start_header_id|>system<|end_header_id|>

{% if tools %}Environment: ipython
{% endif %}Cutting Knowledge Date: December 2023
{% for message in messages if message.role == 'system' %}{{ message.content }}{% endfor %}\
<|eot_id|>
{%- if tools %}<|start_header_id|>user<|end_header_id|>

Given the following functions, please respond with a JSON for a function call with its \
proper arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name \
and its value}. Do not use variables.

{% for tool in tools %}{{ tool | tojson(indent=4) }}

{% endfor %}<|eot_id|>
{%- endif %}
{%- for message in messages if message.role != 'system' %}
{%- if message.role == 'assistant' and message.tool_calls %}\
<|start_header_id|>assistant<|end_header_id|>

{% for call in message.tool_calls %}{% if call.function.name in (builtin_tools or []) %}\
<|python_tag|>{% endif %}{"name": "{{ call.function.name }}", "parameters": \
{{ call.function.arguments | tojson }}}{% endfor %}<|eom_id|>
{%- elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ message.role }}<|end_header_id|>

{{ message.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL = """\
{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'system' %}{{ message.content }}

{% elif message.role == 'user' %}
{%- if loop.last and tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}\
[INST]{{ message.content }}[/INST]
{%- elif message.role == 'assistant' and message.tool_calls %}[TOOL_CALLS][
{%- for call in message.tool_calls %}{"name": "{{ call.function.name }}", "arguments": \
{{ call.function.arguments | tojson }}, "id": "{{ call.id }}"}{% if not loop.last %}, \
{% endif %}{% endfor %}]{{ eos_token }}
{%- elif message.role == 'tool' %}[TOOL_RESULTS]{"content": {{ message.content | tojson }}, \
"call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]
{%- else %}{{ message.content }}{{ eos_token }}
{%- endif %}
{%- endfor %}"""

QWEN3_CODER = """\
{%- if tools %}<|im_start|>system
You are Qwen, a helpful coding assistant.

# Tools

You have access to the following functions:

<tools>
{%- for tool in tools %}
<function>
<name>{{ tool.function.name }}</name>
<description>{{ tool.function.description or '' }}</description>
<parameters>
{%- for name, schema in (tool.function.parameters.properties or {}).items() %}
<parameter>
<name>{{ name }}</name>
<type>{{ schema.type }}</type>
</parameter>
{%- endfor %}
</parameters>
</function>
{%- endfor %}
</tools>

If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' and tools %}
{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{{ message.content or '' }}
{%- for call in message.tool_calls %}
<tool_call>
<function={{ call.function.name }}>
{% for name, value in call.function.arguments.items() %}<parameter={{ name }}>
{{ value if value is string else value | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

GPT_OSS = """\
<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Reasoning: medium

# Valid channels: analysis, commentary, final. Channel must be included for every message.
{%- if tools %}
Calls to these tools must go to the commentary channel: 'functions'.{% endif %}<|end|>
{%- if tools %}<|start|>developer<|message|># Tools

## functions

namespace functions {

{% for tool in tools %}// {{ tool.function.description or '' }}
type {{ tool.function.name }} = (_: {{ tool.function.parameters | tojson }}) => any;

{% endfor %}} // namespace functions<|end|>
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' and message.tool_calls %}
{%- for call in message.tool_calls %}<|start|>assistant<|channel|>commentary \
to=functions.{{ call.function.name }} <|constrain|>json<|message|>\
{{ call.function.arguments | tojson }}<|call|>{% endfor %}
{%- elif message.role == 'tool' %}<|start|>functions.{{ message.name }} to=assistant\
<|channel|>commentary<|message|>{{ message.content }}<|end|>
{%- elif message.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>\
{{ message.content }}<|end|>
{%- else %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""


@dataclass(frozen=True)
class Family:
    parser: str
    template: str
    special_tokens: tuple[str, ...]
    sample: str  # "Checking. " then get_weather(Paris) and get_weather(Oslo, 2)


FAMILIES = {
    "hermes": Family(
        "hermes",
        QWEN25,
        ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"),
        'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", '
        '"days": 2}}\n</tool_call>',
    ),
    "llama3_json": Family(
        "llama3_json",
        LLAMA31,
        (
            "<|begin_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|eom_id|>",
            "<|python_tag|>",
        ),
        # Llama writes no text before its calls: "Checking. " is not there.
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}',
    ),
    "mistral": Family(
        "mistral",
        MISTRAL,
        (
            "[INST]",
            "[/INST]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_CALLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
        'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}]',
    ),
    "qwen3_coder": Family(
        "qwen3_coder",
        QWEN3_CODER,
        ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"),
        "Checking. <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\n"
        "Oslo\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
    ),
    "gpt_oss": Family(
        "gpt_oss",
        GPT_OSS,
        ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>"),
        # Harmony ends the answer at a call: one call per turn.
        "<|channel|>final<|message|>Checking. <|end|><|start|>assistant<|channel|>commentary "
        'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
    ),
}
SAMPLE_CALLS = [{"city": "Paris"}, {"city": "Oslo", "days": 2}]


def build_family_model(root: Path, family: Family) -> Path:
    """A tiny random model with ``family``'s chat template and special tokens."""
    return build_tiny_model(
        root / f"tiny-{family.parser}",
        chat_template=family.template,
        special_tokens=family.special_tokens,
    )


def weather_tool(**city: Any) -> Any:
    """The ``get_weather`` tool in OpenAI's shape: one required string ``city`` (with
    ``city``'s keywords beside its type: an enum, say), nothing else."""
    return {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", **city}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
