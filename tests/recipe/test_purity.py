"""The recipe layer and its command import neither torch, SGLang nor a Kubernetes client."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import sglang_m3.recipe

RECIPE_PACKAGE = Path(sglang_m3.recipe.__file__).parent
COMMAND = RECIPE_PACKAGE.parent / "commands" / "recipe.py"
ALLOWED_THIRD_PARTY = {"pydantic", "yaml"}


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_sources_import_only_pydantic_yaml_and_the_standard_library():
    for path in [*RECIPE_PACKAGE.glob("*.py"), COMMAND]:
        third_party = imported_roots(path) - set(sys.stdlib_module_names) - {"sglang_m3"}
        assert third_party <= ALLOWED_THIRD_PARTY, (path.name, third_party)


def test_using_the_recipe_command_loads_no_heavy_module():
    script = (
        "import sys, argparse\n"
        "from sglang_m3.commands import recipe\n"
        "p = argparse.ArgumentParser(); recipe.register(p.add_subparsers(dest='c'))\n"
        "a = p.parse_args(['recipe', 'validate', 'recipes', '--output', 'json'])\n"
        "import contextlib, io\n"
        "with contextlib.redirect_stdout(io.StringIO()): code = a.handler(a)\n"
        "heavy = [m for m in ('torch', 'sglang', 'kubernetes', 'kopf') if m in sys.modules]\n"
        "print(code, heavy)\n"
    )
    repo = RECIPE_PACKAGE.parents[1]
    done = subprocess.run([sys.executable, "-c", script], cwd=repo, capture_output=True,
                          text=True, timeout=900, check=True)
    assert done.stdout.strip() == "0 []"
