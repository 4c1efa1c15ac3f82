"""Variants of a kernel module built from its source at run time, for the ceiling benches
(bench/decode_ceiling.py, bench/promotion_ceiling.py): nothing of them ships."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path


def module_variant(source_path: Path, replacements, stubs: str, name: str, package: str):
    """The module at source_path with each (text, replacement) applied (each text must occur once,
    else RuntimeError: the source changed under the variant) and `stubs` appended, loaded as
    package.name (its relative imports resolve in `package`)."""
    source = Path(source_path).read_text()
    for text, replacement in replacements:
        if source.count(text) != 1:
            raise RuntimeError(f"{Path(source_path).name} changed: the variant {name} expects one {text.strip()!r}")
        source = source.replace(text, replacement)
    path = Path(os.environ.get("TMPDIR", "/tmp")) / f"moegemm{name}.py"
    path.write_text(source + stubs)
    spec = importlib.util.spec_from_file_location(f"{package}.{name}", path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = package
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
