import importlib.metadata
import math
import subprocess
import sys

import pytest
import torch

from moegemm.kernels.tl_source import interpreter_usable


def run(*args):
    return subprocess.run([sys.executable, "-m", "moegemm", *args], capture_output=True, text=True, timeout=600)


def test_info_prints_versions_and_backends():
    result = run("info")
    assert result.returncode == 0, result.stderr
    for word in ("moegemm", "torch", "triton", "numpy", "backends on cpu", "formats"):
        assert word in result.stdout
    try:  # (make test prints these versions first: the one it runs with)
        transformers = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers = "not installed"
    assert f"transformers {transformers}\n" in result.stdout


@pytest.mark.skipif(not interpreter_usable(), reason="the CPU demo runs the kernel under triton's interpreter")
def test_demo_on_cpu_reports_every_format():
    result = run("demo", "--cpu")
    assert result.returncode == 0, result.stderr
    product, layer = result.stdout.split("\nMoE layer")
    rows = {line.split()[0]: line.split() for line in product.splitlines() if line.split()}
    layer_rows = {line.split()[0]: line.split() for line in layer.splitlines()[2:] if line.split()}
    # The layer against fp32 math on unquantized weights: quantization error, by format.
    # (the weight-only formats' error is their weights' quantization: as their block formats')
    layer_bound = {"bf16": 2e-2, "fp8_block": 0.12, "mxfp8": 0.12, "mxfp4": 0.45, "nvfp4": 0.4, "w4a8": 0.35,
                   "bf16_mxfp4": 0.45, "bf16_nvfp4": 0.4, "bf16_mxfp8": 0.12}
    for fmt in layer_bound:
        err = float(rows[fmt][3])
        assert err < 4e-3, f"{fmt}: error vs reference {err}"
        # the product against the unquantized one: at most the layer's quantization bound
        assert float(rows[fmt][4]) < layer_bound[fmt], f"{fmt}: quantization error {rows[fmt][4]}"
        assert float(layer_rows[fmt][1]) < layer_bound[fmt], f"{fmt}: layer error {layer_rows[fmt][1]}"


def test_peer_figures_load_from_bench_data_and_are_optional(tmp_path, monkeypatch):
    """The quoted peer figures live in bench/data/peers.json, outside the package: the benchmark
    reads them when the file is there and leaves the peer columns out when it is not."""
    import json

    from moegemm import benchmark, benchmark_rows

    monkeypatch.delenv("MOEGEMM_PEERS", raising=False)
    peers = benchmark.load_peers()
    assert benchmark.PEERS_FILE.is_file(), "a source checkout carries bench/data/peers.json"
    assert peers["format"] == "fp8_block" and peers["peer"] and peers["gpu"] and peers["source"]
    assert peers["figures"][("t-6144x7168", 4, 8192)] == 1260
    shapes = {**benchmark_rows.MODEL_SHAPES, **benchmark_rows.TARGET_SHAPES}
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


WEIGHT_ONLY = ("bf16_mxfp4", "bf16_nvfp4", "bf16_mxfp8")


def test_model_formats_preset_rows_every_format_fp8_block_first():
    """Every format on 4 shapes x 4 regimes, key by key; fp8_block first in each key (the other
    rows' xfp8b reads its time), bf16 next (its row times the BF16 baseline the others reuse)."""
    from moegemm import benchmark_rows
    from moegemm.formats import FORMATS

    rows = benchmark_rows.select_rows("model-formats")
    shapes = ("dsv3-up", "dsv3-down", "gptoss-up", "gptoss-down")
    regimes = ((256, 16), (32, 32), (64, 128), (8, 4096))
    assert len(rows) == len(FORMATS) * len(shapes) * len(regimes)
    keys = list(dict.fromkeys((shape, g, t) for _, shape, g, t in rows))
    assert keys == [(shape, g, t) for shape in shapes for g, t in regimes]
    shapes = benchmark_rows.MODEL_SHAPES
    assert shapes["dsv3-up"] == (4096, 7168) and shapes["dsv3-down"] == (7168, 2048)
    assert shapes["gptoss-up"] == (5760, 2880) and shapes["gptoss-down"] == (2880, 2880)
    for key in keys:
        fmts = [fmt for fmt, *rest in rows if tuple(rest) == key]
        assert fmts[:2] == ["fp8_block", "bf16"] and sorted(fmts) == sorted(FORMATS), (key, fmts)
    weight_only = [f for f in WEIGHT_ONLY if f in FORMATS]
    assert benchmark_rows.WEIGHT_ONLY_FORMATS == tuple(weight_only)
    assert not set(weight_only) & set(benchmark_rows.BLOCK_FORMATS)
    # the default rows and formats stay those without the preset
    assert benchmark_rows.DEFAULT_FORMATS == ("fp8_block", "bf16", "mxfp8", "mxfp4", "nvfp4", "w4a8")
    assert benchmark_rows.select_rows() == benchmark_rows.default_rows()


