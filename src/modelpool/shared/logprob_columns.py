"""A run's logprobs stored as columns: what crosses a worker's pipe and what a Result holds.

A prompt of 20,000 tokens scored with 5 alternatives each is 20,000 ``TokenLogprob``
objects holding 100,000 tuples. Pickled as objects, the supervisor's dispatcher thread
unpickled them in one C call of about 100 ms that held the GIL: the daemon's event loop,
and every other request's result, waited for it. :class:`TokenLogprobs` keeps the same
entries as a handful of arrays and two strings, which pickle to their bytes and unpickle
in a copy; a ``TokenLogprob`` is made only when one is read::

    entries = TokenLogprobs.of([TokenLogprob(7, "Hi", -0.5, ((7, "Hi", -0.5),))])
    entries[0]                       # TokenLogprob(token_id=7, token='Hi', logprob=-0.5, ...)
    entries.tokens()                 # ['Hi']: a column at a time, for the answer's JSON
    entries == [entries[0]]          # compares as the sequence of entries it holds

A backend may return one directly (``Generation.logprobs``), built from its own columns
with :meth:`TokenLogprobs.from_columns`; the worker turns a list into one either way.
"""

from __future__ import annotations

import itertools
import math
from array import array
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

from modelpool.shared.protocol import TokenLogprob

# A logprob that is None (a prompt's first token) is stored as NaN: no model's logprob
# is NaN that the answer could carry (JSON has no NaN).
_NONE = math.nan


def _offsets(lengths: array[int]) -> list[int]:
    """Where each item starts, and the end of the last: ``[0, l0, l0 + l1, ...]``."""
    return [0, *itertools.accumulate(lengths)]


