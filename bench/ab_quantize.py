"""bench/ab.py's `quantize` plan: moegemm.quantize against the copy bandwidth, and the two-call
path (quantize + grouped_matmul) against the MoE layer's token path (gather_quantize + the same
grouped_matmul), on the GPU the call gets.

    python bench/ab.py quantize [--formats fp8_block,mxfp8,w4a8] [--out DIR]

1. quantize alone: 32768 x 7168 bf16 tokens (DeepSeek-V3's hidden size) in every format, in the
   plain layout and, where the activations have block scales that take it, the swizzled one
   (8 slots of 4096 rows). bytes = the tokens read once + the data and scales written; pct_copy
   = bytes / time / the copy bandwidth (bytes read + written) measured in the same run. Target
   >= 70%. nvfp4 also with a given global scale: its default one is amax(x) on the device first,
   a second read of x that `bytes` leaves out.
2. the two paths on the verify shapes (moegemm.benchmark_rows' MODEL_SHAPES, groups x nominal tokens
   drawn as `python -m moegemm bench` draws them), in each format of --formats:
       two-call  quantize(x[perm], fmt, scale_layout=the weights', a_offsets) + grouped_matmul
       token     gather_quantize(x, fmt, perm, ...) in the form the product's sm90 kernel reads
                 (token_forms.token_form, as moe_forward's gather writes it; None: the layout)
                 + the same grouped_matmul
   perm a random permutation of the rows (the routing's gather, one choice a token); each step
   is also timed alone. Target two-call / token <= 1.15. The two products are compared: they
   read the same values (a token form is the operand, bit for bit), so they must agree within
   5e-3 of the largest output; bit-identical is reported.

Times: bench/timing.py's Timer (each call captured in a CUDA graph, a sample of each a round in
a shuffled order, L2 flushed before each, medians of >= 30 samples). The quantize calls leave
num_scale_blocks out, as a caller that reads no device value does.
"""

from __future__ import annotations

import math

from ab_common import gpu_env

QUANTIZE_ROWS, QUANTIZE_K, QUANTIZE_SLOTS = 32768, 7168, 8
COPY_TARGET = 0.70  # quantize alone: at least this fraction of the copy bandwidth
TWO_CALL_TARGET = 1.15  # two-call / token path: at most this
TWO_CALL_SHAPES = (("dsv3-up", 8, 4096), )  # (benchmark.MODEL_SHAPES name, groups, nominal tokens)
TWO_CALL_FORMATS = ("fp8_block", "mxfp8", "w4a8")  # the three; --formats picks others


def _bytes(t) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _quantize_alone(timer, copy_tbps: float) -> list[dict]:
    """Part 1 of the module docstring."""
    import torch

    import moegemm

    device = timer.device
    x = torch.randn(QUANTIZE_ROWS, QUANTIZE_K, device=device, dtype=torch.bfloat16)
    a_offsets = torch.arange(0, QUANTIZE_ROWS + 1, QUANTIZE_ROWS // QUANTIZE_SLOTS, dtype=torch.int32, device=device)
    given = torch.tensor(float(x.float().abs().amax()) / 2688.0, device=device)
    cases = {}
    for fmt, f in moegemm.FORMATS.items():
        layouts = ("plain", "swizzled") if f.a_scaled and f.swizzle_capable else ("plain", )
        for layout in layouts:
            cases[(fmt, layout, "")] = dict(fmt=fmt, scale_layout=layout, a_offsets=a_offsets)
        if f.a.global_scale:
            cases[(fmt, "plain", "given global")] = dict(fmt=fmt, scale_layout="plain", global_scale=given)
    timed, sizes = {}, {}
    for key, kwargs in cases.items():
        call = (lambda kw=kwargs: moegemm.quantize(x, **kw))
        q = call()
        sizes[key] = _bytes(x) + _bytes(q.data) + _bytes(q.scales)
        timed[key] = timer.prepare(call)
    rows = []
    for (fmt, layout, note), (ms, eager_ms, why) in timer.in_turns(timed).items():
        tbps = sizes[(fmt, layout, note)] / (ms * 1e-3) / 1e12
        rows.append(dict(key=f"quantize {fmt} {layout}" + (f" ({note})" if note else ""), part="quantize", fmt=fmt,
                         layout=layout, note=note, rows=QUANTIZE_ROWS, k=QUANTIZE_K, bytes=sizes[(fmt, layout, note)],
                         us=round(ms * 1e3, 2), eager_us=round(eager_ms * 1e3, 2), tbps=round(tbps, 3),
                         pct_copy=round(100 * tbps / copy_tbps, 1), meets=tbps / copy_tbps >= COPY_TARGET, why=why))
        print(rows[-1], flush=True)
    return rows


def _two_paths(timer, fmt: str, shape: str, groups: int, nominal: int) -> dict:
    """Part 2 of the module docstring, one format on one shape."""
    import torch

    import moegemm
    # benchmark.Inputs, .MODEL_SHAPES, .group_sizes rather than their own modules': every revision's
    # benchmark module holds these names (a two-revision run imports each revision's library)
    from moegemm import benchmark, layouts
    from moegemm.token_forms import token_form
    from moegemm.token_quantizers import gather_quantize

    device = timer.device
    n, k = benchmark.MODEL_SHAPES[shape]
    sizes = benchmark.group_sizes(groups, nominal, seed=groups * 100003 + nominal)  # (the bench's draw)
    m = sum(sizes)
    inp = benchmark.Inputs(fmt, n, k, sizes, device)  # the weights of `python -m moegemm bench` for this row
    layout = inp.scale_layout
    w = moegemm.QuantizedTensor(inp.b, inp.b_scales, fmt, "b", layout)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    perm = torch.randperm(m, device=device).to(torch.int32)
    grouped = x[perm.long()]  # the two-call path's tokens: already in their groups
    hopper = device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)
    form = token_form(moegemm.get_format(fmt), n, k, m, groups) if hopper else None
    swizzled = layout == "swizzled" and moegemm.get_format(fmt).a_scaled
    aso = layouts.a_scale_offsets(inp.a_offsets) if swizzled else None  # (the routing plan's, in the layer)
    bound = math.ceil(m / 128) + groups
    out_two, out_token = torch.empty_like(inp.out), torch.empty_like(inp.out)

    def quantize():
        return moegemm.quantize(grouped, fmt, scale_layout=layout, a_offsets=inp.a_offsets)

    def gather():
        return gather_quantize(x, fmt, perm, a_offsets=inp.a_offsets, a_scale_offsets=aso,
                               scale_layout=form or layout, num_scale_blocks=bound)

    def product(a, out, a_scale_offsets=None):
        return moegemm.grouped_matmul(a, w, None, None, inp.a_offsets, inp.expert_ids, fmt=fmt,
                                      a_scale_offsets=a_scale_offsets, expert_scales=inp.expert_scales,
                                      scale_layout=layout, out=out)

    quantized, gathered = quantize(), gather()
    calls = {"two-call": lambda: product(quantize(), out_two), "token": lambda: product(gather(), out_token, aso),
             "quantize": quantize, "gather": gather, "product": lambda: product(quantized, out_two),
             "product-token": lambda: product(gathered, out_token, aso)}
    timed = {name: timer.prepare(call) for name, call in calls.items()}
    times = {name: ms for name, (ms, _, _) in timer.in_turns(timed).items()}
    calls["two-call"]()
    calls["token"]()
    diff = float((out_two.float() - out_token.float()).abs().max())
    scale = float(out_token.float().abs().max())
    ratio = times["two-call"] / times["token"]
    row = dict(key=f"two-call {fmt} {shape} {groups}x{nominal}", part="two-call", fmt=fmt, shape=shape, n=n, k=k,
               groups=groups, nominal=nominal, rows=m, layout=layout, form=None if form is None else repr(form),
               **{f"{name}_us": round(ms * 1e3, 2) for name, ms in times.items()},
               ratio=round(ratio, 4), meets=ratio <= TWO_CALL_TARGET, bit_identical=torch.equal(out_two, out_token),
               max_abs_diff=diff, max_abs_out=scale, agrees=diff <= 5e-3 * scale,
               why={name: t.why for name, t in timed.items() if t.why} or None)
    print(row, flush=True)
    return row


