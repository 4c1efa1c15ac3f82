"""GPU differential fuzz: random grouped matmuls of the shapes users run, every kernel backend
against the fp64 reference, each call twice and compared bit for bit.

    python bench/fuzz.py --out bench/results                 # >= 500 problems, one GPU, < 8 min
    python bench/fuzz.py --replay SEED [--backend sm90]      # one problem again (a failure's line)

A problem is drawn from its seed alone (base seed * 1_000_003 + index): format and scale layout;
(N, K) of a real model (DeepSeek-V3, Qwen3-235B, gpt-oss, Kimi K2 at TP8) or one the contract
allows (K = 2880, N = 192, K a multiple of only 16 or 32); 1 to 384 group slots with 0 to 8192
tokens each from uniform or Zipf draws (at most MAX_ROWS in all); expert ids repeated, unsorted
and -1; a_offsets[0] > 0 and rows after the last group; expert and row scales or none; bf16 or
fp32 output. Two problems in five are drawn "large": K >= 2048 and more 128 x 128 tiles than the
GPU has SMs. Each backend that applies (sm90 on Hopper, triton) runs it twice into poisoned
outputs: rows outside valid groups must keep their poison, the two results must be identical,
and the valid rows must be within the format's tolerance of the fp64 reference
(tests/cases.py: elementwise against sum |a*b|, and normalized). The formats that take
prepacked weights (formats.PREPACK_FORMATS, N and K multiples of 64) run sm90 once more on them
("sm90-prepacked"): checked the same way, and bit-identical to sm90 on the plain order where both
run the decoding kernel (mxfp4 and w4a8 at decode run another kernel on the plain order).

Workers: processes sharing the GPU (and Triton's cache), so kernel compilation runs on several
cores; the problems are the same whatever their number.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import platform
import random
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

MODEL_SHAPES = {  # (N, K) of the products of real models
    "DeepSeek-V3 up": (4096, 7168), "DeepSeek-V3 down": (7168, 2048), "DeepSeek-V3 N=2048": (2048, 7168),
    "Qwen3-235B up": (3072, 4096), "Qwen3-235B down": (4096, 1536),
    "gpt-oss up": (5760, 2880), "gpt-oss down": (2880, 2880),
    "Kimi K2 TP8 up": (512, 7168), "Kimi K2 TP8 down": (7168, 256),
}
ODD_SHAPES = {  # what the contract allows beyond them
    "N=192": (192, 4096), "K=2880 N=320": (320, 2880), "K%32": (1024, 1056), "K%16": (768, 1040),
}
FORMATS = ("bf16", "fp8_block", "mxfp8", "mxfp4", "nvfp4", "w4a8", "bf16_mxfp4", "bf16_nvfp4", "bf16_mxfp8")
MAX_ROWS = 16384  # tokens of one problem (the fp64 reference stays well under a second)
MAX_WEIGHTS = 1 << 27  # E * N * K: the weights quantized from fp32 (512 MB) per worker
LARGE_SHARE = 0.4  # of the problems drawn with K >= 2048 and more tiles than SMs


def problem_seed(base: int, index: int) -> int:
    return base * 1_000_003 + index


def draw(seed: int, sm_count: int) -> dict:
    """The problem of `seed`: its description only (no tensors)."""
    rng = random.Random(seed)
    large = rng.random() < LARGE_SHARE
    fmt = rng.choice(FORMATS)
    from moegemm.formats import FORMATS as TABLE

    f = TABLE[fmt]
    layout = rng.choice(("plain", "swizzled")) if f.swizzle_capable else "plain"
    shapes = {**MODEL_SHAPES, **ODD_SHAPES}
    names = [s for s, (n, k) in shapes.items() if k % f.k_multiple == 0 and (not large or k >= 2048)]
    shape = rng.choice(names)
    n, k = shapes[shape]
    regime = rng.choice(("decode", "mid", "prefill"))
    if regime == "decode":
        groups, most = rng.randint(16, 384), rng.choice((4, 16, 40))
    elif regime == "mid":
        groups, most = rng.randint(4, 64), rng.choice((128, 512))
    else:
        groups, most = rng.randint(1, 16), rng.choice((2048, 8192))
    if rng.random() < 0.5:  # uniform
        tokens = [rng.randint(0, most) for _ in range(groups)]
    else:  # Zipf-skewed: a few large groups, many small ones
        tokens = [min(most, int(most / rng.paretovariate(1.2)) if rng.random() < 0.9 else 0) for _ in range(groups)]
    if sum(tokens) > MAX_ROWS:
        scale = MAX_ROWS / sum(tokens)
        tokens = [int(t * scale) for t in tokens]
    experts = max(1, min(16, MAX_WEIGHTS // (n * k)))
    if rng.random() < 0.5:
        ids = [rng.randrange(experts) for _ in range(groups)]  # repeated, unsorted
    else:
        ids = [g % experts for g in range(groups)]
        rng.shuffle(ids)
    skip = rng.random() < 0.3
    ids = [-1 if skip and rng.random() < 0.15 else e for e in ids]
    tiles = sum(math.ceil(t / 128) for t, e in zip(tokens, ids) if e >= 0) * math.ceil(n / 128)
    if large and tiles <= sm_count:  # enough tokens for more tiles than SMs
        need = (sm_count // math.ceil(n / 128) + 1) * 128
        tokens[rng.randrange(groups)] += need
        ids = [e if e >= 0 else 0 for e in ids]
        tiles = sum(math.ceil(t / 128) for t, e in zip(tokens, ids) if e >= 0) * math.ceil(n / 128)
    return dict(seed=seed, fmt=fmt, layout=layout, shape=shape, n=n, k=k, regime=regime, tokens=tokens, ids=ids,
                experts=experts, start=rng.choice((0, 0, 0, rng.randint(1, 64))),
                tail=rng.choice((0, 0, 0, rng.randint(1, 64))), with_scales=rng.random() < 0.5,
                out=rng.choice(("bf16", "bf16", "fp32")), tiles=tiles, large=k >= 2048 and tiles > sm_count)


def backends_for(device: str) -> list[str]:
    from moegemm.ops import available_backends

    return [b for b in ("sm90", "triton") if b in available_backends(device)]


def run_problem(problem: dict, only_backend: str | None = None, device: str = "cuda") -> dict:
    """Build the inputs of `problem`, run each backend twice, check. Returns the record."""
    import torch

    import moegemm
    from moegemm.config import sm90_mx_config
    from moegemm.formats import PREPACK_FORMATS
    from moegemm.kernels import sm90
    from moegemm.ops import resolve_backend
    from moegemm.prepack import prepack_codes
    from moegemm.sm90_configs import DecodeConfig

    from cases import TokenPattern, check_output, make_problem, poison_like, tolerance

    torch.manual_seed(problem["seed"])
    pattern = TokenPattern("fuzz", tuple(problem["tokens"]), tuple(problem["ids"]), start=problem["start"],
                           tail=problem["tail"], experts=problem["experts"])
    p = make_problem(problem["fmt"], problem["layout"], pattern, problem["n"], problem["k"], device,
                     with_scales=problem["with_scales"])
    out_dtype = torch.float32 if problem["out"] == "fp32" else torch.bfloat16
    checked = p.problem(out_dtype)
    record = dict(problem, m=p.m, results={})
    valid = p.valid_rows().to(device)
    runs = [(b, b, p.args()) for b in backends_for(device)]
    prepackable = problem["fmt"] in PREPACK_FORMATS and p.n % 64 == 0 and problem["k"] % 64 == 0
    # The plain order's bits are the prepacked ones' where both run the decoding kernel (mxfp4 and
    # w4a8 at decode run the e2m1 promotion kernel on the plain order: other arithmetic).
    same_kernel = prepackable and checked.num_groups > 0 and isinstance(
        sm90_mx_config(checked.fmt, checked.n, checked.k, checked.m / checked.num_groups), DecodeConfig)
    if "sm90" in backends_for(device) and prepackable:
        # (nvfp4's global scales ride in p.expert_scales, as with the raw operands)
        prepacked = moegemm.QuantizedTensor(prepack_codes(p.w.data), p.w.scales, p.fmt, "b", p.layout, prepacked=True)
        a, _, a_scales, _, a_offsets, expert_ids = p.args()
        runs.append(("sm90-prepacked", "sm90", (a, prepacked, a_scales, None, a_offsets, expert_ids)))
    firsts = {}
    for name, backend, args in runs:
        if only_backend not in (None, backend, name) or (backend == "sm90" and not sm90.supports(checked)):
            continue
        outs, note = [], "ok"
        try:
            for _ in range(2):
                poisoned = poison_like(p.m, p.n, out_dtype, device)
                out = poisoned.clone()
                moegemm.grouped_matmul(*args, **p.kwargs(), out=out, out_dtype=out_dtype, backend=backend)
                outs.append((poisoned, out))
            if device == "cuda":
                torch.cuda.synchronize()
            (poisoned, first), (poisoned2, second) = outs
            bits = torch.int16 if out_dtype == torch.bfloat16 else torch.int32
            if not torch.equal(second[~valid].view(bits), poisoned2[~valid].view(bits)):
                note = "rows outside valid groups were written (second call)"
            elif not torch.equal(first[valid].view(bits), second[valid].view(bits)):
                note = "two identical calls gave different bits"
            elif name == "sm90-prepacked" and same_kernel and "sm90" in firsts and not torch.equal(
                    first[valid].view(bits), firsts["sm90"][valid].view(bits)):
                note = "prepacked weights gave other bits than the plain order"
            else:
                check_output(p, first, poisoned, tolerance(problem["fmt"], backend))
            firsts[name] = first
        except AssertionError as exc:
            note = f"check: {exc}"
        except Exception as exc:  # noqa: BLE001 (a crash is a failure of the problem, reported with it)
            note = f"{type(exc).__name__}: {str(exc)[:300]}"
        chosen = resolve_backend(backend, checked, torch.device(device))
        record["results"][name] = dict(ok=note == "ok", note=note, ran=chosen + ("-prepacked" if name != backend
                                                                                 else ""))
    del p, outs, firsts
    if device == "cuda":
        torch.cuda.empty_cache()
    return record


def reproducer(record: dict, backend: str) -> str:
    return f"python bench/fuzz.py --replay {record['seed']} --backend {backend}"


def _worker(args):
    worker, workers, base, count, deadline, sm_count = args
    records = []
    for index in range(worker, count, workers):
        if time.time() > deadline:
            break
        problem = draw(problem_seed(base, index), sm_count)
        t0 = time.time()
        try:
            record = run_problem(problem)
        except Exception:  # noqa: BLE001
            record = dict(problem, results={"setup": dict(ok=False, note=traceback.format_exc()[-400:], ran="-")})
        record["seconds"] = round(time.time() - t0, 2)
        for backend, result in record["results"].items():
            if not result["ok"]:
                print(f"FAIL {reproducer(record, backend)}  # {record['fmt']} {record['layout']} {record['shape']} "
                      f"G={len(record['tokens'])} M={record.get('m')} out={record['out']}: {result['note'][:200]}",
                      flush=True)
        records.append(record)
    return records


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--problems", type=int, default=560)
    parser.add_argument("--seed", type=int, default=20261126)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--budget", type=float, default=420.0, help="seconds before workers stop taking problems")
    parser.add_argument("--out", type=Path, default=None, help="folder for fuzz-<gpu>.json")
    parser.add_argument("--replay", type=int, default=None, help="run the one problem of this seed")
    parser.add_argument("--backend", default=None, help="with --replay: only this backend")
    args = parser.parse_args()

    import torch

    from moegemm.benchmark import provenance

    props = torch.cuda.get_device_properties(0)
    if args.replay is not None:
        problem = draw(args.replay, props.multi_processor_count)
        record = run_problem(problem, args.backend)
        print(json.dumps({k: v for k, v in record.items() if k not in ("tokens", "ids")}, indent=1))
        print("tokens", record["tokens"], "\nids", record["ids"])
        sys.exit(0 if all(r["ok"] for r in record["results"].values()) else 1)

    t0 = time.time()
    deadline = t0 + args.budget
    jobs = [(w, args.workers, args.seed, args.problems, deadline, props.multi_processor_count)
            for w in range(args.workers)]
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        records = [r for chunk in pool.map(_worker, jobs) for r in chunk]
    records.sort(key=lambda r: r["seed"])
    runs = [(r, b, res) for r in records for b, res in r["results"].items()]
    failures = [dict(reproducer=reproducer(r, b), note=res["note"]) for r, b, res in runs if not res["ok"]]
    summary = dict(
        **provenance("bench/fuzz.py"), gpu=props.name, sms=props.multi_processor_count,
        torch=torch.__version__, python=platform.python_version(), base_seed=args.seed,
        seconds=round(time.time() - t0, 1), problems=len(records), runs=len(runs), failures=len(failures),
        large_problems=sum(r["large"] for r in records),
        by_format={f: sum(r["fmt"] == f for r in records) for f in FORMATS},
        by_backend={b: sum(1 for _, bb, _ in runs if bb == b) for b in ("sm90", "sm90-prepacked", "triton")},
        by_kernel_path={ran: sum(1 for _, _, res in runs if res["ran"] == ran) for ran in {res["ran"] for _, _, res
                                                                                            in runs}},
        deterministic=not any("different bits" in f["note"] for f in failures),
    )
    import triton  # (the version the kernels were compiled with)

    summary["triton"] = triton.__version__
    print(json.dumps(summary, indent=1))
    for f in failures[:40]:
        print("FAIL", f["reproducer"], "#", f["note"][:160])
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        name = args.out / f"fuzz-{props.name.replace(' ', '-')}.json"
        slim = [{k: v for k, v in r.items() if k not in ("tokens", "ids")} | dict(groups=len(r["tokens"]))
                for r in records]
        name.write_text(json.dumps(dict(summary=summary, failures=failures, problems=slim), indent=1))
        print("wrote", name)
    sys.exit(1 if failures or len(records) < 500 else 0)


if __name__ == "__main__":
    main()
