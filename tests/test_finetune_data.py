"""Fine-tuning data: exact ids and loss masks per format, truncation, bad input, step batching."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from flexserve.finetune import (
    TrainingExample,
    TruncationEvent,
    encode_chat,
    epoch_order,
    load_training_data,
    num_training_steps,
    plan_training_steps,
)

from _tokenizer import smollm2_tokenizer, tiny_byte_level_tokenizer

# SmolLM2 ids used below: <|im_start|> 1, <|im_end|> 2 (= eos), "\n" 198, "Hello" 19556,
# " world" 905, "!" 17.
EOS = 2
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
]


def jsonl(*records: object) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in records).encode()


def load(data: bytes, max_seq_len: int = 64, tokenizer=None):
    return load_training_data(data, tokenizer or smollm2_tokenizer(), max_seq_len)


def llama3_style_tokenizer(chat_template: str = LLAMA3_TEMPLATE):
    """A tiny byte-level BPE with Llama 3's special tokens, BOS post-processor and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    special = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(["system user assistant Hello Bye be brief\n\n"] * 20, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|begin_of_text|>",
                                   eos_token="<|eot_id|>", chat_template=chat_template)


def loss_text(tokenizer, example: TrainingExample) -> str:
    return tokenizer.decode([t for t, m in zip(example.input_ids, example.loss_mask) if m])


# ---- the three formats, exact ids and masks ----

def test_text_example_trains_on_every_predicted_token_and_eos():
    data = load(jsonl({"text": "Hello world"}))
    assert data.format == "text"
    (example,) = data.examples
    assert example.input_ids == [19556, 905, EOS]
    assert example.loss_mask == [False, True, True]
    assert example.labels() == [-100, 905, EOS]
    assert (example.line_number, example.num_tokens, example.num_loss_tokens) == (1, 3, 2)
    assert (data.num_tokens, data.num_loss_tokens, data.events) == (3, 2, [])


def test_prompt_completion_trains_on_completion_and_eos_only():
    data = load(jsonl({"prompt": "Capital of France:", "completion": " Paris"},
                      {"prompt": "", "completion": "The cat sat."}))
    first, second = data.examples
    assert first.input_ids == [39832, 282, 4649, 42, 7042, EOS]
    assert first.loss_mask == [False, False, False, False, True, True]
    # An empty prompt (SmolLM2 adds no BOS): nothing predicts the first completion token.
    assert second.input_ids == [504, 2644, 2643, 30, EOS]
    assert second.loss_mask == [False, True, True, True, True]
    assert (data.num_tokens, data.num_loss_tokens) == (11, 6)


def test_chat_example_trains_on_the_assistant_turn_with_its_end_of_turn_tokens():
    tokenizer = smollm2_tokenizer()
    data = load(jsonl({"messages": CHAT}))
    (example,) = data.examples
    assert example.input_ids == [
        1, 9690, 198, 6077, 5453, 30, 2, 198,  # <|im_start|>system\nBe brief.<|im_end|>\n
        1, 4093, 198, 26843, 2, 198,  # <|im_start|>user\nHi<|im_end|>\n
        1, 520, 9531, 198, 19556, 17, 2, 198,  # <|im_start|>assistant\nHello!<|im_end|>\n
    ]
    assert [p for p, m in enumerate(example.loss_mask) if m] == [18, 19, 20, 21]
    assert loss_text(tokenizer, example) == "Hello!<|im_end|>\n"
    assert example.input_ids == tokenizer.apply_chat_template(CHAT, tokenize=True)["input_ids"]


def test_chat_weight_zero_turn_is_excluded_and_later_turns_count():
    tokenizer = smollm2_tokenizer()
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello!", "weight": 0},
                {"role": "user", "content": "Bye"},
                {"role": "assistant", "content": "Bye!", "weight": 1}]
    ids, mask = encode_chat(messages, tokenizer)
    # No system message: SmolLM2's template writes its default one (positions 0-20).
    assert ids[27:] == [1, 520, 9531, 198, 19556, 17, 2, 198, 1, 4093, 198, 3087, 85, 2, 198,
                        1, 520, 9531, 198, 3087, 85, 17, 2, 198]
    assert [p for p, m in enumerate(mask) if m] == [46, 47, 48, 49, 50]
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == "Bye!<|im_end|>\n"


