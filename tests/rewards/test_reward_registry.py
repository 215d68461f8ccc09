"""The ``--reward_funcs`` registry: names, CLI defaults, arguments from YAML/CLI, dotted paths, errors."""

from __future__ import annotations

import pickle
import sys

import pytest

from posttrain.rewards import (
    REWARD_FACTORIES,
    REWARD_FUNCS,
    BoundReward,
    CodeReward,
    CosineScaledReward,
    SoftOverlongPunishment,
    accuracy_reward,
    code_reward,
    reasoning_accuracy_reward,
    resolve_reward_func,
    resolve_reward_funcs,
    think_format_reward,
)


def test_registry_names_and_cli_defaults():
    assert {
        "accuracy_reward",
        "reasoning_accuracy_reward",
        "think_format_reward",
        "get_soft_overlong_punishment",
        "get_repetition_penalty_reward",
        "code_reward",
    } <= set(REWARD_FUNCS.names())
    overlong = REWARD_FUNCS.get("get_soft_overlong_punishment")
    assert isinstance(overlong, SoftOverlongPunishment)
    assert (overlong.max_completion_len, overlong.soft_punish_cache) == (1280, 256)
    assert overlong.__name__ == "soft_overlong_punishment_reward"
    assert "get_cosine_scaled_reward" in REWARD_FACTORIES


def test_resolve_names_and_callables():
    assert resolve_reward_func("accuracy_reward") is accuracy_reward
    assert resolve_reward_func(" think_format_reward ") is think_format_reward
    assert resolve_reward_func("code_reward") is code_reward

    def mine(completions, **kwargs):
        return [0.0] * len(completions)

    assert resolve_reward_func(mine) is mine
    assert resolve_reward_funcs(["accuracy_reward", mine]) == [accuracy_reward, mine]
    assert resolve_reward_funcs("think_format_reward") == [think_format_reward]
    assert resolve_reward_funcs(None) == []


def test_resolve_factories_with_arguments():
    cosine = resolve_reward_func("get_cosine_scaled_reward(max_len=64, min_value_wrong=-2.0)")
    assert isinstance(cosine, CosineScaledReward) and (cosine.max_len, cosine.min_value_wrong) == (64, -2.0)
    from_yaml = resolve_reward_func(
        {"name": "get_soft_overlong_punishment", "kwargs": {"max_completion_len": 10}, "soft_punish_cache": 2}
    )
    assert (from_yaml.max_completion_len, from_yaml.soft_punish_cache) == (10, 2)
    code = resolve_reward_func("code_reward(timeout=2.5, max_workers=1)")
    assert isinstance(code, CodeReward) and code.timeout == 2.5 and code.__name__ == "code_reward"


def test_plain_function_with_arguments_becomes_a_picklable_bound_reward():
    bound = resolve_reward_func("reasoning_accuracy_reward(reasoning_delimiters=['[END]'])")
    assert isinstance(bound, BoundReward) and bound.__name__ == "reasoning_accuracy_reward"
    assert bound.func is reasoning_accuracy_reward
    assert bound(completions=[r"x [END] \boxed{2}"], solution=["2"]) == [1.0]
    clone = pickle.loads(pickle.dumps(bound))
    assert clone.kwargs == {"reasoning_delimiters": ["[END]"]}


def test_dotted_paths_are_imported_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "my_rewards_mod.py").write_text(
        "def composite_reward(completions, **kwargs):\n"
        "    return [float(len(c)) for c in completions]\n"
        "def make_reward(scale=1.0):\n"
        "    def scaled(completions, **kwargs):\n"
        "        return [scale] * len(completions)\n"
        "    return scaled\n"
    )
    (tmp_path / "broken_rewards_mod.py").write_text("import a_dependency_that_is_not_installed\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    for name in ("my_rewards_mod", "broken_rewards_mod"):
        monkeypatch.delitem(sys.modules, name, raising=False)

    func = resolve_reward_func("my_rewards_mod.composite_reward")
    assert func(completions=["ab", "c"]) == [2.0, 1.0]
    assert resolve_reward_func("my_rewards_mod:composite_reward") is func
    assert resolve_reward_func("my_rewards_mod.make_reward(scale=3.0)")(completions=["x"]) == [3.0]
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        resolve_reward_func("my_rewards_mod.missing")
    # A missing dependency *inside* the user's module surfaces as itself, not as "unknown reward".
    with pytest.raises(ModuleNotFoundError, match="a_dependency_that_is_not_installed"):
        resolve_reward_func("broken_rewards_mod.anything")


def test_unknown_names_list_the_registry_and_explain_dotted_paths():
    with pytest.raises(ValueError) as info:
        resolve_reward_func("acuracy_reward")
    message = str(info.value)
    assert "Unknown reward function 'acuracy_reward'" in message
    assert "accuracy_reward" in message and "get_cosine_scaled_reward" in message
    assert "dotted import path" in message
    with pytest.raises(ValueError, match="Unknown reward function 'no_such_pkg.func'"):
        resolve_reward_func("no_such_pkg.func")


def test_argument_errors_are_explained():
    with pytest.raises(ValueError, match=r"needs arguments.*get_cosine_scaled_reward\(max_len=1024\)"):
        resolve_reward_func("get_cosine_scaled_reward")
    with pytest.raises(ValueError, match="Bad arguments for reward function 'get_cosine_scaled_reward'"):
        resolve_reward_func("get_cosine_scaled_reward(max_length=3)")
    with pytest.raises(ValueError, match="must be Python literals"):
        resolve_reward_func("get_cosine_scaled_reward(max_len=some_variable)")
    with pytest.raises(ValueError, match="needs a 'name' key"):
        resolve_reward_func({"kwargs": {}})
    with pytest.raises(TypeError, match="must be a callable"):
        resolve_reward_func(3)
