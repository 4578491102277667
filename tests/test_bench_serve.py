"""`flexserve bench serve`: arrivals, datasets and metrics as plain functions; the whole client
against a real in-process server on a tiny model; the fine-tuning job part against a fake app."""

from __future__ import annotations

import json
import math
import statistics

import numpy as np
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route

from flexserve.bench.finetune import FinetuneSample, finetune_tokens_per_s
from flexserve.bench.metrics import (
    RequestRecord,
    aggregate_metrics,
    format_report,
    percentile,
)
from flexserve.bench.serve import parse_bench_serve_args, run_benchmark
from flexserve.bench.trace import load_trace
from flexserve.bench.workload import (
    MAX_SAMPLED_INPUT_LEN,
    MIN_SAMPLED_LEN,
    PROMPT_WORDS,
    arrival_times,
    iter_random_requests,
    iter_sharegpt_like_requests,
    load_jsonl_requests,
    sharegpt_like_lengths,
)
from flexserve.config import CacheConfig, EngineConfig, ModelConfig
from flexserve.entrypoints.engine_builder import build_async_engine
from flexserve.entrypoints.openai.api_server import ServerThread, build_app


def take(iterator, n: int) -> list:
    return [next(iterator) for _ in range(n)]


# ------------------------------------------------------------------------------------ arrivals
def coefficient_of_variation(times: list[float]) -> float:
    gaps = np.diff([0.0, *times])
    return float(gaps.std() / gaps.mean())


def test_poisson_arrivals_have_mean_gap_one_over_rate_and_cv_one():
    times = arrival_times(20000, request_rate=10.0, burstiness=1.0, seed=0)
    assert times == sorted(times) and times[0] > 0
    assert times[-1] / len(times) == pytest.approx(0.1, rel=0.02)
    assert coefficient_of_variation(times) == pytest.approx(1.0, abs=0.05)
    assert times == arrival_times(20000, 10.0, 1.0, seed=0)
    assert times[:10] != arrival_times(10, 10.0, 1.0, seed=1)


def test_gamma_arrivals_below_shape_one_are_burstier_at_the_same_mean_rate():
    bursty = arrival_times(20000, request_rate=10.0, burstiness=0.25, seed=0)
    smooth = arrival_times(20000, request_rate=10.0, burstiness=4.0, seed=0)
    assert bursty[-1] / len(bursty) == pytest.approx(0.1, rel=0.05)
    assert smooth[-1] / len(smooth) == pytest.approx(0.1, rel=0.02)
    # The coefficient of variation of gamma(k) gaps is 1 / sqrt(k): 2 and 0.5.
    assert coefficient_of_variation(bursty) == pytest.approx(2.0, rel=0.1)
    assert coefficient_of_variation(smooth) == pytest.approx(0.5, rel=0.1)


def test_infinite_rate_sends_everything_at_time_zero():
    assert arrival_times(5, float("inf"), 0.5, seed=3) == [0.0] * 5


@pytest.mark.parametrize("rate,burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0),
                                             (1.0, float("inf"))])
def test_bad_rate_or_burstiness_is_a_value_error(rate, burstiness):
    with pytest.raises(ValueError, match="request-rate|burstiness"):
        arrival_times(3, rate, burstiness, seed=0)


# ------------------------------------------------------------------------------------ datasets
def test_random_requests_have_the_asked_word_counts_and_are_seeded():
    requests = take(iter_random_requests(input_len=12, output_len=7, seed=5), 4)
    for r in requests:
        words = r.prompt.split(" ")
        assert len(words) == 12 and set(words) <= set(PROMPT_WORDS)
        assert (r.prompt_len, r.output_len) == (12, 7)
    assert requests == take(iter_random_requests(12, 7, seed=5), 4)
    assert requests != take(iter_random_requests(12, 7, seed=6), 4)


