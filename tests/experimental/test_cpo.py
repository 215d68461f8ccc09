"""CPOTrainer (and SimPO / CPO-SimPO / AlphaPO) end to end on the offline tiny model: each loss type trains,
TRL's metrics are logged, the trainer's loss equals the core formula on the model's own log-probs, validation."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from experimental_helpers import naive_logps, pairs
from trainer_helpers import fast_config, params_changed, quiet_single_thread, trainable_params  # noqa: F401

from posttrain.experimental.cpo import CPOConfig, CPOTrainer

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
]


def _config(tmp_path, **kw) -> CPOConfig:
    return fast_config(
        CPOConfig, tmp_path, **{"max_steps": 1, "per_device_train_batch_size": 2, "learning_rate": 1e-3, **kw}
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"loss_type": "sigmoid"},
        {"loss_type": "sigmoid", "label_smoothing": 0.1},
        {"loss_type": "hinge"},
        {"loss_type": "ipo"},
        {"loss_type": "simpo", "cpo_alpha": 0.0, "simpo_gamma": 0.5},
        {"loss_type": "simpo"},  # CPO-SimPO
        {"loss_type": "alphapo", "alpha": 0.25, "simpo_gamma": 0.1},
    ],
)
def test_each_loss_type_trains_and_logs_trl_metrics(tmp_path, tiny_model_path, kwargs):
    trainer = CPOTrainer(tiny_model_path, args=_config(tmp_path, **kwargs), train_dataset=pairs())
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    logged = trainer.state.log_history[0]
    assert all(name in logged for name in METRICS), sorted(set(METRICS) - set(logged))
    assert torch.isfinite(torch.tensor(logged["loss"]))


def test_alphapo_is_simpo_without_nll():
    config = CPOConfig(output_dir="unused", loss_type="alphapo", alpha=0.25, report_to="none")
    assert config.loss_type == "simpo" and config.cpo_alpha == 0.0 and config.alpha == 0.25


@pytest.mark.parametrize("loss_type", ["sigmoid", "simpo"])
def test_loss_equals_formula_on_full_logits(tmp_path, tiny_model_path, loss_type):
    trainer = CPOTrainer(
        tiny_model_path, args=_config(tmp_path, loss_type=loss_type, alpha=0.3, cpo_alpha=0.7), train_dataset=pairs(2)
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    model = trainer.model.eval()
    with torch.no_grad():
        loss = trainer.compute_loss(model, batch)
        sums, lengths, logps, mask = naive_logps(model, batch)
    seq = sums / lengths if loss_type == "simpo" else sums
    r = (1 - torch.exp(seq) ** -0.3) / 0.3  # AlphaPO reward shape
    z = 0.1 * (r[:2] - r[2:])
    if loss_type == "simpo":
        z = z - 0.5  # β(Δ − γ/β)
    nll = -(logps[:2] * mask[:2]).sum() / mask[:2].sum()
    expected = -torch.nn.functional.logsigmoid(z).mean() + 0.7 * nll
    torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)


def test_conversational_and_implicit_prompt_data(tmp_path, tiny_model_path):
    conversational = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": "Colour of the sky?"}]] * 2,
            "chosen": [[{"role": "assistant", "content": "Blue."}]] * 2,
            "rejected": [[{"role": "assistant", "content": "Green."}]] * 2,
        }
    )
    implicit = Dataset.from_dict({"chosen": ["The sky is blue."] * 2, "rejected": ["The sky is green."] * 2})
    for i, data in enumerate([conversational, implicit]):
        trainer = CPOTrainer(tiny_model_path, args=_config(tmp_path / str(i)), train_dataset=data)
        trainer.train()
        assert "rewards/margins" in trainer.state.log_history[0]


def test_up_front_validation(tmp_path, tiny_model_path):
    with pytest.raises(ValueError, match="sigmoid, hinge, ipo, simpo, alphapo"):
        _config(tmp_path, loss_type="sigmod")
    with pytest.raises(ValueError, match="kto_pair"):
        _config(tmp_path, loss_type="kto_pair")
    with pytest.warns(UserWarning, match="label_smoothing"):
        _config(tmp_path, loss_type="hinge", label_smoothing=0.1)
    with pytest.raises(ValueError, match="is_encoder_decoder"):
        _config(tmp_path, is_encoder_decoder=True)
    with pytest.raises(ValueError, match="rejected"):  # missing column: the error lists the accepted types
        CPOTrainer(
            tiny_model_path,
            args=_config(tmp_path),
            train_dataset=Dataset.from_dict({"prompt": ["a"], "chosen": ["b"]}),
        )
    with pytest.raises(ValueError, match="train_dataset"):
        CPOTrainer(tiny_model_path, args=_config(tmp_path))


def test_evaluation_logs_eval_metrics(tmp_path, tiny_model_path):
    trainer = CPOTrainer(
        tiny_model_path,
        args=_config(tmp_path, per_device_eval_batch_size=2),
        train_dataset=pairs(2),
        eval_dataset=pairs(2),
    )
    trainer.evaluate()
    logged = trainer.state.log_history[-1]
    assert "eval_loss" in logged and "eval_rewards/accuracies" in logged and "eval_nll_loss" in logged
