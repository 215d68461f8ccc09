"""Bad-input suite: every malformed dataset, contradictory config or broken reward function gets a clear error.

Each case builds a trainer (and trains one step when the problem only shows up then) and asserts the error *type*
and that the message names what is wrong and how to fix it. ``_assert_clear`` also rejects errors raised from deep
inside torch / the data loader: the raising frame must be posttrain, transformers' argument checks or datasets'
loader, never torch internals.

Cases a trainer does not handle yet are marked ``xfail(strict=True)`` with the error it should raise; when the
trainer gains the check, the case starts passing and the strict marker makes the suite fail until it is removed.
"""

from __future__ import annotations

import math
import os
import traceback

import pytest
from datasets import Dataset, DatasetDict

TINY = dict(
    max_steps=1,
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    gradient_checkpointing=False,
    disable_tqdm=True,
    per_device_train_batch_size=2,
)


def _assert_clear(info: pytest.ExceptionInfo, *needles: str) -> None:
    message = str(info.value)
    for needle in needles:
        assert needle.lower() in message.lower(), f"{needle!r} not in error message: {message}"
    origin = traceback.extract_tb(info.tb)[-1].filename
    assert f"{os.sep}torch{os.sep}" not in origin, f"error raised from inside torch ({origin}): {message}"


# -- builders ----------------------------------------------------------------------------------------------------
def _sft(model, out, data, **kw):
    from posttrain.trainers.sft import SFTConfig, SFTTrainer

    trainer_kw = {k: kw.pop(k) for k in ("formatting_func", "peft_config") if k in kw}
    return SFTTrainer(model, args=SFTConfig(output_dir=str(out), **{**TINY, **kw}), train_dataset=data, **trainer_kw)


def _dpo(model, out, data, **kw):
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer

    return DPOTrainer(model, args=DPOConfig(output_dir=str(out), **{**TINY, **kw}), train_dataset=data)


def _grpo(model, out, data=None, reward_funcs=None, **kw):
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    data = data if data is not None else Dataset.from_dict({"prompt": ["a", "b", "c", "d"]})
    config = {**TINY, "num_generations": 2, "max_completion_length": 4, **kw}
    return GRPOTrainer(
        model,
        reward_funcs=reward_funcs or _ok_reward,
        args=GRPOConfig(output_dir=str(out), **config),
        train_dataset=data,
    )


def _ok_reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


TEXT = Dataset.from_dict({"text": ["hello there", "general kenobi", "abc", "def"]})
PREFS = Dataset.from_dict({"prompt": ["q1 ", "q2 "], "chosen": ["yes", "sure"], "rejected": ["no", "nope"]})


# -- cases -------------------------------------------------------------------------------------------------------
# Each case: id -> (callable(model_path, tmp_path) that must raise, expected type, needles in the message).
def _train(trainer):
    trainer.train()


def c_output_dir_under_file(m, tmp):
    (tmp / "afile").write_text("x")
    _train(_sft(m, tmp / "afile" / "out", TEXT))


def c_output_dir_readonly_fs(m, tmp):
    _train(_sft(m, "/proc/posttrain-out", TEXT))


def c_sft_empty_dataset(m, tmp):
    _train(_sft(m, tmp, Dataset.from_dict({"text": []})))


def c_dpo_empty_dataset(m, tmp):
    _train(_dpo(m, tmp, Dataset.from_dict({"prompt": [], "chosen": [], "rejected": []})))


def c_grpo_empty_dataset(m, tmp):
    _train(_grpo(m, tmp, Dataset.from_dict({"prompt": []})))


def c_sft_no_dataset(m, tmp):
    _sft(m, tmp, None)


def c_grpo_no_dataset(m, tmp):
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    GRPOTrainer(m, reward_funcs=_ok_reward, args=GRPOConfig(output_dir=str(tmp), num_generations=2, **TINY))


def c_sft_dataset_dict(m, tmp):
    _train(_sft(m, tmp, DatasetDict({"train": TEXT})))


def c_dpo_all_prompts_too_long(m, tmp):
    data = Dataset.from_dict({"prompt": ["x" * 50] * 4, "chosen": ["y"] * 4, "rejected": ["n"] * 4})
    _train(_dpo(m, tmp, data, max_length=8))


def c_bad_nan_policy(m, tmp):
    _sft(m, tmp, TEXT, nan_policy="ignore")


def c_zero_batch_size(m, tmp):
    _train(_sft(m, tmp, TEXT, per_device_train_batch_size=0))


def c_drop_last_drops_everything(m, tmp):
    _train(_sft(m, tmp, TEXT.select(range(1)), dataloader_drop_last=True))


