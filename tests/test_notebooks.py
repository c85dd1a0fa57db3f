"""Every notebook runs clean under nbdev_test (smoke profile via IN_TEST), one test per notebook.

The chapters whose smoke run tests/test_determinism.py already makes under nbdev_test (one of its pair of runs under two
hash seeds) are left to it: the same run, once, checks both."""
import os, subprocess, sys
from pathlib import Path
import pytest
from rag_lab.papers import PAPERS
from test_determinism import NBDEV_TESTED_THERE

REPO = Path(__file__).resolve().parents[1]
ALL_NOTEBOOKS = sorted(p.name for p in (REPO / 'nbs').glob('[0-9]*.ipynb'))
NOTEBOOKS = [nb for nb in ALL_NOTEBOOKS if nb not in NBDEV_TESTED_THERE]
BIN = Path(sys.executable).parent

def test_every_notebook_is_run_under_nbdev_test_once():
    "Nothing falls between the two files: every notebook is nbdev_test-ed here or by the determinism tests, never both."
    assert set(NBDEV_TESTED_THERE) == {p.notebook for p in PAPERS.values()}   # each paper's chapter, there
    assert sorted(NOTEBOOKS + list(NBDEV_TESTED_THERE)) == ALL_NOTEBOOKS

@pytest.mark.parametrize('nb', NOTEBOOKS)
def test_notebook_runs(nb, tmp_path):
    env = {**os.environ, 'RAG_LAB_OUT': str(tmp_path)}   # smoke outputs never touch committed reports
    r = subprocess.run([str(BIN / 'nbdev_test'), '--path', f'nbs/{nb}', '--do_print'], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"{nb} failed under nbdev_test:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
