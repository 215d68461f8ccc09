"""``TrlParser``: dataclass arguments from flags and a YAML ``--config`` file, as TRL's scripts parse them.

YAML values become parser defaults, so explicit flags override them. An optional top-level ``env:`` mapping is
exported to ``os.environ``. Keys that match no dataclass field are returned (when the caller allows it, e.g. to hand
them to ``accelerate launch``) or rejected with the list of valid names and the closest match.

Parsing happens in two stages so a launcher can validate a command line without building the configs:
:meth:`TrlParser.parse_namespace_and_config` checks every flag and YAML key and returns an ``argparse.Namespace`` plus
the strings no dataclass claimed; :meth:`TrlParser.namespace_to_dataclasses` then builds the dataclasses (running
their ``__post_init__`` validation). :meth:`TrlParser.parse_args_and_config` does both, like TRL's.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import os
import re
import sys
import typing
from collections.abc import Iterable
from typing import Any, NoReturn

import yaml
from transformers import HfArgumentParser

import posttrain.legacy as legacy


class ConfigError(ValueError):
    """A recipe or command line that cannot be parsed: unreadable YAML, unknown keys, bad values."""


def _yaml_to_flags(key: str, value: Any) -> list[str]:
    """``key: value`` from a recipe as command-line strings (for keys handed on, e.g. to accelerate)."""
    if isinstance(value, bool):
        return [f"--{key}", str(value).lower()]
    if isinstance(value, (list, tuple)):
        return [f"--{key}", *[str(v) for v in value]]
    return [f"--{key}", str(value)]


def load_yaml_config(path: str) -> dict[str, Any]:
    """Read a recipe; errors say which file and why (missing, not YAML, not a mapping)."""
    if not os.path.exists(path):
        raise ConfigError(f"Config file {path!r} does not exist. Pass the path of a YAML recipe to --config.")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"Config file {path!r} is not valid YAML: {err}") from err
    except OSError as err:
        raise ConfigError(f"Config file {path!r} cannot be read: {err}") from err
    if not isinstance(data, dict):
        raise ConfigError(
            f"Config file {path} must contain a YAML mapping: `option: value` lines, got a {type(data).__name__}."
        )
    return data


def _pop_config_path(args: list[str]) -> str | None:
    """Remove ``--config PATH`` / ``--config=PATH`` from ``args`` (in place) and return PATH."""
    for idx, arg in enumerate(args):
        if arg == "--config":
            if idx + 1 >= len(args) or args[idx + 1].startswith("--"):
                raise ConfigError("--config needs the path of a YAML recipe, e.g. --config recipe.yaml.")
            path = args[idx + 1]
            del args[idx : idx + 2]
            return path
        if arg.startswith("--config="):
            del args[idx]
            return arg.split("=", 1)[1]
    return None


_SECTION = re.compile(r"^(Args|Arguments|Parameters|Attributes):\s*$")
_ENTRY = re.compile(r"^(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$")


def docstring_field_help(cls: type) -> dict[str, str]:
    """Field descriptions from the ``Args:`` / ``Parameters:`` sections of ``cls``'s docstrings (its MRO too).

    Used as ``--help`` text for fields without ``metadata["help"]``; both ``name: text`` and TRL's
    ``name (`type`, *optional*):`` + indented text are understood.
    """
    found: dict[str, str] = {}
    for klass in cls.__mro__:
        doc = klass.__dict__.get("__doc__")
        if not doc:
            continue
        lines = inspect.cleandoc(doc).splitlines()
        in_section, entry_indent, current = False, None, None
        for line in lines:
            stripped = line.strip()
            indent = len(line) - len(line.lstrip())
            if _SECTION.match(line):
                in_section, entry_indent, current = True, None, None
                continue
            if not in_section:
                continue
            if stripped and indent == 0:
                in_section, current = False, None
                continue
            if not stripped:
                continue
            if entry_indent is None:
                entry_indent = indent
            match = _ENTRY.match(stripped) if indent == entry_indent else None
            if match:
                current = match.group(1)
                if current not in found:
                    found[current] = match.group(3).strip()
                else:
                    current = None  # a subclass already documented it
            elif current is not None and indent > entry_indent:
                found[current] = (found[current] + " " + stripped).strip()
    return found


def _apply_defaults(parser: argparse.ArgumentParser, config: dict[str, Any]) -> set[str]:
    """Make ``config`` the defaults of ``parser``'s options and, recursively, of its subparsers' (as TRL); return the
    keys some option took. Values are converted with the option's type and checked against its choices."""
    claimed: set[str] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for subparser in action.choices.values():
                claimed |= _apply_defaults(subparser, config)
            continue
        if action.dest not in config or action.dest == "help":
            continue
        value = config[action.dest]
        if action.type is not None and value is not None and not isinstance(value, (list, dict, bool)):
            try:
                value = action.type(value)
            except (TypeError, ValueError, argparse.ArgumentTypeError) as err:
                raise ConfigError(f"Invalid value {value!r} for {action.dest!r} in the config file: {err}") from err
        if (
            action.choices is not None
            and value is not None
            and not isinstance(value, (list, dict))
            and value not in action.choices
            and str(value) not in {str(c) for c in action.choices}
        ):
            raise ConfigError(
                f"Invalid value {value!r} for {action.dest!r} in the config file; choose one of: "
                f"{', '.join(str(c) for c in action.choices)}."
            )
        action.default = value
        action.required = False
        claimed.add(action.dest)
    return claimed


