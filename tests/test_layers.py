"""The layering of pyproject.toml's import-linter contracts holds, and a violation would be caught."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parent.parent / "tools" / "lint_imports.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("lint_imports", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["lint_imports"] = module
    spec.loader.exec_module(module)
    return module


def test_the_package_keeps_its_import_contracts(tool, tmp_path):
    tool.installed_layout(tmp_path)
    assert (tmp_path / "scd_store" / "codecs" / "scd" / "codec.py").is_file()  # package-dir mapping applied
    assert (tmp_path / "scd_store" / "adapters" / "lmcache" / "plugin.py").is_file()
    result = tool.lint(tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


@pytest.mark.parametrize("module, bad_import", [
    ("scd_store/store/keys.py", "import scd_store.codecs.scd.codec"),  # the store knows no codec
    ("scd_store/service/bindings.py", "import scd_store.adapters.lmcache.plugin"),  # nothing imports upward
    ("scd_store/adapters/transformers/capture.py", "import scd_store.bench.quality"),
    ("scd_store/adapters/sglang/pages.py", "import scd_store.adapters.lmcache.layout"),  # adapters stay apart
    ("scd_store/adapters/vllm/hashing.py", "import scd_store.store.keys"),  # adapters reach the store via the service
    ("scd_store/adapters/transformers/capture.py", "from scd_store.store.stats import StoreStats"),
])
def test_a_broken_layer_is_reported(tool, tmp_path, module, bad_import):
    tool.installed_layout(tmp_path)
    path = tmp_path / module
    path.write_text(path.read_text() + f"\n{bad_import}\n")
    result = tool.lint(tmp_path)
    assert result.returncode != 0 and "BROKEN" in result.stdout


def test_an_adapter_importing_the_store_breaks_the_service_contract(tool, tmp_path):
    tool.installed_layout(tmp_path)
    path = tmp_path / "scd_store" / "adapters" / "lmcache" / "plugin.py"
    path.write_text(path.read_text() + "\nfrom scd_store.store.keys import chunk_hashes\n")
    result = tool.lint(tmp_path)
    assert result.returncode != 0
    assert "engine adapters reach the store only through the service BROKEN" in result.stdout