def c_resume_without_checkpoint(m, tmp):
    _sft(m, tmp, TEXT).train(resume_from_checkpoint=True)


def c_resume_from_staging_folder(m, tmp):
    staged = tmp / "tmp-checkpoint-3"
    staged.mkdir()
    (staged / "trainer_state.json").write_text("{}")
    _sft(m, tmp, TEXT).train(resume_from_checkpoint=str(staged))


def c_resume_from_model_folder(m, tmp):
    _sft(m, tmp, TEXT).train(resume_from_checkpoint=m)


def c_missing_model_path(m, tmp):
    _sft(str(tmp / "no-such-model"), tmp, TEXT)


def c_hub_id_offline(m, tmp):
    _sft("posttrain-test-org/definitely-not-cached", tmp, TEXT)


def c_model_init_kwargs_bad_json(m, tmp):
    _sft(m, tmp, TEXT, model_init_kwargs="{dtype: float32")


def c_args_wrong_type(m, tmp):
    from posttrain.trainers.sft import SFTTrainer

    SFTTrainer(m, args={"output_dir": str(tmp)}, train_dataset=TEXT)


# SFT
def c_sft_unknown_columns(m, tmp):
    _sft(m, tmp, Dataset.from_dict({"foo": ["a", "b"], "bar": ["c", "d"]}))


def c_sft_text_not_string(m, tmp):
    _train(_sft(m, tmp, Dataset.from_dict({"text": [1, 2, 3, 4]})))


def c_sft_message_without_role(m, tmp):
    data = Dataset.from_list([{"messages": [{"content": "hi"}, {"role": "assistant", "content": "yo"}]}] * 2)
    _train(_sft(m, tmp, data))


def c_sft_message_unknown_role(m, tmp):
    data = Dataset.from_list([{"messages": [{"role": "wizard", "content": "hi"}]}] * 2)
    _train(_sft(m, tmp, data))


def c_sft_completion_none(m, tmp):
    data = Dataset.from_list([{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": None}])
    _train(_sft(m, tmp, data))


def c_sft_unknown_loss_type(m, tmp):
    _sft(m, tmp, TEXT, loss_type="focal")


def c_sft_bad_max_length(m, tmp):
    _sft(m, tmp, TEXT, max_length=0)


def c_sft_packing_without_max_length(m, tmp):
    _sft(m, tmp, TEXT, packing=True, max_length=None)


def c_sft_bad_truncation_mode(m, tmp):
    _sft(m, tmp, TEXT, truncation_mode="middle")


def c_sft_bad_packing_strategy(m, tmp):
    _sft(m, tmp, TEXT, packing=True, packing_strategy="greedy")


def c_sft_missing_text_field(m, tmp):
    _sft(m, tmp, TEXT, dataset_text_field="content")


def c_sft_formatting_func_not_str(m, tmp):
    _train(_sft(m, tmp, TEXT, formatting_func=lambda row: 42))


def c_sft_bad_peft_config(m, tmp):
    _sft(m, tmp, TEXT, peft_config={"r": 8})


# DPO
def c_dpo_missing_rejected(m, tmp):
    _dpo(m, tmp, Dataset.from_dict({"prompt": ["q"], "chosen": ["a"]}))


def c_dpo_chosen_none(m, tmp):
    data = Dataset.from_list(
        [{"prompt": "q", "chosen": "a", "rejected": "b"}, {"prompt": "q", "chosen": None, "rejected": "b"}]
    )
    _train(_dpo(m, tmp, data))


def c_dpo_chosen_wrong_type(m, tmp):
    _train(_dpo(m, tmp, Dataset.from_dict({"prompt": ["q", "r"], "chosen": [1, 2], "rejected": [3, 4]})))


def c_dpo_unknown_loss_type(m, tmp):
    _dpo(m, tmp, PREFS, loss_type="hinge2")


def c_dpo_loss_weights_mismatch(m, tmp):
    _dpo(m, tmp, PREFS, loss_type=["sigmoid", "ipo"], loss_weights=[1.0])


def c_dpo_bad_ld_alpha(m, tmp):
    _dpo(m, tmp, PREFS, ld_alpha=1.5)


def c_dpo_bad_precompute_batch(m, tmp):
    _dpo(m, tmp, PREFS, precompute_ref_batch_size=0)


def c_kto_missing_label(m, tmp):
    from posttrain.trainers.kto import KTOConfig, KTOTrainer

    data = Dataset.from_dict({"prompt": ["q", "r"], "completion": ["a", "b"]})
    KTOTrainer(m, args=KTOConfig(output_dir=str(tmp), **TINY), train_dataset=data)


def c_reward_missing_rejected(m, tmp):
    from posttrain.trainers.reward import RewardConfig, RewardTrainer

    data = Dataset.from_dict({"chosen": ["a", "b"]})
    RewardTrainer(m, args=RewardConfig(output_dir=str(tmp), **TINY), train_dataset=data)


def c_dpo_mixed_formats(m, tmp):
    data = Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": "q"}],
                "chosen": "a",
                "rejected": [{"role": "assistant", "content": "b"}],
            }
        ]
    )
    _train(_dpo(m, tmp, data))


