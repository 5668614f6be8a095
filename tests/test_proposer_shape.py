"""The proposer wing stays readable (issue 33): no function in quickdraft/proposers over 80 lines."""
import ast
from pathlib import Path

import quickdraft.proposers

LONGEST = 80


def test_no_proposer_function_is_over_80_lines() -> None:
    folder = Path(quickdraft.proposers.__file__).parent
    lengths = {f"{path.name}:{node.name}": node.end_lineno - node.lineno + 1
               for path in folder.glob("*.py")
               for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    assert len(lengths) > 50  # the premise: the wing's functions were found
    assert {name: n for name, n in lengths.items() if n > LONGEST} == {}
