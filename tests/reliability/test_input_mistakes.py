"""Input mistakes that TRL lets through silently (or answers deep in the stack), each with a message that names the
culprit and the fix: plain lists / DataFrames as datasets, empty datasets, completion_only_loss without a prompt,
degenerate preference pairs, negative beta."""

from __future__ import annotations

import warnings

import pandas as pd
import pytest
from datasets import Dataset

TINY = dict(
    max_steps=1,
    logging_steps=1,
    report_to="none",
    save_strategy="no",
    gradient_checkpointing=False,
    disable_tqdm=True,
    per_device_train_batch_size=2,
)
PAIRS = [
    {"prompt": "q1 ", "chosen": "yes", "rejected": "no"},
    {"prompt": "q2 ", "chosen": "sure", "rejected": "nope"},
    {"prompt": "q3 ", "chosen": "same", "rejected": "same"},
    {"prompt": "q4 ", "chosen": "ok", "rejected": ""},
]


def _build(kind, model, out, train_dataset, eval_dataset=None, **kw):
    import posttrain as pt

    args = dict(output_dir=str(out), **TINY, **kw)
    if kind == "sft":
        return pt.SFTTrainer(model, args=pt.SFTConfig(**args), train_dataset=train_dataset, eval_dataset=eval_dataset)
    if kind == "dpo":
        return pt.DPOTrainer(model, args=pt.DPOConfig(**args), train_dataset=train_dataset, eval_dataset=eval_dataset)
    if kind == "kto":
        return pt.KTOTrainer(model, args=pt.KTOConfig(**args), train_dataset=train_dataset, eval_dataset=eval_dataset)
    if kind == "reward":
        config = pt.RewardConfig(**args)
        return pt.RewardTrainer(model, args=config, train_dataset=train_dataset, eval_dataset=eval_dataset)
    if kind in ("grpo", "rloo"):
        cls, cfg = (pt.GRPOTrainer, pt.GRPOConfig) if kind == "grpo" else (pt.RLOOTrainer, pt.RLOOConfig)
        config = cfg(num_generations=2, max_completion_length=4, **args)
        return cls(
            model,
            reward_funcs=lambda completions, **k: [1.0] * len(completions),
            args=config,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
        )
    if kind == "distillation":
        config = pt.DistillationConfig(max_completion_length=4, **args)
        return pt.DistillationTrainer(
            model, teacher_model=model, args=config, train_dataset=train_dataset, eval_dataset=eval_dataset
        )
    raise AssertionError(kind)


ROWS = {
    "sft": [{"text": "hello there"}, {"text": "general kenobi"}],
    "dpo": PAIRS[:2],
    "kto": [{"prompt": "a", "completion": "b", "label": True}, {"prompt": "c", "completion": "d", "label": False}],
    "reward": PAIRS[:2],
    "grpo": [{"prompt": "a"}, {"prompt": "b"}],
    "rloo": [{"prompt": "a"}, {"prompt": "b"}],
    "distillation": [{"prompt": "a"}, {"prompt": "b"}],
}


@pytest.mark.parametrize("kind", sorted(ROWS))
def test_list_and_dataframe_say_what_was_passed_and_how_to_convert(kind, tiny_model_path, tmp_path):
    rows = ROWS[kind]
    with pytest.raises(TypeError, match=r"train_dataset is a Python list of 2 rows \(dicts\).*Dataset\.from_list"):
        _build(kind, tiny_model_path, tmp_path, rows)
    with pytest.raises(TypeError, match=r"train_dataset is a pandas DataFrame \(2 rows.*Dataset\.from_pandas\(df"):
        _build(kind, tiny_model_path, tmp_path, pd.DataFrame(rows))


def test_eval_dataset_list_and_dict_of_dataframes(tiny_model_path, tmp_path):
    train = Dataset.from_list(ROWS["sft"])
    with pytest.raises(TypeError, match="eval_dataset is a Python list"):
        _build("sft", tiny_model_path, tmp_path, train, eval_dataset=ROWS["sft"])
    with pytest.raises(TypeError, match=r"eval_dataset\['a'\] is a pandas DataFrame"):
        _build("sft", tiny_model_path, tmp_path, train, eval_dataset={"a": pd.DataFrame(ROWS["sft"])})


