"""How fast fp8_block's dense kernel (kernels/sm90/dense.py) could run if its per-block promotion
cost nothing: the same kernel with its K loop's scale work removed, timed beside the real one,
DeepGEMM and torch's FP8 rowwise grouped mm, in one process.

fp8_block multiplies each 128-K block's partial sums by the token and weight scales (docs/contract.md),
so its K loop issues a fresh wgmma a block, waits for it, and adds the scaled tile into the
accumulator. Two ceiling variants, built from dense.py's source at run time (nothing of them ships)
and swapped into the launcher for their rows; their results are wrong on purpose and not checked:
    unscaled   the same wgmmas, waits and adds a block, with no scale read and no multiply (what the
               promotion's scale loads and FMAs cost)
    chained    no promotion at all: the wgmmas accumulate in place, one step in flight, as bf16's
               K loop (what the per-block wait and add cost: the loop a plain FP8 GEMM runs)
The producer, the ring (with the scales the config stages there), the schedule and the epilogue
stay. If even `chained` trails DeepGEMM, the gap is outside the promotion. One candidate, correct:
    overlapped the promotion of block k overlapping block k+1's wgmma (two partial tiles, which a
               256-wide tile's two accumulators leave no registers for: 128-wide tiles), timed
               beside the kernel as it is on the same 128-wide config, bits compared

    python bench/promotion_ceiling.py --out DIR [--only t-] [--regimes 4x8192,8x4096,32x256,64x128]
    python bench/promotion_ceiling.py --sass      (CPU: each variant's K loops at the prefill config,
                                                  compiled offline: instructions a million MACs,
                                                  spills, and ptxas' wgmma serialization infos)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, os.environ.get("MOEGEMM_TREE") or str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# The promotion loops' calls in DenseConsumer.tile, each replaced by a variant with its signature.
STAGED_CALL = "_promote_staged(m_op, n_op, self.ring, self.scales, zero, it, k_steps, WG, N_SUB)"
LOADED_CALL = "_promote(m_op, n_op, self.ring, zero, a_scale_rows, tok_mask, b_scale_row, self.NUM_KB,"
VARIANT_STUBS = '''

@gluon.jit
def _ceiling_loop(m_op, n_op, ring, zero, it, k_steps, WG: gl.constexpr, SPLIT_N: gl.constexpr,
                  N_SUB: gl.constexpr, CHAINED: gl.constexpr):
    SUB_N: gl.constexpr = zero.shape[1]
    acc0 = zero
    acc1 = zero
    prev = 0
    for kk in range(k_steps):
        stage = ring.wait_ready(it)
        a, b = _wgmma_operands(m_op, n_op, stage, 0, WG, SPLIT_N, SUB_N, False, False)
        if CHAINED:
            acc0 = warpgroup_mma(a, b, acc0, is_async=True)
            if N_SUB == 2:
                a, b = _wgmma_operands(m_op, n_op, stage, SUB_N, WG, SPLIT_N, SUB_N, False, False)
                acc1 = warpgroup_mma(a, b, acc1, is_async=True)
                acc0, acc1 = warpgroup_mma_wait(2, deps=(acc0, acc1))
            else:
                acc0 = warpgroup_mma_wait(1, deps=(acc0, ))
            ring.release(prev, pred=kk > 0)
            prev = stage
        else:
            part = warpgroup_mma(a, b, zero, use_acc=False, is_async=True)
            part = warpgroup_mma_wait(0, deps=(part, ))
            if N_SUB == 2:
                acc0 = acc0 + part
                a, b = _wgmma_operands(m_op, n_op, stage, SUB_N, WG, SPLIT_N, SUB_N, False, False)
                part = warpgroup_mma(a, b, part, use_acc=False, is_async=True)
                part = warpgroup_mma_wait(0, deps=(part, ))
                ring.release(stage)
                acc1 = acc1 + part
            else:
                ring.release(stage)
                acc0 = acc0 + part
        it += 1
    if CHAINED:
        if N_SUB == 2:
            acc0, acc1 = warpgroup_mma_wait(0, deps=(acc0, acc1))
        else:
            acc0 = warpgroup_mma_wait(0, deps=(acc0, ))
        ring.release(prev)
    return acc0, acc1, it


@gluon.jit
def _staged_block(m_op, n_op, ring, scales, zero, part, it, WG: gl.constexpr):
    """Wait for K step `it`'s stage, issue its wgmma into `part` (use_acc=False: its registers
    reused), read its scales; the stage, the issued tile and the block's scale column."""
    stage = ring.wait_ready(it)
    a, b = _wgmma_operands(m_op, n_op, stage, 0, WG, False, zero.shape[1], False, False)
    part = warpgroup_mma(a, b, part, use_acc=False, is_async=True)
    row_layout: gl.constexpr = gl.SliceLayout(1, zero.type.layout)
    sa = scales.tok_bufs.index(stage).slice(WG * WG_ROWS, WG_ROWS).load(row_layout)
    scale = gl.expand_dims(sa * _stage_scale(scales.w_bufs.index(stage), 0), 1)
    return stage, part, scale


