"""Where NineToothed's generated code lives, and keeping it private.

``ninetoothed.make`` writes each kernel's generated Triton source to a file
and imports it. Code imported from a directory that other users can write is
code they can run in your process, so the directory we give it is checked
before anything is generated there:

- it is ``$TWIN_ATTENTION_CACHE_DIR``, else ``$XDG_CACHE_HOME/twin-attention/ninetoothed``
  (``~/.cache/twin-attention/ninetoothed``);
- it is created with mode 0700; an existing one must be a directory that
  belongs to this user and that neither group nor others can write, or the
  call fails with a ``PermissionError`` that says so;
- files are written atomically (a temporary file, then a rename), so several
  processes making the same kernel at once (pytest-xdist workers, torchrun
  ranks) never import a half-written file;
- each kernel made is remembered in ``made/`` under a key of everything its
  code is generated from (:func:`generation_key`), so that the next process
  imports the module instead of generating it again.

NineToothed itself still creates ``~/.ninetoothed`` when it is imported; we
write nothing there. Triton's own cache of compiled kernels is
``$TRITON_CACHE_DIR`` (``~/.triton/cache``): the same rule applies to it, and
keeping it private is the user's part (see the README).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import os
import pathlib
import re
import stat
import sys
import tempfile

from common import compat

ENV_VAR = "TWIN_ATTENTION_CACHE_DIR"


def cache_dir() -> pathlib.Path:
    """The directory NineToothed's generated code goes to (not created here)."""
    chosen = os.environ.get(ENV_VAR)
    if chosen:
        return pathlib.Path(chosen).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "twin-attention" / "ninetoothed"


def ensure_private(path: pathlib.Path) -> pathlib.Path:
    """Create ``path`` (mode 0700) if needed; raise PermissionError unless it is
    a directory of this user that no one else can write."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"the code cache {path} is not a directory")
    if hasattr(os, "getuid") and info.st_uid != os.getuid():
        raise PermissionError(
            f"the code cache {path} belongs to another user (uid {info.st_uid}); code imported from it would "
            f"run as you. Choose a directory of your own with {ENV_VAR}"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"the code cache {path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o}); code "
            f"imported from it could be replaced by theirs. Run 'chmod 700 {path}' or choose another "
            f"directory with {ENV_VAR}"
        )
    return path


def source_key(source: str) -> str:
    """The name of a generated module's file: a hash of its source, blind to the order of its
    top-level imports and functions. NineToothed appends the helper functions an application
    calls in an order that changes from process to process (a set's), so a plain hash made a
    new file of the same kernel in every process. Reordering the imports and the functions
    (decorators included) of a module that holds nothing else, each name defined once, changes
    nothing; any other source is hashed as it is. (One parse of the source costs a fraction of
    NineToothed's generating it.)"""
    digest = hashlib.sha256()
    try:
        body = ast.parse(source).body
    except SyntaxError:
        body = None
    functions = [node.name for node in body or () if isinstance(node, ast.FunctionDef)]
    if body and len(set(functions)) == len(functions) and all(
            isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef)) for node in body):
        lines = source.splitlines(keepends=True)
        blocks = sorted("".join(lines[min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
                                      - 1:node.end_lineno]) for node in body)
        for block in blocks:
            digest.update(block.encode("utf-8") + b"\0")
    else:
        digest.update(source.encode("utf-8"))
    return digest.hexdigest()


def simplified(source: str) -> str:
    """A generated module with the masks of its loads and stores pruned: NineToothed builds a
    tile's mask from every level of its arrangement, repeating the bounds of each program index
    once per level (a key tile's load carried over 60 terms, most of them copies, and sums such as
    ``n - 1 + 1 - 1 + 1``), which Triton's front end and backend then walk again for every load.
    Each mask, an ``&`` of terms, keeps one copy of each term and drops the terms that hold whatever
    the program computes (:func:`_holds`: ``0 < 1``, an ``arange(0, 64)`` below 64, a remainder by 1
    of an index at least 0); ``(x - c) + c`` and ``(x + c) - c`` become ``x``. The same boolean values
    (a mask broadcasts to its pointers' shape either way) and integers: only the text is shorter,
    which is what Triton's front end, and its interpreter, walk term by term. Source that does
    not parse, or holds nothing to prune, is returned as it is (comments and layout kept)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return source
    rewrite = _Simplify()
    tree = rewrite.visit(tree)
    if not rewrite.changed:
        return source
    return ast.unparse(tree) + "\n"  # (unparse reads no line numbers: the new nodes need none)


def _mask_terms(node) -> list:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitAnd):
        return _mask_terms(node.left) + _mask_terms(node.right)
    return [node]


def _holds(node) -> bool:
    """Whether a mask term is ``True`` or a comparison that holds for every value of its integer
    operands' ranges (:func:`_int_range`): ``0 < 1``, ``arange(0, 64)[:, None] < 64``, ``i % 1 >= 0``."""
    if isinstance(node, ast.Constant):
        return node.value is True
    if not (isinstance(node, ast.Compare) and len(node.ops) == 1):
        return False
    a, b = _int_range(node.left), _int_range(node.comparators[0])
    if a is None or b is None:
        return False
    op = type(node.ops[0])
    return {ast.Lt: lambda: a[1] < b[0], ast.LtE: lambda: a[1] <= b[0], ast.Gt: lambda: a[0] > b[1],
            ast.GtE: lambda: a[0] >= b[1], ast.Eq: lambda: a[0] == a[1] == b[0] == b[1]}.get(op, lambda: False)()


