"""Grammar-constrained decoding: a request's output held to a JSON schema (``response_format``) or to a tool
call (``tool_choice``), by a logits processor that masks every token the grammar forbids at each step.

The token masks come from llguidance (the grammar engine vLLM and SGLang offer as their "guidance"
backend): it reads the checkpoint's ``tokenizer.json`` (or dsv3's own byte-level tokenizer), so every token,
multi-byte and special ones included, is judged by the bytes it stands for. A grammar ends with one of the
model's end-of-sequence tokens, which ends the request with finish_reason "stop".

JSON layout. The grammar writes JSON on one line with ", " between items and ": " after keys, as Python's
``json.dumps`` does: what models write unprompted, and no freedom to spend the token budget on blanks (a
grammar that allows any whitespace lets an unsure model pad without end).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dsv3.errors import DSV3Error

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class Grammars:
    """Compiles grammars for one tokenizer and model vocabulary. Reading the tokenizer into llguidance
    takes a moment on a 128K vocabulary, so it is done once, at the first constrained request."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int]):
        self.tokenizer, self.vocab_size, self.eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._ll = None

    def _lltokenizer(self):
        import llguidance

        if self._ll is None:
            if self.tokenizer is None:
                raise DSV3Error("structured output needs the model's tokenizer.json; this model has none")
            if not self.eos_ids:
                raise DSV3Error("structured output needs an end-of-sequence token to end the grammar; this "
                                "model's config and tokenizer name none")
            n_vocab = max(self.vocab_size, self.tokenizer.get_vocab_size(with_added_tokens=True))
            self._ll = llguidance.LLTokenizer(self.tokenizer.to_str(), n_vocab=n_vocab, eos_token=self.eos_ids)
        return self._ll

    def json_schema(self, schema: dict[str, Any], param: str) -> GrammarProcessor:
        """Output that is one JSON value valid under ``schema``."""
        import llguidance

        return self._compile(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS), param)

    def lark(self, grammar: str, param: str) -> GrammarProcessor:
        """Output in a Lark grammar (llguidance's dialect: ``%json {schema}`` embeds a JSON schema and
        ``<[id]>`` names a special token by its id)."""
        return self._compile(grammar, param)

    def recompile(self, grammar: str) -> GrammarProcessor:
        """A fresh processor for the grammar text of one compiled before (``GrammarProcessor.grammar``),
        already checked: how ``serve --ep`` gives a constrained request to the rank that decodes it, since a
        matcher cannot travel between processes but its grammar's text can."""
        return self._compile(grammar, "grammar")

    def _compile(self, grammar: str, param: str) -> GrammarProcessor:
        import llguidance

        matcher = llguidance.LLMatcher(self._lltokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise FieldError(f"{param}: cannot be compiled into a grammar: {matcher.get_error()}", param)
        return GrammarProcessor(matcher, self.vocab_size, self._lltokenizer().vocab_size, grammar)


class FieldError(DSV3Error):
    """A request field this module refuses (a schema the compiler cannot take, say): a 400 naming it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class GrammarProcessor:
    """The logits processor of one constrained request: the matcher follows the request's tokens (rolling
    back a rejected speculative draft) and every token the grammar forbids next gets -inf."""

    def __init__(self, matcher, vocab_size: int, matcher_vocab: int, grammar: str):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.grammar = grammar  # the text the matcher was compiled from (plain data: it crosses processes)
        self.consumed: list[int] = []
        self.bitmask = np.zeros((matcher_vocab + 31) // 32, dtype=np.int32)  # llguidance's size, >= vocab_size

    def __call__(self, tokens: list[int], logits: torch.Tensor) -> torch.Tensor:
        self._follow(tokens)
        return logits.masked_fill_(torch.from_numpy(~self.allowed()), float("-inf"))

    def allowed(self) -> np.ndarray:
        """bool [V]: the tokens the grammar allows next (one bit per token from llguidance, unpacked)."""
        self.matcher.unsafe_compute_mask_ptr(self.bitmask.ctypes.data, self.bitmask.nbytes)
        self._check()
        return np.unpackbits(self.bitmask.view(np.uint8), bitorder="little")[: self.vocab_size].astype(bool)

    def _follow(self, tokens: list[int]) -> None:
        """Bring the matcher to the state after ``tokens``: roll back what is no longer there (a rejected
        draft), consume what is new."""
        same = 0
        for a, b in zip(self.consumed, tokens, strict=False):
            if a != b:
                break
            same += 1
        if same < len(self.consumed):
            self.matcher.rollback(len(self.consumed) - same)
            del self.consumed[same:]
        for token in tokens[same:]:
            self.matcher.consume_token(token)
            self._check()
            self.consumed.append(token)

    def _check(self) -> None:
        if self.matcher.is_error():
            raise DSV3Error(f"the grammar matcher failed: {self.matcher.get_error()}")

