"""DPOTrainer end to end on the offline tiny models: every loss type, data formats, reference modes (copy, PEFT,
precomputed, TR-DPO sync), metrics, invariances (GA, precomputed ≡ live) and a learning test."""

from __future__ import annotations

import os
import random
import warnings

import pytest
import torch
from datasets import Dataset

# quiet_single_thread: an autouse fixture, active in this module once imported
from trainer_helpers import fast_config, params_changed, quiet_single_thread, trainable_params  # noqa: F401
from transformers import TrainingArguments

from posttrain.core.preference import DPO_LOSSES
from posttrain.models.preference_scoring import score_preference_completions
from posttrain.trainers.dpo import DPOConfig, DPOTrainer

METRICS = [
    "rewards/chosen",
    "rewards/rejected",
    "rewards/accuracies",
    "rewards/margins",
    "logps/chosen",
    "logps/rejected",
    "logits/chosen",
    "logits/rejected",
    "entropy",
    "num_tokens",
    "mean_token_accuracy",
]


def _pairs(n: int = 8) -> Dataset:
    prompts, chosen, rejected = (
        ["The sky is", "Grass is", "Snow is", "Coal is"],
        [" blue.", " green.", " white.", " black."],
        [" red.", " pink.", " hot.", " soft and round."],
    )
    idx = [i % 4 for i in range(n)]
    return Dataset.from_dict(
        {
            "prompt": [prompts[i] for i in idx],
            "chosen": [chosen[i] for i in idx],
            "rejected": [rejected[i] for i in idx],
        }
    )


def _config(tmp_path, **kw) -> DPOConfig:
    return fast_config(
        DPOConfig, tmp_path, **{"max_steps": 1, "per_device_train_batch_size": 2, "learning_rate": 1e-3, **kw}
    )


# ---------------------------------------------------------------------------------------------------------------
# Loss types
# ---------------------------------------------------------------------------------------------------------------

LOSS_KWARGS = {"exo_pair": {"label_smoothing": 1e-3}, "robust": {"label_smoothing": 0.1}}


@pytest.mark.parametrize("loss_type", DPO_LOSSES.names())
def test_every_loss_type_trains(tmp_path, tiny_model_path, loss_type):
    trainer = DPOTrainer(
        tiny_model_path,
        args=_config(tmp_path, loss_type=loss_type, **LOSS_KWARGS.get(loss_type, {})),
        train_dataset=_pairs(4),
    )
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    logged = trainer.state.log_history[0]
    assert all(name in logged for name in METRICS), sorted(set(METRICS) - set(logged))
    assert torch.isfinite(torch.tensor(logged["loss"]))


def test_all_trl_loss_types_are_registered():
    expected = {
        "sigmoid",
        "hinge",
        "ipo",
        "exo_pair",
        "nca_pair",
        "robust",
        "bco_pair",
        "sppo_hard",
        "aot",
        "aot_unpaired",
        "apo_zero",
        "apo_down",
        "discopop",
        "sft",
        "sigmoid_norm",
    }
    assert expected <= set(DPO_LOSSES.names())


def test_first_step_sigmoid_loss_is_log2(tmp_path, tiny_model_path):
    """Policy = reference at step 0 → every log-ratio is 0 → −log σ(0) = log 2 and all rewards are 0."""
    trainer = DPOTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=_pairs(4))
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["loss"] == pytest.approx(0.693147, abs=1e-5)
    assert logged["rewards/chosen"] == 0 and logged["rewards/accuracies"] == 0 and logged["rewards/margins"] == 0


