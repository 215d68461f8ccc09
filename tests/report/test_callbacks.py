"""RichProgressCallback (plain lines off a terminal) and LogCompletionsCallback (greedy samples into a table)."""

import json

import pytest
from datasets import Dataset

from posttrain.callbacks import LogCompletionsCallback, RichProgressCallback
from posttrain.trainers.sft import SFTConfig, SFTTrainer


def _trainer(tmp_path, model_path, **kw):
    data = Dataset.from_dict({"text": ["hello world"] * 8})
    args = SFTConfig(
        output_dir=str(tmp_path),
        max_steps=2,
        logging_steps=1,
        per_device_train_batch_size=2,
        report_to="none",
        save_strategy="no",
        gradient_checkpointing=False,
        **kw,
    )
    trainer = SFTTrainer(model=model_path, args=args, train_dataset=data)
    # the callback samples from raw prompts (a prompt-only eval set, as for GRPO/DPO evaluation)
    trainer.eval_dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": c}]} for c in ("hi", "yo")])
    return trainer


def test_log_completions_callback_writes_a_table(tmp_path, tiny_model_path):
    from transformers import GenerationConfig

    trainer = _trainer(tmp_path, tiny_model_path)
    callback = LogCompletionsCallback(
        trainer, GenerationConfig(max_new_tokens=4, do_sample=False), num_prompts=2, freq=1
    )
    trainer.add_callback(callback)
    trainer.train()
    assert [row["step"] for row in callback.table] == [1, 1, 2, 2]
    rows = [json.loads(line) for line in (tmp_path / "completions_log.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and all(isinstance(r["completion"], str) for r in rows)
    assert "hi" in rows[0]["prompt"] and "yo" in rows[1]["prompt"]


def test_log_completions_callback_needs_prompts(tmp_path, tiny_model_path):
    trainer = _trainer(tmp_path, tiny_model_path)
    trainer.eval_dataset = None
    with pytest.raises(ValueError, match="'prompt' column"):
        LogCompletionsCallback(trainer)


def test_rich_progress_plain_mode_prints_metrics_once_per_log(tmp_path, tiny_model_path, capsys):
    trainer = _trainer(tmp_path, tiny_model_path, disable_tqdm=True)
    trainer.add_callback(RichProgressCallback(force_plain=True))
    trainer.train()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[step ")]
    assert [line.split("]")[0] for line in lines] == ["[step 1/2", "[step 2/2"]
    assert all("loss=" in line for line in lines)
