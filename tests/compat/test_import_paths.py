"""The import paths and helpers TRL users write, with their behaviour (not only their presence, which
test_trl_surface.py checks): ``posttrain.trainer.*``, ``posttrain.scripts``, ``posttrain.cli.main``,
``posttrain.models``, callbacks, data utils and chat-template utils."""

from __future__ import annotations

import logging
import subprocess
import sys
import types
import warnings

import pytest
import torch


def test_cli_main_is_the_function_and_the_module_stays_importable():
    code = (
        "import warnings; warnings.simplefilter('error');"
        "from posttrain.cli import main; import inspect; assert inspect.isfunction(main), main;"
        "from posttrain.cli.main import COMMANDS; assert 'sft' in COMMANDS;"
        "import posttrain.cli; assert posttrain.cli.main is main;"
        "import sys; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"  # still free of heavy imports
    # ``python -m posttrain.cli.main`` runs without runpy's "found in sys.modules" RuntimeWarning
    run = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "posttrain.cli.main", "--version"],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0 and run.stdout.startswith("posttrain "), run.stderr


def test_trainer_modules_reexport_trainers_collators_and_configs():
    import posttrain
    from posttrain.data.collators import DataCollatorForPreference, DataCollatorForRewardPreference
    from posttrain.trainer import dpo_trainer, kto_trainer, reward_trainer, sft_trainer
    from posttrain.trainer.callbacks import SyncRefModelCallback
    from posttrain.trainer.dpo_config import DPOConfig
    from posttrain.trainer.model_config import ModelConfig

    assert sft_trainer.SFTTrainer is posttrain.SFTTrainer
    assert dpo_trainer.DataCollatorForPreference is DataCollatorForPreference
    assert reward_trainer.DataCollatorForPreference is DataCollatorForRewardPreference  # TRL's reward collator
    assert kto_trainer.DataCollatorForUnpairedPreference.__name__ == "DataCollatorForUnpairedPreference"
    assert DPOConfig is posttrain.DPOConfig and ModelConfig is posttrain.ModelConfig
    assert SyncRefModelCallback is posttrain.SyncRefModelCallback
    import posttrain.trainer as trainer_pkg

    assert trainer_pkg.GRPOTrainer is posttrain.GRPOTrainer
    with pytest.raises(AttributeError, match="nope"):
        trainer_pkg.nope  # noqa: B018


def test_scripts_exports():
    import posttrain
    from posttrain.scripts import DatasetMixtureConfig, ScriptArguments, TrlParser, get_dataset, init_zero_verbose
    from posttrain.scripts.utils import DatasetConfig

    assert TrlParser is posttrain.TrlParser and ScriptArguments is posttrain.ScriptArguments
    assert DatasetMixtureConfig is posttrain.DatasetMixtureConfig and get_dataset is posttrain.get_dataset
    assert init_zero_verbose is posttrain.init_zero_verbose
    assert DatasetConfig(path="x").path == "x"


def test_init_zero_verbose_routes_warnings_to_logging(monkeypatch, caplog):
    from posttrain.scripts import init_zero_verbose

    monkeypatch.setattr(warnings, "showwarning", warnings.showwarning)
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)
    init_zero_verbose()
    with caplog.at_level(logging.WARNING):
        warnings.showwarning("careful", UserWarning, "script.py", 7)
    assert "script.py:7: UserWarning: careful" in caplog.text


