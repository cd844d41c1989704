"""Stop strings over text that arrives in arbitrary pieces."""

from __future__ import annotations

import itertools
import random

import pytest

from ds4desk.server.stops import StopScanner, first_stop

TEXT = "The rainbow has red, orange and yellow. Then green, blue, indigo and violet."


def scanned(text: str, stops: list[str], cuts: list[int]) -> tuple[list[str], bool]:
    scanner = StopScanner(stops)
    bounds = [0, *sorted(cuts), len(text)]
    shown = [scanner.feed(text[a:b]) for a, b in itertools.pairwise(bounds)]
    shown.append(scanner.flush())
    return shown, scanner.stopped


@pytest.mark.parametrize(
    "stops", [["green"], ["and y", "blue"], ["violet."], ["nowhere", "The"], ["d, o", "red, orange and"]]
)
def test_any_split_gives_the_text_before_the_first_stop(stops: list[str]) -> None:
    expected_cut = min(TEXT.find(stop) for stop in stops if stop in TEXT)
    generator = random.Random(5)
    for _ in range(200):
        cuts = generator.sample(range(1, len(TEXT)), generator.randint(0, 30))
        shown, stopped = scanned(TEXT, stops, cuts)
        assert stopped
        assert "".join(shown) == TEXT[:expected_cut]
        # Nothing shown ever holds a stop string, even across pieces already handed out.
        for end in range(len(shown)):
            assert first_stop("".join(shown[: end + 1]), stops) is None


def test_text_without_a_stop_comes_through_whole() -> None:
    generator = random.Random(9)
    for _ in range(100):
        cuts = generator.sample(range(1, len(TEXT)), generator.randint(0, 20))
        shown, stopped = scanned(TEXT, ["violets", "rainbows"], cuts)
        assert not stopped
        assert "".join(shown) == TEXT


def test_held_text_is_only_a_possible_stop_start() -> None:
    scanner = StopScanner(["</answer>"])
    assert scanner.feed("forty-two</ans") == "forty-two"
    assert scanner.feed("wer> no") == ""
    assert scanner.stopped
    other = StopScanner(["</answer>"])
    assert other.feed("a <") == "a "
    assert other.feed("b") == "<b"
    assert other.flush() == ""
