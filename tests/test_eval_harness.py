"""What evaluation harnesses send: lm-eval's `local-completions` model (log-likelihood through
`echo` + `logprobs` with `max_tokens` 0 or 1, greedy generation), `logit_bias`,
`client.models.retrieve`, and vLLM's `/tokenize` and `/detokenize`; numbers against HF
transformers on SmolLM2 in fp32."""

from __future__ import annotations

import math
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from flexserve.config import CacheConfig, EngineConfig, ModelConfig
from flexserve.entrypoints.engine_builder import build_async_engine
from flexserve.entrypoints.openai.api_server import ServerThread, build_app

MODEL = "smollm2"
MAX_MODEL_LEN = 512


@pytest.fixture(scope="module")
def server(smollm2_dir):
    config = EngineConfig(model=ModelConfig(model=smollm2_dir, max_model_len=MAX_MODEL_LEN),
                          cache=CacheConfig(kv_cache_gib=0.1))
    engine = build_async_engine(config, log_stats=False)
    thread = ServerThread(build_app(engine, served_model_name=MODEL))
    url = thread.start()
    yield SimpleNamespace(url=url, engine=engine, tokenizer=engine.tokenizer)
    thread.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()


def hf_continuation_logprobs(model, context: list[int], continuation: list[int]
                             ) -> tuple[float, bool]:
    """lm-eval's loglikelihood by HF: sum of the continuation's logprobs, and whether each
    continuation token is the argmax."""
    ids = torch.tensor([context + continuation])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
    rows = logprobs[len(context) - 1 : -1]
    target = torch.tensor(continuation)
    chosen = rows.gather(1, target.unsqueeze(1)).squeeze(1)
    return chosen.sum().item(), bool((rows.argmax(dim=-1) == target).all())


REQUESTS = [
    ("The capital of France is", " Paris"),
    ("The capital of France is", " a city in Germany"),
    ("2 + 2 =", " 4"),
    ("Question: What color is the sky on a clear day?\nAnswer:", " blue"),
]


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_loglikelihood_as_lm_eval_local_completions_matches_hf(server, client, hf_model,
                                                               max_tokens):
    tokenizer = server.tokenizer
    contexts = [tokenizer.encode(c) for c, _ in REQUESTS]
    continuations = [tokenizer.encode(c + x)[len(tokenizer.encode(c)):] for c, x in REQUESTS]
    # lm-eval's payload: token-id prompts, echo, logprobs=1, temperature 0, one batch
    response = client.completions.create(
        model=MODEL, prompt=[c + x for c, x in zip(contexts, continuations)],
        max_tokens=max_tokens, temperature=0, logprobs=1, echo=True, seed=1234)
    assert len(response.choices) == len(REQUESTS)
    for choice, context, continuation in zip(sorted(response.choices, key=lambda c: c.index),
                                             contexts, continuations):
        lp = choice.logprobs
        num_prompt = len(context) + len(continuation)
        # lm-eval's parse_logprobs: [ctxlen:-1] with max_tokens 1 drops the generated token
        end = num_prompt if max_tokens == 0 else -1
        assert len(lp.token_logprobs) == num_prompt + max_tokens
        token_logprobs = lp.token_logprobs[len(context):end]
        top_logprobs = lp.top_logprobs[len(context):end]
        assert len(token_logprobs) == len(continuation)
        total = sum(token_logprobs)
        is_greedy = all(t == max(top.values()) for t, top in zip(token_logprobs, top_logprobs))
        ref_total, ref_greedy = hf_continuation_logprobs(hf_model, context, continuation)
        assert total == pytest.approx(ref_total, abs=1e-3)
        assert is_greedy == ref_greedy
        if max_tokens == 0:
            assert choice.finish_reason == "length"
            assert choice.text == tokenizer.decode(context + continuation)
    if max_tokens == 0:
        assert response.usage.completion_tokens == 0
    # the answers differ: the test can tell a right number from a wrong one
    assert len({round(sum(c.logprobs.token_logprobs[1:]), 3) for c in response.choices}) > 1


