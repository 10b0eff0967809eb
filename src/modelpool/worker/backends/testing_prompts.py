"""How the testing backend reads a prompt: its token count and the text a command is
read from (split out of ``testing``, which holds the commands themselves)."""

from __future__ import annotations

import re

from modelpool.shared.protocol import Prompt, TokenIds
from modelpool.worker.backends import testing_images


def count_tokens(prompt: Prompt) -> int:
    """This backend's token count: words, and for chat what a template adds around them."""
    if isinstance(prompt, str):
        return len(prompt.split())
    if isinstance(prompt, TokenIds):
        return len(prompt.ids)
    words = sum(len(testing_images.content_text(message["content"]).split()) for message in prompt)
    return 2 * len(prompt) + words + testing_images.image_tokens(prompt) + 1


def prompt_text(prompt: object) -> str:
    """The last message's text (a string prompt is itself; token ids as numbers)."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, TokenIds):
        return " ".join(str(token_id) for token_id in prompt.ids)
    assert isinstance(prompt, list)
    return testing_images.content_text(prompt[-1]["content"])


# Claude Code writes reminders ahead of the user's text in the same message.
_REMINDERS = re.compile(r"\A(?:\s*<system-reminder>.*?</system-reminder>)+\s*", re.S)


def command_text(prompt: object) -> str:
    """The text a command is read from: the last message's, less the reminders an agent
    puts ahead of it."""
    return _REMINDERS.sub("", prompt_text(prompt))
