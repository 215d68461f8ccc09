"""SDFTTrainer / SDFTConfig: TRL's defaults and checks, the teacher prompt, the loss on a fixed rollout equals the
hand-assembled value for each distillation mode (with loss-token skipping and importance-ratio clipping), each
teacher kind end to end (plain and LoRA students), the seed example, and (slow) the student learns what the teacher
knows from the privileged context."""

from __future__ import annotations

import math

import pytest
import torch
from datasets import Dataset
from trainer_helpers import fast_config, quiet_single_thread  # noqa: F401

from posttrain.experimental.sdft import SDFTConfig, SDFTTrainer
from posttrain.experimental.sdft.sdft_trainer import compose_teacher_prompt

# TRL 1.16's SDFTConfig(output_dir=...): every field it adds to TrainingArguments (dumped from TRL), and the
# TrainingArguments defaults it changes.
TRL_DEFAULTS = {
    "model_init_kwargs": None,
    "trust_remote_code": False,
    "disable_dropout": True,
    "max_prompt_length": 512,
    "num_generations": 8,
    "num_generations_eval": None,
    "max_completion_length": 256,
    "ds3_gather_for_generation": True,
    "shuffle_dataset": True,
    "generation_batch_size": 8,
    "steps_per_generation": 1,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": None,
    "generation_kwargs": None,
    "chat_template_kwargs": None,
    "repetition_penalty": 1.0,
    "cache_implementation": None,
    "use_vllm": False,
    "use_teacher_server": False,
    "vllm_mode": "colocate",
    "vllm_model_impl": "vllm",
    "vllm_enable_sleep_mode": False,
    "vllm_server_base_url": None,
    "vllm_server_host": "0.0.0.0",
    "vllm_server_port": 8000,
    "vllm_group_port": 51216,
    "vllm_server_timeout": 240.0,
    "vllm_tensor_parallel_size": 1,
    "vllm_gpu_memory_utilization": 0.3,
    "vllm_max_model_length": None,
    "num_iterations": 1,
    "teacher_model_kind": "base",
    "teacher_update_rate": 0.05,
    "teacher_sync_steps": 1,
    "distillation_alpha": 0.5,
    "distillation_mode": "topk_logits",
    "distillation_topk": 100,
    "distillation_is_clip": 2.0,
    "distillation_add_tail": False,
    "generate_from_teacher": False,
    "teacher_prompt_template": "{prompt}\n\n{privileged_context}",
    "num_loss_tokens_to_skip": 0,
    "learning_rate": 5e-05,
    "logging_steps": 10,
    "gradient_checkpointing": True,
    "remove_unused_columns": False,
}


def _rows(n=4, context="abc"):
    return Dataset.from_list([{"prompt": f"Q{i}:", "privileged_context": context} for i in range(n)])


def _config(tmp_path, **overrides):
    values = dict(
        per_device_train_batch_size=2, num_generations=2, max_completion_length=6, max_steps=1, learning_rate=1e-3
    )
    return fast_config(SDFTConfig, tmp_path, **{**values, **overrides})


def test_trl_defaults_and_signature(tmp_path):
    import inspect

    args = SDFTConfig(output_dir=str(tmp_path), report_to="none")
    assert {k: getattr(args, k) for k in TRL_DEFAULTS} == TRL_DEFAULTS
    parameters = list(inspect.signature(SDFTTrainer.__init__).parameters)
    assert parameters == ["self", "model", "args", "train_dataset", "eval_dataset", "processing_class", "callbacks",
                          "optimizers", "peft_config"]  # fmt: skip


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(distillation_mode="sampled_token"), "requires `distillation_alpha=1.0`"),
        (dict(distillation_mode="kl"), "distillation_mode must be one of"),
        (dict(teacher_prompt_template="{prompt} only"), "both `{prompt}` and `{privileged_context}`"),
        (dict(teacher_model_kind="frozen"), "teacher_model_kind must be one of"),
        (dict(teacher_update_rate=2.0), "teacher_update_rate"),
        (dict(teacher_sync_steps=0), "teacher_sync_steps"),
        (dict(use_teacher_server=True), "requires `use_vllm=True` and `vllm_mode='server'`"),
        (
            dict(use_teacher_server=True, use_vllm=True, vllm_mode="server"),
            "only supports `teacher_model_kind='live'`",
        ),
        (
            dict(
                use_teacher_server=True,
                use_vllm=True,
                vllm_mode="server",
                teacher_model_kind="live",
                distillation_mode="full_logits",
            ),
            "`full_logits` is unavailable",
        ),
        (dict(beta=0.1), "no effect on SDFT"),
        (dict(per_device_train_batch_size=3), "divisible by num_generations"),
        (dict(generation_batch_size=8, steps_per_generation=2), "can not both be configured"),
    ],
)
def test_config_checks(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=re_escape(message)):
        SDFTConfig(output_dir=str(tmp_path), report_to="none", **overrides)


