"""Expert-parallel checks run in W spawned processes (tests/test_distributed.py): gloo on the CPU,
NCCL with one GPU a rank. Each rank builds the layer the single-process way and the
expert-parallel way from the same seeds, runs its share of the tokens through the second and
all the tokens through the first, and asserts its rows agree; an assertion in any rank fails
the test (torch.multiprocessing re-raises it in the parent)."""

from __future__ import annotations

import datetime
import io
import os
import socket
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import moegemm  # noqa: E402
from moegemm import distributed  # noqa: E402
from moegemm.kernels import tl_source  # noqa: E402

# NVLink multicast stays off on shared GPU hosts (NCCL, PyTorch's symmetric memory, NVSHMEM).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(world: int, backend: str, check: str, *args, timeout: float | None = None):
    """Run check(group, device, *args) on `world` ranks of a fresh process group: forked on the CPU
    (the ranks inherit the imported modules: seconds of make test a rank), spawned for GPUs (CUDA
    cannot be forked). timeout: seconds after which the ranks still running are killed and the
    test fails (a hang)."""
    os.environ.update(NO_MULTICAST)
    context = mp.start_processes(_rank_main, args=(world, backend, free_port(), check, args), nprocs=world,
                                 join=False, start_method="fork" if backend == "gloo" else "spawn")
    deadline = None if timeout is None else time.monotonic() + timeout
    while not context.join(timeout=None if deadline is None else max(deadline - time.monotonic(), 0.1)):
        if deadline is not None and time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise AssertionError(f"{check}: the {world} ranks did not finish within {timeout} s (a hang)")


def _rank_main(rank, world, backend, port, check, args):
    os.environ.update(NO_MULTICAST)
    if backend == "gloo":
        # The layer's quantizers run their PyTorch forms instead of Triton's interpreter (minutes
        # for W processes on two cores); test_moe and test_token_forms cover the interpreted kernels.
        tl_source.interpreter_usable = lambda: False
        torch.set_num_threads(1)  # W ranks share the cores
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device if backend == "nccl" else None, timeout=datetime.timedelta(seconds=180))
    try:
        globals()[check](dist.group.WORLD, device, *args)
    finally:
        dist.destroy_process_group()


def check_all(group, device, *checks):
    """Several checks on one process group: each (name, *args)."""
    for name, *args in checks:
        globals()[name](group, device, *args)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp(min=1e-30)).item()


def _layers(fmt, world_group, device, dtype, *, hidden, width, experts, top_k, path="auto", seed=0):
    """(single-process layer, expert-parallel layer) with the same weights; the EP layer loads the
    full checkpoint tensors on even ranks and its own slice on odd ones (both forms accepted)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    gate = torch.randn(experts, width, hidden, generator=gen) / hidden ** 0.5
    up = torch.randn(experts, width, hidden, generator=gen) / hidden ** 0.5
    down = torch.randn(experts, hidden, width, generator=gen) / width ** 0.5
    router = torch.randn(experts, hidden, generator=gen)
    kw = {"fmt": fmt, "router": "softmax_topk", "dtype": dtype, "device": device}
    one = moegemm.MoE(hidden, width, experts, top_k, **kw)
    one.load_experts(gate=gate.to(device), up=up.to(device), down=down.to(device)).load_router(router.to(device))
    ep = moegemm.MoE(hidden, width, experts, top_k, ep_group=world_group, ep_path=path, **kw)
    first, last = ep.expert_range
    own = dist.get_rank(world_group) % 2 == 1
    cut = (lambda w: w[first:last]) if own else (lambda w: w)
    ep.load_experts(gate=cut(gate).to(device), up=cut(up).to(device), down=cut(down).to(device))
    ep.load_router(router.to(device))
    if fmt == "nvfp4":  # a static intermediate global scale: the dynamic one is taken over each rank's rows
        one.intermediate_global_scale = ep.intermediate_global_scale = torch.tensor(0.01, device=device)
    return one, ep


def check_layers(group, device, fmts, paths, sizes, tol):
    """For every format and path: the EP layer's outputs for this rank's tokens against the
    single-process layer on all ranks' tokens; ranks hold different numbers of tokens on the
    prefill path (one holds none where `sizes` asks), the same on the decode path."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    hidden, width, experts, top_k, tokens = sizes
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    for fmt in fmts:
        one, ep = _layers(fmt, group, device, dtype, hidden=hidden, width=width, experts=experts, top_k=top_k)
        for path in paths:
            # "capacity": the decode path with a capacity, every rank another count, rank 0 none
            ep.ep_path = "decode" if path == "capacity" else path
            counts = [tokens] * world if path == "decode" else [tokens + 3 * r for r in range(world)]
            if path == "prefill" and world > 2:
                counts[1] = 0
            if path == "capacity":
                counts[0] = 0
            ep.ep_capacity = max(counts) if path == "capacity" else None
            gen = torch.Generator(device="cpu").manual_seed(1000 + sum(counts))
            x_all = torch.randn(sum(counts), hidden, generator=gen).to(device, dtype)
            start = sum(counts[:rank])
            mine = x_all[start:start + counts[rank]]
            want = one(x_all)[start:start + counts[rank]]
            got = ep(mine)
            assert got.shape == mine.shape and got.dtype == mine.dtype, (fmt, path, got.shape, got.dtype)
            if path in ("decode", "capacity"):
                assert torch.equal(got, ep(mine)), f"{fmt} {path}: two runs differ"
            if counts[rank]:
                err = rel_err(got, want)
                assert err <= tol, f"{fmt} {path} rank {rank}: relative error {err:.2e} > {tol:.0e}"


