"""Reward functions by name: the ``--reward_funcs`` registry and its resolver.

``REWARD_FUNCS`` maps TRL's CLI names to ready-to-use callables (factories instantiated with TRL's CLI defaults,
e.g. ``get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)``) plus ``code_reward``.
``REWARD_FACTORIES`` maps the names that take arguments to the functions that build them, so YAML and the command
line can write ``get_cosine_scaled_reward(max_len=1024)`` or ``{"name": ..., "kwargs": {...}}``.

:func:`resolve_reward_func` turns one spec into a callable: a callable or model passes through; a registry name; a
``name(key=value, ...)`` string or a dict with arguments; or a dotted import path ``pkg.module.func`` (also
``pkg.module:func``) imported with the current directory on ``sys.path``, which is how a user's own file plugs in.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from posttrain.registry import Registry
from posttrain.rewards.accuracy import accuracy_reward, get_cosine_scaled_reward, reasoning_accuracy_reward
from posttrain.rewards.code import code_reward, get_code_reward
from posttrain.rewards.format import think_format_reward
from posttrain.rewards.shaping import get_repetition_penalty_reward, get_soft_overlong_punishment

REWARD_FUNCS: Registry[Callable[..., Any]] = Registry("reward function")
REWARD_FUNCS.add("accuracy_reward", accuracy_reward)
REWARD_FUNCS.add("reasoning_accuracy_reward", reasoning_accuracy_reward)
REWARD_FUNCS.add("think_format_reward", think_format_reward)
REWARD_FUNCS.add(
    "get_soft_overlong_punishment", get_soft_overlong_punishment(max_completion_len=1280, soft_punish_cache=256)
)
REWARD_FUNCS.add("get_repetition_penalty_reward", get_repetition_penalty_reward())
REWARD_FUNCS.add("code_reward", code_reward)

REWARD_FACTORIES: Registry[Callable[..., Any]] = Registry("reward function factory")
REWARD_FACTORIES.add("get_soft_overlong_punishment", get_soft_overlong_punishment)
REWARD_FACTORIES.add("get_repetition_penalty_reward", get_repetition_penalty_reward)
REWARD_FACTORIES.add("get_cosine_scaled_reward", get_cosine_scaled_reward)
REWARD_FACTORIES.add("code_reward", get_code_reward)


class BoundReward:
    """A reward function with some keyword arguments fixed, e.g. ``reasoning_accuracy_reward(reasoning_delimiters=[...])``.

    A class rather than ``functools.partial`` so it keeps the function's ``__name__`` (the metric key) and pickles
    whenever the function does.
    """

    def __init__(self, func: Callable[..., Any], **kwargs: Any):
        self.func = func
        self.kwargs = kwargs
        self.__name__ = getattr(func, "__name__", type(func).__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.func(*args, **{**kwargs, **self.kwargs})

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.__name__}({args})"


def _unknown(name: str) -> ValueError:
    names = sorted(set(REWARD_FUNCS.names()) | set(REWARD_FACTORIES.names()))
    return ValueError(
        f"Unknown reward function {name!r}. Valid names: {', '.join(names)}. To use your own function, pass its "
        "dotted import path, e.g. 'my_rewards.my_reward_func' for a function my_reward_func in my_rewards.py in the "
        "current directory (or any importable 'pkg.module.func'); factories take arguments as "
        "'pkg.module.make_reward(key=value)'."
    )


def _parse_call(spec: str) -> tuple[str, tuple, dict[str, Any]]:
    """``"name(1, key='v')"`` → ``("name", (1,), {"key": "v"})``; arguments must be Python literals."""
    try:
        node = ast.parse(spec, mode="eval").body
    except SyntaxError as e:
        raise ValueError(f"Cannot parse reward function spec {spec!r}: {e.msg}. Write name(key=value, ...).") from None
    if not isinstance(node, ast.Call):
        raise ValueError(f"Cannot parse reward function spec {spec!r}; write name(key=value, ...).")
    name = _dotted_name(node.func)
    if name is None:
        raise ValueError(f"Reward function spec {spec!r} must start with a name or dotted path before '('.")
    try:
        args = tuple(ast.literal_eval(a) for a in node.args)
        kwargs = {}
        for kw in node.keywords:
            if kw.arg is None:
                raise ValueError("** unpacking is not supported")
            kwargs[kw.arg] = ast.literal_eval(kw.value)
    except ValueError as e:
        raise ValueError(
            f"Arguments of reward function spec {spec!r} must be Python literals (numbers, strings, lists, dicts, "
            f"True/False/None): {e}."
        ) from None
    return name, args, kwargs


def _dotted_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _import_dotted(path: str) -> Any:
    """Import ``pkg.module.attr`` or ``pkg.module:attr`` with the current directory importable."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)
    if ":" in path:
        module_name, _, attr_path = path.partition(":")
        candidates = [(module_name, attr_path.split("."))]
    else:
        parts = path.split(".")
        candidates = [(".".join(parts[:i]), parts[i:]) for i in range(len(parts) - 1, 0, -1)]
    for module_name, attrs in candidates:
        try:
            obj = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # Only a missing module *on the path we are trying* means "try a shorter module"; a missing dependency
            # inside the user's module is a real error and must surface.
            if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
                continue
            raise
        try:
            for attr in attrs:
                obj = getattr(obj, attr)
        except AttributeError:
            raise ValueError(
                f"Module {module_name!r} has no attribute {'.'.join(attrs)!r} (from reward function spec {path!r})."
            ) from None
        return obj
    raise _unknown(path)


