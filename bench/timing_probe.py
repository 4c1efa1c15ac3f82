"""Why DeepSeek-V3 4096 graph replays timed after the baseline ran slower than from rest: the same graphs
timed alone, beside the baseline, in turns with it, after a rest; nvidia-smi logs clocks, power and
throttle reasons every 100 ms to OUT.smi.

    python bench/timing_probe.py OUT.json {fp8_block|mxfp8}
"""
import subprocess, sys, time, statistics, json
sys.path.insert(0, "."); sys.path.insert(0, "bench")
import torch, triton.testing
import moe_layer as ml
import moegemm

dev = torch.device("cuda")
log = []
def mark(msg):
    log.append((time.time(), msg)); print(f"{time.time():.2f} {msg}", flush=True)

smi = subprocess.Popen(["nvidia-smi",
                        "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active",
                        "--format=csv,noheader", "-lms", "100"], stdout=open(sys.argv[1] + ".smi", "w"))
cfg = ml.MODELS["DeepSeek-V3"]
gen = torch.Generator(device=dev).manual_seed(1234)
w = ml.Fp8Weights(cfg, dev, gen)
x, ids, tw = ml.routing_inputs(cfg, 4096, 4096 * 7919, dev)
fmt = sys.argv[2]
w_gu, w_dn = w.ours(fmt)
gu_b, dn_b = w.biases()
ours = lambda: moegemm.moe_forward(x, ids, tw, w_gu, w_dn, gate_up_layout=ml.gate_up_layout(fmt), activation="swiglu",
                                   fused=True, backend="auto")
base = ml.baseline_for(w, fmt, cfg, "fp8_rowwise")
basef = lambda: base(x, ids, tw)
def graph(fn):
    fn(); torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g
def med(fn, rep=100):
    return statistics.median(triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="all")) * 1e3
res = {}
go = graph(ours)
mark("ours alone start")
res["ours_alone"] = [med(go.replay) for _ in range(3)]
mark(f"ours alone {res['ours_alone']}")
res["ours_eager"] = [med(ours) for _ in range(2)]
mark(f"ours eager {res['ours_eager']}")
gb = graph(basef)
mark(f"base captured, mem {torch.cuda.memory_allocated() / 2**30:.1f} GiB "
     f"reserved {torch.cuda.memory_reserved() / 2**30:.1f}")
res["ours_with_base_alive"] = [med(go.replay) for _ in range(3)]
mark(f"ours with base graph alive {res['ours_with_base_alive']}")
turns = []
for r in range(3):
    b = med(gb.replay); o = med(go.replay)
    turns.append((b, o)); mark(f"turn {r}: base {b:.1f} ours {o:.1f}")
res["turns"] = turns
time.sleep(3)
res["ours_after_sleep"] = med(go.replay)
mark(f"ours after 3 s sleep {res['ours_after_sleep']:.1f}")
res["ours_eager_after"] = med(ours)
mark(f"ours eager {res['ours_eager_after']:.1f}")
del gb; torch.cuda.synchronize(); torch.cuda.empty_cache()
res["ours_base_freed"] = [med(go.replay) for _ in range(2)]
mark(f"ours, base graph freed {res['ours_base_freed']}")
go2 = graph(ours)
res["ours_new_graph"] = [med(go2.replay) for _ in range(2)]
mark(f"ours, a new graph {res['ours_new_graph']}")
smi.terminate()
json.dump({"res": res, "log": log}, open(sys.argv[1], "w"), indent=1)
