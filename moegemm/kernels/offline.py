"""Compile kernels for sm_90 without a GPU and read their SASS (tests and design work).

triton.compile with a GPUTarget needs no device; the Triton wheel ships ptxas and cuobjdump,
so the machine code of every kernel variant can be checked on a CPU-only machine.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

SM90 = GPUTarget("cuda", 90, 32)


def _full_signature(jit_fn, signature: dict, constexprs: dict) -> dict:
    """signature plus constexprs marked as such, with every argument of jit_fn named.

    triton.compile does not apply a kernel's defaults: a constexpr left out compiles as absent,
    i.e. a different kernel from the one the launcher runs, and nothing fails. So every argument
    must be given."""
    missing = [name for name in jit_fn.arg_names if name not in signature and name not in constexprs]
    if missing:
        raise ValueError(f"constexprs: {jit_fn.__name__} arguments not given (defaults are not applied): {missing}")
    unknown = [name for name in (*signature, *constexprs) if name not in jit_fn.arg_names]
    if unknown:
        raise ValueError(f"signature: {jit_fn.__name__} has no arguments {unknown}")
    sig = dict(signature)
    for name in constexprs:
        sig[name] = "constexpr"
    return sig


def compile_for_sm90(jit_fn, signature: dict, constexprs: dict, options: dict):
    """Compile a @triton.jit function for sm_90; returns triton's CompiledKernel."""
    sig = _full_signature(jit_fn, signature, constexprs)
    return _dumped(triton.compile(ASTSource(jit_fn, sig, constexprs), target=SM90, options=options))


def _dumped(compiled):
    """With MOEGEMM_SASS_DUMP=DIR, also write the compile's SASS to DIR, one file per pytest case
    (bench/ab.py's `sass` plan compares two revisions' dumps instruction by instruction)."""
    folder = os.environ.get("MOEGEMM_SASS_DUMP")
    if folder:
        case = os.environ.get("PYTEST_CURRENT_TEST", "unnamed").split(" (")[0]
        name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", case)
        path = Path(folder) / f"{name}.sass"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:  # a case that compiles several kernels appends them in order
            f.write(sass(compiled))
    return compiled


def sass(compiled) -> str:
    return cubin_sass(compiled.asm["cubin"])


