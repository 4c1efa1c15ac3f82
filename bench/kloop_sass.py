"""The K loops of our fp8_block prefill kernel and DeepGEMM's, side by side in sm_90 SASS, on the
CPU: which instructions each spends on the same tensor-core work.

    python bench/kloop_sass.py [--groups 4 --rows 8192 --n 6144 --k 7168] [--out FILE]

Ours: kernels/sm90/dense.py at the config the library picks (moegemm.config.sm90_config), as
launched at these shapes, compiled offline (moegemm/kernels/offline.py); --loaded-scales: with the
K loop that loads its scales (DenseConfig.scale_ring off). Without peers/DeepGEMM, ours alone. DeepGEMM (a peer, never project code; its source
with the cutlass and fmt headers it pins in the git-ignored peers/DeepGEMM, SOURCE.txt there):
`sm90_fp8_gemm_1d2d_impl`, the kernel of `m_grouped_fp8_gemm_nt_contiguous` on Hopper, at the
config its heuristics pick for the shape (deepgemm_config: a reading of its SM90 layout choice,
written here), compiled with NVRTC. NVRTC and the CUDA headers come from the PyPI wheels
nvidia-cuda-nvrtc-cu12, nvidia-cuda-runtime-cu12 and nvidia-cuda-cccl-cu12 (12.8), unpacked into
the folder NVIDIA_WHEELS names (default /tmp/nv: `python -m zipfile -e WHEEL /tmp/nv` each). Two
headers NVRTC lacks are stood in for (_SHIMS).

Each innermost loop around a wgmma is counted by opcode and normalized by its tensor-core work:
instructions per million multiply-adds of one consumer warpgroup (a 64 x N x 32 wgmma is 64 * N *
32 of them). The kernels unroll differently (ours one 128-K block an iteration, DeepGEMM several),
so only the normalized counts compare.

    python bench/kloop_sass.py --decode [--formats bf16_mxfp4,nvfp4] [--out FILE]

The decoding kernel (kernels/sm90/decode.py) on prepacked e2m1 weights at decode, 4096 x 7168,
16 and 32 tokens a slot (256-row tiles, 32- and 64-token tiles), its K loop with the weight
scales loaded a step ahead and staged in the ring (DecodeConfig.staged_scales; four consumer
warpgroups of 64 rows, or two of 128): instructions one iteration issues an element of a thread
(a warpgroup's 64 or 128 rows x 128 K over 128 threads; on a
loop with two paths, the path without a large e8m0 code, and the other), by opcode class, the
global loads and spills in the loop, its wgmma waits, the highest register it names and the
partitions' setmaxnreg counts, and the ptxas infos on the compile (C7510-C7515: wgmmas serialized).
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import math
import os
import re
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

DEEPGEMM = ROOT / "peers" / "DeepGEMM"
SMEM = 232448  # sm_90's shared memory a block (DeepGEMM's smem_capacity)
# NVRTC has neither <utility> nor <cstdint> of the standard library: libcu++'s, under std.
_SHIMS = {
    "utility": "#pragma once\n#include <cuda/std/utility>\nnamespace std { using cuda::std::pair; using "
               "cuda::std::make_pair; using cuda::std::integer_sequence; using cuda::std::make_integer_sequence; "
               "using cuda::std::index_sequence; using cuda::std::make_index_sequence; using cuda::std::declval; "
               "using cuda::std::swap; }\n",
    "cstdint": "#pragma once\n#include <cuda/std/cstdint>\n" + "".join(
        f"using cuda::std::{t}; " for t in ("uint8_t", "uint16_t", "uint32_t", "uint64_t", "int8_t", "int16_t",
                                            "int32_t", "int64_t")) + "\nnamespace std { " + "".join(
        f"using cuda::std::{t}; " for t in ("uint8_t", "uint16_t", "uint32_t", "uint64_t", "int8_t", "int16_t",
                                            "int32_t", "int64_t", "uintptr_t", "intptr_t")) + "}\n",
}


def deepgemm_config(m: int, n: int, k: int, num_sms: int = 132) -> dict:
    """The layout DeepGEMM's SM90 heuristics pick for an m-grouped contiguous fp8 product with
    bf16 output (1D2D kernel: 128-row blocks, block_n 16..192 in steps of 16, block_k 128,
    clusters of at most 2): fewest modeled L1/L2 cycles over the wave efficiency."""
    best = None
    for cluster_m, cluster_n in ((1, 1), (1, 2), (2, 1)):
        for block_n in range(16, 193, 16):
            block_m, block_k = 128, 128
            if block_n > block_k and block_n % (block_n - block_k) and block_k % (block_n - block_k):
                continue  # (the 1D2D kernel's unrolling)
            extra = math.ceil(block_m * block_n * 2 / 1024) * 1024 + 16 * 8 * 2
            extra += math.ceil(math.ceil(k / block_k) * 4 * (1 if block_k % block_n == 0 else 2) / 8) * 8
            per_stage = block_m * block_k + block_n * block_k + math.ceil(block_m * 4 / 128) * 128
            stages = min((SMEM - extra) // per_stage, 16)
            if stages < 3 or (block_m * block_n < 128 * 192 and stages < 4):
                continue
            blocks = math.ceil(m / block_m) * math.ceil(n / block_n)
            waves = math.ceil(blocks / num_sms)
            l2_rate, l1_rate = int(min(64.0 * num_sms, 8e6 / 1.3e3)), 128 * num_sms
            cd = block_m * block_n * 2
            l2 = (k * (block_m // cluster_n + block_n // cluster_m) + cd) * blocks // l2_rate
            l1 = (k * (block_m + block_n) + k * (max(64, block_m) + block_n) + cd + cd) * blocks // l1_rate
            cycles = int(max(l1, l2) / (blocks / (waves * num_sms)))
            if cluster_m * cluster_n > 1 and waves <= 1:
                continue
            if best is None or cycles < best["cycles"]:
                best = dict(block_m=block_m, block_n=block_n, block_k=block_k, cluster_m=cluster_m,
                            cluster_n=cluster_n, stages=stages, math_threads=256 if block_m > 64 else 128,
                            cycles=cycles)
    return best


def deepgemm_sass(cfg: dict, n: int, k: int, groups: int, num_sms: int = 132) -> str:
    wheels = Path(os.environ.get("NVIDIA_WHEELS", "/tmp/nv")) / "nvidia"
    nvrtc = ctypes.CDLL(str(wheels / "cuda_nvrtc" / "lib" / "libnvrtc.so.12"))
    swizzle_cd = next(mode for mode in (128, 64, 32, 16) if cfg["block_n"] * 2 % mode == 0)
    code = f"""
