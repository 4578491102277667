"""LoRA adapters: the first bypass-network kind, f_A(X) = scaling * (X A^T) B^T."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from flexserve.peft.bypass import TARGET_MODULES, BypassNetwork, check_placement, move_tensor


def lora_scaling(rank: int, lora_alpha: float, use_rslora: bool) -> float:
    """alpha / r, or alpha / sqrt(r) with rsLoRA (PEFT's rule)."""
    return lora_alpha / math.sqrt(rank) if use_rslora else lora_alpha / rank


@dataclass(slots=True, eq=False)
class LoRAAdapter(BypassNetwork):
    """One LoRA adapter's weights and hyper-parameters (PEFT's layout, on any device).

    weights[(layer, target)] = (A [rank, in], B [out, rank]); a missing key means no bypass there.
    """

    kind = "lora"

    rank: int  # r
    lora_alpha: float  # alpha
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, target) -> (A, B)
    use_rslora: bool = False  # scaling alpha / sqrt(r) instead of alpha / r
    lora_dropout: float = 0.0  # dropout on the bypass input; training only, ignored when serving
    base_model_name_or_path: str | None = None  # recorded from / written to adapter_config.json
    _targets: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if type(self.rank) is not int or self.rank <= 0:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank!r}")
        if isinstance(self.lora_alpha, bool) or not isinstance(self.lora_alpha, (int, float)):
            raise ValueError(f"lora_alpha must be a number, got {self.lora_alpha!r}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {self.lora_dropout!r}")
        if not self.weights:
            raise ValueError("a LoRA adapter needs weights for at least one module")
        for (layer, target), (a, b) in self.weights.items():
            if target not in TARGET_MODULES:
                raise ValueError(f"unsupported LoRA target module {target!r}")
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != self.rank or b.shape[1] != self.rank:
                raise ValueError(
                    f"layer {layer} {target}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} "
                    f"do not have rank {self.rank} ([r, in] and [out, r])"
                )
        present = {target for _, target in self.weights}
        self._targets = tuple(t for t in TARGET_MODULES if t in present)

    @property
    def scaling(self) -> float:
        return lora_scaling(self.rank, self.lora_alpha, self.use_rslora)

    @property
    def target_modules(self) -> tuple[str, ...]:
        return self._targets

    @property
    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())

    def attached(self, layer: int, target: str) -> bool:
        return (layer, target) in self.weights

    def delta(self, layer: int, target: str, x: torch.Tensor) -> torch.Tensor:
        a, b = self.weights[(layer, target)]
        return (x.to(a.dtype) @ a.T @ b.T) * self.scaling

    def check_compatible(
        self, shapes: dict[str, tuple[int, int]], num_layers: int, max_rank: int | None = None
    ) -> None:
        if max_rank is not None and self.rank > max_rank:
            raise ValueError(
                f"the adapter's rank {self.rank} exceeds max_lora_rank {max_rank} "
                "(--max-lora-rank)"
            )
        for (layer, target), (a, b) in sorted(self.weights.items()):
            in_features, out_features = check_placement(layer, target, shapes, num_layers)
            if a.shape[1] != in_features or b.shape[0] != out_features:
                raise ValueError(
                    f"the adapter does not fit the base model: layer {layer} {target} has "
                    f"lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}, the model's {target} "
                    f"needs lora_A [r, {in_features}] and lora_B [{out_features}, r]"
                )

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
           pin_memory: bool = False) -> LoRAAdapter:
        """A copy with its tensors moved/cast (pinned host memory speeds copies to the GPU)."""

        def move(t: torch.Tensor) -> torch.Tensor:
            return move_tensor(t, device, dtype, pin_memory)

        return LoRAAdapter(
            rank=self.rank, lora_alpha=self.lora_alpha,
            weights={k: (move(a), move(b)) for k, (a, b) in self.weights.items()},
            use_rslora=self.use_rslora, lora_dropout=self.lora_dropout,
            base_model_name_or_path=self.base_model_name_or_path,
        )

    @classmethod
    def create(
        cls,
        shapes: dict[str, tuple[int, int]],
        num_layers: int,
        rank: int,
        lora_alpha: float,
        target_modules: tuple[str, ...] | list[str],
        use_rslora: bool = False,
        lora_dropout: float = 0.0,
        generator: torch.Generator | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> LoRAAdapter:
        """A new adapter initialised as PEFT does: A kaiming-uniform (a = sqrt(5)), B = 0,
        so it starts as the identity on the base model."""
        unknown = sorted(set(target_modules) - set(TARGET_MODULES))
        if unknown:
            raise ValueError(f"unsupported LoRA target module(s): {', '.join(unknown)}")
        weights = {}
        for layer in range(num_layers):
            for target in target_modules:
                in_features, out_features = shapes[target]
                # kaiming_uniform_(a=sqrt(5)) on [r, in] is U(-1/sqrt(in), 1/sqrt(in)).
                bound = 1.0 / math.sqrt(in_features)
                a = (torch.rand(rank, in_features, generator=generator) * 2 - 1) * bound
                b = torch.zeros(out_features, rank)
                weights[(layer, target)] = (a.to(dtype), b.to(dtype))
        return cls(rank=rank, lora_alpha=lora_alpha, weights=weights, use_rslora=use_rslora,
                   lora_dropout=lora_dropout)
