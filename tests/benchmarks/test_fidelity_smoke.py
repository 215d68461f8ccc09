"""Smoke tests of the fidelity harness (``python -m benchmarks fidelity``) without TRL: the posttrain half of four
scenarios (a preference trainer, RLOO and Online DPO with fixed completions, RLOO sampling through model.generate),
that the replayed ``model.generate`` (TRL's side) and the replayed generation backend (posttrain's) return the same
completions, and the step-by-step comparison on synthetic logs."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if not getattr(sys.modules.get("benchmarks"), "__file__", None):  # see test_bench_smoke.py
    sys.modules.pop("benchmarks", None)
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import fidelity  # noqa: E402
from benchmarks.fidelity_runner import trainer_classes  # noqa: E402


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory) -> dict[str, str]:
    from posttrain.models.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("fidelity-models")
    return {"causal-lm": save_tiny_model(str(root / "lm"))}


@pytest.mark.parametrize("name", ["kto/kto", "rloo/default", "online_dpo/sigmoid", "rloo/generate_beta0.04_mu2"])
def test_posttrain_half_of_a_scenario_logs_every_step(name, model_paths, tmp_path):
    scenario = dataclasses.replace(fidelity.SCENARIOS[name], steps=2)
    logs = fidelity.run_scenario(scenario, model_paths, trainer_classes("posttrain"), str(tmp_path))
    assert [row["step"] for row in logs] == [1, 2]
    assert all("loss" in row and "grad_norm" in row for row in logs)
    again = fidelity.run_scenario(scenario, model_paths, trainer_classes("posttrain"), str(tmp_path))
    assert fidelity.compare(name, {"logs": logs}, {"logs": again}).status == "equal"  # deterministic


def test_fixed_completions_are_a_pure_function_of_the_prompt():
    a = fidelity.fixed_completion([1, 2, 3], 0, 12, 258)
    assert a == fidelity.fixed_completion([1, 2, 3], 0, 12, 258)
    assert a != fidelity.fixed_completion([1, 2, 3], 1, 12, 258)
    assert 2 <= len(a[0]) <= 12 and len(a[0]) == len(a[1])


def test_replayed_generate_and_backend_return_the_same_completions(model_paths):
    """TRL's side: ``model.generate`` on left-padded prompts, each row repeated ``num_return_sequences`` times;
    posttrain's: ``backend.generate(unique prompts, sampling, num_generations)``; both must see the same rows."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(model_paths["causal-lm"])
    eos, pad = tok.eos_token_id, tok.pad_token_id
    prompts = [[40, 41, 42], [43, 44]]
    trl_like = SimpleNamespace(
        processing_class=tok, model=AutoModelForCausalLM.from_pretrained(model_paths["causal-lm"])
    )
    fidelity.patch_model_generation(trl_like)
    ids = torch.tensor([[40, 41, 42], [pad, 43, 44]])
    config = GenerationConfig(max_new_tokens=6, do_sample=True, num_return_sequences=2)
    mask = (ids != pad).long()
    out = trl_like.model.generate(
        input_ids=ids, attention_mask=mask, generation_config=config, return_dict_in_generate=True
    )
    assert out.sequences[:, :3].tolist() == [[40, 41, 42]] * 2 + [[pad, 43, 44]] * 2
    trl_rows = []
    for row in out.sequences[:, 3:].tolist():
        trl_rows.append(row[: row.index(eos) + 1] if eos in row else row)
    backend = SimpleNamespace(sync_weights=lambda model: None)
    fidelity._fixed_backend(backend, lambda sampling: sampling.max_new_tokens, eos, fidelity.generated_completions)
    done = backend.generate(prompts, SimpleNamespace(max_new_tokens=6), 2)
    assert done.completion_ids == trl_rows and done.prompt_ids == [prompts[0]] * 2 + [prompts[1]] * 2
    assert done.completion_ids[0] != done.completion_ids[1]  # the group's completions differ
    # as a sampler returns them: ended by EOS, or truncated at max_new_tokens
    assert all(row[-1] == eos or len(row) == 6 for row in done.completion_ids)
    assert done.finished == [row[-1] == eos for row in done.completion_ids]


def test_compare_reports_first_differing_step_and_one_sided_keys():
    ours = {"logs": [{"step": 1, "loss": 1.0, "kl": 0.0, "x": 3}, {"step": 2, "loss": 0.5, "kl": 0.1, "x": 3}]}
    same = {"logs": [{"step": 1, "loss": 1.00001, "kl": 0.0}, {"step": 2, "loss": 0.5, "kl": 0.1}]}
    result = fidelity.compare("s", ours, same)
    assert result.status == "equal" and result.only_posttrain == ["x"] and result.keys_compared == 2
    other = {"logs": [{"step": 1, "loss": 1.0, "kl": 0.0}, {"step": 2, "loss": 0.6, "kl": 0.1}]}
    result = fidelity.compare("s", ours, other)
    assert (result.status, result.first_diff_step, result.differing_keys) == ("differs", 2, ["loss"])
    assert fidelity.compare("s", ours, other, keys=("kl",)).status == "equal"
    assert fidelity.compare("s", {"error": "ValueError: a"}, {"error": "ValueError: b"}).status == "equal"
    assert fidelity.compare("s", {"error": "KeyError: a"}, other).status == "error"
    table = fidelity.markdown_table([result], {"s": "pending"})
    assert "| s | **differs** (known: pending) | 2 | loss |" in table


