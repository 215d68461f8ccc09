"""SFTTrainer / SFTConfig end to end on the offline tiny models: every dataset format, packing, padding-free,
completion-only and assistant-only losses, PEFT, saving; invariances (gradient accumulation ≡ larger batch,
padding-free ≡ padded, packed ≡ unpacked, chunked ≡ naive); TRL's validation errors."""

from __future__ import annotations

import json
import math

import datasets
import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer, chatml_template
from posttrain.trainers.sft import SFTConfig, SFTTrainer, dft, nll

datasets.disable_progress_bars()


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads, and on a shared 2-core machine threads only contend."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


QA = [
    ("What color is the sky?", "Blue."),
    ("What color is grass?", "Green!"),
    ("What color is snow?", "White."),
    ("What color is coal?", "Black..."),
]
TEXTS = [f"{q} {a}" for q, a in QA] * 2
IM_END = 258


def args_for(tmp_path, **overrides) -> SFTConfig:
    values = dict(
        output_dir=str(tmp_path / "out"), report_to="none", save_strategy="no", gradient_checkpointing=False,
        logging_steps=1, max_steps=2, per_device_train_batch_size=4, learning_rate=5e-3, write_report=False,
        disable_tqdm=True, dataloader_pin_memory=False, seed=0,
    )  # fmt: skip
    values.update(overrides)
    return SFTConfig(**values)


def user(q):
    return {"role": "user", "content": q}


def assistant(a):
    return {"role": "assistant", "content": a}


DATASETS = {
    "text": lambda: {"text": TEXTS},
    "messages": lambda: {"messages": [[user(q), assistant(a)] for q, a in QA] * 2},
    "prompt_completion": lambda: {"prompt": [q for q, _ in QA] * 2, "completion": [f" {a}" for _, a in QA] * 2},
    "prompt_completion_conversational": lambda: {
        "prompt": [[user(q)] for q, _ in QA] * 2,
        "completion": [[assistant(a)] for _, a in QA] * 2,
    },
    "sharegpt": lambda: {
        "conversations": [[{"from": "human", "value": q}, {"from": "gpt", "value": a}] for q, a in QA] * 2
    },
    "tokenized": lambda: {
        "input_ids": [list(t.encode()) + [IM_END] for t in TEXTS],
        "completion_mask": [[0] * 5 + [1] * (len(t.encode()) - 4) for t in TEXTS],
    },
    "tools": lambda: {
        "messages": [[user(q), assistant(a)] for q, a in QA] * 2,
        "tools": [json.dumps([{"type": "function", "function": {"name": "lookup", "parameters": {}}}])] * 8,
    },
}


def logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


def snapshot(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ----------------------------------------------------------------------------------------------------------------
# End to end
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(DATASETS))
def test_every_dataset_format_trains(name, tiny_model_path, tmp_path):
    trainer = SFTTrainer(tiny_model_path, args=args_for(tmp_path), train_dataset=Dataset.from_dict(DATASETS[name]()))
    row = trainer.train_dataset[0]
    assert set(row) == {"input_ids", "labels"}
    assert IM_END in row["input_ids"][-2:]  # EOS appended (standard) / end of turn + "\n" (conversational)
    before = snapshot(trainer.model)
    trainer.train()
    after = snapshot(trainer.model)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    for key in ("loss", "entropy", "mean_token_accuracy", "num_tokens"):
        assert all(math.isfinite(v) for v in logged(trainer, key)), key
    assert logged(trainer, "num_tokens")[-1] > logged(trainer, "num_tokens")[0]
    if name == "tools":
        assert "<tools>" in trainer.processing_class.decode(row["input_ids"])


def test_loss_decreases_with_default_gradient_checkpointing(tiny_llama_path, tmp_path):
    args = args_for(tmp_path, gradient_checkpointing=True, max_steps=8)
    assert SFTConfig(output_dir=str(tmp_path)).gradient_checkpointing is True  # TRL's default
    trainer = SFTTrainer(tiny_llama_path, args=args, train_dataset=Dataset.from_dict({"text": TEXTS}))
    trainer.train()
    losses = logged(trainer, "loss")
    assert losses[-1] < losses[0] - 0.5
    accuracy = logged(trainer, "mean_token_accuracy")
    assert accuracy[-1] > accuracy[0]


