"""bench/ab.py across two revisions: a timing plan run in each revision's process, alternating
(run_revisions), and the SASS of every offline compile compared case by case (run_sass, no GPU).
Each revision is a temporary git worktree (checked_out); ab.py's docstring describes both modes.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from ab_common import ENTRY, ROOT, git, record


@contextlib.contextmanager
def checked_out(revisions: dict):
    """{side: REV or None} -> {side: (tree, description)}: each REV in a temporary detached git
    worktree, removed afterwards; None is the current working tree as it is."""
    made, trees = [], {}
    top = Path(tempfile.mkdtemp(prefix="moegemm-ab-"))
    try:
        for side, rev in revisions.items():
            if rev is None:
                dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
                trees[side] = (ROOT, f"working tree at {git('rev-parse', '--short', 'HEAD')}"
                                     + (" with uncommitted changes" if dirty else ""), git("rev-parse", "HEAD"))
                continue
            sha = git("rev-parse", "--verify", f"{rev}^{{commit}}")
            path = top / side
            git("worktree", "add", "--detach", "--quiet", str(path), sha)
            made.append(path)
            trees[side] = (path, f"{rev} ({sha[:10]})", sha)
        yield trees
    finally:
        for path in made:
            git("worktree", "remove", "--force", str(path), check=False)
        git("worktree", "prune", check=False)
        shutil.rmtree(top, ignore_errors=True)


def run_revisions(plans: list[str], args) -> int:
    """Each plan in a process per revision, alternating for args.rounds rounds; medians per key."""
    args.out.mkdir(parents=True, exist_ok=True)
    revisions = {"base": args.base, "head": args.head}
    with checked_out(revisions) as trees:
        for plan in plans:
            rounds = []
            for r in range(args.rounds):
                order = ("base", "head") if r % 2 == 0 else ("head", "base")
                for side in order:
                    tree = trees[side][0]
                    with tempfile.TemporaryDirectory() as tmp:
                        env = dict(os.environ, MOEGEMM_TREE=str(tree), AB_LIBRARY_ONLY="1")
                        cmd = [sys.executable, str(ENTRY), plan, "--out", tmp,
                               "--tokens", str(args.tokens)]
                        print(f"[{plan} round {r} {side}] {' '.join(cmd)}", flush=True)
                        run = subprocess.run(cmd, env=env, cwd=tree, check=False)
                        files = list(Path(tmp).glob(f"{plan}-*.json"))
                        if run.returncode not in (0, 2) or not files:
                            raise SystemExit(f"{plan} on {side} failed (rc {run.returncode})")
                        rounds.append(dict(round=r, side=side, **json.loads(files[0].read_text())))
            summary = _revision_summary(rounds)
            data = dict(record=record(plan, base=trees["base"][1], head=trees["head"][1],
                                      base_commit=trees["base"][2], head_commit=trees["head"][2],
                                      rounds=args.rounds),
                        summary=summary, rounds=rounds)
            gpu = rounds[0].get("env", {}).get("gpu", "gpu").replace(" ", "-")
            path = args.out / f"{plan}-revisions-{gpu}.json"
            path.write_text(json.dumps(data, indent=1, default=str))
            print(f"\n{plan}: base {trees['base'][1]} / head {trees['head'][1]}, medians over {args.rounds} rounds")
            print(f"{'case':<56} {'base us':>10} {'head us':>10} {'base/head':>10}")
            for row in summary:
                print(f"{row['key'][:56]:<56} {row['base_us']:>10.1f} {row['head_us']:>10.1f} {row['ratio']:>10.3f}")
            print(f"wrote {path}", flush=True)
    return 0


def _revision_summary(rounds: list[dict]) -> list[dict]:
    times: dict = collections.defaultdict(lambda: collections.defaultdict(list))
    for result in rounds:
        for row in result.get("rows", []):
            if isinstance(row.get("us"), (int, float)):
                times[row["key"]][result["side"]].append(row["us"])
    summary = []
    for key, sides in times.items():
        if sides.get("base") and sides.get("head"):
            base, head = statistics.median(sides["base"]), statistics.median(sides["head"])
            summary.append(dict(key=key, base_us=base, head_us=head, ratio=base / head,
                                base_samples=sides["base"], head_samples=sides["head"]))
    return summary


# ---- sass: the SASS of every offline compile in two revisions ------------------------------------

SASS_TESTS = ["tests/test_compile_sm90.py", "tests/test_routing.py"]

# A pytest plugin for revisions whose offline.py writes no dumps: it wraps the two compile helpers
# (the tests look them up after pytest_configure) and writes the same files the library does.
SASS_PLUGIN = textwrap.dedent('''
    import os
    import re
    from pathlib import Path


    def pytest_configure(config):
        folder = os.environ.get("MOEGEMM_SASS_DUMP")
        if not folder:
            return
        import moegemm
        from moegemm.kernels import offline

        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / "_origin.txt").write_text(os.path.dirname(os.path.abspath(moegemm.__file__)))
        if "MOEGEMM_SASS_DUMP" in Path(offline.__file__).read_text():
            return  # the revision writes its dumps itself

        def dumping(compile_fn):
            def compile_and_dump(*args, **kwargs):
                compiled = compile_fn(*args, **kwargs)
                case = os.environ.get("PYTEST_CURRENT_TEST", "unnamed").split(" (")[0]
                name = re.sub(r"[^A-Za-z0-9_.=-]+", "_", case)
                with open(Path(folder) / f"{name}.sass", "a") as f:
                    f.write(offline.sass(compiled))
                return compiled
            return compile_and_dump

        for name in ("compile_for_sm90", "gluon_compile_for_sm90"):
            if hasattr(offline, name):
                setattr(offline, name, dumping(getattr(offline, name)))
''')

_ADDR = re.compile(r"^\s*/\*[0-9a-fA-F]{4,}\*/\s*")
_ENCODING = re.compile(r"/\*\s*0x[0-9a-fA-F]+\s*\*/")
_JUMPS = ("BRA", "BSSY", "CALL", "JMP", "JMX", "BRX")  # their last hex operand is an address


def _relative_target(instr: str, address: int) -> str:
    """A jump's absolute target as an offset from its own address, so code inserted elsewhere
    does not change every later jump."""
    op = _opcode(instr)
    if not op.startswith(_JUMPS):
        return instr
    match = re.search(r"0x([0-9a-fA-F]+)\s*$", instr)
    if not match:
        return instr
    offset = int(match.group(1), 16) - address
    return instr[:match.start()] + (f".+{offset:#x}" if offset >= 0 else f".-{-offset:#x}")


def normalize_sass(text: str) -> list[str]:
    """Instructions and operands of a dump, one string each, in order: the /*addr*/ and encoding
    comments, function headers (names, flags, section and code headers), labels and blank lines
    dropped; jump targets made relative to the jump; each kernel's own name inside operands
    replaced by <kernel>; a kernel boundary kept as one '<next kernel>' line when a case
    compiled several."""
    names = set(re.findall(r"Function\s*:\s*(\S+)", text))
    out, kernels = [], 0
    for line in text.splitlines():
        if re.search(r"Function\s*:", line):
            kernels += 1
            if kernels > 1:
                out.append("<next kernel>")
            continue
        if not _ADDR.match(line):
            continue  # headers, .headerflags, section markers, labels, encoding-only lines
        address = int(re.match(r"\s*/\*([0-9a-fA-F]+)\*/", line).group(1), 16)
        instr = _ENCODING.sub("", _ADDR.sub("", line)).strip().rstrip(";").strip()
        if not instr:
            continue
        instr = _relative_target(instr, address)
        for name in names:
            instr = instr.replace(name, "<kernel>")
        out.append(re.sub(r"\s+", " ", instr))
    return out


def _opcode(instr: str) -> str:
    parts = instr.split()
    if parts and parts[0].startswith("@"):
        parts = parts[1:]
    return parts[0] if parts else ""


def compare_sass(base: list[str], head: list[str]) -> dict:
    identical = base == head
    first = None
    if not identical:
        i = next((j for j, (b, h) in enumerate(zip(base, head)) if b != h), min(len(base), len(head)))
        first = dict(index=i, base=base[i] if i < len(base) else None, head=head[i] if i < len(head) else None)
    counts = collections.Counter(_opcode(x) for x in head)
    counts.subtract(collections.Counter(_opcode(x) for x in base))
    changes = sorted(((op, n) for op, n in counts.items() if n), key=lambda kv: (-abs(kv[1]), kv[0]))[:6]
    return dict(identical=identical, base_instructions=len(base), head_instructions=len(head), first_difference=first,
                opcode_changes=dict(changes))


def dump_sass(tree: Path, folder: Path, timeout: float) -> dict:
    """pytest's offline compile tests in `tree` with their SASS dumped to `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    plugin_dir = folder.parent / "plugin"
    plugin_dir.mkdir(exist_ok=True)
    (plugin_dir / "ab_sass_dump.py").write_text(SASS_PLUGIN)
    env = dict(os.environ, MOEGEMM_SASS_DUMP=str(folder),
               PYTHONPATH=os.pathsep.join([str(tree), str(plugin_dir)] + [p for p in [os.environ.get("PYTHONPATH")]
                                                                            if p]))
    env.pop("MOEGEMM_TREE", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "ab_sass_dump",
           *[t for t in SASS_TESTS if (tree / t.split("::")[0]).exists()], "-k", "compile"]
    t0 = time.time()
    try:
        run = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout, check=False)
        log, rc = run.stdout + run.stderr, run.returncode
    except subprocess.TimeoutExpired as exc:  # (its output comes as bytes, text=True or not)
        out = exc.stdout or b""
        log, rc = (out if isinstance(out, str) else out.decode(errors="replace")) + "\n[timed out]", None
    (folder.parent / f"{folder.name}.log").write_text(log)
    origin = (folder / "_origin.txt").read_text().strip() if (folder / "_origin.txt").exists() else None
    summary = next((line for line in reversed(log.splitlines()) if re.search(r"\d+ (passed|failed|error)", line)), "")
    return dict(command=" ".join(cmd[1:]), rc=rc, seconds=round(time.time() - t0, 1), pytest=summary.strip("= "),
                library=origin, cases=len(list(folder.glob("*.sass"))))


