import torch
from test_gold import _config, _batch
from distill_helpers import pairs
from trainer_helpers import quiet_single_thread  # noqa: F401
from posttrain.experimental.gold import GOLDTrainer
import pytest

@pytest.mark.parametrize("strategy", ["observed", "bayesian"])
def test_ext(tiny_model_path, merged_teacher_path, tmp_path, strategy):
    args = _config(tmp_path, per_device_train_batch_size=4, max_completion_length=8, max_steps=30,
                   learning_rate=1e-2, lmbda=0.0, logging_steps=10, use_extended_uld=True, uld_token_merge_strategy=strategy)
    trainer = GOLDTrainer(tiny_model_path, merged_teacher_path, args=args, train_dataset=pairs(16))
    batch = _batch(trainer.processing_class, "abcabc")
    trainer.model.eval()
    with torch.no_grad():
        start = trainer._compute_loss(trainer.model, batch).item()
    trainer.train()
    trainer.model.eval()
    with torch.no_grad():
        end = trainer._compute_loss(trainer.model, batch).item()
    print("RESULT", strategy, start, end, [ (e.get("loss"), e.get("distillation_loss")) for e in trainer.state.log_history])
