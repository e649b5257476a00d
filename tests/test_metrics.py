"""The code metrics of the compare command, on small snippets whose counts are known by hand."""

from __future__ import annotations

import ast
import textwrap

import pytest

from common.tools.metrics import code_lines, count_code_lines, feature_lines, function_metrics, index_expressions

SNIPPET = textwrap.dedent('''
    import triton.language as tl


    def kernel(X, Y, stride_x, N, FLAG: tl.constexpr):
        """A docstring

        over two lines."""
        # a comment
        offs = tl.arange(0, 16)          # 1 arange
        x_ptrs = X + offs * stride_x     # 1 address arithmetic
        x = tl.load(x_ptrs, mask=offs < N, other=0.0)  # 1 bounds comparison, 2 load masks

        if FLAG:                         # decision 1
            x = x * 2
        elif N > 4 and N < 8:            # decision 2 (+1 for the `and`), 2 comparisons not on bounds
            x = x + 1
        for i in range(3):               # decision 3
            x = x + i // 2               # 1 `//`
        tl.store(Y + offs, x, mask=offs < N)  # 1 bounds comparison, 1 store mask
''')


def test_code_lines_skip_blanks_comments_and_docstrings():
    assert count_code_lines("a = 1\n\n# comment\nb = (1,\n     2)\n") == 3
    assert count_code_lines('def f():\n    """doc\n    string"""\n    return 1\n') == 2
    lines = code_lines(SNIPPET)
    assert 1 not in lines  # the blank first line of the dedented snippet
    assert count_code_lines(SNIPPET) == 12  # the import and the 11 lines of the function


def test_index_expressions():
    counts = index_expressions(ast.parse(SNIPPET))
    assert counts.aranges == 1
    assert counts.address_arithmetic == 1  # `Y + offs` names no stride or pointer variable
    assert counts.bounds_comparisons == 2  # the two `offs < N`; `N > 4` and `N < 8` name no offset or bound
    assert counts.load_store_masks == 3
    assert counts.div_mod == 1
    assert counts.total == 7


def test_nested_address_arithmetic_counts_once():
    counts = index_expressions(ast.parse("p = X + a * stride_a + b * stride_b\n"))
    assert counts.address_arithmetic == 1


def test_function_metrics():
    """Lines and complexity are radon's: 11 code lines (no docstring, comment or blank);
    McCabe 1 + if + elif + `and` + for = 5."""
    pytest.importorskip("radon", reason="radon comes with the [test] and [bench] extras")
    (m,) = function_metrics(SNIPPET, ["kernel"])
    assert (m.name, m.code_lines, m.complexity, m.index.total) == ("kernel", 11, 5, 7)
    # radon counts a comprehension's loop as well as its `if`: 1 + IfExp + for + if
    (m,) = function_metrics("def f(x):\n    return x if x else [y for y in x if y]\n", ["f"])
    assert m.complexity == 4


def test_feature_lines():
    counts = feature_lines(SNIPPET, ["kernel"], {"flag": r"FLAG", "bounds": r"< N"})
    assert counts["flag"] == 3  # the signature, the `if FLAG:` line and its one-line body
    assert counts["bounds"] == 2  # the load and the store (`N < 8` is not `< N`)
