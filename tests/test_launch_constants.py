"""Launch constants: what a launcher ``lowbit/ops/<op>/_cuda.py`` mirrors of its ``cuda/<op>.cu``.

A launcher sizes grids, blocks and shared memory from constants the kernel also defines (tile
sizes, warps per block, format ids). Each launcher declares the ones it mirrors as
``CU_CONSTANTS = {"kTile": TILE, ...}``, keyed by the C++ names; this test reads the integer
``constexpr`` and ``#define`` values of the .cu file and of the headers it includes
(``cuda/common.cuh``) and holds the two sides to each other, so a change on one side only fails
here. Launchers are discovered like ``tests/test_nvrtc.py`` does.
"""

from __future__ import annotations

import ast
import operator
import re
from pathlib import Path

import pytest

from lowbit import _kernels

from test_nvrtc import _op_launchers

LAUNCHERS = list(_op_launchers())

_INT_TYPE = (r"(?:unsigned\s+|signed\s+)?(?:int|long\s+long|long|short|char|unsigned|"
             r"u?int(?:8|16|32|64)_t|size_t)")
_CONSTEXPR = re.compile(r"\bconstexpr\s+" + _INT_TYPE + r"\s+(\w+)\s*=\s*([^;{}]+);")
_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)[ \t]+([^\n]+?)[ \t]*$", re.M)
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"', re.M)
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_QUALIFIER = re.compile(r"\b\w+::")
_INT_SUFFIX = re.compile(r"\b(0[xX][0-9a-fA-F]+|\d+)[uUlL]+\b")

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Mod: operator.mod, ast.LShift: operator.lshift, ast.RShift: operator.rshift,
           ast.BitOr: operator.or_, ast.BitAnd: operator.and_, ast.BitXor: operator.xor}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos, ast.Invert: operator.invert}


def _c_div(a: int, b: int) -> int:
    """C++ integer division: the quotient truncated toward zero."""
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


def definitions(text: str) -> dict[str, list[str]]:
    """Every integer ``constexpr`` and object-like ``#define`` of a C++ text, by name."""
    text = _COMMENT.sub("", text)
    found: dict[str, list[str]] = {}
    for pattern in (_CONSTEXPR, _DEFINE):
        for name, expr in pattern.findall(text):
            found.setdefault(name, []).append(expr.strip())
    return found


def evaluate(name: str, defs: dict[str, list[str]], _seen: frozenset = frozenset()) -> int:
    """The integer value of ``name`` from ``definitions``; arithmetic on literals and names.

    Raises:
        KeyError: ``name`` is not defined.
        ValueError: it has definitions of different values, or one that is not integer
            arithmetic on literals and other constants.
    """
    if name in _seen:
        raise ValueError(f"{name} is defined in terms of itself")
    values = {_eval_expr(expr, defs, _seen | {name}) for expr in defs[name]}
    if len(values) > 1:
        raise ValueError(f"{name} has definitions of different values: {defs[name]}")
    return values.pop()


def _eval_expr(expr: str, defs: dict[str, list[str]], seen: frozenset) -> int:
    source = _INT_SUFFIX.sub(r"\1", _QUALIFIER.sub("", expr))
    try:
        tree = ast.parse(source, mode="eval").body
    except SyntaxError:
        raise ValueError(f"cannot evaluate {expr!r}") from None

    def walk(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name):
            try:
                return evaluate(node.id, defs, seen)
            except KeyError:
                raise ValueError(f"{expr!r} uses {node.id}, which is not a known constant") \
                    from None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            return _c_div(walk(node.left), walk(node.right))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            return _BINARY[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](walk(node.operand))
        raise ValueError(f"cannot evaluate {expr!r}")

    return walk(tree)


def translation_unit(source_name: str) -> str:
    """The text of ``cuda/<source_name>`` followed by every header it includes, recursively."""
    directory = Path(_kernels.cuda_dir())
    parts, pending, seen = [], [source_name], set()
    while pending:
        name = pending.pop()
        if name in seen:
            continue
        seen.add(name)
        text = (directory / name).read_text()
        parts.append(text)
        pending.extend(inc for inc in _INCLUDE.findall(text) if (directory / inc).is_file())
    return "\n".join(parts)


