"""Structured outputs: the sampler's bitmask against xgrammar's own, JSON-schema, regex, choice
and grammar constraints on SmolLM2 in batches that mix constrained, free and LoRA rows (with and
without asynchronous scheduling), and the OpenAI server's `response_format` and `guided_*`."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Annotated, Literal

import openai
import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from flexserve import LLM, LoRARequest, SamplingParams, StructuredOutputsParams
from flexserve.config import CacheConfig, EngineConfig, ModelConfig
from flexserve.entrypoints.engine_builder import build_async_engine
from flexserve.entrypoints.openai.api_server import ServerThread, build_app
from flexserve.layers.sampler import apply_token_bitmask
from flexserve.peft.bypass import target_shapes
from flexserve.peft.lora import LoRAAdapter
from flexserve.peft.peft_io import save_peft_adapter

xgr = pytest.importorskip("xgrammar")

MODEL = "smollm2"


class Person(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(max_length=40)
    age: int
    city: Literal["Paris", "London", "Tokyo"]


class Inventory(BaseModel):
    model_config = ConfigDict(extra="forbid")
    items: list[Annotated[str, Field(max_length=20)]] = Field(min_length=1, max_length=3)
    in_stock: bool
    price: float = Field(ge=0, le=1000)


class Point(BaseModel):
    x: int = Field(ge=-100, le=100)
    y: int = Field(ge=-100, le=100)


SCHEMAS = [Person, Inventory, Point]


def person_prompt(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Describe person number {i} as JSON."}]


@pytest.fixture(scope="module")
def adapter_dir(smollm2_dir, tmp_path_factory) -> str:
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(smollm2_dir)
    generator = torch.Generator().manual_seed(0)
    adapter = LoRAAdapter.create(target_shapes(hf_config), hf_config.num_hidden_layers, 8, 16.0,
                                 ("q_proj", "v_proj", "down_proj"), generator=generator)
    for _, b in adapter.weights.values():
        b.copy_(torch.randn(b.shape, generator=generator) * 0.3)
    path = tmp_path_factory.mktemp("adapters") / "tuned"
    save_peft_adapter(adapter, str(path))
    return str(path)


@pytest.fixture(scope="module")
def llm(smollm2_dir) -> LLM:
    return LLM(smollm2_dir, max_model_len=1024, kv_cache_gib=0.25, max_lora_rank=8)


def test_bitmask_matches_xgrammar_reference():
    generator = torch.Generator().manual_seed(0)
    vocab_size = 1000  # not a multiple of 32
    logits = torch.randn(5, vocab_size, generator=generator)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (5, (vocab_size + 31) // 32),
                            generator=generator, dtype=torch.int64).to(torch.int32)
    bitmask[2] = -1  # an unconstrained row: all bits set
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask)
    got = apply_token_bitmask(logits, bitmask)
    assert torch.equal(got, expected)
    assert torch.equal(got[2], logits[2])
    assert torch.isinf(got).sum() > vocab_size  # the masks do remove tokens


def test_padded_vocabulary_rows_allow_only_the_grammars_tokens(smollm2_dir):
    """A model vocabulary larger than its tokenizer (padding rows): the matchers work over the
    tokenizer's ids, constrained rows allow exactly xgrammar's tokens among them and no padding
    id, free rows allow everything."""
    from transformers import AutoTokenizer

    from flexserve.engine.plan import ScheduledSequence
    from flexserve.worker.structured_outputs import GrammarManager

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    padded = len(tokenizer) + 77  # not a multiple of 32
    manager = GrammarManager(tokenizer, padded, [tokenizer.eos_token_id])
    assert manager.grammar_vocab_size == len(tokenizer)
    schema = json.dumps(Point.model_json_schema())
    constrained = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(
        json=schema))
    prefix = tokenizer.encode('{"x": 1', add_special_tokens=False)
    rows = [ScheduledSequence(f"r{i}", [prefix[-1]], 3 + len(prefix) - 1, [], True, params,
                              [1, 2, 3], list(prefix), tokenizer.eos_token_id, None)
            for i, params in enumerate([constrained, SamplingParams(max_tokens=8), constrained])]
    bitmask = manager.bitmask(rows, torch.device("cpu"))
    assert bitmask.shape == (3, (padded + 31) // 32)
    allowed = ((bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool()
    allowed = allowed.view(3, -1)[:, :padded]
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer),
                                              stop_token_ids=[tokenizer.eos_token_id])
    matcher = xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_json_schema(
        schema, any_whitespace=False))
    for token_id in prefix:
        assert matcher.accept_token(token_id)
    reference = xgr.allocate_token_bitmask(1, len(tokenizer))
    matcher.fill_next_token_bitmask(reference, 0)
    expected = ((reference.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool()
    expected = expected.view(-1)[:len(tokenizer)]
    for row in (0, 2):
        assert torch.equal(allowed[row, :len(tokenizer)], expected)
        assert not allowed[row, len(tokenizer):].any()
    assert 0 < int(expected.sum()) < len(tokenizer)  # the grammar does restrict the next token
    assert allowed[1].all()


def test_constraints_compile_when_requests_are_prepared(llm):
    """A server prepares requests on its worker threads: the grammar compiles there, and the
    engine's step, which every running request waits for, finds it compiled."""
    import threading

    engine = llm.engine
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        regex=r"[0-9]{3}-unique-to-this-test"))
    compiled_on: list[str] = []
    prepared = []

    def prepare() -> None:
        prepared.append(engine.process_inputs("prep-0", "Three digits:", params))

    runner = engine.executor
    original = runner._grammars()._compile

    def spy(p):
        compiled_on.append(threading.current_thread().name)
        return original(p)

    runner.grammars._compile = spy
    try:
        thread = threading.Thread(target=prepare, name="server-worker")
        thread.start()
        thread.join()
        engine.add_prepared_request(prepared[0])
        while engine.has_unfinished_requests():
            engine.step()
        assert compiled_on == ["server-worker"]  # once, and not in the steps
    finally:
        del runner.grammars._compile
    bad = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(
        grammar='root ::= "a" undefined_rule'))
    with pytest.raises(ValueError, match="structured outputs"):
        engine.process_inputs("prep-1", "x", bad)