def test_chat_token_straddling_the_reply_start_counts_as_reply():
    # "assistant\n" + "  def" tokenizes as ... "istant", "\n ", " def": no token boundary where
    # the reply starts; tokenizing each prefix separately would not line up (BPE merge).
    tokenizer = smollm2_tokenizer()
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "  def f():\n    return 1"}]
    ids, mask = encode_chat(messages, tokenizer)
    tokens = tokenizer.convert_ids_to_tokens(ids)
    counted = [t for t, m in zip(tokens, mask) if m]
    assert counted == ["ĊĠ", "Ġdef", "Ġf", "():", "ĊĠĠĠ", "Ġreturn", "Ġ", "1", "<|im_end|>", "Ċ"]
    assert tokens[len(tokens) - len(counted) - 2:len(tokens) - len(counted)] == ["ass", "istant"]


def test_llama3_style_template():
    tokenizer = llama3_style_tokenizer()
    bos, eot = tokenizer.bos_token_id, tokenizer.eos_token_id
    messages = CHAT + [{"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Bye!"}]
    ids, mask = encode_chat(messages, tokenizer)
    assert ids == tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"]
    assert ids.count(bos) == 1 and ids[0] == bos  # the template's BOS; none added on top
    assert tokenizer.decode([t for t, m in zip(ids, mask) if m]) == (
        "Hello!<|eot_id|>Bye!<|eot_id|>")
    # Each counted run ends on <|eot_id|> and starts right after the header's "\n\n".
    runs, p = [], 0
    while p < len(mask):
        if mask[p]:
            q = p
            while q < len(mask) and mask[q]:
                q += 1
            runs.append((p, q))
            p = q
        p += 1
    assert len(runs) == 2
    for begin, end in runs:
        assert ids[end - 1] == eot
        assert tokenizer.decode(ids[:begin]).endswith(
            "<|start_header_id|>assistant<|end_header_id|>\n\n")
    # Text examples get the tokenizer's BOS (not in the loss) and eos = <|eot_id|>.
    (example,) = load(jsonl({"text": "Hello"}), tokenizer=tokenizer).examples
    assert example.input_ids[0] == bos and example.input_ids[-1] == eot
    assert example.loss_mask == [False] + [True] * (len(example.input_ids) - 1)


def test_template_that_rerenders_earlier_messages_is_refused():
    # Renders the last message differently from the same message followed by others.
    template = ("{% for m in messages %}{% if loop.last %}[{{ m['role'] }}] {{ m['content'] }}"
                "{% else %}{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}")
    tokenizer = llama3_style_tokenizer(template)
    with pytest.raises(ValueError, match=r"line 1: cannot locate messages\[1\] \(assistant\)"):
        load(jsonl({"messages": CHAT[1:]}), tokenizer=tokenizer)


def test_template_errors_become_value_errors_with_the_line():
    template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ValueError, match="line 1: the chat template failed.*roles must alternate"):
        load(jsonl({"messages": CHAT}), tokenizer=llama3_style_tokenizer(template))


# ---- file handling ----

def test_path_input_bom_crlf_blank_lines_and_line_numbers(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"text": "Hello world"}\r\n\r\n  \n{"text": "Hello"}\r\n')
    data = load_training_data(str(path), smollm2_tokenizer(), 64)
    assert [e.line_number for e in data.examples] == [1, 4]
    assert [e.input_ids for e in data.examples] == [[19556, 905, EOS], [19556, EOS]]


def test_unicode_line_separator_inside_a_string_is_not_a_line_break():
    data = load(jsonl({"text": "Hello\u2028world"}, {"text": "Hello"}))
    assert [e.line_number for e in data.examples] == [1, 2]


