"""Prompt lookup: draft the tokens that followed the earlier occurrence that best matches the
context's tail.

Answers that quote their input (edit this passage, repeat this list, fix this code) repeat long
runs of the prompt; wherever the last few tokens appeared before, what came after them then is a
good guess for what comes next. No second model: an index of every earlier position by the two
tokens ending there, kept up to date as the sequence grows.

Which occurrence: the one whose tokens before it agree with the context's for longest (up to
MAX_MATCH), the latest of those that agree equally. A common pair ("of the", ", and") occurs many
times; the occurrence that also matches the words before it is the place being quoted. A match of
a single token is too weak to draft from (in quote-back answers its first draft was accepted one
time in four, against four in five for two tokens or more), so the shortest match drafted from is
two tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

# How far back a candidate's agreement with the tail is followed: past a dozen tokens an
# occurrence is the quoted place, and checking further only costs time.
MAX_MATCH = 16


class PromptLookup:
    """Drafts for one request. `propose` gets the whole sequence so far (prompt and every token
    emitted), which only ever grows."""

    def __init__(self, min_match: int = 2, max_match: int = MAX_MATCH) -> None:
        if not 2 <= min_match <= max_match:
            raise ValueError(f"match lengths must satisfy 2 <= {min_match} <= {max_match}")
        self.min_match, self.max_match = min_match, max_match
        # (seq[i - 1], seq[i]) -> every i indexed so far, in increasing order.
        self._ends: dict[tuple[int, int], list[int]] = {}
        self._indexed = 1  # pairs ending before this index are in _ends
        self.last_match = 0  # the match length of the last proposal (0: none), for statistics

    def propose(self, seq: Sequence[int], count: int) -> list[int]:
        """Up to `count` tokens that followed the best earlier match of seq's tail, or []."""
        end = len(seq) - 1
        self.last_match = 0
        if count <= 0 or end < 2:
            return []
        # Index every pair that ends before the tail's last token: a match must end earlier, so
        # that at least one token follows it.
        for last in range(self._indexed, end):
            self._ends.setdefault((seq[last - 1], seq[last]), []).append(last)
        self._indexed = max(self._indexed, end)
        candidates = self._ends.get((seq[end - 1], seq[end]))
        if not candidates:
            return []
        best_at, best_len = -1, 0
        for at in reversed(candidates):  # latest first: an equal match later does not replace it
            length = 2
            while length < self.max_match and at - length >= 0 and seq[at - length] == seq[end - length]:
                length += 1
            if length > best_len:
                best_at, best_len = at, length
                if length == self.max_match:
                    break
        if best_len < self.min_match:
            return []
        self.last_match = best_len
        return list(seq[best_at + 1 : best_at + 1 + count])
