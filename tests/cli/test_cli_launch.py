"""Accelerate pass-through: recognising launch options, bundled presets, and choosing the launcher."""

from __future__ import annotations

import sys

import pytest
import yaml

from posttrain.cli.launch import (
    bundled_accelerate_configs,
    plan_launch,
    resolve_accelerate_config,
    split_launch_args,
    strip_launch_args,
)
from posttrain.cli.parser import ConfigError

SCRIPT = ["--model_name_or_path", "m", "--dataset_name", "d.jsonl"]


def test_split_launch_args_recognises_accelerate_options():
    launch, unknown = split_launch_args(
        [
            "--num_processes",
            "2",
            "--main_process_port=1234",
            "--mixed-precision",
            "bf16",
            "--cpu",
            "true",
            "--same_network",
            "false",
            "--accelerate_config",
            "zero2",
            "--num_machines",
            "1",
            "--machine_rank",
            "0",
            "--bogus",
            "3",
        ]
    )
    assert launch == [
        "--num_processes",
        "2",
        "--main_process_port",
        "1234",
        "--mixed-precision",
        "bf16",
        "--cpu",
        "--accelerate_config",
        "zero2",
        "--num_machines",
        "1",
        "--machine_rank",
        "0",
    ]
    assert unknown == ["--bogus", "3"]


def test_options_posttrain_sets_itself_are_not_launch_options():
    # the training script is always `-m posttrain.scripts.<verb>`
    _, unknown = split_launch_args(["--module", "--no_python"])
    assert unknown == ["--module", "--no_python"]


def test_launch_option_without_value_is_an_error():
    with pytest.raises(ConfigError, match="needs a value"):
        split_launch_args(["--num_processes"])


def test_strip_launch_args_keeps_options_the_training_config_owns():
    argv = ["--gradient_accumulation_steps", "4", "--num_processes", "2", "--cpu", "--max_steps", "1"]
    assert strip_launch_args(argv, {"--gradient_accumulation_steps", "--max_steps"}) == [
        "--gradient_accumulation_steps",
        "4",
        "--max_steps",
        "1",
    ]


def test_bundled_presets_exist_parse_and_explain_themselves():
    presets = bundled_accelerate_configs()
    assert {"single_gpu", "multi_gpu", "zero1", "zero2", "zero3", "fsdp1", "fsdp2"} <= set(presets)
    from accelerate.commands.config.config_args import load_config_from_file

    for name, path in presets.items():
        text = path.read_text()
        assert text.startswith("#"), f"{name}: first line must be a comment saying when to use it"
        data = yaml.safe_load(text)
        config = load_config_from_file(str(path))
        assert config.num_processes == data["num_processes"]
    assert yaml.safe_load(presets["zero3"].read_text())["deepspeed_config"]["zero_stage"] == 3
    assert yaml.safe_load(presets["fsdp2"].read_text())["fsdp_config"]["fsdp_version"] == 2


def test_resolve_accelerate_config(tmp_path):
    assert resolve_accelerate_config("zero3").endswith("accelerate_configs/zero3.yaml")
    own = tmp_path / "mine.yaml"
    own.write_text("num_processes: 2\n")
    assert resolve_accelerate_config(str(own)) == str(own)
    with pytest.raises(ConfigError, match="Presets: .*zero3"):
        resolve_accelerate_config("zero4")


def test_one_process_runs_in_process():
    plan = plan_launch("sft", [], SCRIPT, cuda_devices=0)
    assert plan.launcher == "inprocess" and plan.command == [] and plan.num_processes == 1
    plan = plan_launch("sft", ["--num_processes", "1", "--mixed_precision", "bf16"], SCRIPT, cuda_devices=1)
    assert plan.launcher == "inprocess" and plan.env["ACCELERATE_MIXED_PRECISION"] == "bf16"


def test_several_processes_without_cuda_use_torchrun():
    plan = plan_launch("grpo", ["--num_processes", "2"], SCRIPT, cuda_devices=0)
    assert plan.launcher == "torchrun" and plan.num_processes == 2
    cmd = plan.command
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert cmd[cmd.index("--nproc_per_node") + 1] == "2"
    assert int(cmd[cmd.index("--master_port") + 1]) > 0
    assert cmd[cmd.index("-m", 3) + 1] == "posttrain.scripts.grpo" and cmd[-len(SCRIPT) :] == SCRIPT
    assert plan.env["ACCELERATE_USE_CPU"] == "true" and plan.env["POSTTRAIN_LAUNCHED"] == "1"


def test_multi_machine_cpu_run_maps_accelerate_options_to_torchrun():
    plan = plan_launch(
        "sft",
        ["--num_processes", "4", "--num_machines", "2", "--machine_rank", "1"]
        + ["--main_process_ip", "10.0.0.1", "--main_process_port", "29501"],
        SCRIPT,
        cuda_devices=0,
    )
    cmd = plan.command
    for opt, value in [("--nproc_per_node", "2"), ("--nnodes", "2"), ("--node_rank", "1")]:
        assert cmd[cmd.index(opt) + 1] == value
    assert cmd[cmd.index("--master_addr") + 1] == "10.0.0.1" and cmd[cmd.index("--master_port") + 1] == "29501"


def test_multi_machine_needs_the_main_process_address():
    with pytest.raises(ConfigError, match="--main_process_ip"):
        plan_launch("sft", ["--num_machines", "2", "--num_processes", "4"], SCRIPT, cuda_devices=0)


def test_cuda_uses_accelerate_launch_with_the_preset():
    plan = plan_launch("dpo", ["--accelerate_config", "zero3", "--num_processes", "4"], SCRIPT, cuda_devices=8)
    assert plan.launcher == "accelerate" and plan.num_processes == 4
    cmd = plan.command
    assert cmd[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert cmd[cmd.index("--config_file") + 1].endswith("zero3.yaml")
    assert "--accelerate_config" not in cmd  # accelerate does not know it
    assert cmd[cmd.index("-m", 3) + 1] == "posttrain.scripts.dpo"


def test_process_count_defaults_like_accelerate():
    # no flag: the config file's num_processes, else every visible GPU
    assert plan_launch("sft", ["--accelerate_config", "multi_gpu"], SCRIPT, cuda_devices=8).num_processes == 8
    assert plan_launch("sft", [], SCRIPT, cuda_devices=4).num_processes == 4
    # DeepSpeed needs accelerate's launcher even for one process
    assert plan_launch("sft", ["--use_deepspeed"], SCRIPT, cuda_devices=1).launcher == "accelerate"


def test_invalid_launch_values_are_config_errors():
    with pytest.raises(ConfigError, match="Invalid launch option"):
        plan_launch("sft", ["--num_processes", "two"], SCRIPT, cuda_devices=0)
    with pytest.raises(ConfigError, match="either --accelerate_config or --config_file"):
        plan_launch("sft", ["--accelerate_config", "zero2", "--config_file", "x.yaml"], SCRIPT, cuda_devices=0)
