"""Fine-tuning data: a JSONL file -> token ids and per-token loss masks.

One JSON object per line, all lines in one of three formats:

- `{"text": s}`: ids = tokenizer(s).input_ids + [eos]; every predicted token counts in the loss.
- `{"prompt": p, "completion": c}`: ids = tokenizer(p).input_ids
  + tokenizer(c, add_special_tokens=False).input_ids + [eos]; completion and eos count.
- `{"messages": [...]}`: the chat template; assistant turns count (`flexserve.finetune.chat`).
  OpenAI's function-calling examples add `"tools": [...]` (to the template) and may carry
  `"parallel_tool_calls"` (accepted; the calls are trained as written).
- `{"input": {"messages": [...]}, "preferred_output": [...], "non_preferred_output": [...]}`: a
  preference pair for DPO (`flexserve.finetune.preference`): two examples, chosen then rejected.

Blank lines are skipped; line numbers in errors and events are the file's 1-based line numbers.
An example longer than `max_seq_len` keeps its first `max_seq_len` tokens and yields a
`TruncationEvent`; one left without a loss token is skipped (its event says so), so a single
over-long prompt does not fail a whole job; a pair is skipped when either side is. A file with no
trainable example is an error.
No torch import: the engine counts tokens and plans steps from this.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from flexserve.finetune.chat import encode_chat
from flexserve.finetune.preference import PREFERENCE_KEYS, encode_preference

# Format name -> the keys an object of that format has, exactly.
DATA_FORMATS: dict[str, frozenset[str]] = {
    "text": frozenset({"text"}),
    "prompt_completion": frozenset({"prompt", "completion"}),
    "messages": frozenset({"messages"}),
    "preference": PREFERENCE_KEYS,
}
# Keys an object of a format may carry besides its own.
OPTIONAL_KEYS: dict[str, frozenset[str]] = {
    "messages": frozenset({"tools", "parallel_tool_calls"}),
}
_KEY_FORMAT = {key: name for name, keys in (*DATA_FORMATS.items(), *OPTIONAL_KEYS.items())
               for key in keys}
_FORMAT_HELP = ('{"text"}, {"prompt", "completion"}, {"messages"} or {"input", '
                '"preferred_output", "non_preferred_output"}')


@dataclass(slots=True)
class TrainingExample:
    """One tokenized example.

    loss_mask[p] is True when the token at position p is predicted from position p - 1 and its
    cross-entropy counts in the loss (HF's labels: labels[p] = input_ids[p] where the mask is
    True, else -100; the model shifts them). loss_mask[0] is always False: nothing predicts the
    first token.
    """

    line_number: int  # 1-based line of the JSONL file
    input_ids: list[int]  # after truncation to max_seq_len
    loss_mask: list[bool]  # same length as input_ids
    num_loss_tokens: int = field(init=False)  # sum(loss_mask)

    def __post_init__(self) -> None:
        if len(self.loss_mask) != len(self.input_ids):
            raise ValueError(
                f"loss_mask has {len(self.loss_mask)} entries for {len(self.input_ids)} tokens")
        if self.loss_mask and self.loss_mask[0]:
            raise ValueError("loss_mask[0] must be False: nothing predicts the first token")
        self.num_loss_tokens = sum(self.loss_mask)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def labels(self, ignore_index: int = -100) -> list[int]:
        """HF-style labels: the token id where it counts in the loss, else `ignore_index`."""
        return [t if m else ignore_index for t, m in zip(self.input_ids, self.loss_mask)]


@dataclass(slots=True, frozen=True)
class TruncationEvent:
    """An example cut to max_seq_len (and skipped when no loss token was left)."""

    line_number: int  # 1-based line of the JSONL file
    num_tokens: int  # tokens before truncation
    num_kept_tokens: int  # tokens kept (max_seq_len)
    skipped: bool  # True: no loss token within the kept tokens, the example is not trained on

    @property
    def message(self) -> str:
        text = (f"line {self.line_number}: {self.num_tokens} tokens truncated to "
                f"{self.num_kept_tokens} (max_seq_len)")
        if self.skipped:
            text += "; no trainable token is left, the example is skipped"
        return text


@dataclass(slots=True)
class TrainingData:
    """A parsed training file."""

    format: str  # a key of DATA_FORMATS
    # trainable examples in file order (skipped ones left out); a preference file holds pairs:
    # examples[2 * i] is pair i's chosen side, examples[2 * i + 1] its rejected side
    examples: list[TrainingExample]
    events: list[TruncationEvent]  # one per truncated example, in file order
    num_tokens: int  # sum of num_tokens over examples (after truncation)
    num_loss_tokens: int  # sum of num_loss_tokens over examples

    @property
    def is_preference(self) -> bool:
        """Whether the examples are DPO pairs (chosen, rejected)."""
        return self.format == "preference"

    @property
    def num_items(self) -> int:
        """What a step batches and an epoch visits: examples, or pairs of a preference file."""
        return len(self.examples) // 2 if self.is_preference else len(self.examples)

    def num_loss_tokens_in(self, example_indices: Iterable[int]) -> int:
        """Loss tokens of a step's examples: the denominator of that step's mean loss."""
        return sum(self.examples[i].num_loss_tokens for i in example_indices)


def check_method_data(method: str, data_format: str) -> None:
    """ValueError when a training file's format does not suit the job's method: dpo trains on
    preference pairs, supervised on the other formats."""
    if method == "dpo" and data_format != "preference":
        raise ValueError(f"method dpo trains on preference pairs ({{\"input\", "
                         f"\"preferred_output\", \"non_preferred_output\"}}), but the file "
                         f"holds {data_format} examples")
    if method != "dpo" and data_format == "preference":
        raise ValueError("the file holds preference pairs: train on them with method dpo")


def _eos_id(tokenizer: Any) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if type(eos) is not int:
        raise ValueError("the model's tokenizer has no eos token; it cannot mark where text ends")
    return eos


def _format_of(record: dict[str, Any]) -> str:
    keys = set(record)
    unknown = sorted(str(k) for k in keys if k not in _KEY_FORMAT)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)}; an example has the keys "
                         f"{_FORMAT_HELP}")
    formats = sorted({_KEY_FORMAT[k] for k in keys})
    if not formats:
        raise ValueError(f"empty object; an example has the keys {_FORMAT_HELP}")
    if len(formats) > 1:
        raise ValueError(f"mixes keys of the {' and '.join(formats)} formats ({sorted(keys)})")
    missing = sorted(DATA_FORMATS[formats[0]] - keys)
    if missing:
        raise ValueError(f"missing key(s) {', '.join(missing)}")
    return formats[0]


def _string(record: dict[str, Any], key: str, allow_empty: bool) -> str:
    value = record[key]
    if not isinstance(value, str):
        raise ValueError(f'"{key}" must be a string, got {type(value).__name__}')
    if not value and not allow_empty:
        raise ValueError(f'empty "{key}"')
    return value


def encode_example(record: dict[str, Any], data_format: str, tokenizer: Any,
                   ) -> tuple[list[int], list[bool]]:
    """Token ids and loss mask (untruncated) of one validated JSON object of `data_format`."""
    if data_format == "messages":
        parallel = record.get("parallel_tool_calls", True)
        if not isinstance(parallel, bool):
            raise ValueError(f'"parallel_tool_calls" must be a boolean, got {parallel!r}')
        return encode_chat(record["messages"], tokenizer, record.get("tools"))
    eos = _eos_id(tokenizer)
    if data_format == "text":
        ids = tokenizer(_string(record, "text", allow_empty=False)).input_ids + [eos]
        return ids, [False] + [True] * (len(ids) - 1)
    prompt_ids = tokenizer(_string(record, "prompt", allow_empty=True)).input_ids
    completion_ids = tokenizer(
        _string(record, "completion", allow_empty=False), add_special_tokens=False).input_ids
    ids = prompt_ids + completion_ids + [eos]
    mask = [False] * len(prompt_ids) + [True] * (len(completion_ids) + 1)
    mask[0] = False  # an empty prompt without BOS: the first completion token is not predicted
    return ids, mask


def _lines(source: bytes | str | os.PathLike[str]) -> list[bytes]:
    if isinstance(source, (bytes, bytearray)):
        data = bytes(source)
    else:
        with open(source, "rb") as f:
            data = f.read()
    if data.startswith(b"\xef\xbb\xbf"):  # a UTF-8 BOM some editors write
        data = data[3:]
    # Split on \n only: str.splitlines would also split inside JSON strings at U+2028 etc.
    return data.split(b"\n")


def _non_finite(constant: str) -> float:
    raise ValueError(f"{constant} is not a JSON number (numbers must be finite)")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:32]} overflows a float (numbers must be finite)")
    return value


def _check_text(value: Any) -> None:
    """ValueError for a string anywhere in a parsed line that is not valid Unicode text (a lone
    surrogate such as "\\ud800", which JSON escapes allow but no tokenizer can encode)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"a string holds the lone surrogate U+{ord(value[e.start]):04X} "
                             "(not valid Unicode text)") from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key)
            _check_text(item)
    elif isinstance(value, list):
        for item in value:
            _check_text(item)


