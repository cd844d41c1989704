"""OpenAI's `stop` strings over streamed text: the engine stops on token ids, clients ask for strings."""

from __future__ import annotations


class StopScanner:
    """Text goes in piece by piece; out comes what can be shown. A tail that could still be the start
    of a stop string is held back until the next piece decides it, so no stop string ever leaks out
    half-written."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = [stop for stop in stops if stop]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        self._held += text
        return self._settle(final=False)

    def flush(self) -> str:
        """The end of the answer: what was held back is decided with the text there is."""
        return "" if self.stopped else self._settle(final=True)

    def _settle(self, final: bool) -> str:
        held = self._held
        cut = first_stop(held, self._stops)
        # A longer stop string that starts earlier may still be completing ("red, orange" against
        # "d, o"): the earliest one in the whole answer wins, so wait for it while it can.
        open_from = len(held) - self._open_tail()
        if cut is not None and (final or open_from >= cut):
            self.stopped = True
            self._held = ""
            return held[:cut]
        if final:
            self._held = ""
            return held
        self._held = held[open_from:]
        return held[:open_from]

    def _open_tail(self) -> int:
        """The length of the longest end of the held text that begins some stop string."""
        longest = 0
        for stop in self._stops:
            for size in range(min(len(stop) - 1, len(self._held)), longest, -1):
                if self._held.endswith(stop[:size]):
                    longest = size
                    break
        return longest


def first_stop(text: str, stops: list[str]) -> int | None:
    """Where the earliest stop string starts in `text`, or None."""
    found = [at for stop in stops if stop and (at := text.find(stop)) >= 0]
    return min(found) if found else None