# ---- truncation ----

def test_truncation_keeps_the_first_tokens_and_records_an_event():
    data = load(jsonl({"text": "Hello world"}, {"text": "The cat sat."}), max_seq_len=3)
    assert data.examples[0].input_ids == [19556, 905, EOS]  # fits exactly: no event
    assert data.examples[1].input_ids == [504, 2644, 2643]
    assert data.examples[1].loss_mask == [False, True, True]
    assert data.events == [TruncationEvent(2, 5, 3, skipped=False)]
    assert data.events[0].message == "line 2: 5 tokens truncated to 3 (max_seq_len)"
    assert (data.num_tokens, data.num_loss_tokens) == (6, 4)


def test_example_without_loss_tokens_after_truncation_is_skipped_with_an_event():
    data = load(jsonl({"prompt": "Capital of France:", "completion": " Paris"},
                      {"prompt": "Hi", "completion": " Paris"}),
                max_seq_len=4)
    (example,) = data.examples
    assert example.line_number == 2
    assert example.input_ids == [26843, 7042, EOS] and example.loss_mask == [False, True, True]
    assert data.events == [TruncationEvent(1, 6, 4, skipped=True)]
    assert data.events[0].message.endswith("no trainable token is left, the example is skipped")


def test_every_example_skipped_is_an_error():
    with pytest.raises(ValueError, match="no example has a trainable token within max_seq_len=2"):
        load(jsonl({"prompt": "Capital of France:", "completion": " Paris"}), max_seq_len=2)


# ---- bad input: every case names the problem and the line ----

