from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dflash.chat.parser import StopStrings


def run(stops, pieces):
    matcher = StopStrings(stops)
    out = "".join(matcher.push(piece) for piece in pieces)
    return out + matcher.flush(), matcher.hit is not None


def test_no_stop_strings_pass_everything_through():
    assert run([], ["ab", "c"]) == ("abc", False)


def test_stop_string_split_across_pieces_is_cut_exactly():
    assert run(["END"], ["hello E", "N", "D and more"]) == ("hello ", True)


def test_held_back_text_that_does_not_become_a_stop_is_released():
    matcher = StopStrings(["END"])
    assert matcher.push("hello EN") == "hello "
    assert matcher.push("X") == "ENX"


def test_earliest_of_several_stop_strings_wins():
    assert run(["world", "lo w"], ["hello world"]) == ("hel", True)


def test_empty_stop_strings_are_ignored():
    assert run(["", "z"], ["abc"]) == ("abc", False)


@given(st.text(alphabet="abc", max_size=30), st.text(alphabet="abc", min_size=1, max_size=4), st.data())
def test_matches_cutting_the_whole_text(text, stop, data):
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    index = text.find(stop)
    expected = (text[:index], True) if index >= 0 else (text, False)
    assert run([stop], pieces) == expected
