"""DeepSeek-V3 and gpt-oss at 4096 tokens: the scatter form of the gather (row-major scale bytes +
kb_major_scales_kernel) against the gather form, bit for bit on every in-slot row, both timed
(graph replay). python bench/scatter_check.py OUT.json"""
import json
import sys

import torch

sys.path.insert(0, ".")
import moegemm
from moegemm import benchmark
from moegemm import activation as act
from moegemm.routing import row_experts
from moegemm.token_forms import token_form

out = {}
for t, k, e, h, n in ((4096, 8, 256, 7168, 4096), (512, 8, 256, 7168, 4096), (4096, 4, 128, 2880, 5760)):
    gen = torch.Generator(device="cuda").manual_seed(t + k)
    x = torch.randn(t, h, device="cuda", generator=gen).bfloat16()
    x[0, 5] = float("nan")
    x[1] = 0
    ids = torch.rand(t, e, device="cuda", generator=gen).topk(k, dim=1).indices.to(torch.int32)
    plan = moegemm.route(ids, e)
    for fmt in ("mxfp8", "mxfp4"):
        form = token_form(fmt, n, h, t * k, e)
        if form is None or form.kind != "e4m3":
            print(t, k, e, fmt, "form", form)
            continue
        rs = row_experts(plan)
        sc = act.scatter_kernel_tokens(x, fmt, plan.grouped_row, rs, form, plan.a_offsets)
        ga = act.gather_kernel_tokens(x, fmt, plan.token_index, form, plan.a_offsets)
        torch.cuda.synchronize()
        rows = plan.valid.sum().item()
        same_data = torch.equal(sc.data[:rows].view(torch.uint8), ga.data[:rows].view(torch.uint8))
        # scales: every in-slot column (gaps between slots are unwritten in both)
        col = torch.zeros(sc.scales.shape[1], dtype=torch.bool, device="cuda")
        ao = plan.a_offsets.tolist()
        from moegemm.token_forms import kb_major_column
        cols = []
        for g in range(e):
            s0, s1 = ao[g], ao[g + 1]
            cols += [kb_major_column(r, s0, g, form.column_block) for r in range(s1 - s0)]
        cols = torch.tensor(cols, device="cuda")
        a, b = sc.scales[:, cols], ga.scales[:, cols]
        same_scales = torch.equal(a.view(torch.int32), b.view(torch.int32))
        nan_scales = int(torch.isnan(a).sum())

        # (both have run above: benchmark._bench_graph captures and replays them)
        us_scatter = 1e3 * benchmark._bench_graph(
            lambda: act.scatter_kernel_tokens(x, fmt, plan.grouped_row, rs, form, plan.a_offsets))
        us_gather = 1e3 * benchmark._bench_graph(
            lambda: act.gather_kernel_tokens(x, fmt, plan.token_index, form, plan.a_offsets))
        key = f"T{t}-k{k}-E{e}-H{h}-{fmt}-cb{form.column_block}"
        out[key] = dict(same_data=same_data, same_scales=same_scales, nan_scales=nan_scales, scatter_us=us_scatter,
                        gather_us=us_gather, rows=rows)
        print(key, out[key], flush=True)
json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": out},
          open(sys.argv[1], "w"), indent=1)
