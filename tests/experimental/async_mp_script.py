"""AsyncGRPO / AsyncDistillation under torchrun (2 processes, gloo on CPU) against a ``posttrain serve`` server, next to
their synchronous server-mode counterparts (``test_async_multiprocess.py``).

Run as ``python -m torch.distributed.run --standalone --nproc_per_node 2 async_mp_script.py MODEL TEACHER URLS OUT
KINDS`` (``URLS``: two server URLs, comma-separated; the ``grpo_pool_*`` runs use both, the others the first). Every run writes, from each process, ``OUT/<kind>_<rank>.json`` (the rounds it trained: round, version,
staleness; its ``rollout_state.json`` values; its log history) and ``OUT/<kind>_<rank>_params.pt`` (its final
parameters: under DDP both ranks must hold the same ones). ``*_async`` runs save checkpoint-1, which ``*_resume``
resumes from (``max_steps=2``), so resumed ≡ uninterrupted is checked with the synchronous run too.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from datasets import Dataset
from multiprocess_harness import finish_rank
from reward_helpers import varied_reward

# 3 prompts per round, 4 completions each, 6 rows per process: the middle prompt's group is split 2 + 2 across the
# processes (advantages normalised over the whole group), and 2 micro-batches per step shuffle the round's rows.
GRPO = dict(
    report_to="none", logging_steps=1, gradient_checkpointing=False, write_report=False, disable_tqdm=True,
    per_device_train_batch_size=3, gradient_accumulation_steps=2, num_generations=4, max_completion_length=6,
    learning_rate=5e-2, seed=7, temperature=0.9, lr_scheduler_type="constant", use_vllm=True, vllm_mode="server",
    request_timeout=120, vllm_server_timeout=60, max_steps=2, save_strategy="no",
)  # fmt: skip
DISTILL = dict(
    report_to="none", logging_steps=1, gradient_checkpointing=False, write_report=False, disable_tqdm=True,
    per_device_train_batch_size=4, max_completion_length=6, learning_rate=5e-2, seed=7, temperature=0.9,
    lr_scheduler_type="constant", use_vllm=True, vllm_mode="server", max_steps=2, beta=0.5, save_strategy="no",
)  # fmt: skip


def grpo_data() -> Dataset:
    return Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(8)])


def distill_data() -> Dataset:
    return Dataset.from_list([{"prompt": f"Q{i}:"} for i in range(8)])


def build(kind: str, model: str, teacher: str, url: str, out: str):
    """The trainer of scenario ``kind`` and the checkpoint to resume from (or None)."""
    path = os.path.join(out, kind)
    resume = None
    if kind.startswith("grpo"):
        from posttrain.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
        from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer

        urls = url.split(",")
        values = dict(GRPO, output_dir=path, vllm_server_base_url=urls[0])
        if kind.startswith("grpo_pool"):  # both servers: each rank's share split into one chunk per server
            values.update(vllm_server_base_url=None, vllm_server_base_urls=urls)
        if kind in ("grpo_sync", "grpo_pool_sync"):
            return GRPOTrainer(model, varied_reward, GRPOConfig(**values), train_dataset=grpo_data()), None
        if kind == "grpo_pool_async":
            values.update(max_staleness=0)
        elif kind == "grpo_async":
            values.update(max_staleness=0, save_strategy="steps", save_steps=1)
        elif kind == "grpo_resume":
            values.update(max_staleness=0)
            resume = os.path.join(out, "grpo_async", "checkpoint-1")
        elif kind == "grpo_stale":  # the worker may run one round ahead: staleness up to 1, same rounds on both ranks
            values.update(max_staleness=1, max_steps=3)
        args = AsyncGRPOConfig(**values)
        return AsyncGRPOTrainer(model, varied_reward, args, train_dataset=grpo_data()), resume
    from posttrain.experimental.async_distillation import AsyncDistillationConfig, AsyncDistillationTrainer
    from posttrain.trainers.distillation import DistillationConfig, DistillationTrainer

    values = dict(DISTILL, output_dir=path, vllm_server_base_url=url.split(",")[0])
    if kind.startswith("distill_sync"):
        if kind == "distill_sync_ckpt":
            values.update(save_strategy="steps", save_steps=1)
        elif kind == "distill_sync_resume":
            resume = os.path.join(out, "distill_sync_ckpt", "checkpoint-1")
        trainer = DistillationTrainer(model, teacher, DistillationConfig(**values), train_dataset=distill_data())
        return trainer, resume
    values.update(max_staleness=0, teacher_temperature=values["temperature"], request_timeout=120,
                  vllm_server_timeout=60)  # fmt: skip
    if kind == "distill_async":
        values.update(save_strategy="steps", save_steps=1)
    elif kind == "distill_resume":
        resume = os.path.join(out, "distill_async", "checkpoint-1")
    args = AsyncDistillationConfig(**values)
    trainer = AsyncDistillationTrainer(model, args, train_dataset=distill_data(), teacher_model=teacher)
    return trainer, resume


def channel(out: str) -> None:
    """The round channel alone: rank 0 sends a keep-alive then an error (rank 1 skips the first, gets the second);
    then rank 0 stays silent and rank 1's bounded receive raises naming what it waited for. Writes
    ``OUT/channel_1.json``. Last scenario: the timed-out group is not used again."""
    from posttrain.rollout.async_worker import RolloutWorkerError
    from posttrain.rollout.multiprocess import RoundChannel

    if not torch.distributed.is_initialized():  # run alone: no trainer set the group up
        torch.distributed.init_process_group("gloo")
    torch.distributed.barrier()  # the group's set-up waits on the store with the group's (short) timeout
    chan = RoundChannel("AsyncGRPO", timeout_s=5.0)
    if chan.is_main:
        chan.send_all(("wait",))
        chan.send_all(("error", "boom on rank 0"))
    else:
        got = chan.receive("round 5 (step 5)")
        start = time.monotonic()
        try:
            chan.receive("round 6 (step 6)")
            error = None
        except RolloutWorkerError as err:
            error = str(err)
        with open(os.path.join(out, "channel_1.json"), "w") as f:
            json.dump({"got": list(got), "error": error, "waited_s": time.monotonic() - start}, f)
    torch.distributed.barrier()  # rank 0 waits here (default group) until rank 1 gave up


def run(kind: str, model: str, teacher: str, url: str, out: str) -> None:
    if kind == "channel":
        return channel(out)

    trainer, resume = build(kind, model, teacher, url, out)
    trainer.train(resume_from_checkpoint=resume)
    rank = trainer.accelerator.process_index
    rollout = getattr(trainer, "async_rollout", None)
    record = {
        "num_processes": trainer.accelerator.num_processes,
        "rounds": rollout.trained_rounds if rollout else None,
        "state": rollout.checkpoint_state({})["rollout_state.json"] if rollout else None,
        "logs": trainer.state.log_history,
    }
    with open(os.path.join(out, f"{kind}_{rank}.json"), "w") as f:
        json.dump(record, f)
    params = {n: p.detach().cpu().clone() for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters()}
    torch.save(params, os.path.join(out, f"{kind}_{rank}_params.pt"))


if __name__ == "__main__":
    torch.set_num_threads(1)
    model_path, teacher_path, server_url, out_dir, kinds = sys.argv[1:6]
    for scenario in kinds.split(","):
        run(scenario, model_path, teacher_path, server_url, out_dir)
    finish_rank()  # barrier, then leave without gloo's teardown (see multiprocess_harness)
