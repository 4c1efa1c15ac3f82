"""Host time of eager calls at decode sizes, beside their CUDA-graph replay time and the floor their
launches set (`python bench/profiling.py host --out DIR`).

For grouped_matmul (a layer's down product, one token an expert: E slots of 1 row) and the MoE layer
(moe_forward at 1 and 64 tokens) of bench/layer_models.py's models and formats:
    host_us    the Python call with the GPU idle before it (synchronize, time the call, median of
               200): what an eager caller (transformers' generate, a training loop) pays a call
    graph_us   the same call captured in a CUDA graph, one replay (CUDA events, median)
and the floor under host_us, measured in the same run:
    launches   the Triton kernel launches of one call, recorded (JITFunction.run)
    bare_us    those launches replayed through JITFunction.run with their arguments prebuilt: no
               moegemm Python at all, only Triton's binding, specialization, cache lookup and launch
    direct_us  the same launches through the compiled kernels' launchers alone (what a launch record
               that skips JITFunction.run would pay; nothing in moegemm does that)
    zeros_us   torch.zeros of the op's output (rows of skipped slots read zero)
beside torch._grouped_mm (bf16) and two trivial Triton kernels (2 and 30 arguments).
"""

from __future__ import annotations

import statistics
import time

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction

import moegemm
from moegemm.kernels.compiled_launch import direct_launches


@triton.jit
def _tiny(p, n):
    offsets = tl.arange(0, 16)
    tl.store(p + offsets, offsets, mask=offsets < n)


@triton.jit
def _tiny30(p, a1, a2, a3, a4, a5, a6, a7, a8, a9, b1, b2, b3, b4, b5, b6, b7, b8, b9, c1, c2, c3, c4, c5, c6, c7, c8,
            c9, n, X: tl.constexpr):
    offsets = tl.arange(0, 16)
    tl.store(p + offsets, offsets + a1 + b1 + c1 + X, mask=offsets < n)


