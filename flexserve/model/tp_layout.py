"""Which part of each Llama weight a tensor-parallel rank holds (Megatron-LM's split).

q/k/v and gate/up are column-parallel: a rank computes its query heads, the key/value heads
they read, and its slice of the intermediate features. o_proj and down_proj are row-parallel:
a rank multiplies its slice of their inputs and the ranks' partial outputs are summed (their
bias added by rank 0 only). The embedding and lm_head are split by vocabulary rows, padded to
equal parts. Key/value heads are split when there are at least as many as ranks and replicated
(each rank holds the one its query heads read) when there are fewer.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

_COLUMN_BY_HEAD = ("q_proj.weight", "q_proj.bias")
_COLUMN_BY_KV_HEAD = ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")
_COLUMN_BY_FEATURE = ("gate_proj.weight", "gate_proj.bias", "up_proj.weight", "up_proj.bias")
_VOCAB_ROWS = ("embed_tokens.weight", "lm_head.weight")
_COLUMN_TARGETS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
# Row-parallel biases: added once to the summed output, so only rank 0 holds them.
_RANK0_BIASES = ("o_proj.bias", "down_proj.bias")


@dataclass(frozen=True, slots=True)
class TensorParallelLayout:
    """The model's sizes and this rank's share of them."""

    rank: int  # this rank, in [0, world_size)
    world_size: int  # tensor-parallel ranks
    num_heads: int  # query heads of the whole model
    num_kv_heads: int  # key/value heads of the whole model
    head_dim: int  # per-head width
    intermediate_size: int  # MLP features of the whole model
    vocab_size: int  # vocabulary rows of the whole model

    @classmethod
    def from_config(cls, config: Any, head_dim: int, rank: int = 0,
                    world_size: int = 1) -> TensorParallelLayout:
        """The layout of `config` at `world_size` ranks; ValueError when it does not split."""
        check_tensor_parallel(config, world_size)
        return cls(rank, world_size, config.num_attention_heads, config.num_key_value_heads,
                   head_dim, config.intermediate_size, config.vocab_size)

    @property
    def num_local_heads(self) -> int:
        return self.num_heads // self.world_size

    @property
    def num_local_kv_heads(self) -> int:
        return max(1, self.num_kv_heads // self.world_size)

    @property
    def kv_head_start(self) -> int:
        """The first key/value head of this rank (with replication: the one its heads read)."""
        return self.rank * self.num_kv_heads // self.world_size

    @property
    def local_intermediate_size(self) -> int:
        return self.intermediate_size // self.world_size

    @property
    def vocab_per_rank(self) -> int:
        """Vocabulary rows each rank holds, the last one padded."""
        return -(-self.vocab_size // self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_end(self) -> int:
        """One past this rank's last real vocabulary row."""
        return min(self.vocab_start + self.vocab_per_rank, self.vocab_size)

    def checkpoint_index(self, name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        """This rank's part of checkpoint tensor `name` (of full `shape`) as an index; None:
        the whole tensor."""
        if self.world_size == 1:
            return None
        if name.endswith(_COLUMN_BY_HEAD):
            width = self.num_local_heads * self.head_dim
            return (slice(self.rank * width, (self.rank + 1) * width),)
        if name.endswith(_COLUMN_BY_KV_HEAD):
            start = self.kv_head_start * self.head_dim
            return (slice(start, start + self.num_local_kv_heads * self.head_dim),)
        if name.endswith(_COLUMN_BY_FEATURE):
            width = self.local_intermediate_size
            return (slice(self.rank * width, (self.rank + 1) * width),)
        if name.endswith("o_proj.weight"):
            width = self.num_local_heads * self.head_dim
            return (slice(None), slice(self.rank * width, (self.rank + 1) * width))
        if name.endswith("down_proj.weight"):
            width = self.local_intermediate_size
            return (slice(None), slice(self.rank * width, (self.rank + 1) * width))
        if name.endswith(_VOCAB_ROWS):
            return (slice(self.vocab_start, self.vocab_end),)
        return None

    def lora_shard(self, target: str, lora_a, lora_b):
        """This rank's part of a LoRA adapter's A [r, in] and B [out, r] on projection `target`
        (S-LoRA's split): a column-parallel projection's B by output rows like its weight, A
        whole (its input is whole on every rank); a row-parallel projection's A by input
        columns like its weight, B whole: each rank's delta is then partial like its base
        output, and the all-reduce after the projection sums both."""
        a, b = self.lora_index(target, "A"), self.lora_index(target, "B")
        return lora_a if a is None else lora_a[a], lora_b if b is None else lora_b[b]

    def lora_index(self, target: str, half: str) -> tuple[slice, ...] | None:
        """This rank's part (`lora_shard`) of LoRA tensor `half` ("A" [r, in] or "B" [out, r])
        on `target` as an index into the whole tensor; None: the whole of it."""
        if self.world_size == 1 or (half == "A") == (target in _COLUMN_TARGETS):
            return None
        return self.checkpoint_index(f"{target}.weight", ())

    def lora_copies(self, target: str, half: str) -> int:
        """How many ranks hold each entry of this rank's part of a LoRA tensor: the world for a
        whole (replicated) tensor, the ranks that share a key/value head for a replicated
        head's k/v B rows, else 1. Each holder's gradient of a shared entry is partial (its
        own heads', features' or input columns' share): the gradient is their sum."""
        if self.world_size == 1:
            return 1
        if (half == "A") == (target in _COLUMN_TARGETS):
            return self.world_size
        if half == "B" and target in ("k_proj", "v_proj") and self.num_kv_heads < self.world_size:
            return self.world_size // self.num_kv_heads
        return 1

    def lora_owner(self, target: str, half: str) -> bool:
        """Whether this rank is the first holder of its part of a LoRA tensor (gathers take
        each entry once, from it)."""
        return self.rank % self.lora_copies(target, half) == 0

    def local_config(self, config: Any) -> Any:
        """A copy of the model's `config` with this rank's sizes: its query and key/value heads
        and MLP features (hidden size and vocabulary whole). The fine-tuning graph, activation
        store and gradient buffers of a rank are sized from it."""
        if self.world_size == 1:
            return config
        local = copy.copy(config)
        local.num_attention_heads = self.num_local_heads
        local.num_key_value_heads = self.num_local_kv_heads
        local.intermediate_size = self.local_intermediate_size
        local.head_dim = self.head_dim
        return local

    def is_vocab_parallel(self, name: str) -> bool:
        return self.world_size > 1 and name.endswith(_VOCAB_ROWS)

    def holds_bias(self, name: str) -> bool:
        """False for a row-parallel bias on a rank other than 0 (it holds zeros instead)."""
        return self.rank == 0 or not name.endswith(_RANK0_BIASES)


def check_tensor_parallel(config: Any, world_size: int) -> None:
    """ValueError when `world_size` ranks cannot split the model's heads and features."""
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {world_size!r}")
    if world_size == 1:
        return
    num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
    if num_heads % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} does not divide the model's "
                         f"{num_heads} attention heads")
    if num_kv_heads >= world_size and num_kv_heads % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} does not divide the model's "
                         f"{num_kv_heads} key/value heads")
    if num_kv_heads < world_size and world_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {world_size} is not a multiple of the model's "
                         f"{num_kv_heads} key/value heads (needed to replicate them)")
    if config.intermediate_size % world_size:
        raise ValueError(f"tensor_parallel_size {world_size} does not divide the model's "
                         f"intermediate_size {config.intermediate_size}")
