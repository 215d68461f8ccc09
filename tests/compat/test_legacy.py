"""posttrain.legacy: names, spellings and recipe keys of older TRL / transformers releases, mapped to today's
behaviour with one FutureWarning per name (issue 35, "the recipes TRL itself broke"), and the old helpers
``setup_chat_format`` / ``DataCollatorForCompletionOnlyLM`` / ``get_kbit_device_map`` re-implemented."""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from datasets import Dataset

import posttrain
from posttrain import legacy
from posttrain.cli.configs import ModelConfig, ScriptArguments
from posttrain.cli.parser import ConfigError, TrlParser
from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer
from posttrain.scripts._common import apply_model_args


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test starts as a fresh process would: no old name warned about yet."""
    monkeypatch.setattr(legacy, "_WARNED", set())


def _future_warnings(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, FutureWarning)]


def _sft(tmp_path, **kwargs):
    return posttrain.SFTConfig(output_dir=str(tmp_path), report_to="none", **kwargs)


# -- ModelConfig -----------------------------------------------------------------------------------------------------
def test_model_config_torch_dtype_maps_to_dtype_and_warns_once():
    with pytest.warns(FutureWarning, match="use `dtype`"):
        args = ModelConfig(torch_dtype="bfloat16")
    assert args.dtype == "bfloat16" and "torch_dtype" not in vars(args)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert ModelConfig(torch_dtype="float16").dtype == "float16"
        assert args.torch_dtype == "bfloat16"  # the old attribute reads dtype
    assert _future_warnings(record) == []  # once per name
    with pytest.raises(ValueError, match="keep only `dtype`"):
        ModelConfig(torch_dtype="bfloat16", dtype="float16")


def test_model_config_trust_remote_code_keyword_still_works(tmp_path):
    with pytest.warns(FutureWarning, match="training_args.trust_remote_code"):
        model_args = ModelConfig(model_name_or_path="m", trust_remote_code=True)
    with pytest.warns(FutureWarning, match="training_args.trust_remote_code"):
        assert model_args.trust_remote_code is True
    assert model_args.model_init_kwargs()["trust_remote_code"] is True
    training_args = _sft(tmp_path)
    apply_model_args(training_args, model_args)
    assert training_args.model_init_kwargs["trust_remote_code"] is True


def test_scripts_read_trust_remote_code_from_the_trainer_config(tmp_path):
    training_args = _sft(tmp_path, trust_remote_code=True)
    apply_model_args(training_args, ModelConfig(model_name_or_path="m"))
    assert training_args.model_init_kwargs["trust_remote_code"] is True
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert ModelConfig().trust_remote_code is False  # alone (no parser linked it): TRL 1.6's default
    assert any("training_args.trust_remote_code" in m for m in _future_warnings(record))


# -- trainer-config keyword arguments ----------------------------------------------------------------------------------
def test_renamed_config_keys(tmp_path):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        args = _sft(tmp_path, max_seq_length=64, use_liger=False)
        again = _sft(tmp_path, max_seq_length=32)
        assert args.max_seq_length == 64 and args.use_liger is False  # old attribute reads
    messages = _future_warnings(record)
    assert args.max_length == 64 and args.use_liger_kernel is False and again.max_length == 32
    assert sum("`max_seq_length` was renamed `max_length`" in m for m in messages) == 1
    assert sum("use `use_liger_kernel`" in m for m in messages) == 1
    with pytest.raises(ValueError, match="keep only `max_length`"):
        _sft(tmp_path, max_seq_length=64, max_length=128)


def test_warmup_ratio_becomes_a_fractional_warmup_steps(tmp_path):
    with pytest.warns(FutureWarning, match=r"warmup_steps=0.1"):
        args = _sft(tmp_path, warmup_ratio=0.1)
    assert args.warmup_steps == 0.1 and args.get_warmup_steps(200) == 20 and args.warmup_ratio == 0.1
    # transformers 4: warmup_steps overrode warmup_ratio
    assert _sft(tmp_path, warmup_ratio=0.1, warmup_steps=7).warmup_steps == 7
    with pytest.raises(ValueError, match="Set `warmup_steps` to the number"):
        _sft(tmp_path, warmup_ratio=1.0)  # would read as 1 step in transformers 5


def test_overwrite_output_dir_is_kept_as_an_attribute(tmp_path):
    with pytest.warns(FutureWarning, match="overwrite_output_dir"):
        args = _sft(tmp_path, overwrite_output_dir=True)
    assert args.overwrite_output_dir is True
    assert "overwrite_output_dir" not in args.to_dict()
    assert _sft(tmp_path).overwrite_output_dir is False  # old scripts read it unconditionally


def test_max_prompt_length_raises_where_it_cannot_be_reproduced(tmp_path):
    """Configs whose trainer never had TRL 0.x's prompt cut (reward, SFT ...) refuse it with the migration."""
    for config in (posttrain.RewardConfig, posttrain.SFTConfig):
        with pytest.raises(ValueError, match="`max_prompt_length` was removed in TRL 0.29"):
            config(output_dir=str(tmp_path), report_to="none", max_prompt_length=128)
    # None (the old "no limit") is harmless
    posttrain.RewardConfig(output_dir=str(tmp_path), report_to="none", max_prompt_length=None)
    with pytest.raises(ValueError, match="`truncation_mode` is not an option here"):  # without max_prompt_length
        posttrain.KTOConfig(output_dir=str(tmp_path), report_to="none", truncation_mode="keep_end")
    with pytest.raises(ValueError, match="`truncation_mode` is not an option here"):  # GRPO never had the old rule
        posttrain.GRPOConfig(
            output_dir=str(tmp_path), report_to="none", max_prompt_length=4, truncation_mode="keep_end"
        )


