"""The package's layering (DESIGN.md section 3), checked on the source: `ops/` never imports `model/`,
and `model_spec.py`, which both build on, imports nothing of the package.

Every import statement counts wherever it stands (module level, inside a function, under
`if TYPE_CHECKING:`), absolute or relative, and so does `importlib.import_module` / `__import__` of a
constant name. Each checker runs on small sources that break the rule first (its negative control).
"""

from __future__ import annotations

import ast
from pathlib import Path

import deterministic_inference

PACKAGE = "deterministic_inference"
PACKAGE_DIR = Path(deterministic_inference.__file__).parent
MODEL = f"{PACKAGE}.model"
LEAF = f"{PACKAGE}.model_spec"


def module_name(path: Path) -> str:
    """The dotted module name of a file of the package (`ops/__init__.py` -> deterministic_inference.ops)."""
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name `from <level dots><target> import ...` refers to inside `module`."""
    if level == 0:
        return target or ""
    package = module.split(".") if is_package else module.split(".")[:-1]
    base = package[: len(package) - (level - 1)]
    return ".".join([*base, target] if target else base)


def imported_names(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of everything `source` (the text of `module`) imports, anywhere in
    it: for `from a import b` both `a` and `a.b` (b may be a submodule)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if alias.name != "*"]
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func) and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                found.append((node.lineno, first.value))
    return found


def _is_dynamic_import(func: ast.expr) -> bool:
    """`importlib.import_module(...)`, `import_module(...)` or `__import__(...)`."""
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    return name in ("import_module", "__import__")


def _within(name: str, package: str) -> bool:
    """Whether dotted `name` is `package` or one of its submodules (model_spec is not within model)."""
    return name == package or name.startswith(package + ".")


def model_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """"line N imports X" for every import of the model package in `source`."""
    names = imported_names(source, module, is_package)
    return sorted({f"line {line} imports {name}" for line, name in names if _within(name, MODEL)})


def package_imports(source: str, module: str) -> list[str]:
    """"line N imports X" for every import of anything of this package in `source`."""
    names = imported_names(source, module)
    return sorted({f"line {line} imports {name}" for line, name in names if _within(name, PACKAGE)})


def ops_files() -> list[Path]:
    """Every Python module under deterministic_inference/ops/."""
    return sorted((PACKAGE_DIR / "ops").rglob("*.py"))


def test_ops_never_imports_model() -> None:
    files = ops_files()
    assert len(files) >= 20, files  # the walk found the ops package (not an empty directory)
    problems = []
    for path in files:
        source = path.read_text(encoding="utf-8")
        for problem in model_imports(source, module_name(path), path.name == "__init__.py"):
            problems.append(f"{path.relative_to(PACKAGE_DIR.parent)}: {problem}")
    assert not problems, "ops/ must not import model/ (DESIGN.md section 3):\n" + "\n".join(problems)


def test_model_spec_is_a_leaf() -> None:
    path = PACKAGE_DIR / "model_spec.py"
    problems = package_imports(path.read_text(encoding="utf-8"), LEAF)
    assert not problems, f"{path.name} must import nothing of {PACKAGE}: {problems}"


def test_model_import_checker_finds_every_form() -> None:
    """Negative control: each way of importing model/ from an ops module is reported with its line."""
    module = f"{PACKAGE}.ops.example"
    cases = {
        "import deterministic_inference.model.llama\n": "deterministic_inference.model.llama",
        "from deterministic_inference.model.moe import GatedMLP\n": "deterministic_inference.model.moe",
        "from deterministic_inference import model\n": "deterministic_inference.model",
        "from ..model.llama import DecoderLayer\n": "deterministic_inference.model.llama",
        "from .. import model\n": "deterministic_inference.model",
        "def f() -> None:\n    from ..model import moe\n": "deterministic_inference.model",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..model.llama import X\n": (
            "deterministic_inference.model.llama"
        ),
        "import importlib\nM = importlib.import_module('deterministic_inference.model.moe')\n": (
            "deterministic_inference.model.moe"
        ),
    }
    for source, name in cases.items():
        line = source.count("\n")  # each case's import is on its last line
        assert f"line {line} imports {name}" in model_imports(source, module), source


def test_model_import_checker_resolves_relative_imports_in_packages() -> None:
    """In ops/__init__.py one dot is ops itself: `from .model import x` names ops.model (not reported),
    `from ..model import x` names model/ (reported)."""
    ops_package = f"{PACKAGE}.ops"
    assert model_imports("from .model import x\n", ops_package, is_package=True) == []
    assert model_imports("from ..model import x\n", ops_package, is_package=True) == [
        "line 1 imports deterministic_inference.model",
        "line 1 imports deterministic_inference.model.x",
    ]


def test_model_import_checker_allows_the_leaf_and_ops() -> None:
    """What ops/ may import is not reported: the leaf module (a name that only starts like model) and
    other ops modules."""
    source = (
        "from deterministic_inference.model_spec import ModelSpec\n"
        "from ..model_spec import RopeScaling\n"
        "from .linear import Linear\n"
        "import torch\n"
    )
    assert model_imports(source, f"{PACKAGE}.ops.example") == []


def test_leaf_checker_reports_package_imports() -> None:
    """Negative control of the leaf rule: any import of the package, absolute or relative, is reported."""
    source = (
        "from dataclasses import dataclass\n"
        "from .errors import ModelLoadError\n"
        "import deterministic_inference\n"
    )
    assert package_imports(source, LEAF) == [
        "line 2 imports deterministic_inference.errors",
        "line 2 imports deterministic_inference.errors.ModelLoadError",
        "line 3 imports deterministic_inference",
    ]