def re_escape(text):
    import re

    return re.escape(text)


def test_one_generation_per_prompt_is_allowed(tmp_path):
    args = SDFTConfig(output_dir=str(tmp_path), report_to="none", num_generations=1, per_device_train_batch_size=2)
    assert (args.generation_batch_size, args.steps_per_generation) == (2, 1)


def test_teacher_prompt_composition():
    assert compose_teacher_prompt("Solve 2+2.", "Answer: 4.", "{prompt}\n\n{privileged_context}") == (
        "Solve 2+2.\n\nAnswer: 4."
    )
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Solve 2+2."}]
    context = [{"role": "assistant", "content": "4"}, {"role": "user", "content": [{"type": "text", "text": "ok"}]}]
    assert compose_teacher_prompt(conversation, context, "{privileged_context} | {prompt}") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "4\nok | Solve 2+2."},
    ]
    with pytest.raises(ValueError, match="end with a user turn"):
        compose_teacher_prompt([{"role": "assistant", "content": "x"}], "c", "{prompt}{privileged_context}")
    with pytest.raises(ValueError, match=r"must not be None.*row 3"):
        compose_teacher_prompt("p", None, "{prompt}{privileged_context}", 3)


def test_sdft_and_sdpo_build_teacher_prompts_alike():
    """SDFT's teacher prompt and SDPO's re-prompt go through one builder: a multimodal last user turn is read as its
    text parts, a conversation keeps its earlier turns, and a prompt that does not end with a user turn (or is
    empty) is refused with the same message by both."""
    from types import SimpleNamespace

    from posttrain.experimental.sdpo.teacher_context import SuccessfulRolloutTeacherContextBuilder

    sdpo = SuccessfulRolloutTeacherContextBuilder(SimpleNamespace(reprompt_template="{prompt}|{solution}|{feedback}"))
    turn = {
        "role": "user",
        "content": [{"type": "text", "text": "Solve"}, {"type": "image"}, {"type": "text", "text": "2+2."}],
    }
    conversation = [{"role": "system", "content": "Be brief."}, turn]
    assert sdpo._reprompt(conversation, "4", "") == [conversation[0], {"role": "user", "content": "Solve 2+2.|4|"}]
    assert compose_teacher_prompt(conversation, "4", "{prompt}|{privileged_context}|") == sdpo._reprompt(
        conversation, "4", ""
    )
    for bad in ([], [{"content": "no role"}], [{"role": "assistant", "content": "x"}]):
        with pytest.raises(ValueError) as sdft_error:
            compose_teacher_prompt(bad, "c", "{prompt}{privileged_context}")
        with pytest.raises(ValueError) as sdpo_error:
            sdpo._reprompt(bad, "", "")
        assert str(sdft_error.value) == str(sdpo_error.value)
        assert "end with a user turn" in str(sdpo_error.value)


def test_missing_privileged_context_column_names_the_column_and_the_fix(tiny_model_path, tmp_path):
    data = Dataset.from_list([{"prompt": "Q1:"}, {"prompt": "Q2:"}])
    with pytest.raises(ValueError, match=r"missing the column\(s\) \['privileged_context'\].*add_column"):
        SDFTTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=data)
    with pytest.raises(ValueError, match=r"eval_dataset.*'prompt'"):
        SDFTTrainer(tiny_model_path, args=_config(tmp_path), train_dataset=_rows(),
                    eval_dataset=Dataset.from_list([{"question": "x", "privileged_context": "y"}]))  # fmt: skip