def mixed_batch(llm: LLM, adapter: str):
    """Eight conversations: JSON schemas (base and LoRA), regex, choice, grammar, json_object,
    and two free rows; greedy and seeded sampling."""
    lora = LoRARequest("tuned", 1, adapter)
    json_params = [StructuredOutputsParams(json=json.dumps(s.model_json_schema())) for s in SCHEMAS]
    rows = [
        (person_prompt(1), SamplingParams(temperature=0, max_tokens=80,
                                          structured_outputs=json_params[0]), None),
        (person_prompt(2), SamplingParams(temperature=0.9, seed=7, max_tokens=80,
                                          structured_outputs=json_params[0]), lora),
        ([{"role": "user", "content": "List up to three fruits for sale as JSON."}],
         SamplingParams(temperature=0.7, seed=3, max_tokens=80,
                        structured_outputs=json_params[1]), None),
        ([{"role": "user", "content": "A point as JSON."}],
         SamplingParams(temperature=0, max_tokens=40, structured_outputs=json_params[2]), lora),
        ([{"role": "user", "content": "Give me a US phone number."}],
         SamplingParams(temperature=0.8, seed=1, max_tokens=30, structured_outputs=(
             StructuredOutputsParams(regex=r"\(\d{3}\) \d{3}-\d{4}"))), None),
        ([{"role": "user", "content": "Is the sky blue?"}],
         SamplingParams(temperature=0, max_tokens=10,
                        structured_outputs=StructuredOutputsParams(choice=("yes", "no"))), lora),
        ([{"role": "user", "content": "Say a greeting."}],
         SamplingParams(temperature=0, max_tokens=10, structured_outputs=StructuredOutputsParams(
             grammar='root ::= ("hello" | "hi") " " ("world" | "there")')), None),
        ([{"role": "user", "content": 'What is 2+2? Reply as a JSON object with the key "answer".'}],
         SamplingParams(temperature=0, max_tokens=60,
                        structured_outputs=StructuredOutputsParams(json_object=True)), None),
        ([{"role": "user", "content": "Tell me a joke."}],
         SamplingParams(temperature=0, max_tokens=24), None),
        ([{"role": "user", "content": "Tell me a joke."}],
         SamplingParams(temperature=0, max_tokens=24), lora),
    ]
    return rows


