"""IncrementalDetokenizer: characters split over byte pieces come out whole, once."""

from __future__ import annotations

from engine.detok import IncrementalDetokenizer

PIECES: dict[int, bytes] = {
    1: b"caf",
    2: b"\xc3",  # first byte of "é"
    3: b"\xa9",  # second byte of "é"
    4: b"\xf0\x9f",  # first half of "😀" (F0 9F 98 80)
    5: b"\x98",
    6: b"\x80!",
    7: b" ",
    8: b"\xff",  # never valid UTF-8
    9: b"\xa9\xe2\x82",  # end of "é", then two of the three bytes of "€"
    10: b"\xac",
}


def detok() -> IncrementalDetokenizer:
    return IncrementalDetokenizer(PIECES.__getitem__)


def test_ascii_pieces_come_out_as_they_are() -> None:
    d = detok()
    assert d.add(1) == "caf"
    assert d.add(7) == " "
    assert d.flush() == ""


def test_two_byte_character_split_over_two_tokens() -> None:
    d = detok()
    assert [d.add(t) for t in (1, 2, 3)] == ["caf", "", "é"]
    assert d.flush() == ""


def test_four_byte_character_split_over_three_tokens() -> None:
    d = detok()
    assert [d.add(t) for t in (7, 4, 5, 6)] == [" ", "", "", "😀!"]


def test_piece_that_ends_one_character_and_starts_another() -> None:
    d = detok()
    assert [d.add(t) for t in (2, 9, 10)] == ["", "é", "€"]


def test_flush_of_an_incomplete_tail_gives_replacement_character() -> None:
    d = detok()
    assert d.add(1) == "caf"
    assert d.add(2) == ""
    assert d.flush() == "\ufffd"
    assert d.flush() == ""


def test_flush_of_a_partial_four_byte_character() -> None:
    d = detok()
    assert d.add(4) + d.add(5) == ""
    assert d.flush() == "\ufffd"


def test_invalid_byte_is_replaced_and_decoding_goes_on() -> None:
    d = detok()
    assert d.add(8) == "\ufffd"
    assert d.add(1) == "caf"


def test_concatenation_equals_one_shot_decode() -> None:
    tokens = [1, 2, 3, 7, 4, 5, 6, 2, 9, 10, 7]
    d = detok()
    streamed = "".join(d.add(t) for t in tokens) + d.flush()
    assert streamed == b"".join(PIECES[t] for t in tokens).decode()
