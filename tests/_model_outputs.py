"""Child-process helper: greedy outputs of a checkpoint as JSON, for comparing kernel paths.

    python tests/_model_outputs.py MODEL_DIR  ->  prints [{"tokens": [...], "logprobs": [...],
    "prompt_logprobs": [...]}, ...] for PROMPTS (run with TRITON_INTERPRET=1 for the Triton path)
"""

from __future__ import annotations

import json
import sys

PROMPTS = [[5, 17, 33, 2, 99, 120, 7, 64, 31, 8, 12, 200, 201, 3, 44, 45, 46, 47, 48],
           [1, 2, 3],
           [250, 240, 230, 220, 210, 200, 190, 180, 170, 160, 150, 140, 130, 120, 110, 100, 90,
            80, 70, 60, 50, 40, 30, 20, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 13],
           [42]]


def outputs(model_dir: str) -> list[dict]:
    from flexserve import LLM, SamplingParams

    # A small token budget forces chunked prefill next to decode rows: mixed Triton batches.
    llm = LLM(model_dir, device="cpu", dtype="float32", max_model_len=64,
              max_num_batched_tokens=20, kv_cache_gib=0.01)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0,
                            prompt_logprobs=0)
    result = []
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params, use_tqdm=False)):
        c = out.outputs[0]
        result.append({
            "tokens": c.token_ids,
            "logprobs": [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)],
            "prompt_logprobs": [out.prompt_logprobs[p][prompt[p]].logprob
                                for p in range(1, len(prompt))],
        })
    return result


if __name__ == "__main__":
    print(json.dumps(outputs(sys.argv[1])))
