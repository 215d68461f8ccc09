"""Grading of assert-style tests in the trusted parent: only the calls of the solution go into the sandbox.

Each test statement is parsed with :mod:`ast`. Every maximal sub-expression that needs the solution (a call of, or
a reference to, a name the test itself does not define: ``f(3)``, ``Solution().two_sum([2, 7], 9)``) is replaced by
a placeholder and its source shipped to the sandbox; the rest of the assertion (the comparison, the expected value,
``abs``/``sorted``/``len``/``math.isclose`` around the calls) stays here. The sandbox runs the solution, evaluates
the shipped expressions and returns each value as strict JSON built from plain types only (``None``, ``bool``,
``int``, ``float``, ``str``, ``bytes``, ``complex``, ``list``, ``tuple``, ``set``, ``frozenset``, ``dict``; anything else
is an error). The parent decodes them into fresh built-in objects and evaluates the assertion with a small
interpreter (:class:`_Evaluator`) that knows only those types and a fixed set of pure functions. So the expected
values never enter the sandbox, nothing printed or returned there can claim "passed", and an object with a forged
``__eq__``, a patched ``compile`` or a shadowed ``len`` in the solution changes nothing here.

Statements that are not tests run in the sandbox as setup (imports, helper definitions, assignments the shipped
calls refer to). HumanEval-style ``def check(candidate): assert candidate(...) == ...`` followed by ``check(f)`` is
inlined (the ``def`` never enters the sandbox); ``for`` loops and comprehensions over values the test defines are
unrolled (``all(f(i) == i for i in range(3))`` ships ``f(0)``, ``f(1)``, ``f(2)``). An assertion that cannot be
graded this way (an ``assert`` inside ``while``/``if``/``with``, a filter or loop over the solution's values that
needs the solution inside, a test-side expression that would have to run in the sandbox) counts as a failed test
and is logged.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import operator
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

_MAX_LEN = 1_000_000  # largest sequence the parent-side evaluator builds
_MAX_EXPONENT = 10_000

_SAFE_FUNCTIONS: dict[str, Any] = {
    f.__name__: f
    for f in (
        abs, all, any, bool, bytes, chr, complex, dict, divmod, enumerate, float, frozenset, int, isinstance, len,
        list, max, min, ord, range, repr, reversed, round, set, sorted, str, sum, tuple, zip,
    )
}  # fmt: skip
_MATH_NAMES = {
    "isclose", "isnan", "isinf", "isfinite", "fabs", "sqrt", "floor", "ceil", "trunc", "gcd", "log", "log2",
    "log10", "exp", "pi", "e", "inf", "nan", "tau", "comb", "factorial", "prod", "fsum", "hypot",
}  # fmt: skip
_BINARY = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.LShift: operator.lshift,
    ast.RShift: operator.rshift, ast.BitOr: operator.or_, ast.BitAnd: operator.and_, ast.BitXor: operator.xor,
}  # fmt: skip
_UNARY = {ast.Not: operator.not_, ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}
_COMPARE = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
    ast.GtE: operator.ge, ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b,
    ast.Is: operator.is_, ast.IsNot: operator.is_not,
}  # fmt: skip
_PLAIN_TYPES = (type(None), bool, int, float, complex, str, bytes, list, tuple, set, frozenset, dict, range)


class Ungradable(Exception):
    pass


@dataclass
class Plan:
    """What to run in the sandbox and how to grade its answers."""

    ops: list[dict] = field(default_factory=list)  # {"x": source} (exec) or {"e": source, "k": index} (eval)
    tests: list[ast.expr | None] = field(default_factory=list)  # None: ungradable, counts as failed
    env: dict[str, Any] = field(default_factory=dict)  # names the tests themselves bind (literal assignments)

    @property
    def shipped(self) -> int:
        return sum(1 for op in self.ops if "e" in op)


class _Lowering(ast.NodeTransformer):
    """Replaces the solution-dependent parts of one expression by ``__sb_<k>`` placeholders."""

    def __init__(self, known: set[str], plan: Plan, test_bound: set[str], safe_calls: set[str]):
        self.known = known
        self.plan = plan
        self.test_bound = test_bound
        self.safe_calls = safe_calls
        self.scopes: list[set[str]] = []

    def _local(self, name: str) -> bool:
        return any(name in scope for scope in self.scopes)

    def dependent(self, node: ast.AST) -> bool:
        return any(
            isinstance(n, ast.Name) and n.id not in self.known and not self._local(n.id) for n in ast.walk(node)
        )

    def ship(self, node: ast.expr) -> ast.expr:
        if any(isinstance(n, ast.Name) and self._local(n.id) for n in ast.walk(node)):
            raise Ungradable("a solution call refers to a variable bound inside the test")
        if not (_names(node) - self.test_bound - self.known):
            raise Ungradable("a part of the test that does not use the solution would be computed in the sandbox")
        index = len(self.plan.ops)
        self.plan.ops.append({"e": ast.unparse(node), "k": index})
        return ast.copy_location(ast.Name(id=f"__sb_{index}", ctx=ast.Load()), node)

    def visit(self, node):
        if isinstance(node, ast.expr) and not self.dependent(node):
            return node
        return super().visit(node)

    def visit_Name(self, node):
        return self.ship(node)

    def visit_Attribute(self, node):
        return self.ship(node)

    def visit_Call(self, node):
        func = node.func
        safe = (isinstance(func, ast.Name) and func.id in self.safe_calls and func.id in self.known) or (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "math"
            and "math" in self.known
        )
        if not safe:
            return self.ship(node)
        return self.generic_visit(node)

    def visit_Lambda(self, node):
        self.scopes.append({a.arg for a in node.args.args})
        try:
            return self.generic_visit(node)
        finally:
            self.scopes.pop()

    def _comprehension(self, node):
        scope: set[str] = set()
        self.scopes.append(scope)
        try:
            for gen in node.generators:
                gen.iter = self.visit(gen.iter)
                scope.update(n.id for n in ast.walk(gen.target) if isinstance(n, ast.Name))
                gen.ifs = [self.visit(cond) for cond in gen.ifs]
            for name in ("elt", "key", "value"):
                if hasattr(node, name):
                    setattr(node, name, self.visit(getattr(node, name)))
            return node
        finally:
            self.scopes.pop()

    visit_ListComp = visit_SetComp = visit_GeneratorExp = visit_DictComp = _comprehension

    def generic_visit(self, node):
        if isinstance(node, (ast.NamedExpr, ast.Await, ast.Yield, ast.YieldFrom, ast.Starred)):
            raise Ungradable(f"{type(node).__name__} in a test")
        return super().generic_visit(node)


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}


def plan_tests(statements: list[str]) -> Plan:
    """Parse assert-style test statements into sandbox operations and parent-side checks."""
    plan = Plan()
    known = set(_SAFE_FUNCTIONS) | {"math"}
    safe_calls = set(_SAFE_FUNCTIONS)
    test_bound: set[str] = set()  # names the tests' own setup binds in the sandbox
    nodes: list[ast.stmt] = []
    for text in statements:
        try:
            nodes.extend(ast.parse(text).body)
        except SyntaxError:
            plan.tests.append(None)
            _log_once(f"unparseable test: {text[:80]!r}")
    checks = {n.name: n for n in nodes if isinstance(n, ast.FunctionDef) and _is_check(n, nodes)}
    pending_assigns: list[tuple[int, ast.stmt, set[str]]] = []  # literal assignments, shipped only if used

    def add_assert(node: ast.Assert) -> None:
        mark = len(plan.ops)
        try:
            test = _Unroll(known, plan.env).visit(ast.parse(ast.unparse(node.test), mode="eval")).body
            lowered = _Lowering(known, plan, test_bound, safe_calls).visit(ast.Expression(body=test)).body
            plan.tests.append(lowered)
        except Ungradable as e:
            del plan.ops[mark:]
            plan.tests.append(None)
            _log_once(f"test graded as failed, it cannot be checked outside the sandbox ({e}): {ast.unparse(node)}")

    def add_statement(node: ast.stmt) -> None:
        if isinstance(node, ast.Assert):
            add_assert(node)
        elif isinstance(node, ast.FunctionDef) and node.name in checks:
            return  # inlined where it is called; its body (with the expected values) never enters the sandbox
        elif isinstance(node, ast.Expr) and _check_call(node, checks):
            check = checks[node.value.func.id]
            mapping = {p.arg: a for p, a in zip(check.args.args, node.value.args)}
            for inner in check.body:
                if isinstance(inner, ast.Expr) and isinstance(inner.value, ast.Constant):
                    continue  # docstring
                add_statement(_substitute(inner, mapping))
        elif isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            targets = {t.id for t in node.targets}
            if not (_names(node.value) - known):
                try:
                    value = _Evaluator(plan.env).eval(node.value)
                except Exception:  # noqa: BLE001 -- not evaluable here: it becomes sandbox setup
                    value = _MISSING
                if value is not _MISSING:
                    for name in targets:
                        plan.env[name] = value
                    known.update(targets)
                    pending_assigns.append((len(plan.ops), node, targets))
                    return
            known.difference_update(targets)
            test_bound.update(targets)
            for name in targets:
                plan.env.pop(name, None)
            plan.ops.append({"x": ast.unparse(node)})
        elif isinstance(node, ast.For) and not node.orelse and not (_names(node.iter) - known):
            try:  # for x in <a value the test itself defines>: unrolled, one test per assert and iteration
                items = _items(_Evaluator(plan.env).eval(node.iter))
            except Exception as e:  # noqa: BLE001
                plan.tests.append(None)
                _log_once(f"loop over {ast.unparse(node.iter)} cannot be unrolled ({e}); counted as failed")
                return
            for item in items:
                mapping: dict[str, ast.expr] = {}
                try:
                    _bind_literals(node.target, item, mapping)
                except Ungradable:
                    plan.tests.append(None)
                    return
                for inner in node.body:
                    add_statement(_substitute(inner, mapping))
        elif any(isinstance(n, ast.Assert) for n in ast.walk(node)):
            plan.tests.append(None)
            _log_once(f"asserts inside {type(node).__name__} cannot be graded outside the sandbox; counted as failed")
        else:
            if isinstance(node, ast.ImportFrom) and node.module == "math" and node.level == 0:
                for alias in node.names:  # from math import isclose: evaluated here, with the real math
                    if alias.name in _MATH_NAMES:
                        plan.env[alias.asname or alias.name] = getattr(math, alias.name)
                        known.add(alias.asname or alias.name)
                        safe_calls.add(alias.asname or alias.name)
            else:
                for name in _bound_names(node):
                    if not (name == "math" and isinstance(node, ast.Import)):
                        known.discard(name)
                        test_bound.add(name)
            plan.ops.append({"x": ast.unparse(node)})

    for node in nodes:
        add_statement(node)
    used = set().union(*(_names(ast.parse(op.get("e") or op["x"])) for op in plan.ops)) if plan.ops else set()
    for position, node, targets in reversed(pending_assigns):
        if targets & used:
            plan.ops.insert(position, {"x": ast.unparse(node)})
    return plan


_MAX_UNROLL = 1000


def _items(iterable: Any) -> list:
    items = []
    for item in iterable:
        items.append(item)
        if len(items) > _MAX_UNROLL:
            raise Ungradable(f"more than {_MAX_UNROLL} iterations")
    return items


def _literal(value: Any) -> ast.expr:
    """An AST literal for a plain value (round-trip checked), or Ungradable."""
    try:
        node = ast.parse(repr(value), mode="eval").body
        if ast.literal_eval(node) == value and type(ast.literal_eval(node)) is type(value):
            return node
    except (SyntaxError, ValueError, RecursionError):
        pass
    raise Ungradable(f"cannot write {type(value).__name__} as a literal")


def _bind_literals(target: ast.AST, value: Any, mapping: dict[str, ast.expr]) -> None:
    if isinstance(target, ast.Name):
        mapping[target.id] = _literal(value)
    elif isinstance(target, (ast.Tuple, ast.List)):
        values = list(value)
        if len(values) != len(target.elts):
            raise Ungradable("unpacking mismatch")
        for t, v in zip(target.elts, values):
            _bind_literals(t, v, mapping)
    else:
        raise Ungradable("complex loop target")


class _Unroll(ast.NodeTransformer):
    """``all(f(i) == i * i for i in range(3))`` -> ``all((f(0) == 0 * 0, f(1) == 1 * 1, f(2) == 2 * 2))``: a
    comprehension over values the test defines, whose element needs the solution, becomes a literal display, so
    each solution call can be shipped on its own and each comparison stays in the parent."""

    def __init__(self, known: set[str], env: dict[str, Any]):
        self.known = known
        self.env = env

    def _unroll(self, node, make):
        node = self.generic_visit(node)
        scope = {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        element = [node.elt] if hasattr(node, "elt") else [node.key, node.value]
        needs_solution = any(
            isinstance(n, ast.Name) and n.id not in self.known and n.id not in scope
            for e in element
            for n in ast.walk(e)
        )
        if not needs_solution or len(node.generators) != 1 or _names(node.generators[0].iter) - self.known:
            return node
        gen = node.generators[0]
        if any(_names(cond) - self.known - scope for cond in gen.ifs):
            raise Ungradable("a comprehension filter needs the solution")
        elts = []
        for item in _items(_Evaluator(self.env).eval(gen.iter)):
            mapping: dict[str, ast.expr] = {}
            _bind_literals(gen.target, item, mapping)
            local: dict[str, Any] = {}
            _bind(gen.target, item, local)
            if all(_Evaluator(self.env).eval(cond, local) for cond in gen.ifs):
                elts.append([_substitute_expr(e, mapping) for e in element])
        return ast.copy_location(make(elts), node)

    def visit_ListComp(self, node):
        return self._unroll(node, lambda elts: ast.List(elts=[e[0] for e in elts], ctx=ast.Load()))

    def visit_GeneratorExp(self, node):
        return self._unroll(node, lambda elts: ast.Tuple(elts=[e[0] for e in elts], ctx=ast.Load()))

    def visit_SetComp(self, node):
        return self._unroll(node, lambda elts: ast.Set(elts=[e[0] for e in elts]) if elts else _empty_set())

    def visit_DictComp(self, node):
        return self._unroll(node, lambda elts: ast.Dict(keys=[e[0] for e in elts], values=[e[1] for e in elts]))


def _empty_set() -> ast.expr:
    return ast.Call(func=ast.Name(id="set", ctx=ast.Load()), args=[], keywords=[])


def _substitute_expr(node: ast.expr, mapping: dict[str, ast.expr]) -> ast.expr:
    class Sub(ast.NodeTransformer):
        def visit_Name(self, n):
            return ast.copy_location(mapping[n.id], n) if n.id in mapping and isinstance(n.ctx, ast.Load) else n

    return ast.fix_missing_locations(Sub().visit(ast.parse(ast.unparse(node), mode="eval")).body)


def _bound_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(a.asname or a.name).split(".")[0] for a in node.names}
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}


def _is_check(node: ast.FunctionDef, nodes: list[ast.stmt]) -> bool:
    if node.args.vararg or node.args.kwarg or node.args.kwonlyargs or node.decorator_list:
        return False
    return any(isinstance(n, ast.Expr) and _check_call(n, {node.name: node}) for n in nodes)


def _check_call(node: ast.Expr, checks: dict[str, ast.FunctionDef]) -> bool:
    call = node.value
    return (
        isinstance(call, ast.Call)
        and isinstance(call.func, ast.Name)
        and call.func.id in checks
        and not call.keywords
        and len(call.args) == len(checks[call.func.id].args.args)
    )


def _substitute(node: ast.stmt, mapping: dict[str, ast.expr]) -> ast.stmt:
    class Sub(ast.NodeTransformer):
        def visit_Name(self, n):
            return ast.copy_location(mapping[n.id], n) if n.id in mapping and isinstance(n.ctx, ast.Load) else n

    return ast.fix_missing_locations(Sub().visit(ast.parse(ast.unparse(node)).body[0]))


_logged: set[str] = set()


def _log_once(message: str) -> None:
    if message not in _logged and len(_logged) < 1000:
        _logged.add(message)
        logger.warning("code_reward: %s", message)


_MISSING = object()


# --- the sandbox side -------------------------------------------------------------------------------------------

HARNESS = r"""
import json, os, sys

