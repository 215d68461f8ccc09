"""The sweep's FLOP accounting and tables, and the machine-peak probe (benchmarks/sweep.py, machine_peak.py)."""

from __future__ import annotations

import pytest

from benchmarks.machine_peak import measure
from benchmarks.sweep import matmul_params, shared_prompt_prefix, tables
from benchmarks.workloads import SYSTEM_PROMPT


def test_qwen05b_has_qwen25_05b_parameter_count():
    per_token, total = matmul_params("qwen05b")
    assert total == 494_032_768  # Qwen/Qwen2.5-0.5B's published size (tied embedding counted once)
    # per token: 24 layers x (q, o: 896^2; k, v: 896 x 128; MLP: 3 x 896 x 4864) + the 151,936 x 896 head
    assert per_token == 24 * (2 * 896 * 896 + 2 * 896 * 128 + 3 * 896 * 4864) + 151_936 * 896


def test_tables_fraction_of_peak_and_decode_bound():
    per_token, total = matmul_params("tiny")
    sft = {
        "impl": "posttrain",
        "config": "sft_packed",
        "model": "tiny",
        "trainer": "sft",
        "median_step_s": 2.0,
        "median_step_cpu_s": 1.0,
        "tokens_per_step": 1000,
        "tokens_per_s": 500.0,
        "peak_rss_above_interpreter_mib": 30.0,
        "adam_floor_mib": 10.0,
    }
    grpo = {
        "impl": "trl",
        "config": "grpo",
        "model": "tiny",
        "trainer": "grpo",
        "median_step_s": 1.0,
        "median_step_cpu_s": 1.0,
        "tokens_per_step": 800,
        "generation_share": 0.5,
        "completions/mean_length": 32.0,
    }
    grpo_posttrain = {**grpo, "impl": "posttrain", "median_step_s": 4.0, "median_step_cpu_s": 0.5}
    text = tables([sft, grpo, grpo_posttrain, {"summary": True}], {"matmul_gflops": 100.0, "read_gbs": 10.0})
    first_table = text.split("Peak (one thread)")[0]
    # SFT: 6 P T FLOP in 1 s of CPU
    gflops = 6 * per_token * 1000 / 1e9
    assert f"| {gflops:.2f} | {gflops / 100:.1%} |" in text
    assert "| sft_packed | tiny | posttrain | 2.000 | 1.000 | 500 | 30 | 10 | 3.00 | 1 |" in first_table
    # GRPO: the loss's 16 x 32 completion tokens plus the two groups' prompts once each ((800 - 512) / 8 = 36
    # tokens, through the layers only) in the non-generation half second; each row generated 32 tokens in 0.5 s (64/s) against a floor of
    # the distinct prompts' prefill (no LM head) at the matmul peak plus 32 decode steps, each max(weight bytes / bandwidth,
    # 16 rows' matmuls / peak)
    train = (6 * per_token * (16 * 32 + 36) - 6 * 320 * 64 * 36) / 0.5 / 1e9  # no LM head (320 x 64) on prompts
    step_floor = max(4 * total / 10e9, 2 * per_token * 16 / 100e9)
    bound = 32 / (2 * (per_token - 320 * 64) * 36 / 100e9 + 32 * step_floor)
    assert (
        f"| grpo | tiny | trl | {train:.2f} | {train / 100:.1%} | 64.0 | {bound:.1f} | {64 / bound:.0%} "
        f"| {1 / step_floor:.1f} |"
    ) in text
    # the ratio table: posttrain / TRL of step CPU and wall; no RSS recorded, and SFT has no TRL row
    assert "| grpo | tiny | 0.50 | 4.00 | – |" in text
    assert "| sft_packed | tiny |" not in text.split("posttrain / TRL step CPU")[1]


def test_shared_prompt_prefix_is_the_chat_template_opening_and_system_prompt():
    # byte-level ChatML: <|im_start|> "system\n" SYSTEM_PROMPT <|im_end|> "\n" <|im_start|> "user\n" "What is "
    assert shared_prompt_prefix("grpo_long") == 1 + 7 + len(SYSTEM_PROMPT.encode()) + 1 + 1 + 1 + 5 + 8 == 437
    assert shared_prompt_prefix("grpo") == 1 + 5 + 8  # no system prompt: <|im_start|> "user\n" "What is "


def test_grpo_flops_count_the_shared_prefix_once():
    per_token, _ = matmul_params("tiny")
    grpo = {
        "impl": "posttrain",
        "config": "grpo",
        "model": "tiny",
        "trainer": "grpo",
        "median_step_s": 1.0,
        "median_step_cpu_s": 1.0,
        "tokens_per_step": 800,
        "generation_share": 0.5,
        "completions/mean_length": 32.0,
    }
    peak = {"matmul_gflops": 100.0, "read_gbs": 10.0}
    # 16 rows of (800 - 512) / 16 = 18 prompt tokens, 2 groups, 10 shared: 10 + 2 x 8 = 26 distinct prompt tokens
    train = (6 * per_token * (16 * 32 + 26) - 6 * 320 * 64 * 26) / 0.5 / 1e9
    assert f"| grpo | tiny | posttrain | {train:.2f} | {train / 100:.1%} |" in tables([grpo], peak, {"grpo": 10})
    # a prefix longer than the prompts is capped at the prompt: 18 tokens once
    train = (6 * per_token * (16 * 32 + 18) - 6 * 320 * 64 * 18) / 0.5 / 1e9
    assert f"| grpo | tiny | posttrain | {train:.2f} | {train / 100:.1%} |" in tables([grpo], peak, {"grpo": 50})


@pytest.mark.parametrize("threads", [1])
def test_machine_peak_reports_positive_rates(threads):
    out = measure(threads, repeats=1, matmul_n=(64,), stream_mib=8)
    assert out["matmul_gflops"] > 0 and out["read_gbs"] > 0 and out["copy_gbs"] > 0
    assert out["clock"] == "thread_time"
