"""PPOTrainer on the tiny offline model: TRL's config defaults, the value-head wrapper, the PPO loss on a fixed rollout
against hand-computed values, end-to-end runs (reward functions, a reward model) with TRL's metrics and a trained
value head, and (slow) learning a dense reward."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from reward_helpers import VariedReward
from trainer_helpers import fast_config, params_changed, quiet_single_thread, trainable_params  # noqa: F401

from posttrain.experimental.ppo import AutoModelForCausalLMWithValueHead, PPOConfig, PPOTrainer

TRL_METRICS = ("objective/kl", "objective/entropy", "objective/non_score_reward", "objective/rlhf_reward",
               "objective/scores", "val/num_eos_tokens", "policy/approxkl_avg", "policy/clipfrac_avg",
               "loss/policy_avg", "loss/value_avg", "val/clipfrac_avg", "policy/entropy_avg", "val/ratio")  # fmt: skip


varied_reward = VariedReward(modulus=3)  # rewards 0, 1 or 2


def _config(tmp_path, **kw) -> PPOConfig:
    values = dict(per_device_train_batch_size=4, response_length=6, max_steps=2, learning_rate=1e-2,
                  num_ppo_epochs=2)  # fmt: skip
    return fast_config(PPOConfig, tmp_path, **{**values, **kw})


def _dataset(n: int = 8) -> Dataset:
    return Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(n)])


def test_config_defaults(tmp_path):
    args = PPOConfig(output_dir=str(tmp_path), report_to="none")
    assert (args.num_ppo_epochs, args.num_mini_batches, args.whiten_rewards, args.kl_coef) == (4, 1, False, 0.05)
    assert (args.kl_estimator, args.cliprange, args.vf_coef, args.cliprange_value) == ("k1", 0.2, 0.1, 0.2)
    assert (args.gamma, args.lam, args.response_length, args.temperature) == (1.0, 0.95, 53, 0.7)
    assert args.learning_rate == 3e-6 and args.missing_eos_penalty is None
    assert args.num_iterations == 4 and args.max_completion_length == 53 and args.beta == 0.05
    for bad in ({"kl_estimator": "k2"}, {"num_generations": 2}, {"missing_eos_penalty": -1.0}):
        with pytest.raises(ValueError):
            PPOConfig(output_dir=str(tmp_path), report_to="none", **bad)


def test_value_head_wrapper_round_trip(tmp_path, tiny_model_path):
    model = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_model_path)
    ids = torch.tensor([[40, 41, 42]])
    logits, _, value = model(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert logits.shape[:2] == (1, 3) and value.shape == (1, 3)
    with torch.no_grad():
        model.v_head.summary.bias.fill_(3.0)
    model.save_pretrained(str(tmp_path / "vh"))
    again = AutoModelForCausalLMWithValueHead.from_pretrained(str(tmp_path / "vh"))
    assert torch.equal(again.v_head.summary.bias, torch.tensor([3.0]))
    assert torch.equal(again.v_head.summary.weight, model.v_head.summary.weight)


def test_loss_on_a_fixed_rollout_equals_the_formula(tmp_path, tiny_model_path):
    args = _config(tmp_path, cliprange=0.2, cliprange_value=0.2, vf_coef=0.5)
    trainer = PPOTrainer(args=args, model=tiny_model_path, reward_funcs=varied_reward, train_dataset=_dataset())
    trainer.model.eval()
    batch = {
        "prompt_ids": torch.tensor([[40, 41], [0, 43]]),
        "prompt_mask": torch.tensor([[1, 1], [0, 1]]),
        "completion_ids": torch.tensor([[50, 51, 52], [53, 0, 0]]),
        "completion_mask": torch.tensor([[1, 1, 1], [1, 0, 0]]),
        "completion_lengths": torch.tensor([3, 1]),
        "advantages": torch.tensor([0.0, 0.0]),
        "num_items_in_batch": torch.tensor(4),
    }
    with torch.no_grad():
        logps = trainer._token_stats(trainer.model, batch).logps
        values = trainer._values(trainer.model, batch)
    shift = torch.tensor([[0.5, -0.1, 0.0], [-0.5, 0.0, 0.0]])  # log-ratio θ vs old
    batch["old_per_token_logps"] = logps - shift
    batch["token_advantages"] = torch.tensor([[1.0, 1.0, -1.0], [-2.0, 0.0, 0.0]])
    batch["old_values"] = values - torch.tensor([[0.5, 0.0, 0.1], [0.0, 0.0, 0.0]])
    batch["returns"] = values + torch.tensor([[1.0, 0.2, 0.0], [0.3, 0.0, 0.0]])
    loss = float(trainer.compute_loss(trainer.model, batch))
    # policy, −min(w·A, clip(w, 0.8, 1.2)·A) per token: w = e^0.5, A = 1 → −1.2; w = e^−0.1, A = 1 → −e^−0.1;
    # w = 1, A = −1 → 1; w = e^−0.5, A = −2 → −min(−1.213, −1.6) = 1.6
    pg = (-1.2 - math.exp(-0.1) + 1.0 + 1.6) / 4
    # value: token (0,0) V − V_old = 0.5 → clipped to 0.2: errors (−1)² vs (−1.3)² → 1.69; (0,1): 0.04; (0,2):
    # V − V_old = 0.1 (inside the range): 0; (1,0): 0.09
    vf = 0.5 * (1.69 + 0.04 + 0.0 + 0.09) / 4
    expected = pg + 0.5 * vf
    assert loss == pytest.approx(expected, rel=1e-4)


def test_trains_policy_and_value_head_and_logs_trl_metrics(tmp_path, tiny_model_path):
    trainer = PPOTrainer(
        args=_config(tmp_path, kl_estimator="k3", missing_eos_penalty=1.0), model=tiny_model_path,
        reward_funcs=varied_reward, train_dataset=_dataset(),
    )  # fmt: skip
    assert trainer.reference.kind != "none"
    before = trainable_params(trainer.model)
    assert any(name.endswith("v_head.summary.weight") for name in before)
    trainer.train()
    assert params_changed(before, trainer.model)
    after = dict(trainer.model.named_parameters())
    assert not torch.equal(before["v_head.summary.weight"], after["v_head.summary.weight"].detach())
    logs = {k: v for h in trainer.state.log_history for k, v in h.items()}
    for key in ("loss", *TRL_METRICS):
        assert key in logs, key


def test_reward_model_and_value_model_rules(tmp_path, tiny_model_path, tiny_reward_model_path):
    with pytest.raises(ValueError, match="value head"):
        PPOTrainer(args=_config(tmp_path), model=tiny_model_path, reward_funcs=varied_reward,
                   train_dataset=_dataset(), value_model=torch.nn.Linear(1, 1))  # fmt: skip
    wrapper = AutoModelForCausalLMWithValueHead.from_pretrained(tiny_model_path)
    trainer = PPOTrainer(args=_config(tmp_path, max_steps=1, kl_coef=0.0), model=wrapper,
                         reward_model=tiny_reward_model_path, train_dataset=_dataset())  # fmt: skip
    assert trainer.value_head is wrapper.v_head and trainer.reference.kind == "none"
    assert isinstance(trainer.reward_funcs[0], torch.nn.Module)
    trainer.train()
    assert trainer.state.log_history[0]["objective/kl"] == 0.0


@pytest.mark.slow
def test_learns_a_dense_reward(tmp_path, tiny_model_path):
    """reward = fraction of even token ids (~0.5 for the random tiny model): it rises above 0.75 in 30 steps."""

    def even_tokens(completion_ids, **kwargs):
        return [sum(t % 2 == 0 for t in ids) / max(len(ids), 1) for ids in completion_ids]

    args = _config(tmp_path, per_device_train_batch_size=16, response_length=4, max_steps=30, learning_rate=1e-2,
                   lr_scheduler_type="constant", temperature=1.0, num_ppo_epochs=1, seed=0)  # fmt: skip
    dataset = Dataset.from_list([{"prompt": f"a{i}:"} for i in range(64)])
    trainer = PPOTrainer(args=args, model=tiny_model_path, reward_funcs=even_tokens, train_dataset=dataset)
    trainer.train()
    scores = [h["objective/scores"] for h in trainer.state.log_history if "objective/scores" in h]
    assert sum(scores[:3]) / 3 < 0.6
    assert sum(scores[-5:]) / 5 > 0.75
