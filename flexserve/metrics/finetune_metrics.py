"""Prometheus metrics of the fine-tuning job service (jobs by state; loss, steps and progress
per job).

Registered in the app's registry (`app.state.metrics.registry`) next to the serving metrics, so
one `/metrics` scrape shows both. Every metric carries the `model_name` label, as the others do.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

ALL_JOBS = "all"  # the job_id label of every job while job ids are not exported
JOB_STATES = ("validating_files", "queued", "running", "paused", "succeeded", "failed",
              "cancelled")


class FinetuneMetrics:
    """`flexserve:finetune_jobs{state}`, `flexserve:finetune_loss{job_id}`,
    `flexserve:finetune_steps_total{job_id}`, `flexserve:finetune_progress{job_id}`."""

    def __init__(self, registry: CollectorRegistry, model_name: str,
                 job_id_labels: bool = True) -> None:
        self.model_name = model_name
        # Off: job ids are tenants' data, so steps count under job_id="all" and the per-job
        # gauges (loss, progress) are not exported.
        self.job_id_labels = job_id_labels
        self._jobs = Gauge("flexserve:finetune_jobs", "Fine-tuning jobs in each state.",
                           ["model_name", "state"], registry=registry,
                           multiprocess_mode="mostrecent")
        for state in JOB_STATES:  # every state is exported, 0 included, so rates work at once
            self._jobs.labels(model_name, state).set(0)
        self._loss = Gauge("flexserve:finetune_loss",
                           "Training loss (mean token cross-entropy) of a job's latest step.",
                           ["model_name", "job_id"], registry=registry,
                           multiprocess_mode="mostrecent")
        # prometheus_client appends `_total` to a counter's samples.
        self._steps = Counter("flexserve:finetune_steps",
                              "Optimizer steps a job has done (a resumed job counts on).",
                              ["model_name", "job_id"], registry=registry)
        self._steps_counted: dict[str, int] = {}  # job id -> steps already in its counter
        self._progress = Gauge("flexserve:finetune_progress",
                               "Fraction of a job's optimizer steps done (steps done / total).",
                               ["model_name", "job_id"], registry=registry,
                               multiprocess_mode="mostrecent")

    def set_job_counts(self, counts: Mapping[str, int]) -> None:
        """The number of jobs in each state (states left out are 0)."""
        for state in JOB_STATES:
            self._jobs.labels(self.model_name, state).set(counts.get(state, 0))

    def observe_step(self, job_id: str, loss: float, num_steps_done: int,
                     num_steps: int | None = None) -> None:
        """A job finished an optimizer step: its loss, and the steps done in total (the counter
        is moved up to it, so a restarted server resumes the count of a resumed job) out of
        `num_steps` planned (its progress)."""
        if self.job_id_labels:
            self._loss.labels(self.model_name, job_id).set(loss)
            if num_steps:
                self._progress.labels(self.model_name, job_id).set(num_steps_done / num_steps)
        delta = num_steps_done - self._steps_counted.get(job_id, 0)
        if delta > 0:
            label = job_id if self.job_id_labels else ALL_JOBS
            self._steps.labels(self.model_name, label).inc(delta)
            self._steps_counted[job_id] = num_steps_done