def _call_us(fn, reps: int, warmup: int, wait: bool) -> float:
    """Median time of one call started with the GPU idle: until it returns, or (wait) until the
    GPU has finished it too."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if wait:
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(samples)


def host_us(fn, reps: int = 200) -> float:
    """Median host time of one call started with the GPU idle."""
    return _call_us(fn, reps, warmup=10, wait=False)


def graph_us(fn, reps: int = 200) -> float:
    """Median device time of one replay of fn captured in a CUDA graph (timing.capture)."""
    from timing import capture

    for _ in range(3):
        fn()
    graph = capture(fn)
    for _ in range(10):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end) * 1e3)
    return statistics.median(times)


def recorded_launches(fn) -> list:
    """(jit function, grid, args, kwargs, compiled kernel) of every Triton launch of one call."""
    fn()
    torch.cuda.synchronize()
    original = JITFunction.run
    launches = []
    direct = direct_launches(False)  # (every launch through JITFunction.run, to be recorded)

    def recording(self, *args, grid, warmup, **kwargs):
        kernel = original(self, *args, grid=grid, warmup=warmup, **kwargs)
        launches.append((self, grid, args, kwargs, kernel))
        return kernel

    JITFunction.run = recording
    try:
        fn()
    finally:
        JITFunction.run = original
        direct_launches(direct)
    return launches


def launch_floors(fn) -> dict:
    """launches, bare_us and direct_us of fn (module docstring)."""
    launches = recorded_launches(fn)

    def bare():
        for jit, grid, args, kwargs, _ in launches:
            jit.run(*args, grid=grid, warmup=False, **kwargs)

    device = driver.active.get_current_device()
    stream = driver.active.get_current_stream(device)
    prepared = []
    for jit, grid, args, kwargs, kernel in launches:
        options = dict(kwargs, debug=kwargs.get("debug", jit.debug) or knobs.runtime.debug,
                       instrumentation_mode=knobs.compilation.instrumentation_mode)
        bound_args, _, _ = jit.device_caches[device][4](*args, **options)
        dims = tuple(grid(bound_args) if callable(grid) else grid)
        dims += (1, ) * (3 - len(dims))
        prepared.append((kernel, dims, tuple(bound_args.values())))

    def direct():
        for kernel, dims, values in prepared:
            kernel.run(*dims, stream, kernel.function, kernel.packed_metadata, None, None, None, *values)

    return dict(launches=len(launches), bare_us=round(host_us(bare), 1), direct_us=round(host_us(direct), 1))


def _down_operands(weights, fmt: str, cfg: dict, device):
    """The down product of one token an expert: A [E, I] quantized like the layer's, B the layer's."""
    _, w_down = weights.ours(fmt)
    groups = cfg["experts"]
    a_offsets = torch.arange(groups + 1, dtype=torch.int32, device=device)
    expert_ids = torch.arange(groups, dtype=torch.int32, device=device)
    h = torch.randn(groups, cfg["width"], device=device).to(torch.bfloat16)
    if not isinstance(w_down, moegemm.QuantizedTensor):
        w_down = moegemm.QuantizedTensor(w_down, None, "bf16", "b")
    a = h if fmt == "bf16" else moegemm.quantize(h, fmt, a_offsets=a_offsets, scale_layout=w_down.scale_layout)
    return a, w_down, a_offsets, expert_ids


def measure(layer_tokens=(1, 64), models=None, fmts=None) -> list[dict]:
    """The rows of the module docstring, printed as they come; `models`, `fmts`: only these."""
    import layer_models as L

    device = torch.device("cuda")
    rows = []

    def add(row):
        rows.append(row)
        print(row, flush=True)

    for m_index, (model, cfg) in enumerate(L.MODELS.items()):
        if models and model not in models:
            continue
        weights = L.build_weights(cfg, m_index, device)
        for fmt in cfg["fmts"]:
            if fmts and fmt not in fmts:
                continue
            for tokens in layer_tokens:
                x, ids, topk_weights = L.routing_inputs(cfg, tokens, 7, device)
                call = L.layer_call(cfg, x, ids, topk_weights, weights, fmt, True)
                row = dict(what="moe_forward", model=model, fmt=fmt, tokens=tokens, host_us=round(host_us(call), 1),
                           graph_us=round(graph_us(call), 1))
                if tokens == 1:
                    row.update(launch_floors(call))
                add(row)
            a, w_down, a_offsets, expert_ids = _down_operands(weights, fmt, cfg, device)

            def product():
                return moegemm.grouped_matmul(a, w_down, None, None, a_offsets, expert_ids, fmt=fmt)

            out_shape = (a_offsets.numel() - 1, w_down.data.shape[1])
            add(dict(what="grouped_matmul", model=model, fmt=fmt, tokens=out_shape[0],
                     host_us=round(host_us(product), 1), graph_us=round(graph_us(product), 1),
                     **launch_floors(product),
                     zeros_us=round(host_us(lambda: torch.zeros(out_shape, dtype=torch.bfloat16, device=device)), 1)))
    experts, n, k = 128, 2880, 2880
    b = torch.randn(experts, n, k, device=device, dtype=torch.bfloat16)
    a = torch.randn(experts, k, device=device, dtype=torch.bfloat16)
    offsets = torch.arange(1, experts + 1, dtype=torch.int32, device=device)

    def torch_grouped():
        return torch._grouped_mm(a, b.transpose(-2, -1), offs=offsets)

    add(dict(what="torch._grouped_mm", tokens=experts, n=n, k=k, host_us=round(host_us(torch_grouped), 1),
             graph_us=round(graph_us(torch_grouped), 1)))

    buf = torch.zeros(16, dtype=torch.int32, device=device)
    add(dict(what="triton launch, 2 arguments", host_us=round(host_us(lambda: _tiny[(1, )](buf, 16)), 1)))
    add(dict(what="triton launch, 30 arguments",
             host_us=round(host_us(lambda: _tiny30[(1, )](buf, *([3] * 27), 16, X=1)), 1)))
    return rows


def eager_us(fn, reps: int = 60) -> float:
    """Median time of one call as an eager caller waits for it: GPU idle before, synchronized
    after (host and device time together, whichever binds)."""
    return _call_us(fn, reps, warmup=5, wait=True)


def decode_products() -> list[dict]:
    """grouped_matmul at a decode size (8 slots of one token, N=512, K=1024) in every format, QuantizedTensor
    operands, beside torch._grouped_mm bf16 on the same groups: host_us and eager_us, and the floor
    under host_us: the call's launches through Triton (bare_us) and through the compiled launchers
    alone (direct_us), and zeros_us, the zeroed output a fresh call starts from (launch_floors)."""
    device = torch.device("cuda")
    experts, n, k = 8, 512, 1024
    a_offsets = torch.arange(experts + 1, dtype=torch.int32, device=device)
    ids = torch.arange(experts, dtype=torch.int32, device=device)
    x, w = torch.randn(experts, k, device=device), torch.randn(experts, n, k, device=device) / 32
    rows = []
    # (a fresh output is zeros: the floor of every call beside its launches)
    zeros = round(host_us(lambda: torch.zeros(experts, n, dtype=torch.bfloat16, device=device)), 1)
    for fmt in moegemm.FORMATS:
        layout = "swizzled" if moegemm.get_format(fmt).swizzle_capable else "plain"
        if fmt == "bf16":
            a, b = x.bfloat16(), w.bfloat16()
        else:
            a = x.bfloat16() if fmt.startswith("bf16_") else moegemm.quantize(x, fmt, scale_layout=layout,
                                                                                a_offsets=a_offsets)
            b = moegemm.quantize_weights(w, fmt, scale_layout=layout)

        def call():
            return moegemm.grouped_matmul(a, b, None, None, a_offsets, ids, fmt=fmt)

        rows.append(dict(what="grouped_matmul", fmt=fmt, slots=experts, n=n, k=k, host_us=round(host_us(call), 1),
                         eager_us=round(eager_us(call), 1), **launch_floors(call), zeros_us=zeros))
    xb, wb = x.bfloat16(), w.bfloat16()

    def torch_grouped():
        return torch._grouped_mm(xb, wb.transpose(-2, -1), offs=a_offsets[1:])

    rows.append(dict(what="torch._grouped_mm", fmt="bf16", slots=experts, n=n, k=k,
                     host_us=round(host_us(torch_grouped), 1), eager_us=round(eager_us(torch_grouped), 1)))
    return rows


def transformers_blocks(tokens=(1, 32, 2048)) -> list[dict]:
    """transformers' own MoE blocks at real sizes (random init, bf16, router included): Qwen3-30B-A3B's
    Qwen3MoeSparseMoeBlock and gpt-oss-20b's GptOssMLP, with the experts of "grouped_mm",
    "batched_mm" (up to 256 tokens) and "moegemm" (bf16, and quantized: fp8_block / bf16_mxfp4),
    eager (eager_us, host_us) and as a CUDA-graph replay (graph_us); the outputs' error against
    grouped_mm's (quantized rows: the format's quantization of these random weights)."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    device = torch.device("cuda")
    moegemm.hf.register()
    blocks = {
        "Qwen3-30B-A3B": (Qwen3MoeSparseMoeBlock, transformers.Qwen3MoeConfig(
            hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8), "fp8_block"),
        "gpt-oss-20b": (GptOssMLP, transformers.GptOssConfig(
            hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4), "bf16_mxfp4"),
    }
    rows = []
    for name, (cls, config, quantized) in blocks.items():
        with torch.device(device):
            block = cls(config).to(torch.bfloat16).eval()
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.02)
        for count in tokens:
            x = torch.randn(1, count, config.hidden_size, device=device, dtype=torch.bfloat16)
            reference = None
            for impl, fmt in (("grouped_mm", None), ("batched_mm", None), ("moegemm", None), ("moegemm", quantized)):
                if impl == "batched_mm" and count > 256:
                    continue
                moegemm.hf.register(fmt=fmt)
                config._experts_implementation = impl

                def call():
                    out = block(x)
                    return out[0] if isinstance(out, tuple) else out

                out = call()
                reference = out if reference is None else reference
                err = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
                rows.append(dict(what="block", model=name, impl=impl if fmt is None else f"{impl}:{fmt}",
                                 tokens=count, eager_us=round(eager_us(call), 1), host_us=round(host_us(call), 1),
                                 graph_us=round(graph_us(call), 1), err_vs_grouped_mm=round(err, 5)))
                print(rows[-1], flush=True)
        moegemm.hf.register()
        del block
        torch.cuda.empty_cache()
    return rows