# Names of NineToothed's generated code that hold integers: a tensor's program-index coordinates
# (``ninetoothed_tensor_3_index_1``) and its sizes and strides (``ninetoothed_ninetoothed_tensor_3_size_2``).
_INT_NAME = re.compile(r"ninetoothed_tensor_\d+_index_\d+|ninetoothed_ninetoothed_tensor_\d+_(size|stride)_\d+")


def _arange(node) -> tuple[int, int] | None:
    """(start, end) of ``....arange(start, end)`` with integer constants, indexed or not (``[:, None]``)."""
    while isinstance(node, ast.Subscript):
        node = node.value
    if (isinstance(node, ast.Call) and not node.keywords and len(node.args) == 2
            and (getattr(node.func, "attr", None) or getattr(node.func, "id", None)) == "arange"
            and all(isinstance(a, ast.Constant) and type(a.value) is int for a in node.args)):
        return node.args[0].value, node.args[1].value
    return None


def _is_int(node) -> bool:
    """Whether ``node`` computes integers: integer constants, _INT_NAME names, aranges, and
    ``+ - * // %`` of those."""
    if isinstance(node, ast.Constant):
        return type(node.value) is int
    if isinstance(node, ast.Name):
        return _INT_NAME.fullmatch(node.id) is not None
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, ast.USub) and _is_int(node.operand)
    if isinstance(node, ast.BinOp):
        return (isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod))
                and _is_int(node.left) and _is_int(node.right))
    return _arange(node) is not None


def _int_range(node) -> tuple[int, int] | None:
    """(least, greatest) of the integers ``node`` can take, where that is known from its text: an
    integer constant; ``arange(a, b)`` (a to b - 1); ``x % 1`` and ``x * 0`` (0) of an integer x (a
    remainder by 1 is 0 under either sign rule); sums, differences and negations of such. Else None."""
    if isinstance(node, ast.Constant):
        return (node.value, node.value) if type(node.value) is int else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        inner = _int_range(node.operand)
        return None if inner is None else (-inner[1], -inner[0])
    if isinstance(node, ast.BinOp):
        if isinstance(node.op, ast.Mod) and _is_int(node.left) and _int_range(node.right) == (1, 1):
            return 0, 0
        if isinstance(node.op, ast.Mult) and _is_int(node.left) and _is_int(node.right) and (
                _int_range(node.left) == (0, 0) or _int_range(node.right) == (0, 0)):
            return 0, 0
        if isinstance(node.op, (ast.Add, ast.Sub)):
            a, b = _int_range(node.left), _int_range(node.right)
            if a is None or b is None:
                return None
            return (a[0] + b[0], a[1] + b[1]) if isinstance(node.op, ast.Add) else (a[0] - b[1], a[1] - b[0])
        return None
    bounds = _arange(node)
    return None if bounds is None or bounds[1] <= bounds[0] else (bounds[0], bounds[1] - 1)


class _Simplify(ast.NodeTransformer):
    """One walk of the tree, children first: each ``(x - c) + c`` and ``(x + c) - c`` as ``x``, for an
    integer constant c; then each ``mask=`` of a call (its terms folded already): its ``&`` terms in
    their order, each once, without those that hold (see :func:`simplified`) but a leading ``True``.
    (Pruning joins terms by ``&`` only, so it leaves nothing more to fold.)"""

    changed = False

    def visit_Call(self, node):
        self.generic_visit(node)
        for keyword in node.keywords:
            if keyword.arg != "mask":
                continue
            terms, kept, seen = _mask_terms(keyword.value), [], set()
            for term in terms:
                text = ast.dump(term)
                if text not in seen and not _holds(term):
                    seen.add(text)
                    kept.append(term)
            if terms and isinstance(terms[0], ast.Constant) and terms[0].value is True:
                # the leading True stays, in its place: under the interpreter the program indices'
                # comparisons are NumPy booleans, and which conversion a chain of them meets
                # depends on what starts it
                kept.insert(0, terms[0])
            if kept and len(kept) < len(terms):  # (a mask whose terms all hold stays whole)
                mask = kept[0]
                for term in kept[1:]:
                    mask = ast.BinOp(mask, ast.BitAnd(), term)
                keyword.value = mask
                self.changed = True
        return node

    def visit_BinOp(self, node):
        self.generic_visit(node)
        inner = node.left
        if (isinstance(node.op, (ast.Add, ast.Sub)) and isinstance(inner, ast.BinOp)
                and isinstance(inner.op, (ast.Add, ast.Sub)) and type(inner.op) is not type(node.op)
                and isinstance(node.right, ast.Constant) and isinstance(inner.right, ast.Constant)
                and type(node.right.value) is int and type(inner.right.value) is int
                and node.right.value == inner.right.value):
            self.changed = True
            return inner.left
        return node


