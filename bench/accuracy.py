"""Measure each GPU backend's error against the fp64 reference (the numbers behind the
tolerance table in tests/cases.py), on large groups (prefill kernels) and on groups of ~10
tokens (decode kernels: sm90 runs mxfp8 there on fp8 tensor cores, kernels/sm90/mxfp8.py).

    python bench/accuracy.py [DIR]     writes DIR/accuracy-<gpu>.json (default bench/results), with
                                       this script and the commit of the tree (MOEGEMM_COMMIT overrides)
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import moegemm  # noqa: E402
from moegemm.benchmark import provenance  # noqa: E402

from cases import TOKEN_PATTERNS, TokenPattern, make_problem, reference_and_bound  # noqa: E402

out_dir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("bench/results")
PATTERNS = {"prefill": TOKEN_PATTERNS[3], "decode": TokenPattern("decode", (10, ) * 24)}
results = []
for backend, fmts in (("triton", list(moegemm.FORMATS)), ("sm90", list(moegemm.FORMATS))):
    for fmt, (regime, pattern) in ((f, item) for f in fmts for item in PATTERNS.items()):
        layout = "swizzled" if moegemm.FORMATS[fmt].swizzle_capable else "plain"
        for out_dtype in (torch.bfloat16, torch.float32):
            worst_norm = worst_elem = 0.0
            for trial in range(3):
                p = make_problem(fmt, layout, pattern, 512, 2048, "cuda")
                out = moegemm.grouped_matmul(*p.args(), **p.kwargs(), out_dtype=out_dtype, backend=backend)
                ref, bound = reference_and_bound(p)
                valid = p.valid_rows().cuda()
                diff = (out.double() - ref)[valid]
                out_rel = 2.0**-8 if out_dtype == torch.bfloat16 else 2.0**-23
                # the accumulation error left after the output rounding, relative to sum |a*b|
                excess = (diff.abs() - out_rel * ref[valid].abs()).clamp(min=0) / bound[valid].clamp(min=1e-30)
                worst_norm = max(worst_norm, float(diff.norm() / ref[valid].norm()))
                worst_elem = max(worst_elem, float(excess.max()))
            results.append(dict(backend=backend, fmt=fmt, regime=regime, out_dtype=str(out_dtype),
                                normalized=worst_norm, elementwise_per_sum_abs=worst_elem))
            print(f"{backend:<7} {fmt:<10} {regime:<8} {str(out_dtype):<15} normalized {worst_norm:.2e}  "
                  f"elementwise/sum|ab| {worst_elem:.2e}")
out_dir.mkdir(parents=True, exist_ok=True)
name = torch.cuda.get_device_name().replace(" ", "-")
(out_dir / f"accuracy-{name}.json").write_text(json.dumps(
    {**provenance("bench/accuracy.py"), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
     "rows": results}, indent=1))
