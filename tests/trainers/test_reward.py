"""RewardTrainer end to end on the offline tiny sequence classifier: data formats, margin and centering against
hand-computed Bradley–Terry losses, long pairs filtered, metrics, PEFT, saving, and a learning test."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset

# quiet_single_thread: an autouse fixture, active in this module once imported
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

from posttrain.trainers.reward import RewardConfig, RewardTrainer

METRICS = ["accuracy", "margin", "min_reward", "mean_reward", "max_reward", "num_tokens"]


def _pairs(n: int = 4, margin: bool = False) -> Dataset:
    data = {
        "chosen": ["The sky is blue.", "Grass is green."] * (n // 2),
        "rejected": ["The sky is red.", "Grass is pink and hot."] * (n // 2),
    }
    if margin:
        data["margin"] = [0.5, 1.5] * (n // 2)
    return Dataset.from_dict(data)


def _config(tmp_path, **kw) -> RewardConfig:
    return fast_config(RewardConfig, tmp_path, **{"max_steps": 1, "per_device_train_batch_size": 4, **kw})


def _rewards(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        r = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
    half = r.shape[0] // 2
    return r[:half], r[half:]


@pytest.mark.parametrize(
    "margin, center", [(False, None), (True, None), (True, 0.01)], ids=["plain", "margin", "margin+center"]
)
def test_first_loss_matches_bradley_terry(tmp_path, tiny_reward_model_path, margin, center):
    """loss = −mean log σ(r_c − r_r − m) + η·mean((r_c + r_r)²), with rewards from the untrained model."""
    data = _pairs(4, margin=margin)
    trainer = RewardTrainer(
        tiny_reward_model_path,
        args=_config(tmp_path, center_rewards_coefficient=center, train_sampling_strategy="sequential"),
        train_dataset=data,
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(4)])
    r_c, r_r = _rewards(trainer.model, batch)
    m = batch["margin"] if margin else torch.zeros(4)
    expected = -F.logsigmoid(r_c - r_r - m).mean()
    if center is not None:
        expected = expected + center * ((r_c + r_r) ** 2).mean()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["loss"] == pytest.approx(expected.item(), abs=1e-5)
    assert all(name in logged for name in METRICS)
    assert logged["accuracy"] == pytest.approx((r_c > r_r).float().mean().item())
    assert logged["margin"] == pytest.approx((r_c - r_r).mean().item(), abs=1e-5)
    rewards = torch.cat([r_c, r_r])
    assert logged["min_reward"] == pytest.approx(rewards.min().item(), abs=1e-5)
    assert logged["max_reward"] == pytest.approx(rewards.max().item(), abs=1e-5)
    assert logged["num_tokens"] == batch["attention_mask"].sum().item()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_config_defaults(tmp_path):
    config = RewardConfig(output_dir=str(tmp_path))
    assert (config.learning_rate, config.max_length, config.center_rewards_coefficient) == (1e-4, 1024, None)
    assert config.gradient_checkpointing is True and config.logging_steps == 10


def test_long_pairs_are_filtered_not_truncated(tmp_path, tiny_reward_model_path):
    data = Dataset.from_dict({"chosen": ["short", "x" * 40], "rejected": ["tiny", "no"]})
    trainer = RewardTrainer(tiny_reward_model_path, args=_config(tmp_path, max_length=16), train_dataset=data)
    assert len(trainer.train_dataset) == 1
    assert len(trainer.train_dataset[0]["chosen_ids"]) == 6  # "short" + EOS, untouched


@pytest.mark.parametrize("kind", ["explicit_standard", "implicit_conversational", "explicit_conversational"])
def test_dataset_formats(tmp_path, tiny_reward_model_path, tiny_tokenizer, kind):
    user = [{"role": "user", "content": "Sky?"}]
    blue, red = [{"role": "assistant", "content": "Blue."}], [{"role": "assistant", "content": "Red."}]
    if kind == "explicit_standard":
        data = Dataset.from_dict({"prompt": ["The sky is"] * 2, "chosen": [" blue."] * 2, "rejected": [" red."] * 2})
    elif kind == "implicit_conversational":
        data = Dataset.from_list([{"chosen": user + blue, "rejected": user + red}] * 2)
    else:
        data = Dataset.from_list([{"prompt": user, "chosen": blue, "rejected": red}] * 2)
    trainer = RewardTrainer(
        tiny_reward_model_path, args=_config(tmp_path, per_device_train_batch_size=2), train_dataset=data
    )
    chosen = tiny_tokenizer.decode(trainer.train_dataset[0]["chosen_ids"])
    if kind == "explicit_standard":
        assert chosen == "The sky is blue.<|im_end|>"  # prompt prepended, EOS appended
    else:
        assert chosen.startswith("<|im_start|>user\nSky?<|im_end|>") and "Blue.<|im_end|>" in chosen
    trainer.train()


def test_pretokenized_and_legacy_columns(tmp_path, tiny_reward_model_path):
    legacy = Dataset.from_dict({"chosen_input_ids": [[65, 66, 258]] * 2, "rejected_input_ids": [[67, 258]] * 2})
    with pytest.warns(FutureWarning, match="chosen_ids"):
        trainer = RewardTrainer(
            tiny_reward_model_path, args=_config(tmp_path, per_device_train_batch_size=2), train_dataset=legacy
        )
    assert trainer.train_dataset[0]["chosen_ids"] == [65, 66, 258]
    trainer.train()


def test_model_must_have_one_label(tmp_path, tiny_reward_model_path):
    from posttrain.models.tiny import build_tiny_model

    model = build_tiny_model(task="sequence-classification")
    model.config.num_labels = 2
    with pytest.raises(ValueError, match="num_labels=2"):
        RewardTrainer(model, args=_config(tmp_path), train_dataset=_pairs())


def test_peft_seq_cls_and_save(tmp_path, tiny_reward_model_path):
    from peft import LoraConfig

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS")
    trainer = RewardTrainer(
        tiny_reward_model_path, args=_config(tmp_path, max_steps=2), train_dataset=_pairs(), peft_config=config
    )
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert any("lora_" in n for n in trainable) and any("score" in n for n in trainable)
    trainer.train()
    trainer.save_model()
    assert os.path.exists(tmp_path / "adapter_config.json")


def test_chat_template_path_and_eos_token(tmp_path, tiny_reward_model_path, tiny_tokenizer):
    template = tmp_path / "simple.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    data = Dataset.from_list(
        [
            {
                "chosen": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                "rejected": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no"}],
            }
        ]
        * 2
    )
    args = _config(
        tmp_path, chat_template_path=str(template), eos_token="<|endoftext|>", per_device_train_batch_size=2
    )
    trainer = RewardTrainer(tiny_reward_model_path, args=args, train_dataset=data)
    assert tiny_tokenizer.decode(trainer.train_dataset[0]["chosen_ids"]) == "[user] hi\n[assistant] yo\n"
    assert trainer.processing_class.eos_token == "<|endoftext|>"
    with pytest.raises(ValueError, match="not in the tokenizer's vocabulary"):
        RewardTrainer(tiny_reward_model_path, args=_config(tmp_path, eos_token="<nope>"), train_dataset=_pairs())


def test_learns_and_evaluates(tmp_path, tiny_reward_model_path, monkeypatch):
    """Chosen answers end in '!' and rejected ones in '?': accuracy on held-out pairs reaches 1."""
    words = ["apple", "river", "stone", "cloud", "green", "table", "light", "music", "ocean", "paper"]
    train = Dataset.from_dict({"chosen": [w + "!" for w in words[:8]], "rejected": [w + "?" for w in words[:8]]})
    held_out = Dataset.from_dict({"chosen": [w + "!" for w in words[8:]], "rejected": [w + "?" for w in words[8:]]})
    args = _config(tmp_path, max_steps=30, learning_rate=3e-3, per_device_eval_batch_size=2)
    trainer = RewardTrainer(tiny_reward_model_path, args=args, train_dataset=train, eval_dataset=held_out)
    trainer.train()
    trainer.evaluate()
    assert trainer.state.log_history[-1]["eval_accuracy"] == 1.0
    prediction = trainer.predict(trainer.eval_dataset)
    assert (
        prediction.predictions.shape == (2, 2) and (prediction.predictions[:, 0] > prediction.predictions[:, 1]).all()
    )
    monkeypatch.chdir(tmp_path)
    default = RewardTrainer(tiny_reward_model_path, train_dataset=train)
    assert default.args.output_dir == f"{os.path.basename(tiny_reward_model_path)}-Reward"
