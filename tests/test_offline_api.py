"""The offline API on SmolLM2 (fp32, CPU): sampling behaviour, n > 1, chat, bad input."""

from __future__ import annotations

import pytest

from flexserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(smollm2_dir) -> LLM:
    return LLM(smollm2_dir, max_model_len=256)


def test_same_seed_same_output_and_different_seed_differs(llm):
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=1234)
    a = llm.generate("Once upon a time", params, use_tqdm=False)[0].outputs[0].token_ids
    # Same request inside a different batch: the seed alone decides the tokens.
    batch = llm.generate(
        ["Tell me a story.", "Once upon a time", "Hello"], params, use_tqdm=False
    )
    assert batch[1].outputs[0].token_ids == a
    other = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=16, seed=4321)
    b = llm.generate("Once upon a time", other, use_tqdm=False)[0].outputs[0].token_ids
    assert a != b


def test_stop_string_cuts_text_and_reports_reason(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    full = llm.generate("1, 2, 3, 4, 5,", greedy, use_tqdm=False)[0].outputs[0].text
    assert " 8" in full, full
    stopped = llm.generate(
        "1, 2, 3, 4, 5,", SamplingParams(temperature=0.0, max_tokens=24, stop=[" 8"]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.text == full[: full.index(" 8")]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " 8"
    kept = llm.generate(
        "1, 2, 3, 4, 5,",
        SamplingParams(temperature=0.0, max_tokens=24, stop=[" 8"], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == full[: full.index(" 8") + 2]


def test_stop_token_ids_and_max_tokens(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    out = llm.generate("1, 2, 3, 4, 5,", greedy, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    target = out.token_ids[3]
    stopped = llm.generate(
        "1, 2, 3, 4, 5,", SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[target]),
        use_tqdm=False,
    )[0].outputs[0]
    first = out.token_ids.index(target)
    assert stopped.token_ids == out.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == target


def test_min_tokens_and_ignore_eos(llm):
    # The chat model ends a short answer with EOS (<|im_end|>) quickly.
    messages = [{"role": "user", "content": "Say just the word yes."}]
    short = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)
    short = short[0].outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 64
    eos = llm.get_tokenizer().eos_token_id
    assert short.token_ids[-1] == eos
    forced = llm.chat(
        messages, SamplingParams(temperature=0.0, max_tokens=64, min_tokens=len(short.token_ids) + 5),
        use_tqdm=False,
    )[0].outputs[0]
    assert len(forced.token_ids) >= len(short.token_ids) + 5
    assert eos not in forced.token_ids[: len(short.token_ids) + 4]
    ignored = llm.chat(
        messages, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert len(ignored.token_ids) == 20 and ignored.finish_reason == "length"


def test_n_completions_share_prompt_blocks(llm):
    params = SamplingParams(n=3, temperature=0.8, max_tokens=8, seed=7)
    out = llm.generate("The weather today is", params, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert llm.engine.scheduler.kv_cache_usage == 0.0


def test_token_id_prompts_and_order(llm):
    tok = llm.get_tokenizer()
    prompts = [tok.encode("Hello there"), tok.encode("The sky is")]
    greedy = SamplingParams(temperature=0.0, max_tokens=5)
    by_ids = llm.generate(prompts, greedy, use_tqdm=False)
    by_text = llm.generate(["Hello there", "The sky is"], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in by_ids] == [o.outputs[0].token_ids for o in by_text]
    assert by_ids[0].prompt_token_ids == prompts[0]


def test_multibyte_text_is_detokenized_whole(llm):
    out = llm.generate("Écris « bonjour » en japonais : こんにちは、", SamplingParams(
        temperature=0.0, max_tokens=16), use_tqdm=False)[0].outputs[0]
    tok = llm.get_tokenizer()
    assert out.text == tok.decode(out.token_ids, skip_special_tokens=True)
    assert "\ufffd" not in out.text


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "empty"),
        ([], SamplingParams(), "empty"),
        ([1, 2, 10**9], SamplingParams(), "vocabulary"),
        ("x " * 400, SamplingParams(), "max_model_len"),
    ],
)
def test_bad_prompts_raise_value_error(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompt, params, use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.5}, "temperature"),
        ({"n": 0}, "n"),
        ({"logprobs": 50}, "logprobs"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ],
)
def test_bad_sampling_params_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_model_path_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist|unknown|not found"):
        LLM(str(tmp_path / "no-such-model"))


def test_unknown_llm_argument_raises_value_error(smollm2_dir):
    with pytest.raises(ValueError, match="unknown LLM argument"):
        LLM(smollm2_dir, max_num_batched_tokenz=3)


def test_chat_uses_template(llm):
    out = llm.chat([{"role": "user", "content": "What is 2+2?"}],
                   SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>system")
    assert out.prompt.endswith("<|im_start|>assistant\n")
    assert out.outputs[0].text
