"""Expert parallelism: the MoE layer's routed experts on W GPUs (NCCL) against one GPU running the
whole layer.

    python bench/ep_layer.py --world 2 --out DIR [--tokens 1,64,512,4096,16384] [--models ...]

Spawns W ranks, one GPU each. Every rank builds the whole model from the same seed
(bench/layer_models.py: DeepSeek-V3 256 experts top-8 in fp8_block and mxfp8, gpt-oss-120b 128
experts top-4 in bf16_mxfp4 and mxfp4, random codes) and keeps its experts [r*E/W, (r+1)*E/W)
for the expert-parallel layer. At T tokens a rank (router choices uniform, as moe_layer.py's):

    one_gpu_us         one GPU running the whole layer on T tokens (moe_forward, CUDA graph replay,
                       L2 flushed, median: bench/timing.py's Timer)
    graph_*            the decode path (fixed capacity, no host read), its three phases each
                       captured in a CUDA graph and replayed in turn: graph_dispatch_us
                       (distributed.dispatch), graph_local_us (moe.moe_forward_received, the
                       rank's experts), graph_combine_us (distributed.combine), GPU time without host
                       gaps; medians, L2 flushed, the slowest rank's
    ep_us, dispatch_us, local_us, combine_us   the prefill path (counts read on the host), eager,
                       CUDA events around each phase; host_us the Python time of each phase on
                       rank 0 (a phase whose host time exceeds its GPU time is host-bound: the
                       host read leaves the GPU idle until the next launches arrive)
    *a2a_dispatch_us, *a2a_combine_us   all_to_all_single alone on the same splits and bytes (uint8
                       rows, fp32 partial sums): the NCCL time for those messages
    *exchange_share    (dispatch + combine) / the layer; *exchange_efficiency = (a2a dispatch +
                       a2a combine) / (dispatch + combine)
    *dispatch_bytes, *combine_bytes   bytes rank 0 sends to other ranks
    *tokens_per_s_ratio = (W * T / EP time) / (T / one_gpu_us): the group's tokens/s over one GPU's
    check: the EP layer's outputs on a rank's tokens (both paths) against one GPU running the
    whole layer on all W*T tokens (relative Frobenius error, the worst rank, T <= 4096)

Writes DIR/ep-layer-w<W>-<GPU>.json and .csv (rows + env: script, commit (MOEGEMM_COMMIT
overrides), NCCL version). NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and the others).
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from layer_models import ALPHA, LIMIT, MODELS, build_weights, gate_up_layout, routing_inputs  # noqa: E402
from timing import Timer  # noqa: E402

import moegemm  # noqa: E402
from moegemm import distributed  # noqa: E402

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TOKENS = (1, 64, 512, 4096, 16384)
FORMATS = {"DeepSeek-V3": ("fp8_block", "mxfp8"), "gpt-oss-120b": ("bf16_mxfp4", "mxfp4")}
CHECK_MAX_TOKENS = 4096  # a rank's tokens up to which the outputs are checked (the reference runs W*T)
ITERS = 15
TOL = 1e-3


@dataclass
class Row:
    model: str
    fmt: str
    world: int
    tokens: int
    one_gpu_us: float = math.nan
    # the decode path, each phase a CUDA graph (GPU time)
    graph_us: float = math.nan
    graph_dispatch_us: float = math.nan
    graph_local_us: float = math.nan
    graph_combine_us: float = math.nan
    graph_a2a_dispatch_us: float = math.nan
    graph_a2a_combine_us: float = math.nan
    graph_exchange_share: float = math.nan
    graph_exchange_efficiency: float = math.nan
    graph_tokens_per_s_ratio: float = math.nan
    graph_ratio_to_one_gpu: float = math.nan
    graph_dispatch_bytes: int = 0
    graph_combine_bytes: int = 0
    # the prefill path, eager (counts read on the host)
    ep_us: float = math.nan
    dispatch_us: float = math.nan
    local_us: float = math.nan
    combine_us: float = math.nan
    host_us: list = field(default_factory=list)  # Python time of dispatch, local, combine: rank 0's
    a2a_dispatch_us: float = math.nan
    a2a_combine_us: float = math.nan
    exchange_share: float = math.nan
    exchange_efficiency: float = math.nan
    tokens_per_s_ratio: float = math.nan
    dispatch_bytes: int = 0
    combine_bytes: int = 0
    check: str = ""
    notes: list = field(default_factory=list)


def _flush(cache):
    import triton

    triton.runtime.driver.active.clear_cache(cache)


def _slowest(value: float, device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _phases(layer_args, x, ids, tw, cache, iters):
    """Medians (us) of dispatch, local, combine and the whole, eager, prefill path."""
    samples, host = [], []
    for i in range(iters + 2):
        torch.cuda.synchronize()
        dist.barrier()
        _flush(cache)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        clock = [time.perf_counter()]
        events[0].record()
        sent = distributed.dispatch(x, ids, tw, layer_args["fmt"], num_experts=layer_args["num_experts"],
                                    group=dist.group.WORLD, path="prefill")
        events[1].record()
        clock.append(time.perf_counter())
        partial = _local(layer_args, sent)
        events[2].record()
        clock.append(time.perf_counter())
        distributed.combine(partial, sent, out_dtype=x.dtype)
        events[3].record()
        clock.append(time.perf_counter())
        torch.cuda.synchronize()
        if i >= 2:
            samples.append([events[j].elapsed_time(events[j + 1]) * 1e3 for j in range(3)])
            host.append([(clock[j + 1] - clock[j]) * 1e6 for j in range(3)])
    medians = [statistics.median(s[j] for s in samples) for j in range(3)]
    return medians, [statistics.median(h[j] for h in host) for j in range(3)], sent


def _a2a_us(splits_out, splits_in, row_elems, dtype, device, cache, iters):
    send = torch.ones(sum(splits_out), row_elems, dtype=dtype, device=device)
    recv = torch.empty(sum(splits_in), row_elems, dtype=dtype, device=device)
    times = []
    for i in range(iters + 2):
        torch.cuda.synchronize()
        dist.barrier()
        _flush(cache)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dist.all_to_all_single(recv, send, splits_in, splits_out)
        end.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def _decode_phases_us(layer_args, x, ids, tw, cache, iters):
    """The decode path's three phases, each captured in its own CUDA graph (the next reads the
    previous one's outputs) and replayed in turn: medians (us) of their GPU times, no host."""
    def phases():
        sent = distributed.dispatch(x, ids, tw, layer_args["fmt"], num_experts=layer_args["num_experts"],
                                    group=dist.group.WORLD, path="decode")
        partial = _local(layer_args, sent)
        return sent, partial, distributed.combine(partial, sent, out_dtype=x.dtype)

    phases()  # compile, then warm up on a side stream as capture wants
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        phases()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graphs = [torch.cuda.CUDAGraph() for _ in range(3)]
    with torch.cuda.graph(graphs[0]):
        sent = distributed.dispatch(x, ids, tw, layer_args["fmt"], num_experts=layer_args["num_experts"],
                                    group=dist.group.WORLD, path="decode")
    with torch.cuda.graph(graphs[1]):
        partial = _local(layer_args, sent)
    with torch.cuda.graph(graphs[2]):
        distributed.combine(partial, sent, out_dtype=x.dtype)
    samples = []
    for i in range(iters + 2):
        torch.cuda.synchronize()
        dist.barrier()
        _flush(cache)
        events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        events[0].record()
        for graph, event in zip(graphs, events[1:]):
            graph.replay()
            event.record()
        torch.cuda.synchronize()
        if i >= 2:
            samples.append([events[j].elapsed_time(events[j + 1]) * 1e3 for j in range(3)])
    return [statistics.median(s[j] for s in samples) for j in range(3)], sent