def test_rollout_holds_student_and_teacher_prompts(tiny_model_path, tmp_path):
    rows = [{"prompt": "Q1:", "privileged_context": "abc"}] * 2
    for generate_from_teacher in (False, True):
        args = _config(tmp_path, generate_from_teacher=generate_from_teacher)
        trainer = SDFTTrainer(tiny_model_path, args=args, train_dataset=_rows())
        tok = trainer.processing_class
        batch = trainer._generate_and_score(rows, "train")
        assert tok.decode(batch["prompt_ids"][0][batch["prompt_mask"][0].bool()]) == "Q1:"
        teacher = batch["teacher_prompt_ids"][0][batch["teacher_prompt_mask"][0].bool()]
        assert tok.decode(teacher) == "Q1:\n\nabc"
        assert batch["completion_ids"].shape[0] == 2 and "old_per_token_logps" not in batch


def test_old_log_probs_when_the_rollout_outlives_a_step(tiny_model_path, tmp_path):
    trainer = SDFTTrainer(tiny_model_path, args=_config(tmp_path, num_iterations=2), train_dataset=_rows())
    batch = trainer._generate_and_score([{"prompt": "Q1:", "privileged_context": "abc"}] * 2, "train")
    old = batch["old_per_token_logps"]
    assert old.shape == batch["completion_ids"].shape
    assert torch.isfinite(old).all() and (old[batch["completion_mask"].bool()] < 0).all()


# -- the loss on a fixed rollout ---------------------------------------------------------------------------------


def _fixed_batch(tok):
    prompt = torch.tensor([tok("Q1:").input_ids, tok("Q2:").input_ids])
    teacher = torch.tensor([tok("Q1:\n\nabc").input_ids, tok("Q2:\n\nxyz").input_ids])
    completion = torch.tensor([tok("abca").input_ids, tok("xyzw").input_ids])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    return {
        "prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "teacher_prompt_ids": teacher,
        "teacher_prompt_mask": torch.ones_like(teacher), "completion_ids": completion, "completion_mask": mask,
        "completion_lengths": torch.tensor([4, 3]),
    }  # fmt: skip


def _completion_log_probs(model, prompt, completion, vocab):
    c = completion.shape[1]
    logits = model(torch.cat([prompt, completion], 1)).logits[:, -c - 1 : -1, :vocab]
    return torch.log_softmax(logits.double(), -1)  # (B, C, V)


def _kl(p_log, q_log):
    return (p_log.exp() * (p_log - q_log)).sum(-1)


def _divergence(s, t, alpha):
    """The generalized JSD written out: α = 0 KL(T‖S), α = 1 KL(S‖T), else α·KL(T‖M) + (1−α)·KL(S‖M)."""
    if alpha == 0:
        return _kl(t, s)
    if alpha == 1:
        return _kl(s, t)
    m = ((1 - alpha) * s.exp() + alpha * t.exp()).log()
    return alpha * _kl(t, m) + (1 - alpha) * _kl(s, m)


def _expected_per_token(mode, s, t, tokens, alpha, topk, add_tail):
    if mode == "full_logits":
        return _divergence(s, t, alpha)
    if mode == "sampled_token":
        s_tok, t_tok = s.gather(-1, tokens[..., None])[..., 0], t.gather(-1, tokens[..., None])[..., 0]
        return (s_tok - t_tok) * s_tok
    idx = s.topk(topk, -1).indices
    s_k, t_k = s.gather(-1, idx), t.gather(-1, idx)
    if add_tail:
        s_k = torch.cat([s_k, (1 - s_k.exp().sum(-1, keepdim=True)).log()], -1)
        t_k = torch.cat([t_k, (1 - t_k.exp().sum(-1, keepdim=True)).log()], -1)
    else:
        s_k, t_k = s_k - s_k.logsumexp(-1, keepdim=True), t_k - t_k.logsumexp(-1, keepdim=True)
    return _divergence(s_k, t_k, alpha)


@pytest.fixture(scope="module")
def loss_trainer(tiny_model_path, tmp_path_factory):
    trainer = SDFTTrainer(tiny_model_path, args=_config(tmp_path_factory.mktemp("sdft-loss")), train_dataset=_rows())
    with torch.no_grad():  # the student leaves the (base) teacher, so the two differ beyond their prompts
        for p in trainer.model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    trainer.model.train()
    return trainer


