"""Prefix fingerprints: how the pool knows which worker holds a request's prefix.

The pool has no tokenizer (a worker does), so it cannot name a prompt's token blocks.
Both sides fingerprint the prompt in the form the pool sees it instead: a chain of
hashes, one per unit (a chat message; a block of ``TEXT_BLOCK_CHARS`` characters of a
string prompt; a block of ``ID_BLOCK`` token ids), each hash covering every unit before
it. A worker's prefix cache keeps, with each entry, the fingerprints of the prompt (and
answer) whose KV it holds, and reports them on every change, evictions included
(``protocol.PrefixCacheReport``); the pool computes a new request's chain once, on the
caller's thread, and prefers the worker whose report holds the longest part of it::

    prompt_fingerprints([{"role": "system", "content": S}, {"role": "user", "content": U}])
        # (fp of [S], fp of [S, U])
    answered_fingerprints(messages, "the answer")   # ... + fp of messages + the answer

Hashes are blake2b (the same in every process, unlike ``hash``), 8 bytes each.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from modelpool.protocol import ChatMessage, Prompt, TokenIds

TEXT_BLOCK_CHARS = 256
ID_BLOCK = 64


def prompt_fingerprints(prompt: Prompt) -> tuple[int, ...]:
    """The chain of ``prompt``'s units (only whole blocks of a string or of token ids)."""
    if isinstance(prompt, str):
        return _chain(_text_blocks(prompt))
    if isinstance(prompt, TokenIds):
        return _chain(_id_blocks(prompt.ids))
    return _chain(_message_units(prompt))


def answered_fingerprints(
    prompt: Prompt, answer_text: str, answer_ids: Sequence[int]
) -> tuple[int, ...]:
    """The chain of ``prompt`` followed by its answer, as the next turn sends it back: the
    answer as an assistant message, appended to a string, or its ids after the prompt's."""
    if isinstance(prompt, str):
        return _chain(_text_blocks(prompt + answer_text))
    if isinstance(prompt, TokenIds):
        return _chain(_id_blocks((*prompt.ids, *answer_ids)))
    return _chain(_message_units([*prompt, {"role": "assistant", "content": answer_text}]))


def matched_units(chain: Sequence[int], held: frozenset[int]) -> int:
    """How many leading units of ``chain`` a worker holding ``held`` has cached."""
    for length in range(len(chain), 0, -1):
        if chain[length - 1] in held:
            return length
    return 0


def _text_blocks(text: str) -> list[bytes]:
    whole = len(text) - len(text) % TEXT_BLOCK_CHARS
    return [
        text[start : start + TEXT_BLOCK_CHARS].encode("utf-8", "surrogatepass")
        for start in range(0, whole, TEXT_BLOCK_CHARS)
    ]


def _id_blocks(ids: Sequence[int]) -> list[bytes]:
    whole = len(ids) - len(ids) % ID_BLOCK
    return [
        b"".join(int(token).to_bytes(8, "little") for token in ids[start : start + ID_BLOCK])
        for start in range(0, whole, ID_BLOCK)
    ]


def _message_units(messages: Sequence[ChatMessage]) -> list[bytes]:
    return [
        f"{message.get('role', '')}\x00{message.get('content', '')}".encode(
            "utf-8", "surrogatepass"
        )
        for message in messages
    ]


def _chain(units: list[bytes]) -> tuple[int, ...]:
    chain = []
    previous = b""
    for unit in units:
        previous = hashlib.blake2b(previous + unit, digest_size=8).digest()
        chain.append(int.from_bytes(previous, "little"))
    return tuple(chain)