@pytest.mark.parametrize("kind", ["sft", "dpo", "kto", "reward", "grpo"])
def test_empty_dataset_says_0_rows(kind, tiny_model_path, tmp_path):
    empty = Dataset.from_list(ROWS[kind]).select([])
    with pytest.raises(ValueError, match=r"train_dataset has 0 rows \(columns \["):
        _build(kind, tiny_model_path, tmp_path, empty)
    with pytest.raises(ValueError, match="eval_dataset has 0 rows.*eval_dataset=None"):
        _build(kind, tiny_model_path, tmp_path, Dataset.from_list(ROWS[kind] * 2), eval_dataset=empty)


def test_completion_only_loss_without_prompt_is_refused(tiny_model_path, tmp_path):
    text = Dataset.from_list(ROWS["sft"])
    with pytest.raises(ValueError, match=r"completion_only_loss=True needs prompt-completion data.*\['text'\]"):
        _build("sft", tiny_model_path, tmp_path, text, completion_only_loss=True)
    chats = Dataset.from_list(
        [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}]
    )
    with pytest.raises(ValueError, match="assistant_only_loss=True"):
        _build("sft", tiny_model_path, tmp_path, chats, completion_only_loss=True)
    # prompt-completion data, and the default None on text data, are fine
    pc = Dataset.from_list([{"prompt": "a", "completion": "b"}, {"prompt": "c", "completion": "d"}])
    assert _build("sft", tiny_model_path, tmp_path, pc, completion_only_loss=True).completion_only_loss is True
    assert _build("sft", tiny_model_path, tmp_path, text).completion_only_loss is False


@pytest.mark.parametrize("kind", ["dpo", "reward", "kto"])
def test_degenerate_pairs_warn_with_counts_and_all_degenerate_is_refused(kind, tiny_model_path, tmp_path):
    with pytest.warns(UserWarning) as record:
        _build(kind, tiny_model_path, tmp_path, Dataset.from_list(PAIRS))
    message = " ".join(str(w.message) for w in record if "preference signal" in str(w.message))
    assert "1 of 4 rows have chosen == rejected (rows 2)" in message
    assert "1 of 4 rows have an empty rejected (rows 3)" in message
    bad = [{"prompt": "q", "chosen": "same", "rejected": "same"}, {"prompt": "r", "chosen": "", "rejected": "x"}]
    with pytest.raises(ValueError, match="Every row of the train dataset.*unusable preference pair"):
        _build(kind, tiny_model_path, tmp_path, Dataset.from_list(bad))


def test_clean_pairs_do_not_warn(tiny_model_path, tmp_path):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _build("dpo", tiny_model_path, tmp_path, Dataset.from_list(PAIRS[:2]))
    assert not [w for w in record if "preference signal" in str(w.message)]


def test_pretokenized_identical_pairs_are_found():
    from posttrain.reliability.validation import check_preference_pairs

    data = Dataset.from_dict({"prompt_ids": [[1], [2]], "chosen_ids": [[3], [4]], "rejected_ids": [[3], [4]]})
    with pytest.raises(ValueError, match="2 of 2 rows have chosen_ids == rejected_ids"):
        check_preference_pairs(data, "DPOTrainer")


@pytest.mark.parametrize("config", ["DPOConfig", "GRPOConfig", "RLOOConfig"])
def test_negative_beta_needs_an_explicit_opt_in(config, tmp_path):
    import posttrain

    cls = getattr(posttrain, config)
    extra = {"num_generations": 2} if config != "DPOConfig" else {}
    with pytest.raises(ValueError, match=r"beta=-0.1 is negative.*allow_negative_beta=True"):
        cls(output_dir=str(tmp_path), report_to="none", beta=-0.1, **extra)
    args = cls(output_dir=str(tmp_path), report_to="none", beta=-0.1, allow_negative_beta=True, **extra)
    assert args.beta == -0.1
