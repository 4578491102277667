"""How inference and fine-tuning share the GPU, and the temporal-sharing baselines; plain Python.

FlexLLM co-serves: every iteration mixes inference and fine-tuning tokens. The baselines it is
compared with (section 8, figure 11) alternate instead: fixed-frequency temporal sharing runs one
fine-tuning step after every n inference iterations, and Dynamic Temporal Sharing (appendix A,
algorithm 3) adapts n to queue pressure. The classes here only decide *when* to switch; the
scheduler runs the phases.
"""

from __future__ import annotations

import enum


class SharingPolicy(str, enum.Enum):
    """Which way inference and fine-tuning share the device."""

    COSERVE = "coserve"  # FlexLLM: both kinds of tokens in every iteration
    TEMPORAL = "temporal"  # one fine-tuning step after every n inference iterations
    DYNAMIC_TEMPORAL = "dynamic-temporal"  # algorithm 3 picks n from queue pressure
    SPATIAL = "spatial"  # separate streams/partitions run the two concurrently
    INFERENCE_ONLY = "inference-only"  # fine-tuning never runs

    @classmethod
    def parse(cls, value: str | SharingPolicy) -> SharingPolicy:
        """The policy named by `value` (case and `_`/`-` insensitive); ValueError listing the
        choices otherwise."""
        if isinstance(value, cls):
            return value
        return cls(value)

    @classmethod
    def _missing_(cls, value: object) -> SharingPolicy:
        if isinstance(value, str):
            normalized = value.strip().lower().replace("_", "-")
            for member in cls:
                if member.value == normalized:
                    return member
        choices = ", ".join(member.value for member in cls)
        raise ValueError(f"unknown sharing policy {value!r}; choose one of: {choices}")


def _check_positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


class TemporalSharing:
    """Fixed-frequency temporal sharing: one fine-tuning step after every n inference iterations
    (n is the "inference frequency" of FlexLLM figure 11)."""

    def __init__(self, frequency: int) -> None:
        _check_positive_int("frequency", frequency)
        self.frequency = frequency  # n: inference iterations per fine-tuning step
        self.num_iterations = 0  # inference iterations since the last fine-tuning phase

    def after_iteration(self) -> bool:
        """Call after each inference iteration; True on every n-th call: fine-tune now."""
        self.num_iterations += 1
        if self.num_iterations >= self.frequency:
            self.num_iterations = 0
            return True
        return False


# Constants of algorithm 3, named by their role.
_MIN_INTERVAL = 64  # f at low pressure; lower end of the final clamp; idle (no stats) interval
_MAX_INTERVAL = 512  # f at high pressure; upper end of the clamp and of the non-recompute path
_FLOOR_INTERVAL = 64 + 16  # line 41's floor on f_s
_RECOMPUTE_EVERY = 3  # line 11: recompute the interval on every third decision
_REUSE_GROWTH = 1.1  # line 15: between recomputes the interval grows by 10% of f_p
_STABILIZATION = 1.35  # line 38
_LOW_PRESSURE = 0.8  # line 31
_HIGH_PRESSURE = 2.0  # line 33
_INTERPOLATION_SCALE = 0.6  # line 37