def _write_atomically(path: pathlib.Path, text: str) -> None:
    """Write ``text`` to ``path`` under a temporary name in its directory, then rename it into
    place (a rename within one directory is atomic)."""
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=path.suffix)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            file.write(text)
        os.replace(temporary, path)
    except BaseException:
        pathlib.Path(temporary).unlink(missing_ok=True)
        raise


def _cache_source(source: str) -> pathlib.Path:
    """NineToothed's ``cache_source``, with the file written atomically and named by
    :func:`source_key`; the source :func:`simplified` first."""
    source = simplified(source)
    path = pathlib.Path(compat.code_cache_dir()) / f"{source_key(source)}.py"
    if not path.exists():
        _write_atomically(path, source)
    return path


# -- kernels made by an earlier process ---------------------------------------------------------

_MODULE_NAME = re.compile(r"[0-9a-f]{64}\.py")


@functools.cache
def _package_sources(packages: tuple) -> str:
    """A hash of every ``.py`` file under each package's directory (name and text), in a fixed order."""
    digest = hashlib.sha256()
    for package in packages:
        root = pathlib.Path(package.__file__).parent
        for path in sorted(root.rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode("utf-8") + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def generation_key(packages: tuple, *parts) -> str | None:
    """The key of one ``ninetoothed.make``: a hash of the sources of ``packages`` (modules whose
    directories hold everything the code is generated from: the arrangements, applications and
    their helpers, this module's :func:`simplified`, NineToothed's generator), of Python's and
    Triton's versions, of whether Triton's interpreter runs (NineToothed copies ``@triton.jit``
    helpers into the code only when they are JIT functions), and of ``parts``, which name the
    kernel (its premake and arguments, name, warps, stages, the device properties NineToothed
    reads). None, nothing to remember, where a part's ``repr`` would name an object's address."""
    import triton

    described = repr(parts)
    if " at 0x" in described:
        return None
    digest = hashlib.sha256()
    for text in (_package_sources(tuple(packages)), sys.version, triton.__version__,
                 os.environ.get("TRITON_INTERPRET", ""), described):
        digest.update(text.encode("utf-8") + b"\0")
    return digest.hexdigest()


def _made_dir() -> pathlib.Path:
    return pathlib.Path(compat.code_cache_dir()) / "made"


def made_before(key: str | None) -> pathlib.Path | None:
    """The module an earlier ``ninetoothed.make`` of ``key`` (:func:`generation_key`) wrote in
    the code cache (:func:`use_private_cache` first), or None: never made, or its file gone. An
    entry that does not name a module of this directory is ignored."""
    if key is None:
        return None
    try:
        name = (_made_dir() / key).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    path = pathlib.Path(compat.code_cache_dir()) / name
    return path if _MODULE_NAME.fullmatch(name) and path.is_file() else None


def remember_made(key: str | None, module) -> None:
    """Record that ``ninetoothed.make`` of ``key`` wrote ``module``, a file of the code cache."""
    module = pathlib.Path(module)
    if key is None or module.parent != pathlib.Path(compat.code_cache_dir()) or not _MODULE_NAME.fullmatch(module.name):
        return
    directory = _made_dir()
    directory.mkdir(mode=0o700, exist_ok=True)
    _write_atomically(directory / key, module.name + "\n")


def number_tensors_from_zero() -> None:
    """Name the ``ninetoothed.Tensor``s made next ``tensor_0``, ``tensor_1``, ... Call before making
    a kernel's tensors (under the lock that makes kernels one at a time).

    NineToothed names each tensor after a count of every tensor the process has made, and its
    kernel's parameters after those names, sorted as strings. A kernel made after others therefore
    had other names and another parameter order than the same kernel made first: another source,
    another file here, and a miss in Triton's cache of compiled kernels (keyed by the source), so
    a new process compiled again every kernel it did not make in the same order as the last one.
    Counted from zero for each kernel, the source depends on the kernel alone
    (:func:`common.compat.restart_tensor_count`; a version without that count is left as it is)."""
    compat.restart_tensor_count()


def use_private_cache() -> pathlib.Path:
    """Point NineToothed's code generation at :func:`cache_dir`, checked private,
    with atomic writes. Call before each ``ninetoothed.make``; returns the directory."""
    directory = ensure_private(cache_dir())
    compat.use_code_cache(directory, _cache_source)
    return directory
