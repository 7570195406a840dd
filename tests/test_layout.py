"""The test suite's own layout: test files share code through helper modules (`*_support.py`,
`official.py`, `figures.py`) and fixtures through conftest.py, never by importing each other."""
import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):  # function-level imports too
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_no_test_file_imports_another():
    files = sorted(TESTS.rglob("*.py"))
    assert len([f for f in files if f.name.startswith("test_")]) > 1
    bad = {str(f.relative_to(TESTS)): sorted(m for m in imported_modules(f) if m.startswith("test_"))
           for f in files if "fixtures" not in f.parts}
    assert not {k: v for k, v in bad.items() if v}, "move what is shared into a *_support.py module or conftest.py"


def test_the_check_sees_a_function_level_import(tmp_path):
    f = tmp_path / "test_x.py"
    f.write_text("def test_a():\n    from test_report import make_run\n")
    assert imported_modules(f) == {"test_report"}