def _posttrain_harness():
    request = json.loads(sys.stdin.read())
    # Compile everything before the solution runs: patching compile/exec/json afterwards changes nothing here.
    compiled = []
    for op in request["ops"]:
        try:
            compiled.append((op, compile(op.get("e") or op["x"], "<test>", "eval" if "e" in op else "exec")))
        except SyntaxError:
            compiled.append((op, None))
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # the solution's prints go nowhere; answers to the copy
    except OSError:
        pass  # (isolation="basic" refuses the open: prints then share the channel, which only carries values)
    dumps, tname, run, evaluate = json.dumps, type, exec, eval  # bound now: patching builtins later changes nothing

    def enc(v, depth=0):
        t = tname(v)
        if depth > 100:
            raise ValueError("nested too deeply")
        if v is None or t is bool or t is int or t is str:
            return v
        if t is float:
            return v if v == v and v not in (float("inf"), float("-inf")) else {"$": "float", "v": float.__repr__(v)}
        if t is list:
            return [enc(x, depth + 1) for x in v]
        if t is tuple or t is set or t is frozenset:
            return {"$": t.__name__, "v": [enc(x, depth + 1) for x in v]}
        if t is dict:
            return {"$": "dict", "v": [[enc(k, depth + 1), enc(x, depth + 1)] for k, x in dict.items(v)]}
        if t is bytes:
            return {"$": "bytes", "v": bytes.hex(v)}
        if t is complex:
            return {"$": "complex", "v": [enc(v.real), enc(v.imag)]}
        raise TypeError("not plain data: " + t.__name__)

    def send(obj):
        line = dumps(obj, allow_nan=False)
        if len(line) > 1_000_000:
            line = dumps({"k": obj.get("k"), "err": "ValueTooLarge"})
        out.write(line + "\n")
        out.flush()

    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        with open("solution.py", encoding="utf-8") as f:
            source = f.read()
        run(compile(source, "solution.py", "exec"), namespace)
    except BaseException as e:
        send({"solution": "error", "err": tname(e).__name__})
        return
    send({"solution": "ok"})
    for op, code in compiled:
        try:
            if code is None:
                raise SyntaxError("test")
            if "e" in op:
                value = evaluate(code, namespace)
                send({"k": op["k"], "v": enc(value)})
            else:
                run(code, namespace)
        except BaseException as e:
            if "e" in op:
                try:
                    send({"k": op["k"], "err": tname(e).__name__})
                except BaseException:
                    pass

