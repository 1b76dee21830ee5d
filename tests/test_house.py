"""The house rules of issue 38, checked on the source: the training step readable in one file (trainer.py at most
300 lines), no class over 300 lines and no function over 60 in remax_megatron/ (tools/ and tests/ excepted)."""

import ast
import os

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "remax_megatron")


def _sizes():
    for top, _, names in os.walk(PACKAGE):
        for name in sorted(n for n in names if n.endswith(".py")):
            path = os.path.join(top, name)
            with open(path) as f:
                tree = ast.parse(f.read())
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    yield os.path.relpath(path, PACKAGE), node, node.end_lineno - node.lineno + 1


def test_the_trainer_fits_in_one_sitting():
    with open(os.path.join(PACKAGE, "trainer.py")) as f:
        lines = len(f.readlines())
    assert lines <= 300, f"remax_megatron/trainer.py has {lines} lines: move a piece of the step to its own module"


def test_no_function_over_60_lines_and_no_class_over_300():
    too_long = [f"{path}: {node.name} ({length} lines)" for path, node, length in _sizes()
                if length > (300 if isinstance(node, ast.ClassDef) else 60)]
    assert not too_long, "split these into well-named pieces: " + "; ".join(too_long)
