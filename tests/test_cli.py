import subprocess
import sys

import pytest

from moegemm.kernels.tl_source import interpreter_usable


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


def test_peer_figures_load_from_bench_data_and_are_optional(tmp_path, monkeypatch):
    """The quoted peer figures live in bench/data/peers.json, outside the package: the benchmark
    reads them when the file is there and leaves the peer columns out when it is not."""
    import json

    from moegemm import benchmark

    monkeypatch.delenv("MOEGEMM_PEERS", raising=False)
    peers = benchmark.load_peers()
    assert benchmark.PEERS_FILE.is_file(), "a source checkout carries bench/data/peers.json"
    assert peers["format"] == "fp8_block" and peers["peer"] and peers["gpu"] and peers["source"]
    assert peers["figures"][("t-6144x7168", 4, 8192)] == 1260
    shapes = {**benchmark.MODEL_SHAPES, **benchmark.TARGET_SHAPES}
    assert all(shape in shapes for shape, _, _ in peers["figures"])
    assert benchmark.load_peers(tmp_path / "absent.json") == {}
    monkeypatch.setenv("MOEGEMM_PEERS", str(tmp_path / "absent.json"))
    assert benchmark.load_peers() == {}
    own = tmp_path / "peers.json"
    own.write_text(json.dumps(dict(peer="p", source="s", gpu="g", format="bf16", unit="u",
                                   rows=[dict(shape="dsv3-up", groups=8, nominal=4096, value=1.5)])))
    monkeypatch.setenv("MOEGEMM_PEERS", str(own))
    assert benchmark.load_peers()["figures"] == {("dsv3-up", 8, 4096): 1.5}


def test_bench_table_has_peer_columns_only_with_peer_figures(capsys):
    from moegemm import benchmark

    row = benchmark.Row("fp8_block", "dsv3-up", 4096, 7168, 8, 4096, 32768, ms=1.0, peer_figure=1000.0, vs_peer=0.9)
    benchmark.print_table([row])
    without = capsys.readouterr().out
    benchmark.print_table([row], peer="DeepGEMM")
    with_peer = capsys.readouterr().out
    assert "xpeer" not in without and "1000.00" not in without
    assert "xpeer" in with_peer and "1000.00" in with_peer


def test_provenance_names_script_and_commit(monkeypatch):
    from moegemm import benchmark

    monkeypatch.setenv("MOEGEMM_COMMIT", "abc1234")
    assert benchmark.provenance("bench/x.py") == {"script": "bench/x.py", "commit": "abc1234", "dirty": None}
    monkeypatch.delenv("MOEGEMM_COMMIT")
    record = benchmark.provenance("bench/x.py")
    assert record["script"] == "bench/x.py" and record["commit"]