@pytest.mark.parametrize(
    "mode, alpha, topk, add_tail",
    [
        ("topk_logits", 0.5, 5, False),
        ("topk_logits", 0.0, 3, True),
        ("topk_logits", 1.0, 5, False),
        ("full_logits", 0.5, None, False),
        ("full_logits", 1.0, None, False),
        ("sampled_token", 1.0, None, False),
    ],
)
def test_loss_on_a_fixed_rollout(loss_trainer, mode, alpha, topk, add_tail):
    trainer = loss_trainer
    args = trainer.args
    args.distillation_mode, args.distillation_alpha, args.distillation_add_tail = mode, alpha, add_tail
    args.distillation_topk = topk or 100
    batch = _fixed_batch(trainer.processing_class)
    loss = trainer._compute_loss(trainer.model, batch)
    with torch.no_grad():
        s = _completion_log_probs(trainer.model, batch["prompt_ids"], batch["completion_ids"], trainer.vocab_rows)
        t = _completion_log_probs(
            trainer.teacher_model, batch["teacher_prompt_ids"], batch["completion_ids"], trainer.vocab_rows
        )
    per_token = _expected_per_token(mode, s, t, batch["completion_ids"], alpha, topk, add_tail)
    mask = batch["completion_mask"].double()
    expected = ((per_token * mask).sum(-1) / mask.sum(-1)).mean()  # mean over rows of each row's token mean
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4, abs=1e-6)
    assert loss.requires_grad
    logged = trainer._metrics["train"]["sdft/distillation_loss"][-1]
    assert logged == pytest.approx(((per_token * mask).sum() / mask.sum()).item(), rel=1e-4, abs=1e-6)
    assert trainer._metrics["train"]["self_distillation/distillation_loss"][-1] == logged


@pytest.mark.parametrize("mode", ["topk_logits", "full_logits"])
def test_loss_never_builds_the_micro_batch_logits(loss_trainer, monkeypatch, mode):
    """The per-token self-distillation loss runs a chunk of loss tokens at a time (forward, recompute, backward):
    the largest (rows, V) block is one chunk, not the micro-batch's N rows."""
    from distill_helpers import LogitsTracker

    trainer = loss_trainer
    args = trainer.args
    monkeypatch.setattr(args, "distillation_mode", mode)
    monkeypatch.setattr(args, "distillation_topk", 4)
    monkeypatch.setattr(trainer, "loss_chunk_size", 2)
    batch = _fixed_batch(trainer.processing_class)
    n_tokens = int(batch["completion_mask"].sum())
    with LogitsTracker(trainer.vocab_rows) as tracker:
        trainer._compute_loss(trainer.model, batch).backward()
    trainer.model.zero_grad()
    assert n_tokens > 2 and tracker.rows == 2, (n_tokens, tracker.rows)


def test_loss_token_skipping_and_importance_clipping(loss_trainer):
    trainer = loss_trainer
    args = trainer.args
    args.distillation_mode, args.distillation_alpha, args.distillation_topk = "full_logits", 0.5, 100
    args.num_loss_tokens_to_skip, args.distillation_is_clip = 1, 2.0
    batch = _fixed_batch(trainer.processing_class)
    with torch.no_grad():
        s = _completion_log_probs(trainer.model, batch["prompt_ids"], batch["completion_ids"], trainer.vocab_rows)
        t = _completion_log_probs(
            trainer.teacher_model, batch["teacher_prompt_ids"], batch["completion_ids"], trainer.vocab_rows
        )
    s_tok = s.gather(-1, batch["completion_ids"][..., None])[..., 0]
    # π_old: row 0 e^1 times less likely (ratio e → capped at 2), row 1 e^1 times more likely (ratio 1/e).
    batch["old_per_token_logps"] = (s_tok + torch.tensor([[-1.0], [1.0]], dtype=s_tok.dtype)).float()
    try:
        loss = trainer._compute_loss(trainer.model, batch)
    finally:
        args.num_loss_tokens_to_skip = 0
    ratio = torch.tensor([[2.0], [math.exp(-1.0)]], dtype=torch.float64)
    per_token = _divergence(s, t, 0.5) * ratio
    mask = batch["completion_mask"].double()
    mask[:, 0] = 0  # the first completion token carries no loss
    expected = ((per_token * mask).sum(-1) / mask.sum(-1)).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-4)


