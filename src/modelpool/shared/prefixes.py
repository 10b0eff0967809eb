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

A request's ``cache_salt`` (vLLM's per-request field; the daemon makes it from the
tenant and the client's own salt) names its *partition*: the chain of a partition other
than the shared default one (no salt) starts from the partition's id, so its
fingerprints and the worker cache's block keys (``backends.common.prefix_cache``) match
nothing of another partition, and neither placement nor ``cached_tokens`` can tell one
request what another partition's prompts were::

    partition_of(None)                               # 0: the shared partition
    prompt_fingerprints(messages, partition_of("tenant-a"))   # another chain
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

from modelpool.shared.lora import lora_ref
from modelpool.shared.protocol import ChatMessage, Prompt, TokenIds

TEXT_BLOCK_CHARS = 256
ID_BLOCK = 64
CACHE_SALT_PARAM = "cache_salt"
"""The generation parameter naming a request's prefix-cache partition (a string)."""
MAX_CACHE_SALT_CHARS = 1024


def partition_of(params: Mapping[str, Any]) -> int:
    """The prefix-cache partition of a request's parameters: 0, the shared one, without a
    ``cache_salt`` nor a LoRA adapter; else a 64-bit id of the salt and the adapter (never
    0): an adapter changes every layer's keys and values, so no entry is shared between
    adapters, nor with the base."""
    salt = params.get(CACHE_SALT_PARAM)
    adapter = lora_ref(params)
    if not salt and adapter is None:
        return 0
    key = str(salt or "")
    if adapter is not None:
        key += f"\0lora\0{adapter.name}\0{adapter.path}"
    digest = hashlib.blake2b(
        key.encode("utf-8", "surrogatepass"), digest_size=8, person=b"cache_salt"
    ).digest()
    return int.from_bytes(digest, "little") or 1


def prompt_fingerprints(prompt: Prompt, partition: int = 0) -> tuple[int, ...]:
    """The chain of ``prompt``'s units (only whole blocks of a string or of token ids) in
    ``partition``."""
    if isinstance(prompt, str):
        return _chain(_text_blocks(prompt), partition)
    if isinstance(prompt, TokenIds):
        return _chain(_id_blocks(prompt.ids), partition)
    return _chain(_message_units(prompt), partition)


def answered_fingerprints(
    prompt: Prompt, answer_text: str, answer_ids: Sequence[int], partition: int = 0
) -> tuple[int, ...]:
    """The chain of ``prompt`` followed by its answer, as the next turn sends it back: the
    answer as an assistant message, appended to a string, or its ids after the prompt's."""
    if isinstance(prompt, str):
        return _chain(_text_blocks(prompt + answer_text), partition)
    if isinstance(prompt, TokenIds):
        return _chain(_id_blocks((*prompt.ids, *answer_ids)), partition)
    answered = [*prompt, {"role": "assistant", "content": answer_text}]
    return _chain(_message_units(answered), partition)


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
        f"{message.get('role', '')}\x00{_content_key(message.get('content', ''))}".encode(
            "utf-8", "surrogatepass"
        )
        for message in messages
    ]


# Of an image, its length and this many bytes at each end name it in a fingerprint:
# placement only, so a collision costs a cache miss, and hashing 20 MB on the caller's
# thread (the daemon's event loop) would cost ~20 ms.
_IMAGE_KEY_BYTES = 4096


def _content_key(content: object) -> str:
    """A message's content as the text its fingerprint hashes: an image part as its type,
    length and ends, never the repr of its bytes."""
    if not isinstance(content, list):
        return str(content)
    keys = []
    for part in content:
        data = part.get("data") if isinstance(part, dict) else None
        if isinstance(data, bytes):
            ends = data[:_IMAGE_KEY_BYTES] + data[-_IMAGE_KEY_BYTES:]
            digest = hashlib.blake2b(ends, digest_size=8).hexdigest()
            keys.append(f"\x01image:{len(data)}:{digest}")
        else:
            keys.append(str(part.get("text", "")) if isinstance(part, dict) else str(part))
    return "\x00".join(keys)


def partition_unit(partition: int) -> int | None:
    """The first fingerprint of every chain of ``partition`` (None for the shared one),
    which names the partition alone: a worker that holds it has served the partition (an
    adapter's rows), which says nothing of a prompt's tokens."""
    return int.from_bytes(_partition_digest(partition), "little") if partition else None


def _partition_digest(partition: int) -> bytes:
    return hashlib.blake2b(partition.to_bytes(8, "little"), digest_size=8).digest()


def _chain(units: list[bytes], partition: int) -> tuple[int, ...]:
    chain = []
    # The shared partition's chain is what it always was; another starts from its id, and
    # with that id as a unit of its own: a worker holding anything of the partition (an
    # adapter's rows leave their KV there) is preferred for its requests, short ones too.
    previous = b""
    if partition:
        previous = _partition_digest(partition)
        chain.append(int.from_bytes(previous, "little"))
    for unit in units:
        previous = hashlib.blake2b(previous + unit, digest_size=8).digest()
        chain.append(int.from_bytes(previous, "little"))
    return tuple(chain)
