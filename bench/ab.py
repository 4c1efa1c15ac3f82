"""A/B measurements with named plans: kernel variants, layer variants, two revisions, or their SASS.

    python bench/ab.py --list                                    the plans, one line each
    python bench/ab.py PLAN [PLAN ...] [--out DIR]               timing plans (GPU), variants in one process
    python bench/ab.py PLAN --base REV [--head REV] [--rounds N] two revisions of the library (GPU)
    python bench/ab.py sass --base REV [--head REV] [--out DIR]  no GPU: the SASS of every offline compile

Timing plans (one H100 or H200; each writes DIR/<plan>-<GPU>.json):
- kernel plans: for each case (format, shape, group sizes) every variant (a forced kernel config,
  or the library's own choice) runs once for its output, which must match the first variant's
  within 5e-3 of the largest output (bit-identical is reported), and is captured in a CUDA graph
  (the swizzled A-scale offsets passed, so no torch set-up kernel runs inside the call). The
  case's graphs are then timed together by bench/timing.py's Timer: a sample of each graph a
  round, in a new shuffled order every round, L2 flushed before each sample (do_bench's flush),
  a warm-up replay first, medians of >= 30 samples. Under a sustained load the H100 runs at its
  power cap with the SM clock moving within a second; timing each variant in a burst of its own
  gave each a different clock (plan power-cap). Per-kernel device times come from the torch
  profiler (L2 warm). pct_copy = bytes of the touched weights, scales, tokens and output / time /
  the copy bandwidth measured in the same run.
- layer plans (layer-*): the whole MoE layer of bench/moe_layer.py captured once per variant,
  timed in turns with the PyTorch baseline, twice.
- fused-ceiling, scatter-check, activation-sweep, power-cap: see their functions.
- quantize: moegemm.quantize at 32K x 7168 tokens against the copy bandwidth, and the two-call
  path (quantize + grouped_matmul) against the layer's token path (gather_quantize + the same
  grouped_matmul) on the verify shapes; ab_quantize.py's docstring.

Two revisions (--base REV, --head REV or the working tree): each revision is checked out into a
temporary git worktree; the plan runs in a process of its own per revision, the two alternating
for --rounds rounds (base, head, head, base, ...), each case with the library's own choice (no
forced variant: the revisions differ in code). The library is imported from the revision's tree
(MOEGEMM_TREE), the harness (bench/) from the current one. Processes cannot share a power state
as graphs in one process do, so compare only ratios that hold over the rounds.

sass (no GPU): runs `pytest -q tests/test_compile_sm90.py tests/test_routing.py -k compile` in each
revision's tree with MOEGEMM_SASS_DUMP=<dir> (moegemm/kernels/offline.py writes each compiled
kernel's SASS to <dir>/<pytest case>.sass; for a revision whose offline.py predates that, a
pytest plugin of bench/ab_revisions.py adds it), then compares the dumps case by case after
normalizing (addresses, encodings, kernel names and section headers dropped; instructions and
operands kept) and writes DIR/sass.md and DIR/sass.json: case, identical or not, instruction
counts, the first differing instruction, the largest opcode count changes; cases present on one
side only apart.

Every result file names this script, the plan and the commit of the tree that made it (dirty or
not; MOEGEMM_COMMIT overrides the commit where the tree's copy has a stale git history).

Modules: ab_common.py (paths, the record, the GPU environment), ab_kernels.py (kernel plans),
ab_layer.py (layer plans), ab_probes.py (fused-ceiling, scatter-check, activation-sweep,
power-cap), ab_quantize.py (quantize), ab_revisions.py (two revisions, sass); timing.py (Timer) and layer_models.py (the
layer's models) are shared with moe_layer.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# the harness's modules from this tree, whichever tree the library comes from (ab_common.TREE)
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ab_common import library_only, record
from ab_kernels import KERNEL_PLANS, run_kernel_plan
from ab_layer import LAYER_PLANS, run_layer_plan
from ab_probes import run_activation_sweep, run_fused_ceiling, run_power_cap, run_scatter_check
from ab_quantize import run_quantize
from ab_revisions import run_revisions, run_sass

# ---- the plans ----------------------------------------------------------------------------------

OTHER_PLANS = {
    "fused-ceiling": ("the most the fused SwiGLU epilogue can gain: (read + write_h + pass) / read",
                      run_fused_ceiling),
    "scatter-check": ("the token gather in scatter form against the gather, bit for bit, both timed",
                      run_scatter_check),
    "activation-sweep": ("launch shapes of the activation kernels at 4096 tokens", run_activation_sweep),
    "power-cap": ("the layer's graph alone, beside and in turns with the baseline, nvidia-smi clocks",
                  run_power_cap),
    "quantize": ("moegemm.quantize against the copy bandwidth; quantize + grouped_matmul against the layer's "
                 "gather_quantize + grouped_matmul", run_quantize),
}


def plan_names() -> dict:
    names = {name: desc for name, (desc, _) in KERNEL_PLANS.items()}
    names.update({name: spec[0] for name, spec in LAYER_PLANS.items()})
    names.update({name: desc for name, (desc, _) in OTHER_PLANS.items()})
    names["sass"] = "(no GPU) the SASS of every offline compile in two revisions, case by case"
    return names


def run_plan(plan: str, args) -> dict:
    if plan in KERNEL_PLANS:
        return run_kernel_plan(plan, args)
    if plan in LAYER_PLANS:
        return run_layer_plan(plan, args)
    return OTHER_PLANS[plan][1](plan, args)


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name().replace(" ", "-")


def run_timing(plans: list[str], args) -> int:
    import torch

    if not torch.cuda.is_available():
        print("the timing plans need a CUDA GPU (`sass` does not)", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    status = 0
    for plan in plans:
        result = run_plan(plan, args)
        data = dict(record=record(plan, library_only=library_only()), **result)
        path = args.out / f"{plan}-{_gpu_name()}.json"
        path.write_text(json.dumps(data, indent=1, default=str))
        print(f"wrote {path}", flush=True)
        if result.get("mismatched"):
            print(f"{plan}: {len(result['mismatched'])} mismatched: {result['mismatched'][:10]}", flush=True)
            status = 2
    return status


# ---- command line --------------------------------------------------------------------------------

def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("plans", nargs="*", help="plan names (--list)")
    parser.add_argument("--list", action="store_true", help="list the plans")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "ab-out")), help="output folder")
    parser.add_argument("--base", help="two revisions: the base revision (sass: required)")
    parser.add_argument("--head", help="the head revision (default: the working tree as it is)")
    parser.add_argument("--rounds", type=int, default=2, help="two revisions: rounds of alternating processes")
    parser.add_argument("--tokens", type=int, default=4096, help="fused-ceiling: tokens of the layer")
    parser.add_argument("--formats", default="", help="quantize: the formats of the two paths (comma-separated; "
                                                      "default fp8_block,mxfp8,w4a8)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="sass: seconds for one revision's pytest")
    parser.add_argument("--keep-dumps", action="store_true", help="sass: keep both revisions' dumps and logs in --out")
    args = parser.parse_args(argv)
    names = plan_names()
    if args.list or not args.plans:
        width = max(map(len, names))
        for name, desc in names.items():
            print(f"{name:<{width}}  {desc}")
        return 0
    unknown = [p for p in args.plans if p not in names]
    if unknown:
        parser.error(f"unknown plan(s) {unknown}; --list shows them")
    if "sass" in args.plans:
        if args.plans != ["sass"] or not args.base:
            parser.error("sass runs alone and needs --base REV")
        return run_sass(args)
    if args.base:
        return run_revisions(args.plans, args)
    return run_timing(args.plans, args)


if __name__ == "__main__":
    sys.exit(main())