def _local(layer_args, sent):
    return moegemm.moe.moe_forward_received(sent, *layer_args["local"], **layer_args["kw"])


def _row(model, cfg, fmt, weights, tokens, world, rank, device, timer, cache) -> Row:
    row = Row(model, fmt, world, tokens)
    experts = cfg["experts"]
    first, last = distributed.expert_range(experts, dist.group.WORLD)
    w_gu, w_dn = weights.ours(fmt)
    gu_bias, dn_bias = weights.biases()
    kw = {"gate_up_layout": gate_up_layout(fmt), "activation": cfg["activation"], "alpha": ALPHA, "limit": LIMIT,
          "fused": True, "backend": "auto"}  # (moe_forward's defaults but these)
    local_kw = {**kw, "gate_up_bias": None if gu_bias is None else gu_bias[first:last],
                "down_bias": None if dn_bias is None else dn_bias[first:last]}
    whole_kw = {**kw, "gate_up_bias": gu_bias, "down_bias": dn_bias}
    local = (w_gu.experts(first, last), w_dn.experts(first, last))  # (every field kept: prepacked too)
    x_all, ids_all, tw_all = routing_inputs(cfg, world * tokens, 7 + tokens, device)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    x, ids, tw = x_all[mine], ids_all[mine], tw_all[mine]

    def ep_layer(path):
        return moegemm.moe_forward(x, ids, tw, *local, ep_group=dist.group.WORLD, ep_path=path, **local_kw)

    got = ep_layer("prefill")
    if tokens <= CHECK_MAX_TOKENS:
        want = moegemm.moe_forward(x_all, ids_all, tw_all, w_gu, w_dn, **whole_kw)[mine]
        worst = 0.0
        for path, out in (("prefill", got), ("decode", ep_layer("decode"))):
            worst = max(worst, _slowest(((out.double() - want.double()).norm() / want.double().norm()).item(),
                                        device))
        row.check = f"{'ok' if worst <= TOL else 'FAIL'} rel {worst:.1e}"
        del want
    timed = timer.prepare(lambda: moegemm.moe_forward(x, ids, tw, w_gu, w_dn, **whole_kw))
    row.one_gpu_us = _slowest(timer.in_turns({"one": timed})["one"][0] * 1e3, device)
    args = {"fmt": fmt, "num_experts": experts, "local": local, "kw": local_kw}
    hidden = cfg["hidden"]

    def a2a(sent):
        return (_slowest(_a2a_us(sent.send_splits, sent.recv_splits, sent.row_bytes, torch.uint8, device, cache,
                                 ITERS), device),
                _slowest(_a2a_us(sent.recv_splits, sent.send_splits, hidden, torch.float32, device, cache, ITERS),
                         device))

    phases, sent = _decode_phases_us(args, x, ids, tw, cache, ITERS)
    row.graph_dispatch_us, row.graph_local_us, row.graph_combine_us = (_slowest(v, device) for v in phases)
    row.graph_us = _slowest(sum(phases), device)
    row.graph_a2a_dispatch_us, row.graph_a2a_combine_us = a2a(sent)
    d_bytes, c_per_col = sent.bytes_to_others()
    row.graph_dispatch_bytes, row.graph_combine_bytes = d_bytes, c_per_col * hidden
    exchange = row.graph_dispatch_us + row.graph_combine_us
    row.graph_exchange_share = exchange / row.graph_us
    row.graph_exchange_efficiency = (row.graph_a2a_dispatch_us + row.graph_a2a_combine_us) / exchange
    row.graph_tokens_per_s_ratio = world * row.one_gpu_us / row.graph_us
    row.graph_ratio_to_one_gpu = row.graph_us / row.one_gpu_us
    del sent

    (d_us, l_us, c_us), host_us, sent = _phases(args, x, ids, tw, cache, ITERS)
    row.host_us = [round(v) for v in host_us]
    row.dispatch_us, row.local_us, row.combine_us = (_slowest(v, device) for v in (d_us, l_us, c_us))
    row.ep_us = _slowest(d_us + l_us + c_us, device)
    row.a2a_dispatch_us, row.a2a_combine_us = a2a(sent)
    d_bytes, c_per_col = sent.bytes_to_others()
    row.dispatch_bytes, row.combine_bytes = d_bytes, c_per_col * hidden
    row.exchange_share = (row.dispatch_us + row.combine_us) / row.ep_us
    row.exchange_efficiency = (row.a2a_dispatch_us + row.a2a_combine_us) / (row.dispatch_us + row.combine_us)
    row.tokens_per_s_ratio = world * row.one_gpu_us / row.ep_us
    return row