def test_bench_formats_and_only_combine_with_the_preset():
    from moegemm import benchmark_rows

    rows = benchmark_rows.select_rows("model-formats", formats="mxfp4,fp8_block", only="gptoss-down,dsv3-up 8x4096")
    regimes = ((256, 16), (32, 32), (64, 128), (8, 4096))
    assert rows == [(fmt, "dsv3-up", 8, 4096) for fmt in ("fp8_block", "mxfp4")] + \
        [(fmt, "gptoss-down", g, t) for g, t in regimes for fmt in ("fp8_block", "mxfp4")]
    assert benchmark_rows.select_rows("model-formats", only="nothing-matches") == []
    with pytest.raises(ValueError, match="not in FORMATS"):
        benchmark_rows.select_rows("model-formats", formats="mxfp4,fp4x")
    with pytest.raises(ValueError, match="preset"):
        benchmark_rows.select_rows("no-such-preset")


def test_bench_dry_run_lists_the_preset_rows_without_a_gpu():
    from moegemm.formats import FORMATS

    result = run("bench", "--preset", "model-formats", "--only", "gptoss-up 32x32", "--dry-run")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == f"{len(FORMATS)} rows"
    assert lines[0] == "fp8_block gptoss-up 32x32" and len(lines) == len(FORMATS) + 1
    result = run("bench", "--formats", "fp4x", "--dry-run")
    assert result.returncode == 2 and "not in FORMATS" in result.stdout


@pytest.mark.parametrize("fmt", WEIGHT_ONLY)
def test_bench_inputs_of_a_weight_only_format(fmt):
    """bf16 A without scales; B, its scales and nvfp4's global scales (as expert_scales) as the
    block format of the same weights builds them."""
    from moegemm import benchmark_inputs
    from moegemm.formats import FORMATS

    if fmt not in FORMATS:
        pytest.skip(f"{fmt} is not in moegemm.formats.FORMATS in this tree")
    sizes = [37, 130, 0, 5]
    n, k, m = 256, 512, sum(sizes)
    block = benchmark_inputs.Inputs(fmt.removeprefix("bf16_"), n, k, sizes, "cpu")
    inp = benchmark_inputs.Inputs(fmt, n, k, sizes, "cpu")
    assert inp.a.dtype == torch.bfloat16 and inp.a.shape == (m, k) and inp.a_scales is None
    assert inp.scale_layout == block.scale_layout == "swizzled"
    assert (inp.b.dtype, inp.b.shape) == (block.b.dtype, block.b.shape)
    assert (inp.b_scales.dtype, inp.b_scales.shape) == (block.b_scales.dtype, block.b_scales.shape)
    if FORMATS[fmt].global_scale:
        assert inp.expert_scales.dtype == torch.float32 and inp.expert_scales.shape == (len(sizes),)
        assert block.expert_scales.shape == (len(sizes),)
    else:
        assert inp.expert_scales is None
    f = FORMATS[fmt]
    weights = 3 * n * k * (f.b.element.bits / 8 + 1 / f.b.block_k)  # three experts have tokens
    assert inp.bytes_moved() == weights + m * k * 2 + m * n * 2
    out = inp.ours()  # the reference backend on the CPU
    assert out.shape == (m, n) and bool(torch.isfinite(out).all())


def test_bench_run_times_fp8_block_first_and_the_bf16_baseline_once_per_key(monkeypatch, tmp_path):
    """run() on the preset's rows with the timing and the GPU faked: every row but fp8_block gets
    vs_fp8_block, and the BF16 torch baseline is timed once per key, reused by the bf16, block
    and weight-only rows."""
    from moegemm import benchmark, benchmark_rows

    timed = []

    class FakeInputs:
        def __init__(self, fmt, n, k, sizes, device):
            self.fmt, self.sizes = fmt, sizes

        def ours(self):
            pass

        def torch_baseline(self):
            pass

        def bytes_moved(self):
            return 1.0

    def fake_time_both(fn, warmup_ms):
        assert warmup_ms == benchmark_rows.PRESETS["model-formats"].warmup_ms
        timed.append((fn.__self__.fmt, fn.__name__))
        return (2.0, 2.5) if fn.__self__.fmt == "fp8_block" else (1.0, 1.5)

    monkeypatch.setattr(benchmark, "Inputs", FakeInputs)
    monkeypatch.setattr(benchmark, "_time_both", fake_time_both)
    monkeypatch.setattr(benchmark, "measure_ceilings",
                        lambda device: {"copy_tbps": 3.0, "bf16_tflops": 700.0, "fp8_rowwise_tflops": 1200.0})
    monkeypatch.setattr(benchmark, "deepgemm_runner", lambda inp: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "fake GPU")
    rows = benchmark_rows.select_rows("model-formats", only="dsv3-down")
    results = benchmark.run(rows, out_dir=tmp_path, progress=False, peers={},
                            warmup_ms=benchmark_rows.PRESETS["model-formats"].warmup_ms)
    keys = {(r.shape, r.groups, r.nominal) for r in results}
    assert len(results) == len(rows) and len(keys) == 4
    baselines = [t for t in timed if t[1] == "torch_baseline"]
    assert baselines == [("fp8_block", "torch_baseline"), ("bf16", "torch_baseline")] * len(keys)
    for r in results:
        assert r.vs_torch == (2.0 / 2.0 if r.fmt == "fp8_block" else 1.0)
        assert (r.vs_fp8_block == 2.0) if r.fmt != "fp8_block" else math.isnan(r.vs_fp8_block), r
