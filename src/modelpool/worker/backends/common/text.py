"""A request's generated tokens as streamed text: stop strings, characters held back.

Shared by every backend: :class:`TextProgress` is driven by ``generate()``'s hooks on
the hf backend's one-call path (``hf.generation``) and by the scheduler
(``common.scheduler``) everywhere else; it decodes with anything that has a
transformers tokenizer's ``decode`` (llama_cpp's ``runtime.Detokenizer``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from modelpool.shared.errors import InvalidRequest
from modelpool.shared.protocol import Call
from modelpool.shared.tool_formats import KEPT_SPECIAL_TOKENS

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

MAX_STOP_STRINGS = 16
_INCOMPLETE_CHAR = "\ufffd"


class TextProgress:
    """One request's decoding state, driven by generate()'s stopping criterion and streamer.

    Within a decoding step transformers calls the stopping criteria, with the
    new token already appended, and then the streamer. Decoding in the
    criterion lets a stop string end generation on the very step that
    completes it; the streamer then emits whatever became stable.

    The whole generated sequence is decoded each step rather than token by
    token, because one token may hold half a character (byte-level
    tokenizers) and a token's leading space can depend on its predecessor.
    Nothing here raises into transformers (an exception there would skip the
    streamer's end()): failures are kept in ``error``, generation is stopped,
    and the handler raises them afterwards.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        call: Call,
        prompt_tokens: int,
        stops: tuple[str, ...],
    ) -> None:
        self._tokenizer: Any = tokenizer
        self._call = call
        self._prompt_tokens = prompt_tokens
        self._stops = stops
        self._decoded = ""
        # A request with tools keeps the call markers that are special tokens (Mistral's
        # [TOOL_CALLS], Llama's <|python_tag|>, gpt-oss's Harmony tokens): the supervisor
        # reads the calls by them. Every other special token is dropped, as always.
        self._kept: frozenset[str] = (
            KEPT_SPECIAL_TOKENS if call.params.get("tools") else frozenset()
        )
        self._dropped = _dropped_special_ids(tokenizer, self._kept) if self._kept else None
        self.token_ids: list[int] = []
        # Everything emitted so far. It is the returned text, so that the text
        # always equals the chunks joined.
        self.text = ""
        # Written ahead of the first chunk, not decoded: a reasoning model's thinking
        # opened by the template (common.thinking). The answer's text is lead + text.
        self.lead = ""
        self._lead_sent = False
        self.cancelled = False
        self.stopped = False
        # The stop string that ended the text (Anthropic's answer names it).
        self.stop_sequence: str | None = None
        self.error: Exception | None = None

    def keep_special(self, tokens: frozenset[str]) -> None:
        """Keep these special tokens in the text too (gpt-oss's Harmony tokens, which its
        thinking is told from its answer by). Called before the first token is taken."""
        self._kept = self._kept | tokens
        self._dropped = _dropped_special_ids(self._tokenizer, self._kept)

    def on_step(self, input_ids: torch.Tensor) -> bool:
        """Stopping-criterion hook: take this step's token; True ends generation."""
        if self.error is not None or self.cancelled or self.stopped:
            return True
        try:
            if self._call.cancelled():
                # The token of this step is dropped: nothing is emitted after a cancel.
                self.cancelled = True
                return True
        except Exception as exc:
            self.error = exc
            return True
        start = self._prompt_tokens + len(self.token_ids)
        return self.take(input_ids[0, start:].tolist())

    def take(self, new_token_ids: list[int]) -> bool:
        """Add generated tokens and decode; True once a stop string ended the text."""
        try:
            self.token_ids.extend(new_token_ids)
            if self._dropped:
                kept = [token for token in self.token_ids if token not in self._dropped]
                decoded = self._tokenizer.decode(
                    kept, skip_special_tokens=False, clean_up_tokenization_spaces=False
                )
            else:
                decoded = self._tokenizer.decode(
                    self.token_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
                )
            found = self._first_stop(decoded)
            if found is not None:
                cut, self.stop_sequence = found
                decoded = decoded[:cut]
                self.stopped = True
            self._decoded = decoded
        except Exception as exc:
            self.error = exc
            return True
        return self.stopped

    def deliver(self) -> None:
        """Count a generated token with the call, when it counts them (a pool's call does:
        its streamed chunks carry the count)."""
        delivered = getattr(self._call, "delivered", None)
        if delivered is not None:
            delivered()

    def on_token(self) -> None:
        """Streamer hook: emit the text that no later token can change."""
        if self.stopped:
            self._emit_until(len(self._decoded))
            return
        stable = self._decoded.rstrip(_INCOMPLETE_CHAR)
        self._emit_until(len(stable) - self._stop_prefix_length(stable))

    def flush(self) -> None:
        """Streamer end hook: emit what was held back, unless the request was cancelled."""
        if not self.cancelled:
            self._emit_until(len(self._decoded))

    def _emit_until(self, end: int) -> None:
        if self.error is not None or end <= len(self.text):
            return
        chunk = self._decoded[len(self.text) : end]
        self.text += chunk
        if self.lead and not self._lead_sent:
            chunk = self.lead + chunk
            self._lead_sent = True
        try:
            self._call.emit(chunk)
        except Exception as exc:
            self.error = exc

    def _first_stop(self, decoded: str) -> tuple[int, str] | None:
        # Emitted text never holds the start of a stop string (see
        # _stop_prefix_length), so the search can begin where it ends.
        return first_stop(decoded, self._stops, len(self.text))

    def _stop_prefix_length(self, text: str) -> int:
        """Length of the longest end of ``text`` that could still grow into a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text) - len(self.text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest


def first_stop(text: str, stops: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    """Where the earliest of ``stops`` begins in ``text`` (from ``start`` on), and which
    one: of two at the same place, the one listed first. None if none is there."""
    found = [(index, stop) for stop in stops if (index := text.find(stop, start)) >= 0]
    return min(found, key=lambda hit: hit[0]) if found else None


def stop_strings(value: object) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) and s for s in items):
        raise InvalidRequest(f"stop must be a non-empty string or a list of them, got {value!r}")
    if len(items) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(items)}")
    return tuple(items)


def _dropped_special_ids(tokenizer: Any, kept_tokens: frozenset[str]) -> frozenset[int] | None:
    """The special tokens a request drops when it keeps ``kept_tokens`` (the call markers,
    Harmony's tokens): all the others; None when the tokenizer has none of them among its
    special tokens (or says nothing of them), and decoding stays as it is."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(decoder, dict):
        return None
    special = {
        token_id: str(getattr(token, "content", token))
        for token_id, token in decoder.items()
        if getattr(token, "special", True)
    }
    special.update(
        (token_id, "")
        for token_id in getattr(tokenizer, "all_special_ids", ())
        if token_id not in special
    )
    kept = {token_id for token_id, content in special.items() if content in kept_tokens}
    if not kept:
        return None
    return frozenset(special) - kept
