"""No pickle, eval or exec anywhere in the package: stored and transferred bytes are our own formats."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATTERN = re.compile(r"^\s*(import|from)\s+(c?pickle|dill|cloudpickle|joblib)\b|torch\.load\(|\.get_serialized_descs\(|"
                     r"\.deserialize_descs\(|pickle\.loads?\(|(?<![\w.])(eval|exec)\(", re.M)


def test_no_module_unpickles_or_evaluates_code():
    offenders = []
    for folder in ("scd_store", "codecs", "adapters"):
        for path in (ROOT / folder).rglob("*.py"):
            if PATTERN.search(path.read_text()):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []
