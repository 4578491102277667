"""Property-based API testing: schemathesis generates requests from `/openapi.json` (valid and
invalid ones) and every response must be no 5xx, a documented status code, the documented content
type and headers, and a body matching its documented schema.

The server is the real app (routes, auth, limits, files and jobs service, scheduler, detokenizer)
over a fake executor that samples one token per step, so generating up to the context takes
milliseconds. A short run here; `benchmarks/schemathesis_run.sh` runs the CLI at length against a
real `flexserve serve`.
"""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    positive_data_acceptance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from flexserve.entrypoints.openai.api_server import ServerThread, build_app
from flexserve.entrypoints.openai.auth import APIKeyTable
from flexserve.entrypoints.openai.limits import AdmissionLimits
from flexserve.finetune.service import FinetuneServiceConfig

from _fake_engine import MODEL, FakeExecutor, fake_engine

API_KEY = "sk-schemathesis"
GENERATION = ("/v1/completions", "/v1/chat/completions")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    import copy

    from _tokenizer import tiny_byte_level_tokenizer

    tokenizer = copy.deepcopy(tiny_byte_level_tokenizer())  # the cached one stays template-free
    tokenizer.chat_template = CHAT_TEMPLATE
    engine = fake_engine(FakeExecutor(), max_model_len=256, tokenizer=tokenizer)
    app = build_app(engine, api_keys=APIKeyTable([(API_KEY, "fuzz")]),
                    limits=AdmissionLimits(max_num_requests=64),
                    finetune=FinetuneServiceConfig(
                        state_dir=str(tmp_path_factory.mktemp("state")),
                        max_upload_bytes=64 * 1024))
    thread = ServerThread(app)
    url = thread.start()
    yield url
    thread.stop()
    engine.shutdown()


def operations() -> list[tuple[str, str]]:
    """(method, path) of every operation the document lists (the server builds the same one)."""
    import flexserve
    from flexserve.entrypoints.openai.openapi import build_openapi

    document = build_openapi(flexserve.__version__, api_key_required=True, finetune=True)
    return [(method.upper(), path) for path, item in document["paths"].items()
            for method in item]


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server + "/openapi.json")


@pytest.mark.parametrize(("method", "path"), operations())
def test_operation_conforms_to_the_openapi_document(api_schema, server, method, path):
    operation = api_schema[path][method]

    @given(case=operation.as_strategy())
    @settings(max_examples=25 if path in GENERATION else 10, deadline=None, derandomize=True,
              database=None, suppress_health_check=list(HealthCheck))
    def check(case):
        if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            case.body["model"] = MODEL  # else every generated name is a 404 (tested elsewhere)
        case.call_and_validate(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"},
                               checks=CHECKS, timeout=60)

    check()


# Positive cases: every request the document allows is accepted (2xx, or 404 for an id or a
# name that does not exist). What a JSON schema cannot state is set aside, each for its reason:
# - the test server runs without LoRA (a fake engine), so loading adapters and creating jobs
#   refuse every request (a real server's document is the same);
# - a JSON schema, regular expression or grammar given as a constraint must compile, and an
#   uploaded file must be JSONL training data: the generated ones are replaced or dropped;
# - prompt and completion together must fit the context, and min_tokens <= max_tokens: the
#   generated max_tokens is capped at 8 and min_tokens at it.
NEEDS_LORA = {("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"),
              ("POST", "/v1/fine_tuning/jobs")}
MUST_COMPILE = ("guided_json", "guided_regex", "guided_grammar", "response_format", "tools",
                "tool_choice")
TRAINING_FILE = b'{"text": "one two three"}\n'


def _semantically_valid(case) -> None:
    body = case.body
    if isinstance(body, dict) and "file" in body and "purpose" in body:
        body["file"] = TRAINING_FILE
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = MODEL
    for name in MUST_COMPILE:
        body.pop(name, None)
    # (numbers: JSON integers may come as integral floats, such as 4443.0)
    for name, cap in (("max_tokens", 8), ("max_completion_tokens", 8), ("min_tokens", 1)):
        if isinstance(body.get(name), (int, float)) and not isinstance(body[name], bool):
            body[name] = min(body[name], cap)


@pytest.mark.parametrize(("method", "path"), [op for op in operations() if op not in NEEDS_LORA])
def test_documented_requests_are_accepted(api_schema, server, method, path):
    operation = api_schema[path][method]

    @given(case=operation.as_strategy(generation_mode=GenerationMode.POSITIVE))
    @settings(max_examples=25 if path in GENERATION else 10, deadline=None, derandomize=True,
              database=None, suppress_health_check=list(HealthCheck))
    def check(case):
        _semantically_valid(case)
        case.call_and_validate(base_url=server, headers={"Authorization": f"Bearer {API_KEY}"},
                               checks=[not_a_server_error, positive_data_acceptance], timeout=60)

    check()
