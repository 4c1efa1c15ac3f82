"""Where an eager decode step's time goes inside transformers' generate(), per experts backend.

    python bench/generate_profile.py --out DIR [--models M,...] [--layers 4] [--batch 1] [--tokens 16]

For each model of bench/hf_generate.py (random init, --layers deep) and each backend (transformers'
grouped_mm, moegemm in each format) at --batch: the wall time a generated token takes (median of
3 greedy generate() calls of --tokens tokens), the host synchronizations torch reports during one
call (torch.cuda.set_sync_debug_mode, with the Python stack of each), the profiler's table of the
CPU time by op and by CUDA runtime call for one call, and the experts modules' own wall time a
call (forward hooks, synchronized). Writes DIR/generate-profile-<GPU>.txt.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moegemm  # noqa: E402
from hf_generate import _configs, _generate  # noqa: E402


def _per_token_ms(model, prompt, tokens: int) -> float:
    _generate(model, prompt, tokens, False)
    times = []
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        _generate(model, prompt, tokens, False)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3 / tokens)
    return statistics.median(times)


def _syncs(model, prompt, tokens: int) -> list[str]:
    """The host synchronizations of one generate() call, each with the frames of ours and transformers'."""
    found = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            original = warnings.showwarning

            def remember(message, category, filename, lineno, file=None, line=None):
                stack = [f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
                         for f in traceback.extract_stack()[:-1]
                         if "moegemm" in f.filename or "transformers" in f.filename]
                found.append(f"{message} <- " + " <- ".join(reversed(stack[-6:])))

            warnings.showwarning = remember
            _generate(model, prompt, tokens, False)
            warnings.showwarning = original
            for w in caught:
                remember(w.message, w.category, w.filename, w.lineno)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    counts: dict[str, int] = {}
    for line in found:
        counts[line] = counts.get(line, 0) + 1
    return [f"{n:5d} x {line}" for line, n in sorted(counts.items(), key=lambda kv: -kv[1])]


def _profile_table(model, prompt, tokens: int) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _generate(model, prompt, tokens, False)
        torch.cuda.synchronize()
    averages = prof.key_averages()
    return (averages.table(sort_by="self_cpu_time_total", row_limit=40)
            + "\n" + averages.table(sort_by="cuda_time_total", row_limit=25))


def _experts_time(model, prompt, tokens: int) -> str:
    """The experts modules' synchronized wall time a call, and their calls a token."""
    modules = moegemm.hf.experts_modules(model)
    spent = []

    def pre(module, args):
        torch.cuda.synchronize()
        module._started = time.perf_counter()

    def post(module, args, out):
        torch.cuda.synchronize()
        spent.append((time.perf_counter() - module._started) * 1e6)

    hooks = [m.register_forward_pre_hook(pre) for m in modules] + [m.register_forward_hook(post) for m in modules]
    try:
        _generate(model, prompt, tokens, False)
    finally:
        for h in hooks:
            h.remove()
    decode = sorted(spent[len(modules):])  # (the prompt's calls first)
    if not decode:
        return "no calls"
    return (f"{len(spent)} calls; decode calls: median {statistics.median(decode):.1f} us, "
            f"p10 {decode[len(decode) // 10]:.1f}, p90 {decode[9 * len(decode) // 10]:.1f}, max {decode[-1]:.1f}")


def main(argv=None) -> int:
    import transformers

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("gpu-out"))
    parser.add_argument("--models", default="gpt-oss-20b,Qwen3-30B-A3B")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    lines = [f"# python bench/generate_profile.py --models {args.models} --layers {args.layers} --batch {args.batch} "
             f"--tokens {args.tokens}; {torch.cuda.get_device_name()}, torch {torch.__version__}, "
             f"transformers {transformers.__version__}, commit {moegemm.benchmark.provenance('')['commit']}"]
    configs = _configs(False)
    for name in args.models.split(","):
        builder, formats = configs[name]
        config = builder(args.layers)
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
        prompt = torch.randint(0, config.vocab_size, (args.batch, 16), device=device)
        for impl, fmt in [("grouped_mm", None), ("batched_mm", None)] + [("moegemm", f) for f in formats]:
            label = impl if fmt is None else f"moegemm:{fmt}"
            try:
                if fmt is not None:
                    moegemm.hf.register(fmt=fmt)
                    model.set_experts_implementation("moegemm")
                    moegemm.hf.prepare(model)
                else:
                    model.set_experts_implementation(impl)
                ms = _per_token_ms(model, prompt, args.tokens)
                lines.append(f"\n## {name} x{args.layers} layers, {label}, batch {args.batch}: {ms:.2f} ms a token")
                lines.append("experts modules: " + _experts_time(model, prompt, args.tokens))
                lines.append("host synchronizations in one generate():")
                lines.extend(_syncs(model, prompt, args.tokens)[:30] or ["  none"])
                lines.append(_profile_table(model, prompt, args.tokens))
            except Exception:  # noqa: BLE001  (recorded, the run goes on)
                lines.append(f"\n## {name} {label}: FAILED\n{traceback.format_exc()}")
            finally:
                if fmt is not None:
                    moegemm.hf.refresh(model)
                    moegemm.hf.register()
            print(lines[-1][:2000] if "FAILED" in lines[-1] else f"{name} {label} done", flush=True)
        del model
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"generate-profile-{torch.cuda.get_device_name().replace(' ', '-')}.txt"
    path.write_text("\n".join(lines) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