def run(llm: LLM, rows) -> list[str]:
    outputs = llm.chat([r[0] for r in rows], [r[1] for r in rows], use_tqdm=False,
                       lora_request=[r[2] for r in rows])
    return [o.outputs[0] for o in outputs]


def check_mixed_outputs(outputs) -> None:
    texts = [o.text for o in outputs]
    for o in outputs[:8]:
        assert o.finish_reason == "stop", (o.text, o.finish_reason)
    Person.model_validate_json(texts[0])
    Person.model_validate_json(texts[1])
    Inventory.model_validate_json(texts[2])
    Point.model_validate_json(texts[3])
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", texts[4])
    assert texts[5] in ("yes", "no")
    assert texts[6] in ("hello world", "hello there", "hi world", "hi there")
    assert isinstance(json.loads(texts[7]), dict)


@pytest.fixture(scope="module")
def mixed(llm, adapter_dir):
    rows = mixed_batch(llm, adapter_dir)
    return rows, run(llm, rows)


@pytest.mark.slow
def test_mixed_batches_follow_their_constraints(llm, mixed):
    rows, outputs = mixed
    check_mixed_outputs(outputs)
    # rows are what they are alone: the masks of their neighbours do not leak
    alone = run(llm, rows[3:4] + rows[8:])
    assert [o.text for o in outputs[3:4] + outputs[8:]] == [o.text for o in alone]
    assert outputs[8].text != outputs[9].text  # the adapter changes the reply


@pytest.mark.slow
def test_synchronous_scheduling_gives_the_same_constrained_outputs(smollm2_dir, mixed):
    rows, outputs = mixed
    sync_llm = LLM(smollm2_dir, max_model_len=1024, kv_cache_gib=0.25, max_lora_rank=8,
                   async_scheduling=False)
    # the JSON rows, greedy and seeded, base and LoRA
    assert [o.text for o in run(sync_llm, rows[:4])] == [o.text for o in outputs[:4]]


def test_constraint_params_are_checked():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=("b",))
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=())


def test_the_offline_llm_refuses_bad_grammars(llm):
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(grammar="root ::= (("))
    with pytest.raises(ValueError, match="invalid grammar"):
        llm.generate("Hi", bad, use_tqdm=False)


# ------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def server(smollm2_dir, adapter_dir):
    from flexserve.config import LoRAConfig

    config = EngineConfig(model=ModelConfig(model=smollm2_dir, max_model_len=1024),
                          cache=CacheConfig(kv_cache_gib=0.25),
                          lora=LoRAConfig(max_loras=2, max_lora_rank=8,
                                          lora_modules={"tuned": adapter_dir}))
    engine = build_async_engine(config, log_stats=False)
    thread = ServerThread(build_app(engine, served_model_name=MODEL))
    url = thread.start()
    yield SimpleNamespace(url=url, engine=engine)
    thread.stop()
    engine.shutdown()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def json_schema_format(model: type[BaseModel], strict: bool = True) -> dict:
    return {"type": "json_schema", "json_schema": {
        "name": model.__name__, "schema": model.model_json_schema(), "strict": strict}}


@pytest.mark.parametrize("model", [MODEL, "tuned"])
@pytest.mark.parametrize("schema", SCHEMAS)
def test_response_format_json_schema(client, model, schema):
    response = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Answer in JSON."}], max_tokens=100,
        temperature=0.8, seed=5, response_format=json_schema_format(schema))
    schema.model_validate_json(response.choices[0].message.content)
    assert response.choices[0].finish_reason == "stop"


