import subprocess
import sys

import pytest

from moegemm.ops import interpreter_usable


def run(*args):
    return subprocess.run([sys.executable, "-m", "moegemm", *args], capture_output=True, text=True, timeout=600)


def test_info_prints_versions_and_backends():
    result = run("info")
    assert result.returncode == 0, result.stderr
    for word in ("moegemm", "torch", "triton", "numpy", "backends on cpu", "formats"):
        assert word in result.stdout


@pytest.mark.skipif(not interpreter_usable(), reason="the CPU demo runs the kernel under triton's interpreter")
def test_demo_on_cpu_reports_every_format():
    result = run("demo", "--cpu")
    assert result.returncode == 0, result.stderr
    product, layer = result.stdout.split("\nMoE layer")
    rows = {line.split()[0]: line.split() for line in product.splitlines() if line.split()}
    layer_rows = {line.split()[0]: line.split() for line in layer.splitlines()[2:] if line.split()}
    # The layer against fp32 math on unquantized weights: quantization error, by format.
    layer_bound = {"bf16": 2e-2, "fp8_block": 0.12, "mxfp8": 0.12, "mxfp4": 0.45, "nvfp4": 0.4, "w4a8": 0.35}
    for fmt in ("bf16", "fp8_block", "mxfp8", "mxfp4", "nvfp4", "w4a8"):
        err = float(rows[fmt][3])
        assert err < 4e-3, f"{fmt}: error vs reference {err}"
        assert float(layer_rows[fmt][1]) < layer_bound[fmt], f"{fmt}: layer error {layer_rows[fmt][1]}"
