"""Tool calling in chat completions: the hermes and llama3_json parsers on recorded outputs of the
families that use them (whole and streamed), the same replies through a server and the `openai`
client, SmolLM2 live under `tool_choice` "required" and a named function (grammar-enforced),
tools and tool messages in the chat template, and the 400s."""

from __future__ import annotations

import copy
import json
from types import SimpleNamespace

import httpx
import openai
import pytest
from pydantic import BaseModel, ConfigDict, Field

from flexserve.config import CacheConfig, EngineConfig, ModelConfig
from flexserve.engine.plan import BatchPlan, StepResult
from flexserve.entrypoints.engine_builder import build_async_engine
from flexserve.entrypoints.openai.api_server import ServerThread, build_app
from flexserve.entrypoints.openai.tool_parsers import (
    HermesToolParser,
    Llama3JsonToolParser,
    ToolCallStream,
)

from _fake_engine import MODEL as FAKE_MODEL
from _fake_engine import fake_engine

pytest.importorskip("xgrammar")


class Weather(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=30)
    unit: str = Field(pattern="^(celsius|fahrenheit)$")


class Time(BaseModel):
    model_config = ConfigDict(extra="forbid")
    timezone: str = Field(max_length=30)


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": Weather.model_json_schema()}},
    {"type": "function", "function": {
        "name": "get_time", "description": "The current time in a timezone",
        "parameters": Time.model_json_schema()}},
]
ARGUMENTS = {"get_weather": Weather, "get_time": Time}

# Replies as Qwen2.5-7B-Instruct (hermes) and Llama-3.1-8B-Instruct (llama3_json) write them.
RECORDED = {
    "hermes": (
        "Let me look that up.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
        "</tool_call>\n<tool_call>\n"
        '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_call>',
        "Let me look that up.\n",
        [("get_weather", {"city": "Paris", "unit": "celsius"}),
         ("get_time", {"timezone": "Europe/Paris"})]),
    "llama3_json": (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", '
        '"unit": "celsius"}}; {"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}',
        None,
        [("get_weather", {"city": "Paris", "unit": "celsius"}),
         ("get_time", {"timezone": "Europe/Paris"})]),
}
PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}


def calls_of(tool_calls) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in tool_calls]


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_parsers_read_recorded_replies(name):
    text, content, calls = RECORDED[name]
    got_content, got_calls = PARSERS[name]().extract(text)
    assert got_content == content
    assert calls_of(got_calls) == calls
    assert len({c.id for c in got_calls}) == len(calls)


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_streamed_parsing_sends_the_same_content_and_calls(name):
    text, content, calls = RECORDED[name]
    stream = ToolCallStream(PARSERS[name]())
    sent, deltas = "", []
    for end in range(1, len(text) + 1):
        piece, new = stream.update(text[:end], end == len(text))
        sent += piece or ""
        deltas += new
    assert sent == (content or "")
    assert [(d.function.name, json.loads(d.function.arguments)) for d in deltas] == calls
    assert [d.index for d in deltas] == list(range(len(calls)))


@pytest.mark.parametrize("name, text", [
    ("hermes", "Just text, no call."),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'),
    ("llama3_json", "Paris is sunny today."),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Par'),
    ("llama3_json", '{"city": "Paris"}'),
])
def test_text_that_is_no_call_stays_content(name, text):
    assert PARSERS[name]().extract(text) == (text, [])
    stream = ToolCallStream(PARSERS[name]())
    sent = ""
    for end in range(1, len(text) + 1):
        piece, calls = stream.update(text[:end], end == len(text))
        sent += piece or ""
        assert calls == []
    assert sent == text


def test_hermes_streams_content_before_the_first_tag():
    stream = ToolCallStream(HermesToolParser())
    assert stream.update("Sure thing <tool", False) == ("Sure thing ", [])
    assert stream.update("Sure thing <tool_call>{", False) == (None, [])


