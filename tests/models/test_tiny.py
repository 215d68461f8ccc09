"""The offline tiny tokenizer and models."""

import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from posttrain.models.tiny import BIG_VOCAB_SIZE, build_tiny_model, build_tiny_tokenizer


def test_tokenizer_is_byte_level_and_round_trips():
    tok = build_tiny_tokenizer()
    text = "héllo wörld 世界 <think>x</think>\n\n  spaces"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert ids[:2] == [ord("h"), 0xC3]  # 'é' is two UTF-8 bytes
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 258 and tok.pad_token_id == 259
    # reasoning tags survive skip_special_tokens (they are added, not special tokens)
    assert "<think>" in tok.decode(ids, skip_special_tokens=True)


def test_chat_template_generation_prompt_and_assistant_mask():
    tok = build_tiny_tokenizer()
    msgs = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    text = tok.apply_chat_template(msgs, tokenize=False)
    assert text == (
        "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n"
    )
    prompt = tok.apply_chat_template(msgs[:2], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>assistant\n") and text.startswith(prompt)
    out = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    masked = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    # the answer and the end-of-turn token are trained (the model learns to stop)
    assert masked == [ord("y"), ord("o"), tok.eos_token_id]


def test_chat_template_renders_tools_and_tool_calls():
    tok = build_tiny_tokenizer()

    def add(a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: first
            b: second
        """
        return a + b

    msgs = [
        {"role": "user", "content": "1+2?"},
        {
            "role": "assistant",
            "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
        },
        {"role": "tool", "name": "add", "content": "3"},
    ]
    text = tok.apply_chat_template(msgs, tools=[add], tokenize=False, add_generation_prompt=True)
    assert '"name": "add"' in text and "<tools>" in text
    assert '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>' in text
    assert "<tool_response>3</tool_response>" in text


def test_models_are_deterministic_from_seed():
    a = build_tiny_model("qwen2", seed=1)
    b = build_tiny_model("qwen2", seed=1)
    c = build_tiny_model("qwen2", seed=2)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


def test_building_does_not_touch_global_rng():
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    build_tiny_model("llama", seed=5)
    assert torch.equal(torch.rand(1), expected)


def test_saved_models_load_by_path(tiny_model_path, tiny_llama_path, tiny_reward_model_path):
    for path, arch in [(tiny_model_path, "Qwen2ForCausalLM"), (tiny_llama_path, "LlamaForCausalLM")]:
        model = AutoModelForCausalLM.from_pretrained(path)
        assert type(model).__name__ == arch
        tok = AutoTokenizer.from_pretrained(path)
        ids = tok("abc", return_tensors="pt")["input_ids"]
        assert model(ids).logits.shape[-1] == model.config.vocab_size
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_path)
    assert rm.config.num_labels == 1 and rm.config.pad_token_id == 259


def test_big_vocab_variant():
    model = build_tiny_model("qwen2", vocab_size=BIG_VOCAB_SIZE, num_layers=1)
    assert model.get_input_embeddings().weight.shape == (BIG_VOCAB_SIZE, 64)
