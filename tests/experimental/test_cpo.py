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


def test_seed_doc_quick_start_runs(tmp_path, tiny_model_path, monkeypatch):
    # cpo_trainer.md "Quick start" (s/trl/posttrain/; hub model / dataset replaced by the local tiny ones, and the
    # run shortened to one offline step)
    import datasets

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pairs(4))
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.experimental.cpo import CPOConfig, CPOTrainer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    train_dataset = load_dataset("trl-lib/ultrafeedback_binarized", split="train")

    training_args = CPOConfig(
        output_dir="Qwen2-0.5B-CPO", max_steps=1, per_device_train_batch_size=2, report_to="none", save_strategy="no"
    )
    trainer = CPOTrainer(model=model, args=training_args, processing_class=tokenizer, train_dataset=train_dataset)
    trainer.train()
    assert trainer.state.global_step == 1


def test_paper_index_configs_build():
    # paper_index.md: CPO, SimPO and AlphaPO settings (s/trl/posttrain/)
    from posttrain.experimental.cpo import CPOConfig

    cpo = CPOConfig(
        loss_type="sigmoid",  # preference learning loss (Section 3 of the paper)
        cpo_alpha=1.0,  # NLL regularizer weight (Section 3 of the paper)
        beta=0.1,  # β temperature (Section 4.2 of the paper)
        learning_rate=1e-4,  # learning rate (official code)
        lr_scheduler_type="inverse_sqrt",  # scheduler (official code)
        num_train_epochs=1,  # Section 4.2 of the paper
        # warm-up ratio (Section 4.2 of the paper); the docs' `warmup_ratio=0.01` is `warmup_steps=0.01` in
        # transformers 5, which removed `warmup_ratio` (a float < 1 in warmup_steps is a ratio)
        warmup_steps=0.01,
        max_length=512,  # max sequence length (Section 4.2 of the paper)
        report_to="none",
    )
    simpo = CPOConfig(
        loss_type="simpo",  # SimPO loss (Section 3 of the paper)
        cpo_alpha=0.0,  # no BC regularizer for SimPO
        beta=2.5,  # β in Appendix B of the paper
        simpo_gamma=1.375,  # γ target reward margin, from γ/β=0.55 in Appendix B of the paper
        learning_rate=1e-6,  # learning rate in Appendix B of the paper
        num_train_epochs=1,  # Appendix B of the paper
        report_to="none",
    )
    # Mistral-Instruct from Table 3 of the paper
    alphapo = CPOConfig(
        loss_type="alphapo", alpha=0.25, beta=2.5, simpo_gamma=0.1, learning_rate=7e-7, report_to="none"
    )
    assert cpo.max_length == 512 and simpo.simpo_gamma == 1.375
    assert (alphapo.loss_type, alphapo.cpo_alpha, alphapo.alpha) == ("simpo", 0.0, 0.25)


def test_peft_adapters_train(tmp_path, tiny_model_path):
    from peft import LoraConfig, PeftModel

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    trainer = CPOTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=pairs(), peft_config=config)
    assert isinstance(trainer.model, PeftModel)
    before = trainable_params(trainer.model)
    assert before and all("lora" in name for name in before)
    trainer.train()
    assert params_changed(before, trainer.model)


def test_gradient_accumulation_equals_larger_batch(tmp_path, tiny_model_path):
    # the loss is a per-pair mean (+ a token-mean NLL, which differs with the split): check the pure preference loss;
    # SGD, so that a wrongly scaled gradient shows (Adam's first step is scale-free)
    from trainer_helpers import assert_same_params, train_and_snapshot

    results = []
    for i, (bs, ga) in enumerate([(2, 1), (1, 2)]):
        args = _config(
            tmp_path / str(i),
            per_device_train_batch_size=bs,
            gradient_accumulation_steps=ga,
            cpo_alpha=0.0,
            optim="sgd",
            learning_rate=1.0,
            max_grad_norm=0.0,  # no clipping: it would hide a wrongly scaled gradient too
        )
        results.append(train_and_snapshot(CPOTrainer(tiny_model_path, args=args, train_dataset=pairs(2))))
    assert_same_params(results)