# --------------------------------------------------------------- recorded replies, over HTTP
class ReplayExecutor:
    """Every request generates `reply` (token ids, then EOS), as if a model wrote it."""

    def __init__(self, reply_ids: list[int], eos: int) -> None:
        self.reply_ids = reply_ids + [eos]
        self.scheduler = None

    def execute(self, plan: BatchPlan) -> StepResult:
        result = StepResult()
        for row in plan.sequences:
            if row.needs_sample:
                num_generated = (row.num_computed_tokens + row.num_scheduled_tokens
                                 - len(row.prompt_token_ids))
                result.sampled_token_ids[row.request_id] = self.reply_ids[num_generated]
        return result


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module", params=sorted(RECORDED))
def replay(request, tokenizer):
    name = request.param
    text = RECORDED[name][0]
    engine = fake_engine(ReplayExecutor(tokenizer.encode(text), eos=0), tokenizer=tokenizer)
    thread = ServerThread(build_app(engine, tool_call_parser=name))
    url = thread.start()
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    yield SimpleNamespace(name=name, client=client, url=url)
    thread.stop()
    engine.shutdown()


def ask(client, **kwargs):
    return client.chat.completions.create(
        model=kwargs.pop("model", FAKE_MODEL), tools=TOOLS, max_tokens=200,
        messages=[{"role": "user", "content": "Weather and time in Paris?"}], **kwargs)


def test_recorded_replies_round_trip_through_the_client(replay):
    _, content, calls = RECORDED[replay.name]
    response = ask(replay.client)  # tool_choice defaults to "auto" with tools
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == content
    assert calls_of(choice.message.tool_calls) == calls
    assert all(c.id.startswith("call_") and c.type == "function"
               for c in choice.message.tool_calls)


def test_recorded_replies_stream_as_openai_tool_call_deltas(replay):
    _, content, calls = RECORDED[replay.name]
    chunks = list(ask(replay.client, stream=True, tool_choice="auto"))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == (content or "")
    by_index: dict[int, dict] = {}
    for chunk in chunks:
        for delta in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            entry = by_index.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = entry["id"] or delta.id
            entry["name"] += delta.function.name or ""
            entry["arguments"] += delta.function.arguments or ""
    assert [(e["name"], json.loads(e["arguments"])) for _, e in sorted(by_index.items())] == calls
    assert all(e["id"] for e in by_index.values())
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_returns_the_text(replay):
    text = RECORDED[replay.name][0]
    response = ask(replay.client, tool_choice="none")
    message = response.choices[0].message
    assert message.tool_calls in (None, []) and response.choices[0].finish_reason == "stop"
    assert message.content == text


def test_tools_and_tool_messages_reach_the_chat_template(tokenizer):
    template_tokenizer = copy.deepcopy(tokenizer)
    template_tokenizer.chat_template = (
        "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}:"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }}"
        "{{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}{% endif %}"
        "{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}\n{% endfor %}")
    engine = fake_engine(ReplayExecutor([], eos=0), tokenizer=template_tokenizer)
    thread = ServerThread(build_app(engine))
    url = thread.start()
    try:
        messages = [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call_1", "type": "function",
                "function": {"name": "get_weather",
                             "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees"},
        ]
        r = httpx.post(url + "/tokenize", json={"messages": messages, "tools": TOOLS,
                                                 "add_generation_prompt": False})
        assert r.status_code == 200, r.text
        text = template_tokenizer.decode(r.json()["tokens"])
        tools_json = text.split("\n")[0].removeprefix("TOOLS:")
        assert [t["function"]["name"] for t in json.loads(tools_json)] == ["get_weather",
                                                                          "get_time"]
        # OpenAI's JSON-text arguments reach the template as an object
        assert 'assistant:CALL get_weather{"city": "Paris", "unit": "celsius"}' in text
        assert "tool:21 degrees [call_1]" in text
        # the chat endpoint renders the same conversation, tool messages included
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        response = client.chat.completions.create(model=FAKE_MODEL, messages=messages,
                                                  tools=TOOLS, tool_choice="none", max_tokens=5)
        ref_messages = copy.deepcopy(messages)
        function = ref_messages[1]["tool_calls"][0]["function"]
        function["arguments"] = json.loads(function["arguments"])
        assert response.usage.prompt_tokens == len(template_tokenizer.encode(
            template_tokenizer.apply_chat_template(ref_messages, tools=TOOLS, tokenize=False,
                                                   add_generation_prompt=True),
            add_special_tokens=False))
        # a model's malformed call sent back reaches the template as its text
        malformed = copy.deepcopy(messages)
        malformed[1]["tool_calls"][0]["function"]["arguments"] = "{not json"
        response = client.chat.completions.create(model=FAKE_MODEL, messages=malformed,
                                                  tools=TOOLS, tool_choice="none", max_tokens=5)
        assert response.usage.prompt_tokens == len(template_tokenizer.encode(
            template_tokenizer.apply_chat_template(malformed, tools=TOOLS, tokenize=False,
                                                   add_generation_prompt=True),
            add_special_tokens=False))
    finally:
        thread.stop()
        engine.shutdown()


