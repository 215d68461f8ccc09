"""The experimental trainers' runs compared between 1 process and 2 processes (torchrun, gloo on CPU).

``python -m torch.distributed.run --nproc_per_node 2 experimental_mp_script.py MODEL ABC_TEACHER MERGED_TEACHER OUT
PER_DEVICE KINDS`` runs the comma-separated ``KINDS`` in one pair of processes; ``run_all`` runs them in-process (1
process, twice the per-device batch, the same global batch). Each run writes, from the main process,
``OUT/<kind>.json`` (every log entry, the process count) and ``OUT/<kind>_params.pt`` (the final trainable
parameters). Completions come from deterministic generators (``multiprocess_harness``), so both layouts train on
identical samples and any difference comes from how rows, tokens and metrics are combined across processes.
Plain SGD (see ``SGD_ARGS``) keeps parameter differences proportional to gradient differences.
"""

from __future__ import annotations

import functools
import json
import os
import sys

import torch
from datasets import Dataset
from multiprocess_harness import SGD_ARGS, PromptKeyedBackend, finish_rank, group_position_rollout

from posttrain.generation.rollout_func import RolloutFuncBackend

ROWS = 16
SCENARIOS = ("cpo", "orpo", "tpo", "bema", "prm", "gkd", "gkd_ga2", "gkd_ga2_epoch", "gold", "iw_opd")
ONLINE = ("online_dpo", "online_dpo_epoch", "gmpo", "a2po", "replay", "ppo", "sdpo", "sdft")


def _reward(completions, **kwargs):
    return [float(len(c)) for c in completions]


def _reward_constant_after_four(prompts, completions, **kwargs):
    """Varied rewards for prompts 0-3 (their groups fill the replay buffer), all-equal for the rest (replaced)."""
    return [float(len(c)) if int(p.split()[-1].rstrip(":")) < 4 else 1.0 for p, c in zip(prompts, completions)]