def check_loaders(group, device):
    """load_fp8_block (DeepSeek FP8) and load_mxfp4 (gpt-oss, biases): the EP layer from the full
    checkpoint (even ranks) or the rank's slice (odd ranks) against the single-process layer."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    first, last = rank * 8 // world, (rank + 1) * 8 // world
    cut = (lambda w: w[first:last]) if rank % 2 else (lambda w: w)
    gen = torch.Generator().manual_seed(11)
    h, i, e, k = 256, 128, 8, 2
    x = torch.randn(world * 5, h, generator=gen)
    mine = slice(rank * 5, (rank + 1) * 5)
    fp8 = {name: (torch.randn(e, *shape, generator=gen) * 4).to(torch.float8_e4m3fn)
           for name, shape in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i)))}
    fp8.update({f"{name}_scale_inv": torch.rand(e, -(-w.shape[1] // 128), -(-w.shape[2] // 128), generator=gen) / 64
                for name, w in list(fp8.items())})
    mx = {"gate_up_blocks": torch.randint(0, 256, (e, 2 * i, h // 32, 16), generator=gen, dtype=torch.uint8),
          "gate_up_scales": torch.randint(118, 122, (e, 2 * i, h // 32), generator=gen, dtype=torch.uint8),
          "down_blocks": torch.randint(0, 256, (e, h, i // 32, 16), generator=gen, dtype=torch.uint8),
          "down_scales": torch.randint(118, 122, (e, h, i // 32), generator=gen, dtype=torch.uint8),
          "gate_up_bias": torch.randn(e, 2 * i, generator=gen) / 10, "down_bias": torch.randn(e, h, generator=gen) / 10}
    router = torch.randn(e, h, generator=gen)
    for loader, weights, kw in (("load_fp8_block", fp8, {"fmt": "fp8_block"}),
                                ("load_mxfp4", mx, {"activation": "swiglu_oai", "router": "topk_softmax",
                                                    "expert_bias": True})):
        kw = {"dtype": torch.float32, **kw}
        one = getattr(moegemm.MoE(h, i, e, k, **kw), loader)(**weights).load_router(router)
        ep = moegemm.MoE(h, i, e, k, ep_group=group, **kw)
        getattr(ep, loader)(**{name: cut(w) for name, w in weights.items()}).load_router(router)
        err = rel_err(ep(x[mine]), one(x)[mine])
        assert err <= 1e-5, f"{loader}: relative error {err:.2e}"


def check_state_dict(group, device):
    """load_state_dict into a rank: the single-process layer's checkpoint (prepacked, all experts)
    cut to the rank's and unpacked (prepack=False); a rank's own state into a fresh rank layer;
    rank 0's state on every rank: a ValueError on each, no rank's weights changed."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    h, i, e, k = 64, 64, 8, 2
    gen = torch.Generator().manual_seed(13)
    weights = dict(gate=torch.randn(e, i, h, generator=gen), up=torch.randn(e, i, h, generator=gen),
                   down=torch.randn(e, h, i, generator=gen))
    router = torch.randn(e, h, generator=gen)
    x = torch.randn(world * 5, h, generator=gen)
    mine = slice(rank * 5, (rank + 1) * 5)
    kw = {"fmt": "bf16_nvfp4", "dtype": torch.float32}
    one = moegemm.MoE(h, i, e, k, prepack=True, **kw).load_experts(**weights).load_router(router)
    ep = moegemm.MoE(h, i, e, k, ep_group=group, prepack=False, **kw)
    ep.load_state_dict(one.state_dict())
    assert not ep.gate_up_prepacked and ep.get_extra_state()["experts"] == ep.expert_range
    got = ep(x[mine])
    err = rel_err(got, one(x)[mine])
    assert err <= 1e-5, f"full checkpoint into rank {rank}: relative error {err:.2e}"
    own = moegemm.MoE(h, i, e, k, ep_group=group, prepack=True, **kw)
    own.load_state_dict(ep.state_dict())
    assert own.gate_up_prepacked and torch.equal(own(x[mine]), got)
    saved = io.BytesIO()
    torch.save(ep.state_dict(), saved)
    first = [saved.getvalue() if rank == 0 else None]  # (its bytes: what torch.save writes)
    dist.broadcast_object_list(first, src=0, group=group)
    try:
        own.load_state_dict(torch.load(io.BytesIO(first[0]), weights_only=True))
    except ValueError as error:
        assert str(error).startswith("load_state_dict: expected the same on every rank"), str(error)
        assert "rank 0 'ok'" in str(error) and "holds experts [0, 4) of 8, this layer keeps [4, 8)" in str(error)
    else:
        raise AssertionError("another rank's experts loaded")
    assert torch.equal(own(x[mine]), got)