# -- the teacher kinds end to end ----------------------------------------------------------------------------------


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_base_teacher_end_to_end(tiny_model_path, tmp_path):
    trainer = SDFTTrainer(tiny_model_path, args=_config(tmp_path, max_steps=2), train_dataset=_rows())
    assert trainer.teacher.kind == "base" and trainer.teacher_model is not trainer.model
    teacher_before, student_before = _params(trainer.teacher_model), _params(trainer.model)
    trainer.train()
    assert all(torch.equal(p, teacher_before[n]) for n, p in trainer.teacher_model.named_parameters())
    assert any(not torch.equal(p, student_before[n]) for n, p in trainer.model.named_parameters())
    logs = {k for entry in trainer.state.log_history for k in entry}
    for name in ("loss", "sdft/distillation_loss", "self_distillation/distillation_loss", "completions/mean_length",
                 "completions/clipped_ratio", "completions/mean_terminated_length"):  # fmt: skip
        assert name in logs


def test_live_teacher_end_to_end(tiny_model_path, tmp_path):
    trainer = SDFTTrainer(tiny_model_path, args=_config(tmp_path, teacher_model_kind="live"), train_dataset=_rows())
    assert trainer.teacher_model is trainer.model and not trainer.teacher.holds_copy
    trainer.train()
    assert trainer.state.global_step == 1


def test_ema_teacher_end_to_end_equals_the_average(tiny_model_path, tmp_path):
    args = _config(tmp_path, teacher_model_kind="ema", teacher_update_rate=0.5)
    trainer = SDFTTrainer(tiny_model_path, args=args, train_dataset=_rows())
    teacher_before = _params(trainer.teacher_model)
    trainer.train()  # one optimizer step, then one EMA update (teacher_sync_steps=1)
    student = dict(trainer.model.named_parameters())
    for name, param in trainer.teacher_model.named_parameters():
        torch.testing.assert_close(param, 0.5 * teacher_before[name] + 0.5 * student[name].detach())
    assert any(not torch.equal(p, teacher_before[n]) for n, p in trainer.teacher_model.named_parameters())


@pytest.mark.parametrize("kind", ["base", "ema"])
def test_lora_student_end_to_end(tiny_model_path, tmp_path, kind):
    from peft import LoraConfig

    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    args = _config(tmp_path, teacher_model_kind=kind, teacher_update_rate=0.5)
    trainer = SDFTTrainer(tiny_model_path, args=args, train_dataset=_rows(), peft_config=peft_config)
    assert not trainer.teacher.holds_copy
    trainer.train()
    params = dict(trainer.model.named_parameters())
    if kind == "ema":
        teacher = {n: p for n, p in params.items() if ".teacher." in n}
        assert teacher and not any(p.requires_grad for p in teacher.values())
        for name, param in teacher.items():  # 0.5·0 + 0.5·student adapter after the step
            torch.testing.assert_close(param, 0.5 * params[name.replace(".teacher.", ".default.")].detach())
    assert any(p.requires_grad for n, p in params.items() if ".default." in n)


# -- the seed's example and learning -----------------------------------------------------------------------------


def test_seed_doc_example_runs(tiny_model_path, tmp_path):
    """The SDFT example of the docs after s/trl/posttrain/ (a tiny local model; no saving or reporting)."""
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": "Solve 2+2."}]],
            "privileged_context": ["Example answer: 4."],
        }
    )
    training_args = fast_config(
        SDFTConfig, tmp_path, distillation_alpha=0.5, distillation_mode="topk_logits", distillation_topk=5,
        max_completion_length=64,
    )  # fmt: skip
    trainer = SDFTTrainer(model=tiny_model_path, args=training_args, train_dataset=dataset)
    trainer.train()
    assert trainer.state.global_step == 3  # 3 epochs of one prompt × 8 generations
    assert "sdft/distillation_loss" in trainer.state.log_history[0]


