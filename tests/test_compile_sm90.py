"""The portable kernel compiles for sm_90 on a CPU-only machine: wgmma (HGMMA) in the SASS,
no register spills, every format and layout. Catches API and resource errors before any
GPU time is spent."""

import pytest
import torch

from moegemm.config import portable_config
from moegemm.formats import FORMATS
from moegemm.kernels import offline, portable
from moegemm.validation import GroupedProblem

from cases import FORMAT_LAYOUTS

POINTERS = {"a_offsets_ptr": "*i32", "expert_ids_ptr": "*i32", "a_scale_offsets_ptr": "*i32",
            "expert_scales_ptr": "*fp32", "row_scales_ptr": "*fp32"}


@pytest.mark.parametrize("fmt,layout", FORMAT_LAYOUTS)
def test_portable_kernel_compiles_for_sm90(fmt, layout):
    f = FORMATS[fmt]
    n, k = 4096, 7168
    problem = GroupedProblem(f, m=8192, n=n, k=k, num_experts=8, num_groups=8, scale_layout=layout,
                             out_dtype=torch.bfloat16)
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
                                           else "*bf16" if name == "out_ptr" else "*u8")
            if name in ("a_scale_ptr", "b_scale_ptr") and fmt == "fp8_block":
                signature[name] = "*fp32"
        else:
            signature[name] = "i32"
    compiled = offline.compile_for_sm90(kernel, signature, constexprs,
                                        {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
    ops = offline.opcode_counts(offline.sass(compiled))
    assert ops["HGMMA"] > 0, f"no wgmma in the SASS: {ops.most_common(12)}"
    assert ops["LDL"] == 0 and ops["STL"] == 0, f"register spills: LDL={ops['LDL']} STL={ops['STL']}"
