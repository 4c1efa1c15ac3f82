"""How fast the decoding kernel (kernels/sm90/decode.py) could run if decoding the weights cost
nothing: the same kernel with its decode removed, timed beside the real one and the baselines.

The decoding kernel runs nvfp4 and the weight-only formats in every regime, mxfp4 and w4a8 above
12 tokens a slot, and mxfp8 at many tokens a slot. Its "ceiling" variant is decode.py with the line that
decodes a step's weights into the wgmma's operand buffer taken out: the producer,
ring, scales, wgmmas and epilogue stay, the wgmmas read whatever the buffers hold, so its
results are wrong on purpose and not checked. It is built from the source at run time
(nothing of it ships) and swapped into the launcher for its rows.

Rows, on one GPU in one process, kernel time by CUDA-graph replay with L2 flushed (medians):
    torch._grouped_mm on bf16 weights of the same groups, our bf16 kernel, our fp8_block,
    each format as it runs, the decoding kernel on the format's config (forced where the format
    runs another kernel), that config without its decode, and where the config has 256-token
    tiles, the same config with 128-token tiles (and mxfp8's promotion kernel on 128-token tiles).
Prefill (8 x ~4096, 64 x ~128 tokens) and decode (256 x ~16, 32 x ~32) on DeepSeek-V3 and gpt-oss
expert shapes; the decode rows also give the copy bandwidth and each row's bytes.

    python bench/decode_ceiling.py --out bench/results [--regimes prefill,decode] [--formats ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.environ.get("MOEGEMM_TREE") or str(Path(__file__).resolve().parents[1]))

import torch

from moegemm import QuantizedTensor, benchmark, benchmark_inputs, benchmark_rows, grouped_matmul
from moegemm.config import override_config, sm90_mx_config
from moegemm.formats import FORMATS, PREPACK_FORMATS
from moegemm.kernels.sm90 import launcher
from moegemm.prepack import prepack_codes
from moegemm.sm90_configs import MX_FORMATS, DecodeConfig, Mxfp8Config, deepest_ring

sys.path.insert(0, str(Path(__file__).resolve().parent))
from source_variants import module_variant  # (beside this script)

# the model-formats preset's shapes and regimes (moegemm/benchmark_rows.py)
SHAPES = {name: benchmark_rows.MODEL_SHAPES[name] for name in benchmark_rows.MODEL_FORMAT_SHAPES}
REGIMES = {"prefill": tuple(r for r in benchmark_rows.MODEL_FORMAT_REGIMES if r[1] > 32),
           "decode": tuple(r for r in benchmark_rows.MODEL_FORMAT_REGIMES if r[1] <= 32)}
# The plain order: the decode and store of a step's weights into the operand buffer, taken out.
DECODE_LINES = (("    _decode_into(operand, raw, scales, raw_layout, dec_layout, NKB, FP4)\n", ""), )
# Prepacked e2m1 (the register path): the words go to the wgmma as they are (4 moves a word, no
# rotation, mask or multiply), the scales still loaded and handed to an asm that ignores them.
REGISTER_DECODE_LINES = (
    ("e2m1_words_to_pairs(raw, BIASED)", "_e2m1_raw_words(raw)"),
    ("scaled_pairs(gl.convert_layout(pairs, pair_layout), scales)",
     "_unscaled_pairs(gl.convert_layout(pairs, pair_layout), scales)"),
)
REGISTER_STUBS = '''

@gluon.jit
def _e2m1_raw_words(raw):
    return gl.inline_asm_elementwise("mov.b32 $0, $4; mov.b32 $1, $4; mov.b32 $2, $4; mov.b32 $3, $4;",
                                     "=r,=r,=r,=r,r", [raw], dtype=gl.int32, is_pure=True, pack=4)


@gluon.jit
def _unscaled_pairs(pairs, scales):
    scales, pairs = gl.broadcast(scales, pairs)
    return gl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r,h", [pairs, scales], dtype=gl.int32, is_pure=False,
                                     pack=1)
'''


def ceiling_kernel(lines=DECODE_LINES, stubs: str = "", name: str = "_decode_ceiling"):
    """decode.py's kernel with `lines` replaced (module docstring): by default without the decode
    and store of the weights in the plain order; REGISTER_DECODE_LINES: without the decode of
    prepacked e2m1 into the wgmma's registers."""
    return module_variant(Path(launcher.__file__).with_name("decode.py"), lines, stubs, name,
                          "moegemm.kernels.sm90").decode_kernel