def _rank_main(rank, world, port, args, out_dir):
    os.environ.update(NO_MULTICAST)
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device, timeout=datetime.timedelta(seconds=180))
    import triton

    cache = triton.runtime.driver.active.get_empty_cache_for_benchmark()
    timer = Timer(device)
    rows, start = [], time.time()
    with torch.no_grad():
        for m_index, (model, cfg) in enumerate(MODELS.items()):
            fmts = [f for f in FORMATS.get(model, ()) if f in args.formats.get(model, FORMATS[model])]
            if not fmts:
                continue
            weights = build_weights(cfg, m_index, device)
            for fmt in fmts:
                for tokens in args.tokens:
                    # (every rank takes the same decision: rank 0's clock)
                    late = _slowest(float(time.time() - start > args.budget), device) > 0
                    # An error raises on its rank, and mp.spawn ends the others (the rows so far are written).
                    row = (Row(model, fmt, world, tokens, check="skipped (budget)") if late else
                           _row(model, cfg, fmt, weights, tokens, world, rank, device, timer, cache))
                    rows.append(row)
                    if rank == 0:
                        _write(rows, world, out_dir)
                        r = row
                        print(f"{model} {fmt} W={world} T={tokens}: one {r.one_gpu_us:.0f} us | graphs "
                              f"{r.graph_us:.0f} (d {r.graph_dispatch_us:.0f} l {r.graph_local_us:.0f} c "
                              f"{r.graph_combine_us:.0f}; a2a {r.graph_a2a_dispatch_us:.0f}/"
                              f"{r.graph_a2a_combine_us:.0f}) share {r.graph_exchange_share:.2f} eff "
                              f"{r.graph_exchange_efficiency:.2f} "
                              f"x{r.graph_tokens_per_s_ratio:.2f} ratio {r.graph_ratio_to_one_gpu:.2f} | eager "
                              f"{r.ep_us:.0f} (d {r.dispatch_us:.0f} l {r.local_us:.0f} c {r.combine_us:.0f}; a2a "
                              f"{r.a2a_dispatch_us:.0f}/{r.a2a_combine_us:.0f}) share {r.exchange_share:.2f} eff "
                              f"{r.exchange_efficiency:.2f} x{r.tokens_per_s_ratio:.2f} host {r.host_us} | {r.check}",
                              flush=True)
            del weights
            torch.cuda.empty_cache()
    dist.destroy_process_group()


