"""The MoE layer under different kernel configs, timed together (one run on one GPU).

    python3 bench/layer_ab.py OUT.json PLAN     PLAN: claims | walk | short-tails | scatter | fused-form

For the plan's rows (bench/moe_layer.py's models, inputs and calls), the layer is captured once
per variant, every sm90 config function's answer changed by the variant, and the graphs and the
baseline's are timed in shuffled turns by moe_layer.Timer, twice.
- claims: claim_rounds 0 (round-robin throughout), 2 (the default) and 1 (kernels/sm90.py,
  schedule; fp8_block keeps 0); DeepSeek-V3 MXFP8 and gpt-oss-120b BF16 at 4096 tokens.
- walk: the narrow mxfp8 tiles' slot walk from chunks of slots or three loads a slot
  (config.Sm90Config.chunk_walk); DeepSeek-V3 MXFP8 at 512 tokens (32-token tiles).
- short-tails: the wide mxfp8 tiles' tails of up to 16 tokens on a 16-wide accumulator, or all
  on the 32-wide one (config.Sm90Config.short_tails); DeepSeek-V3 MXFP8 at 4096 tokens.
- scatter: the tokens quantized once each and stored to their k rows (activation.scatter_quantize),
  or gathered k times each (gather_quantize through the inverse of the plan's grouped_row, one
  small index scatter more than the layer ran before); the formats without a kernel token form,
  DeepSeek-V3 FP8 block and gpt-oss-120b BF16 at 4096 tokens.
- fused-form: the fused epilogue writes the down product's bf16 token form (the decoded values),
  or its operand, which the down product's pre-pass decodes (dequantize_rows); gpt-oss-120b
  MXFP4 at 4096 tokens.
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
import moegemm.activation as A  # noqa: E402
import moegemm.config as C  # noqa: E402
import moegemm.kernels.sm90_epilogue as E  # noqa: E402

def _claims(rounds):
    return lambda fmt_name, cfg: replace(cfg, claim_rounds=0 if fmt_name == "fp8_block" else rounds)


def _walk(chunks):
    return lambda fmt_name, cfg: replace(cfg, chunk_walk=chunks) if cfg.fp8_mma and not cfg.wide_promotion else cfg


def _short_tails(short):
    return lambda fmt_name, cfg: replace(cfg, short_tails=short) if cfg.tail_tokens == 32 else cfg


def _gathered(x, fmt, grouped_row, row_slot, **kwargs):
    """scatter_quantize's result by the gather (the layer's token step before the scatter form)."""
    return A.gather_quantize(x, fmt, A.token_of_row(grouped_row), **kwargs)


class Patch:
    """A variant that replaces module.name while captured (replacement None: keep it)."""

    def __init__(self, module, name, replacement=None):
        self.module, self.name, self.replacement = module, name, replacement

    def __call__(self, fmt_name, cfg):
        return cfg


def _operand_out(launch_fused):
    """launch_fused without out_form: the fused epilogue's operand, which the down product
    decodes in its own pre-pass (the layer before the fused bf16 token form)."""
    return lambda *args, out_form=None, **kwargs: launch_fused(*args, **kwargs)


# plan: (tokens, rows (model index in moe_layer.MODELS, model, fmt), {variant: change(fmt name, config)})
PLANS = {
    "claims": (4096, ((0, "DeepSeek-V3", "mxfp8"), (1, "gpt-oss-120b", "bf16")),
               {f"claim-{r}": _claims(r) for r in (0, 2, 1)}),
    "walk": (512, ((0, "DeepSeek-V3", "mxfp8"), ), {"walk-chunks": _walk(True), "walk-slots": _walk(False)}),
    "short-tails": (4096, ((0, "DeepSeek-V3", "mxfp8"), ), {"short-tails": _short_tails(True),
                                                           "tails-32": _short_tails(False)}),
    "scatter": (4096, ((0, "DeepSeek-V3", "fp8_block"), (1, "gpt-oss-120b", "bf16")),
                {"scatter": Patch(A, "scatter_quantize"), "gather": Patch(A, "scatter_quantize", _gathered)}),
    "fused-form": (4096, ((1, "gpt-oss-120b", "mxfp4"), ),
                   {"bf16-form": Patch(E, "launch_fused"),
                    "operand": Patch(E, "launch_fused", _operand_out(E.launch_fused))}),
}


def captured_with(timer, change, call):
    """call captured with every sm90 config function's answer changed by change(fmt name, config)."""
    mx_config, config = C._sm90_mx_config, C._sm90_config
    C._sm90_mx_config = lambda *a: change(a[0], mx_config(*a))
    C._sm90_config = lambda *a: change(a[0], config(*a))
    patched = isinstance(change, Patch) and change.replacement is not None
    if patched:
        original = getattr(change.module, change.name)
        setattr(change.module, change.name, change.replacement)
    try:
        call()  # compile outside the capture
        return timer.prepare(call)
    finally:
        C._sm90_mx_config, C._sm90_config = mx_config, config
        if patched:
            setattr(change.module, change.name, original)


def main():
    tokens, rows, variants = PLANS[sys.argv[2]]
    device = torch.device("cuda")
    timer = L.Timer(device)
    results = {}
    for m_index, model, fmt in rows:
        cfg = L.MODELS[model]
        weights = L.build_weights(cfg, m_index, device)
        x, ids, topk_weights = L.routing_inputs(cfg, tokens, tokens * 7919 + m_index, device)
        call = L.layer_call(cfg, x, ids, topk_weights, weights, fmt, fused=True)
        timed = {name: captured_with(timer, change, call) for name, change in variants.items()}
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
    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, tokens=tokens, plan=sys.argv[2])
    Path(sys.argv[1]).write_text(json.dumps(dict(env=env, results=results), indent=1))


if __name__ == "__main__":
    main()