@pytest.mark.parametrize("max_model_len", [64, 2048])
def test_sharegpt_like_lengths_are_seeded_and_within_bounds(max_model_len):
    lengths = take(sharegpt_like_lengths(seed=0, max_model_len=max_model_len), 3000)
    assert lengths == take(sharegpt_like_lengths(0, max_model_len), 3000)
    assert lengths != take(sharegpt_like_lengths(1, max_model_len), 3000)
    max_input = min(MAX_SAMPLED_INPUT_LEN, max_model_len // 2)
    for num_prompt, num_output in lengths:
        assert MIN_SAMPLED_LEN <= num_prompt <= max_input
        assert MIN_SAMPLED_LEN <= num_output <= max_model_len - num_prompt
    if max_model_len == 2048:  # log-normal medians 128 / 160, lightly clipped
        assert statistics.median(p for p, _ in lengths) == pytest.approx(128, rel=0.1)
        assert statistics.median(o for _, o in lengths) == pytest.approx(160, rel=0.1)
        assert max(p for p, _ in lengths) == MAX_SAMPLED_INPUT_LEN  # the tail is clipped


def test_sharegpt_like_requests_match_their_lengths_and_cap_outputs():
    requests = take(iter_sharegpt_like_requests(seed=2, max_model_len=512, max_output_len=50), 200)
    lengths = take(sharegpt_like_lengths(2, 512), 200)
    for r, (num_prompt, num_output) in zip(requests, lengths):
        assert len(r.prompt.split(" ")) == r.prompt_len == num_prompt
        assert r.output_len == min(num_output, 50)


def test_jsonl_dataset_loads_prompts_and_output_lengths(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "hello there"}\n\n{"prompt": "count", "output_len": 3}\n')
    requests = load_jsonl_requests(str(path), output_len=9)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in requests] == [
        ("hello there", 0, 9), ("count", 0, 3)]


@pytest.mark.parametrize("line,fragment", [
    ("{not json", "line 2: not JSON"),
    ('{"text": "x"}', 'line 2: expected {"prompt"'),
    ('{"prompt": ""}', 'line 2: expected {"prompt"'),
    ('["prompt"]', 'line 2: expected {"prompt"'),
    ('{"prompt": "x", "output_len": 0}', "line 2: output_len must be an integer >= 1"),
    ('{"prompt": "x", "output_len": 2.0}', "line 2: output_len must be an integer >= 1"),
    ('{"prompt": "x", "max_tokens": 2}', "line 2: unknown field(s) max_tokens"),
])
def test_jsonl_dataset_names_the_bad_line(tmp_path, line, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError) as info:
        load_jsonl_requests(str(path), output_len=4)
    assert fragment in str(info.value) and str(path) in str(info.value)


def test_empty_jsonl_dataset_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(ValueError, match="has no prompts"):
        load_jsonl_requests(str(path), output_len=4)


