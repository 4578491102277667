"""A job's result file: OpenAI's per-step metrics CSV (`step_metrics.csv`, purpose
"fine-tune-results"), built from the job's metrics events.

Columns as OpenAI writes them: step, train_loss, train_mean_token_accuracy, valid_loss,
valid_mean_token_accuracy, full_valid_loss, full_valid_mean_token_accuracy. A cell is empty where
the value was not computed (the validation loss exists only at checkpoints of a job with a
validation file; flexserve computes no validation accuracy and no separate full-validation pass).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable

from flexserve.finetune.records import EventRecord

RESULTS_PURPOSE = "fine-tune-results"
RESULTS_FILENAME = "step_metrics.csv"
RESULT_COLUMNS = ("step", "train_loss", "train_mean_token_accuracy", "valid_loss",
                  "valid_mean_token_accuracy", "full_valid_loss", "full_valid_mean_token_accuracy")


def step_metrics_csv(events: Iterable[EventRecord]) -> bytes:
    """The CSV of a job's metrics events (any order; a later value of a step wins)."""
    rows: dict[int, dict[str, float]] = {}
    for event in events:
        if event.type != "metrics" or not event.data or "step" not in event.data:
            continue
        row = rows.setdefault(int(event.data["step"]), {})
        for column in RESULT_COLUMNS[1:]:
            value = event.data.get(column)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                row[column] = value
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(RESULT_COLUMNS)
    for step in sorted(rows):
        writer.writerow([step, *(_cell(rows[step].get(c)) for c in RESULT_COLUMNS[1:])])
    return out.getvalue().encode()


def _cell(value: float | None) -> str:
    return "" if value is None else repr(float(value))
