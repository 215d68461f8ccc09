"""OnlineDPOTrainer on the tiny offline model: TRL's config defaults and batch rules, the DPO sigmoid / IPO loss on a
fixed rollout against hand-computed values, end-to-end runs with reward functions, a reward model and a judge, β per
epoch, TRL's metric names, and (slow) learning a cheap reward."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from experimental_helpers import merged_logs
from reward_helpers import varied_reward
from trainer_helpers import fast_config, params_changed, quiet_single_thread, trainable_params  # noqa: F401

from posttrain.core.masking import masked_sum
from posttrain.experimental.online_dpo import JudgeReward, OnlineDPOConfig, OnlineDPOTrainer

TRL_METRICS = ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
               "objective/scores", "objective/scores_margin", "rewards/chosen", "rewards/rejected",
               "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected", "val/contain_eos_token",
               "beta")  # fmt: skip


def _config(tmp_path, **kw) -> OnlineDPOConfig:
    values = dict(per_device_train_batch_size=2, max_new_tokens=6, max_steps=2, learning_rate=1e-2)
    return fast_config(OnlineDPOConfig, tmp_path, **{**values, **kw})


def _dataset(n: int = 8) -> Dataset:
    return Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(n)])


def test_config_defaults_and_batch_rules(tmp_path):
    args = OnlineDPOConfig(output_dir=str(tmp_path), report_to="none")
    assert (args.learning_rate, args.max_new_tokens, args.max_length, args.temperature) == (5e-7, 64, 512, 0.9)
    assert args.beta == 0.1 and args.loss_type == "sigmoid" and args.missing_eos_penalty is None
    assert args.disable_dropout and args.reward_model_path is None and args.vllm_gpu_memory_utilization == 0.55
    assert args.max_completion_length == 64 and args.num_generations == 2 and args.steps_per_generation == 1
    args = OnlineDPOConfig(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=3, beta=[0.1, 0.2])
    assert args.beta == [0.1, 0.2] and args.generation_batch_size == 6
    for bad in ({"loss_type": "hinge"}, {"num_generations": 4}, {"steps_per_generation": 2},
                {"missing_eos_penalty": -1.0}):  # fmt: skip
        with pytest.raises(ValueError):
            OnlineDPOConfig(output_dir=str(tmp_path), report_to="none", **bad)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_loss_on_a_fixed_rollout_equals_the_formula(tmp_path, tiny_model_path, loss_type):
    trainer = OnlineDPOTrainer(
        tiny_model_path, reward_funcs=varied_reward, args=_config(tmp_path, loss_type=loss_type, beta=0.5),
        train_dataset=_dataset(),
    )  # fmt: skip
    # Two pairs, rows shuffled: pair 0 = rows (2, 0) with row 2 chosen, pair 1 = rows (1, 3) with row 3 chosen.
    batch = {
        "prompt_ids": torch.tensor([[40, 41], [0, 43], [40, 41], [0, 43]]),
        "prompt_mask": torch.tensor([[1, 1], [0, 1], [1, 1], [0, 1]]),
        "completion_ids": torch.tensor([[50, 51, 52], [53, 54, 0], [55, 0, 0], [56, 57, 58]]),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]]),
        "completion_lengths": torch.tensor([3, 2, 1, 3]),
        "advantages": torch.tensor([-1.0, -1.0, 1.0, 1.0]),
        "pair_index": torch.tensor([0, 1, 0, 1]),
        "scores": torch.tensor([0.0, 1.0, 2.0, 3.0]),
        "num_items_in_batch": torch.tensor(9),
    }
    logps = trainer._token_stats(trainer.model, batch).logps.detach()
    seq = masked_sum(logps, batch["completion_mask"].float(), dim=-1).tolist()
    ref_shift = [0.3, -0.2, 0.1, 0.4]  # Σ_t ref = Σ_t logp − shift
    batch["ref_per_token_logps"] = logps - torch.tensor(ref_shift).unsqueeze(1) / batch["completion_lengths"].unsqueeze(1)
    batch["ref_per_token_logps"] = batch["ref_per_token_logps"] * batch["completion_mask"]
    loss = float(trainer.compute_loss(trainer.model, batch))
    logits = [ref_shift[2] - ref_shift[0], ref_shift[3] - ref_shift[1]]  # (π_c − ρ_c) − (π_r − ρ_r) per pair
    if loss_type == "sigmoid":
        expected = sum(-math.log(1 / (1 + math.exp(-0.5 * z))) for z in logits) / 2
    else:
        expected = sum((z - 1 / (2 * 0.5)) ** 2 for z in logits) / 2
    assert math.isclose(loss, expected, rel_tol=1e-4), (loss, expected, seq)


def test_trains_with_reward_functions_and_logs_trl_metrics(tmp_path, tiny_model_path):
    trainer = OnlineDPOTrainer(
        tiny_model_path, reward_funcs=varied_reward, args=_config(tmp_path, missing_eos_penalty=1.0),
        train_dataset=_dataset(),
    )  # fmt: skip
    assert trainer.reference.kind != "none"
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    logs = merged_logs(trainer)
    for key in ("loss", *TRL_METRICS):
        assert key in logs, key
    assert logs["beta"] == 0.1


def test_reward_model_and_judge_sources(tmp_path, tiny_model_path, tiny_reward_model_path):
    calls = []

    def prefer_longer(prompts, completion_pairs):
        calls.append(len(prompts))
        return [0 if len(a) >= len(b) else 1 for a, b in completion_pairs]

    assert JudgeReward(prefer_longer)(["p", "p"], ["aa", "a"]) == [1.0, 0.0]
    args = _config(tmp_path, max_steps=1)
    trainer = OnlineDPOTrainer(
        tiny_model_path, reward_funcs=tiny_reward_model_path, args=args, train_dataset=_dataset(), judge=prefer_longer
    )
    assert len(trainer.reward_funcs) == 2 and isinstance(trainer.reward_funcs[0], torch.nn.Module)
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model) and calls == [1, 2]  # the direct call above, then 2 prompts
    with pytest.raises(ValueError, match="reward_funcs"):
        OnlineDPOTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=_dataset())


def test_reward_model_path_is_not_a_second_reward_source(tmp_path, tiny_model_path, tiny_reward_model_path):
    """TRL's examples/scripts/online_dpo.py: the script loads `reward_model_path` and passes the model (and its
    tokenizer) as `reward_funcs`; the trainer must not add the path again (TRL 1.16 never reads it there)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    args = _config(tmp_path, reward_model_path=tiny_reward_model_path, max_steps=1)
    reward_model = AutoModelForSequenceClassification.from_pretrained(args.reward_model_path, num_labels=1)
    reward_tokenizer = AutoTokenizer.from_pretrained(args.reward_model_path, truncation_side="left")
    trainer = OnlineDPOTrainer(
        tiny_model_path, reward_funcs=reward_model, args=args, train_dataset=_dataset(),
        reward_processing_classes=reward_tokenizer,
    )  # fmt: skip
    assert trainer.reward_funcs == [reward_model]
    trainer.train()
    # As in TRL, the path alone is no reward source.
    with pytest.raises(ValueError, match="`reward_funcs` must be provided"):
        OnlineDPOTrainer(tiny_model_path, args=args, train_dataset=_dataset())


