"""AdapterOptimizer equals torch.optim.AdamW + clip_grad_norm_ + transformers' LR schedulers."""

from __future__ import annotations

import io

import pytest
import torch
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_schedule_with_warmup,
    get_linear_schedule_with_warmup,
)

from flexserve.finetune import AdapterOptimizer, Hyperparameters, lr_at
from flexserve.finetune.optimizer import AdapterOptimizer as DirectAdapterOptimizer

NUM_STEPS = 5
SHAPES = {"layers.0.q_proj.lora_A": (4, 16), "layers.0.q_proj.lora_B": (24, 4),
          "layers.1.down_proj.lora_A": (4, 7)}


def transformers_scheduler(name: str, optimizer, warmup: int, total: int):
    if name == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup)
    if name == "linear":
        return get_linear_schedule_with_warmup(optimizer, warmup, total)
    return get_cosine_schedule_with_warmup(optimizer, warmup, total)


def random_params(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # Deliberately not in sorted order; one bf16 tensor: masters are fp32 copies of any dtype.
    params = {name: torch.randn(shape, generator=gen) for name, shape in reversed(SHAPES.items())}
    params["layers.1.down_proj.lora_A"] = params["layers.1.down_proj.lora_A"].bfloat16()
    return params


def random_grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    # Large enough that clipping at 1.0 always bites (global norm ~ 3 * sqrt(numel)).
    return {name: 3.0 * torch.randn(shape, generator=gen) for name, shape in SHAPES.items()}


def reference_run(params, num_steps: int, schedule: str, warmup: int, weight_decay: float,
                  max_grad_norm: float | None):
    """The plain HF-style loop: fp32 params, clip_grad_norm_, AdamW, a transformers scheduler."""
    names = sorted(params)
    tensors = [torch.nn.Parameter(params[n].float().clone()) for n in names]
    optimizer = torch.optim.AdamW(tensors, lr=3e-2, weight_decay=weight_decay)
    scheduler = transformers_scheduler(schedule, optimizer, warmup, NUM_STEPS)
    norms, lrs = [], []
    for step in range(num_steps):
        grads = random_grads(step)
        for name, tensor in zip(names, tensors):
            tensor.grad = grads[name].clone()
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(tensors, max_grad_norm)))
        else:
            norms.append(float(torch.nn.utils.get_total_norm([t.grad for t in tensors])))
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return dict(zip(names, (t.detach() for t in tensors))), norms, lrs


def make_optimizer(params, schedule, warmup, weight_decay, max_grad_norm):
    return AdapterOptimizer(params, num_training_steps=NUM_STEPS, learning_rate=3e-2,
                            lr_scheduler=schedule, warmup_steps=warmup,
                            weight_decay=weight_decay, max_grad_norm=max_grad_norm)


def run(optimizer: AdapterOptimizer, steps: range) -> list[float]:
    norms = []
    for step in steps:
        grads = random_grads(step)
        # Accumulated in two halves, as windows of a sequence would arrive (0.5 g + 0.5 g == g
        # exactly in binary floating point, so the sum equals the reference's gradient).
        optimizer.add_grads({n: g * 0.5 for n, g in grads.items()})
        optimizer.add_grads({n: g * 0.5 for n, g in grads.items()})
        norms.append(optimizer.step())
    return norms


CASES = [
    ("constant", 0, 0.0, 1.0), ("constant", 2, 0.1, None), ("linear", 0, 0.0, 1.0),
    ("linear", 2, 0.1, 1.0), ("linear", 3, 0.0, None), ("cosine", 0, 0.1, None),
    ("cosine", 2, 0.0, 1.0), ("cosine", 1, 0.1, 1000.0),
]


@pytest.mark.parametrize("schedule, warmup, weight_decay, max_grad_norm", CASES)
def test_five_steps_match_plain_adamw_and_transformers_scheduler(schedule, warmup, weight_decay,
                                                                 max_grad_norm):
    params = random_params()
    expected, expected_norms, expected_lrs = reference_run(
        params, NUM_STEPS, schedule, warmup, weight_decay, max_grad_norm)
    optimizer = make_optimizer(params, schedule, warmup, weight_decay, max_grad_norm)
    norms = run(optimizer, range(NUM_STEPS))
    assert list(optimizer.masters) == sorted(SHAPES)
    for name, tensor in optimizer.masters.items():
        assert tensor.dtype == torch.float32
        # Bitwise: the same kernels on the same fp32 values.
        assert torch.equal(tensor, expected[name]), name
    assert norms == pytest.approx(expected_norms, rel=0, abs=0)
    assert [optimizer.lr_at(s) for s in range(NUM_STEPS)] == expected_lrs
    assert optimizer.num_completed_steps == NUM_STEPS
    assert all(not g.any() for g in optimizer.grads.values())  # zeroed after each step
    if max_grad_norm == 1.0:
        assert min(norms) > 1.0  # the clipping cases really clipped


def test_params_changed_and_originals_untouched():
    params = random_params()
    before = {n: t.clone() for n, t in params.items()}
    optimizer = make_optimizer(params, "linear", 0, 0.0, 1.0)
    run(optimizer, range(1))
    for name in params:
        assert torch.equal(params[name], before[name])  # masters are copies
        assert not torch.equal(optimizer.masters[name], before[name].float())


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup, total", [(0, 1), (0, 7), (3, 10), (10, 10), (12, 10)])
def test_lr_at_equals_transformers_schedulers(schedule, warmup, total):
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=2e-4)
    scheduler = transformers_scheduler(schedule, optimizer, warmup, total)
    expected = []
    for _ in range(total + 3):  # past the end too
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    got = [lr_at(s, 2e-4, schedule, warmup, total) for s in range(total + 3)]
    assert got == expected


