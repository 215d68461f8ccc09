"""Which online trainers shuffle their generation batch before splitting it into micro-batches, and with which RNG.

TRL's GRPO, RLOO and distillation trainers permute each generation batch with ``torch.randperm`` on the global RNG;
its SDPO, SDFT, GOLD, IW-OPD, GKD, Online DPO and A2PO split it as it comes. Both the micro-batches (their
per-micro-batch means: ``kl``, ``clip_ratio/*``, bnpo's loss) and the global RNG stream that ``model.generate``
samples from next follow from that rule (issue 35 item 8b/8c)."""

from __future__ import annotations

import pytest
import torch
from datasets import Dataset
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

from posttrain.experimental.a2po import A2POTrainer
from posttrain.experimental.gkd import GKDTrainer
from posttrain.experimental.gmpo import GMPOTrainer
from posttrain.experimental.gold import GOLDTrainer
from posttrain.experimental.iw_opd import IWOPDTrainer
from posttrain.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer
from posttrain.experimental.sdft import SDFTTrainer
from posttrain.experimental.sdpo import SDPOTrainer
from posttrain.trainers.distillation import DistillationTrainer
from posttrain.trainers.grpo import GRPOConfig, GRPOTrainer
from posttrain.trainers.rloo import RLOOTrainer


def reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


def _served(trainer, n: int = 8) -> tuple[torch.Tensor, bool]:
    """The rows of the first micro-batch (generation order 0..n-1) and whether the global RNG moved meanwhile."""
    batch = {"completion_ids": torch.arange(n)[:, None], "num_items_in_batch": torch.tensor(n)}
    trainer._generate_and_score = lambda rows, mode: batch
    trainer.model.train()
    torch.manual_seed(11)
    served = trainer._prepare_inputs([{} for _ in range(n)])["completion_ids"][:, 0]
    after = torch.rand(2)
    torch.manual_seed(11)
    return served, not torch.equal(after, torch.rand(2))


def test_grpo_permutes_its_generation_batch_with_the_global_rng(tiny_model_path, tmp_path):
    args = fast_config(GRPOConfig, tmp_path, per_device_train_batch_size=8, num_generations=2, max_completion_length=4)
    trainer = GRPOTrainer(tiny_model_path, reward, args, train_dataset=Dataset.from_list([{"prompt": "a"}] * 8))
    served, moved = _served(trainer)
    torch.manual_seed(11)
    assert torch.equal(served, torch.randperm(8)) and moved


def test_online_dpo_serves_its_generation_batch_in_order_and_leaves_the_rng(tiny_model_path, tmp_path):
    args = fast_config(OnlineDPOConfig, tmp_path, per_device_train_batch_size=4, max_new_tokens=4)
    trainer = OnlineDPOTrainer(
        tiny_model_path, reward_funcs=reward, args=args, train_dataset=Dataset.from_list([{"prompt": "a"}] * 8)
    )
    served, moved = _served(trainer)
    assert served.tolist() == list(range(8)) and not moved


@pytest.mark.parametrize(
    ("trainer_cls", "shuffles"),
    [(GRPOTrainer, True), (RLOOTrainer, True), (DistillationTrainer, True), (GMPOTrainer, True),
     (SDPOTrainer, False), (SDFTTrainer, False), (GOLDTrainer, False), (IWOPDTrainer, False), (GKDTrainer, False),
     (OnlineDPOTrainer, False), (A2POTrainer, False)],
)  # fmt: skip
def test_each_trainer_follows_trls_shuffle_rule(trainer_cls, shuffles):
    assert trainer_cls.shuffles_generation_batch is shuffles
