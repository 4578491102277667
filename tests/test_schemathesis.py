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
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
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
