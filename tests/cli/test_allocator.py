import os
import platform
import subprocess
import sys

import pytest

CODE = "from scd_store.cli.allocator import keep_freed_blocks; print(keep_freed_blocks())"


def _run(**env: str) -> str:
    done = subprocess.run([sys.executable, "-c", CODE], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_the_cli_process_keeps_freed_large_blocks_unless_told_not_to():
    assert "M_MMAP_MAX=0" in _run(SCD_STORE_GLIBC_MMAP="0")
    assert _run(SCD_STORE_GLIBC_MMAP="1").startswith("glibc default")
