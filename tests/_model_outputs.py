"""Child-process helper: greedy outputs of a checkpoint as JSON, for comparing kernel paths.

    python tests/_model_outputs.py MODEL_DIR [ADAPTER_DIR]  ->  prints [{"tokens": [...],
    "logprobs": [...], "prompt_logprobs": [...]}, ...] for PROMPTS (run with TRITON_INTERPRET=1
    for the Triton path). With a PEFT adapter directory, LoRA is on (2 slots of rank 2: small
    enough that the merged GEMMs fold the shrinks) and every other prompt uses the adapter.
"""

from __future__ import annotations

import json
import sys

PROMPTS = [[5, 17, 33, 2, 99, 120, 7, 64, 31, 8, 12, 200, 201, 3, 44, 45, 46, 47, 48],
           [1, 2, 3],
           [250, 240, 230, 220, 210, 200, 190, 180, 170, 160, 150, 140, 130, 120, 110, 100, 90,
            80, 70, 60, 50, 40, 30, 20, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 13],
           [42]]


def outputs(model_dir: str, adapter_dir: str | None = None) -> list[dict]:
    from flexserve import LLM, LoRARequest, SamplingParams

    lora = {} if adapter_dir is None else dict(enable_lora=True, max_loras=2, max_lora_rank=2)
    # A small token budget forces chunked prefill next to decode rows: mixed Triton batches.
    llm = LLM(model_dir, device="cpu", dtype="float32", max_model_len=64,
              max_num_batched_tokens=20, kv_cache_gib=0.01, **lora)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0)
    requests = None
    if adapter_dir is not None:
        requests = [LoRARequest("a", 1, adapter_dir) if i % 2 == 0 else None for i in range(len(PROMPTS))]
    result = []
    generated = llm.generate(PROMPTS, params, use_tqdm=False, lora_request=requests)
    for prompt, out in zip(PROMPTS, generated):
        c = out.outputs[0]
        result.append({
            "tokens": c.token_ids,
            "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
            "prompt_logprobs": [out.prompt_logprobs[p][prompt[p]].logprob
                                for p in range(1, len(prompt))],
        })
    return result


if __name__ == "__main__":
    print(json.dumps(outputs(*sys.argv[1:3])))
