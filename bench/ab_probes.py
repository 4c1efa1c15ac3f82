"""bench/ab.py's probes, each with a measurement of its own: fused-ceiling (the most fusing
SwiGLU into the gate/up product can gain), scatter-check (the token gather in scatter form
against the gather, bit for bit), activation-sweep (launch shapes of the activation kernels) and
power-cap (why calls timed in bursts of their own disagree). Each run_* takes (plan, args) and
returns the result ab.py writes."""

from __future__ import annotations

import os
import subprocess
import tempfile
import time
from pathlib import Path

from ab_common import gpu_env

# ---- fused-ceiling: the most fusing SwiGLU into the gate/up product can gain --------------------

CEILING_ROWS = ((0, "DeepSeek-V3", "mxfp8"), (1, "gpt-oss-120b", "mxfp4"), (1, "gpt-oss-120b", "bf16"))
READ_SHAPES = ((2048, 4), (4096, 8), (8192, 8))  # (int32 elements a program and iteration, warps)


def _read_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def read_kernel(src, out, n, iterations, BLOCK: tl.constexpr):
        """Reads src[0:n] (int32) once, programs striding by BLOCK; stores the xor of what it read
        so that the loads are not dead."""
        pid = tl.program_id(0)
        programs = tl.num_programs(0)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for i in range(iterations):
            offsets = (i * programs + pid).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            acc ^= tl.load(src + offsets, mask=offsets < n, other=0)
        tl.store(out + pid, tl.xor_sum(acc, axis=0))

    return read_kernel


def read_call(tensors, block: int, warps: int):
    """One call that reads every tensor of `tensors` once (their bytes as int32 words)."""
    import torch
    import triton

    kernel = _read_kernel()
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
            kernel[(programs, )](w, sink, w.numel(), iterations, BLOCK=block, num_warps=warps)

    return call


def _ceiling_rows(L, timer, m_index, model, fmt, tokens):
    """One model's fused-ceiling times, in turns, twice."""
    import torch

    import moegemm

    device = torch.device("cuda")
    rows, summary = [], []
    cfg = L.MODELS[model]
    weights = L.build_weights(cfg, m_index, device)
    x, ids, topk_weights = L.routing_inputs(cfg, tokens, tokens * 7919 + m_index, device)
    if torch.unique(ids).numel() != cfg["experts"]:  # (the read kernel reads every expert's weights)
        raise SystemExit(f"{model} at {tokens} tokens leaves experts without tokens; use more tokens")
    step = L.GateUpStep.build(cfg, x, ids, topk_weights, weights, fmt)
    plan_, a, w_gu = step.plan, step.a, step.w_gu
    h = torch.empty(a.data.shape[0], w_gu.data.shape[1], dtype=torch.bfloat16, device=device)
    h_like = torch.empty_like(h)  # (write_h must not zero the h that the pass reads)

    def product():
        moegemm.grouped_matmul(a.data, w_gu, a.scales, None, plan_.a_offsets, plan_.expert_ids,
                               fmt=fmt, a_scale_offsets=step.a_scale_offsets, scale_layout=step.layout, out=h,
                               backend="auto")

    def swiglu_pass():
        return moegemm.swiglu_quantize(h, fmt, gate_up_layout="interleaved", activation=cfg["activation"],
                                       bias=step.bias, a_offsets=plan_.a_offsets, expert_ids=plan_.expert_ids,
                                       a_scale_offsets=step.a_scale_offsets, scale_layout=step.layout,
                                       num_scale_blocks=plan_.scale_blocks_bound, alpha=L.ALPHA, limit=L.LIMIT)

    calls = {"fused": step.call(True), "unfused": step.call(False), "product": product, "pass": swiglu_pass,
             "write_h": lambda: h_like.fill_(0)}
    weight_tensors = [t for t in (w_gu.data, w_gu.scales) if t is not None]
    for block, warps in READ_SHAPES:
        calls[f"read-{block}x{warps}"] = read_call(weight_tensors, block, warps)
    product()  # h as the pass reads it
    timed = {}
    for name, call in calls.items():
        call()  # compiles outside the capture
        timed[name] = timer.prepare(call)
    weight_bytes = sum(t.numel() * t.element_size() for t in weight_tensors)
    for run in range(2):
        times = {name: ms * 1e3 for name, (ms, _, _) in timer.in_turns(timed).items()}
        read = min(v for name, v in times.items() if name.startswith("read-"))
        rows += [dict(key=f"{model} {fmt} {tokens} {name}", model=model, fmt=fmt, variant=name, run=run,
                      us=round(us, 1)) for name, us in times.items()]
        summary.append(dict(model=model, fmt=fmt, run=run, read_us=round(read, 1),
                            read_tbps=round(weight_bytes / (read * 1e-6) / 1e12, 3), h_bytes=h.numel() * 2,
                            measured=round(times["unfused"] / times["fused"], 4),
                            ceiling=round((read + times["write_h"] + times["pass"]) / read, 4)))
        print(model, fmt, summary[-1], flush=True)
    timed.clear()
    return rows, summary


