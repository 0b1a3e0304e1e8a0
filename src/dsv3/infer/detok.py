"""Incremental detokenization with stop strings, for streaming.

Text is released only when it can no longer change: an incomplete UTF-8 sequence at the end (decoded as
U+FFFD) and any tail that could still grow into a stop string are held back until the next token.

Each token decodes a short window of the newest ids, not the whole sequence, whose decode grows with every
token (a byte-level BPE's: 0.23 ms at 1,024 ids, 1.2 ms at 4,096, against 3-4 us a token for the window;
``benchmarks/detok_cost.py``), paid per row per step on the decode thread. A token's text can depend on
the tokens before it (the bytes of a character split across tokens, a SentencePiece decoder's leading
space), so the window starts at the tokens released the time before last, and the new text is what
decoding the window adds to decoding it without the newest tokens: the scheme of Hugging Face's
text-generation-inference and of vLLM. A window grows while its text ends in an incomplete character.
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
        self.text = ""  # the text of ids[:read]
        self.sent = 0  # characters of self.text already released
        self.prefix = self.read = 0  # the window: ids[prefix:] decoded, its text up to ids[read] known already
        self._known: int | None = 0  # len of the text of ids[prefix:read] (None: not decoded since the window moved)

    def state(self) -> tuple:
        """What ``restore`` takes to go on from here (a row handed to another process)."""
        return list(self.ids), self.text, self.sent, self.prefix, self.read

    def restore(self, state: tuple) -> None:
        ids, self.text, self.sent, self.prefix, self.read = state
        self.ids, self._known = list(ids), None

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one token; returns (text delta, whether a stop string was completed)."""
        self.ids.append(token_id)
        if self.tokenizer is None:
            return "", False
        pending = self._advance(final=False)
        cut = self._stop_index(pending)
        if cut is not None:
            self.text += pending  # a stop string may end in the held-back text: the text stops there anyway
            return self._release(cut), True
        return self._release(len(self.text) - self._held_for_stops(len(self.text))), False

    def _advance(self, final: bool) -> str:
        """Append the window's new text to ``text`` once it ends in a whole character (``final``: whatever it
        ends in) and move the window on; else return that new text, held back."""
        if self._known is None:  # once per move of the window, not once per token
            self._known = len(self._decode(self.ids[self.prefix : self.read]))
        known, window = self._known, self._decode(self.ids[self.prefix :])
        if len(window) <= known:
            return ""
        if final or not window.endswith("\ufffd"):
            self.text += window[known:]
            self.prefix, self.read, self._known = self.read, len(self.ids), None
            return ""
        return window[known:]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def flush(self) -> str:
        """Whatever is still held back, at the end of generation."""
        if self.tokenizer is not None:
            self._advance(final=True)
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        upto = max(upto, self.sent)
        delta = self.text[self.sent : upto]
        self.sent = upto
        return delta

    def _stop_index(self, pending: str) -> int | None:
        """Where the first stop string starts in ``text`` followed by ``pending``, looked for from a stop
        string's length before what was released (None: nowhere)."""
        if not self.stops:
            return None
        longest = max(len(s) for s in self.stops)
        start = max(0, self.sent - longest)
        text = self.text + pending if pending else self.text
        hits = [i for i in (text.find(s, start) for s in self.stops) if i >= 0]
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
