"""The per-step host fast paths give the same results as the general paths they bypass."""

from __future__ import annotations

import random

import pytest
import torch

from flexserve.engine.detokenizer import IncrementalDetokenizer, fast_decode_fn
from flexserve.engine.kv_cache_manager import KVCacheManager
from flexserve.engine.output_processor import OutputProcessor
from flexserve.engine.plan import ScheduledSequence, StepResult
from flexserve.engine.request import Request, RequestStatus
from flexserve.layers.attention import AttentionMetadata
from flexserve.layers.sampler import Sampler, SamplingMetadata
from flexserve.sampling_params import SamplingParams

from _tokenizer import smollm2_tokenizer, tiny_byte_level_tokenizer


@pytest.mark.parametrize("make_tokenizer", [smollm2_tokenizer, tiny_byte_level_tokenizer])
def test_fast_decode_equals_tokenizer_decode(make_tokenizer):
    tokenizer = make_tokenizer()
    decode = fast_decode_fn(tokenizer)
    assert decode is not None
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 9))]
        for skip in (True, False):
            assert decode(ids, skip) == tokenizer.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


class _PlainTokenizer:
    """A tokenizer that is not a transformers fast tokenizer: decoded through its `decode`."""

    def __init__(self) -> None:
        self.num_calls = 0

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=True):
        self.num_calls += 1
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_other_tokenizers_keep_their_decode():
    tokenizer = _PlainTokenizer()
    assert fast_decode_fn(tokenizer) is None
    detokenizer = IncrementalDetokenizer(tokenizer, [0, 1], True)
    assert detokenizer.add_token_ids([2, 3]) == "cd"
    assert tokenizer.num_calls > 0


def _request(request_id, prompt_ids, params):
    request = Request(request_id, prompt_ids, params, eos_token_id=None, max_tokens=100)
    request.status = RequestStatus.RUNNING
    return request


def test_final_output_only_returns_the_same_final_output():
    tokenizer = smollm2_tokenizer()
    params = SamplingParams(max_tokens=100, stop=[" lazy"])
    prompt_ids = tokenizer.encode("Tell me:", add_special_tokens=False)
    output_ids = tokenizer.encode(" The quick brown fox jumps over the lazy dog.",
                                  add_special_tokens=False)
    processor = OutputProcessor(tokenizer)
    processor.add_request("stream", None, prompt_ids, params, ["stream"])
    processor.add_request("final", None, prompt_ids, params, ["final"],
                          final_output_only=True)
    requests = {r: _request(r, prompt_ids, params) for r in ("stream", "final")}
    streamed, finals, stopped_at = [], [], {}
    for step, token_id in enumerate(output_ids):
        updated = []
        for request in requests.values():
            if request.request_id not in stopped_at:
                request.append_output_token_id(token_id)
                updated.append(request)
        outputs, stopped = processor.process(updated, StepResult())
        for output in outputs:
            (streamed if output.request_id == "stream" else finals).append(output)
        for request_id in stopped:
            stopped_at[request_id] = step
            requests[request_id].status = RequestStatus.FINISHED_STOPPED
        if len(stopped_at) == 2:
            break
    # The stop string ends both on the same token; only the finished output is returned.
    assert stopped_at["stream"] == stopped_at["final"]
    assert len(streamed) == stopped_at["stream"] + 1
    assert len(finals) == 1 and finals[0].finished
    assert finals[0].outputs == streamed[-1].outputs
    assert finals[0].outputs[0].text == " The quick brown fox jumps over the"
    assert processor.num_unfinished_requests == 0


def test_kv_block_ids_stay_in_step_with_the_block_table():
    manager = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    params = SamplingParams(max_tokens=20)
    request = Request("a", list(range(6)), params, eos_token_id=None, max_tokens=20)
    assert manager.allocate_slots(request, 6, []) == [0, 1]  # an admission
    request.num_computed_tokens = 6
    for token_id in range(100, 106):  # decode: a new block every fourth token only
        request.append_output_token_id(token_id)
        new_blocks = manager.allocate_slots(request, 1)
        assert new_blocks == ([2] if request.num_computed_tokens == 8 else [])
        request.num_computed_tokens += 1
        table = [block.block_id for block in manager.req_to_blocks["a"]]
        assert manager.get_block_ids("a") == table
        manager.check_invariants()
    # Full blocks reached on the fast path are still offered to the prefix cache.
    assert manager.num_cached_blocks["a"] == 3
    with pytest.raises(ValueError, match="tokens scheduled"):
        manager.allocate_slots(request, 2)
    manager.free(request)
    assert manager.get_block_ids("a") == []
    manager.check_invariants()


def test_decode_only_metadata_by_hand():
    md = AttentionMetadata.build([1, 1, 1], [5, 0, 8], [[4, 9], [3], [1, 2, 7]], 4, "cpu")
    assert md.positions.tolist() == [5, 0, 8]
    assert md.slot_mapping.tolist() == [9 * 4 + 1, 3 * 4, 7 * 4]
    assert md.block_tables.tolist() == [[4, 9, 0], [3, 0, 0], [1, 2, 7]]
    assert md.seq_lens.tolist() == [6, 1, 9]
    assert md.query_start_loc.tolist() == [0, 1, 2, 3]
    assert (md.max_query_len, md.max_seq_len) == (1, 9)


def _row(request_id, params, output_token_ids):
    return ScheduledSequence(
        request_id=request_id, new_token_ids=[1], num_computed_tokens=3, block_ids=[0],
        needs_sample=True, sampling_params=params, prompt_token_ids=[5, 6, 7],
        output_token_ids=output_token_ids, eos_token_id=0, seed=None)


def test_all_greedy_metadata_samples_argmax_with_logprobs():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [4.0, 0.5, 0.0, 1.0]])
    rows = [_row("a", SamplingParams(temperature=0.0, logprobs=2), [3]),
            _row("b", SamplingParams(temperature=0.0), [])]
    metadata = SamplingMetadata.build(rows, 4, "cpu")
    assert metadata.all_greedy and metadata.temperature is None
    out = Sampler(seed=0)(logits, metadata)
    assert out.sampled_token_ids.tolist() == [1, 0]
    (a_logprobs, b_logprobs) = out.token_logprobs()
    assert a_logprobs.token_ids == [1, 1, 3] and a_logprobs.ranks == [1, 1, 2]
    assert a_logprobs.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], 0)[1].item())
    # min_tokens still masks EOS (id 0) on the general path: row b may not pick it.
    rows[1] = _row("b", SamplingParams(temperature=0.0, min_tokens=2), [])
    metadata = SamplingMetadata.build(rows, 4, "cpu")
    assert metadata.temperature is not None
    assert Sampler(seed=0)(logits, metadata).sampled_token_ids.tolist() == [1, 3]
