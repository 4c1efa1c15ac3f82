"""bench/ab.py's layer plans (layer-*): the whole MoE layer of bench/layer_models.py captured once
per variant and timed in turns with the PyTorch baseline, twice. A variant changes every sm90
config function's answer (change(fmt name, config) -> config), or replaces one function of the
library while the layer is captured (Patch)."""

from __future__ import annotations

from dataclasses import replace

from ab_common import gpu_env, library_config, library_only


def _claims(rounds):
    return lambda fmt_name, cfg: replace(cfg, claim_rounds=0 if fmt_name == "fp8_block" else rounds)


def _walk(chunks):
    return lambda fmt_name, cfg: (replace(cfg, chunk_walk=chunks) if isinstance(cfg, library_config().Mxfp8Config)
                                  and not cfg.wide else cfg)


def _short_tails(short):
    return lambda fmt_name, cfg: replace(cfg, short_tails=short) if getattr(cfg, "tail_tokens", 0) == 32 else cfg


def _unchanged(fmt_name, cfg):
    return cfg


class Patch:
    """A variant that replaces `name` in `module` while captured (make_replacement(original) ->
    the replacement; None keeps it). Callers must look the name up on the module at call time
    (module.name), as the library's ops do."""

    def __init__(self, module, name, make_replacement=None):
        self.module_name, self.name, self.make_replacement = module, name, make_replacement

    def __call__(self, fmt_name, cfg):
        return cfg

    def module(self):
        import importlib

        module = importlib.import_module(self.module_name)
        if not hasattr(module, self.name):
            raise SystemExit(f"{self.module_name} has no {self.name}")
        return module


def _gathered(original):
    """scatter_quantize's result by the gather (each token read and quantized once per choice)."""
    import moegemm.token_quantizers as tq

    return lambda x, fmt, grouped_row, row_slot, **kwargs: tq.gather_quantize(x, fmt, tq.token_of_row(grouped_row),
                                                                              **kwargs)


def _operand_out(launch_fused):
    """launch_fused without out_form: the fused epilogue's operand, which the down product then
    decodes in its own pre-pass."""
    return lambda *args, out_form=None, **kwargs: launch_fused(*args, **kwargs)


# plan: (description, tokens, rows (index in layer_models.MODELS, model, fmt), {variant: change})
LAYER_PLANS = {
    "layer-claims": ("the layer with claim_rounds 0 (round-robin), 2 (the default) and 1", 4096,
                     ((0, "DeepSeek-V3", "mxfp8"), (1, "gpt-oss-120b", "bf16")),
                     {f"claim-{r}": _claims(r) for r in (0, 2, 1)}),
    "layer-walk": ("the layer with the narrow mxfp8 tiles' slot walk from chunks or by slots", 512,
                   ((0, "DeepSeek-V3", "mxfp8"), ), {"walk-chunks": _walk(True), "walk-slots": _walk(False)}),
    "layer-short-tails": ("the layer with short tails or every tail 32 wide", 4096, ((0, "DeepSeek-V3", "mxfp8"), ),
                          {"short-tails": _short_tails(True), "tails-32": _short_tails(False)}),
    "layer-scatter": ("the layer's token step in scatter form or gathered k times", 4096,
                      ((0, "DeepSeek-V3", "fp8_block"), (1, "gpt-oss-120b", "bf16")),
                      {"scatter": Patch("moegemm.token_quantizers", "scatter_quantize"),
                       "gather": Patch("moegemm.token_quantizers", "scatter_quantize", _gathered)}),
    "layer-fused-form": ("the fused epilogue writing the down product's bf16 token form or its operand", 4096,
                         ((1, "gpt-oss-120b", "mxfp4"), ),
                         {"bf16-form": Patch("moegemm.fused", "launch_fused"),
                          "operand": Patch("moegemm.fused", "launch_fused", _operand_out)}),
}


def captured_with(timer, change, call):
    """call captured with every sm90 config function's answer changed by change(fmt name, config)."""
    c = library_config()
    mx_config, config = c._sm90_mx_config, c._sm90_config
    c._sm90_mx_config = lambda *a: change(a[0], mx_config(*a))
    c._sm90_config = lambda *a: change(a[0], config(*a))
    patched = isinstance(change, Patch) and change.make_replacement is not None
    if patched:
        module = change.module()
        original = getattr(module, change.name)
        setattr(module, change.name, change.make_replacement(original))
    try:
        call()  # compile outside the capture
        return timer.prepare(call)
    finally:
        c._sm90_mx_config, c._sm90_config = mx_config, config
        if patched:
            setattr(module, change.name, original)


def _layer_rows(L, timer, m_index, model, fmt, tokens, variants) -> list[dict]:
    """One model's layer under every variant and its baseline, timed in turns, twice."""
    import torch

    device = torch.device("cuda")
    cfg = L.MODELS[model]
    weights = L.build_weights(cfg, m_index, device)
    x, ids, topk_weights = L.routing_inputs(cfg, tokens, tokens * 7919 + m_index, device)
    call = L.layer_call(cfg, x, ids, topk_weights, weights, fmt, fused=True)
    timed = {name: (timer.prepare(call) if change is _unchanged else captured_with(timer, change, call))
             for name, change in variants.items()}
    base = L.baseline_for(weights, fmt, cfg, "fp8_rowwise" if weights.rowwise() is not None else "bf16")
    base_call = lambda: base(x, ids, topk_weights)  # noqa: E731
    base_call()
    timed["baseline"] = timer.prepare(base_call)
    rows = []
    for run in range(2):
        times = {name: ms * 1e3 for name, (ms, _, _) in timer.in_turns(timed).items()}
        for name, us in times.items():
            rows.append(dict(key=f"{model} {fmt} {tokens} {name}", model=model, fmt=fmt, tokens=tokens,
                             variant=name, run=run, us=round(us, 1), x_baseline=round(times["baseline"] / us, 4)))
        print(model, fmt, {k: round(v, 1) for k, v in times.items()},
              {k: round(times["baseline"] / v, 3) for k, v in times.items()}, flush=True)
    return rows


def run_layer_plan(plan: str, args) -> dict:
    import layer_models as L
    import torch
    from timing import Timer

    _, tokens, models, variants = LAYER_PLANS[plan]
    if library_only():
        variants = {"library": _unchanged}
    device = torch.device("cuda")
    timer = Timer(device)
    env = dict(gpu_env(timer), tokens=tokens)
    rows = []
    for m_index, model, fmt in models:
        rows += _layer_rows(L, timer, m_index, model, fmt, tokens, variants)
        torch.cuda.empty_cache()
    return dict(env=env, rows=rows)