def _context_model(path: str) -> str:
    """A tiny Qwen2 that answers "xyz..." after "Q<n>:" but "abc..." when the prompt carries the hint "abc"."""
    from posttrain.models.tiny import build_tiny_model, build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    torch.manual_seed(0)
    model = build_tiny_model("qwen2", tokenizer=tok, seed=1)
    texts = [f"Q{i}:xyzxyzxyz" for i in range(8)] + [f"Q{i}:\n\nabc\nabcabcabc" for i in range(8)]
    enc = tok(texts, return_tensors="pt", padding=True)
    labels = enc.input_ids.masked_fill(enc.attention_mask == 0, -100)
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-2)
    for _ in range(50):
        model(**enc, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@torch.no_grad()
def _mean_log_prob(model, tok, text: str) -> float:
    """Mean per-token log-prob of ``text`` after each prompt "Q<n>:" (no hint) under ``model``."""
    model.eval()
    values = []
    for i in range(8):
        prompt, completion = tok(f"Q{i}:").input_ids, tok(text).input_ids
        logits = model(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()
        values.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None]).mean().item())
    return sum(values) / len(values)


@pytest.mark.slow
def test_student_learns_the_privileged_behaviour(tmp_path):
    """With the base teacher reading the hint, the student (never shown it) comes to answer "abc" and its per-token
    divergence to the teacher falls."""
    path = _context_model(str(tmp_path / "model"))
    data = Dataset.from_list([{"prompt": f"Q{i}:", "privileged_context": "abc\n"} for i in range(8)])
    args = _config(tmp_path, per_device_train_batch_size=8, num_generations=4, max_completion_length=8, max_steps=20,
                   distillation_topk=20, logging_steps=5)  # fmt: skip
    trainer = SDFTTrainer(path, args=args, train_dataset=data)
    tok = trainer.processing_class
    before = _mean_log_prob(trainer.model, tok, "abcabc")
    trainer.train()
    after = _mean_log_prob(trainer.model, tok, "abcabc")
    # the 50-step Adam fit of _context_model lands a little differently per CPU/Python build (before: -0.92 to below
    # -1.0), so the claim is relative: the unhinted student moves from unsure to near-certain "abc"
    assert before < -0.5 and after > before + 0.5 and after > -0.3, (before, after)
    losses = [e["sdft/distillation_loss"] for e in trainer.state.log_history if "sdft/distillation_loss" in e]
    assert losses[-1] < 0.5 * losses[0], losses


def test_ema_teacher_is_checkpointed_and_resumed(tiny_model_path, tmp_path):
    """A run resumed after step 1 ends with the uninterrupted run's EMA teacher (its average is in the checkpoint)."""
    args = _config(tmp_path / "full", teacher_model_kind="ema", teacher_update_rate=0.5, max_steps=2,
                   save_strategy="steps", save_steps=1)  # fmt: skip
    full = SDFTTrainer(tiny_model_path, args=args, train_dataset=_rows())
    full.train()
    expected = _params(full.teacher_model)
    resumed = SDFTTrainer(tiny_model_path, args=args, train_dataset=_rows())
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-1"))
    assert resumed.state.global_step == 2
    for name, param in resumed.teacher_model.named_parameters():
        torch.testing.assert_close(param, expected[name])


def test_self_distillation_callback_events(tiny_model_path, tmp_path):
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):
        def __init__(self):
            self.events = []

        def on_generation_prompts_selected(self, generation_prompts, **kwargs):
            self.events.append(("prompts", list(generation_prompts)))

        def on_self_distillation_batch_prepared(self, teacher_input_ids, completion_ids, **kwargs):
            assert teacher_input_ids.shape[0] == completion_ids.shape[0]
            prompt = teacher_input_ids[0, : -completion_ids.shape[1]]
            self.events.append(("batch", kwargs["processing_class"].decode(prompt, skip_special_tokens=True)))

        def on_generation_batch_built(self, generate_every, steps_per_generation, **kwargs):
            self.events.append(("built", generate_every, steps_per_generation))

    recorder = Recorder()
    args = _config(tmp_path, generate_from_teacher=True)
    trainer = SDFTTrainer(tiny_model_path, args=args, train_dataset=_rows(1), callbacks=[recorder])
    trainer.train()
    assert [e[0] for e in recorder.events] == ["prompts", "batch", "built"]
    assert recorder.events[0][1] == ["Q0:\n\nabc", "Q0:\n\nabc"]  # generate_from_teacher: the teacher prompts
    assert recorder.events[1][1].endswith("Q0:\n\nabc") and recorder.events[2][1:] == (1, 1)


