"""An n-gram loop detector: thinking that repeats the same few tokens over and over.

One run-length counter per period: ``runs[p]`` counts the consecutive latest tokens
equal to the token ``p`` before them. A run of at least ``min_tokens`` (and at least
``repeats`` periods) at some period up to ``max_period`` is a loop. Each token costs
``max_period`` comparisons, whatever the history's length."""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable


class LoopDetector:
    def __init__(self, max_period: int = 32, min_tokens: int = 64, repeats: int = 4) -> None:
        self.max_period = max_period
        self.min_tokens = min_tokens
        self.repeats = repeats
        self._recent: deque[Hashable] = deque(maxlen=max_period)
        self._runs = [0] * (max_period + 1)

    def take(self, token: Hashable) -> bool:
        """Add ``token``; True when the latest tokens are a loop."""
        recent = self._recent
        runs = self._runs
        looping = False
        count = len(recent)
        for period in range(1, count + 1):
            if recent[count - period] == token:
                run = runs[period] + 1
                runs[period] = run
                if run >= self.min_tokens and run >= period * (self.repeats - 1):
                    looping = True
            else:
                runs[period] = 0
        recent.append(token)
        return looping
