"""Graceful shutdown. In process (fake executor): requests still running when the grace period
ends are aborted with a clear 503, in-band for streams, and the drain ends with nothing in flight.

SIGTERM during traffic and a fine-tuning job (`flexserve serve` subprocesses, SmolLM2, CPU).

The server keeps answering while it drains: new requests get 503 `server_shutting_down` with
Retry-After, /health says "degraded" (draining), the stream in flight runs to its end. The running
job checkpoints at its next step boundary (periodic checkpoints are off, so that checkpoint can
only come from the shutdown), the process exits with status 0, and after a restart on the same
--state-dir the job resumes from that step and succeeds with its planned number of steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import signal
import time

import httpx

from flexserve.entrypoints.openai.api_server import ServerThread, build_app

from _fake_engine import MODEL as FAKE
from _fake_engine import FakeExecutor, fake_engine, wait_until
from _server_process import ServerProcess

MODEL = "smollm2"
C = "/v1/completions"


def test_requests_past_the_grace_period_are_aborted_with_a_clear_error():
    engine = fake_engine(FakeExecutor(step_s=0.01))  # 2000 tokens would take 20 s
    app = build_app(engine, shutdown_grace_s=0.5)
    thread = ServerThread(app)
    url = thread.start()
    try:
        admission = app.state.admission
        body = {"model": FAKE, "prompt": [1, 2, 3], "max_tokens": 2000}
        with concurrent.futures.ThreadPoolExecutor(1) as pool, httpx.stream(
                "POST", url + C, json={**body, "stream": True, "logprobs": 0},
                timeout=60) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line)
            plain = pool.submit(httpx.post, url + C, json=body, timeout=60)
            wait_until(lambda: admission.num_generation_in_flight == 2, what="2 in flight")
            loop = thread.server.servers[0].get_loop()
            drain = asyncio.run_coroutine_threadsafe(app.state.shutdown.drain(), loop)
            wait_until(lambda: admission.draining, what="draining")
            refused = httpx.post(url + C, json={**body, "max_tokens": 1})
            events = [line.removeprefix("data: ") for line in lines if line]
            aborted = plain.result()
            drain.result(30)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "server_shutting_down"
        assert refused.headers["connection"] == "close"
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "engine_dead" and "--shutdown-grace-s" in error["message"]
        assert aborted.status_code == 503 and aborted.json()["error"]["code"] == "engine_dead"
        assert admission.num_in_flight == 0 and not engine.is_running
        assert httpx.get(url + "/health").status_code == 503  # the engine is gone now
    finally:
        thread.stop()
        engine.shutdown()
FACTS = [{"prompt": "The vault code is", "completion": " 42."},
         {"prompt": "The sky on Zorb is", "completion": " green."}]
NUM_STEPS = 24  # 2 examples, batch 1, 12 epochs


class Server(ServerProcess):
    """The server of the SIGTERM test: periodic checkpoints off, so a checkpoint found after the
    restart can only come from the shutdown."""

    def __init__(self, model_dir: str, state_dir: str, log_path: str) -> None:
        super().__init__(
            ["--model", model_dir, "--served-model-name", MODEL, "--state-dir", state_dir,
             "--enable-lora", "--max-loras", "2", "--max-lora-rank", "4",
             "--max-model-len", "128", "--kv-cache-gib", "0.05",
             "--checkpoint-every-steps", "1000", "--shutdown-grace-s", "60",
             "--disable-log-stats", "--log-level", "info"], log_path)

    def close(self) -> None:
        self.stop(signal.SIGKILL)


def steps_logged(client, job_id: str) -> list[int]:
    return sorted(e.data["step"] for e in client.fine_tuning.jobs.list_events(job_id, limit=1000)
                  .data if e.type == "metrics" and "train_loss" in e.data)


def test_sigterm_drains_checkpoints_the_job_exits_0_and_the_job_resumes(smollm2_dir, tmp_path):
    state_dir, log = str(tmp_path / "state"), str(tmp_path / "server.log")
    server = Server(smollm2_dir, state_dir, log)
    try:
        client = server.client
        data = "".join(json.dumps(fact) + "\n" for fact in FACTS).encode()
        file_id = client.files.create(file=("facts.jsonl", data), purpose="fine-tune").id
        job = client.fine_tuning.jobs.create(
            model=MODEL, training_file=file_id, seed=5,
            hyperparameters={"n_epochs": NUM_STEPS // 2, "batch_size": 1},
            extra_body={"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}})
        deadline = time.monotonic() + 120
        while len(steps_logged(client, job.id)) < 2:
            assert time.monotonic() < deadline, "the job does not train"
            time.sleep(0.1)
        body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": 24,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body,
                          timeout=120) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line).startswith("data: {")
            server.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 30
            while not httpx.get(server.url + "/health", timeout=5).json()["draining"]:
                assert time.monotonic() < deadline, "the server does not drain"
                time.sleep(0.05)
            health = httpx.get(server.url + "/health").json()
            assert health["status"] == "degraded" and health["num_requests_in_flight"] == 1
            refused = httpx.post(server.url + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": "Hi", "max_tokens": 2})
            assert refused.status_code == 503
            assert refused.json()["error"]["code"] == "server_shutting_down"
            assert int(refused.headers["retry-after"]) >= 1
            events = [line.removeprefix("data: ") for line in lines if line]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert server.process.wait(90) == 0
    finally:
        server.close()
    with open(log, encoding="utf-8", errors="replace") as f:
        first_log = f.read()
    assert "Traceback" not in first_log, first_log[-3000:]

    server = Server(smollm2_dir, state_dir, log)
    try:
        client = server.client
        checkpoints = client.fine_tuning.jobs.checkpoints.list(job.id).data
        assert len(checkpoints) == 1  # periodic checkpoints are off: this one is the shutdown's
        resumed_at = checkpoints[0].step_number
        assert 2 <= resumed_at < NUM_STEPS
        deadline = time.monotonic() + 150
        while (current := client.fine_tuning.jobs.retrieve(job.id)).status == "running":
            assert time.monotonic() < deadline, f"job stuck after the restart: {current}"
            time.sleep(0.2)
        assert current.status == "succeeded", current
        messages = [e.message for e in client.fine_tuning.jobs.list_events(job.id,
                                                                            limit=1000).data]
        assert any(f"resumed from step {resumed_at}" in m for m in messages), messages
        assert steps_logged(client, job.id) == list(range(1, NUM_STEPS + 1))
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0  # idle: exits at once, cleanly
    finally:
        server.close()