_posttrain_harness()
"""


# --- the parent side --------------------------------------------------------------------------------------------


class _Invalid(ValueError):
    pass


def _reject_constant(name: str):
    raise _Invalid(f"non-standard JSON constant {name}")


def decode_answers(stdout: str) -> tuple[bool, dict[int, Any]]:
    """``(solution_ran, {index: value})`` from the harness output; malformed lines are ignored, first answer wins."""
    solution_ran = False
    answers: dict[int, Any] = {}
    for line in stdout.splitlines():
        try:
            obj = json.loads(line, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            continue
        if not isinstance(obj, dict):
            continue
        if obj.get("solution") == "ok" and len(obj) == 1:
            solution_ran = True
            continue
        k = obj.get("k")
        if type(k) is not int or k in answers or set(obj) not in ({"k", "v"}, {"k", "err"}):
            continue
        if "err" in obj:
            answers[k] = _ERROR
            continue
        try:
            answers[k] = _decode(obj["v"], 0)
        except (_Invalid, ValueError, TypeError, RecursionError):
            answers[k] = _ERROR
    return solution_ran, answers


_ERROR = object()


def _decode(obj: Any, depth: int) -> Any:
    if depth > 110:
        raise _Invalid("too deep")
    if obj is None or type(obj) in (bool, int, float, str):
        return obj
    if type(obj) is list:
        return [_decode(x, depth + 1) for x in obj]
    if type(obj) is not dict or set(obj) != {"$", "v"}:
        raise _Invalid("unknown value")
    tag, v = obj["$"], obj["v"]
    if tag in ("tuple", "set", "frozenset") and type(v) is list:
        items = [_decode(x, depth + 1) for x in v]
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[tag](items)
    if tag == "dict" and type(v) is list and all(type(p) is list and len(p) == 2 for p in v):
        return {_decode(a, depth + 1): _decode(b, depth + 1) for a, b in v}
    if tag == "float" and v in ("nan", "inf", "-inf"):
        return float(v)
    if tag == "bytes" and type(v) is str:
        return bytes.fromhex(v)
    if tag == "complex" and type(v) is list and len(v) == 2:
        return complex(float(_decode(v[0], depth + 1)), float(_decode(v[1], depth + 1)))
    raise _Invalid(f"unknown tag {tag!r}")


def grade(plan: Plan, solution_ran: bool, answers: dict[int, Any]) -> list[bool]:
    """Whether each test of ``plan`` passed, given the sandbox's answers."""
    if not solution_ran:
        return [False] * len(plan.tests)
    env = dict(plan.env)
    for k, value in answers.items():
        env[f"__sb_{k}"] = value
    results = []
    for test in plan.tests:
        if test is None:
            results.append(False)
            continue
        needed = {n.id for n in ast.walk(test) if isinstance(n, ast.Name) and n.id.startswith("__sb_")}
        if any(name not in env or env[name] is _ERROR for name in needed):
            results.append(False)
            continue
        try:
            results.append(bool(_Evaluator(env).eval(test)))
        except Exception:  # noqa: BLE001 -- any failure to evaluate the assertion is a failed test
            results.append(False)
    return results