# GRPO
def c_grpo_missing_prompt(m, tmp):
    _train(_grpo(m, tmp, Dataset.from_dict({"question": ["a", "b"]})))


def c_grpo_reward_wrong_length(m, tmp):
    _train(_grpo(m, tmp, reward_funcs=lambda completions, **kw: [1.0]))


def c_grpo_reward_nan(m, tmp):
    _train(_grpo(m, tmp, reward_funcs=lambda completions, **kw: [math.nan] * len(completions)))


def c_grpo_reward_not_number(m, tmp):
    _train(_grpo(m, tmp, reward_funcs=lambda completions, **kw: ["high"] * len(completions)))


def c_grpo_reward_scalar(m, tmp):
    _train(_grpo(m, tmp, reward_funcs=lambda completions, **kw: 1.0))


def c_grpo_reward_raises(m, tmp):
    def broken(completions, **kwargs):
        raise KeyError("answer")

    _train(_grpo(m, tmp, reward_funcs=broken))


def c_grpo_reward_bad_signature(m, tmp):
    _grpo(m, tmp, reward_funcs=lambda text: [0.0])


def c_grpo_reward_missing_column(m, tmp):
    _grpo(m, tmp, reward_funcs=lambda completions, solution, **kw: [0.0] * len(completions))


def c_grpo_unknown_reward_name(m, tmp):
    _grpo(m, tmp, reward_funcs="no_such_reward")


def c_grpo_reward_weights_mismatch(m, tmp):
    _grpo(m, tmp, reward_weights=[1.0, 2.0])


def c_grpo_one_generation(m, tmp):
    _grpo(m, tmp, num_generations=1)


def c_grpo_batch_not_divisible(m, tmp):
    _grpo(m, tmp, num_generations=3, per_device_train_batch_size=2)


def c_grpo_both_generation_sizes(m, tmp):
    _grpo(m, tmp, generation_batch_size=4, steps_per_generation=2)


def c_grpo_unknown_loss_type(m, tmp):
    _grpo(m, tmp, loss_type="ppo")


def c_grpo_bad_scale_rewards(m, tmp):
    _grpo(m, tmp, scale_rewards="global")


def c_grpo_bad_backend(m, tmp):
    _grpo(m, tmp, generation_backend="tgi")


def c_grpo_vllm_unavailable(m, tmp):
    _grpo(m, tmp, use_vllm=True)


def c_grpo_bad_temperature(m, tmp):
    _grpo(m, tmp, temperature=0.0)


def c_grpo_reward_inf(m, tmp):
    _train(_grpo(m, tmp, reward_funcs=lambda completions, **kw: [math.inf] * len(completions)))


def c_grpo_bad_vllm_mode(m, tmp):
    _grpo(m, tmp, vllm_mode="remote")


