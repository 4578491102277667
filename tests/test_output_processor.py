"""Output processor: stop strings, streaming holdback, n > 1 aggregation, logprobs."""

from __future__ import annotations

import pytest

from flexserve.engine.output_processor import OutputProcessor, find_stop_string
from flexserve.engine.plan import StepResult, TokenLogprobs
from flexserve.engine.request import Request, RequestStatus
from flexserve.sampling_params import SamplingParams

from _tokenizer import smollm2_tokenizer

FOX = "The quick brown fox jumps over the lazy dog. The end."
EOS = 2  # <|im_end|>


def _encode(text):
    return smollm2_tokenizer().encode(text, add_special_tokens=False)


class _Run:
    """One prompt and its children, fed token by token as the engine would."""

    def __init__(self, params, n=1, tokenizer="smollm2", prompt="Tell me:"):
        self.tokenizer = smollm2_tokenizer() if tokenizer == "smollm2" else tokenizer
        self.processor = OutputProcessor(self.tokenizer)
        prompt_ids = _encode(prompt)
        self.child_ids = [f"p-{i}" for i in range(n)] if n > 1 else ["p"]
        self.requests = {}
        for child_id in self.child_ids:
            request = Request(child_id, prompt_ids, params, EOS, max_tokens=1000)
            request.status = RequestStatus.RUNNING
            self.requests[child_id] = request
        self.processor.add_request("p", prompt, prompt_ids, params, self.child_ids)

    def step(self, tokens, logprobs=None, prompt_logprobs=None, finish=None):
        """`tokens`: child id -> new token id; `finish`: child id -> (status, stop_reason)."""
        for child_id, token_id in tokens.items():
            self.requests[child_id].append_output_token_id(token_id)
        for child_id, (status, reason) in (finish or {}).items():
            self.requests[child_id].status = status
            self.requests[child_id].stop_reason = reason
        result = StepResult(sampled_token_ids=dict(tokens), logprobs=logprobs or {},
                            prompt_logprobs=prompt_logprobs or {})
        updated = [self.requests[c] for c in tokens | (finish or {})]
        outputs, stopped = self.processor.process(updated, result)
        for child_id in stopped:  # what the engine does with them
            self.requests[child_id].status = RequestStatus.FINISHED_STOPPED
        return outputs, stopped

    def stream(self, text, last_status=RequestStatus.FINISHED_LENGTH):
        """Feed `text`'s tokens to the single child until it stops; returns every output."""
        token_ids = _encode(text)
        outputs = []
        for i, token_id in enumerate(token_ids):
            finish = {"p": (last_status, None)} if i == len(token_ids) - 1 else None
            step_outputs, stopped = self.step({"p": token_id}, finish=finish)
            assert len(step_outputs) == 1
            outputs.append(step_outputs[0])
            if stopped:
                assert outputs[-1].finished and i < len(token_ids) - 1
                break
        return outputs


def _texts(outputs):
    return [o.outputs[0].text for o in outputs]


def _assert_streams(outputs):
    """Each output's text extends the previous one, so deltas concatenate to the final text."""
    texts = _texts(outputs)
    deltas = [b[len(a):] for a, b in zip([""] + texts, texts)]
    assert all(b.startswith(a) for a, b in zip([""] + texts, texts))
    assert "".join(deltas) == texts[-1]


@pytest.mark.parametrize("stop", ["fox jumps", "s over t", "azy", "e lazy dog. The"])
def test_stop_string_cuts_exactly(stop):
    outputs = _Run(SamplingParams(stop=[stop])).stream(FOX)
    final = outputs[-1].outputs[0]
    assert final.text == FOX[:FOX.index(stop)]
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert outputs[-1].finished
    # Stopped at the token that completed the match; the ids keep that token.
    assert smollm2_tokenizer().decode(final.token_ids).find(stop) >= 0
    assert smollm2_tokenizer().decode(final.token_ids[:-1]).find(stop) < 0
    _assert_streams(outputs)


def test_stop_string_inside_one_token_and_included():
    outputs = _Run(SamplingParams(stop=["row"])).stream(FOX)  # inside " brown"
    assert outputs[-1].outputs[0].text == "The quick b"
    outputs = _Run(SamplingParams(stop=["row"], include_stop_str_in_output=True)).stream(FOX)
    assert outputs[-1].outputs[0].text == "The quick brow"
    _assert_streams(outputs)


