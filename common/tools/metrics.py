"""Code metrics for comparing the two kernels, counted from their source.

Everything here reads Python source with ``ast`` and ``tokenize``; nothing
imports or runs the kernels. The rules are simple on purpose, so that a reader
can check a count by hand:

- lines of code and cyclomatic complexity of a function: radon's (``sloc``
  and McCabe's count); for a set of lines (features, generated code), the
  physical lines holding a token other than a comment, a docstring or a line
  break (:func:`code_lines`);
- index expressions: hand-written address and bounds arithmetic, in three
  kinds: ``arange`` calls, arithmetic on strides or pointers (an outermost
  ``+ - * // %`` expression that names a ``stride``, ``pointer`` or
  ``ptr``/``ptrs`` variable), and bounds comparisons (``<``, ``<=``, ``>``,
  ``>=`` that mention an offset, a length, a head-dim bound, an index, a size
  or an ``arange``); plus ``mask=``/``other=`` arguments of loads and stores;
- integer index arithmetic: ``//`` and ``%`` operators (unravelling a program
  id or a flat index into coordinates).
"""

from __future__ import annotations

import ast
import dataclasses
import io
import re
import textwrap
import tokenize

_STRIDE_OR_POINTER = re.compile(r"stride|pointer|_ptrs?$|^ptrs?$", re.IGNORECASE)
_BOUND = re.compile(r"^offs|offsets|^L[qk]$|HEAD_DIM|source\.shape|^end$|_end$|_index_|_size_|arange")


def code_lines(source: str) -> set[int]:
    """Line numbers that hold code (no blank, comment-only or docstring lines)."""
    source = textwrap.dedent(source)
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENCODING, tokenize.ENDMARKER}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skip:
            for line in range(token.start[0], token.end[0] + 1):
                if line not in docstrings:
                    lines.add(line)
    return lines


def count_code_lines(source: str) -> int:
    return len(code_lines(source))


def _names(node) -> list[str]:
    """Variable names and dotted attribute paths mentioned in an expression."""
    found = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            found.append(sub.id)
        elif isinstance(sub, ast.Attribute):
            try:
                found.append(ast.unparse(sub))
            except Exception:  # noqa: BLE001 - unparse of odd nodes
                found.append(sub.attr)
            found.append(sub.attr)
    return found


def _call_name(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


@dataclasses.dataclass
class IndexCounts:
    aranges: int = 0
    address_arithmetic: int = 0
    bounds_comparisons: int = 0
    load_store_masks: int = 0
    div_mod: int = 0

    @property
    def total(self) -> int:
        return self.aranges + self.address_arithmetic + self.bounds_comparisons + self.load_store_masks

    def __add__(self, other):
        return IndexCounts(*(a + b for a, b in zip(dataclasses.astuple(self), dataclasses.astuple(other))))


def _count_call(node: ast.Call, counts: IndexCounts) -> None:
    """An ``arange`` call; the ``mask=``/``other=`` arguments of a load or store."""
    name = _call_name(node)
    if name == "arange":
        counts.aranges += 1
    if name in ("load", "store"):
        counts.load_store_masks += sum(1 for kw in node.keywords if kw.arg in ("mask", "other"))


def _count_arithmetic(node: ast.BinOp, counts: IndexCounts, inside_counted: set[int]) -> None:
    """A ``//`` or ``%``; an outermost expression on strides or pointers (its sub-expressions are
    recorded in ``inside_counted`` so that they are not counted again)."""
    if isinstance(node.op, (ast.FloorDiv, ast.Mod)):
        counts.div_mod += 1
    if id(node) not in inside_counted and any(_STRIDE_OR_POINTER.search(n) for n in _names(node)):
        counts.address_arithmetic += 1
        inside_counted.update(id(sub) for sub in ast.walk(node))


def _count_comparison(node: ast.Compare, counts: IndexCounts) -> None:
    """An ordering comparison that mentions a bound (an offset, a length, a size, an ``arange``)."""
    if any(isinstance(op, (ast.Lt, ast.LtE, ast.Gt, ast.GtE)) for op in node.ops):
        if any(_BOUND.search(n) for n in _names(node)):
            counts.bounds_comparisons += 1


def index_expressions(tree: ast.AST) -> IndexCounts:
    counts = IndexCounts()
    inside_counted_arithmetic = set()
    for node in ast.walk(tree):  # breadth-first: outer expressions before the ones inside them
        if isinstance(node, ast.Call):
            _count_call(node, counts)
        elif isinstance(node, ast.BinOp):
            _count_arithmetic(node, counts, inside_counted_arithmetic)
        elif isinstance(node, ast.Compare):
            _count_comparison(node, counts)
    return counts


@dataclasses.dataclass
class FunctionMetrics:
    name: str
    code_lines: int
    complexity: int
    index: IndexCounts


def function_metrics(source: str, names) -> list[FunctionMetrics]:
    """Metrics of the named top-level functions of a module's source, in the given order.

    Lines of code and McCabe complexity are radon's (``radon.raw.analyze``'s
    ``sloc`` of the function's source, decorators included; ``cc_visit``);
    index expressions are counted here (radon has no such count).
    """
    from radon.complexity import cc_visit
    from radon.raw import analyze

    source = textwrap.dedent(source)
    tree = ast.parse(source)
    text = source.splitlines()
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    result = []
    for name in names:
        node = functions[name]
        start = min([node.lineno] + [d.lineno for d in node.decorator_list])
        function_source = textwrap.dedent("\n".join(text[start - 1:node.end_lineno]))
        (block,) = [b for b in cc_visit(function_source) if b.name == name]
        result.append(FunctionMetrics(name, analyze(function_source).sloc, block.complexity, index_expressions(node)))
    return result


def feature_lines(source: str, names, features: dict[str, str]) -> dict[str, int]:
    """Code lines of the named functions that serve each feature.

    A line serves a feature when it mentions one of the feature's identifiers
    (a regular expression over the line's text) or sits in the body (not the
    ``else``) of an ``if`` whose condition does.
    """
    source = textwrap.dedent(source)
    tree = ast.parse(source)
    lines = code_lines(source)
    text = source.splitlines()
    functions = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    result = {}
    for feature, pattern in features.items():
        regex = re.compile(pattern)
        hit = set()
        for function in functions:
            for line in range(function.lineno, function.end_lineno + 1):
                if line in lines and regex.search(text[line - 1]):
                    hit.add(line)
            for node in ast.walk(function):
                if isinstance(node, ast.If) and regex.search(ast.unparse(node.test)):
                    for sub in node.body:
                        hit.update(line for line in range(sub.lineno, sub.end_lineno + 1) if line in lines)
        result[feature] = len(hit)
    return result