# (prompt, chosen, rejected) lengths -> lengths after TRL 0.x's rule with max_length=10, max_prompt_length=4
PAIR_CASES = [
    ((8, 3, 5), (4, 3, 5)),  # 8 + 5 > 10: the prompt is cut to 4; 4 + 5 fits
    ((8, 7, 2), (4, 6, 2)),  # still 4 + 7 > 10: both completions cut to 10 - 4 = 6
    ((3, 4, 3), (3, 4, 3)),  # fits: unchanged
    ((2, 9, 1), (2, 6, 1)),  # a short prompt is kept whole, yet the completions are cut to 10 - 4 (TRL 0.x's rule)
    ((0, 12, 3), (0, 6, 3)),
]


def _seq(n: int, start: int) -> list[int]:
    return list(range(start, start + n))


@pytest.mark.parametrize(("lengths", "expected"), PAIR_CASES)
@pytest.mark.parametrize("mode", ["keep_end", "keep_start"])
def test_old_prompt_rule_on_hand_built_lengths(lengths, expected, mode):
    prompt, chosen, rejected = _seq(lengths[0], 100), _seq(lengths[1], 200), _seq(lengths[2], 300)
    got_prompt, (got_chosen, got_rejected) = legacy.fit_prompt_and_completions(prompt, [chosen, rejected], 10, 4, mode)
    assert (len(got_prompt), len(got_chosen), len(got_rejected)) == expected
    kept = expected[0]
    assert got_prompt == (prompt[:kept] if mode == "keep_start" or kept == len(prompt) else prompt[-kept:])
    # completions keep their start
    assert got_chosen == chosen[: expected[1]] and got_rejected == rejected[: expected[2]]


def _pairwise(name: str):
    import importlib

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        module = importlib.import_module(f"posttrain.experimental.{name}")
    return getattr(module, f"{name.upper()}Config"), getattr(module, f"{name.upper()}Trainer")


