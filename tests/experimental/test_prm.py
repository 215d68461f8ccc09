"""PRMTrainer on the offline tiny model: step labels land on each separator token, train_on_last_step_only, a few
training steps change the parameters, the loss equals cross-entropy at the labelled positions, eval accuracy,
up-front validation."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from trainer_helpers import fast_config, params_changed, quiet_single_thread, trainable_params  # noqa: F401

from posttrain.data.formats import DataFormatError
from posttrain.experimental.prm import PRMConfig, PRMTrainer, compute_accuracy
from posttrain.experimental.prm.prm_trainer import tokenize_stepwise_row
from posttrain.models.tiny import build_tiny_tokenizer


def stepwise(n: int = 4) -> Dataset:
    rows = [
        (
            "Which number is larger, 9.8 or 9.11?",
            ["The fractional part of 9.8 is 0.8.", "So 9.11 is larger."],
            [True, False],
        ),
        ("What is 2 + 3?", ["2 + 3 = 5.", "The answer is 5."], [True, True]),
        ("What is 4 * 2?", ["4 * 2 = 6.", "The answer is 6.", "Done."], [False, False, False]),
    ]
    rows = [rows[i % 3] for i in range(n)]
    return Dataset.from_dict(
        {"prompt": [r[0] for r in rows], "completions": [r[1] for r in rows], "labels": [r[2] for r in rows]}
    )


def _config(tmp_path, **kw) -> PRMConfig:
    return fast_config(
        PRMConfig, tmp_path, **{"max_steps": 2, "per_device_train_batch_size": 2, "learning_rate": 1e-3, **kw}
    )


def test_labels_sit_on_each_separator_token():
    tok = build_tiny_tokenizer()
    row = {"prompt": "Q?", "completions": ["ab", "cd"], "labels": [True, False]}
    out = tokenize_stepwise_row(row, tok, "\n", None, None, False, False)
    sep = tok.encode("\n", add_special_tokens=False)
    prompt = tok("Q?", add_special_tokens=False)["input_ids"]
    ab, cd = (tok(s, add_special_tokens=False)["input_ids"] for s in ("ab", "cd"))
    assert out["input_ids"] == prompt + ab + sep + cd + sep
    expected = [-100] * (len(prompt) + len(ab) + len(sep) - 1) + [1] + [-100] * (len(cd) + len(sep) - 1) + [0]
    assert out["labels"] == expected
    last_only = tokenize_stepwise_row(row, tok, "\n", None, None, True, False)["labels"]
    assert [v for v in last_only if v != -100] == [0]
    # evaluation keeps every step's label even with train_on_last_step_only (TRL)
    assert tokenize_stepwise_row(row, tok, "\n", None, None, True, True)["labels"] == expected
    cut = tokenize_stepwise_row(row, tok, "\n", 3, None, False, False)
    assert len(cut["input_ids"]) == len(cut["labels"]) == 3


def test_trains_and_evaluates(tmp_path, tiny_model_path):
    trainer = PRMTrainer(
        tiny_model_path,
        args=_config(tmp_path, per_device_eval_batch_size=2, train_on_last_step_only=True),
        train_dataset=stepwise(),
        eval_dataset=stepwise(3),
    )
    assert trainer.model.config.num_labels == 2
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    assert "loss" in trainer.state.log_history[0]
    metrics = trainer.evaluate()
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0 and "eval_loss" in metrics


def test_loss_is_cross_entropy_at_labelled_positions(tmp_path, tiny_model_path):
    trainer = PRMTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=stepwise(2))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    model = trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    keep = batch["labels"] != -100
    assert int(keep.sum()) == 4  # two steps per row
    expected = torch.nn.functional.cross_entropy(logits[keep], batch["labels"][keep])
    torch.testing.assert_close(loss, expected)


def test_compute_accuracy_ignores_unlabelled_positions():
    preds = torch.tensor([[[0.0, 1.0], [5.0, 0.0], [1.0, 0.0]]]).numpy()
    labels = torch.tensor([[1, -100, 1]]).numpy()
    assert compute_accuracy((preds, labels)) == {"accuracy": 0.5}


def test_up_front_validation(tmp_path, tiny_model_path):
    with pytest.raises(ValueError, match="step_separator"):
        _config(tmp_path, step_separator="")
    with pytest.raises(ValueError, match="PRMTrainer"):  # wrong dataset type
        PRMTrainer(
            tiny_model_path,
            args=_config(tmp_path),
            train_dataset=Dataset.from_dict({"prompt": ["a"], "completion": ["b"]}),
        )
    mismatched = Dataset.from_dict({"prompt": ["a"], "completions": [["x", "y"]], "labels": [[True]]})
    with pytest.raises(DataFormatError, match="same length"):
        PRMTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=mismatched)


def test_trust_remote_code_is_a_prm_option(tmp_path, tiny_model_path, monkeypatch):
    """`python -m posttrain.experimental.run prm --trust_remote_code` parses (ModelConfig no longer declares it, so
    PRMConfig does, as the other configs) and reaches the model and tokenizer loading."""
    import json

    import posttrain.experimental.prm.prm_trainer as prm_trainer
    import posttrain.experimental.run as run
    import posttrain.scripts._common as common

    assert PRMConfig(output_dir=str(tmp_path), report_to="none").trust_remote_code is False
    seen = {}
    monkeypatch.setattr(common, "build_and_train", lambda method, cls, script, args, *rest, **kw: seen.update(
        args=args))  # fmt: skip
    data = tmp_path / "steps.jsonl"
    data.write_text(json.dumps({"prompt": "Q?", "completions": ["a", "b"], "labels": [True, False]}) + "\n")
    argv = ["prm", "--model_name_or_path", tiny_model_path, "--dataset_name", str(data), "--trust_remote_code",
            "--output_dir", str(tmp_path / "out"), "--report_to", "none", "--max_steps", "1"]  # fmt: skip
    assert run.main(argv) == 0
    assert isinstance(seen["args"], PRMConfig) and seen["args"].trust_remote_code is True

    loaded = {}

    def from_pretrained(path, **kwargs):
        loaded.update(kwargs)
        raise RuntimeError("stop")

    from transformers import AutoModelForTokenClassification

    monkeypatch.setattr(AutoModelForTokenClassification, "from_pretrained", from_pretrained)
    with pytest.raises(RuntimeError, match="stop"):
        prm_trainer._load_token_classifier(tiny_model_path, seen["args"])
    assert loaded["trust_remote_code"] is True and loaded["num_labels"] == 2
