"""The workload of `flexserve bench serve`: what each request asks for, and when it is sent.

Datasets: `random` (fixed lengths), `sharegpt-like` (log-normal lengths fitted to ShareGPT's
published statistics) and `jsonl` (the user's prompts). Synthetic prompts are random common words
(`PROMPT_WORDS`), about one token each. Arrivals are a gamma process (`burstiness` is the shape k:
1 is Poisson, k < 1 burstier) with mean inter-arrival 1 / rate. All seeded; no server.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

DATASET_NAMES = ("random", "sharegpt-like", "jsonl")
# ShareGPT-like lengths: log-normal, parameters fitted by eye to published ShareGPT statistics
# (vLLM and DistServe papers, Llama tokenizers: mean prompt ~160-230 tokens, mean output
# ~200-340, both heavy-tailed). With mu = ln(median): mean = median * exp(sigma^2 / 2), so
# 211 prompt and 264 output tokens before clipping.
SHAREGPT_INPUT_MEDIAN = 128
SHAREGPT_INPUT_SIGMA = 1.0
SHAREGPT_OUTPUT_MEDIAN = 160
SHAREGPT_OUTPUT_SIGMA = 1.0
# The bounds vLLM's ShareGPT sampler filters by: at least 4 tokens each, prompts up to 1024.
MIN_SAMPLED_LEN = 4
MAX_SAMPLED_INPUT_LEN = 1024
# Common English words, each one token (with its leading space) in GPT-2, Llama-3 and SmolLM2
# style BPE vocabularies, so a prompt of N random words is about N tokens.
PROMPT_WORDS = tuple("""
the of and to in is it you that he was for on are with as his they be at one have this from or
had by word but what some we can out other were all there when up use your how said an each she
which do their time if will way about many then them write would like so these her long make
thing see him two has look more day could go come did number sound no most people my over know
water than call first who may down side been now find any new work part take get place made live
where after back little only round man year came show every good me give our under name very
through just form great think say help low line turn cause much mean before move right boy old
too same tell does set three want air well also play small end put home read hand port large
spell add even land here must big high such follow act why ask men change went light kind off
need house picture try us again animal point mother world near build self earth father head stand
own page should country found answer school grow study still learn plant cover food sun four
thought let keep eye never last door between city tree cross since hard start might story saw far
sea draw left late run while press close night real life few stop open seem together next white
children begin got walk example ease paper often always music those both mark book letter until
mile river car feet care second group carry took rain eat room friend began idea fish mountain
north once base hear horse cut sure watch color face wood main enough plain girl usual young ready
above ever red list though feel talk bird soon body dog family direct pose leave song measure
state product black short class wind question happen complete ship area half rock order
fire south problem piece told knew pass farm top whole king size heard best hour better true
during hundred am remember step early hold west ground interest reach fast five sing listen six
table travel less morning ten simple several vowel toward war lay against pattern slow center love
person money serve appear road map science rule govern pull cold notice voice fall power town fine
certain fly unit lead cry dark machine note wait plan figure star box noun field rest correct able
pound done beauty drive stood contain front teach week final gave green oh quick develop sleep
warm free minute strong special mind behind clear tail produce fact street inch lot nothing course
stay wheel full force blue object decide surface deep moon island foot yet busy test record boat
common gold possible plane age dry wonder laugh thousand ago ran check game shape yes hot miss
brought heat snow bed bring sit perhaps fill east weight language among""".split())


# ------------------------------------------------------------------------------------ datasets
@dataclass(slots=True, frozen=True)
class SampledRequest:
    """One request to send, as the dataset made it."""

    prompt: str  # the completion prompt, or the user message on the chat endpoint
    prompt_len: int  # prompt tokens aimed for (words of a synthetic prompt); 0 when unknown
    output_len: int  # max_tokens asked for (generated exactly when EOS is ignored)


def random_text(rng: random.Random, num_words: int) -> str:
    """`num_words` words drawn uniformly from PROMPT_WORDS, space separated."""
    return " ".join(rng.choices(PROMPT_WORDS, k=num_words))


def iter_random_requests(input_len: int, output_len: int, seed: int) -> Iterator[SampledRequest]:
    """Endless prompts of `input_len` random words, each asking for `output_len` tokens."""
    check_min("input-len", input_len, 1)
    check_min("output-len", output_len, 1)
    rng = random.Random(f"random-{seed}")
    while True:
        yield SampledRequest(random_text(rng, input_len), input_len, output_len)


def sharegpt_like_lengths(seed: int, max_model_len: int) -> Iterator[tuple[int, int]]:
    """Endless (prompt, output) lengths from the SHAREGPT_* log-normals, clipped so that
    4 <= prompt <= min(1024, max_model_len // 2) and 4 <= output <= max_model_len - prompt."""
    check_min("max-model-len", max_model_len, 2 * MIN_SAMPLED_LEN)
    rng = random.Random(f"sharegpt-like-{seed}")
    max_input = min(MAX_SAMPLED_INPUT_LEN, max_model_len // 2)
    while True:
        prompt = rng.lognormvariate(math.log(SHAREGPT_INPUT_MEDIAN), SHAREGPT_INPUT_SIGMA)
        output = rng.lognormvariate(math.log(SHAREGPT_OUTPUT_MEDIAN), SHAREGPT_OUTPUT_SIGMA)
        num_prompt = min(max(round(prompt), MIN_SAMPLED_LEN), max_input)
        num_output = min(max(round(output), MIN_SAMPLED_LEN), max_model_len - num_prompt)
        yield num_prompt, num_output


def iter_sharegpt_like_requests(seed: int, max_model_len: int,
                                max_output_len: int | None = None) -> Iterator[SampledRequest]:
    """Endless random-word prompts with ShareGPT-like lengths (see `sharegpt_like_lengths`);
    `max_output_len` caps the outputs further (a benchmark's drain time)."""
    rng = random.Random(f"sharegpt-like-text-{seed}")
    for num_prompt, num_output in sharegpt_like_lengths(seed, max_model_len):
        if max_output_len is not None:
            num_output = min(num_output, max_output_len)
        yield SampledRequest(random_text(rng, num_prompt), num_prompt, num_output)


def load_jsonl_requests(path: str, output_len: int) -> list[SampledRequest]:
    """`{"prompt": text}` per line, optionally with `"output_len": n` (else `output_len`);
    ValueError naming the file and line of a bad one."""
    requests: list[SampledRequest] = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e})") from e
            if not isinstance(item, dict) or not isinstance(item.get("prompt"), str) \
                    or not item["prompt"]:
                raise ValueError(f'{where}: expected {{"prompt": "non-empty text"}}, optionally '
                                 f'with "output_len": n')
            unknown = sorted(set(item) - {"prompt", "output_len"})
            if unknown:
                raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}")
            n = item.get("output_len", output_len)
            if type(n) is not int or n < 1:
                raise ValueError(f"{where}: output_len must be an integer >= 1, got {n!r}")
            requests.append(SampledRequest(item["prompt"], 0, n))
    if not requests:
        raise ValueError(f"{path} has no prompts")
    return requests


# ------------------------------------------------------------------------------------ arrivals
def iter_arrival_times(request_rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Endless send times in seconds from the start: gamma inter-arrivals of shape `burstiness`
    and mean 1 / `request_rate` (burstiness 1: a Poisson process); all 0 for an infinite rate."""
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {request_rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"--burstiness must be a finite number > 0, got {burstiness}")
    if math.isinf(request_rate):
        yield from itertools.repeat(0.0)
        return
    rng = random.Random(f"arrivals-{seed}")
    scale = 1.0 / (request_rate * burstiness)  # mean of gamma(k, theta) is k * theta
    t = 0.0
    while True:
        t += rng.gammavariate(burstiness, scale)
        yield t


def arrival_times(num_requests: int, request_rate: float, burstiness: float,
                  seed: int) -> list[float]:
    """The first `num_requests` send times of `iter_arrival_times`."""
    return list(itertools.islice(iter_arrival_times(request_rate, burstiness, seed),
                                 num_requests))


def check_min(name: str, value: int, minimum: int) -> None:
    """ValueError naming the option `--name` when `value` is below `minimum`."""
    if value < minimum:
        raise ValueError(f"--{name} must be >= {minimum}, got {value}")
