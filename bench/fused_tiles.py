"""gpt-oss-120b bf16 gate/up step at ~128 tokens a slot: the fused SwiGLU epilogue on each tile
arrangement (its ring as deep as the fused scratch allows) against the default unfused chain, a sample
of each a round in shuffled order. python bench/fused_tiles.py OUT.json"""
import contextlib
import json
import sys
sys.path.insert(0, "."); sys.path.insert(0, "bench")
import torch

import ab_sm90 as ab
import moe_layer as ml
from moegemm import benchmark, grouped_matmul_swiglu
from moegemm.config import Sm90Config, deepest_ring, override_config

dev = torch.device("cuda")
n, k = ab.SHAPES["gptoss-up"]
sizes = ab.poisson_sizes(128, 128, 7)
inp = benchmark.Inputs("bf16", n, k, sizes, dev)
bias = torch.randn(len(sizes), n, device=dev)


def call(fused):
    return lambda: grouped_matmul_swiglu(inp.a, inp.b, inp.a_scales, inp.b_scales, inp.a_offsets, inp.expert_ids,
                                         fmt="bf16", gate_up_layout="interleaved", out_fmt="bf16",
                                         activation="swiglu_oai", bias=bias,
                                         scale_layout=inp.scale_layout, fused=fused).data


tiles = {"split-64x128": dict(block_n=64, split_n=True, group_m=4),
         "split-64x256": dict(block_n=128, split_n=True, group_m=4),
         "normal-128x128": dict(block_n=128, group_m=4), "normal-128x256": dict(block_n=256, group_m=4)}
variants = {"default-fused": (None, True), "default-unfused": (None, False)}
for name, kw in tiles.items():
    variants["fused-" + name] = (deepest_ring(Sm90Config(block_k=64, stages=2, **kw), 2, 2, fused=True), True)
timer = ml.Timer(dev)
timed, ref = {}, None
for name, (cfg, fused) in variants.items():
    try:
        with override_config(cfg) if cfg is not None else contextlib.nullcontext():
            fn = call(fused)
            out = fn().float()
            if ref is None:
                ref = out
            err = float(((out - ref).abs().max() / ref.abs().max()))
            timed[name] = timer.prepare(fn)  # (the graph keeps the kernels the override chose)
        print(name, cfg and (cfg.block_n, cfg.split_n, cfg.stages), "err", err, flush=True)
    except Exception as exc:  # noqa: BLE001
        print(name, "FAILED", type(exc).__name__, str(exc)[:200], flush=True)
res = {nm: graph_ms * 1e3 for nm, (graph_ms, _, _) in timer.in_turns(timed).items()}
for nm, us in res.items():
    print(f"{nm}: {us:.1f} us  (unfused/this {res['default-unfused'] / us:.3f})", flush=True)
json.dump({"gpu": torch.cuda.get_device_name(), "sizes": sizes, "us": res}, open(sys.argv[1], "w"), indent=1)
