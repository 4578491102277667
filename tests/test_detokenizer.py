"""Incremental detokenization matches a one-shot decode and never shows half a character."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flexserve.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer, decode_token

from _tokenizer import smollm2_tokenizer, tiny_byte_level_tokenizer

TEXTS = [
    "Hello, world!",
    " leading space and  double  spaces\n\nnew lines\ttabs",
    "café naïve résumé Ångström",
    "日本語のテキストと中文字符",
    "emoji 🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "mixed: abc 世界 ü 🎉 end.",
    "Answer<|im_end|>",
    "<|im_start|>assistant\n你好<|im_end|> more 🎉<|endoftext|>",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝛼𝛽 and 한국어",
]
PROMPT = "<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n"


def _stream(tokenizer, prompt_ids, output_ids, skip_special_tokens):
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens)
    deltas = [detokenizer.add_token_ids([token_id]) for token_id in output_ids]
    return detokenizer, deltas


@pytest.mark.parametrize("make_tokenizer", [smollm2_tokenizer, tiny_byte_level_tokenizer])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_decode(make_tokenizer, skip_special_tokens, text):
    tokenizer = make_tokenizer()
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=False)
    output_ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer, deltas = _stream(tokenizer, prompt_ids, output_ids, skip_special_tokens)
    expected = tokenizer.decode(output_ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == detokenizer.output_text == expected
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
    assert detokenizer.flush() == ""


def test_multi_byte_characters_are_held_until_complete():
    tokenizer = smollm2_tokenizer()
    output_ids = tokenizer.encode("🎉", add_special_tokens=False)
    assert len(output_ids) > 1  # the emoji's bytes are split across tokens
    detokenizer, deltas = _stream(tokenizer, [], output_ids, True)
    assert deltas == [""] * (len(output_ids) - 1) + ["🎉"]


def test_several_tokens_per_call_and_empty_prompt():
    tokenizer = smollm2_tokenizer()
    output_ids = tokenizer.encode("chunks of 世界 text 🎉!", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(tokenizer, [])
    deltas = [detokenizer.add_token_ids(output_ids[i:i + 3]) for i in range(0, len(output_ids), 3)]
    assert "".join(deltas) == tokenizer.decode(output_ids)
    assert detokenizer.add_token_ids([]) == ""


def test_flush_emits_an_unfinished_character():
    tokenizer = smollm2_tokenizer()
    output_ids = tokenizer.encode("ok 🎉", add_special_tokens=False)[:-1]
    detokenizer, deltas = _stream(tokenizer, [], output_ids, True)
    assert REPLACEMENT_CHAR not in detokenizer.output_text
    detokenizer.flush()
    assert detokenizer.output_text == tokenizer.decode(output_ids)
    assert detokenizer.output_text.endswith(REPLACEMENT_CHAR)


def test_prompt_ending_inside_a_character():
    tokenizer = smollm2_tokenizer()
    ids = tokenizer.encode("say 🎉 now", add_special_tokens=False)
    # Split the emoji's bytes between prompt and output: the output decodes on its own.
    split = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detokenizer, deltas = _stream(tokenizer, ids[:split], ids[split:], True)
    assert detokenizer.output_text == tokenizer.decode(ids[split:])


def test_first_token_keeps_its_leading_space_after_the_prompt():
    tokenizer = smollm2_tokenizer()
    prompt_ids = tokenizer.encode("The answer is", add_special_tokens=False)
    output_ids = tokenizer.encode(" forty two", add_special_tokens=False)
    detokenizer, deltas = _stream(tokenizer, prompt_ids, output_ids, True)
    assert detokenizer.output_text == " forty two"


def test_decode_token():
    tokenizer = smollm2_tokenizer()
    (im_end,) = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert decode_token(tokenizer, im_end) == "<|im_end|>"
    assert decode_token(tokenizer, tokenizer.encode(" the", add_special_tokens=False)[0]) == " the"


# Surrogates cannot be encoded and a literal U+FFFD would look like an incomplete character.
_ANY_TEXT = st.text(
    alphabet=st.characters(exclude_categories=("Cs",), exclude_characters="\ufffd"), max_size=40)
# SmolLM2's vocabulary lacks a few byte tokens (some control bytes, UTF-8 lead bytes 0xF1+), so
# text outside this range does not round-trip through it at all.
_SMOLLM2_TEXT = st.text(
    alphabet=st.characters(max_codepoint=0x3FFFF, exclude_categories=("Cs", "Cc"),
                           exclude_characters="\ufffd"),
    max_size=40,
)


def _check_random(tokenizer, prompt, text, skip_special_tokens):
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    output_ids = tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)
    detokenizer, deltas = _stream(tokenizer, prompt_ids, output_ids, skip_special_tokens)
    assert detokenizer.output_text == tokenizer.decode(
        output_ids, skip_special_tokens=skip_special_tokens)
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=_SMOLLM2_TEXT, text=_SMOLLM2_TEXT, skip_special_tokens=st.booleans())
def test_random_unicode_matches_decode(prompt, text, skip_special_tokens):
    _check_random(smollm2_tokenizer(), prompt, text, skip_special_tokens)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=_ANY_TEXT, text=_ANY_TEXT, skip_special_tokens=st.booleans())
def test_random_unicode_matches_decode_tiny_tokenizer(prompt, text, skip_special_tokens):
    _check_random(tiny_byte_level_tokenizer(), prompt, text, skip_special_tokens)
