"""The portable kernel compiles for sm_90 on a CPU-only machine: wgmma (HGMMA) in the SASS,
no register spills, every format and layout. Catches API and resource errors before any
GPU time is spent."""

import re
import sys
from pathlib import Path

import pytest
import torch

from moegemm.config import portable_config
from moegemm.formats import FORMATS
from moegemm.kernels import offline, portable
from moegemm.problem import GroupedProblem

from cases import FORMAT_LAYOUTS

# The kernels' fused-epilogue arguments (kernels/sm90/launcher.EpilogueSpec.kernel_args): runtime
# values, and the constexprs (ACT, OUT, OUT_SWIZZLED, HAS_BIAS, VEC, DEQUANT) of the plain epilogue.
EPILOGUE_SIGNATURE = ("*u8", "*fp32", "*fp32", "*i32", "i32", "i32", "i32", "fp32", "fp32")
PLAIN_EPILOGUE = (0, 0, False, False, 32, False)

def wgmma_sass(compiled) -> str:
    """The SASS of a wgmma kernel, checked: no instruction touches a register of a wgmma still
    in flight (offline.wgmma_register_hazards; ptxas can move an epilogue's accumulator reads
    above the last wait, kernels/sm90/decode.py)."""
    text = offline.sass(compiled)
    hazards = offline.wgmma_register_hazards(text)
    assert not hazards, f"registers of an in-flight wgmma touched: {hazards[:4]}"
    return text


POINTERS = {"a_offsets_ptr": "*i32", "expert_ids_ptr": "*i32", "a_scale_offsets_ptr": "*i32",
            "expert_scales_ptr": "*fp32", "row_scales_ptr": "*fp32"}


@pytest.mark.parametrize("fmt,layout", FORMAT_LAYOUTS)
def test_portable_kernel_compiles_for_sm90(fmt, layout):
    check_portable_kernel(fmt, layout)


def test_portable_kernel_compiles_for_n_major_weights():
    """bf16 weights read in place as the transpose of a contiguous [E, K, N]."""
    check_portable_kernel("bf16", "plain", n_major=True)