# -- the teacher behind the generation server (use_teacher_server) ------------------------------------------------


def _served_config(tmp_path, url, **overrides):
    return _config(tmp_path, use_vllm=True, vllm_mode="server", vllm_server_base_url=url, use_teacher_server=True,
                   teacher_model_kind="live", **overrides)  # fmt: skip


@pytest.mark.parametrize("mode, alpha, add_tail", [("sampled_token", 1.0, False), ("topk_logits", 0.5, False),
                                                   ("topk_logits", 0.0, True)])  # fmt: skip
def test_served_teacher_loss_on_a_fixed_rollout(tiny_model_path, served_url, tmp_path, mode, alpha, add_tail):
    args = _served_config(tmp_path, served_url, distillation_mode=mode, distillation_alpha=alpha,
                          distillation_topk=4, distillation_add_tail=add_tail)  # fmt: skip
    trainer = SDFTTrainer(tiny_model_path, args=args, train_dataset=_rows())
    trainer.model.train()
    batch = _fixed_batch(trainer.processing_class)
    loss = trainer._compute_loss(trainer.model, batch)  # the server holds the student's weights (synced)
    with torch.no_grad():
        s = _completion_log_probs(trainer.model, batch["prompt_ids"], batch["completion_ids"], trainer.vocab_rows)
        t = _completion_log_probs(
            trainer.model, batch["teacher_prompt_ids"], batch["completion_ids"], trainer.vocab_rows
        )
    if mode == "sampled_token":
        per_token = _expected_per_token(mode, s, t, batch["completion_ids"], alpha, None, False)
    else:  # on the teacher's own top-4 support
        idx = t.topk(4, -1).indices
        s_k, t_k = s.gather(-1, idx), t.gather(-1, idx)
        if add_tail:
            s_k = torch.cat([s_k, (1 - s_k.exp().sum(-1, keepdim=True)).log()], -1)
            t_k = torch.cat([t_k, (1 - t_k.exp().sum(-1, keepdim=True)).log()], -1)
        else:
            s_k, t_k = s_k - s_k.logsumexp(-1, keepdim=True), t_k - t_k.logsumexp(-1, keepdim=True)
        per_token = _divergence(s_k, t_k, alpha)
    mask = batch["completion_mask"].double()
    expected = ((per_token * mask).sum(-1) / mask.sum(-1)).mean()
    assert loss.item() == pytest.approx(expected.item(), rel=1e-3, abs=1e-5)
    assert trainer._metrics["train"]["self_distillation/server_logprob_abs_diff"][-1] >= 0
    trainer.served_teacher.close()


def test_served_teacher_end_to_end(tiny_model_path, served_url, tmp_path):
    trainer = SDFTTrainer(
        tiny_model_path, args=_served_config(tmp_path, served_url, max_steps=2), train_dataset=_rows()
    )
    before = _params(trainer.model)
    trainer.train()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    logs = {k for entry in trainer.state.log_history for k in entry}
    assert {"sdft/distillation_loss", "self_distillation/server_logprob_abs_diff"} <= logs
    trainer.served_teacher.close()


def test_an_already_adapted_student_with_the_base_teacher_warns(tiny_model_path, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    student = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path),
                             LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))  # fmt: skip
    with pytest.warns(UserWarning, match="already contains a PEFT adapter"):
        trainer = SDFTTrainer(student, args=_config(tmp_path), train_dataset=_rows())
    assert trainer.teacher.uses_adapters and trainer.teacher.adapter_name is None  # the base weights


def test_no_loss_token_gives_a_zero_loss_that_reaches_the_parameters(loss_trainer):
    trainer = loss_trainer
    trainer.args.distillation_mode, trainer.args.distillation_alpha = "full_logits", 0.5
    trainer.args.num_loss_tokens_to_skip = 10  # longer than every completion
    try:
        loss = trainer._compute_loss(trainer.model, _fixed_batch(trainer.processing_class))
    finally:
        trainer.args.num_loss_tokens_to_skip = 0
    assert loss.item() == 0.0 and loss.requires_grad
    assert trainer._metrics["train"]["sdft/distillation_loss"][-1] == 0.0
