"""The rules of docs/architecture.md that a reader of the code can check by its imports.

Each test reads the package's source with :mod:`ast`; nothing is imported, so a rule broken
by a module that fails to import is still reported.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pysafetensors

_PACKAGE = Path(pysafetensors.__file__).parent

# The reference's own private name, re-exported as it does, and pysafetensors.torch's helpers
# that the sharded saver shares (private there: the public module offers the reference's names).
_ALLOWED_PRIVATE: frozenset[tuple[str, str]] = frozenset(
    {
        ("_reader", "_safe_open_handle"),
        ("torch", "_copied_to_save"),
        ("torch", "_flatten"),
        ("torch", "_remove_duplicate_names"),
    }
)

# The format layer: headers parsed and planned with no I/O and no numpy.
_FORMAT_LAYER = ("_format", "_layout", "_dtypes", "_serde_json", "_serde_number", "_serde_syntax")
_IO_MODULES = frozenset({"io", "mmap", "socket", "numpy", "threading", "concurrent"})


def _relative_imports(path: Path) -> list[tuple[str, str, int]]:
    """``(module, name, line)`` for each name a module imports from within the package."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.level and node.module:
            found += [(node.module, alias.name, node.lineno) for alias in node.names]
    return found


def test_modules_share_only_plain_names() -> None:
    private = [
        f"{path.relative_to(_PACKAGE)}:{line} imports {name} from {module}"
        for path in sorted(_PACKAGE.rglob("*.py"))
        for module, name, line in _relative_imports(path)
        if name.startswith("_")
        and not name.startswith("__")
        and (module.rpartition(".")[2], name) not in _ALLOWED_PRIVATE
    ]
    assert private == []


def test_format_layer_imports_no_io_and_no_higher_layer() -> None:
    broken = []
    for stem in _FORMAT_LAYER:
        tree = ast.parse((_PACKAGE / f"{stem}.py").read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.ImportFrom):
                # Within the package: only the format layer itself and the errors it raises.
                if node.module not in (*_FORMAT_LAYER, "_errors"):
                    broken.append(f"{stem}.py:{node.lineno} imports .{node.module}")
                continue
            else:
                continue
            broken += [
                f"{stem}.py:{node.lineno} imports {name}"
                for name in names
                if name.partition(".")[0] in _IO_MODULES
            ]
    assert broken == []
