"""SASS instructions per element of moegemm.quantize's kernel, per format and scale layout, on the CPU.

    python bench/quantize_sass.py [--rows 32768 --k 7168 --slots 8] [--json FILE]
    MOEGEMM_TREE=<a worktree of another revision> python bench/quantize_sass.py    (that revision's)

Each case is the launch moegemm.quantize makes on CUDA tokens of that size (bf16, `slots` equal
slots; the kernel's host launch, intercepted before it runs): the same kernel, constexprs, launch
options and the argument specialization (ints equal to 1 or multiples of 16, 16-byte aligned
pointers) Triton's launcher derives from those arguments, compiled for sm_90 offline
(moegemm/kernels/offline.py). The kernel is straight-line code but for the slow paths of IEEE
divisions (a branch around a CALL, taken only for operands out of the fast path's range, and the
subroutine after the kernel's EXIT) and nvfp4's branch around its rescaling of global scales
below 2^-90: its instructions on the fast path (fast_path_counts) over
the elements a thread quantizes (BLOCK_M rows x NB * VEC columns over the program's threads) is
the work an element costs (its issue slots). Opcode classes: F = fp32 arithmetic, I = integer and logic, M = loads and
stores, C = conversions, P = predicate and select, other.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the library of another tree (e.g. a worktree of the base revision) when MOEGEMM_TREE names it
sys.path.insert(0, os.environ.get("MOEGEMM_TREE") or str(ROOT))

_CLASSES = (("M", ("LDG", "STG", "LDS", "STS", "LDC", "ULDC", "LDL", "STL")),
            ("C", ("F2I", "I2F", "F2F", "F2FP", "I2FP", "F2IP")),
            ("F", ("FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSET", "FCHK", "MUFU", "FSEL")),
            ("P", ("SEL", "ISETP", "PLOP3", "P2R", "R2P", "PRMT")),
            ("I", ("IADD3", "IMAD", "LOP3", "SHF", "LEA", "IMNMX", "IABS", "FLO", "POPC", "BMSK", "SGXT",
                   "IADD", "SHL", "SHR", "IMUL", "UIADD3", "UIMAD", "ULOP3", "USHF", "ULEA", "UMOV", "MOV")))


def _host_module():
    """The module that launches the quantizer kernels: kernels/quantize_kernels.py, or activation.py
    in a revision before it."""
    try:
        from moegemm.kernels import quantize_kernels
    except ImportError:
        from moegemm import activation as quantize_kernels
    return quantize_kernels


def _gather_block_m(host, rows: int) -> int:
    """The gather's BLOCK_M on CUDA (a revision before cuda_block_m: its rule then)."""
    if hasattr(host, "cuda_block_m"):
        return host.cuda_block_m(rows, gather=True)
    return host.CUDA_BLOCK_M if rows > 2048 else host.CUDA_SMALL_BLOCK_M


def _compiled_twin(fn, kernel_module):
    """The compiled build of the interpreted kernel fn, from the tl file that defines it."""
    from moegemm.kernels import tl_source

    compiled = getattr(kernel_module(False), fn.__name__, None)  # (a revision with one tl file)
    return compiled or getattr(tl_source.load(Path(fn.fn.__globals__["__file__"]), False), fn.__name__)


def launches(rows: int, k: int, slots: int, only=None) -> list[tuple[str, str, object, tuple, dict]]:
    """(format, layout, kernel, args, constexprs and options) of each moegemm.quantize case (those
    (format, layout) in `only` where given)."""
    import torch

    import moegemm

    activation = _host_module()
    kernel_module = getattr(activation, "kernel_module", None) or activation._kernels

    x = torch.empty(rows, k, dtype=torch.bfloat16)
    x.zero_()  # (nvfp4's default global scale reads it)
    a_offsets = torch.arange(0, rows + 1, rows // slots, dtype=torch.int32)
    cases = []
    for fmt, f in moegemm.FORMATS.items():
        if fmt.startswith("bf16_"):
            continue  # (bf16's kernel: unscaled activations)
        for layout in ("plain", "swizzled") if f.a_scaled and f.swizzle_capable else ("plain", ):
            if only is not None and (fmt, layout) not in only:
                continue
            captured = []
            real = activation.launch
            activation.launch = (lambda fn, key, grid, args, consts, into=captured:
                                 into.append((fn, args, dict(consts))))
            try:
                moegemm.quantize(x, fmt, scale_layout=layout, a_offsets=a_offsets, backend="triton")
            finally:
                activation.launch = real
            for fn, args, consts in captured:  # (nvfp4: the default global scale's amax pass first)
                if fn.__name__ == "activation_quantize_kernel":
                    # The CPU run took the interpreter's build and block; CUDA's are these (the host launch's).
                    consts["BLOCK_M"] = _gather_block_m(activation, rows)
                    consts["num_warps"] = activation.CUDA_WARPS
                    label = layout
                else:
                    label = f"{layout} ({fn.__name__.split('_kernel')[0]})"
                cases.append((fmt, label, _compiled_twin(fn, kernel_module), args, consts))
    return cases


def compiled_sass(kernel, args: tuple, consts: dict) -> str:
    """The sm_90 SASS of kernel specialized for args as Triton's launcher specializes them."""
    from moegemm.kernels import offline

    return offline.sass(compiled(kernel, args, consts))


def registers(cubin: bytes) -> int:
    """Registers a thread of the cubin's kernel holds (cuobjdump's resource usage)."""
    import subprocess
    import tempfile

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    return int(re.search(r"REG:(\d+)", usage).group(1))


def compiled(kernel, args: tuple, consts: dict):
    """kernel compiled for sm_90, specialized for args as Triton's launcher specializes them."""
    import triton
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    from moegemm.kernels import offline

    backend = make_backend(offline.SM90)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **consts)
    options, signature, constexprs, attrs = kernel._pack_args(backend, consts, bound, specialization, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=offline.SM90,
                          options=options.__dict__)