# ------------------------------------------------------------------------------------ metrics
def test_percentile_interpolates_like_numpy():
    values = [float(v) for v in np.random.default_rng(0).exponential(size=37)]
    for q in (0, 10, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([3.0], 99) == 3.0


def record(index: int, ttft: float | None, e2e: float | None, out: int, itl=(),
           error: str | None = None) -> RequestRecord:
    r = RequestRecord(index, None, 0.0, 10, out, ttft_s=ttft, itl_s=list(itl), e2e_s=e2e,
                      prompt_tokens=10, output_tokens=out, error=error)
    return r


def test_aggregate_metrics_against_hand_computed_values():
    records = [
        record(0, 0.1, 1.1, 11, itl=[0.1] * 10),  # TPOT 100 ms
        record(1, 0.2, 2.2, 11, itl=[0.2] * 10),  # TPOT 200 ms
        record(2, 0.3, 0.3, 1),  # one token: no TPOT, meets any TPOT SLO
        record(3, 0.4, 4.4, 5, itl=[1.0] * 4),  # TPOT 1000 ms
        record(4, None, None, 0, error="HTTP 400: bad"),
    ]
    m = aggregate_metrics(records, duration_s=2.0, percentiles=(50, 90, 99), slo_ttft_ms=250,
                          slo_tpot_ms=150)
    assert (m["num_completed"], m["num_failed"]) == (4, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (40, 28)
    assert m["request_throughput"] == pytest.approx(2.0)
    assert m["output_throughput"] == pytest.approx(14.0)
    assert m["total_token_throughput"] == pytest.approx(34.0)
    ttft = m["ttft_ms"]
    assert ttft["mean"] == pytest.approx(250.0) and ttft["median"] == pytest.approx(250.0)
    assert ttft["p50"] == pytest.approx(250.0)
    assert ttft["p90"] == pytest.approx(370.0)  # rank 2.7 between 300 and 400
    assert ttft["p99"] == pytest.approx(397.0)
    assert ttft["std"] == pytest.approx(math.sqrt(12500.0))
    tpot = m["tpot_ms"]
    assert tpot["mean"] == pytest.approx(1300.0 / 3) and tpot["p50"] == pytest.approx(200.0)
    assert tpot["p90"] == pytest.approx(840.0)  # rank 1.8 between 200 and 1000
    assert m["itl_ms"]["mean"] == pytest.approx((1000 + 2000 + 4000) / 24)
    assert m["itl_ms"]["p50"] == pytest.approx(200.0)
    assert m["e2e_ms"]["mean"] == pytest.approx(2000.0)
    # TTFT <= 250 ms: requests 0 and 1; TPOT <= 150 ms: 0 and 2; both: request 0 only.
    assert m["slo_attainment"] == {"ttft": 0.5, "tpot": 0.5}
    assert m["slo_ms"] == {"ttft": 250, "tpot": 150}
    assert m["goodput"] == pytest.approx(0.5)


def test_aggregate_metrics_without_slos_or_successes():
    m = aggregate_metrics([record(0, None, None, 0, error="boom")], duration_s=1.0)
    assert m["num_completed"] == 0 and m["num_failed"] == 1
    assert m["goodput"] is None and m["slo_attainment"] == {}
    assert m["ttft_ms"] == {"mean": None, "median": None, "std": None, "p50": None,
                            "p90": None, "p99": None}
    only_tpot = aggregate_metrics([record(0, 0.1, 0.5, 5)], 1.0, slo_tpot_ms=100.0)
    assert only_tpot["slo_attainment"] == {"tpot": 1.0} and only_tpot["goodput"] == 1.0


def test_finetune_rate_prefers_the_forward_counter_and_falls_back_to_the_job():
    first = FinetuneSample(10.0, "running", 1000, {"forward": 5.0, "backward": 7.0})
    last = FinetuneSample(14.0, "running", 9000, {"forward": 405.0, "backward": 107.0})
    assert finetune_tokens_per_s(first, last) == (400, 100.0, "metrics.finetune_tokens_total")
    # The counter appears with the job's first window: absent at the start means 0.
    assert finetune_tokens_per_s(FinetuneSample(10.0, "running", None, {}), last)[:2] == (
        405, 101.25)
    first, last = (FinetuneSample(s.time_s, s.status, s.trained_tokens, {})
                   for s in (first, last))
    assert finetune_tokens_per_s(first, last) == (8000, 2000.0, "job.trained_tokens")
    nothing = FinetuneSample(14.0, "running", None, {})
    assert finetune_tokens_per_s(first, nothing) == (0, 0.0, "none")


# ------------------------------------------------------------------------- real server, tiny model
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|im_end|>"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def tiny_server(tiny_config, tiny_checkpoint):
    from transformers import AutoTokenizer

    from _tokenizer import tiny_byte_level_tokenizer

    path = tiny_checkpoint(tiny_config("llama", vocab_size=320, max_position_embeddings=512))
    tiny_byte_level_tokenizer().save_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)  # a copy: the cached one stays as it is
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    config = EngineConfig(model=ModelConfig(model=path, max_model_len=512),
                          cache=CacheConfig(kv_cache_gib=0.01))
    engine = build_async_engine(config, log_stats=False)
    thread = ServerThread(build_app(engine, served_model_name="tiny"))
    url = thread.start()
    yield url, tokenizer
    thread.stop()
    engine.shutdown()


def test_a_chunk_of_several_tokens_counts_as_several_gaps(monkeypatch):
    """Tokens whose text is held back reach the client together: with per-chunk usage their
    chunk's gap is split over them; without it, one gap per chunk."""
    import asyncio

    import httpx

    from flexserve.bench import serve

    def sse(text: str, tokens: int | None) -> str:
        chunk = {"choices": [{"index": 0, "text": text}]}
        if tokens is not None:
            chunk["usage"] = {"prompt_tokens": 3, "completion_tokens": tokens}
        return "data: " + json.dumps(chunk) + "\n\n"

    def run(counts: list[int | None]) -> RequestRecord:
        body = "".join(sse("x", n) for n in counts) + "data: [DONE]\n\n"
        transport = httpx.MockTransport(lambda request: httpx.Response(
            200, text=body, headers={"content-type": "text/event-stream"}))
        clock = iter(range(100))  # each reading of the clock is one second later
        monkeypatch.setattr(serve.time, "perf_counter", lambda: float(next(clock)))

        async def send() -> RequestRecord:
            async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
                return await serve.send_request(client, "completions", {}, RequestRecord(
                    0, None, 0.0, 0, 5), start=0.0)
        return asyncio.run(send())

    # chunks read a second apart: the first token, tokens 2-3, token 4, token 5
    got = run([1, 3, 4, 5])
    assert got.itl_s == [0.5, 0.5, 1.0, 1.0]
    assert got.output_tokens == 5 and got.tpot_s == pytest.approx(
        (got.e2e_s - got.ttft_s) / 4)
    assert run([None, None, None]).itl_s == [1.0, 1.0]


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_bench_serve_against_the_real_server(tiny_server, tmp_path, endpoint, capsys):
    url, tokenizer = tiny_server
    out = tmp_path / "result.json"
    args = parse_bench_serve_args([
        "--base-url", url, "--endpoint", endpoint, "--num-prompts", "8", "--request-rate", "20",
        "--burstiness", "0.5", "--input-len", "6", "--output-len", "5", "--seed", "1",
        "--tenants", "3", "--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000",
        "--output-json", str(out), "--disable-tqdm"])
    result = run_benchmark(args)
    m = result["metrics"]
    assert result["model"] == "tiny" and result["num_requests"] == 8
    assert (m["num_completed"], m["num_failed"]) == (8, 0), result["errors"]
    assert m["total_output_tokens"] == 8 * 5  # EOS is ignored: exactly max_tokens each
    prompts = take(iter_random_requests(6, 5, seed=1), 8)
    expected = [len(tokenizer(p.prompt).input_ids) for p in prompts]
    if endpoint == "completions":
        assert [r["prompt_tokens"] for r in result["requests"]] == expected
    else:  # the chat template adds its role markers around the same text
        assert all(r["prompt_tokens"] > n for r, n in zip(result["requests"], expected))
    assert m["total_input_tokens"] == sum(r["prompt_tokens"] for r in result["requests"])
    for r in result["requests"]:
        assert r["output_tokens"] == 5 and r["error"] is None
        assert 0 < r["ttft_s"] <= r["e2e_s"]
        # one gap per token after the first, up to the last chunk with text
        assert len(r["itl_s"]) <= 4
        assert sum(r["itl_s"]) <= r["e2e_s"] - r["ttft_s"] + 1e-9
        assert r["tpot_s"] == pytest.approx((r["e2e_s"] - r["ttft_s"]) / 4)
    assert [r["tenant"] for r in result["requests"]] == [f"tenant-{i % 3}" for i in range(8)]
    assert [r["scheduled_s"] for r in result["requests"]] == pytest.approx(
        arrival_times(8, 20.0, 0.5, seed=1))
    assert m["slo_attainment"] == {"ttft": 1.0, "tpot": 1.0}
    assert m["goodput"] == pytest.approx(8 / m["duration_s"])
    written = json.loads(out.read_text())
    assert written["metrics"]["total_output_tokens"] == 40
    assert written["settings"]["endpoint"] == endpoint and len(written["requests"]) == 8
    report = format_report(result)
    assert "Successful requests:" in report and "P99 TPOT (ms):" in report


def test_bench_serve_reports_request_errors(tiny_server):
    url, _ = tiny_server
    # 600 prompt words exceed the 512-token context: every request is a 400.
    result = run_benchmark(parse_bench_serve_args([
        "--base-url", url, "--num-prompts", "2", "--input-len", "600", "--output-len", "4",
        "--disable-tqdm"]))
    assert result["metrics"]["num_failed"] == 2 and result["metrics"]["num_completed"] == 0
    assert len(result["errors"]) == 2
    assert all("HTTP 400" in e and "context length" in e for e in result["errors"])


@pytest.mark.parametrize("argv,fragment", [
    (["--num-prompts", "-1"], "--num-prompts must be >= 0"),
    (["--num-prompts", "0"], "needs --finetune-file and --duration"),
    (["--duration", "5"], "--request-rate inf with --duration needs --num-prompts"),
    (["--duration", "0"], "--duration must be"),
    (["--max-concurrency", "0"], "--max-concurrency must be >= 1"),
    (["--dataset-name", "jsonl"], "needs --dataset-path"),
])
def test_bad_options_are_value_errors(tiny_server, argv, fragment):
    url, _ = tiny_server
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        run_benchmark(parse_bench_serve_args(["--base-url", url, "--disable-tqdm", *argv]))


def test_unreachable_server_is_a_value_error():
    with pytest.raises(ValueError, match="cannot reach the server"):
        run_benchmark(parse_bench_serve_args(["--base-url", "http://127.0.0.1:9",
                                              "--num-prompts", "1", "--disable-tqdm"]))


# ------------------------------------------------------------------ fine-tuning job, fake server
class FakeFinetuneServer:
    """The routes bench serve calls; every GET of the job adds 100 trained tokens, and 10
    forward-phase tokens to /metrics when it exports them."""

    def __init__(self, export_metrics: bool = False, max_job_gets: int | None = None,
                 metrics_job_id: str = "ftjob-1") -> None:
        self.export_metrics = export_metrics
        self.metrics_job_id = metrics_job_id  # "all": a server that does not export job ids
        self.max_job_gets = max_job_gets  # later GETs of the job answer 500
        self.uploads: list[tuple[str, bytes]] = []
        self.jobs: list[dict] = []
        self.num_job_gets = 0
        self.num_cancels = 0
        self.status = "queued"
        self.app = Starlette(routes=[
            Route("/v1/models", self.models), Route("/v1/files", self.files, methods=["POST"]),
            Route("/v1/fine_tuning/jobs", self.create, methods=["POST"]),
            Route("/v1/fine_tuning/jobs/{job_id}", self.get),
            Route("/v1/fine_tuning/jobs/{job_id}/cancel", self.cancel, methods=["POST"]),
            Route("/v1/completions", self.complete, methods=["POST"]),
            Route("/metrics", self.metrics),
        ])

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fake", "max_model_len": 128}]})

    async def files(self, request: Request):
        form = await request.form()
        self.uploads.append((form["purpose"], await form["file"].read()))
        return JSONResponse({"id": "file-1", "object": "file", "purpose": form["purpose"]})

    async def create(self, request: Request):
        self.jobs.append(await request.json())
        return JSONResponse(self.job())

    async def get(self, request: Request):
        assert request.path_params["job_id"] == "ftjob-1"
        if self.max_job_gets is not None and self.num_job_gets >= self.max_job_gets:
            return JSONResponse({"error": {"message": "store broke", "type": "server_error"}},
                                status_code=500)
        self.num_job_gets += 1
        self.status = "running"
        return JSONResponse(self.job())

    async def cancel(self, request: Request):
        self.num_cancels += 1
        self.status = "cancelled"
        return JSONResponse(self.job())

    async def metrics(self, request: Request):
        if not self.export_metrics:
            return PlainTextResponse("not here", status_code=404)
        tokens = 10 * self.num_job_gets
        job = self.metrics_job_id
        return PlainTextResponse(
            "# TYPE flexserve:finetune_tokens counter\n"
            f'flexserve:finetune_tokens_total{{job_id="{job}",phase="forward"}} {tokens}\n'
            f'flexserve:finetune_tokens_total{{job_id="{job}",phase="backward"}} {3 * tokens}\n'
            + ('' if job == "all" else
               'flexserve:finetune_tokens_total{job_id="other",phase="forward"} 999\n'))

    async def complete(self, request: Request):
        body = await request.json()

        async def stream():
            for i in range(body["max_tokens"]):
                yield f'data: {json.dumps({"choices": [{"index": 0, "text": f"t{i}"}]})}\n\n'
            usage = {"prompt_tokens": 3, "completion_tokens": body["max_tokens"]}
            yield f'data: {json.dumps({"choices": [], "usage": usage})}\n\n'
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    def job(self) -> dict:
        return {"id": "ftjob-1", "object": "fine_tuning.job", "status": self.status,
                "trained_tokens": 100 * self.num_job_gets, "error": None}


@pytest.fixture
def fake_server():
    def start(**kwargs):
        fake = FakeFinetuneServer(**kwargs)
        thread = ServerThread(fake.app)
        servers.append(thread)
        return fake, thread.start()

    servers: list[ServerThread] = []
    yield start
    for thread in servers:
        thread.stop()


def finetune_argv(url: str, data_path) -> list[str]:
    return ["--base-url", url, "--finetune-file", str(data_path), "--finetune-lora-r", "8",
            "--finetune-target-modules", "down_proj", "up_proj", "--finetune-n-epochs", "3",
            "--finetune-batch-size", "2", "--finetune-max-seq-len", "8192",
            "--finetune-poll-interval", "0.05", "--seed", "7", "--disable-tqdm"]


def test_finetune_job_is_submitted_sampled_and_cancelled(fake_server, tmp_path):
    fake, url = fake_server()
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "a b c"}\n')
    result = run_benchmark(parse_bench_serve_args([
        *finetune_argv(url, data), "--num-prompts", "4", "--request-rate", "50",
        "--output-len", "3"]))
    assert fake.uploads == [("fine-tune", b'{"text": "a b c"}\n')]
    assert fake.jobs == [{
        "model": "fake", "training_file": "file-1", "suffix": "bench-serve", "seed": 7,
        "hyperparameters": {"n_epochs": 3, "batch_size": 2, "max_seq_len": 8192},
        "lora": {"r": 8, "alpha": 32.0, "target_modules": ["down_proj", "up_proj"]}}]
    assert result["metrics"]["num_completed"] == 4
    assert result["metrics"]["total_output_tokens"] == 12
    finetune = result["finetune"]
    samples = finetune["samples"]
    # 100 tokens per GET: the window saw one more GET than its first sample.
    assert finetune["trained_tokens"] == 100 * (len(samples) - 1)
    assert finetune["tokens_per_s"] == pytest.approx(
        finetune["trained_tokens"] / finetune["window_s"])
    assert finetune["source"] == "job.trained_tokens"
    assert [s["trained_tokens"] for s in samples] == sorted(s["trained_tokens"] for s in samples)
    assert finetune["status"] == "running" and finetune["cancelled_at_end"]
    assert fake.num_cancels == 1 and fake.status == "cancelled"
    assert "Fine-tuning throughput (tok/s):" in format_report(result)


