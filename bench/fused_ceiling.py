"""The most the fused SwiGLU epilogue can gain over the unfused chain, from times measured in one run.

    python bench/fused_ceiling.py OUT.json [--tokens 4096]

For each model and format of bench/moe_layer.py whose layer can run the fused epilogue, on the
layer's routed and quantized tokens (as moe_layer.run_row's gate/up step), these are timed
together (graph replay, L2 flushed, in shuffled turns by moe_layer.Timer):

    fused     grouped_matmul_swiglu(fused=True): the product with SwiGLU + requantization in its epilogue
    unfused   grouped_matmul_swiglu(fused=False): the product to bf16 h [rows, 2I], then swiglu_quantize
    product   the product alone, writing h
    pass      swiglu_quantize(h) alone
    read      a kernel that only reads the gate/up weights and scales once (the fastest of a few
              launch shapes)
    write_h   fill_(0) of a tensor of h's shape and type: only writes that many bytes

Both steps run the same product kernel's K loop (the fused one may get a shorter ring for its
epilogue's scratch, which only slows it); fusing replaces the epilogue. So fusing can save at
most the pass and the write of h, while no product, whatever its K loop, takes less than
reading its weights once. Hence

    unfused / fused  <=  (read + write_h + pass) / read        (`ceiling` below)

for any product time at or above the read time; a product at the read time, a fused epilogue
that costs nothing and a write of h not hidden behind the reads reach it. What it leaves out is
an unfused product whose own epilogue costs more than writing h (measured: gpt-oss BF16 at 512
tokens, 1.037 against a ceiling of 1.030; see docs/perf-notes.md). The issue 5 target asks for
unfused / fused >= 1.10.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_layer as L  # noqa: E402
import moegemm  # noqa: E402

ROWS = ((0, "DeepSeek-V3", "mxfp8"), (1, "gpt-oss-120b", "mxfp4"), (1, "gpt-oss-120b", "bf16"))
READ_SHAPES = ((2048, 4), (4096, 8), (8192, 8))  # (int32 elements a program and iteration, warps)


@triton.jit
def _read_kernel(src, out, n, iterations, BLOCK: tl.constexpr):
    """Reads src[0:n] (int32) once, programs striding by BLOCK; stores the xor of what it read
    so that the loads are not dead."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(iterations):
        offsets = (i * programs + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(src + offsets, mask=offsets < n, other=0)
    tl.store(out + pid, tl.xor_sum(acc, axis=0))


def read_call(tensors, block: int, warps: int):
    """One call that reads every tensor of `tensors` once (their bytes as int32 words)."""
    programs = torch.cuda.get_device_properties(0).multi_processor_count * 4
    sink = torch.empty(programs, dtype=torch.int32, device="cuda")
    words = []
    for t in tensors:
        flat = t.contiguous().view(torch.uint8).reshape(-1)
        flat = flat[:flat.numel() // 4 * 4]  # (the last < 4 bytes of a scale tensor: left out)
        words.append(flat.view(torch.int32))

    def call():
        for w in words:
            iterations = triton.cdiv(w.numel(), block * programs)
            _read_kernel[(programs, )](w, sink, w.numel(), iterations, BLOCK=block, num_warps=warps)

    return call


def measure_row(m_index: int, model: str, fmt: str, tokens: int, timer: L.Timer) -> dict:
    cfg = L.MODELS[model]
    device = torch.device("cuda")
    weights = L.build_weights(cfg, m_index, device)
    x, ids, topk_weights = L.routing_inputs(cfg, tokens, tokens * 7919 + m_index, device)
    step = L.GateUpStep.build(cfg, x, ids, topk_weights, weights, fmt)
    plan, a, w_gu = step.plan, step.a, step.w_gu
    touched = torch.unique(ids).numel()  # host sync, outside timing
    h = torch.empty(a.data.shape[0], w_gu.data.shape[1], dtype=torch.bfloat16, device=device)

    def product():
        moegemm.grouped_matmul(a.data, w_gu.data, a.scales, w_gu.scales, plan.a_offsets, plan.expert_ids, fmt=fmt,
                               a_scale_offsets=step.a_scale_offsets, scale_layout=step.layout, out=h, backend="auto")

    def swiglu_pass():
        return moegemm.swiglu_quantize(h, fmt, gate_up_layout="interleaved", activation=cfg["activation"],
                                       bias=step.bias,
                                       a_offsets=plan.a_offsets, expert_ids=plan.expert_ids,
                                       a_scale_offsets=step.a_scale_offsets, scale_layout=step.layout,
                                       num_scale_blocks=plan.scale_blocks_bound, alpha=L.ALPHA, limit=L.LIMIT)

    h_like = torch.empty_like(h)  # (write_h must not zero the h that the pass reads)
    calls = {"fused": step.call(True), "unfused": step.call(False), "product": product, "pass": swiglu_pass,
             "write_h": lambda: h_like.fill_(0)}
    weight_tensors = [t for t in (w_gu.data, w_gu.scales) if t is not None]
    if touched != cfg["experts"]:  # (the read kernel reads every expert's weights)
        raise SystemExit(f"{model} at {tokens} tokens routes to {touched} of {cfg['experts']} experts; use more tokens")
    for block, warps in READ_SHAPES:
        calls[f"read-{block}x{warps}"] = read_call(weight_tensors, block, warps)
    product()  # h as the pass reads it
    timed = {}
    for name, call in calls.items():
        call()  # compiles outside the capture
        timed[name] = timer.prepare(call)
    runs = []
    for _ in range(2):
        times = {name: ms * 1e3 for name, (ms, _, _) in timer.in_turns(timed).items()}
        read = min(v for k, v in times.items() if k.startswith("read-"))
        runs.append(dict(
            times_us={k: round(v, 1) for k, v in times.items()},
            read_us=round(read, 1),
            measured=round(times["unfused"] / times["fused"], 4),
            ceiling=round((read + times["write_h"] + times["pass"]) / read, 4)))
        print(model, fmt, runs[-1], flush=True)
    timed.clear()
    weight_bytes = sum(t.numel() * t.element_size() for t in weight_tensors)
    return dict(model=model, fmt=fmt, tokens=tokens, weight_bytes=weight_bytes, h_bytes=h.numel() * 2,
                read_tbps=[round(weight_bytes / (r["read_us"] * 1e-6) / 1e12, 3) for r in runs], runs=runs)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("fused_ceiling: needs a CUDA GPU")
        return 1
    timer = L.Timer(torch.device("cuda"))
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               copy_tbps=round(timer.copy_tbps(), 3), tokens=args.tokens)
    rows = []
    for m_index, model, fmt in ROWS:
        rows.append(measure_row(m_index, model, fmt, args.tokens, timer))
        torch.cuda.empty_cache()
    args.out.write_text(json.dumps(dict(env=env, rows=rows), indent=1))
    print(json.dumps(env))
    for r in rows:
        print(f"{r['model']:14s} {r['fmt']:6s} ceiling {[x['ceiling'] for x in r['runs']]} "
              f"measured {[x['measured'] for x in r['runs']]} read TB/s {r['read_tbps']}")
    return 0 if all(math.isfinite(x["ceiling"]) for r in rows for x in r["runs"]) else 2


if __name__ == "__main__":
    sys.exit(main())