def fast_path_counts(sass_text: str) -> collections.Counter:
    """Opcode counts of the instructions a thread runs when every division takes its fast path and
    every rarely taken branch of the kernel is skipped, less NOPs: of the code up to the kernel's
    last EXIT, the path from its start with the fewest instructions and no CALL (a division's
    slow path), each forward branch followed or not (an unconditional one followed), everything
    else in order. The kernels are straight-line code but for such branches: around divisions'
    slow paths, and around the work of a rare launch (nvfp4's rescaling for global scales below
    2^-90), whose path is the longer."""
    from moegemm.kernels import offline

    lines = re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass_text)
    code = [(int(address, 16), text.strip()) for address, text in lines]
    last_exit = max(i for i, (_, text) in enumerate(code) if re.search(r"\bEXIT\b", text))
    code = code[:last_exit + 1]
    index = {address: i for i, (address, _) in enumerate(code)}
    # rest[i]: (instructions, next index) of the fewest-instruction path from instruction i to the end
    rest = [(0, None)] * (len(code) + 1)
    for i in range(len(code) - 1, -1, -1):
        address, text = code[i]
        if re.search(r"\bCALL\b", text):
            rest[i] = (math.inf, None)
            continue
        branch = re.match(r"(@!?P\d\s+)?BRA\s+(?:!?P\d,\s*)?0x([0-9a-f]+)", text)
        target = int(branch.group(2), 16) if branch else -1
        nexts = [i + 1]
        if target > address and target in index:
            nexts = [index[target]] if not branch.group(1) else [i + 1, index[target]]
        best = min(nexts, key=lambda j: rest[j][0])
        rest[i] = (rest[best][0] + (not text.startswith("NOP")), best)
    kept, i = [], 0
    while i is not None and i < len(code):
        kept.append(i)
        i = rest[i][1]
    kept = "".join(f"/*{code[j][0]:04x}*/ {code[j][1]} ;\n" for j in kept)
    counts = offline.opcode_counts(kept)
    counts.pop("NOP", None)
    return counts


def classify(counts: collections.Counter) -> dict:
    out = collections.Counter()
    for op, n in counts.items():
        out[next((name for name, ops in _CLASSES if op in ops), "other")] += n
    return dict(out)


def table(rows: int, k: int, slots: int, only=None) -> list[dict]:
    from moegemm.kernels import offline

    result = []
    for fmt, layout, kernel, args, consts in launches(rows, k, slots, only):
        binary = compiled(kernel, args, consts)
        counts = fast_path_counts(offline.sass(binary))
        # (each of the program's threads runs the code once: elements a thread)
        tile = (consts["BLOCK_M"] * consts["NB"] * consts["VEC"] if "BLOCK_M" in consts
                else consts["BLOCK_R"] * consts["BLOCK_K"])
        elements = tile / (32 * consts["num_warps"])
        total = sum(counts.values())
        result.append({"fmt": fmt, "layout": layout, "instructions": total, "elements": elements,
                       "per_element": round(total / elements, 2),
                       "classes": {c: round(n / elements, 2) for c, n in sorted(classify(counts).items())},
                       "spills": counts["LDL"] + counts["STL"], "registers": registers(binary.asm["cubin"]),
                       "top": dict(counts.most_common(8))})
    return result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--k", type=int, default=7168)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    rows = table(args.rows, args.k, args.slots)
    print(f"moegemm.quantize's kernel, {args.rows} x {args.k} bf16 tokens, sm_90 SASS")
    print(f"{'format':<10} {'layout':<28} {'instr':>6} {'el/thr':>6} {'regs':>4} {'/elem':>6}  by class (/elem)")
    for r in rows:
        classes = " ".join(f"{c}={v}" for c, v in r["classes"].items())
        print(f"{r['fmt']:<10} {r['layout']:<28} {r['instructions']:>6} {r['elements']:>6} {r['registers']:>4} "
              f"{r['per_element']:>6}  "
              f"{classes}" + (f"  SPILLS {r['spills']}" if r["spills"] else ""))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