@pytest.mark.parametrize("metrics_job_id", ["ftjob-1", "all"])
def test_finetune_job_alone_from_metrics_and_kept(fake_server, tmp_path, metrics_job_id):
    fake, url = fake_server(export_metrics=True, metrics_job_id=metrics_job_id)
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "a b c"}\n')
    result = run_benchmark(parse_bench_serve_args([
        *finetune_argv(url, data), "--num-prompts", "0", "--duration", "0.3",
        "--finetune-keep"]))
    assert result["num_requests"] == 0 and result["metrics"]["num_completed"] == 0
    finetune = result["finetune"]
    assert finetune["source"] == "metrics.finetune_tokens_total"
    # The forward-phase counter of this job only: 10 per GET.
    assert finetune["trained_tokens"] == 10 * (len(finetune["samples"]) - 1)
    assert finetune["window_s"] >= 0.3
    assert not finetune["cancelled_at_end"] and fake.num_cancels == 0


def test_a_failed_benchmark_cancels_its_job(fake_server, tmp_path):
    # Two GETs work (leaving "queued", the window's first sample); then the job store fails.
    fake, url = fake_server(max_job_gets=2)
    data = tmp_path / "train.jsonl"
    data.write_text('{"text": "a b c"}\n')
    with pytest.raises(ValueError, match="HTTP 500: store broke"):
        run_benchmark(parse_bench_serve_args([*finetune_argv(url, data), "--num-prompts", "2",
                                              "--output-len", "2"]))
    assert fake.num_cancels == 1 and fake.status == "cancelled"


