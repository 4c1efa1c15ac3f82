"""The Hopper (sm_90) kernel family: persistent, warp-specialized Gluon kernels fed by TMA, one
file per kernel on the shared pipeline layer (pipeline.py), one launch entry (launcher.py).

    pipeline.py   ring, tile schedule, producer, plain epilogue stores, scale addressing
    dense.py      bf16 and fp8_block
    decode.py     block formats by decoding the weights to bf16 (nvfp4; mxfp4, w4a8 above 12
                  tokens a slot or prepacked)
    mxfp8.py      mxfp8 by fp8 wgmma and fp32 promotion per 32-wide K block
    e2m1.py       e2m1 weights (mxfp4, w4a8) at decode, plain order: decoded to e4m3, fp8 wgmma, split-K
    promotion.py  the promotion parts mxfp8.py and e2m1.py share
    swiglu.py     the fused SwiGLU epilogue with output requantization
    launcher.py   plan (KernelPlan: a problem's config, grid, token pre-pass, launch key),
                  LaunchArgs, EpilogueSpec, supports, launch: the one launch entry

A new kernel is a new file here built on pipeline.py's Ring, Schedule, walk, Producer and Output;
its config class in moegemm/sm90_configs.py, chosen per shape in moegemm/config.py; and a
_<kernel>_launch function (its launch, made once per plan) with one branch in launcher.plan
(docs/architecture.md, where a new kernel goes).
"""

from .launcher import EpilogueSpec, KernelPlan, LaunchArgs, fused_supports, launch, plan, supports, zeroes_fresh_out
from .swiglu import ACT_SWIGLU, ACT_SWIGLU_OAI, OUT_BF16, OUT_E2M1_E4M3, OUT_E2M1_E8M0, OUT_E4M3_E8M0

__all__ = [
           "ACT_SWIGLU",
           "ACT_SWIGLU_OAI",
           "OUT_BF16",
           "OUT_E2M1_E4M3",
           "OUT_E2M1_E8M0",
           "OUT_E4M3_E8M0",
           "EpilogueSpec",
           "KernelPlan",
           "LaunchArgs",
           "fused_supports",
           "launch",
           "plan",
           "supports",
           "zeroes_fresh_out",
]