def test_earliest_of_several_stop_strings_wins():
    outputs = _Run(SamplingParams(stop=["dog", "quick", "The end"])).stream(FOX)
    assert (outputs[-1].outputs[0].text, outputs[-1].outputs[0].stop_reason) == ("The ", "quick")
    # When one chunk holds overlapping matches, the one that ends first wins, as if the text
    # had arrived one character at a time.
    assert find_stop_string("xxabcd", 4, ["abcd", "c"]) == (4, "c")
    assert find_stop_string("xxabcd", 4, ["bcd", "abcd"]) == (2, "abcd")
    assert find_stop_string("abcd", 1, ["ab"]) is None  # ended before the new text: seen already


def test_streaming_holds_back_possible_stop_prefixes():
    params = SamplingParams(stop=["dog. The X", "jumps!"])
    outputs = _Run(params).stream(FOX)
    _assert_streams(outputs)
    final = outputs[-1].outputs[0]
    assert final.text == FOX and final.finish_reason == "length"
    for output in outputs[:-1]:  # while running, the last 9 characters are hidden
        text = output.outputs[0].text
        assert len(text) <= max(len(smollm2_tokenizer().decode(output.outputs[0].token_ids)) - 9, 0)
    assert outputs[-2].outputs[0].text == FOX[:len(FOX) - len(".") - 9]


def test_multibyte_text_streams_without_replacement_chars():
    text = "Hello world, 世界 🎉 done"
    outputs = _Run(SamplingParams(stop=["🎉 x"])).stream(text, RequestStatus.FINISHED_LENGTH)
    _assert_streams(outputs)
    assert outputs[-1].outputs[0].text == text
    assert not any("\ufffd" in t for t in _texts(outputs))


def test_stop_token_stays_in_ids_not_in_text():
    ids = _encode("alpha beta gamma")
    for include, text in ((False, "alpha beta"), (True, "alpha beta gamma")):
        run = _Run(SamplingParams(stop_token_ids=[ids[2]], include_stop_str_in_output=include,
                                  skip_special_tokens=False))
        run.step({"p": ids[0]})
        run.step({"p": ids[1]})
        outputs, _ = run.step({"p": ids[2]}, finish={"p": (RequestStatus.FINISHED_STOPPED, ids[2])})
        final = outputs[0].outputs[0]
        assert (final.text, final.token_ids) == (text, ids)
        assert (final.finish_reason, final.stop_reason) == ("stop", ids[2])
    run = _Run(SamplingParams(skip_special_tokens=False))
    outputs, _ = run.step({"p": EOS}, finish={"p": (RequestStatus.FINISHED_STOPPED, None)})
    assert outputs[0].outputs[0].text == "" and outputs[0].outputs[0].token_ids == [EOS]


def test_stop_string_wins_over_a_length_finish_in_the_same_step():
    run = _Run(SamplingParams(stop=[" beta"]))
    ids = _encode("alpha beta")
    run.step({"p": ids[0]})
    outputs, stopped = run.step({"p": ids[1]}, finish={"p": (RequestStatus.FINISHED_LENGTH, None)})
    assert stopped == []  # already finished in the scheduler
    assert (outputs[0].outputs[0].text, outputs[0].outputs[0].finish_reason) == ("alpha", "stop")


def test_n_children_aggregate_and_finish_together():
    run = _Run(SamplingParams(n=2, stop=["gamma"]), n=2)
    a, b = _encode("alpha beta"), _encode(" delta gamma epsilon")
    outputs, _ = run.step({"p-0": a[0], "p-1": b[0]})
    assert len(outputs) == 1 and [o.index for o in outputs[0].outputs] == [0, 1]
    outputs, _ = run.step({"p-0": a[1]}, finish={"p-0": (RequestStatus.FINISHED_LENGTH, None)})
    first, second = outputs[0].outputs
    assert first.text == "alpha beta" and first.finish_reason == "length"
    assert second.text == " d" and second.finish_reason is None  # "elta" could start "gamma"
    assert not outputs[0].finished and run.processor.get_output("p") is not None
    outputs, stopped = run.step({"p-1": b[1]})
    assert stopped == ["p-1"] and outputs[0].finished
    assert outputs[0].outputs[1].text == " delta " and outputs[0].outputs[1].stop_reason == "gamma"
    assert run.processor.get_output("p") is None and run.processor.num_unfinished_requests == 0
    assert run.step({"p-1": b[2]}) == ([], [])  # late updates of a finished prompt are ignored


