"""Serving what a fine-tuning job trained: the model names of its adapters, the hot swap of the
job's name onto its newest checkpoint, and the validation loss (or DPO metrics) of a checkpoint.

A job's adapter is served as `ft:<base>:<suffix>:<job_id>` (OpenAI's pattern; no suffix leaves
`::`) and each checkpoint as `<that>:ckpt-step-<N>`. The job's name moves to a new checkpoint with
unregister + register in one engine-thread call, between two steps, so no request the engine
accepts finds the name missing; requests already running on the older checkpoint finish with it.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from flexserve.engine.async_engine import AsyncLLMEngine
from flexserve.engine.lora_request import LoRARequest
from flexserve.finetune.data import TrainingExample
from flexserve.finetune.dpo import DPOMetrics, dpo_pair
from flexserve.sampling_params import SamplingParams

MAX_VALIDATION_REQUESTS = 16  # validation examples in flight at once (they share the engine)


def fine_tuned_model_name(base: str, suffix: str | None, job_id: str) -> str:
    """OpenAI's pattern `ft:<base>:<suffix>:<job_id>` (an empty suffix leaves `::`)."""
    return f"ft:{base}:{suffix or ''}:{job_id}"


def checkpoint_model_name(fine_tuned_model: str, step: int) -> str:
    """The name of a job's checkpoint after optimizer step `step`."""
    return f"{fine_tuned_model}:ckpt-step-{step}"


def parse_job_model_name(base: str, name: str) -> tuple[str, int | None] | None:
    """(job id, checkpoint step or None for the job's own name) of a name in the pattern of a
    job's models on base model `base`; None for any other name."""
    prefix = f"ft:{base}:"
    if not name.startswith(prefix):
        return None
    match = re.fullmatch(r"[^:]*:(ftjob-[0-9a-f]+)(?::ckpt-step-([0-9]+))?", name[len(prefix):])
    if match is None:
        return None
    return match.group(1), None if match.group(2) is None else int(match.group(2))


async def serve_checkpoint(engine: AsyncLLMEngine, checkpoint_name: str,
                           fine_tuned_model: str | None, path: str) -> None:
    """Serve the PEFT directory `path` as `checkpoint_name`, and (unless None) as
    `fine_tuned_model` in place of its older checkpoint. ValueError when it cannot be served."""
    llm = engine.engine
    # Two registrations of one directory, each with its own adapter id (the prefix cache keys
    # KV by it). Both are drawn under the checkpoint's name, which is not served yet (the job's
    # name usually is, and a request for a taken name is refused); one is renamed.
    registrations = [llm.new_lora_request(checkpoint_name, path)]
    if fine_tuned_model is not None:
        registrations.append(LoRARequest(
            fine_tuned_model, llm.new_lora_request(checkpoint_name, path).lora_int_id, path))
    for lora_request in registrations:
        await asyncio.to_thread(llm.load_lora, lora_request)
    await engine.call(_swap_adapters, llm, registrations)


def _swap_adapters(llm: Any, registrations: list[LoRARequest]) -> None:
    """Engine thread: serve each registration under its name, replacing one of that name."""
    names = {r.lora_name for r in llm.list_loras()}
    for lora_request in registrations:
        if lora_request.lora_name in names:
            llm.remove_lora(lora_request.lora_name)
        llm.register_lora(lora_request)


async def validation_loss(engine: AsyncLLMEngine, lora_name: str,
                          examples: list[TrainingExample], tenant: str = "default") -> float:
    """Mean token cross-entropy over the loss tokens of `examples` under adapter `lora_name`.

    Exact, and the training loss's definition (a sum over all loss tokens divided by their
    number): each example runs through the inference path as a prompt with prompt logprobs of
    its own tokens, the same forward the training windows use. Every example must fit the
    context with one generated token (`max_model_len - 1` tokens at most).
    """
    logprobs = await example_logprobs(engine, lora_name, examples, tenant)
    return -sum(logprobs) / sum(example.num_loss_tokens for example in examples)


async def example_logprobs(engine: AsyncLLMEngine, lora_name: str | None,
                           examples: list[TrainingExample], tenant: str = "default"
                           ) -> list[float]:
    """The summed log-probability of each example's loss tokens under adapter `lora_name`
    (None: the base model), through the inference path (prompt logprobs)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    limit = asyncio.Semaphore(MAX_VALIDATION_REQUESTS)

    async def example_logprob(example: TrainingExample) -> float:
        async with limit:
            request_id = engine.next_request_id("ftvalid")
            prepared = await asyncio.to_thread(engine.prepare, request_id, example.input_ids,
                                               params, None, lora_name, tenant)
            final = None
            async for output in engine.generate(prepared):
                final = output
        if final is None or final.prompt_logprobs is None:
            raise RuntimeError(f"validation request {request_id} ended without prompt logprobs")
        logprobs = final.prompt_logprobs
        return sum(logprobs[p][token].logprob
                   for p, (token, counted) in enumerate(zip(example.input_ids,
                                                             example.loss_mask))
                   if counted)

    return list(await asyncio.gather(*(example_logprob(example) for example in examples)))


async def validation_dpo(engine: AsyncLLMEngine, lora_name: str, pairs: list[TrainingExample],
                         reference_logprobs: list[float], beta: float,
                         tenant: str = "default") -> dict[str, float]:
    """A DPO job's validation metrics under adapter `lora_name` (`DPOMetrics.mean()`): `pairs`
    holds each pair's chosen then rejected side, `reference_logprobs` their summed
    log-probabilities under the job's reference model."""
    policy = await example_logprobs(engine, lora_name, pairs, tenant)
    metrics = DPOMetrics()
    for i in range(0, len(pairs), 2):
        metrics.add(dpo_pair(beta, policy[i], policy[i + 1], reference_logprobs[i],
                             reference_logprobs[i + 1]))
    return metrics.mean()
