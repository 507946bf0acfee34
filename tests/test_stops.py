"""StopMatcher: a stream never shows text that turns out to belong to a stop string."""

from __future__ import annotations

import pytest

from scheduler.stops import StopMatcher


def feed_all(m: StopMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    out: list[str] = []
    for p in pieces:
        text, hit = m.feed(p)
        out.append(text)
        if hit:
            return out, True
    return out, False


def test_no_stops_passes_text_through() -> None:
    m = StopMatcher()
    assert m.feed("abc") == ("abc", False)
    assert m.feed("") == ("", False)
    assert m.flush() == ""


def test_empty_stop_strings_are_ignored() -> None:
    m = StopMatcher(("",))
    assert m.stops == ()
    assert m.feed("abc") == ("abc", False)


def test_stop_inside_one_piece_truncates_before_it() -> None:
    m = StopMatcher(("STOP",))
    assert m.feed("foo STOP bar") == ("foo ", True)


def test_possible_prefix_is_held_back_until_settled() -> None:
    m = StopMatcher(("END",))
    assert m.feed("abc E") == ("abc ", False)
    assert m.feed("N") == ("", False)
    # "ENx" is no stop after all: the held text comes out with the new piece.
    assert m.feed("x") == ("ENx", False)
    assert m.flush() == ""


def test_stop_split_across_pieces_is_never_emitted() -> None:
    m = StopMatcher(("world",))
    out, hit = feed_all(m, ["hello wo", "rl", "d! more"])
    assert hit
    assert "".join(out) == "hello "
    assert out == ["hello ", "", ""]


def test_flush_returns_the_held_back_text() -> None:
    m = StopMatcher(("END",))
    assert m.feed("the E") == ("the ", False)
    assert m.flush() == "E"
    assert m.flush() == ""


def test_earliest_stop_wins() -> None:
    m = StopMatcher(("cd", "bc"))
    assert m.feed("abcd") == ("a", True)


def test_overlapping_stops_hold_the_longest_prefix() -> None:
    m = StopMatcher(("abc", "bcd"))
    assert m.feed("xab") == ("x", False)
    assert m.feed("c") == ("", True)


def test_repeated_prefix_characters() -> None:
    m = StopMatcher(("aab",))
    assert m.feed("aaa") == ("a", False)
    assert m.feed("b") == ("", True)


def test_pending_cleared_after_a_hit() -> None:
    m = StopMatcher(("XY",))
    assert m.feed("aX") == ("a", False)
    assert m.feed("Yz") == ("", True)
    assert m.flush() == ""


def test_non_ascii_stop() -> None:
    m = StopMatcher(("fin—",))
    out, hit = feed_all(m, ["c'est la f", "in", "—", " après"])
    assert hit
    assert "".join(out) == "c'est la "


@pytest.mark.parametrize("cut", range(1, 12))
def test_every_split_point_gives_the_same_text(cut: int) -> None:
    text = "say hi STOP now"
    m = StopMatcher(("STOP", "hi!"))
    out, hit = feed_all(m, [text[:cut], text[cut:]])
    assert hit
    assert "".join(out) == "say hi "


@pytest.mark.parametrize("cut", range(0, 9))
def test_every_split_point_without_a_stop_loses_nothing(cut: int) -> None:
    text = "ab STO ST"
    m = StopMatcher(("STOP",))
    out, hit = feed_all(m, [text[:cut], text[cut:]])
    assert not hit
    assert "".join(out) + m.flush() == text


def test_the_matcher_names_the_stop_string_that_ended_the_text() -> None:
    """The earliest stop in the text, whichever order they were given in (Anthropic's
    `stop_sequence` reports it); none until one is hit."""
    m = StopMatcher(("END", "NE", "xyz"))
    assert m.feed("a N") == ("a ", False)
    assert m.hit is None
    assert m.feed("END") == ("", True)
    assert m.hit == "NE"  # "NEND": NE starts first
    m = StopMatcher(("xyz", "END"))
    assert feed_all(m, ["ab", "cE", "N", "D!"]) == (["ab", "c", "", ""], True)
    assert m.hit == "END"
