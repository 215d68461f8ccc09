"""AsyncGRPO with ``keep_routing`` under torchrun (2 processes, gloo on CPU) against a ``posttrain serve`` server that
serves a tiny near-tied Qwen3-MoE (``test_async_grpo_keep_routing.py``).

Run as ``python -m torch.distributed.run --standalone --nproc_per_node 2 async_mp_routing_script.py MODEL URL OUT
KINDS`` (``KINDS``: comma-separated ``replay`` / ``plain``, keep_routing on / off). Each process writes
``OUT/<kind>_<rank>.json``: its log history, the rounds it trained (round, version, staleness), the number of
forwards that replayed routing, its own largest |π_old − π_sampler| per micro-batch, and the routing shapes of the
shard it received first (the rank-0 worker builds every rank's shard; rank 1's routing reaches it only through the
round channel).
"""

from __future__ import annotations

import json
import os
import sys

import torch
from datasets import Dataset
from multiprocess_harness import finish_rank
from reward_helpers import varied_reward

# 2 prompts × 4 completions per round, 4 rows per process; max_staleness=0: every round is sampled from the weights
# it trains with, so with the routing replayed the importance ratio is 1 on both ranks.
ARGS = dict(
    report_to="none", logging_steps=1, gradient_checkpointing=False, write_report=False, disable_tqdm=True,
    per_device_train_batch_size=4, num_generations=4, max_completion_length=8, learning_rate=1e-3, seed=7,
    lr_scheduler_type="constant", use_vllm=True, vllm_mode="server", request_timeout=120, vllm_server_timeout=60,
    max_steps=2, save_strategy="no", max_staleness=0, rollout_importance_sampling=True,
    vllm_importance_sampling_mode="token_truncate",
)  # fmt: skip


def run(kind: str, model: str, url: str, out: str) -> None:
    import posttrain.models.completion_scoring as scoring
    from posttrain.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    replayed: list[int] = []  # one entry per forward that replayed routing (its rows, or shared-prompt packs)
    original = scoring.replay_routing

    def counting(policy, routing):
        replayed.append(int(routing.shape[0]))
        return original(policy, routing)

    scoring.replay_routing = counting
    try:
        args = AsyncGRPOConfig(**ARGS, output_dir=os.path.join(out, kind), vllm_server_base_url=url,
                               keep_routing=kind == "replay")  # fmt: skip
        torch.manual_seed(0)
        dataset = Dataset.from_list([{"prompt": f"Question {i}:"} for i in range(8)])
        trainer = AsyncGRPOTrainer(model, varied_reward, args, train_dataset=dataset)
        shapes: list[list[int]] = []
        prepare = trainer._score_with_current_policy

        def score(batch, record):  # the shard this rank received, before its π_old / loss forwards
            if not shapes:
                shapes.extend(list(batch[k].shape) for k in ("prompt_routing", "completion_routing") if k in batch)
            return prepare(batch, record)

        trainer._score_with_current_policy = score
        trainer.async_rollout.score = score
        # this rank's own max |π_old − π_sampler| per micro-batch (the logged ratio is gathered over the ranks)
        gaps: list[float] = []
        deferred = trainer._deferred_importance_sampling

        def watch(inputs, old_logps, mode):
            mask = inputs["completion_mask"].bool()
            gaps.append(float((old_logps.float() - inputs["sampling_per_token_logps"]).abs()[mask].max()))
            return deferred(inputs, old_logps, mode)

        trainer._deferred_importance_sampling = watch
        trainer.train()
    finally:
        scoring.replay_routing = original
    rank = trainer.accelerator.process_index
    record = {
        "num_processes": trainer.accelerator.num_processes,
        "rounds": trainer.async_rollout.trained_rounds,
        "logs": trainer.state.log_history,
        "replay_calls": len(replayed),
        "local_gaps": gaps,
        "routing_shapes": shapes,
    }
    with open(os.path.join(out, f"{kind}_{rank}.json"), "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    torch.set_num_threads(1)
    model_path, server_url, out_dir, kinds = sys.argv[1:5]
    for scenario in kinds.split(","):
        run(scenario, model_path, server_url, out_dir)
    finish_rank()  # barrier, then leave without gloo's teardown (see multiprocess_harness)