def _print_table(copy_tbps: float, quantize_rows: list[dict], two_call_rows: list[dict]):
    print(f"\nquantize alone: {QUANTIZE_ROWS} x {QUANTIZE_K} bf16 tokens; copy {copy_tbps:.2f} TB/s "
          f"(target >= {COPY_TARGET:.0%} of copy)")
    print(f"{'format':<11} {'layout':<9} {'note':<13} {'us':>8} {'TB/s':>6} {'%copy':>6}  meets")
    for r in quantize_rows:
        print(f"{r['fmt']:<11} {r['layout']:<9} {r['note']:<13} {r['us']:>8.1f} {r['tbps']:>6.2f} "
              f"{r['pct_copy']:>6.1f}  {'yes' if r['meets'] else 'NO'}")
    print(f"\ntwo-call (quantize + grouped_matmul) vs token path (gather_quantize + grouped_matmul), "
          f"target <= {TWO_CALL_TARGET}x")
    print(f"{'format':<10} {'shape':<9} {'rows':>6} {'two-call':>9} {'token':>8} {'ratio':>6} {'quant':>7} "
          f"{'gather':>7} {'prod':>8} {'prod-tok':>8} {'form':<6} {'same':<5} meets   (us)")
    for r in two_call_rows:
        form = "none" if r["form"] is None else ("bf16" if "'bf16'" in r["form"] else "e4m3")
        same = "bits" if r["bit_identical"] else "close" if r["agrees"] else "NO"
        print(f"{r['fmt']:<10} {r['shape']:<9} {r['rows']:>6} {r['two-call_us']:>9.1f} {r['token_us']:>8.1f} "
              f"{r['ratio']:>6.3f} {r['quantize_us']:>7.1f} {r['gather_us']:>7.1f} {r['product_us']:>8.1f} "
              f"{r['product-token_us']:>8.1f} {form:<6} {same:<5} {'yes' if r['meets'] else 'NO'}")


def run_quantize(plan: str, args) -> dict:
    """The module docstring's two parts; --formats: the formats of part 2 (comma-separated)."""
    import torch
    from timing import Timer

    import moegemm

    device = torch.device("cuda")
    timer = Timer(device)
    env = gpu_env(timer)
    formats = tuple(f for f in (args.formats or "").split(",") if f) or TWO_CALL_FORMATS
    unknown = [f for f in formats if f not in moegemm.FORMATS]
    if unknown:
        raise SystemExit(f"--formats: {unknown} not in {list(moegemm.FORMATS)}")
    quantize_rows = _quantize_alone(timer, env["copy_tbps"])
    torch.cuda.empty_cache()
    two_call_rows = []
    for shape, groups, nominal in TWO_CALL_SHAPES:
        for fmt in formats:
            two_call_rows.append(_two_paths(timer, fmt, shape, groups, nominal))
            torch.cuda.empty_cache()
    _print_table(env["copy_tbps"], quantize_rows, two_call_rows)
    return dict(env=dict(env, copy_target=COPY_TARGET, two_call_target=TWO_CALL_TARGET),
                rows=quantize_rows + two_call_rows,
                mismatched=[r["key"] for r in two_call_rows if not r["agrees"]])
