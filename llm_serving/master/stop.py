"""Stop strings on streamed text: the text a client sees never contains a stop string, even when one
arrives split across tokens.

Streaming must not show characters that may turn out to begin a stop string, so the longest tail of the
text that is the beginning of some stop string is held back until the next token shows whether it is
(or the request ends for another reason and `flush` releases it). A match can only end in the newest
piece, so each push searches only where such a match could start, and the held-back tail is looked up
among the stops' prefixes that end in the text's last character.
"""
from __future__ import annotations


class StopStrings:
    def __init__(self, stops):
        self.stops = tuple(s for s in stops if s)
        self.hold = max(map(len, self.stops), default=1) - 1
        # proper prefixes of the stops by their last character, longest first: the text's tail can only be
        # one of those that end in the text's last character
        self._prefixes: dict = {}
        for p in sorted({s[:k] for s in self.stops for k in range(1, len(s))}, key=len, reverse=True):
            self._prefixes.setdefault(p[-1], []).append(p)
        self.text = ""          # everything pushed, up to the stop string once one matched
        self.sent = 0           # characters of text already released
        self.stopped = False
        self.matched = None     # the stop string that ended the text (Anthropic's stop_sequence names it)

    def push(self, piece: str) -> str:
        """Add a token's text; return what may be shown now. Sets `stopped` when a stop string completed:
        the returned text then ends just before it, and nothing more is released."""
        if self.stopped or not piece:
            return ""
        start = max(len(self.text) - self.hold, 0)     # a new match must end inside `piece`
        self.text += piece
        hits = [(i, s) for i, s in ((self.text.find(s, start), s) for s in self.stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            self.stopped = True
            self.text = self.text[:at]
            return self._release(len(self.text))
        return self._release(len(self.text) - self._open_prefix())

    def _open_prefix(self) -> int:
        """Length of the longest tail of text that begins some stop string (and may still complete it)."""
        if not self.text:
            return 0
        return next((len(p) for p in self._prefixes.get(self.text[-1], ()) if self.text.endswith(p)), 0)

    def flush(self) -> str:
        """The request ended for another reason: release what was held back."""
        return "" if self.stopped else self._release(len(self.text))

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:upto], upto
        return out
