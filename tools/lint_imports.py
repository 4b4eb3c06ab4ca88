"""Check the import-linter contracts in pyproject.toml against the package as it installs.

``codecs/`` and ``adapters/`` install as ``scd_store.codecs`` and ``scd_store.adapters`` through
``[tool.setuptools.package-dir]``; import-linter (grimp) walks one directory per top-level
package and would not see them. So the ``.py`` files are laid out as the wheel lays them out, in
a temporary directory, and the contracts are checked there. Exit status: import-linter's.

    python tools/lint_imports.py
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent


def installed_layout(dest: Path) -> None:
    """Copy every ``.py`` file of the distribution's packages to where an install puts it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    tool = project["tool"]["setuptools"]
    mapped = tool.get("package-dir", {})
    for package in tool["packages"]:
        source = ROOT / Path(*package.split("."))
        for prefix, folder in mapped.items():
            if package == prefix or package.startswith(prefix + "."):
                source = ROOT / folder / Path(*package[len(prefix):].lstrip(".").split("."))
        target = dest / Path(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for file in source.glob("*.py"):
            shutil.copy2(file, target / file.name)


def lint(layout: Path) -> subprocess.CompletedProcess[str]:
    """Run import-linter on an installed layout (with pyproject.toml's contracts); output captured."""
    shutil.copy2(ROOT / "pyproject.toml", layout / "pyproject.toml")
    env = {**os.environ, "PYTHONPATH": str(layout)}
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    return subprocess.run([sys.executable, "-c", code], cwd=layout, env=env, check=False, capture_output=True,
                          text=True)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="scd-store-layers-") as tmp:
        installed_layout(Path(tmp))
        result = lint(Path(tmp))
        print(result.stdout + result.stderr, end="")
        return result.returncode


if __name__ == "__main__":
    sys.exit(main())