@pytest.mark.parametrize("name", ["orpo", "cpo"])
def test_orpo_cpo_max_prompt_length_applies_the_old_rule(tmp_path, tiny_model_path, name):
    """alignment-handbook's ORPO recipe (max_length + max_prompt_length) trains with TRL 0.x's cut, row by row."""
    config_cls, trainer_cls = _pairwise(name)
    rows = [{"prompt_ids": _seq(p, 10), "chosen_ids": _seq(c, 40), "rejected_ids": _seq(r, 70)}
            for (p, c, r), _ in PAIR_CASES[:4]]  # fmt: skip
    with pytest.warns(FutureWarning, match="posttrain keeps TRL 0.x's rule"):
        args = config_cls(output_dir=str(tmp_path), report_to="none", max_length=10, max_prompt_length=4, max_steps=1,
                          per_device_train_batch_size=2, use_cpu=True)  # fmt: skip
    assert args.max_prompt_length == 4
    trainer = trainer_cls(tiny_model_path, args=args, train_dataset=Dataset.from_list(rows))
    got = [(len(r["prompt_ids"]), len(r["chosen_ids"]), len(r["rejected_ids"])) for r in trainer.train_dataset]
    assert got == [expected for _, expected in PAIR_CASES[:4]]
    assert trainer.train_dataset[0]["prompt_ids"] == rows[0]["prompt_ids"][-4:]  # keep_end: TRL 0.x's default
    trainer.train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        keep_start = config_cls(output_dir=str(tmp_path), report_to="none", max_length=10, max_prompt_length=4,
                                truncation_mode="keep_start", use_cpu=True)  # fmt: skip
    trainer = trainer_cls(tiny_model_path, args=keep_start, train_dataset=Dataset.from_list(rows))
    assert trainer.train_dataset[0]["prompt_ids"] == rows[0]["prompt_ids"][:4]
    with pytest.raises(ValueError, match="strictly less than max_length"):
        config_cls(output_dir=str(tmp_path), report_to="none", max_length=10, max_prompt_length=10)


def test_kto_max_prompt_length_applies_the_old_rule(tmp_path, tiny_model_path):
    """TRL 0.x KTO's `_process_tokens`: the same rule with the row's one completion (the KL pairs are built after)."""
    cases = [((8, 5), (4, 5)), ((8, 7), (4, 6)), ((3, 4), (3, 4)), ((2, 9), (2, 6))]
    rows = [{"prompt_ids": _seq(p, 10), "completion_ids": _seq(c, 40), "label": i % 2 == 0}
            for i, ((p, c), _) in enumerate(cases)]  # fmt: skip
    with pytest.warns(FutureWarning, match="posttrain keeps TRL 0.x's rule"):
        args = posttrain.KTOConfig(output_dir=str(tmp_path), report_to="none", max_length=10, max_prompt_length=4,
                                   max_steps=1, per_device_train_batch_size=2, use_cpu=True)  # fmt: skip
    trainer = posttrain.KTOTrainer(tiny_model_path, args=args, train_dataset=Dataset.from_list(rows))
    data = trainer.train_dataset
    assert [(len(r["prompt_ids"]), len(r["completion_ids"])) for r in data] == [expected for _, expected in cases]
    assert data[0]["prompt_ids"] == rows[0]["prompt_ids"][-4:]
    assert data[1]["KL_completion_ids"] == data[0]["completion_ids"]  # rotated from the fitted completions
    trainer.train()


def test_dpo_max_prompt_length_keeps_the_last_prompt_tokens(tmp_path, tiny_model_path):
    """TRL ≤ 0.28's DPO cut each tokenized prompt to its last max_prompt_length tokens; the pair is then truncated to
    max_length as today."""
    rows = [{"prompt": "a fairly long prompt " * 3, "chosen": " yes", "rejected": " no"}] * 4
    with pytest.warns(FutureWarning, match="cut to its last `max_prompt_length` tokens"):
        args = posttrain.DPOConfig(output_dir=str(tmp_path), report_to="none", max_prompt_length=5, max_steps=1,
                                   per_device_train_batch_size=2, use_cpu=True)  # fmt: skip
    trainer = posttrain.DPOTrainer(tiny_model_path, args=args, train_dataset=Dataset.from_list(rows))
    full = posttrain.DPOTrainer(
        tiny_model_path, args=posttrain.DPOConfig(output_dir=str(tmp_path), report_to="none", use_cpu=True),
        train_dataset=Dataset.from_list(rows),
    )  # fmt: skip
    cut, whole = trainer.train_dataset[0]["prompt_ids"], full.train_dataset[0]["prompt_ids"]
    assert len(whole) > 5 and cut == whole[-5:]
    assert trainer.train_dataset[0]["chosen_ids"] == full.train_dataset[0]["chosen_ids"]
    trainer.train()


