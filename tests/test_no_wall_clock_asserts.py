"""No test asserts a wall-clock bound (#62): `assert time.monotonic() - start < 5` passes or fails with the load
on the machine. Tests count the work instead (engine steps, calls, bytes, events in order) or compare seconds
with a control timed alongside (a ratio); a timeout that only keeps a hang from lasting forever is no assert.

The check reads each test file's syntax tree (`ast`): within one top-level function (nested functions and lambdas
included) a value is time-derived when it reads a clock (`time.monotonic()`, `time.time()`, `time.perf_counter()`,
their `_ns` forms, `datetime.now()`), a name assigned, appended or looped from a time-derived value, or a function
of the file that returns one. An `assert` fails the check when it orders (<, <=, >, >=) a time-derived value
against one that is not: a number, a constant, a limit. Both sides time-derived is a ratio against a control,
and allowed. Unpacking a call's tuple is not followed (which part is the time is unknown)."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CLOCKS = {"monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "time", "time_ns"}
ORDERS = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)
ADDS = {"append", "extend", "add", "insert", "appendleft", "update", "setdefault"}


def wall_clock_asserts(source: str, filename: str = "<test>") -> list[str]:
    """'file:line: ...' for each assert of `source` that orders a time-derived value against a bound."""
    tree = ast.parse(source, filename)
    modules, functions = {"time"}, set()  # what names the time module, and its clocks imported by name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.asname or a.name for a in node.names if a.name == "time"}
        elif isinstance(node, ast.ImportFrom) and node.module == "time":
            functions |= {a.asname or a.name for a in node.names if a.name in CLOCKS}

    def reads_clock(node: ast.AST) -> bool:
        if not isinstance(node, ast.Call):
            return False
        f = node.func
        if isinstance(f, ast.Name):
            return f.id in functions
        if isinstance(f, ast.Attribute):
            if f.attr in CLOCKS and isinstance(f.value, ast.Name) and f.value.id in modules:
                return True
            base = f.value.attr if isinstance(f.value, ast.Attribute) else getattr(f.value, "id", None)
            return f.attr in ("now", "utcnow") and base == "datetime"
        return False

    scopes = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    scopes += [item for node in tree.body if isinstance(node, ast.ClassDef) for item in node.body
               if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))]
    rest = [node for node in tree.body if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    scopes.append(ast.Module(body=rest, type_ignores=[]))

    timers: set[str] = set()  # functions of this file that return a time-derived value
    tainted: dict[int, set[str]] = {id(scope): set() for scope in scopes}

    def derived(node: ast.AST | None, names: set[str]) -> bool:
        return node is not None and any(
            reads_clock(n) or (isinstance(n, ast.Name) and (n.id in names or n.id in timers)) for n in ast.walk(node))

    def roots(target: ast.AST) -> list[str]:
        """The names an assignment to `target` marks: `x`, `x[i]`, `x.attr`; tuples element by element."""
        while isinstance(target, (ast.Subscript, ast.Attribute, ast.Starred)):
            target = target.value
        return [target.id] if isinstance(target, ast.Name) else []

    def flows(scope: ast.AST):
        """(targets, value) of every assignment-like flow in `scope`."""
        for node in ast.walk(scope):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, (ast.Tuple, ast.List)):
                        if isinstance(node.value, (ast.Tuple, ast.List)) and len(node.value.elts) == len(target.elts):
                            yield from (([t], v) for t, v in zip(target.elts, node.value.elts))
                    else:
                        yield [target], node.value
            elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.NamedExpr)):
                yield [node.target], node.value
            elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
                yield [node.target], node.iter
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in ADDS
                  and node.args):
                yield [node.func.value], ast.Tuple(elts=[*node.args], ctx=ast.Load())

    changed = True
    while changed:  # to a fixed point: names within each scope, and the file's timer functions
        changed = False
        for scope in scopes:
            names = tainted[id(scope)]
            for targets, value in flows(scope):
                if derived(value, names):
                    new = {name for t in targets for name in roots(t)} - names
                    if new:
                        names |= new
                        changed = True
            for node in ast.walk(scope):
                if (isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in timers
                        and any(isinstance(r, ast.Return) and derived(r.value, names) for r in ast.walk(node))):
                    timers.add(node.name)
                    changed = True

    found = []
    for scope in scopes:
        names = tainted[id(scope)]
        for node in ast.walk(scope):
            if not isinstance(node, ast.Assert):
                continue
            for compare in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                sides = [compare.left, *compare.comparators]
                for op, left, right in zip(compare.ops, sides, sides[1:]):
                    if isinstance(op, ORDERS) and derived(left, names) != derived(right, names):
                        found.append(f"{filename}:{compare.lineno}: asserts a wall-clock bound: "
                                     f"{ast.unparse(compare)}")
    return sorted(set(found), key=lambda line: int(line.split(":")[1]))


def test_no_test_asserts_a_wall_clock_bound():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        found += wall_clock_asserts(path.read_text(), str(path.relative_to(TESTS.parent)))
    assert not found, ("count the work (steps, calls, bytes, events in order) or compare with a control timed "
                       "alongside, never with seconds:\n" + "\n".join(found))


def test_the_check_finds_bounds_and_allows_counts_ratios_and_safety_nets():
    bad = '''
import time
from time import perf_counter as clock

def timed(call):
    start = time.perf_counter()
    call()
    return time.perf_counter() - start

def test_direct():
    start = time.monotonic()
    assert time.monotonic() - start < 5

def test_by_name():
    t0 = clock()
    elapsed = clock() - t0
    assert elapsed <= LIMIT + 1.5

def test_through_a_container_and_a_helper(pool):
    shut = {}
    shut[0] = time.monotonic()
    assert max(shut.values()) < 2.0
    assert timed(print) < 0.5
    other = pool.submit(timed, print)
    assert 30 > other.result()
'''
    good = '''
import time

def timed(call):
    start = time.perf_counter()
    call()
    return time.perf_counter() - start

def test_fine(thread, steps):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        pass
    thread.join(30)
    assert not thread.is_alive()
    assert steps.count <= 8
    idle, busy = timed(print), timed(print)
    assert busy <= 5 * idle
    seconds, work = timed(print), 3
    assert work <= 16
'''
    assert [line.split(":")[1] for line in wall_clock_asserts(bad)] == ["12", "17", "22", "23", "25"]
    assert wall_clock_asserts(good) == []