# -------------------------------------------------------------------------- SmolLM2, live
@pytest.fixture(scope="module")
def live(smollm2_dir):
    config = EngineConfig(model=ModelConfig(model=smollm2_dir, max_model_len=1024),
                          cache=CacheConfig(kv_cache_gib=0.25))
    engine = build_async_engine(config, log_stats=False)
    thread = ServerThread(build_app(engine, served_model_name="smollm2"))
    url = thread.start()
    yield openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    thread.stop()
    engine.shutdown()


def check_calls(tool_calls, max_calls: int | None = None) -> None:
    assert tool_calls
    if max_calls is not None:
        assert len(tool_calls) <= max_calls
    for call in tool_calls:
        ARGUMENTS[call.function.name].model_validate_json(call.function.arguments)
        assert call.id.startswith("call_")


@pytest.mark.parametrize("temperature, seed", [(0.0, None), (0.7, 3), (0.7, 4)])
def test_required_tool_choice_live(live, temperature, seed):
    response = ask(live, model="smollm2", tool_choice="required", temperature=temperature,
                   seed=seed)
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls)


def test_required_tool_choice_live_streamed_equals_whole(live):
    whole = ask(live, model="smollm2", tool_choice="required", temperature=0)
    chunks = list(ask(live, model="smollm2", tool_choice="required", temperature=0, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_no_parallel_calls_means_one(live):
    response = ask(live, model="smollm2", tool_choice="required", temperature=1.0, seed=5,
                   parallel_tool_calls=False)
    check_calls(response.choices[0].message.tool_calls, max_calls=1)


def test_named_tool_choice_live(live):
    choice = {"type": "function", "function": {"name": "get_time"}}
    response = ask(live, model="smollm2", tool_choice=choice, temperature=0)
    message = response.choices[0].message
    assert [c.function.name for c in message.tool_calls] == ["get_time"]
    check_calls(message.tool_calls)
    assert response.choices[0].finish_reason == "stop"  # as OpenAI ends a forced call
    chunks = list(ask(live, model="smollm2", tool_choice=choice, temperature=0, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert deltas[0].id and deltas[0].function.name == "get_time"
    assert {d.index for d in deltas} == {0}
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert arguments == message.tool_calls[0].function.arguments


@pytest.mark.parametrize("kwargs, param, message", [
    ({"tool_choice": "auto"}, "tool_choice", "--tool-call-parser"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
    ({"tool_choice": "maybe"}, "tool_choice", None),
    ({"tools": [{"type": "function", "function": {"name": "f"}}] * 2}, "tools", "distinct"),
    ({"tools": [{"type": "retrieval"}]}, "tools", None),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "bogus"}}}}}],
      "tool_choice": "required"}, "tools", "invalid JSON schema"),
])
def test_bad_tool_requests_are_400(live, kwargs, param, message):
    body = {"tools": TOOLS, **kwargs}
    if body["tools"] is None:
        del body["tools"]
    with pytest.raises(openai.BadRequestError) as e:
        live.chat.completions.create(model="smollm2", max_tokens=5,
                                     messages=[{"role": "user", "content": "x"}], **body)
    assert e.value.body["param"].split(".")[0] == param
    if message is not None:
        assert message in e.value.body["message"]
