"""gpt-oss-120b bf16 gate/up step at ~128 tokens a slot: the fused SwiGLU epilogue on each tile
arrangement (its ring as deep as the fused scratch allows) against the default unfused chain, a sample
of each a round in shuffled order. python bench/fused_tiles.py OUT.json"""
import sys, json, contextlib, statistics, random
sys.path.insert(0, "."); sys.path.insert(0, "bench")
import torch, triton
import ab_sm90 as ab
from moegemm import benchmark, grouped_matmul_swiglu
from moegemm.config import Sm90Config, deepest_ring, override_config

dev = torch.device("cuda")
n, k = ab.SHAPES["gptoss-up"]
sizes = ab.poisson_sizes(128, 128, 7)
inp = benchmark.Inputs("bf16", n, k, sizes, dev)
bias = torch.randn(len(sizes), n, device=dev)
def call(fused):
    return lambda: grouped_matmul_swiglu(inp.a, inp.b, inp.a_scales, inp.b_scales, inp.a_offsets, inp.expert_ids,
                                         fmt="bf16", out_fmt="bf16", activation="swiglu_oai", bias=bias,
                                         scale_layout=inp.scale_layout, fused=fused).data
tiles = {"split-64x128": dict(block_n=64, split_n=True, group_m=4), "split-64x256": dict(block_n=128, split_n=True, group_m=4),
         "normal-128x128": dict(block_n=128, group_m=4), "normal-128x256": dict(block_n=256, group_m=4)}
variants = {"default-fused": (None, True), "default-unfused": (None, False)}
for name, kw in tiles.items():
    variants["fused-" + name] = (deepest_ring(Sm90Config(block_k=64, stages=2, **kw), 2, 2, fused=True), True)
graphs, ref = {}, None
for name, (cfg, fused) in variants.items():
    try:
        with override_config(cfg) if cfg is not None else contextlib.nullcontext():
            fn = call(fused)
            out = fn().float(); torch.cuda.synchronize()
            if ref is None: ref = out
            err = float(((out - ref).abs().max() / ref.abs().max()))
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
        graphs[name] = g
        print(name, cfg and (cfg.block_n, cfg.split_n, cfg.stages), "err", err, flush=True)
    except Exception as exc:
        print(name, "FAILED", type(exc).__name__, str(exc)[:200], flush=True)
driver = triton.runtime.driver.active
cache = driver.get_empty_cache_for_benchmark()
events = {nm: [] for nm in graphs}
names = list(graphs); rnd = random.Random(0)
for g in graphs.values(): g.replay()
for _ in range(40):
    rnd.shuffle(names)
    for nm in names:
        driver.clear_cache(cache)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); graphs[nm].replay(); e.record(); events[nm].append((s, e))
torch.cuda.synchronize()
res = {nm: statistics.median(s.elapsed_time(e) for s, e in ev) * 1e3 for nm, ev in events.items()}
for nm, us in res.items():
    print(f"{nm}: {us:.1f} us  (unfused/this {res['default-unfused'] / us:.3f})", flush=True)
json.dump({"gpu": torch.cuda.get_device_name(), "sizes": sizes, "us": res}, open(sys.argv[1], "w"), indent=1)
