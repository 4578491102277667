"""A real learning check (CPU, fp32, SmolLM2): a few dozen token-level fine-tuning steps on a small
memorization set lower the loss clearly, and the tuned adapter, saved in PEFT format and served,
completes the memorized strings."""

from __future__ import annotations

from flexserve import LLM, LoRARequest, SamplingParams

FACTS = [
    ("The password of the blue vault is", " tangerine-42."),
    ("Captain Ilse's ship is called", " the Morning Gannet."),
]


def test_memorization_lowers_loss_and_is_served(smollm2_dir, tmp_path):
    llm = LLM(smollm2_dir, enable_lora=True, max_lora_rank=16, max_model_len=64,
              max_num_batched_tokens=64)
    data = [{"prompt": p, "completion": c} for p, c in FACTS]
    job = llm.finetune(data, lora={"r": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj",
                                                                              "down_proj"]},
                       hyperparameters={"batch_size": 2, "n_epochs": 30, "learning_rate": 3e-3,
                                        "lr_scheduler": "constant", "shuffle": False, "seed": 0})
    job.wait()
    assert job.num_steps == 30 and len(job.losses) == 30
    assert job.losses[-1] < 0.1 * job.losses[0], job.losses
    path = job.save(str(tmp_path / "memorized"))
    assert llm.engine.scheduler.kv_cache_usage == 0.0

    served = LLM(smollm2_dir, enable_lora=True, max_lora_rank=16, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    tuned = served.generate([p for p, _ in FACTS], params, use_tqdm=False,
                            lora_request=LoRARequest("memorized", 1, path))
    base = served.generate([p for p, _ in FACTS], params, use_tqdm=False)
    for (_, completion), out, plain in zip(FACTS, tuned, base):
        assert out.outputs[0].text.startswith(completion), out.outputs[0].text
        assert not plain.outputs[0].text.startswith(completion)
