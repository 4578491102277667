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


QUESTIONS = [("What is the capital of France?", "Paris."), ("What is 2 + 2?", "4."),
             ("What colour is the sky on a clear day?", "Blue."),
             ("How many legs does a spider have?", "Eight.")]


def test_dpo_learns_the_preferences_and_moves_greedy_answers(smollm2_dir, tmp_path):
    """Short answers preferred over the base model's own greedy answers: the reward margin
    starts at 0 (the reference), the preference accuracy ends at 1, and the tuned model leaves
    the rejected answers, giving every preferred one more probability than the base does."""
    import json

    from flexserve.finetune.data import load_training_data

    llm = LLM(smollm2_dir, enable_lora=True, max_lora_rank=16, max_model_len=128,
              max_num_batched_tokens=256)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True) for q, _ in QUESTIONS]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    rejected = [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False)]
    pairs = [{"input": {"messages": [{"role": "user", "content": q}]},
              "preferred_output": [{"role": "assistant", "content": answer}],
              "non_preferred_output": [{"role": "assistant", "content": worse}]}
             for (q, answer), worse in zip(QUESTIONS, rejected)]
    job = llm.finetune(pairs, method="dpo",
                       lora={"r": 16, "alpha": 32,
                             "target_modules": ["q_proj", "v_proj", "down_proj"]},
                       hyperparameters={"beta": 0.1, "batch_size": 4, "n_epochs": 5,
                                        "learning_rate": 1e-3, "lr_scheduler": "constant",
                                        "shuffle": False, "seed": 0})
    job.wait()
    first, last = job.dpo_metrics[0], job.dpo_metrics[-1]
    assert abs(first["rewards/margin"]) < 1e-3 and abs(first["loss"] - 0.6931) < 1e-3
    assert last["rewards/accuracy"] == 1.0 and last["rewards/margin"] > 1.0, job.dpo_metrics
    assert job.losses == sorted(job.losses, reverse=True)
    tuned = LoRARequest("preferences", 1, job.save(str(tmp_path / "dpo")))

    data = load_training_data("".join(json.dumps(p) + "\n" for p in pairs).encode(),
                              tokenizer, 128)
    scoring = SamplingParams(max_tokens=1, prompt_logprobs=0)

    def logprobs(lora: LoRARequest | None) -> list[float]:
        outputs = llm.generate([e.input_ids for e in data.examples], scoring, use_tqdm=False,
                               lora_request=lora)
        return [sum(o.prompt_logprobs[p][t].logprob
                    for p, (t, counted) in enumerate(zip(e.input_ids, e.loss_mask)) if counted)
                for e, o in zip(data.examples, outputs)]

    base, after = logprobs(None), logprobs(tuned)
    for i in range(len(QUESTIONS)):
        assert after[2 * i] > base[2 * i]  # the preferred answer gained probability
        assert after[2 * i] > after[2 * i + 1]  # and beats the rejected one
    answers = [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False,
                                                       lora_request=tuned)]
    assert all(a != r for a, r in zip(answers, rejected)), answers