def test_missing_finetune_file_is_a_value_error(fake_server, tmp_path):
    _, url = fake_server()
    with pytest.raises(ValueError, match="is not a file"):
        run_benchmark(parse_bench_serve_args(finetune_argv(url, tmp_path / "missing.jsonl")
                                             + ["--num-prompts", "1"]))


# ------------------------------------------------------------- fine-tuning job, real server
@pytest.fixture(scope="module")
def tiny_finetune_server(tiny_config, tiny_checkpoint, tmp_path_factory):
    from flexserve.config import LoRAConfig
    from flexserve.finetune.service import FinetuneServiceConfig

    from _tokenizer import tiny_byte_level_tokenizer

    path = tiny_checkpoint(tiny_config("llama", vocab_size=320, max_position_embeddings=256))
    tiny_byte_level_tokenizer().save_pretrained(path)
    config = EngineConfig(model=ModelConfig(model=path, max_model_len=256),
                          cache=CacheConfig(kv_cache_gib=0.01),
                          lora=LoRAConfig(max_loras=2, max_lora_rank=8))
    engine = build_async_engine(config, log_stats=False)
    state_dir = str(tmp_path_factory.mktemp("finetune-state"))
    thread = ServerThread(build_app(engine, served_model_name="tiny",
                                    finetune=FinetuneServiceConfig(state_dir=state_dir)))
    url = thread.start()
    yield url
    thread.stop()
    engine.shutdown()