def test_openai_parse_helper_and_streaming(client):
    parsed = client.beta.chat.completions.parse(
        model=MODEL, messages=person_prompt(3), max_tokens=100, temperature=0,
        response_format=Person) if hasattr(client, "beta") else None
    if parsed is not None:
        assert isinstance(parsed.choices[0].message.parsed, Person)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=person_prompt(3), max_tokens=100, temperature=0, stream=True,
        response_format=json_schema_format(Person)))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    whole = client.chat.completions.create(
        model=MODEL, messages=person_prompt(3), max_tokens=100, temperature=0,
        response_format=json_schema_format(Person))
    assert streamed == whole.choices[0].message.content
    Person.model_validate_json(streamed)


def test_json_object_and_guided_extras(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": 'Reply with the JSON object {"answer": "yes"}.'}],
        max_tokens=60, temperature=0, response_format={"type": "json_object"})
    assert isinstance(json.loads(response.choices[0].message.content), dict)
    choice = client.completions.create(model=MODEL, prompt="Is water wet? Answer:", max_tokens=5,
                                       temperature=0, extra_body={"guided_choice": ["Yes", "No"]})
    assert choice.choices[0].text in ("Yes", "No")
    regex = client.completions.create(model="tuned", prompt="The year is", max_tokens=8,
                                      temperature=1.0, seed=2,
                                      extra_body={"guided_regex": r" (19|20)\d\d"})
    assert re.fullmatch(r" (19|20)\d\d", regex.choices[0].text)
    guided = client.chat.completions.create(
        model=MODEL, messages=person_prompt(4), max_tokens=100, temperature=0,
        extra_body={"guided_json": Point.model_json_schema()})
    Point.model_validate_json(guided.choices[0].message.content)
    grammar = client.completions.create(
        model=MODEL, prompt="Colour:", max_tokens=5, temperature=0,
        extra_body={"guided_grammar": 'root ::= " red" | " green" | " blue"'})
    assert grammar.choices[0].text in (" red", " green", " blue")


def test_strict_schemas_allow_no_extra_properties(client):
    open_schema = {"type": "object",
                   "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["a"]}
    for strict in (True, False):
        response = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "JSON with a and b please."}],
            max_tokens=60, temperature=0,
            response_format={"type": "json_schema", "json_schema": {
                "name": "o", "schema": open_schema, "strict": strict}})
        value = json.loads(response.choices[0].message.content)
        assert isinstance(value["a"], int)
        if strict:
            assert set(value) == {"a"}


@pytest.mark.parametrize("kwargs, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}},
     "response_format", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format", "json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format", None),
    ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex", "regular expression"),
    ({"extra_body": {"guided_grammar": "root ::= "}}, "guided_grammar", "grammar"),
    ({"extra_body": {"guided_choice": []}}, "guided_choice", "choice"),
    ({"extra_body": {"guided_regex": "a", "guided_choice": ["b"]}}, "guided_choice",
     "at most one"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}},
     "response_format", "at most one"),
])
def test_bad_constraints_are_400(client, kwargs, param, message):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=5, **kwargs)
    assert e.value.body["param"].split(".")[0] == param
    if message is not None:
        assert message in e.value.body["message"]


def test_without_xgrammar_constraints_are_a_clear_400(client, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "xgrammar" else real(name, *a))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=5, response_format={"type": "json_object"})
    assert "pip install 'flexserve[structured]'" in e.value.body["message"]
    free = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=2)
    assert free.choices[0].message.content


@pytest.mark.parametrize("field", ["response_format", "guided_json", "tools"])
def test_deeply_nested_schemas_are_a_400(server, field):
    import httpx

    depth = 3000
    schema = '{"type": "array", "items": ' * depth + "{}" + "}" * depth
    extra = {
        "response_format": f'"response_format": {{"type": "json_schema", "json_schema": '
                           f'{{"name": "n", "schema": {schema}}}}}',
        "guided_json": f'"guided_json": {schema}',
        "tools": f'"tools": [{{"type": "function", "function": {{"name": "f", "parameters": '
                 f'{schema}}}}}], "tool_choice": "required"',
    }[field]
    body = (f'{{"model": "{MODEL}", "max_tokens": 2, '
            f'"messages": [{{"role": "user", "content": "x"}}], {extra}}}')
    r = httpx.post(server.url + "/v1/chat/completions", content=body,
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