def check_functional(group, device):
    """moe_forward(ep_group=...) on both paths: dropped choices (ids -1 or >= E), topk_weights None
    and per-expert scales (each rank's slice), as the single-process call treats them; and the
    counts each rank sends."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    hidden, width, experts, top_k, tokens = 256, 128, 4 * world, 3, 10
    gen = torch.Generator(device="cpu").manual_seed(7)
    w_gu = moegemm.quantize_weights(torch.randn(experts, 2 * width, hidden, generator=gen) / 16, "mxfp8",
                                    scale_layout="swizzled")
    w_dn = moegemm.quantize_weights(torch.randn(experts, hidden, width, generator=gen) / 11, "mxfp8",
                                    scale_layout="swizzled")
    x_all = torch.randn(world * tokens, hidden, generator=gen)
    ids_all = torch.randint(0, experts, (world * tokens, top_k), generator=gen, dtype=torch.int32)
    ids_all[::4, 0] = -1
    ids_all[1::5, 1] = experts + 2
    mine = slice(rank * tokens, (rank + 1) * tokens)
    scales = {"gate_up_scales": torch.rand(experts, generator=gen) + 0.5,
              "down_scales": torch.rand(experts, generator=gen) + 0.5}
    want = moegemm.moe_forward(x_all, ids_all, None, w_gu, w_dn, gate_up_layout="interleaved", **scales)[mine]
    first, last = distributed.expert_range(experts, group)

    for path in ("prefill", "decode"):
        got = moegemm.moe_forward(x_all[mine], ids_all[mine], None, w_gu.experts(first, last),
                                  w_dn.experts(first, last),
                                  gate_up_layout="interleaved", ep_group=group, ep_path=path,
                                  **{name: s[first:last] for name, s in scales.items()})
        assert rel_err(got, want) <= 1e-5, (path, rel_err(got, want))
    sent = distributed.dispatch(x_all[mine], ids_all[mine], None, "mxfp8", num_experts=experts, group=group,
                                path="prefill")
    ids = ids_all[mine].long()
    for r in range(world):  # a token goes once to each rank owning one of its choices
        owns = ((ids >= r * experts // world) & (ids < (r + 1) * experts // world)).any(dim=1)
        assert sent.send_splits[r] == int(owns.sum()), (r, sent.send_splits, owns.sum())
    assert sent.topk_ids.shape == (sum(sent.recv_splits), top_k)
    assert bool(((sent.topk_ids >= -1) & (sent.topk_ids < last - first)).all())


def check_transformers_blocks(group, device):
    """hf.from_transformers(block, ep_group=...) on each supported block kind against the same
    block built on one process (the same seed on every rank), every rank on its own tokens."""
    import hf_moe

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    for kind in hf_moe.KINDS:
        torch.manual_seed(3)
        block = hf_moe.build_block(kind)  # (8 or 16 experts: two ranks divide them)
        one = moegemm.hf.from_transformers(block, "mxfp8")
        ep = moegemm.hf.from_transformers(block, "mxfp8", ep_group=group)
        x = torch.randn(world * 6, one.hidden_size, generator=torch.Generator().manual_seed(4))
        mine = slice(rank * 6, (rank + 1) * 6)
        err = rel_err(ep(x[mine]), one(x)[mine])
        assert err <= 1e-5, f"{kind}: relative error {err:.2e}"


def check_errors(group, device):
    """Bad input names its argument; the decode path without a capacity refuses unequal token counts."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    x = torch.randn(4 + rank, 256)
    ids = torch.zeros(4 + rank, 2, dtype=torch.int32)
    for call, name in ((lambda: distributed.dispatch(x, ids, None, "bf16", num_experts=world + 1, group=group),
                        "num_experts"),
                       (lambda: distributed.dispatch(x, ids.float(), None, "bf16", num_experts=world, group=group),
                        "topk_ids"),
                       (lambda: distributed.dispatch(x, ids, None, "bf16", num_experts=world, group=group,
                                                     path="fast"), "path"),
                       (lambda: moegemm.MoE(256, 128, 3 * world + 1, 2, ep_group=group), "num_experts"),
                       (lambda: moegemm.MoE(256, 128, 2 * world, 2, ep_group="world"), "ep_group")):
        try:
            call()
        except (ValueError, TypeError) as e:
            assert name in str(e), (name, str(e))
        else:
            raise AssertionError(f"{name}: no error raised")
    layer = moegemm.MoE(256, 128, 2 * world, 2, fmt="bf16", ep_group=group, dtype=torch.float32)
    try:
        layer.load_experts(gate=torch.zeros(3, 128, 256), up=torch.zeros(3, 128, 256), down=torch.zeros(3, 256, 128))
    except ValueError as e:
        assert "gate" in str(e) and "this rank's experts" in str(e), str(e)
    else:
        raise AssertionError("load_experts took 3 experts")
    try:  # (no MOEGEMM_DEBUG: the eager decode path compares the counts)
        distributed.dispatch(x, ids, None, "bf16", num_experts=2 * world, group=group, path="decode")
    except ValueError as e:
        assert "same number of tokens" in str(e), str(e)
    else:
        raise AssertionError("the decode path took unequal token counts")