def test_finetune_job_on_the_real_server_runs_beside_the_traffic(tiny_finetune_server, tmp_path):
    import httpx

    url = tiny_finetune_server
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": " ".join(["the quick brown fox"] * 8)}) + "\n"
                            for _ in range(16)))
    result = run_benchmark(parse_bench_serve_args([
        "--base-url", url, "--num-prompts", "8", "--request-rate", "20", "--input-len", "6",
        "--output-len", "5", "--finetune-file", str(data), "--finetune-lora-r", "8",
        "--finetune-n-epochs", "50", "--finetune-batch-size", "1",
        "--finetune-poll-interval", "0.1", "--disable-tqdm"]))
    assert result["metrics"]["num_completed"] == 8 and result["metrics"]["num_failed"] == 0
    assert result["metrics"]["total_output_tokens"] == 40
    finetune = result["finetune"]
    assert finetune["job_id"].startswith("ftjob-") and finetune["error"] is None
    assert finetune["status"] == "running" and finetune["cancelled_at_end"]
    assert {s["status"] for s in finetune["samples"]} == {"running"}
    if finetune["source"] == "metrics.finetune_tokens_total":
        forward = [s["metrics_tokens"].get("forward", 0.0) for s in finetune["samples"]]
        assert forward == sorted(forward)
        assert finetune["trained_tokens"] == forward[-1] - forward[0]
    job = httpx.get(f"{url}/v1/fine_tuning/jobs/{finetune['job_id']}").json()
    assert job["status"] == "cancelled"  # the cancel call returns once it is
    assert job["hyperparameters"]["n_epochs"] == 50 and job["hyperparameters"]["batch_size"] == 1