def _env(world):
    root = Path(__file__).resolve().parents[1]
    commit = os.environ.get("MOEGEMM_COMMIT")
    if not commit:
        try:
            commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True,
                                    check=False).stdout.strip()
        except OSError:
            commit = ""
    return {"script": "bench/ep_layer.py", "commit": commit, "gpu": torch.cuda.get_device_name(0), "world": world,
            "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "env": {k: os.environ.get(k) for k in NO_MULTICAST}}


def _write(rows, world, out_dir: Path):
    env = _env(world)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"ep-layer-w{world}-{env['gpu'].replace(' ', '-')}"
    stem.with_suffix(".json").write_text(json.dumps({"env": env, "rows": [asdict(r) for r in rows]}, indent=1,
                                                    default=str))
    with stem.with_suffix(".csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(asdict(Row("", "", 0, 0)).keys()))
        writer.writeheader()
        for r in rows:
            writer.writerow({**asdict(r), "notes": "; ".join(r.notes)})
    print(f"wrote {stem}.json, {stem}.csv ({len(rows)} rows)", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu-out"))
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="tokens a rank, comma-separated")
    parser.add_argument("--models", default="", help="model:fmt,fmt;model:fmt (default: every model and format)")
    parser.add_argument("--budget", type=float, default=420.0, help="start no row after this many seconds")
    args = parser.parse_args(argv)
    if torch.cuda.device_count() < args.world:
        print(f"needs {args.world} GPUs, found {torch.cuda.device_count()}", file=sys.stderr)
        return 1
    args.tokens = tuple(int(t) for t in args.tokens.split(","))
    args.formats = {}
    for part in filter(None, args.models.split(";")):
        model, _, fmts = part.partition(":")
        args.formats[model] = tuple(fmts.split(",")) if fmts else FORMATS[model]
    if args.formats:
        for model in FORMATS:
            args.formats.setdefault(model, ())
    os.environ.update(NO_MULTICAST)
    with socket.socket() as s:  # a free port for the process group's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_main, args=(args.world, port, args, Path(args.out)), nprocs=args.world, join=True)
    written = json.loads(next(Path(args.out).glob(f"ep-layer-w{args.world}-*.json")).read_text())
    return 2 if any(r["check"].startswith(("FAIL", "ERROR")) for r in written["rows"]) else 0


if __name__ == "__main__":
    sys.exit(main())