def prepacked_call(inp: benchmark_inputs.Inputs):
    """inp's call on its weights in the prepacked order (moegemm.prepack_weights): the decoding
    kernel decoding them into its wgmma's registers."""
    weights = QuantizedTensor(prepack_codes(inp.b), inp.b_scales, inp.fmt, "b", inp.scale_layout, prepacked=True)
    return lambda: grouped_matmul(inp.a, weights, inp.a_scales, None, inp.a_offsets, inp.expert_ids, fmt=inp.fmt,
                                  out=inp.out, scale_layout=inp.scale_layout, expert_scales=inp.expert_scales)


def timed(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return benchmark._bench_graph(fn)


def baselines(n: int, k: int, sizes, device) -> dict:
    """Our bf16 and fp8_block kernels and torch._grouped_mm on bf16 weights ("torch") on the
    same groups: ms each."""
    base = {}
    for fmt in ("bf16", "fp8_block"):
        inp = benchmark_inputs.Inputs(fmt, n, k, sizes, device)
        base[fmt] = timed(inp.ours)
        if fmt == "bf16":
            base["torch"] = timed(inp.torch_baseline)
        del inp
        torch.cuda.empty_cache()
    return base


def decoding_config(fmt: str, n: int, k: int, tokens_per_slot: float) -> DecodeConfig:
    """The format's own config where it runs the decoding kernel, else the decoding kernel's
    config of that regime (as bf16_<fmt> would run, or 256-token tiles at prefill)."""
    cfg = sm90_mx_config(FORMATS[fmt], n, k, tokens_per_slot)
    if isinstance(cfg, DecodeConfig):
        return cfg
    weight_only = f"bf16_{fmt}" if f"bf16_{fmt}" in FORMATS else "bf16_mxfp4"
    twin = sm90_mx_config(FORMATS[weight_only], n, k, tokens_per_slot)
    return deepest_ring(twin, FORMATS[fmt])


def run(regimes, fmts, out_dir: Path):
    device = torch.device("cuda")
    ceilings = benchmark.measure_ceilings(device)
    env = {**benchmark.provenance("bench/decode_ceiling.py"), "gpu": torch.cuda.get_device_name(device),
           "torch": torch.__version__, "triton": __import__("triton").__version__,
           **{k: round(v, 3) for k, v in ceilings.items()}}
    print(json.dumps(env), flush=True)
    real_kernel, no_decode = launcher.decode_kernel, ceiling_kernel()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"decode-ceiling-{env['gpu'].replace(' ', '-')}.json"
    rows = []
    for regime in regimes:
        for groups, nominal in REGIMES[regime]:
            for shape, (n, k) in SHAPES.items():
                sizes = benchmark_rows.group_sizes(groups, nominal, seed=groups * 100003 + nominal)
                tokens = sum(sizes)
                flops = 2.0 * tokens * n * k
                base = baselines(n, k, sizes, device)
                for fmt in fmts:
                    inp = benchmark_inputs.Inputs(fmt, n, k, sizes, device)
                    row = {"regime": regime, "shape": shape, "groups": groups, "nominal": nominal, "tokens": tokens,
                           "fmt": fmt, "torch_bf16_ms": base["torch"], "bf16_ms": base["bf16"],
                           "fp8_block_ms": base["fp8_block"], "bytes": inp.bytes_moved()}
                    row["ms"] = timed(inp.ours)
                    row["config"] = str(sm90_mx_config(FORMATS[fmt], n, k, tokens / groups))
                    cfg = decoding_config(fmt, n, k, tokens / groups)
                    row["decoding_config"] = str(cfg)
                    as_run = isinstance(sm90_mx_config(FORMATS[fmt], n, k, tokens / groups), DecodeConfig)
                    if cfg.token_tile == 256:  # the wide tiles against 128-token tiles on the same code
                        narrow = deepest_ring(replace(cfg, token_tile=128), FORMATS[fmt])
                        with override_config(narrow):
                            row["tiles_128_ms"] = timed(inp.ours)
                        if fmt == "mxfp8":  # and against its promotion kernel's 128-token tiles
                            promotion = Mxfp8Config(token_tile=128, stages=2, group_m=4, consumer_regs=232)
                            with override_config(deepest_ring(promotion, FORMATS[fmt])):
                                row["promotion_ms"] = timed(inp.ours)
                    with override_config(cfg):
                        # (the format's own kernel where it runs the decoding kernel: timed once)
                        row["decoding_ms"] = row["ms"] if as_run else timed(inp.ours)
                        inp.ours()
                        decoded = inp.out.clone()
                        launcher.decode_kernel = no_decode
                        try:
                            row["no_decode_ms"] = timed(inp.ours)
                        finally:
                            launcher.decode_kernel = real_kernel
                    keys = ["ms", "decoding_ms", "no_decode_ms"]
                    if fmt in PREPACK_FORMATS:
                        row["prepacked_config"] = str(sm90_mx_config(FORMATS[fmt], n, k, tokens / groups,
                                                                     prepacked=True))
                        # the decoding kernel's tiles: the same products in the same order
                        inp.out.fill_(float("nan"))
                        call = prepacked_call(inp)
                        call()
                        row["prepacked_bits_equal"] = bool(torch.equal(inp.out.view(torch.int16),
                                                                       decoded.view(torch.int16)))
                        row["prepacked_ms"] = timed(call)
                        keys.append("prepacked_ms")
                    for key in keys:
                        name = key.replace("_ms", "") if key != "ms" else "as_run"
                        row[f"{name}_x_torch"] = base["torch"] / row[key]
                        row[f"{name}_x_fp8_block"] = base["fp8_block"] / row[key]
                        row[f"{name}_tflops"] = flops / row[key] / 1e9
                        row[f"{name}_pct_copy"] = 100 * row["bytes"] / row[key] / 1e9 / ceilings["copy_tbps"]
                    rows.append(row)
                    path.write_text(json.dumps({"env": env, "rows": rows}, indent=1))  # (a run cut short keeps its rows)
                    print(f"{regime:7} {shape:11} {groups}x{nominal:<5} {fmt:11} as run {row['ms']:.3f} ms "
                          f"({row['as_run_x_torch']:.2f}x torch, {row['as_run_x_fp8_block']:.2f}x fp8_block) | "
                          f"decoding {row['decoding_ms']:.3f} | prepacked {row.get('prepacked_ms', 0):.3f} "
                          f"({row.get('prepacked_x_torch', 0):.2f}x torch, {row.get('prepacked_x_fp8_block', 0):.2f}x "
                          f"fp8_block, bits {row.get('prepacked_bits_equal')}) | no decode {row['no_decode_ms']:.3f} "
                          f"({row['no_decode_x_torch']:.2f}x torch, {row['no_decode_x_fp8_block']:.2f}x fp8_block, "
                          f"{row['no_decode_pct_copy']:.0f}% copy)", flush=True)
                    del inp
                    torch.cuda.empty_cache()
    print(f"wrote {path}")


# Prepacked register-path configs at few tokens a slot: (weight_tile, sub_steps, consumer_regs,
# staged_scales, consumer_rows): the scales loaded a step ahead, or staged in the ring (e2m1 on
# swizzled scales) with four consumer warpgroups of 64 rows or two of 128.
REGISTER_VARIANTS = {"w128_s2": (128, 2, 192, False, 64), "w256_s2": (256, 2, 112, False, 64),
                     "w256_s4": (256, 4, 112, False, 64), "w256_staged": (256, 2, 112, True, 64),
                     "w256_staged_r128": (256, 2, 232, True, 128)}
# (groups, nominal tokens a group): the decode regimes of the targets, and gpt-oss's own
# (128 experts, ~2 tokens each), where mxfp4 and w4a8 on the plain order run the e2m1 kernel
FP4_REGIMES = ((256, 16), (32, 32), (128, 2))


def _variant_config(fmt: str, token_tile: int, weight_tile: int, sub_steps: int, regs: int, staged: bool = False,
                    consumer_rows: int = 64):
    """The register path's config for a variant, its ring as deep as it fits; None where the
    variant does not apply (a stage over 128 bytes of a weight row, 256-row tiles past 64 tokens,
    staged scales of e4m3 weights)."""
    if staged and not FORMATS[fmt].b.element.packed:
        return None
    cfg = DecodeConfig(token_tile=token_tile, stages=2, group_m=1, consumer_regs=regs, sub_steps=sub_steps,
                       prepacked=True, weight_tile=weight_tile, staged_scales=staged, consumer_rows=consumer_rows)
    try:
        cfg = deepest_ring(cfg, FORMATS[fmt])
        cfg.check(FORMATS[fmt])
    except ValueError:
        return None
    return cfg


def run_few_tokens(fmts, out_dir: Path, variants=(), regimes=FP4_REGIMES):
    """Decode regimes of the prepacked register path: as run, each REGISTER_VARIANTS config with
    and without its decode (REGISTER_DECODE_LINES: the data path alone), fp8_block and torch bf16
    beside them, and triton_kernels' matmul_ogs on bf16_mxfp4 where bench/peer_triton_kernels.py
    finds it; every variant's bits against the default config's. `variants`: only those of
    REGISTER_VARIANTS (all when empty); `regimes`: (groups, nominal tokens) pairs."""
    device = torch.device("cuda")
    ceilings = benchmark.measure_ceilings(device)
    env = {**benchmark.provenance("bench/decode_ceiling.py --few-tokens"),
           "gpu": torch.cuda.get_device_name(device),
           "torch": torch.__version__, "triton": __import__("triton").__version__,
           **{k: round(v, 3) for k, v in ceilings.items()}}
    print(json.dumps(env), flush=True)
    import peer_triton_kernels as peer

    has_peer = peer.available()
    real_kernel = launcher.decode_kernel
    no_decode = ceiling_kernel(REGISTER_DECODE_LINES, REGISTER_STUBS, "_register_ceiling")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"few-tokens-{env['gpu'].replace(' ', '-')}.json"
    rows = []
    for groups, nominal in regimes:
        for shape, (n, k) in SHAPES.items():
            sizes = benchmark_rows.group_sizes(groups, nominal, seed=groups * 100003 + nominal)
            tokens = sum(sizes)
            base = baselines(n, k, sizes, device)
            for fmt in fmts:
                inp = benchmark_inputs.Inputs(fmt, n, k, sizes, device)
                row = {"shape": shape, "groups": groups, "nominal": nominal, "tokens": tokens, "fmt": fmt,
                       "torch_bf16_ms": base["torch"], "bf16_ms": base["bf16"], "fp8_block_ms": base["fp8_block"],
                       "bytes": inp.bytes_moved(), "ms": timed(inp.ours),
                       "config": str(sm90_mx_config(FORMATS[fmt], n, k, tokens / groups))}
                keys = ["ms"]
                if fmt in PREPACK_FORMATS:
                    default = sm90_mx_config(FORMATS[fmt], n, k, tokens / groups, prepacked=True)
                    row["prepacked_config"] = str(default)
                    call = prepacked_call(inp)
                    call()
                    reference = inp.out.clone()
                    row["prepacked_ms"] = timed(call)
                    keys.append("prepacked_ms")
                    for name, variant in REGISTER_VARIANTS.items():
                        if variants and name not in variants:
                            continue
                        cfg = _variant_config(fmt, default.token_tile, *variant)
                        if cfg is None:
                            continue
                        packed = FORMATS[fmt].b.element.packed  # (the stubbed decode is e2m1's)
                        with override_config(cfg):
                            inp.out.fill_(float("nan"))
                            call()
                            row[f"{name}_bits_equal"] = bool(torch.equal(inp.out.view(torch.int16),
                                                                         reference.view(torch.int16)))
                            row[f"{name}_ms"] = timed(call)
                            keys.append(f"{name}_ms")
                            if packed:
                                launcher.decode_kernel = no_decode
                                try:
                                    row[f"{name}_no_decode_ms"] = timed(call)
                                finally:
                                    launcher.decode_kernel = real_kernel
                                keys.append(f"{name}_no_decode_ms")
                if fmt == "bf16_mxfp4" and has_peer:
                    try:
                        peer_call = peer.mxfp4_call(inp)
                        row["peer_error"] = peer.check(inp, peer_call())
                        row["peer_ms"] = timed(peer_call)
                        keys.append("peer_ms")
                    except Exception as error:  # noqa: BLE001 (the peer's failure is recorded, the run goes on)
                        row["peer_failed"] = repr(error)[:300]
                for key in keys:
                    stem = key.replace("_ms", "") if key != "ms" else "as_run"
                    row[f"{stem}_x_fp8_block"] = base["fp8_block"] / row[key]
                    row[f"{stem}_x_torch"] = base["torch"] / row[key]
                    row[f"{stem}_pct_copy"] = 100 * row["bytes"] / row[key] / 1e9 / ceilings["copy_tbps"]
                if "peer_ms" in row:
                    best = min(row[key] for key in keys if key.endswith("_ms") and "no_decode" not in key
                               and key != "peer_ms")
                    row["best_x_peer"] = row["peer_ms"] / best
                rows.append(row)
                path.write_text(json.dumps({"env": env, "rows": rows}, indent=1))
                stems = {key: key.replace("_ms", "") if key != "ms" else "as_run" for key in keys}
                print(f"{groups}x{nominal:<4} {shape:11} {fmt:11} " + " ".join(
                    f"{stems[key]}={row[key]:.3f}({row[stems[key] + '_x_fp8_block']:.2f})" for key in keys)
                    + (f" peer_err={row['peer_error']:.1e}" if "peer_error" in row else ""), flush=True)
                del inp
                torch.cuda.empty_cache()
    print(f"wrote {path}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--regimes", default="prefill,decode")
    parser.add_argument("--formats", default=",".join(MX_FORMATS))
    parser.add_argument("--few-tokens", action="store_true",
                        help="the prepacked register path's configs at few tokens a slot (run_few_tokens)")
    parser.add_argument("--variants", default="", help="--few-tokens: only these REGISTER_VARIANTS (comma-separated)")
    parser.add_argument("--few-regimes", default="",
                        help="--few-tokens: GROUPSxTOKENS pairs, comma-separated (default: 256x16,32x32,128x2)")
    args = parser.parse_args(argv)
    start = time.time()
    fmts = [f for f in args.formats.split(",") if f in FORMATS]
    if args.few_tokens:
        regimes = tuple(tuple(int(v) for v in r.split("x")) for r in args.few_regimes.split(",") if r) or FP4_REGIMES
        run_few_tokens(fmts, Path(args.out), tuple(v for v in args.variants.split(",") if v), regimes)
    else:
        run(args.regimes.split(","), fmts, Path(args.out))
    print(f"# {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