class TokenLogprobs(Sequence[TokenLogprob]):
    """An immutable sequence of :class:`TokenLogprob`, stored as columns.

    Columns: the token ids, their texts joined into one string with each text's length,
    the logprobs (NaN for None), each entry's number of alternatives, and the
    alternatives' ids, texts (joined, with lengths) and logprobs, entry after entry.
    """

    # In the constructor's order, which is also the pickle's.
    COLUMNS = (
        "_ids",
        "_text",
        "_text_lengths",
        "_logprobs",
        "_top_counts",
        "_top_ids",
        "_top_text",
        "_top_text_lengths",
        "_top_logprobs",
    )
    # Besides the columns: where each entry's text, alternatives and their texts start,
    # made on the first read by index (so that reading entry after entry stays linear).
    __slots__ = (*COLUMNS, "_starts")

    def __init__(
        self,
        ids: array[int],
        text: str,
        text_lengths: array[int],
        logprobs: array[float],
        top_counts: array[int],
        top_ids: array[int],
        top_text: str,
        top_text_lengths: array[int],
        top_logprobs: array[float],
    ) -> None:
        entries = len(ids)
        alternatives = len(top_ids)
        if not (len(text_lengths) == len(logprobs) == len(top_counts) == entries) or not (
            len(top_text_lengths) == len(top_logprobs) == alternatives == sum(top_counts)
        ):
            raise ValueError("TokenLogprobs columns of different lengths")
        if sum(text_lengths) != len(text) or sum(top_text_lengths) != len(top_text):
            raise ValueError("TokenLogprobs text lengths do not add up to their text")
        self._ids = ids
        self._text = text
        self._text_lengths = text_lengths
        self._logprobs = logprobs
        self._top_counts = top_counts
        self._top_ids = top_ids
        self._top_text = top_text
        self._top_text_lengths = top_text_lengths
        self._top_logprobs = top_logprobs
        self._starts: tuple[list[int], list[int], list[int]] | None = None

    @classmethod
    def from_columns(
        cls,
        token_ids: Iterable[int],
        tokens: Sequence[str],
        logprobs: Iterable[float | None],
        top_counts: Iterable[int],
        top_ids: Iterable[int],
        top_tokens: Sequence[str],
        top_logprobs: Iterable[float],
    ) -> TokenLogprobs:
        """Entries given column by column: entry ``i`` has ``top_counts[i]`` alternatives,
        the next ones in ``top_ids``, ``top_tokens`` and ``top_logprobs``."""
        return cls(
            array("q", token_ids),
            "".join(tokens),
            array("L", map(len, tokens)),
            array("d", (_NONE if value is None else value for value in logprobs)),
            array("L", top_counts),
            array("q", top_ids),
            "".join(top_tokens),
            array("L", map(len, top_tokens)),
            array("d", top_logprobs),
        )

    @classmethod
    def of(cls, entries: Iterable[TokenLogprob]) -> TokenLogprobs:
        """``entries`` as columns; a TokenLogprobs comes back as it is."""
        if isinstance(entries, TokenLogprobs):
            return entries
        listed = list(entries)
        for entry in listed:
            if not isinstance(entry, TokenLogprob):
                raise TypeError(
                    f"a logprob entry must be a TokenLogprob, not {type(entry).__name__}"
                )
        top = [alternative for entry in listed for alternative in entry.top]
        return cls.from_columns(
            [entry.token_id for entry in listed],
            [entry.token for entry in listed],
            [entry.logprob for entry in listed],
            [len(entry.top) for entry in listed],
            [token_id for token_id, _, _ in top],
            [token for _, token, _ in top],
            [logprob for _, _, logprob in top],
        )

    # ---- columns ------------------------------------------------------------------------

    def tokens(self) -> list[str]:
        """Each entry's token text."""
        text = self._text
        starts = _offsets(self._text_lengths)
        return [text[start:end] for start, end in itertools.pairwise(starts)]

    def logprob_values(self) -> list[float | None]:
        """Each entry's logprob, None for a prompt's first token."""
        return [None if math.isnan(value) else value for value in self._logprobs]

    def summed_logprob(self) -> float:
        """The sum of the logprobs (None counts as 0): how best_of ranks runs."""
        return math.fsum(value for value in self._logprobs if not math.isnan(value))

    def text(self) -> str:
        """Every entry's token text, joined."""
        return self._text

    def alternative_columns(self) -> tuple[list[str], list[float], list[int]]:
        """Every alternative's token text and logprob, entry after entry, and where each
        entry's start in them (one more: the end of the last)."""
        text = self._top_text
        starts = _offsets(self._top_text_lengths)
        texts = [text[start:end] for start, end in itertools.pairwise(starts)]
        return texts, self._top_logprobs.tolist(), _offsets(self._top_counts)

    def alternatives(self) -> list[tuple[tuple[int, str, float], ...]]:
        """Each entry's alternatives as ``TokenLogprob.top`` has them: (token id, token
        text, logprob), most likely first."""
        texts, logprobs, bounds = self.alternative_columns()
        triples = list(zip(self._top_ids, texts, logprobs, strict=True))
        return [tuple(triples[start:end]) for start, end in itertools.pairwise(bounds)]

    def windows(self, size: int) -> Iterator[TokenLogprobs]:
        """The entries ``size`` at a time, each window a TokenLogprobs of its own."""
        text_at = top_at = top_text_at = 0
        for start in range(0, len(self), size):
            end = start + size
            text_lengths = self._text_lengths[start:end]
            top_counts = self._top_counts[start:end]
            top_end = top_at + sum(top_counts)
            top_text_lengths = self._top_text_lengths[top_at:top_end]
            text_end = text_at + sum(text_lengths)
            top_text_end = top_text_at + sum(top_text_lengths)
            yield TokenLogprobs(
                self._ids[start:end],
                self._text[text_at:text_end],
                text_lengths,
                self._logprobs[start:end],
                top_counts,
                self._top_ids[top_at:top_end],
                self._top_text[top_text_at:top_text_end],
                top_text_lengths,
                self._top_logprobs[top_at:top_end],
            )
            text_at, top_at, top_text_at = text_end, top_end, top_text_end

    # ---- Sequence -------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, index: int) -> TokenLogprob: ...

    @overload
    def __getitem__(self, index: slice) -> list[TokenLogprob]: ...

    def __getitem__(self, index: int | slice) -> TokenLogprob | list[TokenLogprob]:
        if isinstance(index, slice):
            return [self[position] for position in range(*index.indices(len(self)))]
        position = range(len(self))[index]  # IndexError past the end; negatives count back
        if self._starts is None:
            self._starts = (
                _offsets(self._text_lengths),
                _offsets(self._top_counts),
                _offsets(self._top_text_lengths),
            )
        text_starts, top_starts, top_text_starts = self._starts
        token = self._text[text_starts[position] : text_starts[position + 1]]
        alternatives = tuple(
            (
                self._top_ids[alternative],
                self._top_text[top_text_starts[alternative] : top_text_starts[alternative + 1]],
                self._top_logprobs[alternative],
            )
            for alternative in range(top_starts[position], top_starts[position + 1])
        )
        logprob = self._logprobs[position]
        return TokenLogprob(
            self._ids[position], token, None if math.isnan(logprob) else logprob, alternatives
        )

    def __iter__(self) -> Iterator[TokenLogprob]:
        columns = zip(
            self._ids, self.tokens(), self.logprob_values(), self.alternatives(), strict=True
        )
        return itertools.starmap(TokenLogprob, columns)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenLogprobs):
            # The logprobs as values: NaN (a None) is unequal to itself.
            return self.logprob_values() == other.logprob_values() and all(
                getattr(self, name) == getattr(other, name)
                for name in self.COLUMNS
                if name != "_logprobs"
            )
        if isinstance(other, Sequence) and not isinstance(other, str | bytes):
            return len(self) == len(other) and all(
                mine == theirs for mine, theirs in zip(self, other, strict=True)
            )
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TokenLogprobs({list(self)!r})"

    # ---- pickling: the columns' bytes -----------------------------------------------------

    def _columns(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self.COLUMNS)

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            _unpickle,
            tuple(
                column if isinstance(column, str) else (column.typecode, column.tobytes())
                for column in self._columns()
            ),
        )


def _unpickle(*columns: str | tuple[str, bytes]) -> TokenLogprobs:
    arrays: list[Any] = []
    for column in columns:
        if isinstance(column, str):
            arrays.append(column)
        else:
            typecode, data = column
            values = array(typecode)
            values.frombytes(data)
            arrays.append(values)
    return TokenLogprobs(*arrays)
