"""The DPO loss (Rafailov et al. 2023; the sigmoid loss of TRL's `DPOTrainer`), per pair.

For a pair with chosen side c and rejected side r, `lp` is the sum of the policy's log-
probabilities of a side's loss tokens (its assistant turn) and `ref` the same under the reference
model (the policy as the job started: the backbone, plus `init_adapter` if one was given):

    z    = beta * ((lp_c - ref_c) - (lp_r - ref_r))
    loss = -logsigmoid(z)                              a step's loss: the mean over its pairs

The rewards are beta * (lp - ref) of each side, the margin their difference (z), and a pair is
accurate when its margin is positive. The gradient reaches each side through its summed token
cross-entropy CE = -lp: d loss / d CE_c = beta * sigmoid(-z) = -(d loss / d CE_r). So a side's
backward is a supervised backward whose per-token loss gradient is scaled by that coefficient
(divided by the step's number of pairs), which is how the worker runs it. Pure Python: the engine
computes the coefficients and the metrics from the log-probabilities the worker reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def log_sigmoid(x: float) -> float:
    """log(1 / (1 + exp(-x))) without overflow for large |x|."""
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


@dataclass(slots=True, frozen=True)
class PairResult:
    """One pair's DPO loss, rewards and gradient coefficient."""

    loss: float  # -logsigmoid(margin)
    chosen_reward: float  # beta * (lp_c - ref_c)
    rejected_reward: float  # beta * (lp_r - ref_r)
    coefficient: float  # d loss / d CE_c = beta * sigmoid(-margin); the rejected side gets -it

    @property
    def margin(self) -> float:
        return self.chosen_reward - self.rejected_reward


def dpo_pair(beta: float, policy_chosen: float, policy_rejected: float, reference_chosen: float,
             reference_rejected: float) -> PairResult:
    """The pair's result from the four summed log-probabilities (see the module docstring)."""
    chosen = beta * (policy_chosen - reference_chosen)
    rejected = beta * (policy_rejected - reference_rejected)
    margin = chosen - rejected
    return PairResult(-log_sigmoid(margin), chosen, rejected, beta * sigmoid(-margin))


@dataclass(slots=True)
class DPOMetrics:
    """Sums over pairs; `mean` turns them into a step's (or a validation file's) metrics."""

    num_pairs: int = 0
    loss_sum: float = 0.0
    chosen_reward_sum: float = 0.0
    rejected_reward_sum: float = 0.0
    num_accurate: int = 0  # pairs whose margin is positive

    def add(self, pair: PairResult) -> None:
        self.num_pairs += 1
        self.loss_sum += pair.loss
        self.chosen_reward_sum += pair.chosen_reward
        self.rejected_reward_sum += pair.rejected_reward
        self.num_accurate += pair.margin > 0

    def mean(self) -> dict[str, float]:
        """loss, rewards/chosen, rewards/rejected, rewards/margin and rewards/accuracy (the
        fraction of pairs whose margin is positive), each a mean over the pairs."""
        n = max(self.num_pairs, 1)
        chosen, rejected = self.chosen_reward_sum / n, self.rejected_reward_sum / n
        return {"loss": self.loss_sum / n, "rewards/chosen": chosen,
                "rewards/rejected": rejected, "rewards/margin": chosen - rejected,
                "rewards/accuracy": self.num_accurate / n}


def metric_fields(mean: dict[str, float], prefix: str) -> dict[str, float]:
    """The rewards of a `DPOMetrics.mean()` as metric fields `<prefix>_...` (prefix train or
    valid): what events and checkpoint metrics carry beside `<prefix>_loss`."""
    return {f"{prefix}_rewards_chosen": mean["rewards/chosen"],
            f"{prefix}_rewards_rejected": mean["rewards/rejected"],
            f"{prefix}_reward_margin": mean["rewards/margin"],
            f"{prefix}_preference_accuracy": mean["rewards/accuracy"]}
