"""The shape of farm's code: its largest classes and modules and its longest functions.

    python bench/structure.py [PACKAGE_FOLDER]   # default: this checkout's farm/

Printed: the five classes with the most methods, the five longest modules, and the ten
longest functions (``def`` line to last line, docstring included, decorators not).
``tests/unit/test_layout.py`` holds the limits (35 methods, 60 lines); this shows where
the code stands against them, for any checkout (``git worktree add`` an old commit and
point this at its ``farm/`` to compare).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def measure(package: Path) -> tuple[list, list, list]:
    """(methods, path:class), (lines, path) and (lines, path:line name), unsorted."""
    classes, modules, functions = [], [], []
    for path in sorted(package.rglob("*.py")):
        text = path.read_text()
        where = path.relative_to(package.parent)
        modules.append((len(text.splitlines()), str(where)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(item, FUNCTIONS) for item in node.body)
                classes.append((methods, f"{where}:{node.name}"))
            elif isinstance(node, FUNCTIONS):
                length = node.end_lineno - node.lineno + 1
                functions.append((length, f"{where}:{node.lineno} {node.name}"))
    return classes, modules, functions


def main() -> None:
    package = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parents[1] / "farm"
    classes, modules, functions = measure(package.resolve())
    for title, rows, count, unit in (
        ("classes with the most methods", classes, 5, "methods"),
        ("longest modules", modules, 5, "lines"),
        ("longest functions", functions, 10, "lines"),
    ):
        print(f"{title}:")
        for size, name in sorted(rows, reverse=True)[:count]:
            print(f"  {size:5d} {unit:8s} {name}")
    print(f"functions over 60 lines: {sum(size > 60 for size, _ in functions)}")
    print(f"classes over 35 methods: {sum(size > 35 for size, _ in classes)}")


if __name__ == "__main__":
    main()