def test_lr_values():
    assert [lr_at(s, 1.0, "linear", 2, 6) for s in range(6)] == [0.0, 0.5, 1.0, 0.75, 0.5, 0.25]
    assert [lr_at(s, 1.0, "constant", 2, 6) for s in range(4)] == [0.0, 0.5, 1.0, 1.0]
    assert lr_at(0, 1.0, "cosine", 0, 4) == 1.0
    assert lr_at(2, 1.0, "cosine", 0, 4) == pytest.approx(0.5, abs=1e-15)


def test_state_dict_round_trip_continues_identically():
    params = random_params()
    uninterrupted = make_optimizer(params, "cosine", 1, 0.1, 1.0)
    full_norms = run(uninterrupted, range(NUM_STEPS))

    first = make_optimizer(params, "cosine", 1, 0.1, 1.0)
    first_norms = run(first, range(3))
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    # A fresh optimizer over different starting values: the checkpoint replaces all of it.
    resumed = make_optimizer(random_params(seed=7), "cosine", 1, 0.1, 1.0)
    resumed.add_grads(random_grads(99))  # stale gradients are dropped by the load
    resumed.load_state_dict(state)
    assert resumed.num_completed_steps == 3
    rest_norms = run(resumed, range(3, NUM_STEPS))
    assert first_norms + rest_norms == full_norms
    for name in SHAPES:
        assert torch.equal(resumed.masters[name], uninterrupted.masters[name])


def test_state_dict_is_a_snapshot():
    optimizer = make_optimizer(random_params(), "linear", 0, 0.0, 1.0)
    run(optimizer, range(1))
    state = optimizer.state_dict()
    saved = {n: t.clone() for n, t in state["masters"].items()}
    exp_avg = state["adamw"]["state"][0]["exp_avg"].clone()
    run(optimizer, range(1, 2))
    assert state["num_completed_steps"] == 1
    assert all(torch.equal(state["masters"][n], saved[n]) for n in SHAPES)
    assert torch.equal(state["adamw"]["state"][0]["exp_avg"], exp_avg)
    assert not torch.equal(optimizer.state_dict()["adamw"]["state"][0]["exp_avg"], exp_avg)


def test_load_state_dict_rejects_another_adapter():
    optimizer = make_optimizer(random_params(), "linear", 0, 0.0, 1.0)
    state = optimizer.state_dict()
    other = dict(state, masters={"x": torch.zeros(1)})
    with pytest.raises(ValueError, match="checkpoint tensors"):
        optimizer.load_state_dict(other)
    masters = {**state["masters"], "layers.0.q_proj.lora_A": torch.zeros(2)}
    wrong_shape = dict(state, masters=masters)
    with pytest.raises(ValueError, match="layers.0.q_proj.lora_A: checkpoint shape"):
        optimizer.load_state_dict(wrong_shape)
    with pytest.raises(ValueError, match="checkpoint step 9 is outside 0..5"):
        optimizer.load_state_dict(dict(state, num_completed_steps=9))


def test_add_grads_checks_names_and_shapes():
    optimizer = make_optimizer(random_params(), "linear", 0, 0.0, 1.0)
    with pytest.raises(ValueError, match="no adapter tensor named 'nope'"):
        optimizer.add_grads({"nope": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"gradient shape \(3,\) does not match \(4, 16\)"):
        optimizer.add_grads({"layers.0.q_proj.lora_A": torch.zeros(3)})
    optimizer.add_grads({"layers.0.q_proj.lora_A": torch.ones(4, 16, dtype=torch.bfloat16)})
    assert optimizer.grads["layers.0.q_proj.lora_A"].dtype == torch.float32
    assert optimizer.grads["layers.0.q_proj.lora_A"].sum().item() == 64.0


def test_no_step_past_the_planned_number():
    optimizer = make_optimizer(random_params(), "linear", 0, 0.0, 1.0)
    run(optimizer, range(NUM_STEPS))
    with pytest.raises(RuntimeError, match="all 5 planned optimizer steps are done"):
        optimizer.step()


def test_from_hyperparameters():
    hp = Hyperparameters(learning_rate=3e-2, lr_scheduler="cosine", warmup_steps=1,
                         weight_decay=0.1, max_grad_norm=1.0)
    a = AdapterOptimizer.from_hyperparameters(random_params(), hp, NUM_STEPS)
    b = make_optimizer(random_params(), "cosine", 1, 0.1, 1.0)
    assert run(a, range(NUM_STEPS)) == run(b, range(NUM_STEPS))
    assert all(torch.equal(a.masters[n], b.masters[n]) for n in SHAPES)
    assert AdapterOptimizer is DirectAdapterOptimizer  # the package's lazy export


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_training_steps=0), "num_training_steps must be a positive integer"),
    (dict(lr_scheduler="step"), "lr_scheduler must be one of constant, linear, cosine"),
    (dict(warmup_steps=-1), "warmup_steps must be an integer >= 0"),
    (dict(learning_rate=0.0), "learning_rate must be a positive number"),
    (dict(weight_decay=-0.1), "weight_decay must be >= 0"),
    (dict(max_grad_norm=0.0), "max_grad_norm must be positive or None"),
])
def test_constructor_rejects_bad_settings(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdapterOptimizer(random_params(), **{"num_training_steps": 5, **kwargs})
    with pytest.raises(ValueError, match="needs at least one tensor"):
        AdapterOptimizer({}, num_training_steps=5)
    with pytest.raises(ValueError, match="cannot be trained"):
        AdapterOptimizer({"a": torch.zeros(2, dtype=torch.int64)}, num_training_steps=5)