def test_completion_only_loss_masks_the_prompt(tiny_model_path, tmp_path):
    data = Dataset.from_dict(DATASETS["prompt_completion"]())
    trainer = SFTTrainer(tiny_model_path, args=args_for(tmp_path, max_steps=1), train_dataset=data)
    assert trainer.completion_only_loss is True  # None is inferred from the prompt/completion columns
    row = trainer.train_dataset[0]
    n_prompt = len(QA[0][0].encode())
    assert row["labels"][:n_prompt] == [-100] * n_prompt
    assert row["labels"][n_prompt:] == row["input_ids"][n_prompt:]
    full = SFTTrainer(
        tiny_model_path, args=args_for(tmp_path, completion_only_loss=False, max_steps=1), train_dataset=data
    )
    assert full.train_dataset[0]["labels"] == full.train_dataset[0]["input_ids"]


def test_assistant_only_loss_trains_on_assistant_turns(tiny_model_path, tmp_path):
    conv = [user("Hi"), assistant("Hello!"), user("Color of sky?"), assistant("Blue.")]
    data = Dataset.from_dict({"messages": [conv] * 4})
    trainer = SFTTrainer(tiny_model_path, args=args_for(tmp_path, assistant_only_loss=True), train_dataset=data)
    row = trainer.train_dataset[0]
    trained = [t for t in row["labels"] if t != -100]
    assert trainer.processing_class.decode(trained) == "Hello!<|im_end|>Blue.<|im_end|>"
    before = snapshot(trainer.model)
    trainer.train()
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_assistant_only_loss_swaps_in_the_training_template(tiny_model_path, tmp_path):
    tokenizer = build_tiny_tokenizer()
    tokenizer.chat_template = chatml_template().replace("{%- generation %}", "").replace("{%- endgeneration %}", "")
    data = Dataset.from_dict({"messages": [[user("Hi"), assistant("Hello!")]] * 4})
    trainer = SFTTrainer(
        tiny_model_path, args=args_for(tmp_path, assistant_only_loss=True), train_dataset=data,
        processing_class=tokenizer,
    )  # fmt: skip
    assert "generation" in trainer.processing_class.chat_template
    assert trainer.processing_class.decode([t for t in trainer.train_dataset[0]["labels"] if t != -100]) == (
        "Hello!<|im_end|>"
    )


def test_formatting_func_eos_token_and_chat_template_kwargs(tiny_model_path, tmp_path):
    data = Dataset.from_dict({"question": [q for q, _ in QA], "answer": [a for _, a in QA]})
    args = args_for(tmp_path, eos_token="<|endoftext|>", max_steps=1)
    trainer = SFTTrainer(
        tiny_model_path, args=args, train_dataset=data, formatting_func=lambda ex: f"Q: {ex['question']} A: {ex['answer']}"
    )  # fmt: skip
    ids = trainer.train_dataset[0]["input_ids"]
    assert bytes(ids[:-1]).decode() == f"Q: {QA[0][0]} A: {QA[0][1]}" and ids[-1] == 256
    trainer.train()

    # a .jinja chat_template_path replaces the template; per-row chat_template_kwargs reach it
    template = tmp_path / "custom.jinja"
    template.write_text("{%- if prefix is defined %}{{ prefix }}{% endif %}" + chatml_template())
    rows = {"messages": [[user("Hi"), assistant("Yo")]] * 2, "chat_template_kwargs": [{"prefix": "PFX"}] * 2}
    trainer = SFTTrainer(
        tiny_model_path, args=args_for(tmp_path, chat_template_path=str(template), max_steps=1),
        train_dataset=Dataset.from_dict(rows),
    )  # fmt: skip
    assert trainer.processing_class.decode(trainer.train_dataset[0]["input_ids"]).startswith("PFX<|im_start|>user")


def test_chat_template_path_clones_a_tokenizer_and_peft_trains_new_tokens(tiny_llama_path, tmp_path):
    from peft import LoraConfig

    trainer = SFTTrainer(
        tiny_llama_path, args=args_for(tmp_path, chat_template_path=tiny_llama_path, max_steps=1),
        train_dataset=Dataset.from_dict(DATASETS["messages"]()),
        peft_config=LoraConfig(r=4, target_modules=["q_proj"]),
    )  # fmt: skip
    rows = trainer.model.get_input_embeddings().weight.shape[0]
    assert len(trainer.processing_class) == rows and rows % 64 == 0
    config = trainer.model.peft_config["default"]
    assert config.trainable_token_indices["embed_tokens"]  # the added tokens' embedding rows are trained
    assert "lm_head" in config.modules_to_save  # untied head: trained as a copy
    trainer.train()
    assert math.isfinite(logged(trainer, "loss")[0])