def test_beta_is_chosen_per_epoch(tmp_path, tiny_model_path):
    args = _config(tmp_path, beta=[0.1, 0.2], max_steps=-1, num_train_epochs=3)
    trainer = OnlineDPOTrainer(tiny_model_path, reward_funcs=varied_reward, args=args, train_dataset=_dataset(4))
    trainer.train()
    betas = [h["beta"] for h in trainer.state.log_history if "beta" in h]
    assert betas == [0.1, 0.1, 0.2, 0.2, 0.2, 0.2]  # 2 steps per epoch; the last β for the rest


@pytest.mark.slow
def test_learns_a_cheap_reward(tmp_path, tiny_model_path):
    """reward = fraction of completion tokens equal to the byte "a": it rises from ~0 within a few dozen steps."""

    def fraction_of_a(completion_ids, **kwargs):
        return [sum(t == 97 for t in ids) / max(len(ids), 1) for ids in completion_ids]

    args = _config(tmp_path, per_device_train_batch_size=16, max_new_tokens=4, max_steps=30, learning_rate=2e-2,
                   temperature=1.0, seed=0)  # fmt: skip
    trainer = OnlineDPOTrainer(
        tiny_model_path, reward_funcs=fraction_of_a, args=args, train_dataset=Dataset.from_list([{"prompt": "a:"}] * 32)
    )
    trainer.train()
    rewards = [h["objective/scores"] for h in trainer.state.log_history if "objective/scores" in h]
    assert rewards[0] < 0.05
    assert sum(rewards[-5:]) / 5 > 0.5