def test_selective_log_softmax_has_trls_signature_and_values():
    from posttrain.trainer.utils import selective_log_softmax

    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11)
    index = torch.randint(0, 11, (2, 3))
    naive = torch.gather(logits.log_softmax(-1), -1, index.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(selective_log_softmax(logits, index), naive)
    top = torch.topk(logits, 4, dim=-1).indices  # (..., K)
    torch.testing.assert_close(selective_log_softmax(logits, top), torch.gather(logits.log_softmax(-1), -1, top))
    warm = torch.gather((logits / 0.7).log_softmax(-1), -1, index.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(selective_log_softmax(logits, index, temperature=0.7), warm)
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    torch.testing.assert_close(selective_log_softmax(logits, index, row_mask=mask), naive * mask)
    with pytest.raises(ValueError, match="temperature"):
        selective_log_softmax(logits, index, temperature=0.0)


def test_flush_left_and_nanstd():
    from posttrain.trainer.utils import flush_left, nanstd

    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]])
    values = torch.tensor([[9, 9, 2, 3, 4], [9, 5, 6, 9, 9]])
    new_mask, new_values = flush_left(mask, values)
    assert new_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    assert new_values.tolist() == [[2, 3, 4], [5, 6, 0]]
    assert flush_left(mask).tolist() == new_mask.tolist()
    x = torch.tensor([[1.0, 3.0, float("nan")], [2.0, 4.0, 6.0]])
    torch.testing.assert_close(nanstd(x, dim=1), torch.tensor([2.0**0.5, 2.0]))
    assert nanstd(x, dim=1, keepdim=True).shape == (2, 1)
    torch.testing.assert_close(nanstd(x), torch.tensor([1.0, 3.0, 2.0, 4.0, 6.0]).std())


def test_create_reference_model_shares_the_first_layers(tiny_model_path):
    from posttrain.models import create_reference_model
    from posttrain.models.loading import create_model_from_path

    model = create_model_from_path(tiny_model_path)
    full = create_reference_model(model)
    assert all(not p.requires_grad for p in full.parameters()) and not full.training
    assert all(p.requires_grad for p in model.parameters())  # a plain copy leaves the policy trainable

    ref = create_reference_model(model, num_shared_layers=1)
    names = [n for n, _ in model.named_parameters()]
    first_unshared = next(i for i, n in enumerate(names) if n.startswith("model.layers.1."))
    for i, name in enumerate(names):
        shared = ref.get_parameter(name).data_ptr() == model.get_parameter(name).data_ptr()
        assert shared == (i < first_unshared), name
        assert model.get_parameter(name).requires_grad == (i >= first_unshared), name
    custom = create_reference_model(create_model_from_path(tiny_model_path), 1, pattern="model.layers.{layer}")
    assert custom.get_parameter(names[0]).requires_grad is False
    with pytest.raises(ValueError, match="no parameter name matches layer 1.*pattern="):
        create_reference_model(create_model_from_path(tiny_model_path), 1, pattern="transformer.h.{layer}")