def _build(name: str, args: tuple, kwargs: dict[str, Any] | None) -> Any:
    if kwargs is None:
        if name in REWARD_FUNCS:
            return REWARD_FUNCS.get(name)
        if name in REWARD_FACTORIES:
            raise ValueError(
                f"Reward function {name!r} needs arguments: write e.g. '{name}(max_len=1024)' on the command line "
                f"or {{'name': '{name}', 'kwargs': {{...}}}} in YAML. Signature: "
                f"{name}{inspect.signature(REWARD_FACTORIES.get(name))}."
            )
    else:
        target = None
        if name in REWARD_FACTORIES:
            target, is_factory = REWARD_FACTORIES.get(name), True
        elif name in REWARD_FUNCS:
            target, is_factory = REWARD_FUNCS.get(name), False
        if target is not None:
            try:
                return target(*args, **kwargs) if is_factory else BoundReward(target, **kwargs)
            except TypeError as e:
                raise ValueError(f"Bad arguments for reward function {name!r}: {e}.") from None
    if "." in name or ":" in name:
        obj = _import_dotted(name)
        if kwargs is not None:
            obj = obj(*args, **kwargs)  # a dotted path with arguments names a factory
        if not callable(obj):
            raise ValueError(f"{name!r} resolved to {type(obj).__name__} {obj!r:.100}, which is not callable.")
        return obj
    raise _unknown(name)


def resolve_reward_func(spec: Any) -> Any:
    """Turn one reward spec into a callable (or pass a model / callable through).

    Args:
        spec: One of
            - a callable or ``torch.nn.Module`` (returned unchanged);
            - a registry name: ``"accuracy_reward"``, ``"get_soft_overlong_punishment"``, ...;
            - a name with arguments: ``"get_cosine_scaled_reward(max_len=1024)"`` (literal values);
            - a dict ``{"name": ..., "kwargs": {...}}`` or ``{"name": ..., key: value, ...}``;
            - a dotted path ``"pkg.module.func"`` / ``"pkg.module:func"``, imported with the current directory on
              ``sys.path``; with arguments (``"pkg.module.make(k=1)"``) the imported object is called as a factory.

    Raises:
        ValueError: for an unknown name (listing the valid names and explaining dotted paths) or bad arguments.
    """
    if isinstance(spec, Mapping):
        if "name" not in spec:
            raise ValueError(f"A reward function given as a dict needs a 'name' key, got {dict(spec)!r:.200}.")
        kwargs = dict(spec.get("kwargs") or {})
        kwargs.update({k: v for k, v in spec.items() if k not in ("name", "kwargs")})
        return _build(str(spec["name"]).strip(), (), kwargs)
    if isinstance(spec, str):
        text = spec.strip()
        if text.endswith(")") and "(" in text:
            name, args, kwargs = _parse_call(text)
            return _build(name, args, kwargs)
        return _build(text, (), None)
    if callable(spec):
        return spec
    raise TypeError(
        f"A reward function must be a callable, a model, a registry name, a dotted path or a dict; got "
        f"{type(spec).__name__}: {spec!r:.100}."
    )


def resolve_reward_funcs(specs: Any) -> list[Any]:
    """:func:`resolve_reward_func` over a list (a single spec is wrapped; ``None`` gives ``[]``)."""
    if specs is None:
        return []
    if isinstance(specs, (str, Mapping)) or callable(specs):
        specs = [specs]
    return [resolve_reward_func(s) for s in specs]
