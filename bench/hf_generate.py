"""transformers models generating with moegemm's experts backend against transformers' own.

    python bench/hf_generate.py --out DIR [--models M,...] [--modes eager,compiled] [--batches 1,32]
                                [--new-tokens 128] [--prefill 2048] [--layers N] [--budget SECONDS]
    python bench/hf_generate.py --cpu-smoke --out DIR       (tiny models on the CPU: the script runs)

--free-source: the formats that copy the weights (every one but bf16) run last and free the bf16
experts as they convert them (moegemm.hf.register(free_source=True)), so that a model and its
quantized copy need not fit at once; their error is then not checked (transformers' experts are
gone).

Random-init models at their real per-layer dimensions (bf16, transformers' own initialization):

    gpt-oss-20b      24 layers, H 2880, 32 experts of I 2880, top-4      moegemm: bf16, bf16_mxfp4
    Qwen3-30B-A3B    48 layers, H 2048, 128 experts of I 768, top-8      moegemm: bf16, fp8_block
    DeepSeek-V3      H 7168, 256 experts of I 2048, top-8, MLA; 2 layers  moegemm: fp8_block
                     (--layers overrides every model's depth)

Each model runs with experts_implementation "grouped_mm" and "batched_mm" (transformers'),
then "moegemm" bf16 (the weights read in place), then "no_experts": experts that compute nothing
(a zero fill), the time of everything else in the model, and last "moegemm" in each format that
quantizes the weights once (moegemm.hf.register(fmt=...)), all on the same weights in one
process. best backend's time / no_experts' time is the most any experts backend can gain (the
ceiling):

    prefill    one forward of 1 x --prefill tokens, no cache: ms (the first token's latency of a
               prompt that long) and tokens/s; batched_mm is not run here (it gathers a weight
               matrix a token: tens of GB at 2048 tokens)
    decode     greedy generate() of --new-tokens tokens (min = max, no sampling) from a 16-token
               prompt at each batch size: tokens/s (batch * new tokens / the call's time) and the
               first token's latency (generate() of one token)
    compiled   the same with a static cache, which generate() compiles (torch.compile,
               "reduce-overhead"): the first call compiles and is not timed

Times are medians of --reps calls after one warm-up call (CUDA-synchronized wall time: what a
transformers user waits). Every moegemm row also checks its experts against transformers': the
first experts module's call in a prefill, recomputed by the "grouped_mm" experts on the same
inputs; bf16 rows must agree to 2e-2 (relative Frobenius norm), quantized rows record their error
(the format's quantization of these random weights). A row that fails its check or raises is
marked and the exit status is 2. Rows not started by --budget seconds are skipped.

Writes DIR/hf-generate-<GPU>.json: the rows, the environment, this script and the commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import moegemm  # noqa: E402
from moegemm.benchmark import provenance  # noqa: E402

BASELINES = ("grouped_mm", "batched_mm")
# An experts implementation that computes nothing (one zero fill): generate() with it takes the
# time of everything but the experts, so best / its time bounds what any backend can gain.
CEILING = "no_experts"
BF16_TOL = 2e-2


def _configs(cpu: bool) -> dict:
    """name -> (config builder, moegemm formats). Builders take the depth (None: the model's)."""
    import transformers

    if cpu:
        return {
            "tiny-gpt-oss": (lambda n: transformers.GptOssConfig(
                vocab_size=256, hidden_size=64, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2,
                num_hidden_layers=n or 2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                layer_types=["full_attention"] * (n or 2)), ("bf16", "bf16_mxfp4")),
            "tiny-qwen3-moe": (lambda n: transformers.Qwen3MoeConfig(
                vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                num_experts_per_tok=2, num_hidden_layers=n or 2, num_attention_heads=4, num_key_value_heads=2,
                head_dim=16), ("bf16", "fp8_block")),
        }
    return {
        "gpt-oss-20b": (lambda n: transformers.GptOssConfig(
            vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4,
            num_hidden_layers=n or 24, num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128,
            layer_types=(["sliding_attention", "full_attention"] * ((n or 24) // 2)
                         + ["sliding_attention"] * ((n or 24) % 2))),
            ("bf16", "bf16_mxfp4")),
        "Qwen3-30B-A3B": (lambda n: transformers.Qwen3MoeConfig(
            vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
            num_experts_per_tok=8, num_hidden_layers=n or 48, num_attention_heads=32, num_key_value_heads=4,
            head_dim=128, norm_topk_prob=True), ("bf16", "fp8_block")),
        "DeepSeek-V3": (lambda n: transformers.DeepseekV3Config(
            vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
            n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
            routed_scaling_factor=2.5, num_hidden_layers=n or 2, first_k_dense_replace=0, num_attention_heads=128,
            num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
            v_head_dim=128), ("fp8_block",)),
    }


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device, reps: int) -> float:
    """Median wall time of fn in ms, after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _check(model, ids) -> float:
    """The first experts module's call in a forward under "moegemm" against the "grouped_mm"
    experts on the same inputs (relative Frobenius error)."""
    module = moegemm.hf.experts_modules(model)[0]
    seen = []
    hook = module.register_forward_hook(lambda mod, args, out: seen.append((args, out)))
    try:
        with torch.no_grad():
            model(ids, use_cache=False)
    finally:
        hook.remove()
    (inputs, got), = seen[:1]
    module.config._experts_implementation = "grouped_mm"
    try:
        with torch.no_grad():
            want = module(*inputs)
    finally:
        module.config._experts_implementation = "moegemm"
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def _generate(model, prompt, new_tokens: int, static: bool):
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
    with torch.no_grad():
        return model.generate(prompt, **kwargs)


def _register_ceiling():
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(CEILING, lambda self, hidden_states, top_k_index, top_k_weights:
                              torch.zeros_like(hidden_states))


def run_model(name, config, formats, args, device, deadline, log) -> list[dict]:
    import transformers

    rows = []
    torch.manual_seed(0)
    start = time.perf_counter()
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    log(f"{name}: built ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, "
        f"{time.perf_counter() - start:.1f} s)")
    prefill_ids = torch.randint(0, config.vocab_size, (1, args.prefill), device=device)
    # The formats that copy the weights run last, after the ceiling: with --free-source each frees
    # the bf16 source as it converts a module (a 30B model and its copy exceed an 80 GB GPU), after
    # which nothing else can read the experts.
    copies = [f for f in formats if f != "bf16"]
    impls = ([(b, None) for b in BASELINES] + [("moegemm", f) for f in formats if f == "bf16"] + [(CEILING, None)]
             + [("moegemm", f) for f in copies])
    freed = False
    for impl, fmt in impls:
        label = impl if fmt is None else f"moegemm:{fmt}"
        row = dict(model=name, layers=config.num_hidden_layers, impl=label)
        if time.perf_counter() > deadline or freed:
            rows.append({**row, "notes": "skipped: " + ("--budget" if not freed else "an earlier row freed the source")})
            continue
        free_source = args.free_source and fmt in copies
        try:
            if fmt is not None:
                moegemm.hf.register(fmt=fmt, free_source=free_source)
                model.set_experts_implementation("moegemm")
                moegemm.hf.prepare(model)
                row["check_err"] = None if free_source else round(_check(model, prefill_ids[:, :64]), 5)
                row["free_source"] = free_source
                if fmt == "bf16" and not row["check_err"] < BF16_TOL:
                    row["check"] = f"FAIL: {row['check_err']} >= {BF16_TOL}"
            else:
                model.set_experts_implementation(impl)
            if impl != "batched_mm":
                with torch.no_grad():
                    ms = _timed(lambda m=model: m(prefill_ids, use_cache=False), device, args.reps)
                row.update(prefill_ms=round(ms, 2), prefill_tok_s=round(args.prefill / ms * 1e3, 1))
            for mode in args.modes:
                static = mode == "compiled"
                for batch in args.batches:
                    prompt = torch.randint(0, config.vocab_size, (batch, 16), device=device)
                    ms = _timed(lambda m=model: _generate(m, prompt, args.new_tokens, static), device, args.reps)
                    first = _timed(lambda m=model: _generate(m, prompt, 1, static), device, args.reps)
                    row[f"{mode}_b{batch}_tok_s"] = round(batch * args.new_tokens / ms * 1e3, 1)
                    row[f"{mode}_b{batch}_first_token_ms"] = round(first, 2)
        except Exception as error:  # noqa: BLE001  (recorded, the run goes on)
            row["check"] = f"FAIL: {type(error).__name__}: {str(error)[:300]}"
        finally:
            freed = free_source
            if not freed:
                moegemm.hf.refresh(model)  # (the converted weights of this format freed)
            moegemm.hf.register()
        rows.append(row)
        log(json.dumps(row))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu-out")
    parser.add_argument("--models", default=None, help="comma-separated (default: all)")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--budget", type=float, default=1e9, help="seconds after which no new row starts")
    parser.add_argument("--free-source", action="store_true",
                        help="the formats that copy the weights free the bf16 source (their error is not checked)")
    parser.add_argument("--cpu-smoke", action="store_true")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.batches, args.new_tokens, args.prefill, args.reps = "2", 2, 24, 1
        args.modes = "eager"
    args.modes = [m for m in args.modes.split(",") if m]
    args.batches = [int(b) for b in args.batches.split(",")]
    device = torch.device("cpu" if args.cpu_smoke else "cuda")
    begin = time.perf_counter()
    deadline = begin + args.budget

    def log(message):
        print(f"[{time.perf_counter() - begin:7.1f} s] {message}", flush=True)

    moegemm.hf.register()
    _register_ceiling()
    configs = _configs(args.cpu_smoke)
    names = args.models.split(",") if args.models else list(configs)
    rows = []
    for name in names:
        builder, formats = configs[name]
        rows += run_model(name, builder(args.layers), formats, args, device, deadline, log)
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    import transformers

    env = dict(**provenance("bench/hf_generate.py"), gpu=gpu, torch=torch.__version__,
               transformers=transformers.__version__, args={k: v for k, v in vars(args).items()},
               date=time.strftime("%Y-%m-%d %H:%M:%S"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"hf-generate-{gpu.replace(' ', '-')}.json"
    path.write_text(json.dumps(dict(record=env, rows=rows), indent=1))
    log(f"wrote {path}")
    _print_table(rows)
    return 2 if any(str(r.get("check", "")).startswith("FAIL") for r in rows) else 0


def _print_table(rows):
    keys = [k for k in rows[0] if k.endswith("tok_s") or k.endswith("_ms")] if rows else []
    print("| model | impl | " + " | ".join(keys) + " | check |")
    for r in rows:
        print(f"| {r['model']} | {r['impl']} | " + " | ".join(str(r.get(k, "")) for k in keys)
              + f" | {r.get('check', r.get('check_err', r.get('notes', '')))} |")


if __name__ == "__main__":
    raise SystemExit(main())