def test_data_and_chat_template_utils_signatures():
    from posttrain.chat_template_utils import add_response_schema, get_training_chat_template, parse_response
    from posttrain.data_utils import apply_chat_template, common_prefix_length
    from posttrain.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    row = {"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}
    assert apply_chat_template(row, processing_class=tok)["completion"].startswith("yo")
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix_length([], [1]) == 0
    with pytest.raises(TypeError, match="processing_class"):
        get_training_chat_template()

    from posttrain.chat_template_utils import has_generation_markers

    assert has_generation_markers(chat_template="{%- generation -%}x{% endgeneration %}")
    assert has_generation_markers({"default": "{% generation %}x{% endgeneration %}", "tool_use": ""})
    assert not has_generation_markers({"default": "plain"})

    tok = add_response_schema(tok)
    text = '<tool_call>\n{"name": "mul", "arguments": {"a": "7"}}\n</tool_call><|im_end|>'
    ids = tok(text, add_special_tokens=False)["input_ids"]

    def mul(a: int) -> int:
        """Multiply.

        Args:
            a: a number
        """
        return a

    untyped = parse_response(tok, ids)["tool_calls"][0]["function"]["arguments"]
    typed = parse_response(tok, ids, tools=[mul])["tool_calls"][0]["function"]["arguments"]
    assert untyped == {"a": "7"} and typed == {"a": 7}


class _FakeWeave(types.ModuleType):
    """Just enough of weave's API: init, get_client, EvaluationLogger with log_prediction/log_score/log_summary."""

    def __init__(self):
        super().__init__("weave")
        self.inits, self.loggers = [], []
        outer = self

        class Prediction:
            def __init__(self, inputs, output):
                self.inputs, self.output, self.scores, self.finished = inputs, output, {}, False

            def log_score(self, scorer, score):
                self.scores[scorer] = score

            def finish(self):
                self.finished = True

        class EvaluationLogger:
            def __init__(self, model, dataset, eval_attributes):
                self.model, self.dataset, self.attributes = model, dataset, eval_attributes
                self.predictions, self.summary = [], None
                outer.loggers.append(self)

            def log_prediction(self, inputs, output):
                self.predictions.append(Prediction(inputs, output))
                return self.predictions[-1]

            def log_summary(self, summary):
                self.summary = summary

        self.EvaluationLogger = EvaluationLogger

    def get_client(self):
        return None

    def init(self, project):
        self.inits.append(project)


def test_weave_callback_logs_eval_completions_and_scores(tiny_model_path, monkeypatch):
    from accelerate import Accelerator
    from datasets import Dataset
    from transformers import GenerationConfig, TrainerControl, TrainerState

    from posttrain.models.loading import create_model_from_path, load_processing_class
    from posttrain.trainer.callbacks import WeaveCallback

    trainer = types.SimpleNamespace(
        eval_dataset=Dataset.from_dict({"prompt": ["a b", "c d"]}),
        processing_class=load_processing_class(tiny_model_path),
        model=create_model_from_path(tiny_model_path),
        accelerator=Accelerator(cpu=True),
    )
    fake = _FakeWeave()
    monkeypatch.setitem(sys.modules, "weave", fake)
    callback = WeaveCallback(
        trainer,
        project_name="me/proj",
        scorers={"length": lambda prompt, completion: len(completion)},
        generation_config=GenerationConfig(max_new_tokens=3, do_sample=False),
        num_prompts=1,
    )
    assert callback.is_evaluation_mode
    state = TrainerState()
    state.global_step = 5
    callback.on_evaluate(None, state, TrainerControl())
    assert fake.inits == ["me/proj"]
    (logger,) = fake.loggers
    assert logger.dataset == "eval_dataset" and logger.attributes["training_step"] == 5
    assert logger.model == tiny_model_path  # the model's _name_or_path
    (prediction,) = logger.predictions
    assert prediction.inputs == {"prompt": "a b"} and prediction.finished and isinstance(prediction.output, str)
    assert prediction.scores["length"] == len(prediction.output)
    assert logger.summary["length_mean"] == len(prediction.output)
    callback.on_evaluate(None, state, TrainerControl())  # same step: not logged twice
    assert len(fake.loggers) == 1

    monkeypatch.setitem(sys.modules, "weave", None)  # not installed: a warning, nothing logged
    assert WeaveCallback(trainer)._init_weave() is None
    trainer.eval_dataset = None
    with pytest.raises(ValueError, match="evaluation dataset"):
        WeaveCallback(trainer)


def test_posttrain_logs_only_under_its_own_logger_names():
    """TRL logs under ``trl.<module>``; posttrain under ``posttrain.<module>``, so ``logging.getLogger("posttrain")``
    filters every posttrain message the way ``logging.getLogger("trl")`` does TRL's."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "posttrain"
    bad = []
    for path in root.rglob("*.py"):
        for match in re.finditer(r"getLogger\(([^)]*)\)(\.setLevel)?", path.read_text()):
            name, configures_other = match.group(1).strip(), match.group(2)
            if name in ("__name__", "") or name.strip("'\"").startswith("posttrain") or configures_other:
                continue
            bad.append(f"{path.relative_to(root.parent)}: getLogger({name})")
    assert not bad, bad


def test_report_failure_is_logged_not_printed(tmp_path, monkeypatch, caplog):
    import posttrain.report
    from posttrain.callbacks import ReportCallback

    def broken(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(posttrain.report, "write_report", broken)
    state = types.SimpleNamespace(is_world_process_zero=True)
    with caplog.at_level(logging.WARNING, logger="posttrain.callbacks"):
        ReportCallback().on_train_end(types.SimpleNamespace(output_dir=str(tmp_path)), state, None)
    assert "could not write the training report: disk full" in caplog.text