@gluon.jit
def _pinned(acc):
    """acc, computed before the next wgmma is issued: passed through a wgmma wait that retires
    nothing new, so the compiler cannot sink the promotion past the wgmma that reuses the
    promoted tile's registers (which would keep that tile alive in a copy)."""
    return warpgroup_mma_wait(1, deps=(acc, ))


@gluon.jit
def _overlapped_staged(m_op, n_op, ring, scales, zero, it, k_steps, WG: gl.constexpr, N_SUB: gl.constexpr):
    """The staged promotion of a 128-wide tile with the next block's wgmma in flight while this
    block is promoted: two partial tiles (A, B) alternate, the loop unrolled by two so neither is
    copied across the back edge; the same sums in the same order as _promote_staged."""
    gl.static_assert(N_SUB == 1, "overlapped: 128-wide tiles")
    acc = zero
    stage_a, part_a, scale_a = _staged_block(m_op, n_op, ring, scales, zero, zero, it, WG)
    part_b = zero
    for kk in range(1, k_steps - 1, 2):
        stage_b, part_b, scale_b = _staged_block(m_op, n_op, ring, scales, zero, part_b, it + kk, WG)
        part_a = warpgroup_mma_wait(1, deps=(part_a, ))
        acc = _pinned(acc + part_a * scale_a)
        ring.release(stage_a)
        stage_a, part_a, scale_a = _staged_block(m_op, n_op, ring, scales, zero, part_a, it + kk + 1, WG)
        part_b = warpgroup_mma_wait(1, deps=(part_b, ))
        acc = _pinned(acc + part_b * scale_b)
        ring.release(stage_b)
    if k_steps % 2 == 0:  # (names of their own: a branch may not change a value's type)
        stage_l, last, scale_l = _staged_block(m_op, n_op, ring, scales, zero, part_b, it + k_steps - 1, WG)
        done_a = warpgroup_mma_wait(1, deps=(part_a, ))
        acc = acc + done_a * scale_a
        ring.release(stage_a)
        done_l = warpgroup_mma_wait(0, deps=(last, ))
        acc = acc + done_l * scale_l
        ring.release(stage_l)
    else:
        done_a = warpgroup_mma_wait(0, deps=(part_a, ))
        acc = acc + done_a * scale_a
        ring.release(stage_a)
    return acc, zero, it + k_steps


@gluon.jit
def _staged_ceiling(m_op, n_op, ring, scales, zero, it, k_steps, WG: gl.constexpr, N_SUB: gl.constexpr):
    if CEILING_OVERLAPPED:
        acc0, acc1, it = _overlapped_staged(m_op, n_op, ring, scales, zero, it, k_steps, WG, N_SUB)
    else:
        acc0, acc1, it = _ceiling_loop(m_op, n_op, ring, zero, it, k_steps, WG, False, N_SUB, CEILING_CHAINED)
    return acc0, acc1, it


@gluon.jit
def _loaded_ceiling(m_op, n_op, ring, zero, a_scale_rows, tok_mask, b_scale_row, NUM_KB, high_valid, it, k_steps,
                    WG: gl.constexpr, SPLIT_N: gl.constexpr, N_SUB: gl.constexpr, tok_dim: gl.constexpr):
    return _ceiling_loop(m_op, n_op, ring, zero, it, k_steps, WG, SPLIT_N, N_SUB, CEILING_CHAINED)