def check_portable_kernel(fmt, layout, n_major=False):
    f = FORMATS[fmt]
    n, k = 4096, 7168
    problem = GroupedProblem(f, m=8192, n=n, k=k, num_experts=8, num_groups=8, scale_layout=layout,
                             out_dtype=torch.bfloat16, b_n_major=n_major)
    cfg = portable_config(f, n, k, "cuda")
    constexprs = portable.kernel_constexprs(problem, cfg, interpret=False)
    constexprs.update(HAS_EXPERT_SCALES=True, HAS_ROW_SCALES=True)
    kernel = portable.kernel_module(False).grouped_matmul_kernel
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            continue
        if name.endswith("_ptr"):
            signature[name] = POINTERS.get(name, "*bf16" if name in ("out_ptr", "a_ptr", "b_ptr") and fmt == "bf16"
                                           else "*bf16" if name == "out_ptr" or (name == "a_ptr" and f.weight_only)
                                           else "*u8")
            if name in ("a_scale_ptr", "b_scale_ptr") and fmt == "fp8_block":
                signature[name] = "*fp32"
        else:
            signature[name] = "i32"
    compiled = offline.compile_for_sm90(kernel, signature, constexprs,
                                        {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    ops = offline.opcode_counts(offline.sass(compiled))
    assert ops["HGMMA"] > 0, f"no wgmma in the SASS: {ops.most_common(12)}"
    assert ops["LDL"] == 0 and ops["STL"] == 0, f"register spills: LDL={ops['LDL']} STL={ops['STL']}"


SM90_CASES = [
    (fmt, tokens_per_slot, out_dtype)
    for fmt in ("fp8_block", "bf16")
    for tokens_per_slot in (8, 16, 32, 40, 128, 8192)
    for out_dtype in (torch.bfloat16, torch.float32)
]


def sm90_kernel_compiled(fmt, cfg, out="bf16", epilogue=None, with_scales=True, n_major=False, dynamic=True,
                         fill=False):
    """kernels/sm90/dense.py for cfg (bf16/fp32 out; the fused epilogue's output when given); with_scales:
    the specialization with expert and row scales (a call without them compiles another); n_major:
    for N-major bf16 weights (their [1, block_k, weight_tile] boxes, launcher._weight_descriptor);
    dynamic: the last rounds' tiles claimed (the launcher's choice where the config claims rounds); fill:
    the variant of a fresh output, which zeroes the rows no valid slot owns (free_rows.py)."""
    from moegemm.kernels.sm90 import dense

    dt = "fp8e4nv" if fmt == "fp8_block" else "bf16"
    signature = {
        "a_desc": offline.tensordesc_signature(dt, [cfg.token_tile, cfg.block_k]),
        "b_desc": offline.tensordesc_signature(dt, [1, cfg.block_k, cfg.weight_tile] if n_major
                                               else [cfg.weight_tile, cfg.block_k]),
        "c_desc": offline.tensordesc_signature(out, [64, cfg.epilogue_n(fmt == "fp8_block")]),
        "out_ptr": "*u8" if epilogue and epilogue[1] else "*" + out, "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32",
        "a_offsets_ptr": "*i32", "expert_ids_ptr": "*i32", "expert_scales_ptr": "*fp32", "row_scales_ptr": "*fp32",
        "tile_counter_ptr": "*i32", "claim_rounds": "i32", **{name: "i32" for name in ("M", "N", "K", "E", "G",
                                                                                       "NUM_KB")},
        "epi": EPILOGUE_SIGNATURE,
    }
    constexprs = dict(STAGES=cfg.stages, GROUP_M=cfg.group_m, SWAP=cfg.swap, PROMOTE=fmt == "fp8_block",
                      HAS_EXPERT_SCALES=with_scales, HAS_ROW_SCALES=with_scales and epilogue is None,
                      CONSUMER_REGS=cfg.consumer_regs,
                      EPI=epilogue or PLAIN_EPILOGUE, DYNAMIC=dynamic, SCALE_RING=cfg.scale_ring, FILL=fill)
    return offline.gluon_compile_for_sm90(dense.dense_kernel, signature, constexprs, {"num_warps": 4},
                                          aligned=("out_ptr", "N"))


def check_sm90_plain_kernel(fmt, cfg, out):
    from moegemm.sm90_configs import SM90_SMEM_BYTES

    compiled = sm90_kernel_compiled(fmt, cfg, out)
    ops = offline.opcode_counts(wgmma_sass(compiled))
    mma = "QGMMA" if fmt == "fp8_block" else "HGMMA"
    assert ops[mma] > 0, f"no {mma} in the SASS: {ops.most_common(12)}"
    assert ops["UTMALDG"] > 0 and (cfg.swap or ops["UTMASTG"] > 0), "TMA loads (and stores) expected"
    # A 256-wide fp8_block tile holds two accumulators and one block tile (192 of 232
    # registers): with its scales loaded by the consumers ptxas spills a few tile-setup values
    # (21 LDL/STL, none inside the K loop, read off the SASS); every other configuration, the
    # scales staged in the ring included, has none.
    allowed = 32 if (fmt == "fp8_block" and cfg.epilogue_n(True) < cfg.block_n and not cfg.scale_ring) else 0
    assert ops["LDL"] + ops["STL"] <= allowed, f"register spills: LDL={ops['LDL']} STL={ops['STL']}"
    assert compiled.metadata.shared <= SM90_SMEM_BYTES
    # The config's estimate bounds what the kernel takes (within the compiler's bookkeeping).
    assert compiled.metadata.shared <= cfg.smem_bytes(FORMATS[fmt], 4 if out == "fp32" else 2) + 256


@pytest.mark.parametrize("fmt,tokens_per_slot,out_dtype", SM90_CASES)
def test_sm90_kernel_compiles_for_sm90(fmt, tokens_per_slot, out_dtype):
    from moegemm.config import sm90_config

    cfg = sm90_config(FORMATS[fmt], 4096, 7168, tokens_per_slot, 4 if out_dtype == torch.float32 else 2)
    check_sm90_plain_kernel(fmt, cfg, "fp32" if out_dtype == torch.float32 else "bf16")



def mma_loop_macs(loop: list[str]) -> int:
    """Multiply-adds of one consumer warpgroup's wgmmas in a loop (a 64 x N x K wgmma: 64 * N * K)."""
    return sum(64 * int(m.group(1)) * int(m.group(2))
               for m in (re.search(r"GMMA\.64x(\d+)x(\d+)", t) for t in loop) if m)


@pytest.mark.parametrize("with_scales", [False, True])
def test_fp8_block_prefill_k_loop_budget(with_scales):
    """The eight prefill shapes of `python -m moegemm bench` (benchmark_rows.TARGET_SHAPES at 4 x
    8192 and 8 x 4096 tokens) run one fp8_block config: 128 x 256 tiles with the scales in the ring.
    As launched (round-robin; with and without expert and row scales): no spill anywhere, no
    global load in the K loops, and at most 95 instructions a million multiply-adds of a consumer
    warpgroup (a 128-K block's promotion alone is 128 FFMAs, 61 a million; the loop that loaded
    its scales took 110 and spilled 35 values outside it)."""
    from moegemm.benchmark_rows import TARGET_SHAPES
    from moegemm.config import sm90_config

    fmt = FORMATS["fp8_block"]
    cfg = sm90_config(fmt, 6144, 7168, 8192)
    assert cfg.scale_ring and cfg.block_n == 256
    assert {sm90_config(fmt, n, k, tokens) for n, k in TARGET_SHAPES.values() for tokens in (8192, 4096)} == {cfg}
    sass = wgmma_sass(sm90_kernel_compiled("fp8_block", cfg, with_scales=with_scales, dynamic=False))
    ops = offline.opcode_counts(sass)
    assert ops["LDL"] + ops["STL"] == 0, f"register spills: LDL={ops['LDL']} STL={ops['STL']}"
    loops = innermost_mma_loops(sass)
    assert len(loops) == 2, "one K loop a consumer warpgroup"
    for loop in loops:
        assert not [t for t in loop if re.search(r"\bLDG\b", t)], "global loads in the K loop"
        per_million = len(loop) / mma_loop_macs(loop) * 1e6
        assert per_million <= 95, f"{len(loop)} instructions a 128-K block: {per_million:.1f} a million MACs"


def test_scale_ring_config_rules():
    """scale_ring is fp8_block's, on normal tiles; its stage buffers count in the shared memory."""
    import dataclasses

    from moegemm.sm90_configs import DenseConfig

    fp8 = FORMATS["fp8_block"]
    cfg = DenseConfig(block_n=256, block_k=128, stages=3, group_m=4, scale_ring=True)
    cfg.check(fp8)
    plain = dataclasses.replace(cfg, scale_ring=False)
    assert cfg.smem_bytes(fp8) == plain.smem_bytes(fp8) + 3 * (128 + 2) * 4
    for bad, f in (({"swap": True, "block_n": 32}, fp8), ({"split_n": True, "block_n": 128}, fp8),
                   ({"block_k": 64}, FORMATS["bf16"])):
        with pytest.raises(ValueError, match="scale_ring"):
            dataclasses.replace(cfg, **bad).check(f)

# (tokens per slot, fused output (ACT, OUT, OUT_SWIZZLED, HAS_BIAS, VEC)): swapped (16, 40),
# split-n (130) and normal (8192) tiles of the bf16 kernel, bf16 and mxfp8 out
FUSED_BF16_CASES = [(tps, epi) for tps in (16, 40, 130, 8192)
                    for epi in ((2, 0, False, True, 32, False), (1, 2, True, False, 32, False))]


@pytest.mark.parametrize("tokens_per_slot,epilogue", FUSED_BF16_CASES)
def test_sm90_fused_epilogue_compiles_for_sm90(tokens_per_slot, epilogue):
    """The bf16 kernel's fused SwiGLU epilogue fits the shared memory its config counts
    (sm90_configs.DenseConfig.fused_scratch: normal tiles give the plain epilogue's TMA buffers to
    their ring), with no spills (but a few on 128 x 256 tiles quantizing their output)."""
    from moegemm.config import sm90_config
    from moegemm.sm90_configs import SM90_SMEM_BYTES

    cfg = sm90_config(FORMATS["bf16"], 5760, 2880, tokens_per_slot, 2 if epilogue[1] == 0 else 1, fused=True)
    compiled = sm90_kernel_compiled("bf16", cfg, epilogue=epilogue)
    ops = offline.opcode_counts(wgmma_sass(compiled))
    assert ops["HGMMA"] > 0
    assert compiled.metadata.shared <= min(SM90_SMEM_BYTES, cfg.smem_bytes(FORMATS["bf16"], 2, fused=True) + 256)
    allowed = 32 if (cfg.block_n == 256 and not cfg.split_n and epilogue[1] != 0) else 0
    assert ops["LDL"] + ops["STL"] <= allowed, f"register spills: LDL={ops['LDL']} STL={ops['STL']}"


# (tokens per slot, fused output or None): the bf16 kernel's swapped (16, 40), split-n (130) and
# normal (8192) tiles on N-major weights (gpt-oss's experts, read in place), plain and fused
N_MAJOR_CASES = [(tps, epi) for tps in (16, 40, 130, 8192) for epi in (None, (2, 0, False, True, 32, False))]


@pytest.mark.parametrize("tokens_per_slot,epilogue", N_MAJOR_CASES)
def test_sm90_n_major_weights_compile_for_sm90(tokens_per_slot, epilogue):
    """N-major bf16 weights: the same wgmmas as K-major ones (shape and count), reading the weights
    as staged through the hardware's transposed-operand bit (tnspB; tnspA where the swapped tile
    makes them the M side), kept in flight, with no spills, in the shared memory the config counts;
    a weight tile is loaded in 64-column boxes (128-byte swizzle), one more TMA load a 64 columns."""
    from moegemm.config import sm90_config
    from moegemm.sm90_configs import SM90_SMEM_BYTES

    cfg = sm90_config(FORMATS["bf16"], 5760, 2880, tokens_per_slot, 2, fused=epilogue is not None)
    k_major = wgmma_sass(sm90_kernel_compiled("bf16", cfg, epilogue=epilogue))
    compiled = sm90_kernel_compiled("bf16", cfg, epilogue=epilogue, n_major=True)
    sass = wgmma_sass(compiled)
    ops, k_ops = offline.opcode_counts(sass), offline.opcode_counts(k_major)
    shapes = lambda text: sorted(re.findall(r"HGMMA\.(\d+x\d+x\d+)", text))  # noqa: E731
    assert shapes(sass) == shapes(k_major) and shapes(sass), "other wgmma shapes than on K-major weights"
    flag = "tnspA" if cfg.swap else "tnspB"
    gmmas = [line for line in sass.splitlines() if "HGMMA" in line]
    assert all(flag in line for line in gmmas) and not any("tnspA" in line for line in k_major.splitlines()), \
        f"N-major weights read without the {flag} bit"
    assert wgmma_overlaps(sass), "every wgmma is serialized"
    assert ops["UTMALDG"] == k_ops["UTMALDG"] + cfg.weight_tile // 64 - 1
    # The fused normal tile (gpt-oss's gate/up product at prefill) spills the program id once
    # (stored twice in the setup all warps run, loaded where the producer starts: 2 STL, 1 LDL,
    # read off the SASS; the same with the producer at 56 or 72 registers); none anywhere else.
    allowed = 3 if epilogue is not None and not cfg.swap and not cfg.split_n else 0
    assert ops["LDL"] + ops["STL"] <= allowed, f"register spills: LDL={ops['LDL']} STL={ops['STL']}"
    for loop in innermost_mma_loops(sass):
        assert not [t for t in loop if re.search(r"\b(LDL|STL)\b", t)], "register spills in a K loop"
    assert setmaxnreg_values(compiled) == setmaxnreg_values(
        sm90_kernel_compiled("bf16", cfg, epilogue=epilogue)) and cfg.consumer_regs in setmaxnreg_values(compiled)
    assert compiled.metadata.shared <= min(SM90_SMEM_BYTES,
                                           cfg.smem_bytes(FORMATS["bf16"], 2, fused=epilogue is not None) + 256)


MX_CASES = [
    (fmt, tokens_per_slot, layout)
    for fmt in ("mxfp8", "mxfp4", "nvfp4", "w4a8")
    for tokens_per_slot in (8, 16, 32, 40, 128, 8192)
    for layout in ("plain", "swizzled")
]


def sm90_mx_token_tile(fmt, tokens_per_slot):
    return mx_default_config(fmt, tokens_per_slot).token_tile


def mx_default_config(fmt, tokens_per_slot):
    from moegemm.config import sm90_mx_config

    return sm90_mx_config(FORMATS[fmt], 4096, 7168, tokens_per_slot)


def check_wgmma_pipelining(sass, fmt, tokens_per_slot):
    """Every kernel keeps wgmmas in flight back to back: the decoding kernel, the narrow
    promotion tiles, and the wide ones (a token half's wgmma runs while the other half is
    promoted, kernels/sm90/mxfp8.py). Only the tail loop of wide tiles waits for each one."""
    assert wgmma_overlaps(sass), "every wgmma is serialized"
    from moegemm.sm90_configs import Mxfp8Config

    cfg = mx_default_config(fmt, tokens_per_slot)
    if isinstance(cfg, Mxfp8Config) and cfg.wide:
        assert all(wgmma_overlaps("\n".join(loop)) for loop in innermost_mma_loops(sass)
                   if not any("64x32x32" in t for t in loop)), "a wide loop waits for every wgmma"


def mx_kernel_compiled(fmt, tokens_per_slot, layout, epilogue=None, with_scales=True, prepacked=False, fill=False):
    from moegemm.config import sm90_mx_config
    from moegemm.kernels.sm90 import decode, launcher
    from moegemm.sm90_configs import DecodeConfig, weight_bytes, with_epilogue_scratch

    f = FORMATS[fmt]
    cfg = sm90_mx_config(f, 4096, 7168, tokens_per_slot, prepacked=prepacked)
    if not isinstance(cfg, DecodeConfig):
        return mxfp8_kernel_compiled(cfg, layout, epilogue, fmt, with_scales=with_scales)
    if epilogue is not None:
        cfg = with_epilogue_scratch(cfg, f)
    fp4 = f.b.element.packed
    constexprs = {}
    if staged_scales(fmt, cfg, layout):  # the weight scales' atoms through the ring
        descs = {"ws_desc": offline.tensordesc_signature("i32", [cfg.stage_k // f.scale_vec // 4 * 32, 4],
                                                         launcher._unswizzled_32bit_layout())}
    else:
        descs, constexprs["ws_desc"] = {}, None
    signature = {
        "t_desc": offline.tensordesc_signature("bf16", [cfg.token_tile, cfg.block_k]),
        "w_desc": offline.tensordesc_signature("u8" if fp4 else "fp8e4nv",
                                               [cfg.weight_tile, int(cfg.stage_k * weight_bytes(f))]), **descs,
        "out_ptr": "*u8" if epilogue else "*bf16", "b_scale_ptr": "*u8", "a_offsets_ptr": "*i32",
        "expert_ids_ptr": "*i32", "expert_scales_ptr": "*fp32", "row_scales_ptr": "*fp32",
        **{name: "i32" for name in ("M", "N", "K", "E", "G", "NUM_KB", "KB4")}, "epi": EPILOGUE_SIGNATURE,
    }
    constexprs.update(STAGES=cfg.stages, GROUP_M=cfg.group_m, VEC=f.scale_vec, NV_SCALE=f.b.scale == "e4m3",
                      SWIZZLED=layout == "swizzled", HAS_EXPERT_SCALES=with_scales,
                      HAS_ROW_SCALES=with_scales and epilogue is None,
                      CONSUMER_REGS=cfg.consumer_regs, EPI=epilogue or PLAIN_EPILOGUE, PREPACKED=cfg.prepacked,
                      CONSUMER_ROWS=cfg.consumer_rows, FILL=fill)
    return offline.gluon_compile_for_sm90(decode.decode_kernel, signature, constexprs,
                                          {"num_warps": 4})


def staged_scales(fmt, cfg, layout) -> bool:
    """Whether the launcher gives the decoding kernel its weight scales through the ring
    (launcher.staged_scales)."""
    return cfg.staged_scales and layout == "swizzled" and FORMATS[fmt].b.element.packed


def mxfp8_kernel_compiled(cfg, layout, epilogue=None, fmt="mxfp8", half_tiles=False, with_scales=True):
    """The promotion kernels: kernels/sm90/mxfp8.py for mxfp8 (Mxfp8Config), kernels/sm90/e2m1.py for
    the e2m1 weights of mxfp4/w4a8 (E2m1Config, packed bytes in the ring)."""
    from moegemm.kernels.sm90 import e2m1, launcher, mxfp8
    from moegemm.sm90_configs import E2m1Config, with_epilogue_scratch

    if epilogue is not None:
        cfg = with_epilogue_scratch(cfg, FORMATS[fmt])
    swizzled = layout == "swizzled"
    fp4_weights = isinstance(cfg, E2m1Config)
    scales_layout = launcher._unswizzled_32bit_layout()
    descs, constexprs = {}, {}
    if fp4_weights or cfg.wide:  # token scales through the ring
        descs["s_desc"] = offline.tensordesc_signature("fp32", [cfg.stage_k // 32, cfg.token_tile], scales_layout)
    else:
        constexprs["s_desc"] = None
    if fp4_weights:
        if swizzled:  # and the weight scales' atoms
            descs["ws_desc"] = offline.tensordesc_signature("i32", [cfg.stage_k // 128 * 32, 4], scales_layout)
        else:
            constexprs["ws_desc"] = None
        if half_tiles:  # N % 128 <= 64: an expert's last tile loads its 64 rows alone (split-K)
            descs["w_half_desc"] = offline.tensordesc_signature("u8", [cfg.weight_tile // 2, cfg.block_k])
        else:
            constexprs["w_half_desc"] = None
    elif cfg.tail_tokens:  # a slot's last tile takes up to tail_tokens more tokens (wide mxfp8 tiles)
        descs["tail_desc"] = offline.tensordesc_signature("fp8e4nv", [cfg.tail_tokens, cfg.block_k])
        descs["tail_s_desc"] = offline.tensordesc_signature("fp32", [cfg.stage_k // 32, cfg.tail_tokens],
                                                            scales_layout)
    else:
        constexprs["tail_desc"] = None
        constexprs["tail_s_desc"] = None
    signature = {
        "t_desc": offline.tensordesc_signature("fp8e4nv", [cfg.token_tile, cfg.block_k]),
        "w_desc": offline.tensordesc_signature("u8" if fp4_weights else "fp8e4nv",
                                               [cfg.weight_tile, cfg.block_k]), **descs,
        "out_ptr": "*u8" if epilogue else "*bf16", "b_scale_ptr": "*i32" if swizzled else "*u8",
        "a_offsets_ptr": "*i32", "expert_ids_ptr": "*i32", "expert_scales_ptr": "*fp32", "row_scales_ptr": "*fp32",
        "tile_counter_ptr": "*i32", "claim_rounds": "i32",
        **{name: "i32" for name in ("M", "N", "K", "E", "G", "NUM_KB", "KB4")}, "epi": EPILOGUE_SIGNATURE,
    }
    constexprs.update(STAGES=cfg.stages, GROUP_M=cfg.group_m, SWIZZLED=swizzled, HAS_EXPERT_SCALES=with_scales,
                      HAS_ROW_SCALES=with_scales and epilogue is None, CONSUMER_REGS=cfg.consumer_regs,
                      EPI=epilogue or PLAIN_EPILOGUE, DYNAMIC=not (fp4_weights and cfg.split_k))
    if fp4_weights:
        kernel = e2m1.e2m1_kernel
        constexprs.update(ACC_FACTOR=64.0 if fmt == "w4a8" else 1.0, SPLIT_K=cfg.split_k)
    else:
        kernel = mxfp8.mxfp8_kernel
        signature.update(t_scale_ptr="*fp32", T_SCALE_STRIDE="i32")
        constexprs.update(CHUNK_WALK=cfg.chunk_walk, SHORT_TAILS=cfg.short_tails)
    # (the layer's shapes: N a multiple of 16, as the launcher then specializes)
    return offline.gluon_compile_for_sm90(kernel, signature, constexprs, {"num_warps": 4}, aligned=("out_ptr", "N"))


def wgmma_overlaps(sass: str) -> bool:
    """Some wgmma issues while an earlier one is in flight: two HGMMA/QGMMA with no wait for
    zero between them. A serialized kernel (ptxas C7512, with the producer's setmaxnreg at 40)
    waits for zero after every one."""
    events = re.findall(r"\b(HGMMA|QGMMA|WARPGROUP\.DEPBAR\.LE gsb0, 0x0)\b", sass)
    return any(a in ("HGMMA", "QGMMA") and b in ("HGMMA", "QGMMA") for a, b in zip(events, events[1:]))


@pytest.mark.parametrize("fmt,tokens_per_slot,layout", MX_CASES)
def test_sm90_mx_kernel_compiles_for_sm90(fmt, tokens_per_slot, layout):
    from moegemm.sm90_configs import SM90_SMEM_BYTES

    compiled = mx_kernel_compiled(fmt, tokens_per_slot, layout)
    sass = wgmma_sass(compiled)
    ops = offline.opcode_counts(sass)
    assert ops["HGMMA"] + ops["QGMMA"] > 0 and ops["UTMALDG"] > 0, \
        f"wgmma and TMA loads expected: {ops.most_common(12)}"
    check_wgmma_pipelining(sass, fmt, tokens_per_slot)
    check_spills(sass, fmt, tokens_per_slot)
    # (one SHFL: ptxas's warp aggregation of the producer's tile claim, Schedule.claim_next)
    assert ops["SHFL"] <= ops["ATOMG"], "decoding the weights moved data between threads (operand layout mismatch)"
    assert compiled.metadata.shared <= SM90_SMEM_BYTES


def check_spills(sass: str, fmt: str, tokens_per_slot: float, fused: bool = False):
    """None in a K loop, and in the mxfp8 promotion kernel (plain epilogue) at most two values
    (the weight rows' scale offsets, which LLVM hoists to the slot level on the 128-token tiles
    with tails: stored once a slot, read once a tile). Outside: other 128-token tiles spill up to 35 tile-setup and epilogue values within the consumers'
    192 registers, or up to 80 (160 with a tail); the split-K e2m1 kernel's four consumer
    warpgroups (112 registers each) up to 14 with 16-token tiles or the fused epilogue; the
    decoding kernel's 256-token tiles up to 8 setup and epilogue values (their producer has 24
    registers, the consumers 240 with two 128-token accumulators); other tiles none. (The fused epilogue on mxfp8's 128-token tiles also spills 4 values in its K
    loop: not checked there, docs/perf-notes.md.)"""
    from moegemm.config import sm90_mx_config
    from moegemm.sm90_configs import E2m1Config, Mxfp8Config

    cfg = sm90_mx_config(FORMATS[fmt], 4096, 7168, tokens_per_slot)
    tail = getattr(cfg, "tail_tokens", 0)
    if isinstance(cfg, Mxfp8Config) and not fused:  # (the tile's token offsets are made after the K loop)
        allowed = 8 if tail else 0
    else:
        split_k = isinstance(cfg, E2m1Config) and cfg.split_k
        allowed = (160 if tail else 80) if cfg.token_tile == 128 else 32 if split_k else 16 if cfg.token_tile == 256 \
            else 0
    ops = offline.opcode_counts(sass)
    assert ops["LDL"] + ops["STL"] <= allowed, f"register spills: LDL={ops['LDL']} STL={ops['STL']}"
    if fused and cfg.token_tile == 128:
        return
    for loop in innermost_mma_loops(sass):
        assert not [t for t in loop if re.search(r"\b(LDL|STL)\b", t)], "register spills in a K loop"


def setmaxnreg_values(compiled) -> set[int]:
    """The register counts of a kernel's setmaxnreg instructions: each partition's, 56 (every
    warpgroup's share until the partitions start) and 256 (the default partition's around them)."""
    return {int(v) for v in re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+);", compiled.asm["ptx"])}


def innermost_mma_loops(sass: str) -> list[list[str]]:
    """The instructions of every loop that contains a wgmma and no other loop (the K loops of
    each consumer partition)."""
    loops = [[text for _, text in loop] for loop in offline.innermost_loops(sass)]
    assert loops, "no loop around a wgmma"
    return loops


def first_mma_loop(sass: str) -> list[str]:
    """The instructions of the first loop that contains a wgmma: from the target of the first
    backward branch past the first HGMMA/QGMMA to that branch."""
    instructions = [(int(a, 16), text) for a, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    first_mma = next(a for a, text in instructions if "GMMA" in text)
    for address, text in instructions:
        target = re.search(r"\bBRA (0x[0-9a-f]+)", text)
        if target and address > first_mma and int(target.group(1), 16) <= first_mma:
            return [t for a, t in instructions if int(target.group(1), 16) <= a <= address]
    raise AssertionError("no loop around the first wgmma")


@pytest.mark.parametrize("fmt", ("mxfp4", "w4a8"))
def test_e2m1_promotion_loop_issues_no_global_loads(fmt):
    # With swizzled weight scales the producer copies every scale of a stage into the ring
    # (five TMA loads: two token boxes, the weights, token scales, weight-scale atoms), so the
    # consumers' K loop has no LDG for its fence (a MEMBAR) to wait on (kernels/sm90/e2m1.py).
    # The decode is 8 instructions for 8 elements (_E2M1_TO_E4M3_PTX, no byte shuffles), and an
    # 8-token tile promotes 4 accumulators a thread and K block: 428 instructions a stage at
    # 8 tokens (593 with the PRMT table on 16-token tiles). Split-K (the default): each of the
    # four consumer warpgroups' K loops takes one 128-K half of a stage, four wgmmas and 226
    # instructions at 8 tokens.
    for tokens_per_slot, most in ((2, 240), (8, 280)):
        sass = wgmma_sass(mx_kernel_compiled(fmt, tokens_per_slot, "swizzled"))
        loops = innermost_mma_loops(sass)
        assert len(loops) == 4, "one K loop a consumer warpgroup"
        for loop in loops:
            assert sum("QGMMA" in t for t in loop) == 4, "four k32 wgmmas a half stage"
            assert not [t for t in loop if re.search(r"\bLDG\b", t)], "global loads in the e2m1 K loop"
            assert not [t for t in loop if t.split()[0] == "PRMT"], "byte shuffles in the e2m1 decode"
            assert len(loop) <= most, f"{len(loop)} instructions a half stage"
        assert offline.opcode_counts(sass)["UTMALDG"] == 5


@pytest.mark.parametrize("fmt", ("mxfp8", "mxfp4", "nvfp4", "w4a8"))
def test_token_prepass_compiles_for_sm90(fmt):
    f = FORMATS[fmt]
    module = portable.kernel_module(False)
    kernel = module.dequantize_rows_kernel
    codes = portable.format_constexprs(f, True, False, False)
    constexprs = dict(A_ELEM=codes["A_ELEM"], SCALE=codes["A_SCALE"],
                      VEC=f.scale_vec, SWIZZLED=True, INTERPRETED=False, BLOCK_M=32, BLOCK_K=128, FILL=False)
    signature = {name: ("*bf16" if name == "out_ptr" else "*i32" if name in POINTERS else "*u8")
                 if name.endswith("_ptr") else "i32" for name in kernel.arg_names if name not in constexprs}
    compiled = offline.compile_for_sm90(kernel, signature, constexprs, {"num_warps": 4, "num_stages": 1})
    ops = offline.opcode_counts(offline.sass(compiled))
    assert ops["LDL"] + ops["STL"] == 0, f"register spills: LDL={ops['LDL']} STL={ops['STL']}"


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("swizzled", [False, True])
def test_merged_token_prepass_compiles_for_sm90(swizzled, packed):
    # tokens.token_prepass: the scale decode and the e2m1 -> e4m3 conversion in one kernel; not
    # packed, w4a8's row scales and its e4m3 tokens' even/odd order (int16 pairs).
    kernel = portable.kernel_module(False).token_prepass_kernel
    constexprs = dict(SWIZZLED=swizzled, ALIGN_GROUPS=True, BLOCK_M=32, BLOCK_KB=64, EXP=0 if not packed else 6,
                      EVEN_ODD=True, BLOCK=1024, PACKED=packed, FILL=False)
    source = "*u8" if packed else "*i16"
    signature = {name: ("*fp32" if name == "scales_out_ptr" else "*i32" if name in POINTERS else
                        source if name == "src_ptr" else "*u8")
                 if name.endswith("_ptr") else "i32" for name in kernel.arg_names if name not in constexprs}
    compiled = offline.compile_for_sm90(kernel, signature, constexprs, {"num_warps": 4, "num_stages": 1})
    ops = offline.opcode_counts(offline.sass(compiled))
    assert ops["LDL"] + ops["STL"] == 0, f"register spills: LDL={ops['LDL']} STL={ops['STL']}"


@pytest.mark.parametrize("kernel_name,out_type", [("dequantize_rows_kernel", "*bf16"),
                                                   ("decode_row_scales_kernel", "*fp32"),
                                                   ("token_prepass_kernel", "*bf16")])
def test_token_prepass_zero_fill_compiles_for_sm90(kernel_name, out_type):
    """The pre-passes' FILL programs (kernels/tokens.py: a fresh product output's rows outside
    valid slots zeroed in the same launch), of a bf16 or fp32 output: no spills, and the fill's
    stores are there (more global stores than without it)."""
    kernel = getattr(portable.kernel_module(False), kernel_name)
    f = FORMATS["nvfp4" if kernel_name == "dequantize_rows_kernel" else "mxfp8"]
    codes = portable.format_constexprs(f, True, False, False)
    constexprs = {
        "dequantize_rows_kernel": dict(A_ELEM=codes["A_ELEM"], SCALE=codes["A_SCALE"], VEC=f.scale_vec,
                                       SWIZZLED=True, INTERPRETED=False, BLOCK_M=32, BLOCK_K=128),
        "decode_row_scales_kernel": dict(SWIZZLED=True, ALIGN_GROUPS=4, BLOCK_M=32, BLOCK_KB=64),
        "token_prepass_kernel": dict(SWIZZLED=True, ALIGN_GROUPS=4, BLOCK_M=32, BLOCK_KB=64, EXP=6, EVEN_ODD=True,
                                     BLOCK=1024, PACKED=True),
    }[kernel_name]
    typed = dict(POINTERS, c_ptr=out_type, scales_out_ptr="*fp32",
                 out_ptr="*bf16" if kernel_name == "dequantize_rows_kernel" else "*fp32")
    signature = {name: typed.get(name, "*u8") if name.endswith("_ptr") else "i32"
                 for name in kernel.arg_names if name not in constexprs and name != "FILL"}
    stores = []
    for fill in (False, True):
        compiled = offline.compile_for_sm90(kernel, signature, dict(constexprs, FILL=fill),
                                            {"num_warps": 4, "num_stages": 1})
        ops = offline.opcode_counts(offline.sass(compiled))
        assert ops["LDL"] + ops["STL"] == 0, f"register spills (FILL={fill}): LDL={ops['LDL']} STL={ops['STL']}"
        stores.append(ops["STG"])
    assert stores[1] > stores[0], f"no stores of the fill: {stores}"


# (weight format, tokens per slot, fused output (ACT, OUT, OUT_SWIZZLED, HAS_BIAS, VEC, DEQUANT))
FUSED_MX_CASES = [
    ("mxfp8", 16, (1, 2, True, False, 32, False)),
    ("mxfp4", 8192, (2, 3, True, True, 32, False)),
    ("nvfp4", 32, (1, 4, True, False, 16, False)),
    ("w4a8", 8192, (1, 2, False, True, 32, False)),
    ("mxfp8", 128, (2, 0, False, True, 32, False)),
    ("mxfp4", 8, (2, 3, True, True, 32, False)),  # e2m1 weights on the promotion kernel
    ("w4a8", 2, (1, 2, True, False, 32, False)),  # and its 8-token tiles
    # the bf16 token form out (the decoded values): gpt-oss's prefill, and a wide mxfp8 tile
    ("mxfp4", 8192, (2, 3, False, True, 32, True)),
    ("w4a8", 8192, (2, 2, False, True, 32, True)),
    ("mxfp8", 128, (1, 2, False, False, 32, True)),
]


@pytest.mark.parametrize("fmt,tokens_per_slot,epilogue", FUSED_MX_CASES)
def test_fused_swiglu_epilogue_compiles_for_sm90(fmt, tokens_per_slot, epilogue):
    """The fused SwiGLU epilogue: its layout conversion's scratch fits beside the (shortened)
    ring, no spills are added, and the wgmmas still issue back to back."""
    from moegemm.sm90_configs import SM90_SMEM_BYTES

    compiled = mx_kernel_compiled(fmt, tokens_per_slot, "swizzled", epilogue)
    sass = wgmma_sass(compiled)
    check_wgmma_pipelining(sass, fmt, tokens_per_slot)
    check_spills(sass, fmt, tokens_per_slot, fused=True)
    assert compiled.metadata.shared <= SM90_SMEM_BYTES


@pytest.mark.parametrize("layout", ["plain", "swizzled"])
def test_e2m1_split_k_half_tiles_compile(layout):
    # gpt-oss down (N = 2880 = 22.5 x 128): the producer's 64-row box for an expert's last tile
    # (sixth TMA load), the skipping warpgroups' wait-and-release loop; no spills in a K loop.
    from moegemm.config import sm90_mx_config

    cfg = sm90_mx_config(FORMATS["mxfp4"], 2880, 2880, 2)
    assert cfg.split_k
    compiled = mxfp8_kernel_compiled(cfg, layout, None, "mxfp4", half_tiles=True)
    sass = wgmma_sass(compiled)
    assert offline.opcode_counts(sass)["UTMALDG"] == (6 if layout == "swizzled" else 5)
    # every one of the four consumer warpgroups gets the config's registers, consumer 0 (the
    # default partition, which gets what the workers leave of the pool) included
    assert setmaxnreg_values(compiled) == {cfg.consumer_regs, 480 - 4 * cfg.consumer_regs, 56, 256}
    for loop in innermost_mma_loops(sass):
        assert not [t for t in loop if re.search(r"\b(LDL|STL)\b", t)], "register spills in a K loop"


def test_e2m1_promotion_config_rules():
    """The default decode config of mxfp4/w4a8 is the e2m1 promotion kernel's (8-token tiles up
    to 4 tokens a slot, then 16; 256 K a stage); the shapes it cannot run are refused rather than
    launched."""
    import dataclasses

    from moegemm.config import sm90_mx_config
    from moegemm.sm90_configs import DecodeConfig, E2m1Config

    for fmt in ("mxfp4", "w4a8"):
        cfg = sm90_mx_config(FORMATS[fmt], 5760, 2880, 2)
        assert isinstance(cfg, E2m1Config) and cfg.token_tile == 8 and cfg.stage_k == 256 and cfg.split_k
        with pytest.raises(ValueError, match="consumer_regs"):
            dataclasses.replace(cfg, consumer_regs=192).check(FORMATS[fmt])  # four consumer warpgroups
        assert sm90_mx_config(FORMATS[fmt], 5760, 2880, 8).token_tile == 16
        assert isinstance(sm90_mx_config(FORMATS[fmt], 5760, 2880, 16), DecodeConfig)  # regime 32: decoding
        with pytest.raises(ValueError, match="8 or 16 tokens"):
            dataclasses.replace(cfg, token_tile=32).check(FORMATS[fmt])
    # 8-token tiles are the e2m1 promotion kernel's only: the other formats and kernels keep 16.
    assert sm90_mx_config(FORMATS["mxfp8"], 5760, 2880, 2).token_tile == 16
    assert sm90_mx_config(FORMATS["nvfp4"], 5760, 2880, 2).token_tile == 16
    e2m1_cfg = E2m1Config(token_tile=16, stages=4, group_m=1, consumer_regs=192, split_k=False)
    for fmt in ("nvfp4", "mxfp8"):  # 16-wide scale blocks (no k32 wgmma per block); e4m3 weights
        with pytest.raises(ValueError, match="E2m1Config runs"):
            e2m1_cfg.check(FORMATS[fmt])


def test_wide_weight_tiles_config_rules():
    from moegemm.config import sm90_mx_config
    from moegemm.sm90_configs import DecodeConfig, E2m1Config

    # prepacked weights at up to 64 tokens a tile: 256 rows, four consumer warpgroups
    for tokens_per_slot, tile in ((2, 16), (16, 32), (30, 64), (40, 64)):
        cfg = sm90_mx_config(FORMATS["bf16_mxfp4"], 5760, 2880, tokens_per_slot, prepacked=True)
        assert (cfg.weight_tile, cfg.token_tile) == (256, tile) and cfg.consumer_regs <= 120
    assert sm90_mx_config(FORMATS["bf16_mxfp4"], 5760, 2880, 16, prepacked=False).weight_tile == 128
    # e2m1 weights with e4m3 or e2m1 tokens: prepacked, the decoding kernel's 256-row tiles from one
    # token a slot on (16-token tiles: no 8-token tiles there), the e2m1 promotion kernel plain
    for fmt in ("mxfp4", "w4a8"):
        for tokens_per_slot, tile in ((0.5, 16), (2, 16), (16, 32), (40, 64)):
            cfg = sm90_mx_config(FORMATS[fmt], 5760, 2880, tokens_per_slot, prepacked=True)
            assert isinstance(cfg, DecodeConfig) and (cfg.weight_tile, cfg.token_tile) == (256, tile)
        assert isinstance(sm90_mx_config(FORMATS[fmt], 5760, 2880, 2), E2m1Config)
    assert sm90_mx_config(FORMATS["bf16_mxfp4"], 5760, 2880, 1000, prepacked=True).weight_tile == 128
    for bad in (dict(prepacked=False), dict(token_tile=128), dict(consumer_regs=192), dict(weight_tile=192)):
        fields = dict(token_tile=16, stages=2, group_m=1, consumer_regs=112, sub_steps=2, prepacked=True,
                      weight_tile=256) | bad
        with pytest.raises(ValueError, match="weight_tile|256-row tiles"):
            DecodeConfig(**fields).check(FORMATS["bf16_mxfp4"])


def test_chunk_walk_config_rules():
    """The slot walk from chunks of slots is the 32-token mxfp8 tiles' default (where it measured
    faster); wide tiles refuse it, and the other kernels' configs have no such setting."""
    import dataclasses

    from moegemm.config import sm90_mx_config
    from moegemm.sm90_configs import DecodeConfig, DenseConfig, E2m1Config

    assert sm90_mx_config(FORMATS["mxfp8"], 7168, 2048, 16).chunk_walk  # 32-token tiles
    assert not any(getattr(sm90_mx_config(FORMATS[fmt], 7168, 2048, tps), "chunk_walk", False)
                   for fmt in ("mxfp8", "mxfp4", "w4a8") for tps in (1, 2, 8, 40, 128))
    with pytest.raises(ValueError, match="chunk_walk"):
        dataclasses.replace(sm90_mx_config(FORMATS["mxfp8"], 7168, 2048, 128), chunk_walk=True).check(FORMATS["mxfp8"])
    for kind in (DecodeConfig, DenseConfig, E2m1Config):
        assert "chunk_walk" not in {field.name for field in dataclasses.fields(kind)}


def test_mxfp8_wide_loops_use_no_scale_load_in_its_own_iteration():
    # The next stage's weight scales are loaded a stage ahead; their decode must wait for the
    # next iteration: decoded right after the load, every stage waited for DRAM (Nsight long
    # scoreboard; docs/perf-notes.md, "Scales staged through the ring"). The wide and tail
    # loops, swizzled scales. (The narrow loop moves its next token scales, and plain byte loads
    # are packed, in the iteration of their load: unmeasured, so not asserted.) A copy of the
    # loaded register into the loop-carried one in the loop's last 32 instructions, a stage after
    # the load, is allowed: ptxas issues the load before the previous word's decode frees its
    # register.
    sass = wgmma_sass(mx_kernel_compiled("mxfp8", 128, "swizzled"))
    loops = innermost_mma_loops(sass)
    assert loops
    for loop in loops:
        for i, text in enumerate(loop):
            load = re.search(r"\bLDG\.E\S* (R\d+),", text)
            if load:
                reg = load.group(1)
                readers = [(j, t) for j, t in enumerate(loop[i + 1:], i + 1)
                           if re.search(rf"\b{reg}\b", t.split(",", 1)[-1] if "," in t else "")]
                early = [t for j, t in readers if not (j >= len(loop) - 32 and re.match(rf"MOV R\d+, {reg}\s*$", t))]
                assert not early, f"{reg} loaded and read in one iteration: {early[:2]}"


def test_mxfp8_tails_only_where_they_pay():
    from dataclasses import replace

    from moegemm.config import sm90_mx_config

    f = FORMATS["mxfp8"]
    assert sm90_mx_config(f, 4096, 7168, 128).tail_tokens == 32  # ~128 tokens an expert
    # an expert's tiles share weights: the decoding kernel's 256-token tiles, no tails
    assert sm90_mx_config(f, 4096, 7168, 1024).token_tile == 256
    assert sm90_mx_config(f, 4096, 7168, 40).tail_tokens == 0  # 64-token tiles
    assert sm90_mx_config(f, 4096, 7168, 128).short_tails  # and tails of <= 16 tokens on their own accumulator
    cfg = sm90_mx_config(f, 4096, 7168, 128)
    for bad in (replace(cfg, token_tile=64), replace(cfg, tail_tokens=8)):
        with pytest.raises(ValueError, match="tail_tokens"):
            bad.check(f)
    for bad in (replace(cfg, tail_tokens=16), replace(cfg, tail_tokens=0)):
        with pytest.raises(ValueError, match="short_tails"):
            replace(bad, short_tails=True).check(f)


def test_offline_compile_names_every_argument():
    # triton.compile does not apply a kernel's defaults: a constexpr left out would compile a
    # kernel other than the one launched, so the helpers refuse it (and names it has not).
    from moegemm.kernels.sm90 import mxfp8

    kernel = mxfp8.mxfp8_kernel
    given = {name: "i32" for name in kernel.arg_names if name != "SHORT_TAILS"}
    with pytest.raises(ValueError, match="SHORT_TAILS"):
        offline.gluon_compile_for_sm90(kernel, given, {}, {"num_warps": 4})
    with pytest.raises(ValueError, match="nope"):
        offline.gluon_compile_for_sm90(kernel, given, {"SHORT_TAILS": False, "nope": 1}, {"num_warps": 4})
    with pytest.raises(ValueError, match="HAS_ROW_SCALES"):
        offline.compile_for_sm90(portable.kernel_module(False).grouped_matmul_kernel, {}, {}, {})


# Every kernel family in the specialization of a call without expert and row scales (the other
# tests compile the one with them; ptxas schedules the two differently): the decoding kernel's
# 32- and 64-token tiles once read their accumulator before the last wgmma retired in this one
# only (kernels/sm90/decode.py, _upcast_chain).
UNSCALED_CASES = [("sm90", "bf16", 16), ("sm90", "fp8_block", 40),
                  ("mx", "mxfp4", 20), ("mx", "mxfp4", 40), ("mx", "nvfp4", 20), ("mx", "w4a8", 40),
                  ("mx", "mxfp8", 8), ("mx", "mxfp8", 130), ("mx", "mxfp4", 2)]


@pytest.mark.parametrize("fmt,tokens_per_slot,layout", [("bf16_mxfp4", 16, "plain"), ("nvfp4", 1024, "swizzled"),
                                                       ("bf16_mxfp8", 100, "swizzled"), ("bf16_nvfp4", 40, "plain"),
                                                       ("mxfp4", 2, "swizzled"), ("w4a8", 40, "plain")])
def test_prepacked_weights_decode_into_registers(fmt, tokens_per_slot, layout):
    # Prepacked weights go from the ring to the wgmma's register operand: the K loop stores no
    # decoded weights and has no proxy fence (only the scales' layout conversion touches shared
    # memory), no register of an in-flight wgmma is touched, nothing spills.
    sass = wgmma_sass(mx_kernel_compiled(fmt, tokens_per_slot, layout, prepacked=True))
    for loop in innermost_mma_loops(sass):
        ops = [t.split()[1] if t.startswith("@") else t.split()[0] for t in loop]
        assert not [o for o in ops if o.startswith("FENCE")], "a proxy fence in the prepacked K loop"
        assert not [o for o in ops if o in ("STS.128", "STL", "LDL")], "decoded weights stored, or a spill"
        assert any(o.startswith("HGMMA") for o in ops)


# Decode instructions an element in the prepacked e2m1 K loop: 9 integer instructions a word
# of 8 elements (rotations SHF, masks LOP3: kernels/sm90/decode.py, moegemm.prepack) and bf16x2
# multiplies (HMUL2): by 2^126 and the e8m0 scale (mx), or once by the e4m3 scale times 2^117
# (nvfp4). gl.fp4_to_fp's table lookups took 2.7 an element of these four, and 57 IMADs an iteration.
E2M1_DECODE_BOUNDS = {"bf16_mxfp4": 2.3, "nvfp4": 1.75, "bf16_nvfp4": 1.75}  # (a few are address arithmetic)


@pytest.mark.parametrize("weight_tile", [128, 256])
@pytest.mark.parametrize("fmt", sorted(E2M1_DECODE_BOUNDS))
def test_prepacked_e2m1_decode_instructions_an_element(fmt, weight_tile):
    from moegemm.config import override_config
    from moegemm.sm90_configs import DecodeConfig, deepest_ring

    regs = 112 if weight_tile == 256 else 192
    cfg = deepest_ring(DecodeConfig(token_tile=16, stages=2, group_m=1, consumer_regs=regs, sub_steps=2,
                                    prepacked=True, weight_tile=weight_tile), FORMATS[fmt])
    with override_config(cfg):
        compiled = mx_kernel_compiled(fmt, 16, "swizzled", prepacked=True)
    sass = wgmma_sass(compiled)
    loops = innermost_mma_loops(sass)
    assert len(loops) == weight_tile // 64, "a K loop a consumer warpgroup"
    # the default partition (consumer 0) gets the config's registers as the workers do (it gets
    # what they leave of the pool), and the config's shared-memory estimate bounds the kernel's
    setmaxnreg = setmaxnreg_values(compiled)
    assert cfg.consumer_regs in setmaxnreg and min(setmaxnreg) >= 24, sorted(setmaxnreg)
    if weight_tile == 256:
        # (56: every warpgroup's share until the partitions start; 256: the default's around them)
        expected = {cfg.consumer_regs, 480 - 4 * cfg.consumer_regs, 56, 256}
        assert setmaxnreg == expected, sorted(setmaxnreg)
    # (two consumer warpgroups: up to ~0.9 KB of the compiler's scratch beyond the estimate, which
    # the 128-row configs' margins absorb; four: counted)
    assert compiled.metadata.shared <= cfg.smem_bytes(FORMATS[fmt]) + (0 if weight_tile == 256 else 1024)
    for loop in loops:
        ops = [t.split()[1] if t.startswith("@") else t.split()[0] for t in loop]
        assert not [o for o in ops if o in ("STL", "LDL")], "a spill"
        decode = sum(1 for o in ops if o.split(".")[0] in ("SHF", "LOP3", "HMUL2", "PRMT"))
        elements = 8 * sum(1 for o in ops if o.startswith("HGMMA"))  # (32 a thread a k64 step of 4 wgmmas)
        assert decode / elements <= E2M1_DECODE_BOUNDS[fmt], f"{decode} decode instructions for {elements} elements"


@pytest.mark.parametrize("family,fmt,tokens_per_slot", UNSCALED_CASES)
def test_unscaled_specialization_reads_no_accumulator_in_flight(family, fmt, tokens_per_slot):
    if family == "sm90":
        from moegemm.config import sm90_config

        cfg = sm90_config(FORMATS[fmt], 4096, 7168, tokens_per_slot, 2)
        compiled = sm90_kernel_compiled(fmt, cfg, with_scales=False)
    else:
        compiled = mx_kernel_compiled(fmt, tokens_per_slot, "plain", with_scales=False)
    wgmma_sass(compiled)


def test_register_hazard_check_finds_an_early_accumulator_read():
    # The check itself: a read of the accumulator between the last wgmma and its wait is
    # found; after the wait it is not; a newer group left in flight keeps its registers busy.
    body = ("/*0010*/ HGMMA.64x32x16.F32.BF16 R24, gdesc[UR36], R24, gsb0 ;\n"
            "/*0020*/ WARPGROUP.DEPBAR.LE gsb0, 0x1 ;\n"
            "/*0030*/ HGMMA.64x32x16.F32.BF16 R24, gdesc[UR40], R24, gsb0 ;\n"
            "/*0040*/ WARPGROUP.DEPBAR.LE gsb0, 0x1 ;\n"
            "/*0050*/ F2FP.BF16.F32.PACK_AB R40, R39, R38 ;\n"
            "/*0060*/ WARPGROUP.DEPBAR.LE gsb0, 0x0 ;\n"
            "/*0070*/ F2FP.BF16.F32.PACK_AB R41, R37, R36 ;\n"
            "/*0080*/ IMAD R56, R57, R58, RZ ;\n")
    assert offline.wgmma_register_hazards(body) == [("0050", "F2FP.BF16.F32.PACK_AB R40, R39, R38")]


# The prepacked e2m1 K loop with its weight scales staged in the ring (DecodeConfig.staged_scales):
# instructions one iteration issues an element of a thread (a warpgroup's 64 or 128 rows x 128 K
# over its 128 threads), on its path without an e8m0 code >= 128 (the longer one decodes as the
# step-ahead loop does), read off the sm_90 SASS. The step-ahead loop: 3.80 with 2 LDG
# (bf16_mxfp4, 16 tokens a slot), 3.67-3.75 with 4 (nvfp4, whose staged e4m3 scales convert as
# before). (fmt, tokens a slot, consumer rows) -> bound.
STAGED_BUDGETS = {("bf16_mxfp4", 16, 64): 2.95, ("bf16_mxfp4", 32, 64): 3.0, ("mxfp4", 16, 64): 2.95,
                  ("w4a8", 32, 64): 3.0, ("nvfp4", 16, 64): 3.8, ("bf16_nvfp4", 32, 64): 3.8,
                  ("bf16_mxfp4", 16, 128): 2.55, ("bf16_mxfp4", 32, 128): 2.55, ("w4a8", 16, 128): 2.55,
                  ("nvfp4", 32, 128): 3.4}


def staged_config(fmt, tokens_per_slot, staged=True, consumer_rows=64):
    """The prepacked default config of the regime (4096 x 7168) with staged_scales set (and
    consumer_rows: 128 with 232 registers a consumer), its ring as deep as it then fits."""
    import dataclasses

    from moegemm.config import sm90_mx_config
    from moegemm.sm90_configs import deepest_ring

    cfg = sm90_mx_config(FORMATS[fmt], 4096, 7168, tokens_per_slot, prepacked=True)
    wide = dict(consumer_rows=128, consumer_regs=232) if consumer_rows == 128 else {}
    return deepest_ring(dataclasses.replace(cfg, staged_scales=staged, stages=2, **wide), FORMATS[fmt])


@pytest.mark.parametrize("fmt,tokens_per_slot,consumer_rows", sorted(STAGED_BUDGETS))
def test_staged_scales_k_loop_issues_no_global_load(fmt, tokens_per_slot, consumer_rows):
    from moegemm.config import override_config
    from moegemm.sm90_configs import SM90_SMEM_BYTES

    cfg = staged_config(fmt, tokens_per_slot, consumer_rows=consumer_rows)
    with override_config(cfg):
        compiled = mx_kernel_compiled(fmt, tokens_per_slot, "swizzled", prepacked=True)
    sass = wgmma_sass(compiled)
    ops = offline.opcode_counts(sass)
    # two token boxes, the weights and one box of scale atoms for each 128-row block
    assert ops["UTMALDG"] == 5
    loops = offline.innermost_loops(sass)
    assert len(loops) == 256 // consumer_rows, "a K loop a consumer warpgroup"
    units = 2 * consumer_rows // 64  # (a step of a 64-row block: four k16 wgmmas)
    for body in loops:
        texts = [t for _, t in body]
        assert not [t for t in texts if re.search(r"\b(LDG|LDL|STL)\b", t)], "a global load or a spill in the K loop"
        fast, _ = offline.loop_paths(body)
        gmmas = [t for t in fast if "HGMMA" in t]
        assert len(gmmas) == 4 * units, "two 64-wide steps of four k16 wgmmas a 64-row block"
        # each unit's wgmmas stay in flight while the next decodes; none across the back edge
        assert [t.split()[-1] for t in fast if "DEPBAR" in t] == ["0x1"] * (units - 1) + ["0x0"]
        per_element = len(fast) / (8 * len(gmmas))
        assert per_element <= STAGED_BUDGETS[fmt, tokens_per_slot, consumer_rows], \
            f"{len(fast)} instructions for {8 * len(gmmas)} elements"
    assert wgmma_overlaps(sass), "every wgmma is serialized"
    # (64-token tiles: up to two setup values stored before the partitions start, loaded once by
    # each; none in a K loop)
    allowed = 0 if cfg.token_tile < 64 else 16
    assert ops["LDL"] + ops["STL"] <= allowed, f"register spills: LDL={ops['LDL']} STL={ops['STL']}"
    assert compiled.metadata.shared <= min(SM90_SMEM_BYTES, cfg.smem_bytes(FORMATS[fmt]))
    # every consumer gets the config's registers, the producer what they leave
    consumers = 256 // consumer_rows
    assert {cfg.consumer_regs, {2: 504, 4: 480}[consumers] - consumers * cfg.consumer_regs} <= \
        setmaxnreg_values(compiled)


def test_staged_scales_config_rules():
    import dataclasses

    from moegemm.config import sm90_mx_config
    from moegemm.sm90_configs import DecodeConfig

    # the prepacked defaults at few tokens stage the scales (64-row consumers)
    assert all(sm90_mx_config(FORMATS[fmt], 5760, 2880, tps, prepacked=True).staged_scales
               for fmt in ("bf16_mxfp4", "nvfp4", "mxfp4") for tps in (2, 16, 40))
    staged = staged_config("bf16_mxfp4", 16)
    assert staged.smem_bytes(FORMATS["bf16_mxfp4"]) > dataclasses.replace(staged, staged_scales=False).smem_bytes(
        FORMATS["bf16_mxfp4"])  # (a byte a K block of each weight row, a stage)
    fields = dict(token_tile=16, stages=2, group_m=1, consumer_regs=112, sub_steps=2, prepacked=True,
                  weight_tile=256, staged_scales=True)
    DecodeConfig(**fields).check(FORMATS["bf16_mxfp4"])
    DecodeConfig(**fields | dict(consumer_rows=128, consumer_regs=232)).check(FORMATS["bf16_mxfp4"])
    for bad in (dict(prepacked=False, weight_tile=128, consumer_regs=192), dict(weight_tile=128, consumer_regs=192),
                dict(sub_steps=4), dict(consumer_rows=128), dict(consumer_rows=128, consumer_regs=232, token_tile=128),
                dict(consumer_rows=128, consumer_regs=232, staged_scales=False), dict(consumer_rows=96)):
        with pytest.raises(ValueError, match="staged_scales|consumer_rows|up to 64 tokens"):
            DecodeConfig(**fields | bad).check(FORMATS["bf16_mxfp4"])
    # where the scales cannot be staged, the launcher steps back to four 64-row consumers
    wide = staged_config("bf16_mxfp4", 16, consumer_rows=128)
    back = wide.step_ahead(FORMATS["bf16_mxfp4"])
    assert (back.staged_scales, back.consumer_rows, back.consumer_regs) == (False, 64, 112)
    back.check(FORMATS["bf16_mxfp4"])


def test_loop_paths_take_the_short_and_long_branch():
    # A loop whose body branches over a slow block: the fast path skips it, the slow path runs
    # it; the branch out of the loop (an mbarrier wait's retry) counts as not taken.
    body = ("/*0010*/ SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [R1], R2 ;\n"
            "/*0020*/ @!P1 BRA 0x0900 ;\n"
            "/*0030*/ @!P2 BRA 0x0070 ;\n"
            "/*0040*/ HMUL2 R3, R3, R4 ;\n"
            "/*0050*/ HMUL2 R5, R5, R4 ;\n"
            "/*0060*/ BRA 0x0080 ;\n"
            "/*0070*/ HMUL2 R3, R3, R6 ;\n"
            "/*0080*/ HGMMA.64x32x16.F32.BF16 R24, R3, gdesc[UR4], R24, gsb0 ;\n"
            "/*0090*/ @P0 BRA 0x0010 ;\n"
            "/*0900*/ BRA 0x0010 ;\n")
    loops = offline.innermost_loops(body)
    assert len(loops) == 1 and [a for a, _ in loops[0]] == list(range(0x10, 0xa0, 0x10))
    fast, slow = offline.loop_paths(loops[0])
    assert len(fast) == 6 and "HMUL2 R3, R3, R6" in fast and "HMUL2 R5, R5, R4" not in fast
    assert len(slow) == 8 and "HMUL2 R5, R5, R4" in slow and "HMUL2 R3, R3, R6" not in slow


def test_folded_e8m0_scales_are_two_to_the_code_less_one():
    # decode._FOLDED_E8M0_PTX (PRMT of two code bytes into the halves, then t * 128 + c): bf16
    # 2^(b-1) in each half, i.e. the e8m0 scale 2^(b-127) times the 2^126 that the biased e2m1
    # decoding leaves out, for every code the staged loop takes this way (0..127).
    import struct

    from moegemm.kernels.sm90.decode import _FOLDED_E8M0_PTX

    def bf16(bits):
        return struct.unpack("<f", struct.pack("<I", bits << 16))[0]

    for h, ptx in enumerate(_FOLDED_E8M0_PTX.value):
        selector = int(re.search(r"prmt\.b32 t, \$1, 0, (0x[0-9a-f]+);", ptx).group(1), 16)
        scale, add = (int(v, 0) for v in re.search(r"mad\.lo\.u32 \$0, t, (\w+), (\w+);", ptx).groups())
        for b0, b1 in ((0, 127), (1, 126), (126, 1), (127, 0), (64, 96)):
            word = (b0 << 16 * h) | (b1 << 8 + 16 * h) | (0xFF << 16 * (1 - h)) | (0xEE << 8 + 16 * (1 - h))
            source = word.to_bytes(4, "little") + bytes(4)  # (prmt's second operand: 0)
            t = int.from_bytes(bytes(source[(selector >> 4 * i) & 7] for i in range(4)), "little")
            out = (t * scale + add) & 0xFFFFFFFF
            assert (bf16(out & 0xFFFF), bf16(out >> 16)) == (2.0 ** (b0 - 1), 2.0 ** (b1 - 1))


@pytest.mark.parametrize("consumer_rows", [64, 128])
@pytest.mark.parametrize("fmt,epilogue", [("bf16_mxfp4", (2, 0, False, True, 32, False)),
                                          ("nvfp4", (1, 4, True, False, 16, False))])
def test_staged_scales_fused_epilogue_compiles_for_sm90(fmt, epilogue, consumer_rows):
    """The fused SwiGLU epilogue on staged-scale tiles (a 128-row consumer stores its two 64-row
    blocks one after the other): it fits shared memory, no spill in a K loop, wgmmas in flight."""
    from moegemm.config import override_config
    from moegemm.sm90_configs import SM90_SMEM_BYTES

    with override_config(staged_config(fmt, 16, consumer_rows=consumer_rows)):
        compiled = mx_kernel_compiled(fmt, 16, "swizzled", epilogue, prepacked=True)
    sass = wgmma_sass(compiled)
    assert wgmma_overlaps(sass)
    for body in offline.innermost_loops(sass):
        assert not [t for _, t in body if re.search(r"\b(LDG|LDL|STL)\b", t)], "a global load or a spill in a K loop"
    assert compiled.metadata.shared <= SM90_SMEM_BYTES


@pytest.mark.parametrize("fmt,tokens_per_slot,consumer_rows", [("bf16_mxfp4", 32, 128), ("nvfp4", 16, 64)])
def test_staged_scales_unscaled_specialization_reads_no_accumulator_in_flight(fmt, tokens_per_slot, consumer_rows):
    # (the specialization without expert and row scales, where ptxas once moved the decoding
    # kernel's epilogue reads above its last wait: test_unscaled_specialization_...)
    from moegemm.config import override_config

    with override_config(staged_config(fmt, tokens_per_slot, consumer_rows=consumer_rows)):
        wgmma_sass(mx_kernel_compiled(fmt, tokens_per_slot, "swizzled", with_scales=False, prepacked=True))


# ptxas's infos that it serialized every wgmma of the kernel (and why).
SERIALIZED_WGMMA = ("C7510", "C7511", "C7512", "C7513", "C7514", "C7515")


# A wgmma whose accumulator a mov redefines before its wait: ptxas serializes the wgmmas.
SERIALIZING_PTX = """.version 8.4
.target sm_90a
.address_size 64
.visible .entry serialized(.param .u64 out)
{
.reg .f32 %f<4>;
.reg .b64 %rd<2>;
ld.param.u64 %rd0, [out];
mov.f32 %f0, 0f00000000;
mov.f32 %f1, 0f00000000;
mov.f32 %f2, 0f00000000;
mov.f32 %f3, 0f00000000;
wgmma.fence.sync.aligned;
wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%f0, %f1, %f2, %f3}, %rd0, %rd0, 1, 1, 1, 0, 0;
REDEFINE
wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%f0, %f1, %f2, %f3}, %rd0, %rd0, 1, 1, 1, 0, 0;
wgmma.commit_group.sync.aligned;
wgmma.wait_group.sync.aligned 0;
st.global.v4.f32 [%rd0], {%f0, %f1, %f2, %f3};
ret;
}
"""


def test_ptxas_infos_report_serialized_wgmma():
    # The check itself: the mov between the two wgmmas makes ptxas serialize them, and says so.
    class Compiled:
        def __init__(self, ptx):
            self.asm = {"ptx": ptx}

    serialized = offline.ptxas_infos(Compiled(SERIALIZING_PTX.replace("REDEFINE", "mov.f32 %f0, 0f3F800000;")))
    assert [code for code, _ in serialized if code in SERIALIZED_WGMMA], serialized
    assert not offline.ptxas_infos(Compiled(SERIALIZING_PTX.replace("REDEFINE", "")))


# The variants of a fresh output (no out given) of the kernels with no token pre-pass: the dense
# kernel's tile arrangements (swapped at decode, split-n at 128 tokens a slot, normal, fp8_block's
# staged scales at 8192) and the decoding kernel's (plain and prepacked 256-row tiles, 64-row consumers).
FILL_CASES = [("sm90", "bf16", 1, False), ("sm90", "bf16", 40, False), ("sm90", "bf16", 128, False),
              ("sm90", "bf16", 8192, False),
              ("sm90", "fp8_block", 1, False), ("sm90", "fp8_block", 8192, False),
              ("mx", "bf16_mxfp4", 1, False), ("mx", "bf16_mxfp4", 16, True), ("mx", "bf16_nvfp4", 16, True),
              ("mx", "bf16_mxfp8", 16, False)]


@pytest.mark.parametrize("family,fmt,tokens_per_slot,prepacked", FILL_CASES)
def test_fresh_output_fill_variants_compile_for_sm90(family, fmt, tokens_per_slot, prepacked):
    """FILL (kernels/sm90/free_rows.py): the kernel zeroes a fresh output's rows no valid slot owns
    after its tiles. The variant stores zeros (STG) beside the plain variant's stores, spills
    nothing, touches no register of an in-flight wgmma, and grows no K loop by more than 2
    instructions (ptxas orders a loop's instructions differently with the values the fill holds
    through it: the loops keep their length, lose one, or gain 2 of ~100-330)."""
    if family == "sm90":
        from moegemm.config import sm90_config

        cfg = sm90_config(FORMATS[fmt], 4096, 7168, tokens_per_slot, 2)

        def compiled(fill):
            return sm90_kernel_compiled(fmt, cfg, fill=fill)
    else:
        def compiled(fill):
            return mx_kernel_compiled(fmt, tokens_per_slot, "swizzled", prepacked=prepacked, fill=fill)
    plain, filling = wgmma_sass(compiled(False)), wgmma_sass(compiled(True))
    ops = offline.opcode_counts(filling)
    assert ops["LDL"] + ops["STL"] == offline.opcode_counts(plain)["LDL"] + offline.opcode_counts(plain)["STL"] == 0
    assert sum(n for op, n in ops.items() if op.startswith("STG")) > sum(
        n for op, n in offline.opcode_counts(plain).items() if op.startswith("STG")), "no zero stores"

    lengths, plain_lengths = [len(loop) for loop in innermost_mma_loops(filling)], [
        len(loop) for loop in innermost_mma_loops(plain)]
    assert len(lengths) == len(plain_lengths) and all(a <= b + 2 for a, b in zip(lengths, plain_lengths,
                                                                                   strict=True)), (
        f"K loops of {lengths} instructions with the fill, {plain_lengths} without")


def test_promotion_ceiling_variants_compile_for_sm90():
    """bench/promotion_ceiling.py's variants of the fp8_block kernel (no scale work; no promotion;
    the promotion overlapping the next block's wgmma on 128-wide tiles) build from dense.py's
    source and compile at the prefill config: no spills, no serialized wgmma, and the ceilings'
    K loops no longer than the kernel's (the script then times them on a GPU)."""
    bench = str(Path(__file__).resolve().parents[1] / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    import promotion_ceiling

    report = promotion_ceiling.sass_report()
    rows = {(r["variant"], "block_n=128" in r["config"]): r for r in report}
    assert set(rows) == {("as run", False), ("unscaled", False), ("chained", False), ("as run", True),
                         ("overlapped", True)}
    for r in report:
        assert r["spills"] == 0 and not r["serialized"], r
    as_run = rows["as run", False]["loop_instructions"]
    assert all(u <= a for u, a in zip(rows["unscaled", False]["loop_instructions"], as_run, strict=True))
    assert all(c < a for c, a in zip(rows["chained", False]["loop_instructions"], as_run, strict=True))
