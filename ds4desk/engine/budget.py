"""The thinking budget: once the thinking part of an answer reaches its budget, the close sequence
is forced one token per step, then sampling resumes so that the model writes its answer."""

from __future__ import annotations

from ds4desk.engine.api import EngineFailure, ErrorCode, ThinkingBudget


class ThinkingGate:
    def __init__(self, budget: ThinkingBudget, vocab_size: int) -> None:
        close = list(budget.close_tokens)
        if budget.max_tokens < 0 or not close:
            raise EngineFailure(
                ErrorCode.BAD_REQUEST, "a thinking budget needs max_tokens >= 0 and at least one close token"
            )
        if any(not 0 <= t < vocab_size for t in close):
            raise EngineFailure(ErrorCode.BAD_REQUEST, f"close tokens {close} are outside the vocabulary")
        self._budget = budget.max_tokens
        self._close = close
        self._thinking = True
        self._spent = 0
        self._tail: list[int] = []  # the last len(close) tokens, to see the close sequence arrive
        self._pending: list[int] = []
        self.forced = False

    def forced_token(self) -> int | None:
        """The token this step must be, or None to sample."""
        if self._thinking and not self._pending and self._spent >= self._budget:
            # Complete a close sequence the model has already begun instead of starting it over.
            begun = next(
                (
                    k
                    for k in range(min(len(self._tail), len(self._close) - 1), 0, -1)
                    if self._tail[-k:] == self._close[:k]
                ),
                0,
            )
            self._pending = self._close[begun:]
            self.forced = True
        return self._pending.pop(0) if self._pending else None

    def observe(self, token: int) -> None:
        """Every generated token, forced or sampled, in order."""
        if not self._thinking:
            return
        self._spent += 1
        self._tail = [*self._tail, token][-len(self._close) :]
        if self._tail == self._close:
            self._thinking = False
            self._pending.clear()