def run_sass(args) -> int:
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="moegemm-sass-"))
    runs, dumps = {}, {}
    try:
        with checked_out({"base": args.base, "head": args.head}) as trees:
            for side in ("base", "head"):
                tree, described, _ = trees[side]
                print(f"[sass] {side}: {described}: pytest in {tree} ...", flush=True)
                runs[side] = dict(revision=described, commit=trees[side][2],
                                  **dump_sass(Path(tree), work / side, args.timeout))
                print(f"[sass] {side}: {runs[side]['cases']} cases, pytest: {runs[side]['pytest'] or runs[side]['rc']}"
                      f" ({runs[side]['seconds']} s)", flush=True)
                library = runs[side]["library"]
                if library and Path(library).resolve() != (Path(tree) / "moegemm").resolve():
                    raise SystemExit(f"{side}: the tests imported moegemm from {runs[side]['library']}, not {tree}")
                dumps[side] = {p.stem: normalize_sass(p.read_text()) for p in sorted((work / side).glob("*.sass"))}
        if args.keep_dumps:
            for side in ("base", "head"):
                shutil.copytree(work / side, out / f"sass-{side}", dirs_exist_ok=True)
                shutil.copy(work / f"{side}.log", out / f"sass-{side}.log")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base, head = dumps["base"], dumps["head"]
    cases = [dict(case=name, **compare_sass(base[name], head[name])) for name in sorted(set(base) & set(head))]
    data = dict(record=record("sass", base=runs["base"]["revision"], head=runs["head"]["revision"]),
                runs=runs, compared=len(cases), identical=sum(c["identical"] for c in cases),
                differing=[c["case"] for c in cases if not c["identical"]],
                base_only=sorted(set(base) - set(head)), head_only=sorted(set(head) - set(base)), cases=cases)
    (out / "sass.json").write_text(json.dumps(data, indent=1))
    (out / "sass.md").write_text(sass_markdown(data))
    print(sass_markdown(data, brief=True))
    print(f"wrote {out / 'sass.md'}, {out / 'sass.json'}")
    return 0 if all(r["rc"] == 0 for r in runs.values()) else 1


