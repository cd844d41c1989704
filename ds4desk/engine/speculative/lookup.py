"""Prompt lookup: draft the tokens that followed the latest earlier occurrence of the context's tail.

Answers that quote their input (edit this passage, repeat this list, fix this code) repeat long
runs of the prompt; wherever the last few tokens appeared before, what came after them then is a
good guess for what comes next. No second model: a dictionary of n-grams, kept up to date as the
sequence grows, finds the match in constant time per step.
"""

from __future__ import annotations

from collections.abc import Sequence


class PromptLookup:
    """Drafts for one request. `propose` gets the whole sequence so far (prompt and every token
    emitted), which only ever grows; n-grams of `max_ngram` down to `min_ngram` tokens are tried,
    the longest first, since a longer match is a better predictor."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes must satisfy 1 <= {min_ngram} <= {max_ngram}")
        self._sizes = range(max_ngram, min_ngram - 1, -1)
        # n-gram -> the index of its last token, for the latest occurrence indexed so far.
        self._latest: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending before this index are in _latest

    def propose(self, seq: Sequence[int], count: int) -> list[int]:
        """Up to `count` tokens that followed the latest earlier match of seq's tail, or []."""
        end = len(seq) - 1
        if count <= 0 or end < 1:
            return []
        # Index every n-gram that ends before the tail's last token: a match must end earlier, so
        # that at least one token follows it.
        for last in range(self._indexed, end):
            for size in self._sizes:
                if last + 1 >= size:
                    self._latest[tuple(seq[last + 1 - size : last + 1])] = last
        self._indexed = max(self._indexed, end)
        for size in self._sizes:
            if end + 1 < size:
                continue
            found = self._latest.get(tuple(seq[end + 1 - size : end + 1]))
            if found is not None:
                return list(seq[found + 1 : found + 1 + count])
        return []