__device__ inline void cudaGridDependencySynchronize() {{ asm volatile("griddepcontrol.wait;":::"memory"); }}
__device__ inline void cudaTriggerProgrammaticLaunchCompletion() {{
    asm volatile("griddepcontrol.launch_dependents;":::); }}
#include <deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh>
using namespace deep_gemm;
static void __instantiate_kernel() {{
    auto ptr = reinterpret_cast<void*>(&sm90_fp8_gemm_1d2d_impl<cute::UMMA::Major::K, 0, {n}, {k}, {groups},
        {cfg['block_m']}, {cfg['block_n']}, {cfg['block_k']}, 128, 128, {swizzle_cd}, {cfg['stages']}, 128,
        {cfg['math_threads']}, {cfg['cluster_m'] * cfg['cluster_n']}, {'true' if cfg['cluster_n'] > 1 else 'false'},
        {num_sms}, GemmType::MGroupedContiguous, cutlass::bfloat16_t, epilogue::transform::EpilogueIdentity>);
}};
"""
    with tempfile.TemporaryDirectory() as shims:
        for name, text in _SHIMS.items():
            Path(shims, name).write_text(text)
        options = ["-std=c++20", "--diag-suppress=39,161,174,177,186,940", f"-I{shims}",
                   f"-I{DEEPGEMM / 'deep_gemm' / 'include'}", f"-I{DEEPGEMM / 'third-party' / 'cutlass' / 'include'}",
                   f"-I{wheels / 'cuda_runtime' / 'include'}", f"-I{wheels / 'cuda_cccl' / 'include'}",
                   "--gpu-architecture=sm_90a", "-default-device", "--device-int128"]
        program = ctypes.c_void_p()
        assert nvrtc.nvrtcCreateProgram(ctypes.byref(program), code.encode(), b"kernel.cu", 0, None, None) == 0
        status = nvrtc.nvrtcCompileProgram(program, len(options),
                                           (ctypes.c_char_p * len(options))(*[o.encode() for o in options]))
        size = ctypes.c_size_t()
        if status != 0:
            nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"NVRTC: {log.value.decode()[-2000:]}")
        nvrtc.nvrtcGetCUBINSize(program, ctypes.byref(size))
        cubin = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetCUBIN(program, cubin)
        from moegemm.kernels.offline import cubin_sass

        return cubin_sass(cubin.raw)


def ours_sass(n: int, k: int, tokens_per_slot: float, loaded_scales: bool = False):
    """Our kernel as the launcher runs it at the prefill shapes (round-robin tiles, no expert or
    row scales); loaded_scales: the K loop that loads its scales (DenseConfig.scale_ring off)."""
    from dataclasses import replace

    from test_compile_sm90 import sm90_kernel_compiled

    from moegemm.config import sm90_config
    from moegemm.formats import FORMATS
    from moegemm.kernels import offline

    cfg = sm90_config(FORMATS["fp8_block"], n, k, tokens_per_slot)
    if loaded_scales:
        cfg = replace(cfg, scale_ring=False, consumer_regs=232)
    return cfg, offline.sass(sm90_kernel_compiled("fp8_block", cfg, with_scales=False, dynamic=cfg.claim_rounds > 0))


def k_loops(sass: str) -> list[dict]:
    """Each innermost wgmma loop: its opcode counts and the multiply-adds of its wgmmas (of one
    consumer warpgroup), and per million of those."""
    from test_compile_sm90 import innermost_mma_loops

    out = []
    for loop in innermost_mma_loops(sass):
        ops = collections.Counter((t.split()[1] if t.startswith("@") else t.split()[0]).split(".")[0] for t in loop)
        macs = sum(64 * int(m.group(1)) * int(m.group(2))
                   for m in (re.search(r"GMMA\.64x(\d+)x(\d+)", t) for t in loop) if m)
        out.append({"instructions": len(loop), "macs": macs, "ops": dict(ops.most_common()),
                    "per_million_macs": {op: round(c / macs * 1e6, 1) for op, c in ops.most_common()},
                    "total_per_million_macs": round(len(loop) / macs * 1e6, 1)})
    return out


def _deepgemm_source() -> str:
    """'DeepGEMM <commit>' from peers/DeepGEMM/SOURCE.txt."""
    match = re.search(r"at ([0-9a-f]{7,40})", (DEEPGEMM / "SOURCE.txt").read_text())
    return f"DeepGEMM {match.group(1) if match else 'of unknown commit'}"


# Opcode classes of the decoding kernel's K loop (the first word of the opcode).
DECODE_CLASSES = (("decode", ("SHF", "LOP3", "HMUL2", "PRMT", "LEA", "F2FP", "HADD2", "I2F", "F2F")),
                  ("wgmma", ("HGMMA", "WARPGROUP")), ("barriers", ("BAR", "SYNCS")),
                  ("shared loads", ("LDS",)), ("global loads", ("LDG",)), ("spills", ("LDL", "STL")),
                  ("uniform", ("U",)), ("branches", ("BRA", "REDUX", "VOTE")))


def _opcode_class(opcode: str) -> str:
    head = opcode.split(".")[0]
    for name, prefixes in DECODE_CLASSES:
        if any(head == p or (p == "U" and head.startswith("U")) for p in prefixes):
            return name
    return "other"


def decode_loop(fmt: str, tokens_per_slot: float, staged: bool, consumer_rows: int = 64) -> dict:
    """The decoding kernel's K loop on prepacked weights (module docstring), of consumer 0;
    consumer_rows 128: two staged-scale consumers of 128 rows (232 registers)."""
    import dataclasses

    from test_compile_sm90 import mx_kernel_compiled, setmaxnreg_values

    from moegemm.config import override_config, sm90_mx_config
    from moegemm.formats import FORMATS
    from moegemm.kernels import offline
    from moegemm.sm90_configs import deepest_ring

    cfg = sm90_mx_config(FORMATS[fmt], 4096, 7168, tokens_per_slot, prepacked=True)
    wide = {"consumer_rows": 128, "consumer_regs": 232} if consumer_rows == 128 else {}
    cfg = deepest_ring(dataclasses.replace(cfg, staged_scales=staged, stages=2, **wide), FORMATS[fmt])
    with override_config(cfg):
        compiled = mx_kernel_compiled(fmt, tokens_per_slot, "swizzled", prepacked=True)
    sass = offline.sass(compiled)
    body = offline.innermost_loops(sass)[0]
    fast, slow = offline.loop_paths(body)
    elements = 8 * sum("GMMA" in t for t in fast)  # (a k16 wgmma of 64 rows: 8 elements a thread)
    classes = collections.Counter(_opcode_class(offline.opcode(t)) for t in fast)
    ops = offline.opcode_counts(sass)
    registers = [int(r) for _, t in body for r in re.findall(r"\bR(\d+)\b", t)]
    return {"config": str(cfg), "elements": elements, "instructions": len(fast),
            "per_element": round(len(fast) / elements, 2), "slow_path_per_element": round(len(slow) / elements, 2),
            "classes": {name: round(n / elements, 2) for name, n in classes.most_common()},
            "ldg_in_loop": sum(bool(re.search(r"\bLDG\b", t)) for _, t in body),
            "spills_in_loop": sum(bool(re.search(r"\b(LDL|STL)\b", t)) for _, t in body),
            "spills": ops["LDL"] + ops["STL"], "waits": [t.split()[-1] for t in fast if "DEPBAR" in t],
            "highest_register": max(registers), "setmaxnreg": sorted(setmaxnreg_values(compiled)),
            "hazards": len(offline.wgmma_register_hazards(sass)), "shared": compiled.metadata.shared,
            "ptxas": [code for code, _ in offline.ptxas_infos(compiled)]}


def decode_report(fmts) -> str:
    from moegemm.benchmark import provenance

    lines = ["# The decoding kernel's K loop on prepacked weights, sm_90 SASS (4096 x 7168)", "",
             f"`python bench/kloop_sass.py --decode --formats {','.join(fmts)}` "
             f"({provenance('bench/kloop_sass.py')['commit'][:7]})", "",
             "| format | tokens a slot | scales | instructions an element | (other path) | "
             + " | ".join(name for name, _ in DECODE_CLASSES) + " | other | LDG in loop | spills (in loop) | "
             "waits | highest register | setmaxnreg | ptxas |", "|" + "---|" * (12 + len(DECODE_CLASSES))]
    for fmt in fmts:
        for tokens_per_slot in (16, 32):
            for staged, rows in ((False, 64), (True, 64), (True, 128)):
                r = decode_loop(fmt, tokens_per_slot, staged, rows)
                scales = f"staged, {rows} rows a consumer" if staged else "step ahead"
                lines.append(f"| {fmt} | {tokens_per_slot} | {scales} | "
                             f"{r['per_element']} | {r['slow_path_per_element']} | "
                             + " | ".join(str(r["classes"].get(name, 0)) for name, _ in DECODE_CLASSES)
                             + f" | {r['classes'].get('other', 0)} | {r['ldg_in_loop']} | {r['spills']} "
                             f"({r['spills_in_loop']}) | {' '.join(r['waits'])} | R{r['highest_register']} | "
                             f"{r['setmaxnreg']} | {' '.join(r['ptxas']) or '-'} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decode", action="store_true", help="the decoding kernel's K loop on prepacked weights")
    parser.add_argument("--formats", default="bf16_mxfp4,nvfp4", help="--decode: formats")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--rows", type=int, default=8192, help="tokens a group")
    parser.add_argument("--n", type=int, default=6144)
    parser.add_argument("--k", type=int, default=7168)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--loaded-scales", action="store_true",
                        help="ours with the K loop that loads its scales (DenseConfig.scale_ring off)")
    args = parser.parse_args(argv)
    from moegemm.benchmark import provenance

    if args.decode:
        text = decode_report(args.formats.split(","))
        print(text)
        if args.out:
            args.out.write_text(text)
        return 0

    cfg, ours = ours_sass(args.n, args.k, float(args.rows), args.loaded_scales)
    sides = {"moegemm": (str(cfg), k_loops(ours))}
    if DEEPGEMM.exists():
        dg_cfg = deepgemm_config(args.groups * args.rows, args.n, args.k)
        theirs = deepgemm_sass(dg_cfg, args.n, args.k, args.groups)
        sides["DeepGEMM"] = (str(dg_cfg), k_loops(theirs))
        peer = _deepgemm_source()
    else:
        peer = "no DeepGEMM (peers/DeepGEMM absent)"
    command = f"python bench/kloop_sass.py --groups {args.groups} --rows {args.rows} --n {args.n} --k {args.k}"
    lines = [f"# K loops in sm_90 SASS: {args.groups} x {args.rows} tokens, N {args.n}, K {args.k}",
             "", f"`{command}{' --loaded-scales' if args.loaded_scales else ''}`"
             f" ({provenance('bench/kloop_sass.py')['commit'][:7]}); {peer}",
             ""]
    opcodes = collections.Counter()
    for name, (config, loops) in sides.items():
        loop = loops[0]
        lines.append(f"- {name}: {config}; {len(loops)} consumer loops, the first: {loop['instructions']} "
                     f"instructions for {loop['macs']} multiply-adds, {loop['total_per_million_macs']} a million")
        opcodes.update(loop["ops"])
    lines += ["", "| opcode | " + " | ".join(f"{side} a million MACs" for side in sides) + " |",
              "|---|" + "---|" * len(sides)]
    for op, _ in opcodes.most_common():
        row = [str(sides[s][1][0]["per_million_macs"].get(op, 0)) for s in sides]
        lines.append(f"| {op} | " + " | ".join(row) + " |")
    lines.append("| all | " + " | ".join(str(sides[s][1][0]["total_per_million_macs"]) for s in sides) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