def test_grpo_max_prompt_length_keeps_the_last_prompt_tokens(tmp_path, tiny_model_path):
    with pytest.warns(FutureWarning, match="cut to its last `max_prompt_length` tokens"):
        args = posttrain.GRPOConfig(
            output_dir=str(tmp_path), report_to="none", max_prompt_length=3, per_device_train_batch_size=2,
            num_generations=2, max_completion_length=2, max_steps=1, use_cpu=True,
        )  # fmt: skip
    assert args.max_prompt_length == 3

    def reward(completions, **kwargs):
        return [0.0] * len(completions)

    trainer = posttrain.GRPOTrainer(
        tiny_model_path, reward_funcs=reward, args=args,
        train_dataset=Dataset.from_list([{"prompt": "a long prompt of many byte tokens"}] * 4),
    )  # fmt: skip
    assert trainer._rollout_settings().max_prompt_length == 3
    plain = posttrain.GRPOTrainer(
        tiny_model_path, reward_funcs=reward, args=posttrain.GRPOConfig(output_dir=str(tmp_path), report_to="none"),
        train_dataset=Dataset.from_list([{"prompt": "p"}] * 8),
    )  # fmt: skip
    assert plain._rollout_settings().max_prompt_length is None  # TRL 1.16: no truncation


def test_declared_fields_are_left_alone(tmp_path):
    """A config that still declares an old name (e.g. A2PO's max_prompt_length) gets it, with no warning."""
    from posttrain.trainers.distillation import DistillationConfig

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        args = DistillationConfig(output_dir=str(tmp_path), report_to="none", max_prompt_length=16)
    assert args.max_prompt_length == 16 and not any("max_prompt_length" in m for m in _future_warnings(record))


def test_packing_strategy_ffd_is_bfd(tmp_path):
    """TRL 0.19's `packing_strategy="ffd"` (alignment-handbook's smollm3 SFT recipe) is TRL 0.20's "bfd"."""
    with pytest.warns(FutureWarning, match="renamed 'bfd'"):
        assert _sft(tmp_path, packing=True, packing_strategy="ffd").packing_strategy == "bfd"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert _sft(tmp_path, packing_strategy="ffd").packing_strategy == "bfd"
    assert _future_warnings(record) == []  # once
    recipe = _recipe(tmp_path, f"packing: true\npacking_strategy: ffd\noutput_dir: {tmp_path}\nreport_to: none\n")
    _, training_args, _ = TrlParser((ScriptArguments, posttrain.SFTConfig, ModelConfig)).parse_args_and_config(
        ["--config", recipe]
    )
    assert training_args.packing_strategy == "bfd"
    with pytest.raises(ValueError, match="packing_strategy='first_fit' is not valid"):
        _sft(tmp_path, packing_strategy="first_fit")


def test_model_init_kwargs_torch_dtype_maps_to_dtype_once(tiny_model_path):
    """`model_init_kwargs={"torch_dtype": ...}` (transformers 4) loads with `dtype`, warned once through legacy."""
    from posttrain.models.loading import create_model_from_path

    with pytest.warns(FutureWarning, match=r"model_init_kwargs.*`torch_dtype` was renamed `dtype`"):
        model = create_model_from_path(tiny_model_path, torch_dtype="float16")
    assert model.dtype == torch.float16
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert create_model_from_path(tiny_model_path, torch_dtype="bfloat16").dtype == torch.bfloat16
    assert _future_warnings(record) == []
    with pytest.raises(ValueError, match="keep only `dtype`"):
        create_model_from_path(tiny_model_path, torch_dtype="float16", dtype="bfloat16")
    assert legacy.model_init_kwargs({"torch_dtype": "auto", "dtype": "auto"}) == {"dtype": "auto"}
    assert legacy.model_init_kwargs(None) == {}


