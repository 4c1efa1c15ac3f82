"""The MoE layer under different tile schedules, timed together (one run on one GPU).

    python3 bench/layer_claims_ab.py OUT.json

For DeepSeek-V3 MXFP8 and gpt-oss-120b BF16 at 4096 tokens (bench/moe_layer.py's rows and
inputs), the layer is captured once with every kernel config's claim_rounds set to 0 (round-robin
throughout), 2 (the default) and 1 (kernels/sm90.py, schedule; fp8_block keeps 0), and the three
graphs and the baseline's are timed in shuffled turns by moe_layer.Timer, twice.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moe_layer as L  # noqa: E402
import moegemm.config as C  # noqa: E402

ROWS = ((0, "DeepSeek-V3", "mxfp8"), (1, "gpt-oss-120b", "bf16"))  # (model index in moe_layer.MODELS, model, fmt)
CLAIM_ROUNDS = (0, 2, 1)
TOKENS = 4096


def captured_with_claim_rounds(timer, rounds, call):
    """call captured with every sm90 config function's answer given claim_rounds = rounds."""
    mx_config, config = C._sm90_mx_config, C._sm90_config
    C._sm90_mx_config = lambda *a: replace(mx_config(*a), claim_rounds=rounds)
    C._sm90_config = lambda *a: replace(config(*a), claim_rounds=0 if a[0] == "fp8_block" else rounds)
    try:
        call()  # compile outside the capture
        return timer.prepare(call)
    finally:
        C._sm90_mx_config, C._sm90_config = mx_config, config


def main():
    device = torch.device("cuda")
    timer = L.Timer(device)
    results = {}
    for m_index, model, fmt in ROWS:
        cfg = L.MODELS[model]
        weights = L.build_weights(cfg, m_index, device)
        x, ids, topk_weights = L.routing_inputs(cfg, TOKENS, TOKENS * 7919 + m_index, device)
        call = L.layer_call(cfg, x, ids, topk_weights, weights, fmt, fused=True)
        timed = {f"claim-{r}": captured_with_claim_rounds(timer, r, call) for r in CLAIM_ROUNDS}
        base = L.baseline_for(weights, fmt, cfg, "fp8_rowwise" if weights.rowwise() is not None else "bf16")
        base_call = lambda: base(x, ids, topk_weights)  # noqa: E731
        base_call()
        timed["baseline"] = timer.prepare(base_call)
        runs = {}
        for run in range(2):
            runs[run] = {name: ms * 1e3 for name, (ms, _, _) in timer.in_turns(timed).items()}
            print(model, fmt, {k: round(v, 1) for k, v in runs[run].items()},
                  {k: round(runs[run]["baseline"] / v, 3) for k, v in runs[run].items()}, flush=True)
        results[f"{model} {fmt}"] = runs
        timed.clear()
        del weights, base
        torch.cuda.empty_cache()
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, tokens=TOKENS)
    Path(sys.argv[1]).write_text(json.dumps(dict(env=env, results=results), indent=1))


if __name__ == "__main__":
    main()
