"""ORPOTrainer end to end on the offline tiny model: trains, logs TRL's metrics (log_odds_ratio, log_odds_chosen,
nll_loss, ...), its loss equals NLL − β·log σ(log-odds ratio) on the model's own full-logit log-probs; validation."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from experimental_helpers import naive_logps, pairs
from trainer_helpers import fast_config, params_changed, quiet_single_thread, trainable_params  # noqa: F401

from posttrain.experimental.orpo import ORPOConfig, ORPOTrainer

METRICS = [
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "nll_loss",
    "log_odds_ratio",
    "log_odds_chosen",
]


def _config(tmp_path, **kw) -> ORPOConfig:
    return fast_config(
        ORPOConfig, tmp_path, **{"max_steps": 2, "per_device_train_batch_size": 2, "learning_rate": 1e-3, **kw}
    )


def test_trains_and_logs_trl_metrics(tmp_path, tiny_model_path):
    trainer = ORPOTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=pairs())
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    logged = trainer.state.log_history[0]
    assert all(name in logged for name in METRICS), sorted(set(METRICS) - set(logged))
    # log_odds_ratio is the mean log σ(log odds): always <= 0
    assert logged["log_odds_ratio"] <= 0.0


def test_loss_equals_formula_on_full_logits(tmp_path, tiny_model_path):
    trainer = ORPOTrainer(tiny_model_path, args=_config(tmp_path, beta=0.25), train_dataset=pairs(2))
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    model = trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
        sums, lengths, logps, mask = naive_logps(model, batch)
    mean = (sums / lengths).double()
    lc, lr = mean[:2], mean[2:]
    log_odds = (lc - lr) - (torch.log1p(-torch.exp(lc)) - torch.log1p(-torch.exp(lr)))
    # TRL's NLL term: every attended token of prompt+chosen (its cross-entropy over input_ids), not the completion
    attended = batch["attention_mask"][:2, 1:].float()
    assert attended.sum() > mask[:2].sum()  # the prompt tokens count
    nll = -(logps[:2] * attended).sum() / attended.sum()
    expected = nll.double() - 0.25 * torch.nn.functional.logsigmoid(log_odds).mean()
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
    assert math.isfinite(loss.item())


def test_paper_config_from_the_seed_docs():
    # paper_index.md, "ORPO: Monolithic Preference Optimization without Reference Model" (s/trl/posttrain/)
    from posttrain.experimental.orpo import ORPOConfig

    training_args = ORPOConfig(
        beta=0.1,  # λ odds ratio loss weight (Table 7 of the paper, Mistral-ORPO-β)
        learning_rate=5e-6,  # learning rate (Appendix C of the paper)
        lr_scheduler_type="inverse_sqrt",  # scheduler (Appendix C of the paper)
        num_train_epochs=5,  # Appendix C of the paper
        warmup_steps=200,  # warm-up steps (Appendix C of the paper)
        per_device_train_batch_size=8,  # batch size (Appendix C of the paper)
        report_to="none",
    )
    assert training_args.beta == 0.1 and training_args.max_length == 1024


def test_up_front_validation(tmp_path, tiny_model_path):
    with pytest.raises(ValueError, match="beta"):
        _config(tmp_path, beta=-1.0)
    with pytest.raises(ValueError, match="generate_during_eval"):
        _config(tmp_path, generate_during_eval=True)
    bad = Dataset.from_dict({"prompt": ["a"], "completion": ["b"]})
    with pytest.raises(ValueError, match="ORPOTrainer"):
        ORPOTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=bad)