def test_prm_model_init_kwargs_torch_dtype(tmp_path, tiny_model_path):
    from posttrain.experimental.prm import PRMConfig
    from posttrain.experimental.prm.prm_trainer import _load_token_classifier

    args = PRMConfig(output_dir=str(tmp_path), report_to="none", model_init_kwargs={"torch_dtype": "float16"})
    with pytest.warns(FutureWarning, match="`torch_dtype` was renamed `dtype`"):
        model = _load_token_classifier(tiny_model_path, args)
    assert model.dtype == torch.float16 and model.config.num_labels == 2
    args = PRMConfig(output_dir=str(tmp_path), report_to="none",
                     model_init_kwargs={"torch_dtype": "float16", "dtype": "float32"})  # fmt: skip
    with pytest.raises(ValueError, match="keep only `dtype`"):  # before: torch_dtype silently won
        _load_token_classifier(tiny_model_path, args)


# -- TrlParser: YAML recipes and flags ---------------------------------------------------------------------------
def _recipe(tmp_path, text: str) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return str(path)


def test_recipe_with_old_keys_parses(tmp_path):
    """An alignment-handbook-style SFT recipe (transformers 4 / TRL 0.x keys)."""
    recipe = _recipe(
        tmp_path,
        f"model_name_or_path: m\ntorch_dtype: bfloat16\nmax_seq_length: 128\nwarmup_ratio: 0.1\n"
        f"overwrite_output_dir: true\nuse_liger: false\noutput_dir: {tmp_path}\nreport_to: none\n",
    )
    parser = TrlParser((ScriptArguments, posttrain.SFTConfig, ModelConfig))
    with pytest.warns(FutureWarning) as record:
        _, training_args, model_args = parser.parse_args_and_config(["--config", recipe])
    assert model_args.dtype == "bfloat16" and training_args.max_length == 128
    assert training_args.warmup_steps == 0.1 and training_args.overwrite_output_dir is True
    assert training_args.use_liger_kernel is False
    messages = " ".join(str(w.message) for w in record)
    for new in ("`dtype`", "`max_length`", "warmup_steps", "overwrite_output_dir", "`use_liger_kernel`"):
        assert new in messages


def test_old_flags_on_the_command_line(tmp_path):
    parser = TrlParser((ScriptArguments, posttrain.SFTConfig, ModelConfig))
    with pytest.warns(FutureWarning):
        _, training_args, model_args = parser.parse_args_and_config(
            ["--output_dir", str(tmp_path), "--report_to", "none", "--torch_dtype", "float16", "--max_seq_length=64",
             "--warmup_ratio", "0.05", "--overwrite_output_dir", "--trust_remote_code", "true"]
        )  # fmt: skip
    assert model_args.dtype == "float16" and training_args.max_length == 64
    assert training_args.warmup_steps == 0.05 and training_args.overwrite_output_dir is True
    with pytest.warns(FutureWarning, match="training_args.trust_remote_code"):
        assert model_args.trust_remote_code is True  # open-r1's get_model reads it here


def test_recipe_max_prompt_length(tmp_path):
    grpo = TrlParser((ScriptArguments, posttrain.GRPOConfig, ModelConfig))
    recipe = _recipe(tmp_path, f"max_prompt_length: 256\noutput_dir: {tmp_path}\nreport_to: none\n")
    with pytest.warns(FutureWarning, match="max_prompt_length"):
        _, training_args, _ = grpo.parse_args_and_config(["--config", recipe])
    assert training_args.max_prompt_length == 256
    reward = TrlParser((ScriptArguments, posttrain.RewardConfig, ModelConfig))
    with pytest.raises(ConfigError, match="`max_prompt_length` was removed"):
        reward.parse_args_and_config(["--config", recipe])
    # alignment-handbook's zephyr-141b ORPO recipe keys, and an old truncation_mode on the command line
    orpo_config, _ = _pairwise("orpo")
    orpo = TrlParser((ScriptArguments, orpo_config, ModelConfig))
    recipe = _recipe(tmp_path, f"max_length: 2048\nmax_prompt_length: 1792\noutput_dir: {tmp_path}\nreport_to: none\n")
    with pytest.warns(FutureWarning, match="posttrain keeps TRL 0.x's rule"):
        _, training_args, _ = orpo.parse_args_and_config(["--config", recipe, "--truncation_mode", "keep_start"])
    assert training_args.max_prompt_length == 1792 and training_args._legacy_pair_rule == (1792, "keep_start")
    _, training_args, _ = orpo.parse_args_and_config(["--config", recipe])
    assert training_args._legacy_pair_rule == (1792, "keep_end")