def test_every_prompt_logprob_matches_hf(server, client, hf_model):
    ids = server.tokenizer.encode("Once upon a time, in a land far away, there lived a")
    response = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True,
                                         logprobs=0)
    got = response.choices[0].logprobs.token_logprobs
    assert got[0] is None
    with torch.no_grad():
        logprobs = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], dim=-1)
    ref = logprobs[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor(got[1:]), ref, atol=1e-4, rtol=0)


def test_streamed_prompt_only_echo(client, server):
    prompt = "Hello there, general"
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=0,
                                            echo=True, logprobs=1, stream=True))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == prompt
    tokens = [t for c in chunks if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.tokens]
    assert len(tokens) == len(server.tokenizer.encode(prompt))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_max_tokens_zero_needs_echo(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=0)
    assert e.value.body["param"] == "max_tokens"


def test_greedy_generation_as_lm_eval_matches_hf(server, client, hf_model):
    tokenizer = server.tokenizer
    context = "Question: What is the largest planet in the solar system?\nAnswer:"
    response = client.completions.create(model=MODEL, prompt=[context], max_tokens=12,
                                         temperature=0, stop=["\n\n", "Question:"], seed=1234)
    ids = tokenizer.encode(context)
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    ref = tokenizer.decode(out[0, len(ids):], skip_special_tokens=True)
    for stop in ("\n\n", "Question:"):
        ref = ref.split(stop)[0]
    assert response.choices[0].text == ref


def test_logit_bias_forces_and_bans_tokens(server, client):
    tokenizer = server.tokenizer
    token = tokenizer.encode(" banana")[0]
    response = client.completions.create(model=MODEL, prompt="The capital of France is",
                                         max_tokens=3, temperature=0,
                                         logit_bias={str(token): 100})
    assert response.choices[0].text == tokenizer.decode([token] * 3)
    free = client.completions.create(model=MODEL, prompt="The capital of France is",
                                     max_tokens=1, temperature=0, logprobs=0)
    first = tokenizer.encode(free.choices[0].text)[0]
    banned = client.completions.create(model=MODEL, prompt="The capital of France is",
                                       max_tokens=1, temperature=0,
                                       logit_bias={str(first): -100})
    assert tokenizer.encode(banned.choices[0].text)[0] != first
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2, temperature=0,
                                          logit_bias={str(token): 100})
    assert chat.choices[0].message.content == tokenizer.decode([token] * 2)


@pytest.mark.parametrize("bias, message", [
    ({"x": 1}, "token ids"), ({"99999999": 1}, "outside the vocabulary"),
    ({"5": 101}, "less than or equal to 100"), ({"-1": 1}, "outside the vocabulary"),
])
def test_bad_logit_bias_is_a_400(client, bias, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1, logit_bias=bias)
    assert e.value.body["param"] == "logit_bias" and message in e.value.body["message"]


def test_models_retrieve(server, client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert card.model_dump()["max_model_len"] == MAX_MODEL_LEN
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"
    nested = httpx.get(server.url + "/v1/models/org/no-such-model")
    assert nested.status_code == 404


def test_tokenize_and_detokenize(server):
    tokenizer = server.tokenizer
    text = "Hello, world! Tokenize me."
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text})
    assert r.status_code == 200
    body = r.json()
    assert body["tokens"] == tokenizer.encode(text)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN
    back = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    messages = [{"role": "user", "content": "Hi!"}]
    chat = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat.json()["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)


@pytest.mark.parametrize("path, body, param", [
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"model": "nope", "prompt": "x"}, "model"),
    ("/tokenize", {"messages": []}, "messages"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_bad_tokenize_requests_are_4xx(server, path, body, param):
    r = httpx.post(server.url + path, json=body)
    assert 400 <= r.status_code < 500
    assert r.json()["error"]["param"] == param


def test_logprobs_are_finite_numbers(client):
    response = client.completions.create(model=MODEL, prompt="a b c d", max_tokens=0, echo=True,
                                         logprobs=2)
    lp = response.choices[0].logprobs
    assert all(math.isfinite(x) and x <= 0 for x in lp.token_logprobs[1:])