def load_training_data(source: bytes | str | os.PathLike[str], tokenizer: Any,
                       max_seq_len: int) -> TrainingData:
    """Parse a JSONL training file (a path, or its bytes) into tokenized examples.

    `tokenizer`: a transformers tokenizer (its chat template for `messages`). Every problem is a
    ValueError starting with the 1-based line number, e.g. "line 3: empty \"completion\"".
    """
    if type(max_seq_len) is not int or max_seq_len < 2:
        raise ValueError(f"max_seq_len must be an integer >= 2, got {max_seq_len!r}")
    data_format: str | None = None
    format_line = 0
    examples: list[TrainingExample] = []
    events: list[TruncationEvent] = []
    for line_number, raw in enumerate(_lines(source), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"line {line_number}: not UTF-8 text ({e.reason})") from None
        if not line.strip():
            continue
        try:
            record = json.loads(line, parse_constant=_non_finite, parse_float=_finite_float)
            _check_text(record)
        except json.JSONDecodeError as e:
            raise ValueError(f"line {line_number}: not valid JSON ({e.msg} at column {e.colno})"
                             ) from None
        except ValueError as e:
            raise ValueError(f"line {line_number}: {e}") from None
        try:
            if not isinstance(record, dict):
                raise ValueError(f"expected a JSON object, got {type(record).__name__}")
            line_format = _format_of(record)
            if data_format is None:
                data_format, format_line = line_format, line_number
            elif line_format != data_format:
                raise ValueError(f"a {line_format} example, but line {format_line} is a "
                                 f"{data_format} example; a file holds one format")
            if line_format == "preference":
                sides = list(encode_preference(record, tokenizer))
            else:
                sides = [encode_example(record, line_format, tokenizer)]
        except ValueError as e:
            raise ValueError(f"line {line_number}: {e}") from None
        kept = []
        for ids, mask in sides:
            if len(ids) > max_seq_len:
                num_tokens = len(ids)
                ids, mask = ids[:max_seq_len], mask[:max_seq_len]
                events.append(TruncationEvent(line_number, num_tokens, max_seq_len,
                                              not any(mask)))
            kept.append(TrainingExample(line_number, ids, mask))
        if all(e.num_loss_tokens for e in kept):
            examples.extend(kept)
    if data_format is None:
        raise ValueError("the training file has no examples (it is empty)")
    if not examples:
        raise ValueError(f"no example has a trainable token within max_seq_len={max_seq_len}")
    return TrainingData(
        format=data_format,
        examples=examples,
        events=events,
        num_tokens=sum(e.num_tokens for e in examples),
        num_loss_tokens=sum(e.num_loss_tokens for e in examples),
    )