# -- old helpers ------------------------------------------------------------------------------------------------------
def test_setup_chat_format_adds_chatml_and_resizes():
    model, tokenizer = build_tiny_model(), build_tiny_tokenizer()
    tokenizer.chat_template = None
    with pytest.warns(FutureWarning, match="clone_chat_template"):
        model, tokenizer = posttrain.setup_chat_format(model, tokenizer, resize_to_multiple_of=64)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == ("<|im_start|>", "<|im_end|>",
                                                                              "<|im_end|>")  # fmt: skip
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                           add_generation_prompt=True)  # fmt: skip
    assert prompt.endswith("<|im_start|>assistant\n")
    embeddings = model.get_input_embeddings().weight.shape[0]
    assert embeddings % 64 == 0 and embeddings >= len(tokenizer.vocab)
    assert model.config.eos_token_id == tokenizer.eos_token_id == model.generation_config.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    with pytest.raises(ValueError, match="already added"):
        posttrain.setup_chat_format(model, tokenizer)
    with pytest.raises(ValueError, match="not available"):
        tokenizer.chat_template = None
        posttrain.setup_chat_format(model, tokenizer, format="zephyr")


def test_get_kbit_device_map_warns_and_keeps_its_answer():
    with pytest.warns(FutureWarning, match="get_quantization_config"):
        device_map = posttrain.get_kbit_device_map()
    assert device_map == (None if not torch.cuda.is_available() else device_map)
    if not torch.cuda.is_available():
        assert device_map is None


def test_orpo_and_cpo_at_the_top_level():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from posttrain.experimental.cpo import CPOConfig, CPOTrainer
        from posttrain.experimental.orpo import ORPOConfig, ORPOTrainer
    with pytest.warns(FutureWarning, match="posttrain.experimental.orpo"):
        assert posttrain.ORPOConfig is ORPOConfig
    assert posttrain.ORPOTrainer is ORPOTrainer
    assert posttrain.CPOConfig is CPOConfig and posttrain.CPOTrainer is CPOTrainer
    with pytest.raises(AttributeError):
        posttrain.AlignPropConfig  # noqa: B018 - never re-created


