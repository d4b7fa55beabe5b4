"""The chaos soak (`tools/chaos_resume.py`) at a small scale: a 2-rank run with async saves is
killed three times at seeded random moments (SIGKILL and SIGTERM, whole process tree), restarted
with the same command until it completes, and compared with an uninterrupted run: losses of every
attempt and every checkpoint bit for bit, no leftover process, no `.incomplete`, manifests verified."""
import os
import re
import subprocess
import sys

import pytest
from conftest import REPO

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]


def test_a_run_killed_at_random_moments_resumes_bit_identically(tmp_path):
    work = tmp_path / "w"
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tools", "chaos_resume.py"), "--work", str(work),
                           "--kills", "3", "--seed", "3", "--train-iters", "6"],
                          capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    kills = re.findall(r"^kill \d/3: (SIGKILL|SIGTERM) at .* during (startup|first iteration|training|save)",
                       proc.stdout, re.M)
    assert len(kills) == 3, proc.stdout
    assert re.search(r"^chaos-resume: PASS \(seed 3\): 3 of 3 kills .* checkpoints \[2, 4, 6\] equal bit for bit",
                     proc.stdout, re.M), proc.stdout
    assert not list((work / "chaos" / "ckpt").glob("*.incomplete"))

    # the comparison is not vacuous: two checkpoints of different iterations are told apart
    from megatron_dllm.cli.chaos_resume import Mismatch, compare_checkpoints

    ckpt = work / "reference" / "ckpt"
    compare_checkpoints(str(ckpt / "iter_0000006"), str(work / "chaos" / "ckpt" / "iter_0000006"), str(tmp_path))
    with pytest.raises(Mismatch, match="iter_0000004 sharded state.*tensors differ"):
        compare_checkpoints(str(ckpt / "iter_0000004"), str(ckpt / "iter_0000006"), str(tmp_path))
