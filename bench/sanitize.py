"""compute-sanitizer (memcheck, racecheck, synccheck) on every kernel family, one command:

    python bench/sanitize.py --out DIR          # every (tool, workload), logs and sanitize-<gpu>.json in DIR
    python bench/sanitize.py --workload NAME    # one workload, what compute-sanitizer runs

Workloads (each at a shape with several tiles per program: more tiles than 2 x the SMs; each
result also checked against the fp64 reference, so the sanitized path is the right one):
    sm90            fp8_block and bf16 (kernels/sm90/dense.py): normal, split-n and swapped tiles
    n-major         bf16 weights read N-major in place (the transpose of [E, K, N], gpt-oss's
                    layout) on normal, split-n and swapped tiles and the fused SwiGLU epilogue,
                    partial last N and K steps; each bit for bit the K-major copy's result
    mx-decoding     the bf16-decoding block-format kernel (kernels/sm90/decode.py): mxfp4, nvfp4,
                    w4a8, mxfp8 on 32-, 64-, 128- and 256-token tiles, bf16_mxfp4 (bf16 tokens)
                    on 32 and 256, unscaled and scaled calls
    prepacked       the same kernel on prepacked weights (decoded into the wgmma's registers):
                    bf16_mxfp4, nvfp4, bf16_mxfp8 and mxfp4 (tokens through the pre-pass) on
                    16-, 64-, 128- and 256-token tiles,
                    16 and 64 also on 256-row tiles (four consumer warpgroups)
    mxfp8-promotion kernels/sm90/mxfp8.py: 16- and 32-token tiles (slot walk from
                    chunks), wide 64- and 128-token tiles with tails and short tails
    e2m1-split-k    the same kernel with e2m1 weights (mxfp4, w4a8): split-K 8- and 16-token
                    tiles, and half tiles (N % 128 <= 64)
    fused-swiglu    the fused SwiGLU epilogue of every family, each output format
    routing         routing, gather/scatter quantization, SwiGLU quantization, unpermute,
                    moe_forward (Triton kernels)
    adversarial     (memcheck only) offsets past M and decreasing, expert ids >= E and < -1,
                    on every kernel family: nothing may be read or written out of bounds

racecheck reports, besides any real hazard, three handoffs that the PTX memory model orders
but racecheck does not follow: in each, several threads write (or read) a shared-memory word,
a barrier over all of them follows (bar.sync / bar.warp.sync), then ONE thread arrives on an
mbarrier (a release) that the other side waits for (an acquire). They are counted apart, each
hazard only when every access it names lies on that handoff's lines:
    dispatch   Triton's warp specialization: the default warpgroup writes the word that starts
               (and ends) the worker warps before `barrier.sync 1` of all warps, the workers read
               it after theirs (code Triton attributes to the Gluon kernel function itself, whose
               own statements touch no shared data: they allocate it and call the partitions)
    tile-id    kernels/sm90/pipeline.py Schedule.publish / receive: the producer's next tile, written
               by the producer warp, read by the consumer warpgroups (id_ready / id_free)
    split-k    kernels/sm90/e2m1.py _reduce_split_k: one K half's partial sums, written by a
               warpgroup, read by the other (red_ready / red_free)
Every other hazard in a moegemm kernel is an error (hazards inside PyTorch's own kernels, which
carry no Python line, are listed apart). racecheck runs a lighter set of calls (RACECHECK_CALLS) than
memcheck and synccheck: it instruments every shared-memory access.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

TOOLS = ("memcheck", "racecheck", "synccheck")
WORKLOADS = ("sm90", "n-major", "mx-decoding", "prepacked", "mxfp8-promotion", "e2m1-split-k", "fused-swiglu", "routing",
             "adversarial")


# ---- workloads ------------------------------------------------------------------------------

def _groups(count, lo, hi, seed, experts=8, skip=True):
    """count slots of lo..hi tokens (seeded), ids repeating over `experts`, a few skipped."""
    import torch

    from cases import TokenPattern

    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(lo, hi + 1, (count,), generator=gen).tolist()
    ids = [(-1 if skip and g % 7 == 3 else g % experts) for g in range(count)]
    return TokenPattern(f"{count}x{lo}-{hi}", tuple(tokens), tuple(ids), start=3, tail=5, experts=experts)


def _racecheck() -> bool:
    """The workload runs under racecheck: the lighter set of calls (module docstring)."""
    return os.environ.get("RACECHECK_CALLS") == "1"


def _check(fmt, layout, pattern, n, k, config=None, with_scales=True, out_dtype=None):
    """One call on the sm90 backend (config forced when given), checked against the reference."""
    import torch

    from cases import run_sm90

    run_sm90(fmt, pattern, n, k, out_dtype or torch.bfloat16, with_scales, config, layout)
    print(f"ok {fmt} {layout} {pattern.name} N={n} K={k} {config or 'default config'}", flush=True)


def workload_sm90():
    from moegemm.sm90_configs import DenseConfig

    big = _groups(8, 300, 500, 1)  # ~25 token tiles x 16 weight tiles of 128
    small = _groups(64, 1, 30, 2)
    for fmt, bk in (("fp8_block", 128), ("bf16", 64)):
        if _racecheck():
            _check(fmt, "plain", big, 2048, 128, DenseConfig(block_n=128, block_k=bk, stages=4, group_m=4))
            _check(fmt, "plain", small, 1024, 128, DenseConfig(block_n=32, block_k=bk, stages=6, group_m=1, swap=True))
            continue
        _check(fmt, "plain", big, 2048, 256, DenseConfig(block_n=128, block_k=bk, stages=4, group_m=4))
        _check(fmt, "plain", big, 2048, 256, DenseConfig(block_n=256, block_k=bk, stages=3, group_m=2))
        _check(fmt, "plain", big, 2048, 256, DenseConfig(block_n=128, block_k=bk, stages=3, group_m=4, split_n=True))
        _check(fmt, "plain", small, 1024, 256, DenseConfig(block_n=32, block_k=bk, stages=6, group_m=1, swap=True))
        _check(fmt, "plain", small, 1024, 256, with_scales=False)


def workload_n_major():
    import torch

    import moegemm
    from moegemm.config import override_config
    from moegemm.sm90_configs import DenseConfig

    from cases import check_output, make_problem, poison_like, tolerance

    big, small = _groups(8, 300, 500, 3), _groups(64, 1, 30, 4)
    cases = [(big, DenseConfig(block_n=128, block_k=64, stages=4, group_m=4)),
             (big, DenseConfig(block_n=128, block_k=64, stages=3, group_m=4, split_n=True)),
             (small, DenseConfig(block_n=32, block_k=64, stages=6, group_m=1, swap=True))]
    if not _racecheck():
        cases.append((big, DenseConfig(block_n=256, block_k=64, stages=3, group_m=2)))
    n, k = 2112, 560  # (a partial last weight tile of 128 and 256, a partial last K step of 64)
    for pattern, cfg in cases:
        p = make_problem("bf16", "plain", pattern, n, k, "cuda")
        weights = p.w.data.transpose(1, 2).contiguous().transpose(1, 2)
        poisoned = poison_like(p.m, n, torch.bfloat16, "cuda")
        outs = []
        for b in (p.w.data, weights):
            out = poisoned.clone()
            with override_config(cfg):
                moegemm.grouped_matmul(p.a.data, b, None, None, p.a_offsets, p.expert_ids, **p.kwargs(), out=out,
                                       backend="sm90")
            outs.append(out)
        check_output(p, outs[1], poisoned, tolerance("bf16", "sm90"))
        assert torch.equal(outs[1].view(torch.int16), outs[0].view(torch.int16)), f"N-major bits differ, {cfg}"
        print(f"ok bf16 N-major {pattern.name} N={n} K={k} {cfg}", flush=True)
    p = make_problem("bf16", "plain", small, 1024, 256, "cuda", with_scales=False)
    kw = dict(fmt="bf16", gate_up_layout="interleaved", activation="swiglu_oai", backend="sm90",
              bias=torch.randn(small.experts, 1024, device="cuda") * 0.1)
    outs = [moegemm.grouped_matmul_swiglu(*p.args()[:1], b, None, None, *p.args()[4:6], fused=True, **kw).data
            for b in (p.w.data, p.w.data.transpose(1, 2).contiguous().transpose(1, 2))]
    valid = p.valid_rows().to("cuda")
    assert torch.equal(outs[1][valid].view(torch.int16), outs[0][valid].view(torch.int16))
    print("ok fused SwiGLU on N-major bf16 weights", flush=True)


def workload_mx_decoding():
    from moegemm.sm90_configs import DecodeConfig

    for tokens, (lo, hi) in ((32, (10, 30)), (64, (30, 60)), (128, (60, 200)), (256, (200, 600))):
        cfg = DecodeConfig(token_tile=tokens, stages=3, group_m=1 if tokens < 128 else 4,
                           consumer_regs=240 if tokens == 256 else 192, sub_steps=2 if tokens < 128 else 1)
        pattern = _groups(64 if tokens < 128 else 24, lo, hi, tokens)
        fmts = ("mxfp4", "nvfp4", "w4a8", "mxfp8") + (("bf16_mxfp4",) if tokens in (32, 256) else ())
        for fmt in fmts[:1 if _racecheck() else len(fmts)]:
            _check(fmt, "swizzled" if fmt != "w4a8" else "plain", pattern, 1024, 256, cfg,
                   with_scales=fmt == "nvfp4" or tokens == 64)


def workload_prepacked():
    import dataclasses

    import torch

    import moegemm
    from cases import check_output, make_problem, poison_like, tolerance
    from moegemm.config import override_config
    from moegemm.sm90_configs import DecodeConfig

    # (weight_tile 256: four consumer warpgroups on each token stage, the default up to 64 tokens)
    for tokens, (lo, hi), weight_tile in ((16, (2, 16), 256), (64, (30, 60), 256), (16, (2, 16), 128),
                                          (128, (60, 200), 128), (256, (200, 600), 128)):
        wide = weight_tile == 256
        cfg = DecodeConfig(token_tile=tokens, stages=3, group_m=1 if tokens < 128 else 4,
                           consumer_regs=112 if wide else 240 if tokens == 256 else 192,
                           sub_steps=2 if tokens < 128 else 1, prepacked=True, weight_tile=weight_tile)
        pattern = _groups(64 if tokens < 128 else 24, lo, hi, tokens)
        fmts = ("bf16_mxfp4", "nvfp4", "bf16_mxfp8", "mxfp4")
        for fmt in fmts[:1 if _racecheck() else len(fmts)]:
            p = make_problem(fmt, "swizzled", pattern, 1024, 256, "cuda", with_scales=tokens == 64)
            # (nvfp4's global scales are in p.expert_scales already)
            a, w = (dataclasses.replace(q, global_scale=None) for q in (p.a, p.w))
            poisoned = poison_like(p.m, p.n, torch.bfloat16, "cuda")
            out = poisoned.clone()
            with override_config(cfg):
                moegemm.grouped_matmul(a, moegemm.prepack_weights(w), None, None, p.a_offsets, p.expert_ids,
                                       fmt=fmt, expert_scales=p.expert_scales, row_scales=p.row_scales, out=out,
                                       backend="sm90")
            check_output(p, out, poisoned, tolerance(fmt, "sm90"))
            print(f"ok {fmt} prepacked {pattern.name} N=1024 K=256 {cfg}", flush=True)


def workload_mxfp8_promotion():
    from moegemm.config import sm90_mx_config
    from moegemm.formats import FORMATS

    # (from ~200 tokens a slot mxfp8 runs the decoding kernel's 256-token tiles: mx-decoding)
    for tokens_per_slot, (lo, hi) in ((12, (1, 20)), (20, (8, 30)), (40, (30, 60)), (150, (120, 180))):
        cfg = sm90_mx_config(FORMATS["mxfp8"], 1024, 256, tokens_per_slot)
        groups = 64 if tokens_per_slot < 100 else 24 if tokens_per_slot < 500 else 6
        if _racecheck() and tokens_per_slot not in (12, 150):
            continue
        for layout in ("plain", "swizzled")[:1 if _racecheck() else 2]:
            _check("mxfp8", layout, _groups(groups, lo, hi, tokens_per_slot), 1024, 256, cfg,
                   with_scales=layout == "plain")


def workload_e2m1_split_k():
    from moegemm.config import sm90_mx_config
    from moegemm.formats import FORMATS

    for fmt in ("mxfp4", "w4a8")[:1 if _racecheck() else 2]:
        for tokens_per_slot, (lo, hi) in ((2, (1, 4)), (8, (4, 14))):
            cfg = sm90_mx_config(FORMATS[fmt], 1024, 512, tokens_per_slot)
            assert cfg.split_k, cfg
            for layout in ("plain", "swizzled")[:1 if _racecheck() else 2]:
                _check(fmt, layout, _groups(96, lo, hi, tokens_per_slot), 1024, 512, cfg, with_scales=layout == "plain")
        half = sm90_mx_config(FORMATS[fmt], 1088, 480, 2)  # N % 128 = 64: the producer's half tiles
        _check(fmt, "swizzled", _groups(96, 1, 4, 5), 1088, 480, half)


def workload_fused_swiglu():
    import torch

    import moegemm

    from cases import make_problem

    cases = [("bf16", "mxfp8", _groups(64, 1, 30, 11)), ("bf16", "nvfp4", _groups(6, 300, 600, 12)),
             ("mxfp8", "bf16", _groups(64, 1, 30, 13)), ("mxfp8", "mxfp8", _groups(24, 120, 180, 14)),
             ("mxfp4", "mxfp4", _groups(96, 1, 4, 15)), ("mxfp4", "mxfp8", _groups(64, 10, 30, 16)),
             ("nvfp4", "nvfp4", _groups(24, 60, 200, 17)), ("w4a8", "mxfp8", _groups(96, 4, 14, 18))]
    for fmt, out_fmt, pattern in cases:
        layout = "swizzled" if fmt != "bf16" else "plain"
        p = make_problem(fmt, layout, pattern, 1024, 256, "cuda")
        kw = dict(fmt=fmt, gate_up_layout="interleaved", out_fmt=out_fmt, activation="swiglu_oai",
                  expert_scales=p.expert_scales, bias=torch.randn(pattern.experts, 1024, device="cuda") * 0.1,
                  scale_layout=layout,
                  out_global_scale=torch.tensor(0.01, device="cuda") if out_fmt == "nvfp4" else None,
                  backend="sm90")
        fused = moegemm.grouped_matmul_swiglu(*p.args()[:6], fused=True, **kw)
        unfused = moegemm.grouped_matmul_swiglu(*p.args()[:6], fused=False, **kw)
        valid = p.valid_rows().to("cuda")
        got, want = moegemm.dequantize(fused)[valid], moegemm.dequantize(unfused)[valid]
        err = float((got - want).norm() / want.norm())
        assert err < 0.2, f"fused {fmt} -> {out_fmt}: {err:.3e} from the unfused chain"
        print(f"ok fused {fmt} -> {out_fmt} {pattern.name}: {err:.2e} from the unfused chain", flush=True)


def workload_routing():
    import torch

    import moegemm
    from moegemm import token_quantizers

    torch.manual_seed(0)
    h, i, e, top_k, t = 256, 128, 16, 4, 300
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(-1, e + 2, (t, top_k), dtype=torch.int32, device="cuda")  # dropped choices too
    plan = moegemm.route(ids, e, torch.rand(t, top_k, device="cuda"))
    for fmt in ("bf16", "fp8_block", "mxfp8", "mxfp4", "nvfp4", "w4a8"):
        layout = "swizzled" if fmt not in ("bf16", "fp8_block", "w4a8") else "plain"
        token_quantizers.scatter_quantize(x, fmt, plan.grouped_row, moegemm.routing.row_experts(plan),
                                          a_offsets=plan.a_offsets, scale_layout=layout,
                                          num_scale_blocks=plan.scale_blocks_bound)
        token_quantizers.gather_quantize(x, fmt, plan.token_index, a_offsets=plan.a_offsets, scale_layout=layout,
                                         num_scale_blocks=plan.scale_blocks_bound)
        h2 = torch.randn(plan.num_grouped_rows, 2 * i, device="cuda")
        token_quantizers.swiglu_quantize(h2, fmt, gate_up_layout="concat" if fmt == "fp8_block" else "interleaved",
                                         a_offsets=plan.a_offsets, expert_ids=plan.expert_ids, scale_layout=layout,
                                         num_scale_blocks=plan.scale_blocks_bound)
    moegemm.unpermute_tokens(torch.randn(plan.num_grouped_rows, h, device="cuda"), plan)
    for fmt in ("mxfp8", "fp8_block", "mxfp4"):
        layer = moegemm.MoE(h, i, e, top_k, fmt=fmt, device="cuda").load_experts(
            gate=torch.randn(e, i, h, device="cuda") * 0.1, up=torch.randn(e, i, h, device="cuda") * 0.1,
            down=torch.randn(e, h, i, device="cuda") * 0.1)
        w_gate_up, w_down = layer.weights()
        y = moegemm.moe_forward(x, ids, torch.rand(t, top_k, device="cuda"), w_gate_up, w_down,
                                gate_up_layout=layer.gate_up_layout)
        torch.cuda.synchronize()
        assert bool(torch.isfinite(y).all())
        print(f"ok routing, quantizers and moe_forward {fmt}", flush=True)


def workload_adversarial():
    """Bad offsets and ids reach the kernels unchecked (value checks run only on the CPU and under
    MOEGEMM_DEBUG=1): they must still read and write nothing out of bounds."""
    import torch

    import moegemm
    from moegemm.config import override_config, sm90_mx_config
    from moegemm.formats import FORMATS
    from moegemm.sm90_configs import DecodeConfig, DenseConfig

    assert os.environ.get("MOEGEMM_DEBUG", "0") in ("", "0")
    m, n, k, e = 300, 1024, 256, 4
    offsets = {"past M": [0, 100, 250, 400, 900], "decreasing": [0, 200, 120, 300, 180],
               "negative": [-50, 10, 40, 60, 70]}
    ids = {"ids >= E": [0, 7, 1, 99], "ids < -1": [-5, 2, -1000, 3], "mixed": [3, -2, 8, 0]}
    configs = [("fp8_block", None), ("bf16", DenseConfig(block_n=32, block_k=64, stages=6, group_m=1, swap=True)),
               ("mxfp4", None), ("nvfp4", DecodeConfig(token_tile=32, stages=3, group_m=1, consumer_regs=192,
                                                      sub_steps=2)),
               ("mxfp8", sm90_mx_config(FORMATS["mxfp8"], n, k, 150)),
               ("mxfp4", sm90_mx_config(FORMATS["mxfp4"], n, k, 2))]
    for fmt, cfg in configs:
        layout = "plain"
        qa = moegemm.quantize(torch.randn(m, k, device="cuda"), fmt, scale_layout=layout)
        qw = moegemm.quantize_weights(torch.randn(e, n, k, device="cuda"), fmt, scale_layout=layout)
        for (oname, off), (iname, eid) in zip(offsets.items(), ids.items()):
            a_offsets = torch.tensor(off, dtype=torch.int32, device="cuda")
            expert_ids = torch.tensor(eid, dtype=torch.int32, device="cuda")
            for backend in ("sm90", "triton"):
                out = torch.zeros(m, n, dtype=torch.bfloat16, device="cuda")
                args = (qa.data, qw.data, qa.scales, qw.scales, a_offsets, expert_ids)
                if cfg is not None and backend == "sm90":
                    with override_config(cfg):
                        moegemm.grouped_matmul(*args, fmt=fmt, scale_layout=layout, out=out, backend=backend)
                else:
                    moegemm.grouped_matmul(*args, fmt=fmt, scale_layout=layout, out=out, backend=backend)
            torch.cuda.synchronize()
            print(f"ok adversarial {fmt} {oname} / {iname} ({cfg or 'default config'})", flush=True)


# ---- the runner ------------------------------------------------------------------------------

HANDOFFS = {  # name: (the files that hold it, pattern of its lines)
    "tile-id": (("pipeline.py", ), r"tile_ids\.index\(slot\)\.(store|load)\("),
    "split-k": (("e2m1.py", ), r"\bbuf\.(store\(acc\)|load\(acc_layout\))"),
}
KERNEL_SOURCES = ("sm90/*.py", )  # the sm90 kernels' sources, in moegemm/kernels/


def _handoff_lines() -> dict[str, set[str]]:
    """'file.py:line' of each handoff's accesses (module docstring); "dispatch": every line of
    the Gluon kernel functions (from `def ..._kernel(` to the next top-level statement)."""
    found = {"dispatch": set(), **{name: set() for name in HANDOFFS}}
    kernels = ROOT / "moegemm" / "kernels"
    for path in sorted({p for pattern in KERNEL_SOURCES for p in kernels.glob(pattern) if p.is_file()}):
        inside = False
        for number, text in enumerate(path.read_text().splitlines(), 1):
            if re.match(r"def \w+_kernel\(", text):
                inside = True
            elif text and not text[0].isspace() and not text.startswith(")"):
                inside = False
            if inside:
                found["dispatch"].add(f"{path.name}:{number}")
        for name, (pattern_file, pattern) in HANDOFFS.items():
            if path.name in pattern_file:
                for number, text in enumerate(path.read_text().splitlines(), 1):
                    if re.search(pattern, text):
                        found[name].add(f"{path.name}:{number}")
    return found


def parse(tool: str, log: str) -> dict:
    """Errors in a compute-sanitizer log; racecheck's split into dispatch-word hazards and others."""
    summary = re.search(r"(ERROR|RACECHECK) SUMMARY: (\d+) (?:errors|hazards displayed \((\d+) errors)", log)
    if summary is None:
        return dict(errors=None, note="no summary (the run did not finish)")
    if tool != "racecheck":
        return dict(errors=int(summary.group(2)))
    total = int(summary.group(3))
    handoffs = _handoff_lines()
    counts = {name: 0 for name in handoffs}
    other, examples = 0, []
    for block in re.split(r"\n(?==========\s+(?:Error|Warning):)", log):
        if not re.match(r"=========\s+(?:Error|Warning):", block):
            continue
        places = set(re.findall(r"\b(\w+\.py:\d+)", block))
        hazards = sum(int(n) for n in re.findall(r"\[(\d+) hazards?\]", block)) or 1
        name = next((name for name, lines in handoffs.items() if places and places <= lines), None)
        if not places:  # a kernel without Python line info: PyTorch's own (at::native::...)
            counts["outside moegemm"] = counts.get("outside moegemm", 0) + hazards
        elif name is None:
            other += hazards
            examples.append(block[:600])
        else:
            counts[name] += hazards
    return dict(errors=other, handoff_hazards=counts, reported_errors=total, other_examples=examples[:5])


