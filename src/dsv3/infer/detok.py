"""Incremental detokenization with stop strings, for streaming.

Text is released only when it can no longer change: an incomplete UTF-8 sequence at the end (decoded as
U+FFFD) and any tail that could still grow into a stop string are held back until the next token.
"""

from __future__ import annotations

from functools import cache


class TextStream:
    """Feeds token ids one at a time; returns the new text that is safe to show."""

    def __init__(self, tokenizer=None, stop_strings: tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stops = tuple(s for s in stop_strings if s)
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0  # characters of self.text already released

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one token; returns (text delta, whether a stop string was completed)."""
        self.ids.append(token_id)
        if self.tokenizer is None:
            return "", False
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        cut = self._stop_index()
        if cut is not None:
            return self._release(cut), True
        safe = len(self.text) - (1 if self.text.endswith("\ufffd") else 0)
        return self._release(safe - self._held_for_stops(safe)), False

    def flush(self) -> str:
        """Whatever is still held back, at the end of generation."""
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        upto = max(upto, self.sent)
        delta = self.text[self.sent : upto]
        self.sent = upto
        return delta

    def _stop_index(self) -> int | None:
        longest = max((len(s) for s in self.stops), default=0)
        start = max(0, self.sent - longest)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def _held_for_stops(self, end: int) -> int:
        """Length of the longest tail of text[:end] that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, end), best, -1):
                if self.text[end - n : end] == s[:n]:
                    best = n
                    break
        return best


def token_text_and_bytes(tokenizer, token_id: int) -> tuple[str, list[int]]:
    """One token as OpenAI's logprobs show it: its text and its UTF-8 bytes. A byte-level BPE token may
    hold part of a character: its bytes are then the real ones (from the byte alphabet), and its text
    the decodable part. Without a tokenizer the token is named by its id."""
    if tokenizer is None:
        text = f"token_id:{token_id}"
        return text, list(text.encode())
    piece = tokenizer.id_to_token(token_id)
    table = _byte_level_decoder()
    if type(tokenizer.decoder).__name__ == "ByteLevel" and piece and all(c in table for c in piece):
        raw = bytes(table[c] for c in piece)
        return raw.decode("utf-8", errors="replace"), list(raw)
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return text, list(text.encode())


@cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-printable-character table (the ``ByteLevel`` alphabet), inverted."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}