# ----------------------------------------------------------------- benchmarks/coserve.py parts
@pytest.fixture(scope="module")
def coserve():
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "coserve.py"
    spec = importlib.util.spec_from_file_location("coserve_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_coserve_policies_map_to_server_options(coserve):
    assert coserve.server_policy_args("coserve") == ["--coserve-policy", "coserve"]
    assert coserve.server_policy_args("finetune-only") == ["--coserve-policy", "coserve"]
    assert coserve.server_policy_args("temporal-128") == [
        "--coserve-policy", "temporal", "--temporal-frequency", "128"]
    assert coserve.server_policy_args("spatial") == ["--coserve-policy", "spatial"]
    for bad in ("temporal-0", "temporal", "fast"):
        with pytest.raises(ValueError, match="unknown policy"):
            coserve.server_policy_args(bad)
    assert coserve.gpu_slug("NVIDIA H200") == "h200" and coserve.gpu_slug("cpu") == "cpu"


def coserve_row(policy: str, rate, tpot: float | None, ft: float | None) -> dict:
    return {"policy": policy, "rate": rate, "tpot_attainment": tpot,
            "finetune_tokens_per_s": ft, "error": None}


def test_coserve_targets_are_judged_from_the_rows(coserve):
    rows = [
        coserve_row("finetune-only", None, None, 10000.0),
        coserve_row("inference-only", 4.0, 1.0, None),
        coserve_row("inference-only", 20.0, 0.90, None),  # not held: coserve is not judged there
        coserve_row("coserve", 4.0, 0.97, 8000.0),
        coserve_row("coserve", 20.0, 0.50, 3000.0),
        coserve_row("temporal-64", 4.0, 0.80, 9000.0),  # lower attainment: not compared
        coserve_row("temporal-128", 4.0, 0.965, 5000.0),  # within 1 point: compared
        coserve_row("temporal-128", 20.0, 0.60, 4000.0),  # higher attainment and faster: a loss
        {"policy": "spatial", "rate": 4.0, "error": "server: exited"},
    ]
    slo, solo, temporal = coserve.evaluate_targets(rows)
    assert slo.endswith("met (4 req/s: 97.0%)")
    assert solo.endswith("met (8000 / 10000 tok/s = 80.0% at 4 req/s)")
    assert temporal.endswith("NOT met (20 req/s temporal-128: 3000 vs 4000 tok/s)")
    rows[3] = coserve_row("coserve", 4.0, 0.94, 7000.0)
    rows[7] = coserve_row("temporal-128", 20.0, 0.40, 4000.0)
    slo, solo, temporal = coserve.evaluate_targets(rows)
    assert "NOT met (4 req/s: 94.0%)" in slo and "NOT met (7000 / 10000" in solo
    assert temporal.endswith("met (4 req/s temporal-128: 7000 vs 5000 tok/s)")
    assert all(line.endswith("not measured") or "not measured (" in line
               for line in coserve.evaluate_targets(rows[3:5]))
    assert "| coserve | 4 | 94.0 | - |" in coserve.format_row(rows[3])


def test_coserve_word_tokenizer_makes_one_token_per_word(coserve, tiny_config, tiny_checkpoint,
                                                          tmp_path):
    path = tiny_checkpoint(tiny_config("llama", vocab_size=600, max_position_embeddings=256))
    tokenizer_dir = coserve.write_word_tokenizer(path, str(tmp_path / "tok"))
    assert tokenizer_dir == str(tmp_path / "tok")
    data = tmp_path / "train.jsonl"
    coserve.write_finetune_file(str(data), num_sequences=20, min_len=30, max_len=60, seed=0)
    lengths = [len(json.loads(line)["text"].split(" ")) + 1 for line in data.read_text().split(
        "\n") if line]
    assert len(lengths) == 20 and min(lengths) >= 30 and max(lengths) <= 60
    config = EngineConfig(model=ModelConfig(model=path, tokenizer=tokenizer_dir, max_model_len=256),
                          cache=CacheConfig(kv_cache_gib=0.01))
    engine = build_async_engine(config, log_stats=False)
    thread = ServerThread(build_app(engine, served_model_name="tiny"))
    url = thread.start()
    try:
        result = run_benchmark(parse_bench_serve_args([
            "--base-url", url, "--num-prompts", "4", "--input-len", "17", "--output-len", "3",
            "--disable-tqdm"]))
    finally:
        thread.stop()
        engine.shutdown()
    assert [r["prompt_tokens"] for r in result["requests"]] == [17] * 4
    assert result["metrics"]["total_output_tokens"] == 12
    # A model with its own tokenizer keeps it.
    from _tokenizer import tiny_byte_level_tokenizer

    tiny_byte_level_tokenizer().save_pretrained(path)
    assert coserve.write_word_tokenizer(path, str(tmp_path / "tok2")) is None


def test_bench_serve_replays_a_trace_against_the_real_server(tiny_server, tmp_path):
    url, _ = tiny_server
    path = tmp_path / "trace.jsonl"
    rows = [{"arrival_time": 0.0, "input_len": 5, "output_len": 3}, {"arrival_time": 0.2},
            {"arrival_time": 0.6, "output_len": 2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = run_benchmark(parse_bench_serve_args([
        "--base-url", url, "--trace", str(path), "--input-len", "4", "--output-len", "4",
        "--slo-tpot-ms", "60000", "--trace-bin-s", "0.5", "--disable-tqdm"]))
    records = result["requests"]
    assert [r["scheduled_s"] for r in records] == [0.0, 0.2, 0.6]
    assert [r["max_tokens"] for r in records] == [3, 4, 2]
    assert [r["expected_prompt_len"] for r in records] == [5, 4, 4]
    assert result["metrics"]["num_completed"] == 3
    assert [b["requests"] for b in result["timeline"]] == [2, 1]
    assert result["timeline"][0]["tpot_attainment"] == 1.0


def test_coserve_trace_mode_replays_the_trace_and_tabulates_bins(coserve):
    import argparse

    args = argparse.Namespace(max_model_len=8192, max_output_len=256, slo_tpot_ms=50.0,
                              slo_ttft_ms=5000.0, seed=0, trace=coserve.DEFAULT_TRACE,
                              trace_bin_s=10.0, duration=8.0, burstiness=0.5,
                              finetune_lengths=[1024, 8192])
    argv = coserve.bench_argv(args, "http://x", "coserve", None, "train.jsonl")
    parsed = parse_bench_serve_args(argv)
    assert parsed.trace == coserve.DEFAULT_TRACE and parsed.trace_bin_s == 10.0
    assert parsed.duration is None and "--request-rate" not in argv
    entries = load_trace(coserve.DEFAULT_TRACE)  # the shipped trace: 2 -> 20 -> 2 req/s, 90 s
    assert 600 <= len(entries) <= 1200 and entries[-1].arrival_s < 90.0

    def run(policy, attainments, rates):
        return {"policy": policy, "error": None, "timeline": [
            {"t_s": 10.0 * i, "request_rate": 2.0 + i, "tpot_attainment": a,
             "finetune_tokens_per_s": r} for i, (a, r) in enumerate(zip(attainments, rates))]}

    lines = coserve.trace_table([run("coserve", [1.0, 0.95], [7000.0, 5000.0]),
                                 run("dynamic-temporal", [1.0, None], [3000.0, None])])
    assert lines[0].startswith("| t (s) | req/s | coserve TPOT att. (%)")
    assert lines[2] == "| 0 | 2.0 | 100 | 7000 | 100 | 3000 |"
    assert lines[3] == "| 10 | 3.0 | 95 | 5000 | - | - |"
