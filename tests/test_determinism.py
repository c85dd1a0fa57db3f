"""Two runs of a paper notebook under different string-hash seeds write byte-identical tables and figures.

Python randomises `hash()` of strings per process (PYTHONHASHSEED), so any iteration over a set of strings can change
order between runs. The runner starts kernels with a fixed PYTHONHASHSEED, but the code must not depend on it: these
tests run the notebook with papermill directly, under two different seeds, and compare every output byte for byte.

Excluded, because they measure time rather than results: `run_meta.json` (wall time, start time), `table9` (the
paper's runtime table: seconds per stage) and `figure6` (the plot of table9).
"""
import json, os, subprocess, sys
from pathlib import Path
import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TIME_DEPENDENT = {'run_meta.json', 'table9.csv', 'table9.md', 'figure6.png', 'figure6.pdf'}


def _run_twice(nb: str, tmp_path: Path, params: list[str]) -> tuple[Path, Path]:
    procs, outs = [], []
    for seed in ('1', '2'):
        out = tmp_path / f'hashseed{seed}'
        env = {k: v for k, v in os.environ.items() if k != 'IN_TEST'} | dict(PYTHONHASHSEED=seed, RAG_LAB_OUT=str(out))
        procs.append(subprocess.Popen([str(BIN / 'papermill'), nb, str(tmp_path / f'executed{seed}.ipynb'), '--no-progress-bar',
                                       *params], cwd=REPO / 'nbs', env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs.append(out)
    for p in procs:
        log, _ = p.communicate(timeout=1200)
        assert p.returncode == 0, log[-3000:]
    return outs[0], outs[1]


def _differences(a: Path, b: Path) -> list[str]:
    files = sorted({p.relative_to(a) for p in a.rglob('*') if p.is_file()} | {p.relative_to(b) for p in b.rglob('*') if p.is_file()})
    assert len(files) > 10, files
    return [str(f) for f in files if f.name not in TIME_DEPENDENT
            and (not (a / f).exists() or not (b / f).exists() or (a / f).read_bytes() != (b / f).read_bytes())]


def test_claim_aware_outputs_do_not_depend_on_the_hash_seed(tmp_path):
    a, b = _run_twice('20_claim_aware.ipynb', tmp_path, ['-p', 'profile', 'smoke'])
    assert _differences(a, b) == []


def _without_wall_time(path: Path) -> bytes:
    "A file's bytes without the lines that report wall time (the only cells a replay may change)."
    if path.suffix in ('.csv', '.md'):
        return b'\n'.join(l for l in path.read_bytes().splitlines() if b'wall' not in l.lower())
    return path.read_bytes()


@pytest.mark.parametrize('nb,slug', [('10_reason_verify.ipynb', 'reason_verify'), ('30_rag2.ipynb', 'rag2'),
                                     ('40_verirag.ipynb', 'verirag'), ('50_pubmed_reasoner.ipynb', 'pubmed_reasoner')])
def test_llm_notebook_replays_from_records_identically_under_two_hash_seeds(nb, slug, tmp_path, monkeypatch):
    "Smoke runs replayed from the committed records (the local LLM cache switched off, so nothing is read from this "
    "machine): no call is computed, and every table and figure is the same bytes under two string-hash seeds."
    if not (REPO / 'records' / slug / 'smoke').exists(): pytest.fail(f"no smoke records for {slug}: run `rag-lab reproduce --profile smoke --record`")
    monkeypatch.setenv('RAG_LAB_LLM_CACHE', 'off')
    monkeypatch.delenv('RAG_LAB_RECORDS', raising=False)
    a, b = _run_twice(nb, tmp_path, ['-p', 'profile', 'smoke'])
    for out in (a, b):
        calls = json.loads((out / 'reports' / slug / 'run_meta.json').read_text())['llm_calls']
        assert calls['computed'] == 0 and calls['record'] == calls['distinct'] > 0, calls
    files = sorted({p.relative_to(a) for p in a.rglob('*') if p.is_file()} | {p.relative_to(b) for p in b.rglob('*') if p.is_file()})
    assert len(files) > 5, files
    differ = [str(f) for f in files if f.name != 'run_meta.json'
              and (not (a / f).exists() or not (b / f).exists() or _without_wall_time(a / f) != _without_wall_time(b / f))]
    assert differ == []
