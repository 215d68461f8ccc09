"""Training runs compared between 1 process and 2 processes (torchrun, gloo on CPU) with the same global batch.

Run as ``python -m torch.distributed.run --nproc_per_node 2 reliability_mp_script.py MODEL OUT PER_DEVICE`` (2
processes) or call ``run_all`` in-process (1 process, twice the per-device batch). Each run writes, from the main
process, ``OUT/<kind>.json`` with the logged losses and ``OUT/<kind>_params.pt`` with the final parameters; GRPO also
writes ``OUT/grpo_advantages_<rank>.json``: every (completion text, advantage) this process trained on. ``sft_resume``
resumes the ``sft`` run from its checkpoint-1 (written by all processes); ``nan_skip`` makes one process's loss NaN
(with finite gradients) at step 1 under ``nan_policy="skip"`` and writes ``OUT/nan_skip_<rank>.json``.

Plain SGD (``multiprocess_harness.SGD_ARGS``) keeps parameter differences proportional to gradient differences. GRPO uses a deterministic ``rollout_func``
(``multiprocess_harness.group_position_rollout``: completions depend only on the prompt and the completion's position
in its group), so both layouts train on identical completions and any difference comes from
how groups, rewards and token counts are combined across processes.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from datasets import Dataset
from multiprocess_harness import SGD_ARGS, finish_rank, group_position_rollout


def _reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _build_epoch(kind: str, args: dict):
    """One epoch over 10 rows: with 2 processes × 2 rows the last batch holds 2 rows (issue 18, item 1)."""
    import posttrain

    args.update(max_steps=-1, num_train_epochs=1)
    n = 10
    if kind == "sft_epoch":
        data = Dataset.from_dict({"text": [f"line {i} " + "xyz" * (1 + i % 5) for i in range(n)]})
        return posttrain.SFTTrainer(args["model"], args=posttrain.SFTConfig(**_no_model(args)), train_dataset=data)
    data = Dataset.from_dict(
        {
            "prompt": [f"question {i}? " for i in range(n)],
            "chosen": ["yes " * (1 + i % 3) for i in range(n)],
            "rejected": ["no " * (1 + i % 4) for i in range(n)],
        }
    )
    if kind == "dpo_epoch":
        return posttrain.DPOTrainer(args["model"], args=posttrain.DPOConfig(**_no_model(args)), train_dataset=data)
    return posttrain.RewardTrainer(args["model"], args=posttrain.RewardConfig(**_no_model(args)), train_dataset=data)


def _no_model(args: dict) -> dict:
    return {k: v for k, v in args.items() if k != "model"}


def _build(kind: str, model_path: str, out: str, per_device: int):
    args = dict(SGD_ARGS, output_dir=os.path.join(out, kind), per_device_train_batch_size=per_device)
    if kind.endswith("_epoch"):
        return _build_epoch(kind, {**args, "model": model_path})
    if kind in ("sft", "sft_resume", "nan_skip"):
        from posttrain.trainers.sft import SFTConfig, SFTTrainer

        if kind == "sft":  # checkpoints written by 2 processes, resumed by "sft_resume"
            args.update(save_strategy="steps", save_steps=1)
        if kind == "sft_resume":
            args["output_dir"] = os.path.join(out, "sft")
        if kind == "nan_skip":
            args["nan_policy"] = "skip"
        data = Dataset.from_dict({"text": [f"line {i} " + "xyz" * (1 + i % 5) for i in range(16)]})
        return SFTTrainer(model_path, args=SFTConfig(**args), train_dataset=data)
    if kind == "dpo":
        from posttrain.trainers.dpo import DPOConfig, DPOTrainer

        data = Dataset.from_dict(
            {
                "prompt": [f"question {i}? " for i in range(16)],
                "chosen": ["yes " * (1 + i % 3) for i in range(16)],
                "rejected": ["no " * (1 + i % 4) for i in range(16)],
            }
        )
        return DPOTrainer(model_path, args=DPOConfig(**args), train_dataset=data)
    from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

    data = Dataset.from_dict({"prompt": [f"p{i}:" for i in range(8)]})
    config = GRPOConfig(**args, num_generations=4, max_completion_length=16, loss_type="dapo", shuffle_dataset=False)
    return GRPOTrainer(
        model_path, reward_funcs=_reward, args=config, train_dataset=data, rollout_func=group_position_rollout
    )


def run(kind: str, model_path: str, out: str, per_device: int) -> None:
    trainer = _build(kind, model_path, out, per_device)
    seen = []
    if kind == "grpo":
        pipeline_run = trainer.pipeline.run
        tokenizer = trainer.processing_class

        def recording_run(*a, **kw):
            batch = pipeline_run(*a, **kw)
            texts = tokenizer.batch_decode(batch["completion_ids"], skip_special_tokens=True)
            seen.extend(zip(texts, batch["advantages"].tolist()))
            return batch

        trainer.pipeline.run = recording_run
    rank = trainer.accelerator.process_index
    if kind == "nan_skip":
        compute_loss = trainer.compute_loss

        def nan_on_rank1_step1(*a, **kw):
            # A NaN loss with finite gradients, on one process only: only the cross-process vote keeps the
            # other process from stepping alone (DDP never re-syncs parameters).
            loss = compute_loss(*a, **kw)
            bad = rank == 1 and trainer.state.global_step == 0
            return loss + torch.tensor(float("nan") if bad else 0.0) if not isinstance(loss, tuple) else loss

        trainer.compute_loss = nan_on_rank1_step1
    if kind == "sft_resume":
        trainer.train(resume_from_checkpoint=os.path.join(out, "sft", "checkpoint-1"))
    else:
        trainer.train()
    if kind == "grpo":
        with open(os.path.join(out, f"grpo_advantages_{rank}.json"), "w") as f:
            json.dump(seen, f)
    if kind == "nan_skip":
        flat = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        with open(os.path.join(out, f"nan_skip_{rank}.json"), "w") as f:
            json.dump({"skipped": trainer._numerics.skipped_steps, "checksum": flat.double().sum().item()}, f)
    if trainer.accelerator.is_main_process:
        losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
        logs = [r for r in trainer.state.log_history if "loss" in r]
        with open(os.path.join(out, f"{kind}.json"), "w") as f:
            json.dump({"losses": losses, "logs": logs, "num_processes": trainer.accelerator.num_processes}, f)
        state = {k: v.detach().cpu() for k, v in trainer.accelerator.unwrap_model(trainer.model).state_dict().items()}
        torch.save(state, os.path.join(out, f"{kind}_params.pt"))
    trainer.accelerator.wait_for_everyone()


def run_all(model_path: str, out: str, per_device: int, kinds=("sft", "dpo", "grpo")) -> None:
    """Run ``kinds`` in order (``sft_resume`` needs ``sft`` first)."""
    os.makedirs(out, exist_ok=True)
    for kind in kinds:
        run(kind, model_path, out, per_device)


if __name__ == "__main__":
    torch.set_num_threads(1)
    run_all(sys.argv[1], sys.argv[2], int(sys.argv[3]), kinds=sys.argv[4].split(","))
    finish_rank()  # barrier, then leave without gloo's teardown (see multiprocess_harness)
