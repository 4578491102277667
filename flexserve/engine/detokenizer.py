"""Incremental detokenization: output text that grows token by token, never half a character.

The prefix/read-offset algorithm of TGI and vLLM: decode a short window of recent tokens twice,
without and with the new ones, and emit only the difference. The window supplies the context that
decoders need (sentencepiece's leading space), and a decode that ends in U+FFFD means a character
whose UTF-8 bytes are split across tokens is not complete yet, so its text is held back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as context for the first output token (vLLM uses the same 5).
_NUM_PROMPT_CONTEXT_TOKENS = 5


def fast_decode_fn(tokenizer: Any) -> Callable[[list[int], bool], str] | None:
    """`decode(ids, skip_special_tokens)` straight on the Rust tokenizer under a transformers
    fast tokenizer whose `decode` is the stock one; None for any other tokenizer.

    transformers' `decode` adds ~6 us of Python per call (argument conversion, dispatch) around
    a ~2 us Rust decode; with clean-up off it returns exactly what the backend returns.
    """
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    decode, _decode = getattr(cls, "decode", None), getattr(cls, "_decode", None)
    if backend is None or decode is None or _decode is None:
        return None
    if (decode.__qualname__ != "PreTrainedTokenizerBase.decode"
            or _decode.__qualname__ not in _STOCK_FAST_DECODES
            or not cls.__module__.startswith("transformers.")
            or type(backend).__module__ != "tokenizers"):
        return None
    backend_decode = backend.decode
    return lambda ids, skip_special_tokens: backend_decode(
        ids, skip_special_tokens=skip_special_tokens)


# The fast tokenizers' `_decode` (one name per transformers generation): a backend decode, then
# the optional clean-up that the detokenizer always turns off.
_STOCK_FAST_DECODES = ("TokenizersBackend._decode", "PreTrainedTokenizerFast._decode")


def decode_token(tokenizer: Any, token_id: int) -> str:
    """The text of one token on its own (logprob entries); special tokens are kept."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


class IncrementalDetokenizer:
    """Turns one sequence's output token ids into text as they arrive."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._fast_decode = fast_decode_fn(tokenizer)
        self.output_text = ""  # all text emitted so far
        # Context tail of the prompt followed by every output token; decoded only in windows.
        self._token_ids = list(prompt_token_ids[-_NUM_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0  # window start: tokens before it are already final text
        self._read_offset = len(self._token_ids)  # tokens before it have been emitted
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        if self._prefix_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character: output bytes could complete it, which would
            # change the prefix text itself. Start from the output alone instead.
            self._prefix_offset = self._read_offset
            self._prefix_text = ""

    def add_token_ids(self, token_ids: list[int]) -> str:
        """Append output tokens; return the text they finalize (possibly "")."""
        if not token_ids:
            return ""
        self._token_ids.extend(token_ids)
        new_text = self._decode(self._prefix_offset, len(self._token_ids))
        if len(new_text) <= len(self._prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        return self._emit(new_text)

    def flush(self) -> str:
        """Emit what is held back, incomplete characters included (the sequence has ended)."""
        new_text = self._decode(self._prefix_offset, len(self._token_ids))
        if len(new_text) <= len(self._prefix_text):
            return ""
        return self._emit(new_text)

    def _emit(self, new_text: str) -> str:
        delta = new_text[len(self._prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        self.output_text += delta
        return delta

    def _decode(self, start: int, end: int) -> str:
        if start >= end:
            return ""
        if self._fast_decode is not None:
            return self._fast_decode(self._token_ids[start:end], self.skip_special_tokens)
        return self.tokenizer.decode(
            self._token_ids[start:end],
            skip_special_tokens=self.skip_special_tokens,
            # Clean-up rewrites text across token boundaries, which windows cannot reproduce.
            clean_up_tokenization_spaces=False,
        )