def sanitize(tool: str, workload: str, out: Path, timeout: float) -> dict:
    log_path = out / f"{tool}-{workload}.log"
    cmd = ["compute-sanitizer", "--tool", tool, "--print-limit", "2000"]
    if tool == "racecheck":
        cmd += ["--racecheck-report", "analysis"]
    cmd += [sys.executable, str(Path(__file__).resolve()), "--workload", workload]
    env = dict(os.environ, RACECHECK_CALLS="1" if tool == "racecheck" else "0")
    t0 = time.time()
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
        log, rc = run.stdout + run.stderr, run.returncode
    except subprocess.TimeoutExpired as exc:
        log, rc = (exc.stdout or b"").decode(errors="replace") + "\n[timed out]", None
    log_path.write_text(log)
    result = dict(tool=tool, workload=workload, rc=rc, seconds=round(time.time() - t0, 1), **parse(tool, log))
    result["workload_ok"] = rc == 0 and "Traceback" not in log
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", choices=WORKLOADS)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--jobs", type=int, default=6, help="sanitizer runs at once (the GPU is shared)")
    parser.add_argument("--timeout", type=float, default=420.0)
    args = parser.parse_args()
    if args.workload:
        globals()["workload_" + args.workload.replace("-", "_")]()
        return
    import torch

    args.out.mkdir(parents=True, exist_ok=True)
    runs = [(tool, w) for w in args.workloads.split(",") for tool in args.tools.split(",")
            if not (w == "adversarial" and tool != "memcheck")]
    for w in args.workloads.split(","):  # compile everything once, outside the sanitizer
        for calls in ("0", "1") if "racecheck" in args.tools else ("0",):
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "--workload", w], cwd=ROOT, check=True,
                           env=dict(os.environ, RACECHECK_CALLS=calls))
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda r: sanitize(*r, args.out, args.timeout), runs))
    gpu = torch.cuda.get_device_name(0)
    from moegemm.benchmark import provenance

    record = dict(**provenance("bench/sanitize.py"), gpu=gpu, results=results,
                  errors=sum(r["errors"] or 0 for r in results) + sum(r["errors"] is None for r in results),
                  all_workloads_ok=all(r["workload_ok"] for r in results))
    (args.out / f"sanitize-{gpu.replace(' ', '-')}.json").write_text(json.dumps(record, indent=1))
    print(f"{'tool':<10} {'workload':<16} {'errors':>7} {'seconds':>8}  ok  handoffs (racecheck)")
    for r in results:
        print(f"{r['tool']:<10} {r['workload']:<16} {str(r['errors']):>7} {r['seconds']:>8}  {r['workload_ok']}  "
              f"{r.get('handoff_hazards', '')}")
    print("total errors", record["errors"], "workloads ok", record["all_workloads_ok"])
    sys.exit(0 if record["errors"] == 0 and record["all_workloads_ok"] else 1)


if __name__ == "__main__":
    main()