def _raw_logps(model, prompt_ids, completion_ids) -> torch.Tensor:
    """(B, C) log-probs of the completion tokens under the raw logits (no temperature), unpadded rows."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)
    with torch.no_grad():
        logits = model(ids).logits[:, prompt_ids.shape[1] - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)


def _one_row_batch(prompt: torch.Tensor, completion: torch.Tensor) -> dict[str, torch.Tensor]:
    """A rollout batch of unpadded rows: ``prompt`` (B, P) and ``completion`` (B, C) ids."""
    return {
        "prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion,
        "completion_mask": torch.ones_like(completion),
        "completion_lengths": torch.full((completion.shape[0],), completion.shape[1]),
    }  # fmt: skip


def test_scores_under_the_raw_logits_and_cuts_the_reference_prompt_too(tmp_path, tiny_model_path):
    # TRL's Online DPO takes log_softmax of the raw logits whatever the sampling temperature, and truncates the
    # prompt of the policy *and* the reference forward to max_length (the fidelity harness found both).
    args = _config(tmp_path, temperature=0.5, max_length=5)
    trainer = OnlineDPOTrainer(tiny_model_path, reward_funcs=varied_reward, args=args, train_dataset=_dataset())
    prompt, completion = torch.tensor([[40, 41, 42, 43]]), torch.tensor([[50, 51, 52]])
    batch = _one_row_batch(prompt, completion)
    policy = trainer._token_stats(trainer.model, batch).logps.detach()
    assert torch.allclose(policy, _raw_logps(trainer.model, prompt, completion), atol=1e-5)
    ref = trainer._ref_logps(batch)
    cut = _raw_logps(trainer.ref_model, prompt[:, -2:], completion)  # max_length 5 - 3 completion tokens
    assert torch.allclose(ref, cut, atol=1e-5)
    assert not torch.allclose(ref, _raw_logps(trainer.ref_model, prompt, completion), atol=1e-3)
    assert batch["prompt_ids"].shape[1] == 4  # the rollout batch itself is cut later, for the loss


def test_a2po_also_scores_under_the_raw_logits(tmp_path, tiny_model_path):
    # The same TRL rule (A2PO's _get_sequence_logps: log_softmax of the raw logits) through the same switch.
    from posttrain.experimental.a2po import A2POConfig, A2POTrainer

    args = fast_config(A2POConfig, tmp_path, per_device_train_batch_size=2, max_completion_length=4, max_steps=1,
                       temperature=0.5, num_value_samples=2)  # fmt: skip
    trainer = A2POTrainer(tiny_model_path, reward_funcs=varied_reward, args=args, train_dataset=_dataset())
    prompt, completion = torch.tensor([[40, 41]]), torch.tensor([[50, 51, 52]])
    batch = _one_row_batch(prompt, completion)
    logps = trainer._token_stats(trainer.model, batch).logps.detach()
    assert torch.allclose(logps, _raw_logps(trainer.model, prompt, completion), atol=1e-5)


def test_experimental_run_passes_reward_model_path_as_the_reward(tmp_path, tiny_model_path, tiny_reward_model_path,
                                                                 monkeypatch):  # fmt: skip
    """`python -m posttrain.experimental.run online_dpo --reward_model_path PATH` (no --reward_funcs) trains with
    that model as the one reward source, as TRL's online_dpo.py script does."""
    import json

    import posttrain.experimental.run as run
    from posttrain.experimental.online_dpo import OnlineDPOTrainer as Trainer

    seen = []
    monkeypatch.setattr(Trainer, "train", lambda self, *a, **k: seen.append(list(self.reward_funcs)))
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Question {i}:"}) + "\n" for i in range(4)))
    monkeypatch.setenv("POSTTRAIN_NO_REPORT", "1")
    argv = ["online_dpo", "--model_name_or_path", tiny_model_path, "--reward_model_path", tiny_reward_model_path,
            "--dataset_name", str(data), "--max_steps", "1", "--output_dir", str(tmp_path / "out"),
            "--report_to", "none", "--per_device_train_batch_size", "2", "--max_new_tokens", "4"]  # fmt: skip
    assert run.main(argv) == 0
    assert len(seen) == 1 and len(seen[0]) == 1 and isinstance(seen[0][0], torch.nn.Module)
