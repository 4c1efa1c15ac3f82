"""The layer bench's rows (bench/moe_layer.py, bench/layer_models.py) planned on the CPU."""

import sys
from pathlib import Path

import pytest
import torch

import moegemm
from moegemm.formats import FORMATS

BENCH = str(Path(__file__).resolve().parents[1] / "bench")


def bench_modules():
    """bench/layer_models.py and bench/moe_layer.py, imported as the bench scripts import each other."""
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import layer_models
    import moe_layer

    return layer_models, moe_layer


def test_layer_table_rows_per_model():
    """DeepSeek-V3: fp8_block and mxfp8 at every token count (mxfp8 at 4096 included); gpt-oss-120b:
    mxfp4 and bf16 at every count, the weight-only bf16_mxfp4 at 64 and 4096 where FORMATS has it."""
    layer_models, moe_layer = bench_modules()
    ds, go = layer_models.MODELS["DeepSeek-V3"], layer_models.MODELS["gpt-oss-120b"]
    tokens = moe_layer.TOKENS
    ds_rows = moe_layer.table_rows(ds, moe_layer.layer_fmts(ds), tokens)
    assert ds_rows == [(fmt, t) for fmt in ("fp8_block", "mxfp8") for t in tokens]
    assert ("mxfp8", 4096) in ds_rows
    go_rows = moe_layer.table_rows(go, moe_layer.layer_fmts(go), tokens)
    want = [(fmt, t) for fmt in ("mxfp4", "bf16") for t in tokens]
    if "bf16_mxfp4" in FORMATS:
        want += [("bf16_mxfp4", 64), ("bf16_mxfp4", 4096)]
        assert "bf16_mxfp4" in moe_layer.TOL
        # other token counts (--tokens) keep the weight-only rows to theirs
        assert moe_layer.table_rows(go, ("bf16_mxfp4",), (1, 512, 4096)) == [("bf16_mxfp4", 4096)]
    assert go_rows == want


def test_weight_only_mxfp4_layer_weights_read_the_mxfp4_bytes():
    """The weight-only rows read the mxfp4 rows' e2m1 codes (prepacked, as MoE.load_mxfp4 keeps
    them) and e8m0 scales: the same weight bytes for ours / weight read."""
    if "bf16_mxfp4" not in FORMATS:
        pytest.skip("bf16_mxfp4 is not in moegemm.formats.FORMATS in this tree")
    layer_models, _ = bench_modules()
    cfg = layer_models.SMOKE_MODELS["tiny-gpt-oss"]
    weights = layer_models.build_weights(cfg, 1, torch.device("cpu"))
    mx_gu, mx_dn = weights.ours("mxfp4")
    gu, dn = weights.ours("bf16_mxfp4")
    e, h, i = cfg["experts"], cfg["hidden"], cfg["width"]
    for q, mx, n, k in ((gu, mx_gu, 2 * i, h), (dn, mx_dn, h, i)):
        assert q.fmt == "bf16_mxfp4" and q.scale_layout == "swizzled"
        assert q.prepacked and torch.equal(moegemm.unpack_weights(q).data, mx.data) and q.scales is mx.scales
        assert q.data.shape == (e, n, k // 2) and q.scales.dtype == torch.float8_e8m0fnu
    e2m1_e8m0 = (2 * i * h + h * i) * (0.5 + 1 / 32)  # bytes per expert
    assert layer_models.weight_bytes_per_expert(gu, dn) == e2m1_e8m0
    assert weights.ours("bf16_mxfp4") is weights.ours("bf16_mxfp4")


def test_hf_generate_runs_on_the_cpu(tmp_path):
    """bench/hf_generate.py --cpu-smoke: toy gpt-oss and Qwen3-MoE models through every backend row,
    each moegemm row's experts checked against grouped_mm's (exit status 0), a record written."""
    pytest.importorskip("transformers")
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import json

    import hf_generate

    assert hf_generate.main(["--cpu-smoke", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "hf-generate-cpu.json").read_text())
    rows = {(r["model"], r["impl"]): r for r in record["rows"]}
    assert rows[("tiny-gpt-oss", "moegemm:bf16")]["check_err"] < 2e-2
    assert all(r["eager_b2_tok_s"] > 0 for r in rows.values())
    assert record["record"]["script"] == "bench/hf_generate.py"


def test_host_python_layer_mode_rows_and_launches():
    """bench/host_python.py --layer (a process of its own: it fakes a Hopper and stubs every launch):
    a row per format at 1 and 64 tokens, each naming the routing kernels, the format's product
    kernels and the combine."""
    import subprocess

    run = subprocess.run([sys.executable, str(Path(BENCH) / "host_python.py"), "--layer", "--formats", "bf16,mxfp8",
                          "--calls", "2"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    rows = [line for line in run.stdout.splitlines() if line and not line.startswith("#")]
    assert [row.split()[:2] for row in rows] == [["bf16", "T=1"], ["bf16", "T=64"], ["mxfp8", "T=1"],
                                                 ["mxfp8", "T=64"]]
    for row, product in zip(rows, ("dense_kernel", "dense_kernel", "mxfp8_kernel", "mxfp8_kernel")):
        assert float(row.split()[3]) > 0 and row.split()[4] == "us"
        assert "routing_histogram_kernel, routing_offsets_kernel, routing_scatter_kernel" in row
        assert product in row and "routing_combine_kernel" in row
