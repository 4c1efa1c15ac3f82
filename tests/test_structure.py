"""The package's shape: modules of one job (no module over 450 lines outside the sm90 kernels,
whose files are one kernel each) and one compile boundary (only compile_boundary.py asks
torch.compile whether it is tracing)."""

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "moegemm"
MAX_LINES = 450


def _modules():
    return sorted(PACKAGE.rglob("*.py"))


def test_no_module_outside_the_sm90_kernels_exceeds_450_lines():
    sm90 = PACKAGE / "kernels" / "sm90"
    long = {str(p.relative_to(PACKAGE)): n for p in _modules() if sm90 not in p.parents
            for n in [len(p.read_text().splitlines())] if n > MAX_LINES}
    assert len(_modules()) > 30 and not long, long


def test_only_the_compile_boundary_asks_whether_torch_compile_traces():
    asking = [str(p.relative_to(PACKAGE)) for p in _modules() if "is_compiling" in p.read_text()]
    assert asking == ["compile_boundary.py"], asking
