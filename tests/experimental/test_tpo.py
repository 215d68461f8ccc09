"""TPOTrainer end to end on the offline tiny model: every loss type trains and logs TRL's metrics, the loss equals
the contrastive formula + tpo_alpha·NLL(gold) on the model's own full-logit log-probs, tpo_alpha=0 drops the gold
block, implicit prompts are stripped from the reference, validation; the seed docs' configs build."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from experimental_helpers import naive_logps
from trainer_helpers import fast_config, params_changed, quiet_single_thread, trainable_params  # noqa: F401

from posttrain.data.formats import DataFormatError
from posttrain.experimental.tpo import DataCollatorForTriplePreference, TPOConfig, TPOTrainer
from posttrain.experimental.tpo.tpo_trainer import tokenize_triple_preference
from posttrain.models.tiny import build_tiny_tokenizer

METRICS = [
    "entropy",
    "num_tokens",
    "logits/chosen",
    "logits/rejected",
    "mean_token_accuracy",
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
]


def triples(n: int = 4) -> Dataset:
    rows = [
        ("The sky is", " blue.", " red.", " blue and clear."),
        ("Grass is", " green.", " pink.", " green and soft."),
        ("Snow is", " white.", " hot.", " white and cold."),
        ("Coal is", " black.", " soft and round.", " black and hard."),
    ]
    rows = [rows[i % 4] for i in range(n)]
    return Dataset.from_dict(
        {k: [r[i] for r in rows] for i, k in enumerate(["prompt", "chosen", "rejected", "reference"])}
    )


def _config(tmp_path, **kw) -> TPOConfig:
    return fast_config(
        TPOConfig, tmp_path, **{"max_steps": 1, "per_device_train_batch_size": 2, "learning_rate": 1e-3, **kw}
    )


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "tpo-l"])
def test_each_loss_type_trains_and_logs_trl_metrics(tmp_path, tiny_model_path, loss_type):
    trainer = TPOTrainer(
        tiny_model_path, args=_config(tmp_path, loss_type=loss_type, beta=0.1), train_dataset=triples()
    )
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    logged = trainer.state.log_history[0]
    assert all(name in logged for name in METRICS), sorted(set(METRICS) - set(logged))


@pytest.mark.parametrize(("loss_type", "tpo_alpha"), [("sigmoid", 0.5), ("tpo-l", 1.0), ("sigmoid", 0.0)])
def test_loss_equals_formula_on_full_logits(tmp_path, tiny_model_path, loss_type, tpo_alpha):
    args = _config(tmp_path, loss_type=loss_type, beta=0.1, tpo_alpha=tpo_alpha, label_smoothing=0.1)
    trainer = TPOTrainer(tiny_model_path, args=args, train_dataset=triples(2))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    assert batch["input_ids"].shape[0] == (6 if tpo_alpha else 4)  # tpo_alpha=0: no gold block
    model = trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
        sums, lengths, logps, mask = naive_logps(model, batch)
    seq = sums / lengths if loss_type == "tpo-l" else sums
    z = 0.1 * (seq[:2] - seq[2:4])
    if loss_type == "tpo-l":
        z = z - 0.5  # β(Δ − γ/β), γ = tpo_l_gamma
    expected = (-0.9 * torch.nn.functional.logsigmoid(z) - 0.1 * torch.nn.functional.logsigmoid(-z)).mean()
    if tpo_alpha:
        expected = expected + tpo_alpha * (-(logps[4:] * mask[4:]).sum() / mask[4:].sum())
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)


def test_collator_layout():
    collator = DataCollatorForTriplePreference(pad_token_id=0)
    out = collator(
        [
            {"prompt_ids": [1, 2, 3], "chosen_ids": [4, 5], "rejected_ids": [6], "reference_ids": [7, 8]},
            {"prompt_ids": [9, 10], "chosen_ids": [11], "rejected_ids": [12, 13], "reference_ids": [14]},
        ]
    )
    assert out["input_ids"].tolist() == [
        [1, 2, 3, 4, 5],
        [9, 10, 11, 0, 0],
        [1, 2, 3, 6, 0],
        [9, 10, 12, 13, 0],
        [1, 2, 3, 7, 8],
        [9, 10, 14, 0, 0],
    ]
    assert out["completion_mask"].tolist()[4] == [0, 0, 0, 1, 1]
    assert out["attention_mask"].tolist()[1] == [1, 1, 1, 0, 0]


def test_implicit_prompt_is_stripped_from_reference():
    tok = build_tiny_tokenizer()
    row = {"chosen": "The sky is blue.", "rejected": "The sky is red.", "reference": "The sky is blue and clear."}
    out = tokenize_triple_preference(row, tok)
    assert tok.decode(out["prompt_ids"]) == "The sky is"
    assert tok.decode(out["reference_ids"]).startswith(" blue and clear.")
    with pytest.raises(DataFormatError, match="does not start with the implicit prompt"):
        tokenize_triple_preference({**row, "reference": "Something else."}, tok)


def test_up_front_validation(tmp_path, tiny_model_path):
    with pytest.raises(ValueError, match="sigmoid, hinge, ipo, tpo-l"):
        _config(tmp_path, loss_type="tpo_l")
    with pytest.raises(ValueError, match="reference"):
        TPOTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=triples().remove_columns("reference"))
    with pytest.raises(ValueError, match="TPOTrainer"):
        TPOTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=Dataset.from_dict({"text": ["a"]}))


def test_paper_index_configs_build():
    # paper_index.md, "Triple Preference Optimization" (s/trl/posttrain/)
    from posttrain.experimental.tpo import TPOConfig

    training_args = TPOConfig(
        loss_type="sigmoid",  # contrastive loss between chosen and rejected (Section 3 of the paper)
        tpo_alpha=1.0,  # weight of the NLL term on the gold response (Section 3 of the paper)
        beta=0.01,  # β temperature (Table 6 of the paper)
        learning_rate=5e-7,  # Table 6 of the paper
        num_train_epochs=1,
        max_length=1024,
        report_to="none",
    )
    assert training_args.tpo_l_gamma == 0.5
    training_args = TPOConfig(
        loss_type="tpo-l",  # length-normalized variant (Section 3 of the paper)
        tpo_alpha=1.0,
        beta=0.01,
        tpo_l_gamma=0.5,  # γ target reward margin (Table 6 of the paper, Llama-3-Base 5K)
        learning_rate=5e-7,
        num_train_epochs=1,
        report_to="none",
    )
    assert training_args.loss_type == "tpo-l"