'''
CEILINGS = ("unscaled", "chained")  # results wrong on purpose
VARIANTS = (*CEILINGS, "overlapped")  # overlapped: correct, on 128-wide tiles
REGIMES = ((4, 8192), (8, 4096), (32, 256), (64, 128))


def variant_kernel(variant: str):
    """dense.py's kernel with its promotion loops replaced by the `variant` ceiling (module docstring)."""
    from source_variants import module_variant

    from moegemm.kernels.sm90 import launcher

    replacements = [(call, stub + call.split("(", 1)[1])
                    for call, stub in ((STAGED_CALL, "_staged_ceiling("), (LOADED_CALL, "_loaded_ceiling("))]
    stubs = VARIANT_STUBS + (f"\n\nCEILING_CHAINED = gl.constexpr({variant == 'chained'})\n"
                             f"CEILING_OVERLAPPED = gl.constexpr({variant == 'overlapped'})\n")
    return module_variant(Path(launcher.__file__).with_name("dense.py"), replacements, stubs,
                          f"_promotion_ceiling_{variant}", "moegemm.kernels.sm90").dense_kernel


def sass_report() -> list[dict]:
    """Each variant's K loops at the fp8_block prefill config of 6144 x 7168 (8 x 4096), offline."""
    sys.path.insert(0, str(ROOT / "tests"))
    from dataclasses import replace

    import test_compile_sm90 as compiled_cases

    from moegemm.config import sm90_config
    from moegemm.formats import FORMATS
    from moegemm.kernels import offline
    from moegemm.kernels.sm90 import dense
    from moegemm.sm90_configs import deepest_ring

    cfg = sm90_config(FORMATS["fp8_block"], 6144, 7168, 4096, 2)
    narrow = deepest_ring(replace(cfg, block_n=128, stages=2), FORMATS["fp8_block"], 2)
    rows, real = [], dense.dense_kernel
    for variant, config in (("as run", cfg), *((v, cfg) for v in CEILINGS), ("as run", narrow),
                            ("overlapped", narrow)):
        dense.dense_kernel = real if variant == "as run" else variant_kernel(variant)
        try:
            compiled = compiled_cases.sm90_kernel_compiled("fp8_block", config)
        finally:
            dense.dense_kernel = real
        text = offline.sass(compiled)
        loops = compiled_cases.innermost_mma_loops(text)
        per_mmac = [round(len(loop) / compiled_cases.mma_loop_macs(loop) * 1e6, 1) for loop in loops]
        ops = offline.opcode_counts(text)
        rows.append({"variant": variant, "config": str(config), "loop_instructions": [len(loop) for loop in loops],
                     "per_million_macs": per_mmac, "spills": ops["LDL"] + ops["STL"],
                     "serialized": [code for code, _ in offline.ptxas_infos(compiled) if code.startswith("C751")]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def prepared(timer, fn, kernel=None, config=None):
    """fn warmed up and captured in a CUDA graph (timing.Timer.prepare) with `kernel` in the
    launcher's place and `config` forced (a forced config has no cached plan, so the swapped
    kernel is the one planned and captured)."""
    import contextlib

    from moegemm.config import override_config
    from moegemm.kernels.sm90 import launcher

    real = launcher.dense_kernel
    with override_config(config) if config is not None else contextlib.nullcontext():
        launcher.dense_kernel = kernel or real
        try:
            fn()
            return timer.prepare(fn)
        finally:
            launcher.dense_kernel = real


def run(out_dir: Path, only: str, regimes) -> None:
    """Per row, every call captured in a graph and timed in shuffled turns (timing.Timer: each a
    sample a round, L2 flushed): ratios between the columns of one row hold under the power cap."""
    from dataclasses import replace

    import torch
    from timing import Timer

    from moegemm import benchmark, benchmark_inputs, benchmark_rows
    from moegemm.config import sm90_config
    from moegemm.formats import FORMATS
    from moegemm.sm90_configs import deepest_ring

    device = torch.device("cuda")
    timer = Timer(device)
    env = {**benchmark.provenance("bench/promotion_ceiling.py"), "gpu": torch.cuda.get_device_name(device),
           "torch": torch.__version__, "triton": __import__("triton").__version__}
    print(json.dumps(env), flush=True)
    variants = {v: variant_kernel(v) for v in VARIANTS}
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"promotion-ceiling-{env['gpu'].replace(' ', '-')}.json"
    rows = []
    for shape, (n, k) in benchmark_rows.TARGET_SHAPES.items():
        if only and not shape.startswith(only):
            continue
        for groups, nominal in regimes:
            sizes = benchmark_rows.group_sizes(groups, nominal, seed=groups * 100003 + nominal)
            inp = benchmark_inputs.Inputs("fp8_block", n, k, sizes, device)
            row = {"shape": shape, "n": n, "k": k, "groups": groups, "nominal": nominal, "tokens": sum(sizes)}
            cfg = sm90_config(FORMATS["fp8_block"], n, k, sum(sizes) / groups, 2)
            row["config"] = str(cfg)
            calls = {"as_run": prepared(timer, inp.ours), "torch_rowwise": prepared(timer, inp.torch_baseline),
                     "forced": prepared(timer, inp.ours, config=cfg)}  # (the kernel on the variants' config)
            try:
                deepgemm = benchmark_inputs.deepgemm_runner(inp)
                if deepgemm is not None:
                    calls["deepgemm"] = prepared(timer, deepgemm)
            except Exception as error:  # noqa: BLE001 (the peer's failure is recorded, the run goes on)
                row["deepgemm_failed"] = repr(error)[:300]
            for variant in CEILINGS:
                calls[variant] = prepared(timer, inp.ours, variants[variant], cfg)
            if cfg.scale_ring:  # the overlapped loop on 128-wide tiles, beside the kernel as it is there
                narrow = deepest_ring(replace(cfg, block_n=128, stages=2), FORMATS["fp8_block"], 2)
                row["narrow_config"] = str(narrow)
                calls["narrow"] = prepared(timer, inp.ours, config=narrow)
                calls["overlapped"] = prepared(timer, inp.ours, variants["overlapped"], narrow)
                calls["narrow"].graph.replay()
                expected = inp.out.clone()
                inp.out.fill_(float("nan"))
                calls["overlapped"].graph.replay()
                row["overlapped_bits_equal"] = bool(torch.equal(inp.out.view(torch.int16),
                                                                expected.view(torch.int16)))
            for name, (ms, _, why) in timer.in_turns(calls).items():
                row[f"{name}_ms"] = ms
                if why:
                    row[f"{name}_why"] = why
            flops = 2.0 * row["tokens"] * n * k
            for name in calls:
                row[f"{name}_tflops"] = flops / row[f"{name}_ms"] / 1e9
                if "deepgemm" in calls:
                    row[f"{name}_x_deepgemm"] = row["deepgemm_ms"] / row[f"{name}_ms"]
                row[f"{name}_x_torch_rowwise"] = row["torch_rowwise_ms"] / row[f"{name}_ms"]
            rows.append(row)
            path.write_text(json.dumps({"env": env, "rows": rows}, indent=1))  # (a run cut short keeps its rows)
            print(f"{shape:12} {groups}x{nominal:<5} " + ", ".join(f"{name} {row[f'{name}_ms']:.3f} ms" for name in calls)
                  + (f" (overlapped bits equal: {row['overlapped_bits_equal']})" if "overlapped" in calls else "")
                  + " | x DeepGEMM: " + ", ".join(f"{name} {row.get(f'{name}_x_deepgemm', float('nan')):.2f}"
                                                 for name in calls), flush=True)
            del inp, calls
            torch.cuda.empty_cache()
    print(f"wrote {path}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--only", default="t-", help="shapes of benchmark_rows.TARGET_SHAPES starting so")
    parser.add_argument("--regimes", default=",".join(f"{g}x{t}" for g, t in REGIMES), help="GROUPSxTOKENS, ...")
    parser.add_argument("--sass", action="store_true", help="the variants' K loops offline (CPU), no timing")
    args = parser.parse_args(argv)
    start = time.time()
    if args.sass:
        sass_report()
    else:
        regimes = tuple(tuple(int(v) for v in r.split("x")) for r in args.regimes.split(",") if r)
        run(Path(args.out), args.only, regimes)
    print(f"# {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