CASES = {
    # generic (BaseTrainer / BaseConfig / model loading)
    "output_dir_under_file": (c_output_dir_under_file, ValueError, ["output_dir=", "not writable"]),
    "output_dir_readonly": (c_output_dir_readonly_fs, ValueError, ["output_dir=", "not writable"]),
    "sft_empty_dataset": (c_sft_empty_dataset, ValueError, ["train_dataset has 0 rows"]),
    "dpo_empty_dataset": (c_dpo_empty_dataset, ValueError, ["train_dataset has 0 rows"]),
    "grpo_empty_dataset": (c_grpo_empty_dataset, ValueError, ["train_dataset has 0 rows"]),
    "sft_no_dataset": (c_sft_no_dataset, ValueError, ["train_dataset"]),
    "grpo_no_dataset": (c_grpo_no_dataset, ValueError, ["train_dataset", "prompt"]),
    "sft_dataset_dict": (c_sft_dataset_dict, TypeError, ["train_dataset", "dataset['train']"]),
    "dpo_all_prompts_too_long": (c_dpo_all_prompts_too_long, ValueError, ["empty", "max_length"]),
    "bad_nan_policy": (c_bad_nan_policy, ValueError, ["nan_policy", "stop", "skip"]),
    "zero_batch_size": (c_zero_batch_size, ValueError, ["per_device_train_batch_size"]),
    "drop_last_drops_all": (c_drop_last_drops_everything, ValueError, ["dataloader_drop_last"]),
    "resume_no_checkpoint": (c_resume_without_checkpoint, ValueError, ["resume_from_checkpoint=True", "no complete"]),
    "resume_from_staging": (c_resume_from_staging_folder, ValueError, ["staging folder"]),
    "resume_from_model_folder": (c_resume_from_model_folder, ValueError, ["trainer_state.json"]),
    "missing_model_path": (c_missing_model_path, OSError, ["no-such-model"]),
    "hub_id_offline": (c_hub_id_offline, OSError, ["definitely-not-cached"]),
    "model_init_kwargs_bad_json": (c_model_init_kwargs_bad_json, ValueError, ["model_init_kwargs", "JSON"]),
    "args_wrong_type": (c_args_wrong_type, TypeError, ["args", "SFTConfig"]),
    # SFT
    "sft_unknown_columns": (c_sft_unknown_columns, ValueError, ["foo", "text"]),
    "sft_text_not_string": (c_sft_text_not_string, (ValueError, TypeError), ["text"]),
    "sft_message_without_role": (c_sft_message_without_role, ValueError, ["role"]),
    "sft_message_unknown_role": (c_sft_message_unknown_role, ValueError, ["wizard"]),
    "sft_completion_none": (c_sft_completion_none, ValueError, ["completion", "1"]),
    "sft_unknown_loss_type": (c_sft_unknown_loss_type, ValueError, ["focal", "nll"]),
    "sft_bad_max_length": (c_sft_bad_max_length, ValueError, ["max_length"]),
    "sft_packing_without_max_length": (c_sft_packing_without_max_length, ValueError, ["packing", "max_length"]),
    "sft_bad_truncation_mode": (c_sft_bad_truncation_mode, ValueError, ["truncation_mode", "keep_end"]),
    "sft_bad_packing_strategy": (c_sft_bad_packing_strategy, ValueError, ["packing_strategy", "bfd"]),
    "sft_missing_text_field": (c_sft_missing_text_field, ValueError, ["content"]),
    "sft_formatting_func_not_str": (c_sft_formatting_func_not_str, (ValueError, TypeError), ["formatting_func"]),
    "sft_bad_peft_config": (c_sft_bad_peft_config, TypeError, ["peft_config"]),
    # DPO
    "dpo_missing_rejected": (c_dpo_missing_rejected, ValueError, ["rejected"]),
    "dpo_chosen_none": (c_dpo_chosen_none, ValueError, ["chosen", "1"]),
    "dpo_chosen_wrong_type": (c_dpo_chosen_wrong_type, (ValueError, TypeError), ["chosen"]),
    "dpo_unknown_loss_type": (c_dpo_unknown_loss_type, ValueError, ["hinge2", "sigmoid"]),
    "dpo_loss_weights_mismatch": (c_dpo_loss_weights_mismatch, ValueError, ["loss_weights", "loss_type"]),
    "dpo_bad_ld_alpha": (c_dpo_bad_ld_alpha, ValueError, ["ld_alpha"]),
    "dpo_bad_precompute_batch": (c_dpo_bad_precompute_batch, ValueError, ["precompute_ref_batch_size"]),
    "dpo_mixed_formats": (c_dpo_mixed_formats, ValueError, ["row 0", "chosen", "list of messages"]),
    # KTO / Reward
    "kto_missing_label": (c_kto_missing_label, ValueError, ["label"]),
    "reward_missing_rejected": (c_reward_missing_rejected, ValueError, ["rejected"]),
    # GRPO
    "grpo_missing_prompt": (c_grpo_missing_prompt, ValueError, ["prompt", "question"]),
    "grpo_reward_wrong_length": (c_grpo_reward_wrong_length, ValueError, ["returned 1 values for 2 completions"]),
    "grpo_reward_nan": (c_grpo_reward_nan, ValueError, ["nan"]),
    "grpo_reward_not_number": (c_grpo_reward_not_number, ValueError, ["high"]),
    "grpo_reward_scalar": (c_grpo_reward_scalar, ValueError, ["list"]),
    "grpo_reward_raises": (c_grpo_reward_raises, ValueError, ["broken", "answer"]),
    "grpo_reward_bad_signature": (c_grpo_reward_bad_signature, ValueError, ["<lambda>", "kwargs"]),
    "grpo_reward_missing_column": (c_grpo_reward_missing_column, ValueError, ["solution"]),
    "grpo_unknown_reward_name": (c_grpo_unknown_reward_name, ValueError, ["no_such_reward", "accuracy_reward"]),
    "grpo_reward_weights_mismatch": (c_grpo_reward_weights_mismatch, ValueError, ["reward weights (2)"]),
    "grpo_one_generation": (c_grpo_one_generation, ValueError, ["at least 2 generations"]),
    "grpo_batch_not_divisible": (c_grpo_batch_not_divisible, ValueError, ["num_generations", "divisible"]),
    "grpo_both_generation_sizes": (c_grpo_both_generation_sizes, ValueError, ["generation_batch_size"]),
    "grpo_unknown_loss_type": (c_grpo_unknown_loss_type, ValueError, ["ppo", "dapo"]),
    "grpo_bad_scale_rewards": (c_grpo_bad_scale_rewards, ValueError, ["scale_rewards", "group"]),
    "grpo_bad_backend": (c_grpo_bad_backend, ValueError, ["tgi", "posttrain"]),
    "grpo_vllm_unavailable": (c_grpo_vllm_unavailable, (ImportError, RuntimeError, ValueError), ["vllm"]),
    "grpo_bad_temperature": (c_grpo_bad_temperature, ValueError, ["temperature"]),
    "grpo_reward_inf": (c_grpo_reward_inf, ValueError, ["inf"]),
    "grpo_bad_vllm_mode": (c_grpo_bad_vllm_mode, ValueError, ["vllm_mode", "colocate"]),
}

