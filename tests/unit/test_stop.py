from hypothesis import given, strategies as st

from llm_serving.master.stop import StopStrings


def run(stops, pieces):
    """(text shown, stopped) after streaming pieces, flushing at the end when no stop matched."""
    s = StopStrings(stops)
    shown = "".join(s.push(p) for p in pieces)
    return shown + s.flush(), s.stopped


def test_stop_string_split_across_tokens_is_cut_and_never_shown():
    s = StopStrings(["\nUser:"])
    shown = [s.push(p) for p in ["Hello", " there", "\n", "Us", "er", ":", " more"]]
    assert "".join(shown) == "Hello there" and s.stopped
    assert shown[2:] == ["", "", "", "", ""]                 # "\nUs..." was held back, then cut
    assert s.flush() == ""


def test_only_a_tail_that_may_begin_a_stop_is_held_back():
    s = StopStrings(["STOP"])
    assert s.push("ab") == "ab"                              # cannot begin "STOP": shown at once
    assert s.push("ST") == "" and s.push("x") == "STx"       # "ST" might have been; "STx" is not
    assert s.push("S") == "" and s.flush() == "S" and not s.stopped


def test_earliest_of_several_stops_wins_and_no_stops_changes_nothing():
    assert run(["b", "abc"], ["xab", "c"]) == ("xa", True)
    s = StopStrings(["abc", "b"])                # the match says which stop it was (Anthropic's stop_sequence)
    assert s.push("xab") == "xa" and s.matched == "b"
    assert StopStrings(["b"]).matched is None
    assert run([], ["a", "b"]) == ("ab", False)
    assert run(["."], [".", "x"]) == ("", True)


@given(st.lists(st.text(alphabet="ab.\n", max_size=4), max_size=12),
       st.lists(st.text(alphabet="ab.\n", min_size=1, max_size=3), min_size=1, max_size=3))
def test_shown_text_is_the_text_cut_before_the_first_stop(pieces, stops):
    """In stream order: the first piece after which some stop appears ends the text, cut before the
    earliest-starting stop in the text so far (generation ends there: a stop that would only be completed by
    later pieces, though it starts earlier, never comes)."""
    full, cut = "", None
    for piece in pieces:
        full += piece
        found = [i for i in (full.find(s) for s in stops) if i >= 0]
        if found:
            cut = min(found)
            break
    shown, stopped = run(stops, pieces)
    assert stopped == (cut is not None)
    assert shown == (full if cut is None else full[:cut])
    assert not any(s in shown for s in stops)