def _preference(n: int = ROWS, extra: bool = False) -> Dataset:
    """Pairs whose chosen completions differ in length, so each process's token count differs."""
    prompts = ["The sky is", "Grass is", "Snow is", "Coal is"]
    chosen = [" blue.", " green and leafy and soft.", " white.", " black and hard and old and dusty."]
    rejected = [" red and loud.", " pink.", " hot and dry and bright.", " soft."]
    reference = [" blue and clear.", " green.", " white and cold and wet.", " black."]
    columns = {
        "prompt": prompts,
        "chosen": chosen,
        "rejected": rejected,
        **({"reference": reference} if extra else {}),
    }
    return Dataset.from_dict({k: [v[(i + i // 4) % 4] for i in range(n)] for k, v in columns.items()})


def _stepwise(n: int = ROWS) -> Dataset:
    rows = [
        ("Which is larger, 9.8 or 9.11?", ["9.8 has 0.8.", "So 9.11 is larger, as it is longer."], [True, False]),
        ("What is 2 + 3?", ["2 + 3 = 5."], [True]),
        ("What is 4 * 2?", ["4 * 2 = 6.", "The answer is 6.", "Done."], [False, False, False]),
    ]
    rows = [rows[i % 3] for i in range(n)]
    return Dataset.from_dict({k: [r[i] for r in rows] for i, k in enumerate(["prompt", "completions", "labels"])})


def _distill_pairs(n: int = ROWS) -> Dataset:
    answers = ["abc", "abcabcab", "ab", "abcabc"]
    return Dataset.from_list([{"prompt": f"Q{i}:", "completion": answers[(i + i // 4) % 4]} for i in range(n)])


def _distill_pairs_uneven(n: int = ROWS) -> Dataset:
    """Rows 2-3 of every 4 have empty completions (nothing to align): unshuffled on 2 processes × 2 rows, process 1
    has no ULD rows at all while process 0 has two."""
    answers = ["abc", "abcabcab", "", ""]
    return Dataset.from_list([{"prompt": f"Q{i}:", "completion": answers[i % 4]} for i in range(n)])


def _prompts(n: int = ROWS, context: bool = False) -> Dataset:
    extra = lambda i: {"privileged_context": "ab" * (1 + i % 3)} if context else {}  # noqa: E731
    return Dataset.from_list([{"prompt": f"Question {i}:", **extra(i)} for i in range(n)])


def _offline(kind: str, model: str, args: dict):
    import posttrain
    from posttrain.experimental import cpo, orpo, prm, tpo

    if kind == "cpo":
        return cpo.CPOTrainer(model, args=cpo.CPOConfig(**args), train_dataset=_preference())
    if kind == "cpo_epoch":  # one epoch of 10 rows: on 2 processes × 2 rows the last global batch holds 2 rows
        config = cpo.CPOConfig(**dict(args, max_steps=-1, num_train_epochs=1))
        return cpo.CPOTrainer(model, args=config, train_dataset=_preference(10))
    if kind == "orpo":
        return orpo.ORPOTrainer(model, args=orpo.ORPOConfig(**args), train_dataset=_preference())
    if kind == "tpo":
        return tpo.TPOTrainer(model, args=tpo.TPOConfig(**args), train_dataset=_preference(extra=True))
    if kind == "prm":
        return prm.PRMTrainer(model, args=prm.PRMConfig(**args), train_dataset=_stepwise())
    from posttrain.experimental.bema_for_ref_model import BEMACallback, DPOTrainer

    bema = BEMACallback(update_freq=1, update_ref_model=True, ref_model_update_freq=1, lag=1)
    return DPOTrainer(model, args=posttrain.DPOConfig(**args), train_dataset=_preference(), callbacks=[bema])


def _distillation(kind: str, model: str, teachers: dict, args: dict):
    from posttrain.experimental import gkd, gold, iw_opd

    args = dict(args, max_completion_length=8)
    if kind == "gkd":
        config = gkd.GKDConfig(**args, lmbda=0.0, beta=0.5)
        return gkd.GKDTrainer(model, teachers["abc"], args=config, train_dataset=_distill_pairs())
    if kind in ("gkd_ga2", "gkd_ga2_epoch"):
        # gradient accumulation 2: one round per optimizer step, the rows of TRL's per-micro-batch batches; the epoch
        # of 12 rows ends in a step of one micro-batch (2 processes × 2 rows, or 1 × 4)
        epoch = dict(max_steps=-1, num_train_epochs=1) if kind == "gkd_ga2_epoch" else {}
        config = gkd.GKDConfig(**dict(args, gradient_accumulation_steps=2, **epoch), lmbda=0.0, beta=0.5)
        data = _distill_pairs(12 if epoch else ROWS)
        return gkd.GKDTrainer(model, teachers["abc"], args=config, train_dataset=data)
    if kind in ("gold", "gold_uneven"):
        uneven = kind == "gold_uneven"
        config = gold.GOLDConfig(**args, lmbda=0.0, use_uld_loss=True, shuffle_dataset=not uneven)
        data = _distill_pairs_uneven() if uneven else _distill_pairs()
        return gold.GOLDTrainer(model, teachers["merged"], args=config, train_dataset=data)
    config = iw_opd.IWOPDConfig(**args)
    trainer = iw_opd.IWOPDTrainer(model, teachers["abc"], args=config, train_dataset=_distill_pairs())
    trainer.backend = trainer.rollout.student_backend = PromptKeyedBackend(trainer.processing_class)
    return trainer


def _online(kind: str, model: str, args: dict, per_device: int):
    from posttrain.experimental import a2po, gmpo, grpo_with_replay_buffer, online_dpo, ppo, sdft, sdpo

    rollout = group_position_rollout
    if kind == "gmpo":
        config = gmpo.GMPOConfig(**args, num_generations=4, max_completion_length=8, shuffle_dataset=False)
        return gmpo.GMPOTrainer(model, _reward, config, train_dataset=_prompts(), rollout_func=rollout)
    if kind == "replay":
        config = grpo_with_replay_buffer.GRPOWithReplayBufferConfig(
            **dict(args, max_steps=4), num_generations=2, max_completion_length=8, shuffle_dataset=False,
            replay_buffer_size=8,
        )  # fmt: skip
        return grpo_with_replay_buffer.GRPOWithReplayBufferTrainer(
            model, _reward_constant_after_four, config, train_dataset=_prompts(), rollout_func=rollout
        )
    if kind == "sdpo":
        config = sdpo.SDPOConfig(**args, num_generations=4, max_completion_length=8, shuffle_dataset=False)
        return sdpo.SDPOTrainer(model, _reward, config, train_dataset=_prompts(context=True), rollout_func=rollout)
    if kind == "sdft":
        config = sdft.SDFTConfig(**args, num_generations=2, max_completion_length=8, shuffle_dataset=False)
        trainer = sdft.SDFTTrainer(model, args=config, train_dataset=_prompts(context=True))
        trainer.backend = trainer.rollout.student_backend = PromptKeyedBackend(trainer.processing_class)
        return trainer
    rollout = functools.partial(group_position_rollout, vary_by_prompt=True)
    if kind == "a2po":
        config = a2po.A2POConfig(**args, max_completion_length=8, num_value_samples=4, filter_all_incorrect=False)
        trainer = a2po.A2POTrainer(model, _reward, config, train_dataset=_prompts(8), rollout_func=rollout)
    elif kind == "ppo":
        config = ppo.PPOConfig(**args, response_length=8, num_ppo_epochs=1)
        trainer = ppo.PPOTrainer(args=config, model=model, reward_funcs=_reward, train_dataset=_prompts())
    elif kind == "online_dpo_epoch":  # one epoch of 6 prompts at 4 per round: the last round holds 2 (TRL keeps it)
        config = online_dpo.OnlineDPOConfig(**dict(args, max_steps=-1, num_train_epochs=1), max_new_tokens=8)
        trainer = online_dpo.OnlineDPOTrainer(model, reward_funcs=_reward, args=config, train_dataset=_prompts(6))
    else:
        config = online_dpo.OnlineDPOConfig(**args, max_new_tokens=8)
        trainer = online_dpo.OnlineDPOTrainer(model, reward_funcs=_reward, args=config, train_dataset=_prompts())
    trainer.rollout_func = rollout
    trainer.backend = trainer.pipeline.backend = RolloutFuncBackend(rollout, trainer)
    return trainer


def _build(kind: str, paths: dict, out: str, per_device: int):
    args = dict(SGD_ARGS, output_dir=os.path.join(out, kind), per_device_train_batch_size=per_device)
    if kind in ("gkd", "gkd_ga2", "gkd_ga2_epoch", "gold", "gold_uneven", "iw_opd"):
        return _distillation(kind, paths["model"], paths, args)
    if kind in ONLINE:
        return _online(kind, paths["model"], args, per_device)
    return _offline(kind, paths["model"], args)


def _single_process_configs(out: str) -> None:
    """Build each async trainer's config under this launch (they once refused several processes); write what each
    one raised (None: built)."""
    from posttrain.experimental.async_distillation import AsyncDistillationConfig
    from posttrain.experimental.async_grpo import AsyncGRPOConfig

    errors = {}
    for config_class in (AsyncGRPOConfig, AsyncDistillationConfig):
        try:
            config_class(output_dir=os.path.join(out, "unused"), report_to="none")
            errors[config_class.__name__] = None
        except ValueError as err:
            errors[config_class.__name__] = str(err)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(os.path.join(out, "single_process.json"), "w") as f:
            json.dump(errors, f)


def _run_a2po_stage_one(trainer, out: str) -> None:
    """A2PO's V* estimation alone, recording the prompts this process sampled; writes
    ``OUT/a2po_stage1_<rank>.json``: those prompts (one entry per sample) and the V* table this process holds."""
    backend, sampled = trainer.pipeline.backend, []
    rollout = backend.rollout_func

    def recording(prompts, trainer):
        sampled.extend(prompts)
        return rollout(prompts, trainer)

    backend.rollout_func = recording
    trainer._estimate_optimal_values()
    backend.rollout_func = rollout
    with open(os.path.join(out, f"a2po_stage1_{trainer.accelerator.process_index}.json"), "w") as f:
        json.dump({"sampled": sampled, "values": trainer._optimal_values}, f)


def run(kind: str, paths: dict, out: str, per_device: int) -> None:
    if kind == "single_process":
        return _single_process_configs(out)
    trainer = _build(kind, paths, out, per_device)
    if kind == "a2po":
        _run_a2po_stage_one(trainer, out)
    trainer.train()
    if trainer.accelerator.is_main_process:
        logs = [r for r in trainer.state.log_history if "train_runtime" not in r]
        with open(os.path.join(out, f"{kind}.json"), "w") as f:
            json.dump({"logs": logs, "num_processes": trainer.accelerator.num_processes}, f)
        model = trainer.accelerator.unwrap_model(trainer.model)
        state = {n: p.detach().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}
        torch.save(state, os.path.join(out, f"{kind}_params.pt"))
    trainer.accelerator.wait_for_everyone()


def run_all(paths: dict, out: str, per_device: int, kinds) -> None:
    os.makedirs(out, exist_ok=True)
    for kind in kinds:
        run(kind, paths, out, per_device)


if __name__ == "__main__":
    torch.set_num_threads(1)
    model, abc, merged, out, per_device, kinds = sys.argv[1:7]
    run_all({"model": model, "abc": abc, "merged": merged}, out, int(per_device), kinds.split(","))
    finish_rank()  # barrier, then leave without gloo's teardown (see multiprocess_harness)
