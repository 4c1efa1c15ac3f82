"""What the parts of bench/ab.py share: where the harness and the library live, the record every
result file carries, and the run's GPU environment.

The harness (bench/) always comes from the current tree; the library from MOEGEMM_TREE when set
(a two-revision run's process for another revision), else from the current tree too.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TREE = Path(os.environ.get("MOEGEMM_TREE") or ROOT)  # where moegemm is imported from
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
sys.path.insert(0, str(TREE))

SCRIPT = "bench/ab.py"
ENTRY = HERE / "ab.py"  # what a two-revision run starts in each revision's process


def git(*args, cwd=ROOT, check=True) -> str:
    run = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)
    if check and run.returncode != 0:
        raise SystemExit(f"git {' '.join(args)}: {run.stderr.strip()}")
    return run.stdout.strip()


def record(plan: str, **extra) -> dict:
    """This script, the plan and the commit of the harness's tree (MOEGEMM_COMMIT overrides it)."""
    commit, dirty = os.environ.get("MOEGEMM_COMMIT"), None
    if not commit:
        try:
            commit = git("rev-parse", "HEAD")
            dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
        except (SystemExit, OSError, subprocess.SubprocessError):
            commit = "unknown"
    return dict(script=SCRIPT, plan=plan, commit=commit, dirty=dirty, **extra)


def gpu_env(timer) -> dict:
    import torch
    import triton

    return dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                copy_tbps=round(timer.copy_tbps(), 4), date=time.strftime("%Y-%m-%d %H:%M:%S"),
                library="this tree" if TREE.resolve() == ROOT.resolve() else f"the tree {TREE.name}")


def library_only() -> bool:
    """Set for the processes of a two-revision run: every case with the library's own choice."""
    return os.environ.get("AB_LIBRARY_ONLY") == "1"


def library_config():
    """moegemm.config of the library's tree (imported late: `--list` and `sass` need no torch): its
    choice functions, and the sm90 config classes and deepest_ring it chooses with, which every
    revision's config module holds as names (defined there, or imported from sm90_configs.py)."""
    from moegemm import config

    return config