class DynamicTemporalSharing:
    """Dynamic Temporal Sharing, algorithm 3 of FlexLLM appendix A, line by line.

    Inference runs for `interval` (s) scheduler steps, then one fine-tuning phase. Every step
    records the queue length q, batch size b, arrivals a and completions c. At a switch the next
    interval is recomputed from the recorded pressure on every third switch only; in between it
    is min(512, 1.1 * f_p). The statistics are reset at every switch.

    The paper does not give initial values of s and f_p; we start both at 64, the interval the
    algorithm itself uses for an idle system and at low pressure, so a fresh server switches as
    often as the clamp allows until its first recompute has seen the load. d starts at 0.
    """

    def __init__(self, initial_interval: int = 64, initial_frequency: float = 64.0) -> None:
        _check_positive_int("initial_interval", initial_interval)
        if (
            isinstance(initial_frequency, bool)
            or not isinstance(initial_frequency, (int, float))
            or not initial_frequency > 0
            or initial_frequency == float("inf")
        ):
            raise ValueError(
                f"initial_frequency must be a finite number > 0, got {initial_frequency!r}"
            )
        self._interval: float = float(initial_interval)  # s: inference steps left before switching
        self._prev_frequency: float = float(initial_frequency)  # f_p: smoothed previous frequency
        self._decisions = 0  # d: switches since the last recompute
        self._queue_lengths: list[int] = []  # Q: q of each step since the last switch
        self._batch_sizes: list[int] = []  # B: b of each step since the last switch
        self._num_arrivals = 0  # r_a: arrivals since the last switch
        self._num_completions = 0  # r_c: completions since the last switch

    @property
    def interval(self) -> float:
        """s: inference steps left before the next switch (fractional after a recompute)."""
        return self._interval

    @property
    def prev_frequency(self) -> float:
        """f_p: the hysteresis memory of line 39-40 (before line 41's floor)."""
        return self._prev_frequency

    @property
    def decisions(self) -> int:
        """d: switches since the last recompute (0, 1 or 2 between steps)."""
        return self._decisions

    @property
    def queue_lengths(self) -> list[int]:
        """Q: a copy of the queue lengths recorded since the last switch."""
        return list(self._queue_lengths)

    @property
    def batch_sizes(self) -> list[int]:
        """B: a copy of the batch sizes recorded since the last switch."""
        return list(self._batch_sizes)

    @property
    def num_arrivals(self) -> int:
        """r_a: requests arrived since the last switch."""
        return self._num_arrivals

    @property
    def num_completions(self) -> int:
        """r_c: requests completed since the last switch."""
        return self._num_completions

    def scheduler_step(
        self, queue_length: int, batch_size: int, num_arrivals: int, num_completions: int
    ) -> bool:
        """SCHEDULER_STEP(q, b, a, c), once per inference iteration: True means switch to
        fine-tuning now, False means continue inference."""
        for name, value in (
            ("queue_length", queue_length),
            ("batch_size", batch_size),
            ("num_arrivals", num_arrivals),
            ("num_completions", num_completions),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        self._num_arrivals += num_arrivals  # line 4
        self._num_completions += num_completions  # line 5
        self._queue_lengths.append(queue_length)  # line 6
        # Line 7: B is recorded as the algorithm does although line 24's mean is never used.
        self._batch_sizes.append(batch_size)
        self._interval -= 1  # line 8
        if self._interval <= 0:  # line 9
            self._decisions += 1  # line 10
            if self._decisions >= _RECOMPUTE_EVERY:  # line 11
                self._interval = self.compute_next_interval()  # line 12
                self._decisions = 0  # line 13
            else:
                self._interval = min(_MAX_INTERVAL, self._prev_frequency * _REUSE_GROWTH)  # line 15
            # Line 16. The flattened pseudo-code leaves open whether RESET_STATS belongs to the
            # else branch only; we reset at every switch, so each recompute sees exactly the
            # steps since the previous switch.
            self._reset_stats()
            return True  # line 17
        return False  # line 18

    def compute_next_interval(self) -> float:
        """COMPUTE_NEXT_INTERVAL (lines 19-42): the next interval from the recorded statistics.
        Updates f_p as a side effect (line 40). Called with no statistics it returns 64 and
        changes nothing; from `scheduler_step` Q always holds at least the current step."""
        if not self._queue_lengths:  # line 20
            return float(_MIN_INTERVAL)  # line 21
        num_steps = len(self._queue_lengths)
        mean_queue = sum(self._queue_lengths) / num_steps  # line 22
        max_queue = max(self._queue_lengths)  # line 23
        # Line 24 computes mean(B) but nothing reads it; skipped as dead code.
        arrival_rate = self._num_arrivals / num_steps  # line 25: lambda, arrivals per step
        completion_rate = self._num_completions / num_steps  # line 26: mu
        queue_pressure = min(1.0, mean_queue / 20.0)  # line 27
        spike_pressure = min(0.5, max_queue / 25.0)  # line 28
        backlog_pressure = max(0.0, (arrival_rate - completion_rate) / 8.0)  # line 29
        pressure = queue_pressure + spike_pressure + backlog_pressure  # line 30
        if pressure <= _LOW_PRESSURE:  # line 31
            frequency = float(_MIN_INTERVAL)  # line 32
        elif pressure >= _HIGH_PRESSURE:  # line 33
            frequency = float(_MAX_INTERVAL)  # line 34
        else:
            normalized = (pressure - _LOW_PRESSURE) / (_HIGH_PRESSURE - _LOW_PRESSURE)  # line 36
            frequency = _MIN_INTERVAL + normalized * _INTERPOLATION_SCALE * (
                _MAX_INTERVAL - _MIN_INTERVAL
            )  # line 37
        # Line 38. The pseudo-code lost its indentation; this line follows the whole if/else
        # chain, so we apply it to every branch (the text: "stabilization adjustments to computed
        # frequencies"). Heavy load thus gives 691.2, which line 42 clamps to 512 while f_p keeps
        # the unclamped average.
        frequency *= _STABILIZATION
        smoothed = (frequency + 2.0 * self._prev_frequency) / 3.0  # line 39
        # Line 40 stores the average before line 41's floor: f_p may sit below 80 (and above
        # 512), and it is f_p that the next non-recompute switches (line 15) grow from.
        self._prev_frequency = smoothed
        smoothed = max(smoothed, _FLOOR_INTERVAL)  # line 41
        return min(max(smoothed, float(_MIN_INTERVAL)), float(_MAX_INTERVAL))  # line 42

    def _reset_stats(self) -> None:
        """RESET_STATS: clear Q, B, r_a and r_c."""
        self._queue_lengths.clear()
        self._batch_sizes.clear()
        self._num_arrivals = 0
        self._num_completions = 0