def _short(case: str) -> str:
    return case.replace("tests_test_", "").replace(".py_test_", ": ")


def sass_markdown(data: dict, brief: bool = False) -> str:
    runs = data["runs"]
    lines = [f"# SASS A/B: {runs['base']['revision']} -> {runs['head']['revision']}", "",
             f"Made by `{data['record']['script']}` (plan sass) at commit {data['record']['commit']}"
             f"{' (uncommitted changes)' if data['record']['dirty'] else ''}.", "",
             "| side | revision | pytest | cases | seconds |", "|---|---|---|---|---|"]
    for side in ("base", "head"):
        r = runs[side]
        lines.append(f"| {side} | {r['revision']} | {r['pytest'] or 'rc ' + str(r['rc'])} | {r['cases']} | "
                     f"{r['seconds']} |")
    differing = [c for c in data["cases"] if not c["identical"]]
    lines += ["", f"**{data['identical']} of {data['compared']} cases identical, {len(differing)} differ**"
              f"; {len(data['base_only'])} only in base, {len(data['head_only'])} only in head.", ""]
    if differing:
        lines += ["| case | base instr | head instr | first difference (index: base / head) | opcode changes |",
                  "|---|---|---|---|---|"]
        for c in differing:
            f = c["first_difference"]
            ops = ", ".join(f"{op} {n:+d}" for op, n in c["opcode_changes"].items()) or "none (order or operands)"
            lines.append(f"| {_short(c['case'])} | {c['base_instructions']} | {c['head_instructions']} | "
                         f"{f['index']}: `{f['base']}` / `{f['head']}` | {ops} |")
    if not brief:
        same = [c for c in data["cases"] if c["identical"]]
        if same:
            lines += ["", "Identical:", ""] + [f"- {_short(c['case'])} ({c['base_instructions']} instructions)"
                                               for c in same]
    for side in ("base_only", "head_only"):
        if data[side]:
            lines += ["", f"Only in {side.split('_')[0]}:", ""] + [f"- {_short(c)}" for c in data[side]]
    return "\n".join(lines) + "\n"