class _Evaluator:
    """Evaluates the parent side of an assertion over plain data, with size guards (no ``eval``)."""

    def __init__(self, env: dict[str, Any]):
        self.env = env

    def eval(self, node: ast.AST, local: dict[str, Any] | None = None) -> Any:
        local = local or {}
        method = getattr(self, "_" + type(node).__name__, None)
        if method is None:
            raise Ungradable(f"unsupported syntax {type(node).__name__}")
        return method(node, local)

    def _Expression(self, n, local):
        return self.eval(n.body, local)

    def _Constant(self, n, local):
        return n.value

    def _Name(self, n, local):
        if n.id in local:
            return local[n.id]
        if n.id in self.env:
            return self.env[n.id]
        if n.id in _SAFE_FUNCTIONS:
            return _SAFE_FUNCTIONS[n.id]
        if n.id == "math":
            return math
        raise NameError(n.id)

    def _Tuple(self, n, local):
        return tuple(self.eval(e, local) for e in n.elts)

    def _List(self, n, local):
        return [self.eval(e, local) for e in n.elts]

    def _Set(self, n, local):
        return {self.eval(e, local) for e in n.elts}

    def _Dict(self, n, local):
        if any(k is None for k in n.keys):
            raise Ungradable("dict unpacking")
        return {self.eval(k, local): self.eval(v, local) for k, v in zip(n.keys, n.values)}

    def _UnaryOp(self, n, local):
        v = self.eval(n.operand, local)
        return _UNARY[type(n.op)](v)

    def _BinOp(self, n, local):
        a, b = self.eval(n.left, local), self.eval(n.right, local)
        op = type(n.op)
        if op is ast.Pow and isinstance(b, int) and abs(b) > _MAX_EXPONENT and a not in (0, 1, -1):
            raise OverflowError("exponent too large")
        if op is ast.LShift and isinstance(b, int) and b > _MAX_EXPONENT:
            raise OverflowError("shift too large")
        if op is ast.Mult and any(
            isinstance(seq, (str, bytes, list, tuple)) and isinstance(times, int) and len(seq) * times > _MAX_LEN
            for seq, times in ((a, b), (b, a))
        ):
            raise OverflowError("sequence too long")
        if op is ast.Mod and isinstance(a, (str, bytes)):
            raise Ungradable("%-formatting")
        if op not in _BINARY:
            raise Ungradable(f"operator {op.__name__}")
        return _plain(_BINARY[op](a, b))

    def _BoolOp(self, n, local):
        if isinstance(n.op, ast.And):
            value = True
            for e in n.values:
                value = self.eval(e, local)
                if not value:
                    return value
            return value
        value = False
        for e in n.values:
            value = self.eval(e, local)
            if value:
                return value
        return value

    def _Compare(self, n, local):
        left = self.eval(n.left, local)
        for op, comparator in zip(n.ops, n.comparators):
            right = self.eval(comparator, local)
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True

    def _IfExp(self, n, local):
        return self.eval(n.body, local) if self.eval(n.test, local) else self.eval(n.orelse, local)

    def _Subscript(self, n, local):
        return self.eval(n.value, local)[self.eval(n.slice, local)]

    def _Slice(self, n, local):
        parts = [None if p is None else self.eval(p, local) for p in (n.lower, n.upper, n.step)]
        return slice(*parts)

    def _Attribute(self, n, local):
        if isinstance(n.value, ast.Name) and n.value.id == "math" and n.attr in _MATH_NAMES:
            return getattr(math, n.attr)
        value = self.eval(n.value, local)
        if n.attr.startswith("_") or not isinstance(value, _PLAIN_TYPES):
            raise Ungradable(f"attribute {n.attr}")
        return getattr(value, n.attr)

    def _Call(self, n, local):
        func = self.eval(n.func, local)
        args = []
        for a in n.args:
            if isinstance(a, ast.Starred):
                args.extend(self.eval(a.value, local))
            else:
                args.append(self.eval(a, local))
        kwargs = {k.arg: self.eval(k.value, local) for k in n.keywords if k.arg is not None}
        if func is range or (func in (list, tuple, set, sorted, sum) and args and isinstance(args[0], range)):
            r = range(*args) if func is range else args[0]
            if len(r) > _MAX_LEN:
                raise OverflowError("range too long")
        return _plain(func(*args, **kwargs))

    def _Lambda(self, n, local):
        names = [a.arg for a in n.args.args]

        def function(*values):
            return self.eval(n.body, {**local, **dict(zip(names, values))})

        return function

    def _comprehension(self, n, local, make):
        out = []

        def loop(i, scope):
            if i == len(n.generators):
                out.append(make(scope))
                if len(out) > _MAX_LEN:
                    raise OverflowError("comprehension too long")
                return
            gen = n.generators[i]
            for item in self.eval(gen.iter, scope):
                inner = dict(scope)
                _bind(gen.target, item, inner)
                if all(self.eval(cond, inner) for cond in gen.ifs):
                    loop(i + 1, inner)

        loop(0, dict(local))
        return out

    def _ListComp(self, n, local):
        return self._comprehension(n, local, lambda s: self.eval(n.elt, s))

    _GeneratorExp = _ListComp

    def _SetComp(self, n, local):
        return set(self._ListComp(n, local))

    def _DictComp(self, n, local):
        return dict(self._comprehension(n, local, lambda s: (self.eval(n.key, s), self.eval(n.value, s))))


def _bind(target: ast.AST, value: Any, scope: dict[str, Any]) -> None:
    if isinstance(target, ast.Name):
        scope[target.id] = value
    elif isinstance(target, (ast.Tuple, ast.List)):
        values = list(value)
        if len(values) != len(target.elts):
            raise ValueError("unpacking mismatch")
        for t, v in zip(target.elts, values):
            _bind(t, v, scope)
    else:
        raise Ungradable("complex comprehension target")


def _plain(value: Any) -> Any:
    if isinstance(value, (str, bytes, list, tuple, set, frozenset, dict)) and len(value) > _MAX_LEN:
        raise OverflowError("value too large")
    return value