def mismatches(mirrored: dict[str, int], text: str) -> list[str]:
    """How the launcher's ``CU_CONSTANTS`` disagree with the C++ text (empty when they agree)."""
    defs = definitions(text)
    problems = []
    for name, value in sorted(mirrored.items()):
        if name not in defs:
            problems.append(f"{name} is not an integer constexpr or #define of the kernel source")
            continue
        try:
            actual = evaluate(name, defs)
        except ValueError as exc:
            problems.append(str(exc))
            continue
        if actual != value:
            problems.append(f"{name} = {actual} in the kernel source, {value} in the launcher")
    return problems


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_launcher_declares_what_it_mirrors(launcher):
    mirrored = getattr(launcher, "CU_CONSTANTS", None)
    assert isinstance(mirrored, dict), (
        f"{launcher.__name__} must declare CU_CONSTANTS, the .cu constants it mirrors "
        "({} if none)")
    for name, value in mirrored.items():
        assert isinstance(name, str) and re.fullmatch(r"[A-Za-z_]\w*", name), name
        assert type(value) is int, (name, value)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_launcher_constants_match_the_kernel(launcher):
    problems = mismatches(launcher.CU_CONSTANTS, translation_unit(launcher.SOURCE))
    assert not problems, f"{launcher.__name__} vs cuda/{launcher.SOURCE}:\n" + "\n".join(problems)


def test_at_least_one_launcher_mirrors_constants():
    # Guards the discovery and the parser: an empty scan would pass every check above.
    assert len(LAUNCHERS) >= 8
    assert sum(len(launcher.CU_CONSTANTS) for launcher in (p.values[0] for p in LAUNCHERS)) >= 10


_SAMPLE = """
#include "common.cuh"
namespace demo {
constexpr int kWarps = 4;                      // a comment: constexpr int kFake = 9;
constexpr int kThreads = kWarps * lowbit::kWarpSize;
constexpr unsigned kMask = 0xffu;
constexpr long long kBig = 1ll << 40;
constexpr int kNeg = -7 / 2;
constexpr float kEps = 1e-5f;
template <int BITS> constexpr int kPer = 8 / BITS;
}  // namespace demo
#define DEMO_ROWS (kWarps * 2)
constexpr int kWarpSize = 32;
"""


@pytest.mark.parametrize("name,value", [
    ("kWarps", 4), ("kThreads", 128), ("kMask", 255), ("kBig", 1 << 40), ("kNeg", -3),
    ("DEMO_ROWS", 8),
])
def test_parser_evaluates_constants(name, value):
    assert mismatches({name: value}, _SAMPLE) == []


@pytest.mark.parametrize("mirrored,message", [
    ({"kThreads": 256}, "kThreads = 128 in the kernel source, 256 in the launcher"),
    ({"kFake": 9}, "kFake is not an integer constexpr"),
    ({"kEps": 0}, "kEps is not an integer constexpr"),
    ({"kPer": 4}, "BITS, which is not a known constant"),
])
def test_parser_reports_disagreement(mirrored, message):
    (problem,) = mismatches(mirrored, _SAMPLE)
    assert message in problem


def test_parser_rejects_conflicting_definitions():
    text = _SAMPLE + "namespace other { constexpr int kWarps = 8; }\n"
    (problem,) = mismatches({"kWarps": 4}, text)
    assert "different values" in problem


@pytest.mark.parametrize("launcher", [p for p in LAUNCHERS if p.values[0].CU_CONSTANTS])
def test_a_change_on_either_side_fails(launcher):
    mirrored = launcher.CU_CONSTANTS
    text = translation_unit(launcher.SOURCE)
    name = sorted(mirrored)[0]
    assert mismatches({**mirrored, name: mirrored[name] + 1}, text)
    changed = re.sub(r"(\bconstexpr\s+int\s+" + name + r"\s*=)", r"\1 1 +", text, count=1)
    assert changed != text
    assert mismatches(mirrored, changed)