def run_fused_ceiling(plan: str, args) -> dict:
    """On the layer's routed and quantized tokens (layer_models.GateUpStep), timed together in turns:
    fused (grouped_matmul_swiglu(fused=True)), unfused (the product to bf16 h, then
    swiglu_quantize), product (alone, writing h), pass (swiglu_quantize(h) alone), read (a kernel
    that reads the gate/up weights and scales once; the fastest of READ_SHAPES) and write_h
    (fill_(0) of a tensor of h's shape). Both steps run the same product kernel's K loop (the
    fused one may get a shorter ring for its epilogue's scratch, which only slows it); fusing
    replaces the epilogue, so it can save at most the pass and the write of h, while no product
    takes less than reading its weights once. Hence, for any product at or above the read time,

        unfused / fused  <=  ceiling = (read + write_h + pass) / read

    reached by a product at the read time, a free fused epilogue and a write of h not hidden
    behind the reads. It leaves out an unfused product whose own epilogue costs more than
    writing h (gpt-oss BF16 at 512 tokens measured above its ceiling that way)."""
    import layer_models as L
    import torch
    from timing import Timer

    device = torch.device("cuda")
    timer = Timer(device)
    env = dict(gpu_env(timer), tokens=args.tokens)
    rows, summary = [], []
    for m_index, model, fmt in CEILING_ROWS:
        more_rows, more_summary = _ceiling_rows(L, timer, m_index, model, fmt, args.tokens)
        rows, summary = rows + more_rows, summary + more_summary
        torch.cuda.empty_cache()
    return dict(env=env, rows=rows, summary=summary)


# ---- scatter-check: the token gather in scatter form against the gather, bit for bit ------------

def run_scatter_check(plan: str, args) -> dict:
    """DeepSeek-V3 and gpt-oss token steps (mxfp8, mxfp4 in the kernels' e4m3 token form): the
    scatter form (each token read and quantized once, stored to its k rows; row-major scale bytes
    moved to the K-block-major form) against the gather form, bit for bit on every in-slot row and
    scale column (a NaN element and a zero row included), both timed by graph replay."""
    import torch

    import moegemm
    from moegemm import benchmark
    from moegemm.routing import row_experts
    from moegemm.token_forms import kb_major_column, token_form
    from moegemm.token_quantizers import gather_quantize, scatter_quantize

    rows = []
    for t, k, e, hidden, n in ((4096, 8, 256, 7168, 4096), (512, 8, 256, 7168, 4096), (4096, 4, 128, 2880, 5760)):
        gen = torch.Generator(device="cuda").manual_seed(t + k)
        x = torch.randn(t, hidden, device="cuda", generator=gen).bfloat16()
        x[0, 5] = float("nan")
        x[1] = 0
        ids = torch.rand(t, e, device="cuda", generator=gen).topk(k, dim=1).indices.to(torch.int32)
        route = moegemm.route(ids, e)
        for fmt in ("mxfp8", "mxfp4"):
            form = token_form(moegemm.get_format(fmt), n, hidden, t * k, e)
            if form is None or form.kind != "e4m3":
                continue
            slots = row_experts(route)

            def scatter(x=x, fmt=fmt, route=route, slots=slots, form=form):
                return scatter_quantize(x, fmt, route.grouped_row, slots, a_offsets=route.a_offsets,
                                        scale_layout=form)

            def gather(x=x, fmt=fmt, route=route, form=form):
                return gather_quantize(x, fmt, route.token_index, a_offsets=route.a_offsets, scale_layout=form)
            sc, ga = scatter(), gather()
            torch.cuda.synchronize()
            valid = int(route.valid.sum())
            same_data = torch.equal(sc.data[:valid].view(torch.uint8), ga.data[:valid].view(torch.uint8))
            bounds = route.a_offsets.tolist()
            cols = torch.tensor([kb_major_column(r, bounds[g], g, form.column_block)
                                 for g in range(e) for r in range(bounds[g + 1] - bounds[g])], device="cuda")
            a, b = sc.scales[:, cols], ga.scales[:, cols]
            row = dict(key=f"T{t}-k{k}-E{e}-H{hidden}-{fmt}", same_data=same_data,
                       same_scales=torch.equal(a.view(torch.int32), b.view(torch.int32)),
                       nan_scales=int(torch.isnan(a).sum()), rows=valid,
                       scatter_us=1e3 * benchmark._bench_graph(scatter), gather_us=1e3 * benchmark._bench_graph(gather))
            row["us"] = row["scatter_us"]
            rows.append(row)
            print(row, flush=True)
    return dict(env=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__), rows=rows,
                mismatched=[r["key"] for r in rows if not (r["same_data"] and r["same_scales"])])


