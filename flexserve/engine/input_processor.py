"""Turns user prompts (text, token ids, chat messages) into validated token-id lists."""

from __future__ import annotations

import importlib.util
from typing import Any, Sequence

from flexserve.sampling_params import SamplingParams

Prompt = str | Sequence[int]
# Slack on the character bound below, for normalizers that drop characters (whitespace, accents).
_NORMALIZER_SLACK = 2


def max_token_chars(tokenizer: Any | None) -> int | None:
    """The longest vocabulary entry in characters (None when unknown). A token decodes to at
    most that many bytes, so a prompt of C characters has at least C / max_token_chars tokens:
    a prompt far too long for the context is refused without tokenizing it."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        vocab = get_vocab()
    except Exception:  # a tokenizer without a vocabulary listing: no bound
        return None
    return max((len(token) for token in vocab), default=None) if isinstance(vocab, dict) else None


class InputProcessor:
    """Tokenizes and validates prompts against the model's vocabulary and context length."""

    def __init__(self, tokenizer: Any | None, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        token_chars = max_token_chars(tokenizer)
        # prompts with more characters than this surely exceed the context (max_token_chars)
        self.max_prompt_chars = (None if token_chars is None
                                 else _NORMALIZER_SLACK * token_chars * max_model_len)

    def process(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        """Returns (prompt text or None, token ids); raises ValueError on bad input."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass token ids instead of text")
            self.check_text_length(prompt)
            return self.validate(prompt, list(self.tokenizer.encode(prompt)))
        if isinstance(prompt, Sequence) and not isinstance(prompt, (bytes, bytearray)):
            token_ids = list(prompt)
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in token_ids):
                raise ValueError("a token-id prompt must be a list of integers")
            bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(
                    f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})"
                )
            return self.validate(None, token_ids)
        raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")

    def check_text_length(self, text: str) -> None:
        """ValueError, without tokenizing, for a text with far more characters than the
        context can hold as tokens."""
        if self.max_prompt_chars is not None and len(text) > self.max_prompt_chars:
            raise ValueError(
                f"the prompt has {len(text)} characters, more than the model's context length "
                f"(max_model_len) of {self.max_model_len} tokens can hold")

    def check_params(self, params: SamplingParams) -> None:
        """What `SamplingParams` cannot check alone: logit_bias ids inside the vocabulary, and
        what structured outputs need (the tokenizer and the xgrammar package)."""
        for token_id in params.logit_bias or {}:
            if token_id >= self.vocab_size:
                raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary "
                                 f"[0, {self.vocab_size})")
        if params.structured_outputs is not None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer; this model has "
                                 "none")
            if importlib.util.find_spec("xgrammar") is None:
                raise ValueError("structured outputs need the xgrammar package, which this "
                                 "server does not have: pip install 'flexserve[structured]'")

    def validate(self, text: str | None, token_ids: list[int]) -> tuple[str | None, list[int]]:
        """Checks a tokenized prompt against the context length."""
        if not token_ids:
            raise ValueError("prompt must not be empty")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(token_ids)} tokens, but the model's context length "
                f"(max_model_len) is {self.max_model_len}: at most {self.max_model_len - 1} prompt "
                "tokens leave room for one generated token"
            )
        return text, token_ids

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """Generation limit: params.max_tokens, capped by what the context length leaves."""
        room = self.max_model_len - num_prompt_tokens
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render messages with the tokenizer's chat template into prompt text."""
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer, so it has no chat template")
        if not messages:
            raise ValueError("messages must not be empty")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m:
                raise ValueError("each message must be an object with a 'role'")
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template")
        try:
            return self.tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                **(chat_template_kwargs or {}),
            )
        except Exception as e:  # jinja errors carry the template's own message
            raise ValueError(f"cannot apply the chat template: {e}") from e

    def encode_chat_prompt(self, text: str) -> list[int]:
        """Chat templates already contain the special tokens; do not add them again."""
        self.check_text_length(text)
        return list(self.tokenizer.encode(text, add_special_tokens=False))