def check_graph(group, device, fmts, sizes, tol):
    """The decode path captured in a CUDA graph (ep_path "auto" takes it while capturing) and
    replayed on new tokens, against the single-GPU layer."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    hidden, width, experts, top_k, tokens = sizes
    for fmt in fmts:
        one, ep = _layers(fmt, group, device, torch.bfloat16, hidden=hidden, width=width, experts=experts,
                          top_k=top_k, path="auto")
        static = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
        ep.ep_path = "decode"  # compile and warm up the decode path outside the capture
        ep(static)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            ep(static)
        torch.cuda.current_stream().wait_stream(stream)
        ep.ep_path = "auto"  # which takes the decode path while capturing
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ep(static)
        gen = torch.Generator(device="cpu").manual_seed(5)
        x_all = torch.randn(world * tokens, hidden, generator=gen).to(device, torch.bfloat16)
        static.copy_(x_all[rank * tokens:(rank + 1) * tokens])
        graph.replay()
        torch.cuda.synchronize()
        want = one(x_all)[rank * tokens:(rank + 1) * tokens]
        err = rel_err(out, want)
        assert err <= tol, f"{fmt} graph rank {rank}: relative error {err:.2e} > {tol:.0e}"


def check_over_capacity(group, device):
    """The decode path with a capacity: the rank over it raises a ValueError naming the capacity;
    the others return their tokens' outputs (those of the single-process layer)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    dtype = torch.float32
    one, ep = _layers("mxfp8", group, device, dtype, hidden=256, width=128, experts=2 * world, top_k=2, path="decode")
    ep.ep_capacity = 4
    counts = [5] + [4 - r % 3 for r in range(1, world)]  # rank 0 one token over
    gen = torch.Generator(device="cpu").manual_seed(5)
    x_all = torch.randn(sum(counts), 256, generator=gen).to(device, dtype)
    start = sum(counts[:rank])
    mine = x_all[start:start + counts[rank]]
    if rank == 0:
        try:
            ep(mine)
        except ValueError as e:
            assert "capacity 4" in str(e) and "x:" in str(e), str(e)
        else:
            raise AssertionError("5 tokens above a capacity of 4 ran")
    else:
        err = rel_err(ep(mine), one(x_all)[start:start + counts[rank]])
        assert err <= 1e-5, f"rank {rank}: relative error {err:.2e}"