def test_async_grpo_is_stable_at_the_top_level_without_the_experimental_warning():
    code = (
        "import warnings; warnings.simplefilter('error')\n"
        "import posttrain\n"
        "trainer, config = posttrain.AsyncGRPOTrainer, posttrain.AsyncGRPOConfig\n"
        "warnings.simplefilter('ignore')\n"
        "from posttrain.experimental.async_grpo import AsyncGRPOTrainer, AsyncGRPOConfig\n"
        "assert trainer is AsyncGRPOTrainer and config is AsyncGRPOConfig\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRL_EXPERIMENTAL_SILENCE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert "AsyncGRPOTrainer" in posttrain.__all__ and "AsyncGRPOConfig" in posttrain.__all__


# -- DataCollatorForCompletionOnlyLM -------------------------------------------------------------------------------
RESPONSE, HUMAN = "### Answer:", "### Question:"


def _collator(**kwargs):
    tokenizer = build_tiny_tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return posttrain.DataCollatorForCompletionOnlyLM(tokenizer=tokenizer, **kwargs), tokenizer


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_completion_only_masks_up_to_the_last_response_template():
    collator, tok = _collator(response_template=RESPONSE)
    short, long = "Q: hi ### Answer: yo", "Q: hello there ### Answer: fine thanks"
    batch = collator([{"input_ids": _ids(tok, short)}, {"input_ids": _ids(tok, long)}])
    for row, text in enumerate((short, long)):
        ids = _ids(tok, text)
        answer_start = len(_ids(tok, text.split(RESPONSE)[0] + RESPONSE))
        labels = batch["labels"][row]
        assert (labels[:answer_start] == -100).all()
        assert labels[answer_start : len(ids)].tolist() == ids[answer_start:]
        assert (labels[len(ids) :] == -100).all()  # padding (right side, the tokenizer's)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["labels"].shape
    assert batch["input_ids"][0, -1].item() == tok.pad_token_id


def test_completion_only_multi_turn_with_instruction_template():
    collator, tok = _collator(response_template=RESPONSE, instruction_template=HUMAN, ignore_index=-1)
    text = "### Question: a ### Answer: b ### Question: c ### Answer: d ### Question: e"
    labels = collator([{"input_ids": _ids(tok, text)}])["labels"][0].tolist()
    kept = tok.decode([t for t in labels if t != -1])
    assert kept == " b  d "  # each answer after its template, up to the next question; the trailing question masked


def test_completion_only_accepts_token_ids_and_masks_rows_without_the_template():
    tok = build_tiny_tokenizer()
    collator, _ = _collator(response_template=_ids(tok, RESPONSE))
    with pytest.warns(UserWarning, match="Could not find response key"):
        batch = collator([{"input_ids": _ids(tok, "no template here")}, {"input_ids": _ids(tok, "x ### Answer: y")}])
    assert (batch["labels"][0] == -100).all()
    assert tok.decode([t for t in batch["labels"][1].tolist() if t != -100]) == " y"


def test_completion_only_padding_free():
    collator, tok = _collator(response_template=RESPONSE, padding_free=True)
    first, second = _ids(tok, "a ### Answer: b"), _ids(tok, "cc ### Answer: dd")
    batch = collator([{"input_ids": first}, {"input_ids": second}])
    assert batch["input_ids"].tolist() == [first + second] and "attention_mask" not in batch
    assert batch["position_ids"].tolist() == [list(range(len(first))) + list(range(len(second)))]
    assert batch["cu_seq_lens_q"].tolist() == [[0, len(first), len(first) + len(second)]]
    assert batch["max_length_q"].tolist() == [len(second)]
    kept = [t for t in batch["labels"][0].tolist() if t != -100]
    assert tok.decode(kept) == " b dd"


def test_completion_only_collator_trains_with_sft_trainer(tmp_path, tiny_model_path):
    """The old recipe: SFTTrainer(..., data_collator=DataCollatorForCompletionOnlyLM(...)) on a text dataset."""
    collator, tok = _collator(response_template=RESPONSE)
    dataset = Dataset.from_list([{"text": f"Q{i} ### Answer: A{i}"} for i in range(8)])
    args = _sft(tmp_path, max_steps=2, per_device_train_batch_size=4, use_cpu=True, logging_steps=1,
                max_length=64, learning_rate=1e-3)  # fmt: skip
    trainer = posttrain.SFTTrainer(tiny_model_path, args=args, train_dataset=dataset, processing_class=tok,
                                   data_collator=collator)  # fmt: skip
    batch = next(iter(trainer.get_train_dataloader()))
    answer_tokens = (batch["labels"] != -100).sum(dim=1)
    assert answer_tokens.tolist() == [3, 3, 3, 3] or answer_tokens.tolist() == [4, 4, 4, 4]  # " A<i>" (+ EOS)
    trainer.train()
    assert trainer.state.global_step == 2


def test_readme_table_lists_every_old_name():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    table = readme.split("### Switching from older TRL", 1)[1].split("\n## ", 1)[0]
    for name in (*legacy.LEGACY_KEYS, *legacy.TOP_LEVEL, *legacy.OLD_PACKING_STRATEGIES, "trust_remote_code"):
        assert f"`{name}" in table or f"{name}`" in table, name
