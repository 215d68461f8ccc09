"""DistillationTrainer with tools=: on-policy samples run the tool loop (a scripted policy, as in the GRPO agent
tests); tool-result tokens stay in context but leave the loss mask; tool metrics are logged; training runs."""

from __future__ import annotations

import torch
from agent_helpers import call, last_user, scripted_sampler, tool_responses
from datasets import Dataset

from posttrain.trainers.distillation import DistillationConfig, DistillationTrainer


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def _script(context):
    responses = tool_responses(context)
    if responses:
        return f"It is {responses[-1]}."
    a, b = (int(x) for x in last_user(context).split("+"))
    return call("add", f'{{"a": {a}, "b": {b}}}')


def test_distillation_with_tools_masks_tool_tokens_and_trains(tiny_model_path, tmp_path):
    rows = [{"prompt": [{"role": "user", "content": f"{a}+3"}]} for a in (2, 3)]
    args = DistillationConfig(
        output_dir=str(tmp_path), per_device_train_batch_size=2, max_completion_length=128, max_steps=1,
        learning_rate=1e-3, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
        write_report=False, gradient_checkpointing=False, max_tool_calling_iterations=2,
    )  # fmt: skip
    trainer = DistillationTrainer(tiny_model_path, tiny_model_path, args=args, train_dataset=Dataset.from_list(rows),
                                  tools=[add])  # fmt: skip
    sampler, _, _ = scripted_sampler(_script, tokenizer=trainer.processing_class)
    trainer.backend.inner = sampler
    batch = trainer.rollout.run([dict(r) for r in rows])
    tok = trainer.processing_class
    mask, lengths = batch["completion_mask"], batch["completion_lengths"]
    for i in range(2):
        ids = batch["completion_ids"][i, : lengths[i]].tolist()
        kept = tok.decode([t for t, m in zip(ids, mask[i].tolist()) if m], skip_special_tokens=False)
        excluded = tok.decode([t for t, m in zip(ids, mask[i].tolist()) if not m], skip_special_tokens=False)
        assert "<tool_call>" in kept and f"It is {2 + i + 3}." in kept  # the model's own turns are trained on
        assert excluded.startswith("\n<|im_start|>tool\n<tool_response>")  # the tool result is context only
    assert int(batch["num_items_in_batch"]) == int(mask.sum()) < int(lengths.sum())
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["tools/call_frequency"] == 1.0 and logs["tools/failure_frequency"] == 0.0
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_server_distillation_with_tools_scores_the_tool_loop_against_the_served_teacher(tiny_model_path, tmp_path,
                                                                                        monkeypatch):  # fmt: skip
    """ServerDistillationTrainer takes DistillationTrainer's tools= / max_tool_calling_iterations: the on-policy
    samples run the tool loop, the teacher behind `posttrain serve` (loopback) scores the whole sequence, tool-result
    tokens stay out of the loss, tool metrics are logged and training runs."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from posttrain.experimental.server_distillation import ServerDistillationConfig, ServerDistillationTrainer
    from posttrain.models.tiny import save_tiny_model
    from posttrain.serving.app import serve_in_thread
    from posttrain.serving.engine import PosttrainEngine

    rows = [{"prompt": [{"role": "user", "content": f"{a}+3"}]} for a in (2, 3)]
    # A teacher with other weights: the student's own would give a KL of 0 up to rounding, of either sign.
    teacher_path = save_tiny_model(tmp_path / "teacher", arch="qwen2", seed=1)
    with serve_in_thread(PosttrainEngine.from_pretrained(teacher_path, device="cpu")) as url:
        args = ServerDistillationConfig(
            output_dir=str(tmp_path), per_device_train_batch_size=2, max_completion_length=128, max_steps=1,
            learning_rate=1e-3, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True,
            write_report=False, gradient_checkpointing=False, max_tool_calling_iterations=2,
            teacher_model_server_url=url,
        )  # fmt: skip
        trainer = ServerDistillationTrainer(tiny_model_path, args=args, train_dataset=Dataset.from_list(rows),
                                            tools=[add])  # fmt: skip
        sampler, _, _ = scripted_sampler(_script, tokenizer=trainer.processing_class)
        trainer.backend.inner = sampler
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
    logs = trainer.state.log_history[0]
    assert logs["tools/call_frequency"] == 1.0 and logs["tools/failure_frequency"] == 0.0
    assert logs["distillation_loss"] > 0
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
