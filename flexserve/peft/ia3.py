"""(IA)3 adapters (Liu et al. 2022, PEFT's `IA3Config`): a learned vector l rescales one tensor.

For an output-scaled target (q/k/v/o/gate/up by default) Y = l * (X W^T); for a feed-forward target
(PEFT's `feedforward_modules`, down_proj in its Llama default) the input is scaled instead:
Y = (l * X) W^T. FlexLLM (section 4.1) writes the elementwise product in the bypass form
Y = f_B(X) + f_A(X) around an identity backbone op: T * l = T + T * (l - 1), so f_A(T) = T * (l - 1)
on the tensor T that l multiplies (the linear's output, or its input for a feed-forward target).
`delta` is that f_A; `forward` is the whole adapted linear, computed as PEFT computes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from flexserve.peft.bypass import TARGET_MODULES, BypassNetwork, check_placement, move_tensor

# PEFT's IA3 default for Llama-family models (TRANSFORMERS_MODELS_TO_IA3_*_MAPPING["llama"]).
IA3_DEFAULT_TARGETS = ("k_proj", "v_proj", "down_proj")
IA3_DEFAULT_FEEDFORWARD = ("down_proj",)


@dataclass(slots=True, eq=False)
class IA3Adapter(BypassNetwork):
    """One (IA)3 adapter's vectors (on any device).

    weights[(layer, target)] = l, 1-D: [out_features] for output-scaled targets, [in_features] for
    targets in `feedforward_modules`. A missing key means no adapter on that linear.
    """

    kind = "ia3"

    weights: dict[tuple[int, str], torch.Tensor]  # (layer, target) -> l, [out] or [in]
    feedforward_modules: tuple[str, ...]  # targets whose input (not output) l scales
    base_model_name_or_path: str | None = None  # recorded from / written to adapter_config.json
    _targets: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if not self.weights:
            raise ValueError("an (IA)3 adapter needs a vector for at least one module")
        for (layer, target), vector in self.weights.items():
            if target not in TARGET_MODULES:
                raise ValueError(f"unsupported (IA)3 target module {target!r}")
            if not isinstance(vector, torch.Tensor) or vector.dim() != 1:
                shape = tuple(vector.shape) if isinstance(vector, torch.Tensor) else vector
                raise ValueError(
                    f"layer {layer} {target}: the (IA)3 vector must be 1-D, got {shape}")
        present = {target for _, target in self.weights}
        self.feedforward_modules = tuple(self.feedforward_modules)
        stray = sorted(set(self.feedforward_modules) - present)
        if stray:  # PEFT: feedforward_modules must be a subset of target_modules
            raise ValueError(
                f"feedforward_modules {', '.join(stray)} must be among the adapted modules "
                f"({', '.join(t for t in TARGET_MODULES if t in present)})"
            )
        self._targets = tuple(t for t in TARGET_MODULES if t in present)

    @property
    def target_modules(self) -> tuple[str, ...]:
        return self._targets

    @property
    def num_bytes(self) -> int:
        return sum(v.nbytes for v in self.weights.values())

    def is_feedforward(self, target: str) -> bool:
        """Whether l scales this target's input (True) or its output (False)."""
        return target in self.feedforward_modules

    def attached(self, layer: int, target: str) -> bool:
        return (layer, target) in self.weights

    def scale(self, layer: int, target: str, t: torch.Tensor) -> torch.Tensor:
        """t * l in l's dtype, cast back to t's dtype (PEFT's rounding)."""
        vector = self.weights[(layer, target)]
        return (t.to(vector.dtype) * vector).to(t.dtype)

    def delta(self, layer: int, target: str, x: torch.Tensor) -> torch.Tensor:
        """f_A(T) = T * (l - 1) for the tensor T that l multiplies: the linear's output for an
        output-scaled target, its input for a feed-forward one (FlexLLM's bypass form)."""
        vector = self.weights[(layer, target)]
        return x.to(vector.dtype) * (vector - 1)

    def forward(
        self,
        layer: int,
        target: str,
        x: torch.Tensor,
        base: torch.Tensor,
        weight: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The adapted linear's output Y for input x, given base = f_B(x) = x W^T (+ bias).

        Output-scaled: Y = l * base. Feed-forward: Y = (l * x) W^T + bias, which needs the
        backbone's `weight` (and bias): scaling precedes the GEMM, so `base` cannot be reused.
        """
        if not self.attached(layer, target):
            return base
        if not self.is_feedforward(target):
            return self.scale(layer, target, base)
        if weight is None:
            raise ValueError(
                f"{target} is a feed-forward (IA)3 target (its input is scaled): pass the "
                "backbone linear's weight"
            )
        return F.linear(self.scale(layer, target, x), weight, bias)

    def check_compatible(
        self, shapes: dict[str, tuple[int, int]], num_layers: int, max_rank: int | None = None
    ) -> None:
        """ValueError unless every vector fits its linear. `max_rank` is ignored: (IA)3 vectors
        have no rank."""
        for (layer, target), vector in sorted(self.weights.items()):
            in_features, out_features = check_placement(layer, target, shapes, num_layers)
            feedforward = self.is_feedforward(target)
            expected = in_features if feedforward else out_features
            if vector.shape[0] != expected:
                side = "input (feed-forward module)" if feedforward else "output"
                raise ValueError(
                    f"the adapter does not fit the base model: layer {layer} {target} has an "
                    f"(IA)3 vector of length {vector.shape[0]}; the model's {target} scales its "
                    f"{side}, which has {expected} features"
                )

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
           pin_memory: bool = False) -> IA3Adapter:
        """A copy with its vectors moved/cast (pinned host memory speeds copies to the GPU)."""

        return IA3Adapter(
            weights={k: move_tensor(v, device, dtype, pin_memory) for k, v in self.weights.items()},
            feedforward_modules=self.feedforward_modules,
            base_model_name_or_path=self.base_model_name_or_path,
        )

    @classmethod
    def create(
        cls,
        shapes: dict[str, tuple[int, int]],
        num_layers: int,
        target_modules: tuple[str, ...] | list[str] = IA3_DEFAULT_TARGETS,
        feedforward_modules: tuple[str, ...] | list[str] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> IA3Adapter:
        """A new adapter initialised as PEFT does: every l = 1, so it starts as the identity.

        `feedforward_modules` None means PEFT's Llama default: down_proj when it is a target.
        """
        unknown = sorted(set(target_modules) - set(TARGET_MODULES))
        if unknown:
            raise ValueError(f"unsupported (IA)3 target module(s): {', '.join(unknown)}")
        if feedforward_modules is None:
            feedforward_modules = tuple(t for t in IA3_DEFAULT_FEEDFORWARD if t in target_modules)
        weights = {}
        for layer in range(num_layers):
            for target in target_modules:
                in_features, out_features = shapes[target]
                length = in_features if target in feedforward_modules else out_features
                weights[(layer, target)] = torch.ones(length, dtype=dtype)
        return cls(weights=weights, feedforward_modules=tuple(feedforward_modules))
