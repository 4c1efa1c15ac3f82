"""README.md's ```python blocks run as written on the CPU, except those that `_needs` sets apart (a
GPU, a torch.distributed process group); a block that loads a model from the hub (`name = "..."`)
loads a tiny one saved here instead, since no hub is reachable. Where the README shows what a
block prints ("It prints"), it prints those lines (error values within a factor of 2; a backend
this machine lacks prints no line)."""

import contextlib
import io
import pathlib
import re

import pytest
import torch

import moegemm
from moegemm.ops import BACKENDS

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
HUB_NAME = re.compile(r'^name = "[^"]+"', re.M)  # the model a block loads with from_pretrained(name)
NUMBER = re.compile(r"\d\.\de[-+]\d\d")  # an error value, as the blocks print them
RUN_HERE = 2  # the first run on the CPU and the transformers block; the expert-parallel one needs a group


def _python_blocks() -> list[tuple[str, str | None]]:
    """(code, the printed lines the README shows for it, or None) of each ```python block."""
    text = README.read_text(encoding="utf-8")
    fences = list(FENCE.finditer(text))
    blocks = []
    for i, fence in enumerate(fences):
        if fence.group(1) != "python":
            continue
        following = fences[i + 1] if i + 1 < len(fences) else None
        shown = following is not None and following.group(1) == "" and \
            text[fence.end():following.start()].strip().startswith("It prints")
        blocks.append((fence.group(2), following.group(2) if shown else None))
    return blocks


def _needs(code: str) -> str | None:
    """What `code` needs that a CPU machine without a network lacks, or None."""
    if "torch.distributed" in code:
        return "a torch.distributed process group"
    if '"cuda"' in code or ".cuda()" in code:
        return "a CUDA GPU"
    return None


def test_the_blocks_run_here_are_the_expected_ones():
    blocks = _python_blocks()
    assert len([code for code, _ in blocks if _needs(code) is None]) == RUN_HERE, [_needs(c) for c, _ in blocks]
    assert sum(shown is not None for _, shown in blocks) == 1  # (the first run's output)


def _tiny_moe_model(path: pathlib.Path) -> str:
    """A random two-layer Qwen3-MoE model saved in `path` (what from_pretrained reads)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                         num_experts=8, num_experts_per_tok=2, num_key_value_heads=2, head_dim=16,
                                         vocab_size=128, num_hidden_layers=2, num_attention_heads=4)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("index", range(len(_python_blocks())))
def test_a_readme_block_runs_as_written(index, tmp_path):
    code, shown = _python_blocks()[index]
    why = _needs(code)
    if why is not None:
        pytest.skip(f"README's python block {index} needs {why}")
    loads = HUB_NAME.search(code)
    if loads:
        code = code.replace(loads.group(0), f"name = {_tiny_moe_model(tmp_path)!r}")
    printed = io.StringIO()
    namespace = {"__name__": "__readme__"}
    with contextlib.redirect_stdout(printed):
        exec(compile(code, f"README.md python block {index}", "exec"), namespace)
    if shown is not None:
        # (the lines of a backend this CPU lacks, e.g. the interpreter under numpy >= 2.4, are not printed)
        absent = set(BACKENDS) - set(moegemm.available_backends("cpu"))
        got, want = printed.getvalue().splitlines(), [line for line in shown.splitlines()
                                                      if line.split()[0] not in absent]
        assert [NUMBER.sub("#", line) for line in got] == [NUMBER.sub("#", line) for line in want], printed.getvalue()
        for g, w in zip(NUMBER.findall(printed.getvalue()), NUMBER.findall(shown)):
            assert float(w) / 2 <= float(g) <= float(w) * 2, (g, w)
    if loads:
        model = namespace["model"]
        experts = moegemm.hf.experts_modules(model)
        assert len(experts) == 2 and all(m.config._experts_implementation == "moegemm" for m in experts)
        with torch.no_grad():
            assert torch.isfinite(model(torch.randint(0, 128, (1, 7))).logits).all()