def test_logprobs_and_prompt_logprobs():
    tokenizer = smollm2_tokenizer()
    run = _Run(SamplingParams(logprobs=2, prompt_logprobs=1), prompt="alpha beta gamma")
    prompt_ids = _encode("alpha beta gamma")
    ids = _encode(" delta epsilon")
    steps = [TokenLogprobs([ids[0], ids[0], 7], [-0.5, -0.5, -1.25], [1, 1, 2]),
             TokenLogprobs([ids[1], 9, 11], [-2.0, -0.1, -1.0], [3, 1, 2])]
    prompt_chunks = [[None, TokenLogprobs([prompt_ids[1], 5], [-3.0, -1.0], [4, 1])],
                     [TokenLogprobs([prompt_ids[2], prompt_ids[2]], [-0.2, -0.2], [1, 1])]]
    run.step({"p": ids[0]}, logprobs={"p": steps[0]}, prompt_logprobs={"p": prompt_chunks[0]})
    outputs, _ = run.step({"p": ids[1]}, logprobs={"p": steps[1]},
                          prompt_logprobs={"p": prompt_chunks[1]},
                          finish={"p": (RequestStatus.FINISHED_LENGTH, None)})
    completion = outputs[0].outputs[0]
    assert completion.cumulative_logprob == pytest.approx(-2.5)
    assert [list(position) for position in completion.logprobs] == [[ids[0], 7], [ids[1], 9, 11]]
    chosen = completion.logprobs[1][ids[1]]
    assert (chosen.logprob, chosen.rank, chosen.decoded_token) == (-2.0, 3, " epsilon")
    assert completion.logprobs[0][7].decoded_token == tokenizer.decode([7])
    prompt_logprobs = outputs[0].prompt_logprobs
    assert len(prompt_logprobs) == len(prompt_ids) == 3 and prompt_logprobs[0] is None
    assert list(prompt_logprobs[1]) == [prompt_ids[1], 5]
    assert prompt_logprobs[2][prompt_ids[2]].decoded_token == " gamma"


def test_no_logprobs_requested_gives_none():
    run = _Run(SamplingParams())
    outputs, _ = run.step({"p": 5}, logprobs={"p": TokenLogprobs([5], [-1.0], [1])})
    assert outputs[0].outputs[0].logprobs is None
    assert outputs[0].outputs[0].cumulative_logprob is None and outputs[0].prompt_logprobs is None


def test_without_tokenizer_text_is_empty_but_ids_flow():
    run = _Run(SamplingParams(stop=["beta"], logprobs=0), tokenizer=None)
    ids = _encode("alpha beta gamma")
    run.step({"p": ids[0]}, logprobs={"p": TokenLogprobs([ids[0]], [-1.0], [1])})
    outputs, stopped = run.step({"p": ids[1]})
    assert stopped == [] and outputs[0].outputs[0].text == ""
    outputs, _ = run.step({"p": ids[2]}, finish={"p": (RequestStatus.FINISHED_LENGTH, None)})
    final = outputs[0].outputs[0]
    assert (final.text, final.token_ids, final.finish_reason) == ("", ids, "length")
    assert final.logprobs[0][ids[0]].decoded_token is None


def test_abort_forgets_the_prompt():
    run = _Run(SamplingParams(n=2), n=2)
    run.step({"p-0": 5, "p-1": 6}, finish={"p-0": (RequestStatus.FINISHED_LENGTH, None)})
    assert run.processor.abort("p") == ["p-1"]
    assert run.processor.get_output("p") is None and run.processor.abort("p") == []
    assert run.step({"p-1": 7}) == ([], [])
    run.processor.add_request("q", None, [1], SamplingParams(), ["q"])
    with pytest.raises(ValueError):
        run.processor.add_request("q", None, [1], SamplingParams(), ["q"])