def cubin_sass(cubin: bytes) -> str:
    """The SASS of a cubin, by the cuobjdump that Triton's wheel ships."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "--dump-sass", f.name], capture_output=True, text=True, check=True).stdout


def ptxas_infos(compiled) -> list[tuple[str, str]]:
    """The "(Cnnnn) ..." messages ptxas gives on the compile's PTX for sm_90a (the wheel's ptxas,
    as Triton runs it), such as C7510-C7515: every wgmma serialized, and why. Triton drops them."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(compiled.asm["ptx"])
        log = subprocess.run([str(tool), "-v", "--gpu-name=sm_90a", str(source), "-o", str(Path(folder) / "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    return re.findall(r"\((C\d{4})\) ([^\n]*)", log)


def opcode_counts(sass_text: str) -> collections.Counter:
    """Opcode (first word of each instruction, predicate and modifiers stripped) -> count."""
    counts = collections.Counter()
    for match in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass_text):
        counts[match.group(1)] += 1
    return counts


_GMMA = re.compile(r"\b[HQ]GMMA\.64x(\d+)x\d+\.F32\S*\s+R(\d+)\s*,(.*)")
_WGMMA_WAIT = re.compile(r"WARPGROUP\.DEPBAR\.LE\s+gsb0,\s*0x([0-9a-f]+)")


def _registers(instruction: str) -> set[int]:
    """Registers an instruction reads or writes: 64-bit operands (R4.64 in an address, .64 or
    WIDE opcodes) span two, .128 opcodes four."""
    opcode = instruction.split()[1] if instruction.startswith("@") else instruction.split()[0]
    width = 4 if ".128" in opcode else 2 if ".64" in opcode or "WIDE" in opcode else 1
    found = set()
    for operand in re.sub(r"\[[^\]]*\]", "", instruction).split()[1:]:
        for reg in re.findall(r"\bR(\d+)\b", operand):
            found |= set(range(int(reg), int(reg) + width))
    for reg, wide in re.findall(r"\bR(\d+)(\.64)?", "".join(re.findall(r"\[[^\]]*\]", instruction))):
        found |= set(range(int(reg), int(reg) + (2 if wide else 1)))
    return found


def wgmma_register_hazards(sass_text: str) -> list[tuple[str, str]]:
    """(address, instruction) of every instruction that reads or writes a register of a wgmma
    still in flight, in the SASS's linear order: its accumulator (64 x N fp32: N / 2 registers
    a thread from the destination on) or its register A operand. A group ends at the HGMMA /
    QGMMA marked gsb0; WARPGROUP.DEPBAR.LE gsb0, n leaves the n newest groups in flight. Linear
    order follows a loop's body into the code after it, which is where ptxas once scheduled an
    epilogue's reads of the accumulator above the final wait (kernels/sm90/decode.py, _upcast_chain)."""
    pending, open_group, found = [], set(), []
    for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass_text):
        mma = _GMMA.search(text)
        if mma:
            n, base = int(mma.group(1)), int(mma.group(2))
            open_group |= set(range(base, base + n // 2))
            for reg in re.findall(r"\bR(\d+)\b", mma.group(3).split("gdesc")[0]):
                open_group |= set(range(int(reg), int(reg) + 4))
            if re.search(r"\bgsb0\b", text):
                pending.append(open_group)
                open_group = set()
            continue
        wait = _WGMMA_WAIT.search(text)
        if wait:
            keep = int(wait.group(1), 16)
            pending = pending[len(pending) - keep:] if keep else []
            continue
        in_flight = open_group.union(*pending)
        if in_flight and _registers(text) & in_flight:
            found.append((address, text.strip()))
    return found


def gluon_compile_for_sm90(jit_fn, signature: dict, constexprs: dict, options: dict, aligned: tuple = ()):
    """Compile a @gluon.jit function for sm_90 (descriptor arguments: see tensordesc_signature).
    `aligned`: names of the pointer and integer arguments to compile as multiples of 16 (what the
    launcher specializes on at run time when they are)."""
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = _full_signature(jit_fn, signature, constexprs)
    attrs = {(jit_fn.arg_names.index(name), ): [["tt.divisibility", 16]] for name in aligned}
    return _dumped(triton.compile(GluonASTSource(jit_fn, sig, constexprs, attrs), target=SM90, options=options))


def tensordesc_signature(dtype_name: str, block: list[int], layout=None) -> str:
    """The signature string of a host TensorDescriptor argument ("fp8e4nv", "bf16", "fp32");
    its shared layout the default for the block unless given."""
    from triton.experimental.gluon import language as gl

    dtype = {"fp8e4nv": gl.float8e4nv, "bf16": gl.bfloat16, "fp32": gl.float32, "u8": gl.uint8,
             "i32": gl.int32}[dtype_name]
    layout = layout or gl.NVMMASharedLayout.get_default_for(block, dtype)
    return "tensordesc<%s[%s],%s>" % (dtype_name, ", ".join(map(str, block)), layout)


def _instructions(sass_text: str) -> list[tuple[int, str]]:
    return [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass_text)]


def innermost_loops(sass_text: str, opcode: str = "GMMA") -> list[list[tuple[int, str]]]:
    """(address, instruction) of every loop (a backward branch's span) that holds `opcode` and
    no other loop: the K loops of a kernel's consumers."""
    instructions = _instructions(sass_text)
    spans = []
    for address, text in instructions:
        target = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            spans.append((int(target.group(1), 16), address))
    loops = []
    for lo, hi in spans:
        if any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in spans):
            continue
        body = [(a, t) for a, t in instructions if lo <= a <= hi]
        if any(opcode in t for _, t in body):
            loops.append(body)
    return loops


def loop_paths(body: list[tuple[int, str]]) -> tuple[list[str], list[str]]:
    """The (shortest, longest) lists of instructions one iteration of a loop body (innermost_loops)
    issues from its head to its back edge, over its forward branches (a branch out of the loop,
    such as an mbarrier wait's retry, counts as not taken): where a loop has a fast and a slow
    path, what each iteration of each issues."""
    index = {address: i for i, (address, _) in enumerate(body)}
    shortest: list[list[str]] = [[] for _ in range(len(body) + 1)]
    longest: list[list[str]] = [[] for _ in range(len(body) + 1)]
    for i in range(len(body) - 1, -1, -1):
        address, text = body[i]
        branch = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        target = int(branch.group(1), 16) if branch else None
        if i < len(body) - 1 and target in index and target > address:
            nexts = [index[target]] + ([i + 1] if text.startswith("@") else [])
        else:
            nexts = [i + 1]
        shortest[i] = [text] + min((shortest[j] for j in nexts), key=len)
        longest[i] = [text] + max((longest[j] for j in nexts), key=len)
    return shortest[0], longest[0]


def opcode(instruction: str) -> str:
    """An instruction's opcode with its modifiers, predicate stripped."""
    return instruction.split()[1] if instruction.startswith("@") else instruction.split()[0]
