"""posttrain's public surface against TRL 1.16's, recorded in tests/compat/trl_surface.json.

The JSON is written by ``benchmarks/trl_surface.py`` inside the TRL side venv (``bash benchmarks/setup_trl.sh``);
these tests need no TRL. Each TRL name must import from the same path with ``trl`` → ``posttrain``, each function
and trainer ``__init__`` must take TRL's parameters in TRL's order with TRL's defaults (posttrain may add
parameters after them), each config field and CLI option must exist with TRL's default. The only exceptions are
listed below with their reason: README's deliberate differences, and work another open issue is landing.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
from pathlib import Path

import pytest

from benchmarks.trl_surface import CONFIGS, cli_options, config_fields, jsonable, parameters

SURFACE = json.loads((Path(__file__).parent / "trl_surface.json").read_text())
POSTTRAIN = Path(__file__).resolve().parents[2] / "posttrain"

# README "Deliberate differences": key -> reason.
DELIBERATE = {
    "config:SFTConfig.loss_type": "README: SFT's `chunked_nll` is the default (None resolves to it); TRL 1.16's "
    "default `nll` computes the same loss without full logits, which posttrain's `chunked_nll` is.",
    "cli:sft:--loss_type": "as config:SFTConfig.loss_type",
    "cli:sft:--loss-type": "as config:SFTConfig.loss_type",
}
# Differences another open issue removes; drop the entry when it lands (the test then checks the TRL default).
PENDING = {
}
if not (POSTTRAIN / "experimental" / "bema_for_ref_model").exists():
    # trl.BEMACallback comes with posttrain.experimental.bema_for_ref_model (issue 22).
    for module in ("trl", "trl.trainer", "trl.trainer.callbacks"):
        PENDING[f"name:{module}.BEMACallback"] = "issue 22 (posttrain.experimental.bema_for_ref_model)"
EXCEPTIONS = {**DELIBERATE, **PENDING}


def posttrain_module(trl_module: str) -> str:
    return "posttrain" + trl_module[len("trl") :]


def test_surface_is_trl_1_16():
    assert SURFACE["trl_version"].startswith("1.16"), SURFACE["trl_version"]
    assert SURFACE["generated_by"] == "benchmarks/trl_surface.py"


@pytest.mark.parametrize("trl_module", sorted(SURFACE["names"]))
def test_public_names_import_from_the_same_path(trl_module):
    module = importlib.import_module(posttrain_module(trl_module))
    missing = [
        name
        for name in SURFACE["names"][trl_module]
        if f"name:{trl_module}.{name}" not in EXCEPTIONS and not hasattr(module, name)
    ]
    assert not missing, f"{posttrain_module(trl_module)} lacks TRL's {missing}"


def _compare_parameters(where: str, trl: list[dict], ours: list[dict]) -> list[str]:
    """TRL's positional parameters are a prefix of ours (names and defaults); its keyword-only and ``*args`` /
    ``**kwargs`` parameters exist in ours with the same kind and default."""
    problems = []
    positional = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")
    trl_pos = [p for p in trl if p["kind"] in positional]
    our_pos = [p for p in ours if p["kind"] in positional]
    for i, want in enumerate(trl_pos):
        got = our_pos[i] if i < len(our_pos) else None
        if got is None or got["name"] != want["name"]:
            problems.append(f"{where}: positional parameter {i} is {got and got['name']!r}, TRL: {want['name']!r}")
        elif got["default"] != want["default"]:
            problems.append(f"{where}({want['name']}=...): default {got['default']!r}, TRL: {want['default']!r}")
    by_name = {p["name"]: p for p in ours}
    by_kind = {p["kind"]: p for p in ours if p["kind"] in ("VAR_POSITIONAL", "VAR_KEYWORD")}
    for want in trl:
        if want["kind"] in positional:
            continue
        if want["kind"] in ("VAR_POSITIONAL", "VAR_KEYWORD"):
            if want["kind"] not in by_kind:
                problems.append(f"{where}: no {want['kind']} parameter (TRL: {want['name']})")
            continue
        got = by_name.get(want["name"])
        if got is None:
            problems.append(f"{where}: no parameter {want['name']!r}")
        elif got["default"] != want["default"]:
            problems.append(f"{where}({want['name']}=...): default {got['default']!r}, TRL: {want['default']!r}")
    return problems


def _our_function(key: str):
    """posttrain's function for TRL's ``module.name`` key, found through the modules that export it."""
    name = key.rsplit(".", 1)[1]
    for trl_module, names in SURFACE["names"].items():
        if name in names:
            module = importlib.import_module(posttrain_module(trl_module))
            if hasattr(module, name):
                return getattr(module, name)
    raise AssertionError(f"no posttrain module exports {name}")


@pytest.mark.parametrize("key", sorted(SURFACE["functions"]))
def test_function_signatures(key):
    if f"function:{key}" in EXCEPTIONS:
        pytest.skip(EXCEPTIONS[f"function:{key}"])
    fn = _our_function(key)
    assert inspect.isfunction(fn), f"{key}: posttrain's is {fn!r}, not a function"
    assert not _compare_parameters(key, SURFACE["functions"][key], parameters(fn))


@pytest.mark.parametrize("trainer", sorted(SURFACE["trainers"]))
def test_trainer_init_parameters(trainer):
    import posttrain

    ours = parameters(getattr(posttrain, trainer).__init__)
    assert not _compare_parameters(f"{trainer}.__init__", SURFACE["trainers"][trainer], ours)


def _our_config(name: str):
    module = "posttrain.scripts.utils" if CONFIGS[name] == "trl.scripts.utils" else "posttrain"
    return getattr(importlib.import_module(module), name)


@pytest.mark.parametrize("config", sorted(SURFACE["configs"]))
def test_config_fields_and_defaults(config):
    cls = _our_config(config)
    assert dataclasses.is_dataclass(cls)
    ours = config_fields(cls)
    problems = []
    for field, default in SURFACE["configs"][config].items():
        if f"config:{config}.{field}" in EXCEPTIONS:
            continue
        if field not in ours:
            problems.append(f"{config}.{field} is missing (TRL default {default!r})")
        elif ours[field] != default:
            problems.append(f"{config}.{field} defaults to {ours[field]!r}, TRL: {default!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("verb", sorted(SURFACE["cli"]))
def test_cli_options_and_defaults(verb):
    ours = cli_options(verb, package="posttrain")
    problems = []
    for option, default in SURFACE["cli"][verb].items():
        if f"cli:{verb}:{option}" in EXCEPTIONS:
            continue
        if option not in ours:
            problems.append(f"posttrain {verb}: no {option} (TRL default {default!r})")
        elif ours[option] != default:
            problems.append(f"posttrain {verb} {option} defaults to {ours[option]!r}, TRL: {default!r}")
    assert not problems, "\n".join(problems)


def test_exceptions_are_still_needed():
    """An allow-list entry whose difference is gone must be removed, so the check covers it again (also when the
    issue a PENDING entry waits for has landed)."""
    stale = []
    for key in EXCEPTIONS:
        kind, _, rest = key.partition(":")
        if kind == "config":
            config, field = rest.split(".")
            ours = config_fields(_our_config(config))
            if ours.get(field, object()) == SURFACE["configs"][config].get(field):
                stale.append(key)
        elif kind == "cli":
            verb, option = rest.split(":")
            if cli_options(verb, package="posttrain").get(option, object()) == SURFACE["cli"][verb].get(option):
                stale.append(key)
    assert not stale, f"remove these from DELIBERATE / PENDING: {stale}"


def test_jsonable_matches_the_dump_format():
    """The comparison serialises posttrain's defaults exactly as the dump serialised TRL's."""
    assert jsonable(inspect.Parameter.empty) == {"required": True}
    assert jsonable((None, None)) == [None, None]
    assert jsonable(float("inf")) == {"repr": "inf"}
    assert jsonable({"a": 1}) == {"a": 1}