def test_iterable_dataset(tiny_model_path, tmp_path):
    data = Dataset.from_dict({"text": TEXTS}).to_iterable_dataset()
    trainer = SFTTrainer(tiny_model_path, args=args_for(tmp_path, packing=True, max_length=64), train_dataset=data)
    trainer.train()
    assert len(logged(trainer, "loss")) == 2


@pytest.mark.parametrize("strategy", ["bfd", "bfd_split", "wrapped"])
def test_packing_strategies(strategy, tiny_model_path, tmp_path):
    args = args_for(tmp_path, packing=True, packing_strategy=strategy, max_length=64, per_device_train_batch_size=2)
    trainer = SFTTrainer(tiny_model_path, args=args, train_dataset=Dataset.from_dict({"text": TEXTS}))
    ds = trainer.train_dataset
    assert len(ds) < len(TEXTS)
    assert all(len(r["input_ids"]) <= 64 for r in ds)
    assert ("seq_lengths" in ds.column_names) == (strategy != "wrapped")
    assert not trainer.padding_free  # sdpa: packed blocks stay rows with block-diagonal masks (flash: flattened)
    trainer.train()
    assert all(math.isfinite(v) for v in logged(trainer, "loss"))


@pytest.mark.invariance
def test_packed_equals_unpacked_loss(tiny_model_path, tmp_path):
    """With the whole dataset in one batch, BFD packing (padding-free, block-diagonal attention) gives the padded
    batch's loss and gradients: same label tokens, same per-sequence context."""
    data = Dataset.from_dict({"text": TEXTS})
    common = dict(per_device_train_batch_size=8, optim="sgd", learning_rate=0.5)  # SGD: see _run_pair
    padded = SFTTrainer(tiny_model_path, args=args_for(tmp_path, **common), train_dataset=data)
    packed = SFTTrainer(
        tiny_model_path, args=args_for(tmp_path, packing=True, max_length=64, **common), train_dataset=data
    )
    assert len(packed.train_dataset) < 8
    for trainer in (padded, packed):
        trainer.train()
    torch.testing.assert_close(logged(packed, "loss"), logged(padded, "loss"), atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(packed.model.named_parameters(), padded.model.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=name)


# ----------------------------------------------------------------------------------------------------------------
# Invariances
# ----------------------------------------------------------------------------------------------------------------


def _run_pair(tiny_model_path, tmp_path, data, a: dict, b: dict, steps=2):
    """Train twice and compare loss trajectories and weights. Plain SGD: Adam's g/√v would turn float32 rounding in
    near-zero gradients into lr-sized weight differences."""
    runs = []
    for i, overrides in enumerate((a, b)):
        args = args_for(tmp_path / str(i), max_steps=steps, optim="sgd", learning_rate=0.5, **overrides)
        trainer = SFTTrainer(tiny_model_path, args=args, train_dataset=data)
        trainer.train()
        runs.append(trainer)
    torch.testing.assert_close(logged(runs[0], "loss"), logged(runs[1], "loss"), atol=1e-5, rtol=1e-5)
    for (name, p), q in zip(runs[0].model.named_parameters(), runs[1].model.parameters()):
        torch.testing.assert_close(p, q, atol=2e-5, rtol=1e-4, msg=name)
    return runs


@pytest.mark.invariance
def test_gradient_accumulation_equals_large_batch(tiny_model_path, tmp_path):
    """1 × GA 4 ≡ 4 × 1: rows of different lengths and completion masks, loss normalised by num_items_in_batch."""
    data = Dataset.from_dict(DATASETS["prompt_completion"]())
    _run_pair(
        tiny_model_path, tmp_path, data,
        {"per_device_train_batch_size": 1, "gradient_accumulation_steps": 4},
        {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1},
    )  # fmt: skip


@pytest.mark.invariance
def test_padding_free_equals_padded(tiny_model_path, tmp_path):
    data = Dataset.from_dict(DATASETS["messages"]())
    _run_pair(tiny_model_path, tmp_path, data, {"padding_free": True, "max_length": None}, {})


@pytest.mark.invariance
def test_chunked_nll_equals_nll_and_dft_differs(tiny_model_path, tmp_path):
    data = Dataset.from_dict({"text": TEXTS})
    chunked, naive = _run_pair(tiny_model_path, tmp_path, data, {}, {"loss_type": "nll"})
    assert chunked.loss_type == "chunked_nll" and naive.loss_type == "nll"
    assert chunked.args.loss_type == "chunked_nll"  # None resolves to TRL's default
    dft_run = SFTTrainer(tiny_model_path, args=args_for(tmp_path / "d", loss_type="dft"), train_dataset=data)
    dft_run.train()
    assert logged(dft_run, "loss")[0] < logged(naive, "loss")[0]  # p_t < 1 shrinks every token's loss


def test_loss_functions_by_hand():
    logps = torch.tensor([[math.log(0.5), math.log(0.25)]], requires_grad=True)
    torch.testing.assert_close(nll(logps), torch.tensor([[0.6931472, 1.3862944]]))
    # dft: −p·log p = 0.5·0.693 = 0.3466, 0.25·1.386 = 0.3466; gradient −p (p detached)
    out = dft(logps)
    torch.testing.assert_close(out, torch.tensor([[0.3465736, 0.3465736]]))
    out.sum().backward()
    torch.testing.assert_close(logps.grad, torch.tensor([[-0.5, -0.25]]))


@pytest.mark.invariance
def test_activation_offloading_gives_the_same_loss(tiny_model_path, tmp_path):
    data = Dataset.from_dict({"text": TEXTS})
    _run_pair(tiny_model_path, tmp_path, data, {"activation_offloading": True}, {}, steps=1)


# ----------------------------------------------------------------------------------------------------------------
# Models: PEFT, MoE, saving, eval
# ----------------------------------------------------------------------------------------------------------------


def test_peft_lora_trains_adapter_and_saves_it_alone(tiny_model_path, tmp_path):
    from peft import LoraConfig, PeftModel

    trainer = SFTTrainer(
        tiny_model_path, args=args_for(tmp_path, gradient_checkpointing=True),
        train_dataset=Dataset.from_dict({"text": TEXTS}),
        peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    )  # fmt: skip
    before = snapshot(trainer.model)
    trainer.train()
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(before[n], p)}
    assert changed and all("lora_" in n for n in changed)
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    files = {p.name for p in out.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= files
    assert "model.safetensors" not in files
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), str(out)).eval()
    ids = torch.tensor([list(b"The sky is")])
    trainer.model.eval()
    torch.testing.assert_close(reloaded(ids).logits, trainer.model(ids).logits, atol=1e-5, rtol=1e-5)


