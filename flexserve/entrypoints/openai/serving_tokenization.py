"""`POST /tokenize` and `POST /detokenize` (vLLM's shapes): a prompt or a conversation (through the
chat template, with its tools) to token ids, and token ids back to text."""

from __future__ import annotations

from starlette.requests import Request

from flexserve.entrypoints.openai.errors import bad_request
from flexserve.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from flexserve.entrypoints.openai.serving_chat import OpenAIServingChat


class OpenAIServingTokenization(OpenAIServingChat):
    """Tokenizes as the completions and chat endpoints do, so counts match their usage."""

    def _tokenizer(self):
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise bad_request("this model has no tokenizer")
        return tokenizer

    def tokenize(self, request: TokenizeCompletionRequest | TokenizeChatRequest,
                 raw_request: Request) -> TokenizeResponse:
        if request.model is not None:
            self.check_model(request.model, raw_request)
        tokenizer = self._tokenizer()
        if isinstance(request, TokenizeChatRequest):
            text, token_ids = self.render_chat(request.messages, request.add_generation_prompt,
                                               request.tools, request.chat_template_kwargs)
            if request.add_special_tokens:
                token_ids = list(tokenizer.encode(text, add_special_tokens=True))
        else:
            token_ids = list(tokenizer.encode(request.prompt,
                                              add_special_tokens=request.add_special_tokens))
        return TokenizeResponse(count=len(token_ids), max_model_len=self.max_model_len,
                                tokens=token_ids)

    def detokenize(self, request: DetokenizeRequest, raw_request: Request) -> DetokenizeResponse:
        if request.model is not None:
            self.check_model(request.model, raw_request)
        tokenizer = self._tokenizer()
        vocab_size = self.engine.input_processor.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                              param="tokens")
        return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))