# Not handled yet by the owning trainer → what it should raise. Strict: once handled, the case passes and the marker
# has to be removed.
NOT_YET = {}


def _params():
    for case in sorted(CASES):
        marks = [pytest.mark.xfail(strict=True, reason=NOT_YET[case])] if case in NOT_YET else []
        yield pytest.param(case, marks=marks, id=case)


@pytest.mark.parametrize("case", list(_params()))
def test_bad_input_gives_clear_error(case, tiny_model_path, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    build, error, needles = CASES[case]
    with pytest.raises(error) as info:
        build(tiny_model_path, tmp_path)
    _assert_clear(info, *needles)


def test_suite_covers_at_least_40_cases():
    assert len(CASES) >= 40


@pytest.mark.parametrize("trainer", ["dpo", "reward"])
def test_dataset_dict_as_train_dataset_is_rejected_for_preference_trainers(trainer, tiny_model_path, tmp_path):
    from posttrain.trainers.dpo import DPOConfig, DPOTrainer
    from posttrain.trainers.reward import RewardConfig, RewardTrainer

    pairs = Dataset.from_dict({"prompt": ["a"], "chosen": ["b"], "rejected": ["c"]})
    cls, cfg = (DPOTrainer, DPOConfig) if trainer == "dpo" else (RewardTrainer, RewardConfig)
    with pytest.raises(TypeError, match=r"train_dataset=dataset\['train'\]"):
        cls(
            tiny_model_path,
            args=cfg(output_dir=str(tmp_path), report_to="none"),
            train_dataset=DatasetDict({"train": pairs}),
        )


@pytest.mark.parametrize("trainer", ["reward", "grpo"])  # DPO/KTO/GRPO/RLOO train on images (test_*_vision, _vlm)
def test_image_columns_are_refused_by_text_only_trainers(trainer, tiny_model_path, tmp_path):
    """Images would be silently ignored: the error names the columns and the fix."""
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
    from posttrain.trainers.reward import RewardConfig, RewardTrainer

    rows = {
        "reward": {"prompt": ["a"] * 4, "chosen": ["b"] * 4, "rejected": ["c"] * 4},
        "grpo": {"prompt": ["a"] * 4},
    }
    data = Dataset.from_dict({**rows[trainer], "images": [[]] * 4})
    cls, cfg = {
        "reward": (RewardTrainer, RewardConfig),
        "grpo": (GRPOTrainer, GRPOConfig),
    }[trainer]
    args = cfg(output_dir=str(tmp_path), report_to="none")
    extra = {"reward_funcs": lambda completions, **kw: [0.0] * len(completions)} if trainer == "grpo" else {}
    if trainer == "grpo":
        args = cfg(output_dir=str(tmp_path), report_to="none", per_device_train_batch_size=4, num_generations=2)
    # GRPO trains vision-language models: on a text-only model the error says so (tests/trainers/test_grpo_vlm.py)
    match = r"model Qwen2ForCausalLM is a text-only model" if trainer == "grpo" else r"image column\(s\) \['images'\]"
    with pytest.raises(ValueError, match=match + r".*(SFTTrainer|vision-language model)"):
        cls(tiny_model_path, args=args, train_dataset=data, **extra)