def test_scenario_grid_covers_every_trainer_and_loss_type():
    names = set(fidelity.SCENARIOS)
    stable = {"sft", "dpo", "kto", "reward", "grpo", "rloo"}
    trainers = {s.trainer for s in fidelity.SCENARIOS.values()}
    assert stable <= trainers and trainers - stable <= set(fidelity.EXPERIMENTAL)
    assert all(f"dpo/{loss}" in names for loss in fidelity.DPO_LOSSES)
    for loss in fidelity.GRPO_LOSSES:
        assert {f"grpo/{loss}_beta{b}_mu{m}" for b in (0.0, 0.04) for m in (1, 2)} <= names
    assert fidelity.select(["kto/"]) and all(s.trainer == "kto" for s in fidelity.select(["kto/"]))
    # issue 35 item 8: packed num_input_tokens_seen, GRPO GA=2 β=0.04 μ=2 (default and bnpo), RLOO sampling
    assert {"sft/packed_bfd_tokens_seen", "grpo/grad_accum_2_grpo_beta0.04_mu2", "grpo/grad_accum_2_bnpo_beta0.04_mu2",
            "rloo/generate_beta0.04_mu2"} <= names  # fmt: skip
    sampled = fidelity.SCENARIOS["rloo/generate_beta0.04_mu2"]
    assert sampled.sample and sampled.posttrain_args == {"generation_backend": "transformers"}


def test_vlm_scenario_trains_on_the_images(tmp_path):
    """The posttrain half of ``vlm/grpo_llava`` (tiny LLaVA, images in conversational prompts, completions from
    ``patch_generation``) logs every step, deterministically; with the images blackened the same completions give
    another ``grad_norm``, so the images reach the compared forwards (what makes the TRL comparison meaningful)."""
    from PIL import Image

    from posttrain.models.tiny import save_tiny_vlm

    paths = {"vlm-llava": save_tiny_vlm(str(tmp_path / "vlm"), family="llava")}
    scenario = dataclasses.replace(fidelity.SCENARIOS["vlm/grpo_llava"], steps=2)
    logs = fidelity.run_scenario(scenario, paths, trainer_classes("posttrain"), str(tmp_path / "a"))
    assert [row["step"] for row in logs] == [1, 2]
    again = fidelity.run_scenario(scenario, paths, trainer_classes("posttrain"), str(tmp_path / "b"))
    assert fidelity.compare("vlm", {"logs": logs}, {"logs": again}).status == "equal"

    def black(**kw):
        rows = fidelity.ds_vlm_prompts(**kw)
        for row in rows:
            row["image"] = Image.new("RGB", row["image"].size, (0, 0, 0))
        return rows

    fidelity.DATASETS["vlm_black"] = black
    try:
        blackened = dataclasses.replace(scenario, dataset="vlm_black")
        other = fidelity.run_scenario(blackened, paths, trainer_classes("posttrain"), str(tmp_path / "c"))
    finally:
        del fidelity.DATASETS["vlm_black"]
    result = fidelity.compare("vlm", {"logs": logs}, {"logs": other})
    assert result.status == "differs" and "grad_norm" in result.differing_keys


def test_patched_trl_generation_keys_completions_on_the_processed_prompt():
    """TRL's side of ``patch_generation``: GRPO's ``_generate_single_turn`` returns ``(completion_ids, None)`` (no
    sampling log-probs), RLOO's the rows alone; each row is ``fixed_completions`` of the prompt ids TRL built."""
    tok = SimpleNamespace(eos_token_id=258)

    class GRPOTrainer:
        processing_class = SimpleNamespace(tokenizer=tok)
        args = SimpleNamespace(max_completion_length=8)

        def _generate_single_turn(self, *a):
            raise AssertionError("replaced")

    class RLOOTrainer(GRPOTrainer):
        pass

    prompts = [[5, 6, 7], [5, 6, 7], [9, 9]]
    grpo, rloo = GRPOTrainer(), RLOOTrainer()
    fidelity.patch_generation(grpo)
    fidelity.patch_generation(rloo)
    expected = fidelity.fixed_completions(prompts, 8, 258)
    assert grpo._generate_single_turn(prompts, [["img"]] * 3, {}, 2) == (expected, None)
    assert rloo._generate_single_turn(prompts, None, None, 2) == expected
    assert expected[0] != expected[1]  # the group's k-th completions differ