@pytest.mark.parametrize(
    "extra",
    [
        {"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]},
        {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3},
        {"f_divergence_type": "js_divergence"},
        {"ld_alpha": 0.5},
        {"use_weighting": True},
        {"label_smoothing": 0.1, "beta": 0.5},
        {"activation_offloading": True},
    ],
    ids=["mpo", "alpha_div", "js_div", "ld_dpo", "wpo", "cdpo", "offload"],
)
def test_loss_options_train(tmp_path, tiny_model_path, extra):
    trainer = DPOTrainer(tiny_model_path, args=_config(tmp_path, max_steps=2, **extra), train_dataset=_pairs(4))
    before = trainable_params(trainer.model)
    trainer.train()
    assert params_changed(before, trainer.model)
    assert all(torch.isfinite(torch.tensor(h["loss"])) for h in trainer.state.log_history if "loss" in h)


def test_config_validation(tmp_path):
    with pytest.raises(ValueError, match="loss_weights"):
        DPOConfig(output_dir=str(tmp_path), loss_type=["sigmoid", "sft"], loss_weights=[1.0])
    with pytest.raises(ValueError, match="exo_pair"):
        DPOConfig(output_dir=str(tmp_path), loss_type="exo_pair")
    with pytest.raises(ValueError, match="Unknown DPO loss_type 'sigmod'"):
        DPOConfig(output_dir=str(tmp_path), loss_type="sigmod")
    with pytest.raises(ValueError, match="use_weighting"):
        DPOConfig(output_dir=str(tmp_path), loss_type="aot", use_weighting=True)
    with pytest.raises(ValueError, match="f_divergence_type"):
        DPOConfig(output_dir=str(tmp_path), f_divergence_type="kl")
    with pytest.raises(ValueError, match="precompute_ref_log_probs"):
        DPOConfig(output_dir=str(tmp_path), sync_ref_model=True, precompute_ref_log_probs=True)
    with pytest.warns(UserWarning, match="padding_free"):
        assert DPOConfig(output_dir=str(tmp_path), padding_free=True).padding_free is False
    with pytest.warns(FutureWarning, match="keep_end"):
        DPOConfig(output_dir=str(tmp_path), truncation_mode="keep_end")
    config = DPOConfig(output_dir=str(tmp_path), loss_type="ipo")
    assert config.loss_type == ["ipo"]
    assert (config.learning_rate, config.beta, config.max_length, config.logging_steps) == (1e-6, 0.1, 1024, 10)
    assert config.gradient_checkpointing is True


def test_default_output_dir_and_training_arguments(tmp_path, tiny_model_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = DPOTrainer(tiny_model_path, train_dataset=_pairs(2))
    assert trainer.args.output_dir == f"{os.path.basename(tiny_model_path)}-DPO"
    assert isinstance(trainer.args, DPOConfig) and trainer.args.learning_rate == 1e-6
    plain = TrainingArguments(output_dir=str(tmp_path / "plain"), per_device_train_batch_size=3, report_to="none")
    converted = DPOTrainer(tiny_model_path, args=plain, train_dataset=_pairs(2)).args
    assert isinstance(converted, DPOConfig) and converted.per_device_train_batch_size == 3
    assert converted.beta == 0.1


def test_resolve_args_converts_a_copy_and_names_the_config_on_bad_input(tmp_path):
    """BaseTrainer.resolve_args (shared by every trainer): values and the hub token carried over, the caller's
    accelerator_config left alone when the trainer adjusts its own (IterableDataset), TRL's default output_dir."""
    plain = TrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=3, report_to="none", hub_token="secret"
    )
    converted = DPOTrainer.resolve_args(plain, "org/tiny-model", DPOConfig, "DPO")
    assert isinstance(converted, DPOConfig)
    assert (converted.per_device_train_batch_size, converted.hub_token, converted.beta) == (3, "secret", 0.1)
    converted.accelerator_config.dispatch_batches = False
    assert plain.accelerator_config.dispatch_batches is not False
    assert DPOTrainer.resolve_args(converted, "org/tiny-model", DPOConfig, "DPO") is converted
    assert DPOTrainer.resolve_args(None, "org/tiny-model", DPOConfig, "DPO").output_dir == "tiny-model-DPO"
    with pytest.raises(TypeError, match="DPOConfig"):
        DPOTrainer.resolve_args({"output_dir": str(tmp_path)}, "org/tiny-model", DPOConfig, "DPO")


def test_moe_aux_loss_is_added_and_logged(tmp_path, tiny_tokenizer):
    """A MoE policy: router logits are switched on and loss = log 2 + router_aux_loss_coef · aux_loss at step 1."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, pad_token_id=259, eos_token_id=258, bos_token_id=None,
    )  # fmt: skip
    model = Qwen2MoeForCausalLM(config)
    trainer = DPOTrainer(model, args=_config(tmp_path), train_dataset=_pairs(2), processing_class=tiny_tokenizer)
    assert model.config.output_router_logits is True
    trainer.train()
    logged = trainer.state.log_history[0]
    assert logged["aux_loss"] > 0
    assert logged["loss"] == pytest.approx(0.693147 + config.router_aux_loss_coef * logged["aux_loss"], abs=1e-5)


def test_iterable_train_dataset(tmp_path, tiny_model_path):
    with pytest.warns(UserWarning, match="dispatch_batches=False"):
        trainer = DPOTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=_pairs(4).to_iterable_dataset())
    trainer.train()
    assert trainer.state.global_step == 1


# ---------------------------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------------------------


def _conversational(n: int = 4, implicit: bool = False) -> Dataset:
    rows = []
    for i in range(n):
        user = [{"role": "user", "content": f"Colour of thing {i}?"}]
        chosen = [{"role": "assistant", "content": "Blue."}]
        rejected = [{"role": "assistant", "content": "Red, I think."}]
        if implicit:
            rows.append({"chosen": user + chosen, "rejected": user + rejected})
        else:
            rows.append({"prompt": user, "chosen": chosen, "rejected": rejected})
    return Dataset.from_list(rows)


@pytest.mark.parametrize("kind", ["implicit_standard", "explicit_conversational", "implicit_conversational"])
def test_dataset_formats(tmp_path, tiny_model_path, tiny_tokenizer, kind):
    if kind == "implicit_standard":
        data = Dataset.from_dict({"chosen": ["The sky is blue."] * 4, "rejected": ["The sky is green."] * 4})
    else:
        data = _conversational(4, implicit=kind == "implicit_conversational")
    trainer = DPOTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=data)
    row = trainer.train_dataset[0]
    im_start = tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")
    if kind == "implicit_standard":
        assert tiny_tokenizer.decode(row["prompt_ids"]) == "The sky is"
        assert row["chosen_ids"][-1] == tiny_tokenizer.eos_token_id  # EOS appended to standard completions
    else:
        assert row["prompt_ids"][0] == im_start
        assert tiny_tokenizer.decode(row["prompt_ids"]).endswith("<|im_start|>assistant\n")
        assert tiny_tokenizer.decode(row["chosen_ids"]).startswith("Blue.<|im_end|>")
    trainer.train()
    assert "rewards/accuracies" in trainer.state.log_history[0]


def test_standard_data_gets_eos_and_pretokenized_data_is_accepted(tmp_path, tiny_model_path, tiny_tokenizer):
    trainer = DPOTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=_pairs(2))
    eos = tiny_tokenizer.eos_token_id
    assert all(r["chosen_ids"][-1] == eos and r["rejected_ids"][-1] == eos for r in trainer.train_dataset)
    tokenized = Dataset.from_dict(
        {"prompt_ids": [[65, 66]] * 2, "chosen_ids": [[67, eos]] * 2, "rejected_ids": [[68, 69, eos]] * 2}
    )
    trainer = DPOTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=tokenized)
    trainer.train()


def test_bad_dataset_names_columns(tmp_path, tiny_model_path):
    from posttrain.data.formats import DataFormatError

    with pytest.raises(DataFormatError, match="prompt, chosen, rejected"):
        DPOTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=Dataset.from_dict({"text": ["hi"]}))


def test_max_length_drops_long_prompts_and_truncates(tmp_path, tiny_model_path):
    data = Dataset.from_dict(
        {"prompt": ["x" * 30, "ab"], "chosen": [" yes", " a long long completion"], "rejected": [" no", " b"]}
    )
    trainer = DPOTrainer(tiny_model_path, args=_config(tmp_path, max_length=10), train_dataset=data)
    assert len(trainer.train_dataset) == 1  # the 30-token prompt alone reaches max_length
    batch = trainer.data_collator([trainer.train_dataset[0]])
    assert batch["input_ids"].shape[1] == 10
    assert batch["completion_mask"][:, :2].sum() == 0 and batch["completion_mask"][0].sum() == 8


# ---------------------------------------------------------------------------------------------------------------
# Scoring path
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.invariance
def test_score_completions_matches_full_logits(tiny_llama_path):
    """Chunked log-probs, entropy, top-1 hits, mean logits and WPO normalisers equal the naive full-logits values."""
    from posttrain.models.loading import create_model_from_path

    model = create_model_from_path(tiny_llama_path)
    ids = torch.tensor([[72, 105, 32, 116, 104, 101, 114, 101, 258], [65, 66, 67, 68, 258, 259, 259, 259, 259]])
    attention = (ids != 259).long()
    completion = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0, 0, 0, 0]])
    scores = score_preference_completions(
        model,
        ids,
        attention,
        completion,
        compute_entropy=True,
        compute_accuracy=True,
        compute_mean_logits=True,
        compute_wpo=True,
        chunk_size=3,
    )
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
    logp_all = logits.log_softmax(-1)
    target = ids[:, 1:]
    mask = (completion[:, 1:] * attention[:, 1:]).bool()
    torch.testing.assert_close(scores.mask[:, 1:], mask)
    expected = logp_all.gather(-1, target.unsqueeze(-1)).squeeze(-1) * mask
    torch.testing.assert_close(scores.logps[:, 1:], expected, atol=1e-5, rtol=1e-5)
    entropy = -(logp_all.exp() * logp_all).sum(-1) * mask
    torch.testing.assert_close(scores.entropy[:, 1:], entropy, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(scores.mean_logits[:, 1:], logits.mean(-1) * mask, atol=1e-5, rtol=1e-5)
    norm = (torch.logsumexp(2 * logits, -1) - 2 * torch.logsumexp(logits, -1)) * mask
    torch.testing.assert_close(scores.wpo_log_normalizer[:, 1:], norm, atol=1e-5, rtol=1e-5)
    hits = (logits.argmax(-1) == target) & mask
    torch.testing.assert_close(scores.correct[:, 1:], hits)
    assert scores.logps[:, 0].eq(0).all()
    rows = score_preference_completions(
        model, ids, attention, completion, accuracy_rows=torch.tensor([True, False]), chunk_size=2
    )
    torch.testing.assert_close(rows.correct[0, 1:], hits[0])
    assert not rows.correct[1].any() and rows.mean_logits is None and rows.entropy is None


# ---------------------------------------------------------------------------------------------------------------
# Reference modes and invariances
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.invariance
def test_gradient_accumulation_matches_larger_batch(tmp_path, tiny_model_path):
    """Batch 1 × GA 4 ≡ batch 4 × GA 1: the same parameters after one SGD step (pairs of different lengths)."""
    data = _pairs(4)
    results = []
    for batch, accumulation in [(4, 1), (1, 4)]:
        args = _config(
            tmp_path / f"b{batch}",
            per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulation,
            optim="sgd",
            learning_rate=0.5,
            max_grad_norm=0.0,
            train_sampling_strategy="sequential",
        )
        trainer = DPOTrainer(tiny_model_path, args=args, train_dataset=data)
        trainer.train()
        results.append((trainer.state.log_history[0]["loss"], trainable_params(trainer.model)))
    (loss_a, params_a), (loss_b, params_b) = results
    assert loss_a == pytest.approx(loss_b, abs=1e-6)
    for name in params_a:
        torch.testing.assert_close(params_a[name], params_b[name], atol=1e-6, rtol=1e-5)


@pytest.mark.invariance
def test_precomputed_reference_equals_live_reference(tmp_path, tiny_model_path):
    """Two steps: step 1 has policy = reference either way; step 2 checks the stored values against the live copy."""
    live = DPOTrainer(tiny_model_path, args=_config(tmp_path / "live", max_steps=2), train_dataset=_pairs(4))
    live.train()
    pre = DPOTrainer(
        tiny_model_path,
        args=_config(tmp_path / "pre", max_steps=2, precompute_ref_log_probs=True, precompute_ref_batch_size=3),
        train_dataset=_pairs(4),
    )
    assert pre.reference.kind == "precomputed" and pre.reference.model is None
    assert {"ref_chosen_logps", "ref_rejected_logps"} <= set(pre.train_dataset.column_names)
    pre.train()
    for step in (0, 1):
        for key in ("loss", "rewards/chosen", "rewards/margins", "logps/chosen"):
            assert pre.state.log_history[step][key] == pytest.approx(live.state.log_history[step][key], abs=1e-5)


def test_explicit_ref_model_path(tmp_path, tiny_model_path, tiny_llama_path):
    trainer = DPOTrainer(tiny_model_path, ref_model=tiny_llama_path, args=_config(tmp_path), train_dataset=_pairs(2))
    assert trainer.reference.kind == "model" and type(trainer.reference.model).__name__ == "LlamaForCausalLM"
    trainer.train()
    assert trainer.state.log_history[0]["rewards/chosen"] != 0  # a different reference → nonzero log-ratios


def test_peft_reference_has_no_copy_and_saves_adapter(tmp_path, tiny_model_path):
    from peft import LoraConfig, PeftModel

    from posttrain.models.loading import create_model_from_path

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    args = _config(tmp_path, max_steps=2, gradient_checkpointing=True)  # the default, tested once with PEFT
    trainer = DPOTrainer(tiny_model_path, args=args, train_dataset=_pairs(4), peft_config=config)
    assert trainer.reference.kind == "adapters_disabled" and trainer.reference.model is None
    before = trainable_params(trainer.model)
    assert all("lora_" in name for name in before)
    trainer.train()
    assert params_changed(before, trainer.model)
    assert trainer.state.log_history[0]["loss"] == pytest.approx(0.693147, abs=1e-5)  # LoRA B = 0 at start
    trainer.save_model()
    assert os.path.exists(tmp_path / "adapter_config.json")
    assert not any(name.startswith(".tmp-save-") for name in os.listdir(tmp_path))
    reloaded = PeftModel.from_pretrained(create_model_from_path(tiny_model_path), str(tmp_path))
    trained = dict(trainer.model.named_parameters())
    adapters = {name: p for name, p in reloaded.named_parameters() if "lora_" in name}
    assert adapters.keys() == before.keys()  # the trained adapter weights came back, and only they
    assert all(torch.equal(p, trained[name].detach().cpu()) for name, p in adapters.items())


def test_sync_ref_model_mixes_policy_into_reference(tmp_path, tiny_model_path):
    args = _config(tmp_path, sync_ref_model=True, ref_model_sync_steps=1, ref_model_mixup_alpha=0.5)
    trainer = DPOTrainer(tiny_model_path, args=args, train_dataset=_pairs(2))
    ref_before = {n: p.detach().clone() for n, p in trainer.reference.model.named_parameters()}
    policy_before = trainable_params(trainer.model)
    trainer.train()
    policy_after = dict(trainer.model.named_parameters())
    for name, ref_param in trainer.reference.model.named_parameters():
        expected = 0.5 * policy_after[name].detach() + 0.5 * ref_before[name]
        torch.testing.assert_close(ref_param, expected)
    assert params_changed(policy_before, trainer.model)


def test_precompute_with_iterable_dataset_is_rejected(tmp_path, tiny_model_path):
    iterable = _pairs(2).to_iterable_dataset()
    with pytest.raises(ValueError, match="IterableDataset"):
        DPOTrainer(tiny_model_path, args=_config(tmp_path, precompute_ref_log_probs=True), train_dataset=iterable)


# ---------------------------------------------------------------------------------------------------------------
# Evaluation, saving, learning
# ---------------------------------------------------------------------------------------------------------------


def test_evaluate_and_save(tmp_path, tiny_model_path):
    from posttrain.models.loading import create_model_from_path

    trainer = DPOTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=_pairs(4), eval_dataset=_pairs(4))
    trainer.train()
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics
    logged = trainer.state.log_history[-1]
    assert "eval_rewards/accuracies" in logged and "eval_logps/chosen" in logged
    prediction = trainer.predict(trainer.eval_dataset)
    assert prediction.predictions.shape == (4, 2) and (prediction.label_ids == 0).all()
    trainer.save_model()
    reloaded = create_model_from_path(str(tmp_path))
    for name, param in reloaded.named_parameters():
        torch.testing.assert_close(param, dict(trainer.model.named_parameters())[name].detach())


def test_learns_a_synthetic_preference(tmp_path, tiny_model_path):
    """chosen = the prompt's last letter, rejected = another letter: the implicit-reward accuracy climbs above 0.9."""
    rng = random.Random(0)
    letters = "abcdefgh"
    rows = []
    for _ in range(48):
        prompt = "".join(rng.choice(letters) for _ in range(4))
        rows.append({"prompt": prompt, "chosen": prompt[-1], "rejected": rng.choice(letters.replace(prompt[-1], ""))})
    args = _config(
        tmp_path,
        max_steps=40,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        beta=0.5,
        lr_scheduler_type="constant",
    )
    trainer = DPOTrainer(tiny_model_path, args=args, train_dataset=Dataset.from_list(rows))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    accuracies = [h["rewards/accuracies"] for h in trainer.state.log_history if "rewards/accuracies" in h]
    assert accuracies[0] == 0.0  # step 1: policy = reference
    assert sum(accuracies[-5:]) / 5 > 0.9