def _fails_together(call, starts: str, *pieces: str):
    """call() raises a ValueError whose message starts with `starts` and holds every piece."""
    try:
        call()
    except ValueError as e:
        assert str(e).startswith(starts) and all(piece in str(e) for piece in pieces), (starts, str(e))
    else:
        raise AssertionError(f"no error where one was due: {starts}")


def check_disagreeing_calls(group, device):
    """Rank 0's moe_forward(ep_group=...) call differs from the others' in what sizes the
    exchanges or a packed row (the format, k, the hidden size, the path, the capacity; on the
    decode path without a capacity, the token count): every rank raises a ValueError naming the
    field and every rank's value, before any token moves, on both paths. Without the check gloo
    aborts, NCCL hangs, or the rows decode as another format's (fp8_block's rows have mxfp8's
    bytes). Then MoE's decode path without a capacity on unequal counts; then a right call on the
    same group gives the single-process outputs (no rank was left inside a collective)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    hidden, width, experts, top_k, tokens = 256, 128, 2 * world, 3, 6
    gen = torch.Generator().manual_seed(21)
    w_gu = (torch.randn(experts, 2 * width, hidden, generator=gen) / 16).to(device)
    w_dn = (torch.randn(experts, hidden, width, generator=gen) / 11).to(device)
    x = torch.randn(world * tokens, hidden, generator=gen).to(device)
    ids = torch.randint(0, experts, (world * tokens, top_k), generator=gen, dtype=torch.int32).to(device)
    mine = slice(rank * tokens, (rank + 1) * tokens)
    # (numpy and 0-d tensor bounds, as torch's indexing takes them)
    first, last = (np.int64(bound) for bound in distributed.expert_range(experts, group))
    whole = {name: (moegemm.quantize_weights(w_gu[..., :h], fmt), moegemm.quantize_weights(w_dn[:, :h], fmt))
             for name, fmt, h in (("mxfp8", "mxfp8", hidden), ("nvfp4", "nvfp4", hidden),
                                  ("fp8_block", "fp8_block", hidden), ("mxfp8 narrow", "mxfp8", 128))}
    share = {fmt: tuple(w.experts(first, torch.tensor(last)) for w in pair) for fmt, pair in whole.items()}

    def call(fmt="mxfp8", k=top_k, count=tokens, h=hidden, **ep):
        layout = "concat" if fmt == "fp8_block" else "interleaved"
        return moegemm.moe_forward(x[mine][:count, :h], ids[mine][:count, :k], None, *share[fmt],
                                   gate_up_layout=layout, ep_group=group, **ep)

    others = ", ".join(f"rank {r} {{}}" for r in range(1, world))
    cases = [  # (every rank's arguments, rank 0's changes, the error's start, what it names)
        (dict(ep_path="prefill"), dict(fmt="nvfp4"), "fmt:", "rank 0 'nvfp4', " + others.format(*["'mxfp8'"] * 3)),
        (dict(ep_path="decode"), dict(fmt="fp8_block"), "fmt:", "rank 0 'fp8_block', rank 1 'mxfp8'"),
        (dict(ep_path="prefill"), dict(k=2), "top_k:", "rank 0 2, rank 1 3"),
        (dict(ep_path="decode"), dict(k=2), "top_k:", "rank 0 2, rank 1 3"),
        (dict(ep_path="prefill"), dict(fmt="mxfp8 narrow", h=128), "hidden_size:", "rank 0 128, rank 1 256"),
        (dict(ep_path="decode"), dict(ep_path="prefill"), "path:", "rank 0 'prefill', rank 1 'decode'"),
        (dict(ep_path="decode", ep_capacity=8), dict(ep_capacity=6), "capacity:", "rank 0 6, rank 1 8"),
        (dict(ep_path="decode"), dict(count=4), "x: the decode path without a capacity", "rank 0 4, rank 1 6",
         "pass ep_capacity"),
    ]
    for every, changes, starts, *pieces in cases:
        _fails_together(lambda: call(**{**every, **(changes if rank == 0 else {})}), starts, *pieces)
    # The layer: the decode path without a capacity, rank r holding 3 + r tokens.
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    _, layer = _layers("mxfp8", group, device, dtype, hidden=hidden, width=width, experts=experts, top_k=2,
                       path="decode")
    counts = ", ".join(f"rank {r} {3 + r}" for r in range(world))
    _fails_together(lambda: layer(x[mine][:3 + rank].to(dtype)), "x: the decode path without a capacity", counts,
                    "pass ep_capacity")
    want = moegemm.moe_forward(x, ids, None, *whole["mxfp8"], gate_up_layout="interleaved")[mine]
    tol = 1e-5 if device.type == "cpu" else 1e-3  # (GPUs: the combine's fp32 sums in another order)
    for path in ("prefill", "decode"):
        err = rel_err(call(ep_path=path), want)
        assert err <= tol, f"{path} after the refused calls: relative error {err:.2e}"


MISUSES = {  # what one rank does differently -> the field every rank's error names
    "fmt": (dict(fmt="mxfp8"), dict(fmt="bf16")),
    "hidden_size": (dict(hidden_size=256), dict(hidden_size=512)),
    "num_experts": (dict(num_experts=8), dict(num_experts=16)),
    "ep_path": (dict(ep_path="prefill"), dict(ep_path="decode")),
    "ep_capacity": (dict(ep_capacity=4), dict(ep_capacity=8)),
}


def check_misuse(group, device, case):
    """Ranks that build or load disagreeing layers get a ValueError naming the difference, every
    rank, at once (no collective of mismatched sizes waits for ever)."""
    rank = dist.get_rank(group)
    args = dict(hidden_size=256, intermediate_size=128, num_experts=8, top_k=2, dtype=torch.float32)
    if case == "loaded format":  # the same layer, then MXFP4 checkpoint weights on rank 0, float ones elsewhere
        layer = moegemm.MoE(256, 128, 8, 2, ep_group=group, dtype=torch.float32)
        gen = torch.Generator().manual_seed(3)
        try:
            if rank == 0:
                layer.load_mxfp4(gate_up_blocks=torch.randint(0, 256, (8, 256, 8, 16), generator=gen, dtype=torch.uint8),
                                 gate_up_scales=torch.full((8, 256, 8), 120, dtype=torch.uint8),
                                 down_blocks=torch.randint(0, 256, (8, 256, 4, 16), generator=gen, dtype=torch.uint8),
                                 down_scales=torch.full((8, 256, 4), 120, dtype=torch.uint8))
            else:
                layer.load_experts(gate=torch.randn(8, 128, 256, generator=gen), up=torch.randn(8, 128, 256, generator=gen),
                                   down=torch.randn(8, 256, 128, generator=gen))
        except ValueError as e:
            assert str(e).startswith("fmt: expected the same on every rank") and "(MoE.load_" in str(e), str(e)
            assert "rank 0 'bf16_mxfp4', rank 1 'bf16'" in str(e), str(e)
            return
        raise AssertionError("disagreeing weights loaded")
    args.update(MISUSES[case][0] if rank == 0 else MISUSES[case][1])
    try:
        moegemm.MoE(args.pop("hidden_size"), args.pop("intermediate_size"), args.pop("num_experts"), args.pop("top_k"),
                    ep_group=group, **args)
    except ValueError as e:
        assert str(e).startswith(f"{case}: expected the same on every rank") and "rank 0" in str(e), str(e)
        return
    raise AssertionError(f"{case}: disagreeing layers built")