def test_full_model_save_reloads(tiny_model_path, tmp_path):
    trainer = SFTTrainer(tiny_model_path, args=args_for(tmp_path), train_dataset=Dataset.from_dict({"text": TEXTS}))
    trainer.train()
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    assert not any(p.name.startswith(".tmp") for p in out.iterdir())  # atomic save leaves no temp folder
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    ids = tokenizer("The sky is", return_tensors="pt").input_ids
    trainer.model.eval()
    torch.testing.assert_close(model(ids).logits, trainer.model(ids).logits, atol=1e-5, rtol=1e-5)


def test_moe_aux_loss_is_added_and_logged(tmp_path):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    tok = build_tiny_tokenizer()
    config = Qwen2MoeConfig(
        vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
        shared_expert_intermediate_size=16, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    model = Qwen2MoeForCausalLM(config)
    assert model.config.output_router_logits is False
    trainer = SFTTrainer(
        model, args=args_for(tmp_path, max_steps=1), train_dataset=Dataset.from_dict({"text": TEXTS}),
        processing_class=tok,
    )  # fmt: skip
    assert model.config.output_router_logits is True and model.config.router_aux_loss_coef == 0.001
    trainer.train()
    assert logged(trainer, "aux_loss")[0] > 0


def test_evaluate_with_eval_packing(tiny_model_path, tmp_path):
    data = Dataset.from_dict({"text": TEXTS})
    args = args_for(tmp_path, packing=True, max_length=64, eval_packing=False)
    trainer = SFTTrainer(tiny_model_path, args=args, train_dataset=data, eval_dataset={"a": data, "b": data})
    assert "seq_lengths" in trainer.train_dataset.column_names
    assert "seq_lengths" not in trainer.eval_dataset["a"].column_names and len(trainer.eval_dataset["a"]) == 8
    metrics = trainer.evaluate(trainer.eval_dataset["a"])
    assert math.isfinite(metrics["eval_loss"])
    for key in ("eval_entropy", "eval_mean_token_accuracy"):  # logged with TRL's eval_ prefix
        assert math.isfinite(logged(trainer, key)[-1]), key
    # the packed training batches and the padded eval batches score the same tokens
    trainer.args.eval_packing = True
    assert metrics["eval_loss"] == pytest.approx(trainer.evaluate(trainer.train_dataset)["eval_loss"], abs=1e-5)


def test_compute_loss_func_and_compute_metrics_get_full_logits(tiny_model_path, tmp_path):
    calls = []

    def loss_func(outputs, labels, num_items_in_batch=None):
        calls.append((outputs.logits.shape, labels.shape, num_items_in_batch))
        return outputs.logits.float().pow(2).mean()

    def compute_metrics(pred):
        return {"logit_rank": float(pred.predictions.ndim)}

    data = Dataset.from_dict({"text": TEXTS})
    trainer = SFTTrainer(
        tiny_model_path, args=args_for(tmp_path, max_steps=1, per_device_eval_batch_size=8), train_dataset=data,
        eval_dataset=data, compute_loss_func=loss_func, compute_metrics=compute_metrics,
    )  # fmt: skip
    trainer.train()
    logits_shape, labels_shape, n_items = calls[0]
    assert logits_shape[:2] == labels_shape and logits_shape[-1] == 320 and n_items > 0
    assert math.isfinite(logged(trainer, "mean_token_accuracy")[0])
    assert trainer.evaluate()["eval_logit_rank"] == 3.0  # (B, T, V) logits reach compute_metrics


def test_model_object_and_args_conversion(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, tok = build_tiny_model("qwen2"), build_tiny_tokenizer()
    plain = TrainingArguments(output_dir=str(tmp_path / "plain"), report_to="none", learning_rate=1e-4)
    trainer = SFTTrainer(model, args=plain, train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=tok)
    assert isinstance(trainer.args, SFTConfig) and trainer.args.learning_rate == 1e-4
    assert trainer.args.output_dir == str(tmp_path / "plain")
    default = SFTTrainer(model, train_dataset=Dataset.from_dict({"text": TEXTS}), processing_class=tok)
    assert default.args.output_dir.endswith("SFT") and default.args.learning_rate == 2e-5


# ----------------------------------------------------------------------------------------------------------------
# Validation (TRL's errors)
# ----------------------------------------------------------------------------------------------------------------


def test_config_validation(tmp_path):
    out = str(tmp_path)
    with pytest.raises(ValueError, match="packing_strategy"):
        SFTConfig(output_dir=out, packing_strategy="first_fit")
    with pytest.warns(FutureWarning, match="bfd_split"):
        assert SFTConfig(output_dir=out, packing_strategy="bfd-requeue").packing_strategy == "bfd_split"
    with pytest.warns(FutureWarning, match="keep_end"):
        SFTConfig(output_dir=out, truncation_mode="keep_end")
    with pytest.raises(ValueError, match="max_length"):
        SFTConfig(output_dir=out, packing=True, max_length=None)
    with pytest.raises(ValueError, match="chunked_nll"):
        SFTConfig(output_dir=out, loss_type="cross_entropy")
    assert SFTConfig(output_dir=out, dataset_kwargs='{"skip_prepare_dataset": true}').dataset_kwargs == {
        "skip_prepare_dataset": True
    }


def test_packing_flattens_batches_only_for_flash_attention(tmp_path):
    model = build_tiny_model("qwen2")
    packed = SFTConfig(output_dir=str(tmp_path), packing=True)
    assert not SFTTrainer._resolve_padding_free(model, packed)  # sdpa: one packed block per row
    model.config._attn_implementation = "flash_attention_2"
    assert SFTTrainer._resolve_padding_free(model, packed)  # varlen kernels: one flattened row (TRL's behaviour)
    wrapped = SFTConfig(output_dir=str(tmp_path), packing=True, packing_strategy="wrapped")
    assert not SFTTrainer._resolve_padding_free(model, wrapped)


def test_trainer_validation_errors(tiny_model_path, tmp_path):
    text = Dataset.from_dict({"text": TEXTS})
    with pytest.raises(ValueError, match="`max_length` is not enforced"):
        SFTTrainer(tiny_model_path, args=args_for(tmp_path, padding_free=True), train_dataset=text)
    with pytest.raises(ValueError, match="formatting_func"):
        SFTTrainer(
            tiny_model_path, args=args_for(tmp_path, completion_only_loss=True), train_dataset=text,
            formatting_func=lambda ex: ex["text"],
        )  # fmt: skip
    with pytest.raises(ValueError, match="eos_token"):
        SFTTrainer(tiny_model_path, args=args_for(tmp_path, eos_token="<|nope|>"), train_dataset=text)
    with pytest.raises(ValueError, match="conversational"):
        SFTTrainer(tiny_model_path, args=args_for(tmp_path, assistant_only_loss=True), train_dataset=text)
    with pytest.raises(ValueError, match="columns"):
        SFTTrainer(tiny_model_path, args=args_for(tmp_path), train_dataset=Dataset.from_dict({"body": TEXTS}))
    with pytest.raises(ValueError, match="with_transform"):
        SFTTrainer(tiny_model_path, args=args_for(tmp_path), train_dataset=text.with_transform(lambda b: b))
    masked = Dataset.from_dict({"input_ids": [[1, 2, 3]], "completion_mask": [[0, 1, 1]]})
    with pytest.raises(ValueError, match="labels"):
        SFTTrainer(
            tiny_model_path, args=args_for(tmp_path, dataset_kwargs={"skip_prepare_dataset": True}),
            train_dataset=masked,
        )  # fmt: skip
    with pytest.raises(ValueError, match="No row"):
        SFTTrainer(
            tiny_model_path, args=args_for(tmp_path, max_length=3), train_dataset=Dataset.from_dict(
                DATASETS["prompt_completion"]()
            ),
        )  # fmt: skip
    with pytest.raises(ImportError, match="bitsandbytes"):
        SFTTrainer(
            tiny_model_path, args=args_for(tmp_path, model_init_kwargs={"quantization_config": {"load_in_4bit": True}}),
            train_dataset=text,
        )  # fmt: skip


@pytest.mark.parametrize("packing_strategy", ["bfd", "wrapped", None])
def test_num_tokens_counts_real_tokens_as_trl(tiny_model_path, tmp_path, packing_strategy):
    """TRL's num_tokens: every real token seen (its padding-free bfd rows have no padding); posttrain's packed rows
    are padded apart, and that padding must not count (issue 18, item 6)."""
    rows = Dataset.from_list([{"text": f"Row {i} text" * (1 + i % 3)} for i in range(18)])
    packing = {"packing": True, "packing_strategy": packing_strategy} if packing_strategy else {}
    args = args_for(tmp_path, max_steps=-1, num_train_epochs=1, max_length=32, **packing)
    trainer = SFTTrainer(tiny_model_path, args=args, train_dataset=rows)
    trainer.train()
    expected = sum(len(ids) for ids in trainer.train_dataset["input_ids"])
    assert trainer.state.log_history[-2]["num_tokens"] == expected


@pytest.mark.parametrize(
    ("packing_strategy", "seen"), [("bfd", "non_padding"), ("wrapped", "non_padding"), (None, "non_padding"),
                                   ("bfd", "all")]
)  # fmt: skip
def test_num_input_tokens_seen_counts_tokens(tiny_model_path, tmp_path, packing_strategy, seen):
    """``include_num_input_tokens_seen="non_padding"`` counts the real tokens seen. Packed batches carry a 4-D
    block-diagonal attention mask; transformers' ``attention_mask.sum()`` of it counted attended (query, key) pairs,
    ~L/2 times the tokens (issue 35, item 8a). ``"all"`` of a BFD-packed batch: the tokens of TRL's flat
    padding-free row, not posttrain's padding between its separate packed rows. Expected: the packed rows' lengths,
    summed by hand."""
    rows = Dataset.from_list([{"text": f"Row {i} text" * (1 + i % 3)} for i in range(18)])
    packing = {"packing": True, "packing_strategy": packing_strategy} if packing_strategy else {}
    args = args_for(
        tmp_path, max_steps=-1, num_train_epochs=1, max_length=32, include_num_input_tokens_seen=seen, **packing
    )  # fmt: skip
    trainer = SFTTrainer(tiny_model_path, args=args, train_dataset=rows)
    trainer.train()
    expected = sum(len(ids) for ids in trainer.train_dataset["input_ids"])
    assert trainer.state.num_input_tokens_seen == expected
    assert trainer.state.log_history[-2]["num_input_tokens_seen"] == expected