OK = {"text": "Hello"}
BAD_LINES = [
    (b'{"text": "a"}\n{"text": \n', r"line 2: not valid JSON"),
    (b'{"text": "a"}\n\xff\xfe\n', r"line 2: not UTF-8 text"),
    (jsonl(["Hello"]), r"line 1: expected a JSON object, got list"),
    (jsonl(OK, "Hello"), r"line 2: expected a JSON object, got str"),
    (jsonl({}), r"line 1: empty object"),
    (jsonl({"txt": "a"}), r"line 1: unknown key\(s\) txt"),
    (jsonl({"text": "a", "label": 1}), r"line 1: unknown key\(s\) label"),
    (jsonl({"text": "a", "prompt": "b"}), r"line 1: mixes keys of the prompt_completion and text"),
    (jsonl({"prompt": "a"}), r"line 1: missing key\(s\) completion"),
    (jsonl({"completion": "a"}), r"line 1: missing key\(s\) prompt"),
    (jsonl(OK, {"prompt": "a", "completion": "b"}),
     r"line 2: a prompt_completion example, but line 1 is a text example"),
    (jsonl({"text": 5}), r'line 1: "text" must be a string, got int'),
    (jsonl({"text": None}), r'line 1: "text" must be a string, got NoneType'),
    (jsonl({"text": ""}), r'line 1: empty "text"'),
    (jsonl({"prompt": "a", "completion": ""}), r'line 1: empty "completion"'),
    (jsonl({"prompt": 1, "completion": "b"}), r'line 1: "prompt" must be a string, got int'),
    (jsonl({"prompt": "a", "completion": ["b"]}), r'"completion" must be a string, got list'),
    (jsonl({"messages": "hi"}), r'line 1: "messages" must be a list, got str'),
    (jsonl({"messages": []}), r'line 1: "messages" is empty'),
    (jsonl({"messages": ["hi"]}), r"line 1: messages\[0\] must be an object, got str"),
    (jsonl({"messages": [{"role": "function", "content": "x"}, CHAT[2]]}),
     r"line 1: messages\[0\] has role 'function'; supported roles: system, user, assistant, "
     r"tool"),
    (jsonl({"messages": [{"content": "x"}, CHAT[2]]}), r"messages\[0\] has role None"),
    (jsonl({"messages": [CHAT[1], {"role": "assistant", "content": [{"type": "text"}]}]}),
     r"line 1: messages\[1\] \(assistant\) content must be a string, got list"),
    (jsonl({"messages": [CHAT[1], {"role": "assistant"}]}),
     r"messages\[1\] \(assistant\) content must be a string, got NoneType"),
    (jsonl({"messages": [CHAT[1], {"role": "assistant", "content": "x", "audio": "bot"}]}),
     r"line 1: messages\[1\] has unsupported key\(s\) audio"),
    (jsonl({"messages": [CHAT[1], {"role": "assistant", "tool_calls": []}]}),
     r"line 1: messages\[1\]: tool_calls must be a non-empty list"),
    (jsonl({"messages": [CHAT[1], {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{x"}}]}]}),
     r"messages\[1\].tool_calls\[0\]: arguments are not valid JSON"),
    (jsonl({"messages": [CHAT[1], {"role": "assistant", "tool_calls": [{"name": "f"}]}]}),
     r"messages\[1\].tool_calls\[0\] must be"),
    (jsonl({"messages": [{**CHAT[1], "tool_calls": [{"function": {"name": "f"}}]}, CHAT[2]]}),
     r"messages\[0\]: tool_calls are only allowed on assistant messages"),
    (jsonl({"messages": [{**CHAT[1], "tool_call_id": "c"}, CHAT[2]]}),
     r"messages\[0\]: tool_call_id is only allowed on tool messages"),
    (jsonl({"messages": CHAT, "tools": {"name": "f"}}), r'line 1: "tools" must be a list'),
    (jsonl({"messages": CHAT, "tools": [{"type": "function"}]}), r"line 1: tools\[0\] must be"),
    (jsonl({"messages": CHAT, "parallel_tool_calls": "no"}),
     r'"parallel_tool_calls" must be a boolean'),
    (jsonl({"tools": []}), r"line 1: missing key\(s\) messages"),
    (jsonl({"messages": CHAT[:2]}), r'line 1: "messages" has no assistant message'),
    (jsonl({"messages": [CHAT[1], {"role": "assistant", "content": ""}]}),
     r"line 1: messages\[1\]: empty assistant content"),
    (jsonl({"messages": [{**CHAT[1], "weight": 1}, CHAT[2]]}),
     r"line 1: messages\[0\]: weight is only allowed on assistant messages"),
    (jsonl({"messages": [CHAT[1], {**CHAT[2], "weight": 2}]}), r"weight must be 0 or 1, got 2"),
    (jsonl({"messages": [CHAT[1], {**CHAT[2], "weight": True}]}),
     r"weight must be 0 or 1, got True"),
    (jsonl({"messages": [CHAT[1], {**CHAT[2], "weight": 0}]}),
     r"line 1: every assistant message has weight 0"),
    (b"", r"the training file has no examples \(it is empty\)"),
    (b"\n \n\r\n", r"the training file has no examples \(it is empty\)"),
]


@pytest.mark.parametrize("data, message", BAD_LINES)
def test_bad_input_is_a_value_error_naming_line_and_problem(data, message):
    with pytest.raises(ValueError, match=message):
        load(data)


def test_chat_needs_a_chat_template():
    with pytest.raises(ValueError, match="line 1: the model's tokenizer has no chat template"):
        load(jsonl({"messages": CHAT}), tokenizer=tiny_byte_level_tokenizer())


@pytest.mark.parametrize("max_seq_len", [1, 0, True, 2.5])
def test_bad_max_seq_len(max_seq_len):
    with pytest.raises(ValueError, match="max_seq_len must be an integer >= 2"):
        load(jsonl(OK), max_seq_len=max_seq_len)


def test_training_example_checks_its_own_mask():
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2 tokens"):
        TrainingExample(1, [1, 2], [False])
    with pytest.raises(ValueError, match=r"loss_mask\[0\] must be False"):
        TrainingExample(1, [1, 2], [True, True])


# ---- steps ----

def test_steps_in_file_order_keep_the_smaller_last_batch_per_epoch():
    steps = plan_training_steps(5, batch_size=2, n_epochs=2, shuffle=False, seed=None)
    assert [s.example_indices for s in steps] == [(0, 1), (2, 3), (4,)] * 2
    assert [s.epoch for s in steps] == [0, 0, 0, 1, 1, 1]
    assert [s.index for s in steps] == list(range(6))
    assert num_training_steps(5, 2, 2) == len(steps) == 6
    assert num_training_steps(4, 2, 3) == 6 and num_training_steps(1, 8, 1) == 1


def test_shuffled_steps_are_a_seeded_permutation_per_epoch():
    steps = plan_training_steps(7, batch_size=3, n_epochs=3, shuffle=True, seed=1234)
    assert [len(s.example_indices) for s in steps] == [3, 3, 1] * 3
    orders = [[i for s in steps if s.epoch == e for i in s.example_indices] for e in range(3)]
    for epoch, order in enumerate(orders):
        expected = list(range(7))
        random.Random(f"1234:{epoch}").shuffle(expected)  # the documented rule
        assert order == expected == epoch_order(7, epoch, shuffle=True, seed=1234)
        assert sorted(order) == list(range(7))
    assert len({tuple(o) for o in orders}) == 3  # epochs differ
    # Pinned: a resumed job must see the same order on any machine and Python version.
    assert orders[0] == [0, 5, 4, 1, 3, 6, 2]
    assert plan_training_steps(7, 3, 3, True, 1234) == steps
    assert plan_training_steps(7, 3, 3, True, 1235) != steps


def test_step_batching_rejects_bad_arguments():
    with pytest.raises(ValueError, match="batch_size must be a positive integer"):
        plan_training_steps(5, 0, 1, False, None)
    with pytest.raises(ValueError, match="num_examples must be a positive integer"):
        num_training_steps(0, 2, 1)
    with pytest.raises(ValueError, match="shuffling needs an integer seed"):
        plan_training_steps(5, 2, 1, True, None)


def test_loss_tokens_of_a_step():
    data = load(jsonl({"text": "Hello world"}, {"text": "The cat sat."}, {"text": "Hello"}))
    assert [e.num_loss_tokens for e in data.examples] == [2, 4, 1]
    assert data.num_loss_tokens_in((2, 0)) == 3


def test_the_package_loads_without_torch():
    # The engine (which never imports torch) parses data and plans steps with this package.
    code = ("import sys, flexserve.finetune as f; f.plan_training_steps(3, 2, 1, True, 0); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# Qwen2.5's tool-calling template, cut to what decides the text: tools in the system turn,
# assistant calls as <tool_call> tags, tool results as user turns.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}"
    "<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"]}}}]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    {"role": "assistant", "content": "It is 21 C in Paris."},
]


def test_tool_use_examples_train_the_calls_and_replies_not_the_results():
    import copy

    tokenizer = copy.deepcopy(smollm2_tokenizer())
    tokenizer.chat_template = TOOL_TEMPLATE
    data = load(jsonl({"messages": TOOL_CHAT, "tools": TOOLS, "parallel_tool_calls": False}),
                max_seq_len=512, tokenizer=tokenizer)
    (example,) = data.examples
    rendered = [dict(m) for m in TOOL_CHAT]
    rendered[1] = {**rendered[1], "content": "", "tool_calls": [{
        **TOOL_CHAT[1]["tool_calls"][0],
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    text = tokenizer.apply_chat_template(rendered, tools=TOOLS, tokenize=False)
    assert example.input_ids == tokenizer(text, add_special_tokens=False).input_ids
    assert '"name": "get_weather"' in text.split("<|im_start|>user")[0]  # tools reach it
    trained = tokenizer.decode([t for t, m in zip(example.input_ids, example.loss_mask) if m])
    assert trained == ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
                       "</tool_call><|im_end|>\nIt is 21 C in Paris.<|im_end|>\n")
    assert "21 C\n</tool_response>" not in trained and "Weather in" not in trained