# ---- activation-sweep: launch shapes of the activation kernels at prefill sizes ------------------

def _forget_planned_launches(quantize_kernels) -> None:
    """Drop the quantizer's launches planned with the module's tiles (rows_launch caches them per
    host values; a revision before it plans every call)."""
    if hasattr(quantize_kernels, "rows_launch"):
        quantize_kernels.rows_launch.cache_clear()


def run_activation_sweep(plan: str, args) -> dict:
    """Rows a program x scale blocks a program (times 1, 2, 4) x warps of the gather/scatter and
    SwiGLU quantization kernels at DeepSeek-V3 / gpt-oss 4096 tokens, and of moegemm.quantize at
    32768 x 7168 tokens (graph replay, median)."""
    import layer_models as L
    import torch
    from timing import Timer, capture

    import moegemm
    from moegemm.kernels import quantize_kernels
    from moegemm.routing import row_experts
    from moegemm.token_forms import TokenForm
    from moegemm.token_quantizers import gather_quantize, scatter_quantize, swiglu_quantize

    dev = torch.device("cuda")
    timer = Timer(dev, warmup=10, rep=60)

    def timed(fn):
        fn()
        return timer.bench(capture(fn).replay) * 1e3

    ds, go = L.MODELS["DeepSeek-V3"], L.MODELS["gpt-oss-120b"]
    x, ids, tw = L.routing_inputs(ds, 4096, 3, dev)
    route = moegemm.route(ids, ds["experts"], tw)
    h = torch.randn(ids.numel(), 4096, device=dev).bfloat16()
    xg, idsg, twg = L.routing_inputs(go, 4096, 3, dev)
    route_g = moegemm.route(idsg, go["experts"], twg)
    gather_bytes = x.numel() * 2 + ids.numel() * 7168
    tokens = torch.randn(32768, 7168, device=dev).bfloat16()
    token_slots = torch.arange(0, 32769, 4096, dtype=torch.int32, device=dev)
    cases = {
        "dsv3-scatter-mxfp8-e4m3form": (lambda: scatter_quantize(
            x, "mxfp8", route.grouped_row, row_experts(route), a_offsets=route.a_offsets,
            scale_layout=TokenForm("e4m3")), gather_bytes),
        "dsv3-scatter-fp8block": (lambda: scatter_quantize(
            x, "fp8_block", route.grouped_row, row_experts(route), a_offsets=route.a_offsets), gather_bytes),
        "dsv3-swiglu-mxfp8-e4m3form": (lambda: swiglu_quantize(
            h, "mxfp8", activation="swiglu", gate_up_layout="interleaved", bias=None, a_offsets=route.a_offsets,
            expert_ids=route.expert_ids, scale_layout=TokenForm("e4m3"), alpha=1.702, limit=7.0),
            h.numel() * 2 + h.numel() // 2),
        "dsv3-swiglu-fp8block-concat": (lambda: swiglu_quantize(h, "fp8_block", gate_up_layout="concat"),
                                        h.numel() * 2 + h.numel() // 2),
        "gptoss-gather-mxfp4-bf16form": (lambda: gather_quantize(
            xg, "mxfp4", route_g.token_index, a_offsets=route_g.a_offsets, scale_layout=TokenForm("bf16")),
            xg.numel() * 2 + idsg.numel() * 2880 * 2),
        "quantize-fp8block-32k": (lambda: moegemm.quantize(tokens, "fp8_block"),
                                  tokens.numel() * 3 + tokens.numel() // 32),
        "quantize-mxfp8-32k-swizzled": (lambda: moegemm.quantize(tokens, "mxfp8", scale_layout="swizzled",
                                                                 a_offsets=token_slots),
                                        tokens.numel() * 3 + tokens.numel() // 32),
    }
    original = (quantize_kernels.CUDA_BLOCK_M, quantize_kernels.CUDA_WARPS, quantize_kernels.output_code)
    rows = []
    try:
        for name, (fn, nbytes) in cases.items():
            for block_m in (8, 16, 32):
                for factor in (1, 2, 4):
                    for warps in (4, 8):
                        quantize_kernels.CUDA_BLOCK_M, quantize_kernels.CUDA_WARPS = block_m, warps
                        quantize_kernels.output_code = lambda f, m, _o=original[2], _k=factor: (
                            lambda r: (r[0], r[1], r[2] * _k))(_o(f, m))
                        _forget_planned_launches(quantize_kernels)
                        try:
                            us = timed(fn)
                        except Exception as exc:  # noqa: BLE001 (a shape the kernel refuses)
                            print(name, block_m, factor, warps, "failed", type(exc).__name__, flush=True)
                            continue
                        rows.append(dict(key=f"{name} bm{block_m} nbx{factor} w{warps}", case=name, block_m=block_m,
                                         nb_factor=factor, warps=warps, us=us, tbps=nbytes / us / 1e6))
                        print(rows[-1], flush=True)
    finally:
        quantize_kernels.CUDA_BLOCK_M, quantize_kernels.CUDA_WARPS, quantize_kernels.output_code = original
        _forget_planned_launches(quantize_kernels)
    return dict(env=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                         defaults=dict(block_m=original[0], warps=original[1])), rows=rows)


# ---- power-cap: why calls timed in bursts of their own disagree ---------------------------------

def run_power_cap(plan: str, args) -> dict:
    """DeepSeek-V3 at 4096 tokens (mxfp8): the layer's graph timed alone, beside the baseline's,
    in turns with it and after a rest, while nvidia-smi logs SM clock, power and throttle
    reasons every 100 ms (rows `smi`). Under a sustained load the H100 reaches its power cap
    within ~0.5 s and its clock moves between ~1.4 and 1.98 GHz: the reason the timers take a
    sample of every call a round in a shuffled order."""
    import layer_models as L
    import torch
    from timing import Timer, capture

    import moegemm

    dev = torch.device("cuda")
    log, out = [], {}
    timer = Timer(dev, warmup=5, rep=100)  # each call in a burst of its own, as do_bench times it

    def mark(msg):
        log.append((round(time.time(), 3), msg))
        print(f"{time.time():.2f} {msg}", flush=True)

    def graph(fn):
        fn()
        return capture(fn)

    def med(fn):
        return timer.bench(fn) * 1e3

    smi_log = tempfile.NamedTemporaryFile("w+", suffix=".smi", delete=False)
    smi = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,"
                            "clocks_throttle_reasons.active", "--format=csv,noheader", "-lms", "100"], stdout=smi_log)
    try:
        cfg = L.MODELS["DeepSeek-V3"]
        weights = L.build_weights(cfg, 0, dev)
        x, ids, tw = L.routing_inputs(cfg, 4096, 4096 * 7919, dev)
        fmt = "mxfp8"
        w_gu, w_dn = weights.ours(fmt)
        ours = lambda: moegemm.moe_forward(x, ids, tw, w_gu, w_dn, gate_up_layout=L.gate_up_layout(fmt),  # noqa
                                           activation="swiglu", fused=True, backend="auto")
        base = L.baseline_for(weights, fmt, cfg, "fp8_rowwise")
        go = graph(ours)
        out["ours_alone"] = [med(go.replay) for _ in range(3)]
        mark(f"ours alone {out['ours_alone']}")
        gb = graph(lambda: base(x, ids, tw))
        out["ours_beside_baseline"] = [med(go.replay) for _ in range(3)]
        mark(f"ours with the baseline's graph alive {out['ours_beside_baseline']}")
        out["turns"] = []
        for turn in range(3):
            b, o = med(gb.replay), med(go.replay)
            out["turns"].append((b, o))
            mark(f"turn {turn}: baseline {b:.1f} ours {o:.1f}")
        time.sleep(3)
        out["ours_after_rest"] = med(go.replay)
        mark(f"ours after 3 s of rest {out['ours_after_rest']:.1f}")
    finally:
        smi.terminate()
        smi.wait()
    smi_rows = Path(smi_log.name).read_text().splitlines()
    os.unlink(smi_log.name)
    rows = [dict(key="ours_after_rest", us=out["ours_after_rest"])]
    return dict(env=dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__), res=out, log=log, smi=smi_rows,
                rows=rows)