class TrlParser(HfArgumentParser):
    """``HfArgumentParser`` with TRL's ``--config`` YAML handling and complete ``--help`` (defaults shown).

    Args:
        dataclass_types: Dataclasses to fill (e.g. ``(ScriptArguments, SFTConfig, ModelConfig)``).
        **kwargs: Passed to ``argparse.ArgumentParser`` (``prog``, ``description``, ``epilog``...).

    Bad values and unknown options raise :class:`ConfigError` (a one-paragraph message) instead of printing the full
    usage line and exiting. A field declared by several dataclasses (e.g. a script dataclass repeating a trainer
    config's field) is one option, registered by the first dataclass, whose value fills all of them. Keys of older
    TRL / transformers releases (``torch_dtype``, ``max_seq_length``, ``warmup_ratio`` ...) are mapped by
    :mod:`posttrain.legacy` with a ``FutureWarning``.
    """

    def __init__(self, dataclass_types: Iterable[type] | type | None = None, **kwargs):
        if dataclass_types is None:
            dataclass_types = []
        elif not isinstance(dataclass_types, (list, tuple)):
            dataclass_types = [dataclass_types]
        for dc in dataclass_types:
            if "config" in {f.name for f in dataclasses.fields(dc)}:
                raise ValueError(
                    f"Dataclass {dc.__name__} has a field named 'config'. This field is reserved for the config file "
                    "path and should not be used in the dataclass. Rename the field (--config names the YAML recipe)."
                )
        kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        if kwargs.get("prog"):
            # the default usage line would list all ~250 options
            kwargs.setdefault("usage", f"{kwargs['prog']} [--config RECIPE.yaml] [--OPTION VALUE ...]")
        # abbreviations would let an accelerate flag (e.g. --tpu) silently match a training option by prefix
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(dataclass_types, **kwargs)
        documented: dict[str, str] = {}
        for dc in dataclass_types:
            for name, text in docstring_field_help(dc).items():
                documented.setdefault(name, text)
        for action in self._actions:
            if action.dest == "help":
                continue
            if not (action.help or "").strip():
                # ArgumentDefaultsHelpFormatter only shows defaults for actions with some help text
                action.help = documented.get(action.dest) or " "
            # argparse %-formats help text; a literal % (e.g. "10%") would crash --help
            action.help = re.sub(r"(?<!%)%(?![(%])", "%%", action.help)
        self.add_argument("--config", type=str, default=None, help="Path to a YAML recipe; flags override it.")
        self.yaml_extra_keys: list[str] = []
        self._legacy_held: dict[str, Any] = {}

    def _add_dataclass_arguments(self, dtype: type) -> None:
        """One ``--help`` section per dataclass, titled with its name and the first line of its docstring."""
        title = getattr(dtype, "_argument_group_name", None) or f"{dtype.__name__} options"
        summary = inspect.cleandoc(dtype.__doc__ or "").split("\n\n")[0].replace("\n", " ") or None
        group = self.add_argument_group(title, description=summary)
        try:
            type_hints = typing.get_type_hints(dtype)
        except NameError as err:
            raise RuntimeError(f"Cannot resolve the field types of {dtype.__name__}: {err}") from err
        for fld in dataclasses.fields(dtype):
            if not fld.init:
                continue
            fld.type = type_hints[fld.name]
            self._parse_dataclass_field(group, fld)

    @staticmethod
    def _parse_dataclass_field(parser: argparse.ArgumentParser, field: dataclasses.Field) -> None:
        if f"--{field.name}" in parser._option_string_actions:
            return  # shared with an earlier dataclass: one option feeds both
        HfArgumentParser._parse_dataclass_field(parser, field)

    # ------------------------------------------------------------------------------------------------------------
    def error(self, message: str) -> NoReturn:
        """argparse's hook for bad values: raise instead of printing the (very long) usage and exiting."""
        raise ConfigError(f"{message}. Run `{self.prog} --help` for every option with its default.")

    def field_names(self) -> list[str]:
        """Every option name the dataclasses define (this parser's and its subparsers'), sorted."""
        names = {f.name for dc in self.dataclass_types for f in dataclasses.fields(dc) if f.init}
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for subparser in action.choices.values():
                    if isinstance(subparser, TrlParser):
                        names.update(subparser.field_names())
        return sorted(names)

    def set_defaults_with_config(self, **kwargs: Any) -> list[str]:
        """Make ``kwargs`` (e.g. a YAML recipe) the defaults of this parser and of its subparsers, as TRL's.

        Options given defaults stop being required. Values are converted with the option's type and checked
        against its choices, so a typo in a recipe fails here, naming the key. Returns the keys no parser claimed as
        TRL does: ``["--key", str(value), ...]``.
        """
        return [item for key, value in self._apply_config(kwargs) for item in (f"--{key}", str(value))]

    def _apply_config(self, config: dict[str, Any]) -> list[tuple[str, Any]]:
        """Set ``config`` as defaults (here and in every subparser); return the unclaimed ``(key, value)`` items."""
        claimed = _apply_defaults(self, config)
        return [(key, value) for key, value in config.items() if key not in claimed]

    def _read_config(self, args: list[str]) -> list[tuple[str, Any]]:
        """Pop ``--config PATH`` from ``args``, export its ``env:`` block, apply the rest as defaults; return the
        unclaimed items (empty without ``--config``)."""
        self.yaml_extra_keys = []
        config_path = _pop_config_path(args)
        if config_path is None:
            return []
        config = load_yaml_config(config_path)
        if "env" in config:
            env = config.pop("env")
            if not isinstance(env, dict):
                raise ConfigError(
                    f"`env` field should be a dict in the YAML file. In {config_path}, write `env:` followed by "
                    f"indented `NAME: value` lines (got {type(env).__name__} {env!r})."
                )
            os.environ.update({str(k): str(v) for k, v in env.items()})
        config, held = legacy.translate_recipe(self, config)  # older TRL / transformers keys
        self._legacy_held.update(held)
        extra = self._apply_config(config)
        self.yaml_extra_keys = [key for key, _ in extra]
        return extra

    def parse_namespace_and_config(self, args: Iterable[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
        """Check ``args`` (default ``sys.argv[1:]``) and the YAML named by ``--config``; build no dataclass.

        Returns the namespace of every option and the strings that matched no option: YAML keys first (as
        ``--key value``, YAML switches as ``true``/``false`` and lists spread, for ``accelerate launch``), then
        command-line strings, so a flag repeated on the command line wins over the recipe.
        """
        args = list(sys.argv[1:] if args is None else args)
        self._legacy_held = {}
        extra = [s for key, value in self._read_config(args) for s in _yaml_to_flags(key, value)]
        args, held = legacy.translate_argv(self, args)
        self._legacy_held.update(held)
        namespace, remaining = self.parse_known_args(args)
        if hasattr(namespace, "config"):
            delattr(namespace, "config")
        return namespace, extra + list(remaining)

    def namespace_to_dataclasses(self, namespace: argparse.Namespace) -> tuple:
        """One instance per dataclass type, in order; ``__post_init__`` errors become :class:`ConfigError`.

        As ``HfArgumentParser``, values no dataclass takes (a subparser's options and its ``dest``, arguments added
        with ``add_argument``) follow as one ``argparse.Namespace``.
        """
        values = dict(vars(namespace))
        outputs = []
        for dtype in self.dataclass_types:
            keys = {f.name for f in dataclasses.fields(dtype) if f.init}
            inputs = {k: v for k, v in values.items() if k in keys}
            try:
                inputs.update(legacy.held_kwargs(self, dtype, getattr(self, "_legacy_held", {})))
                outputs.append(dtype(**inputs))
            except (TypeError, ValueError) as err:
                if isinstance(err, ConfigError):
                    raise
                raise ConfigError(f"Invalid {dtype.__name__} options: {err}") from err
        legacy.link_model_configs(outputs)
        taken = {f.name for dtype in self.dataclass_types for f in dataclasses.fields(dtype) if f.init}
        leftover = {k: v for k, v in values.items() if k not in taken}
        if leftover:
            outputs.append(argparse.Namespace(**leftover))
        return tuple(outputs)

    def parse_args_and_config(
        self,
        args: Iterable[str] | None = None,
        return_remaining_strings: bool = False,
        fail_with_unknown_args: bool = True,
        separate_remaining_strings: bool = False,
    ) -> tuple:
        """Parse ``args`` (default ``sys.argv[1:]``) with the YAML named by ``--config`` as defaults, as TRL's.

        Values from the YAML become defaults (of subparsers too), command-line flags override them, and an ``env:``
        mapping is exported to ``os.environ``. Returns the dataclass instances (plus a ``Namespace`` of values no
        dataclass takes, e.g. a subparser's), then:

        - with ``return_remaining_strings``: the strings no option claimed, YAML keys first as
          ``["--key", str(value)]`` then the command line's (two lists, YAML's then the command line's, with
          ``separate_remaining_strings``);
        - otherwise unclaimed command-line strings raise :class:`ConfigError` (a ``ValueError``) starting "Some
          specified arguments are not used by the HfArgumentParser", and unclaimed YAML keys raise one starting
          "Unknown arguments from config file" unless ``fail_with_unknown_args=False``.
        """
        args = list(sys.argv[1:] if args is None else args)
        self._legacy_held = {}
        config_extra = self._read_config(args)
        args, held = legacy.translate_argv(self, args)  # older TRL / transformers flags
        self._legacy_held.update(held)
        config_remaining = [item for key, value in config_extra for item in (f"--{key}", str(value))]
        namespace, cli_remaining = self.parse_known_args(args)
        if hasattr(namespace, "config"):
            delattr(namespace, "config")
        outputs = self.namespace_to_dataclasses(namespace)
        if return_remaining_strings:
            if separate_remaining_strings:
                return (*outputs, config_remaining, list(cli_remaining))
            return (*outputs, config_remaining + list(cli_remaining))
        if cli_remaining:
            raise ConfigError(
                f"Some specified arguments are not used by the HfArgumentParser: {list(cli_remaining)}. "
                + self.unknown_args_message(list(cli_remaining))
            )
        if config_remaining and fail_with_unknown_args:
            raise ConfigError(
                f"Unknown arguments from config file: {config_remaining}. Please remove them, add them to the "
                "dataclass, or set `fail_with_unknown_args=False`. " + self.unknown_args_message(config_remaining)
            )
        return outputs

    def unknown_args_message(self, remaining: list[str]) -> str:
        """A one-paragraph error naming each unknown option, its closest valid name, and all valid names."""
        names = [s[2:].split("=")[0] for s in remaining if s.startswith("--")]
        valid = self.field_names()
        hints = []
        for name in dict.fromkeys(names or remaining):
            where = " (from the config file)" if name in self.yaml_extra_keys else ""
            close = difflib.get_close_matches(name.replace("-", "_"), valid, n=1)
            hints.append(f"{name!r}{where}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        return (
            f"Unknown argument(s): {', '.join(hints)}. Run `{self.prog} --help` for the full list; valid options are: "
            f"{', '.join(valid)}."
        )
