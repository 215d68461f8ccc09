"""A toy BaseTrainer subclass (plain causal-LM loss) shared by the reliability tests and their subprocess scripts."""

from __future__ import annotations

from datasets import Dataset

from posttrain.models.loading import create_model_from_path, load_processing_class
from posttrain.trainers.base import BaseConfig, BaseTrainer


class ToyTrainer(BaseTrainer):
    """Causal-LM loss on ``input_ids``; ``loss_hook(trainer, loss, inputs)`` may corrupt the loss for a test."""

    loss_hook = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = model(input_ids=inputs["input_ids"], labels=inputs["input_ids"])
        loss = out.loss
        if self.loss_hook is not None:
            loss = self.loss_hook(model, loss, inputs)
        return (loss, out) if return_outputs else loss


def toy_dataset(n: int = 16) -> Dataset:
    return Dataset.from_dict({"input_ids": [[(7 * i + j) % 250 + 1 for j in range(6 + i % 3)] for i in range(n)]})


def make_toy(output_dir, model_path, trainer_cls=ToyTrainer, dataset=None, **kw) -> ToyTrainer:
    defaults = dict(
        max_steps=4,
        logging_steps=1,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        report_to="none",
        save_strategy="no",
        gradient_checkpointing=False,
        disable_tqdm=True,
    )
    defaults.update(kw)
    args = BaseConfig(output_dir=str(output_dir), **defaults)
    tokenizer = load_processing_class(model_path)
    from transformers import DataCollatorForLanguageModeling

    return trainer_cls(
        model=create_model_from_path(model_path),
        args=args,
        train_dataset=dataset if dataset is not None else toy_dataset(),
        processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
