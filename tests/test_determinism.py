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
from rag_lab.config import LLMParams
from rag_lab.papers import PAPERS
from rag_lab.report import without_wall_time
from conftest import shares_corpus

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
TIME_DEPENDENT = {'run_meta.json', 'table9.csv', 'table9.md', 'figure6.png', 'figure6.pdf'}


def _run_twice(nb: str, tmp_path: Path, repo: Path = REPO, env: dict | None = None) -> tuple[Path, Path]:
    "Run chapter `nb` of checkout `repo` in the smoke profile twice at once, under string-hash seeds 1 and 2: with papermill "
    "(`-p profile smoke`) and under nbdev_test (the smoke profile through IN_TEST, as `make test` runs every notebook), so "
    "one pair of runs also stands for the chapter's nbdev_test (tests/test_notebooks.py leaves it to this file). The two output roots."
    runs = {'1': [str(BIN / 'papermill'), nb, str(tmp_path / 'executed1.ipynb'), '--no-progress-bar', '-p', 'profile', 'smoke'],
            '2': [str(BIN / 'nbdev_test'), '--path', str(repo / 'nbs' / nb), '--do_print']}
    procs, outs = [], []
    for seed, cmd in runs.items():
        out = tmp_path / f'hashseed{seed}'
        kenv = {k: v for k, v in os.environ.items() if k != 'IN_TEST'} | (env or {}) | dict(PYTHONHASHSEED=seed, RAG_LAB_OUT=str(out))
        procs.append(subprocess.Popen(cmd, cwd=repo / 'nbs' if seed == '1' else repo, env=kenv,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs.append(out)
    for p, (seed, cmd) in zip(procs, runs.items()):
        log, _ = p.communicate(timeout=1200)
        assert p.returncode == 0, f"{Path(cmd[0]).name} {nb} (PYTHONHASHSEED={seed}) failed:\n{log[-3000:]}"
    return outs[0], outs[1]


def _differences(a: Path, b: Path, # two output roots
                 least: int = 10, # fewer files than this: the runs wrote too little to compare
                ) -> list[str]: # files written by one run only, or whose bytes differ (wall-time lines aside)
    "The output files on which two runs disagree; files that measure time rather than results are left out."
    files = sorted({p.relative_to(a) for p in a.rglob('*') if p.is_file()} | {p.relative_to(b) for p in b.rglob('*') if p.is_file()})
    assert len(files) > least, files
    return [str(f) for f in files if f.name not in TIME_DEPENDENT
            and (not (a / f).exists() or not (b / f).exists() or without_wall_time(a / f) != without_wall_time(b / f))]


def test_claim_aware_outputs_do_not_depend_on_the_hash_seed(tmp_path):
    a, b = _run_twice('20_claim_aware.ipynb', tmp_path)
    assert _differences(a, b) == []


# the chapters that call an LLM (their parameter class is an LLMParams), from the registry
LLM_SLUGS = tuple(s for s, p in PAPERS.items() if issubclass(p.params, LLMParams))


def _clean_clone(tmp_path: Path) -> tuple[Path, dict]:
    "A fresh clone of this checkout, and the environment that runs its own code with no LLM cache (models shared)."
    clone = tmp_path / 'clone'
    subprocess.run(['git', 'clone', '-q', str(REPO), str(clone)], check=True)
    env = {k: v for k, v in os.environ.items() if k not in ('IN_TEST', 'RAG_LAB_RECORDS', 'RAG_LAB_OUT')} | dict(
        PYTHONPATH=str(clone), RAG_LAB_LLM_CACHE='off', RAG_LAB_CACHE=os.environ.get('RAG_LAB_CACHE', str(REPO / '.cache')))
    return clone, env


def _recorded_digests(folder: Path) -> dict[str, str]:
    "The table digests a recording run wrote beside its records (`tables.sha256`: digest, two spaces, file name)."
    return dict(reversed(l.split('  ', 1)) for l in (folder / 'tables.sha256').read_text().splitlines())


@pytest.mark.parametrize('nb,slug', [pytest.param(PAPERS[s].notebook, s, marks=shares_corpus(s)) for s in LLM_SLUGS])
def test_llm_notebook_replays_its_smoke_records_on_a_clean_checkout_identically_under_two_hash_seeds(nb, slug, tmp_path):
    "A fresh clone (no LLM cache, its own code and records) runs the chapter's smoke profile with papermill under two "
    "string-hash seeds at once: no call is computed, every table and figure is the same bytes in both runs (wall-time "
    "lines aside), and the tables are those of the run that made the records (`tables.sha256`). One pair of runs per "
    "chapter checks the hash seed, the clean checkout and the records."
    from rag_lab.report import table_digests
    clone, env = _clean_clone(tmp_path)
    if not (clone / 'records' / slug / 'smoke' / 'tables.sha256').exists():
        pytest.fail(f"no committed smoke records for {slug}: run `rag-lab reproduce --profile smoke --only {slug} --record` and commit records/")
    a, b = _run_twice(nb, tmp_path, clone, env)
    head = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=clone, capture_output=True, text=True).stdout
    for out in (a, b):
        meta = json.loads((out / 'reports' / slug / 'run_meta.json').read_text())
        calls = meta['llm_calls']
        assert calls['computed'] == 0 and calls['record'] == calls['distinct'] > 0, calls
        assert meta['git_commit'][:7] == head[:7], (meta['git_commit'], head)   # the clone's own code ran
    assert _differences(a, b, least=5) == []
    assert table_digests(a / 'reports' / slug) == _recorded_digests(clone / 'records' / slug / 'smoke')


# the chapter notebooks whose nbdev_test run is one of this file's pairs (tests/test_notebooks.py skips them)
NBDEV_TESTED_THERE = ('20_claim_aware.ipynb', *(PAPERS[s].notebook for s in LLM_SLUGS))


# default-profile chapters whose replay takes about a minute (rag2's needs ~20 min of retrieval: left to `make reproduce`)
QUICK_DEFAULT_REPLAYS = tuple(s for s in LLM_SLUGS if s != 'rag2')


@pytest.mark.parametrize('slug', [pytest.param(s, marks=shares_corpus(s)) for s in QUICK_DEFAULT_REPLAYS])
def test_default_records_replay_on_a_clean_checkout_to_the_published_tables(tmp_path, slug):
    "The published default run of an LLM chapter replays on a fresh clone, computing no call, to its published tables."
    from rag_lab.report import table_digests
    clone, env = _clean_clone(tmp_path)
    digests = clone / 'records' / slug / 'default' / 'tables.sha256'
    if not digests.exists(): pytest.fail(f"no committed {digests.relative_to(clone)}: publish with `rag-lab reproduce --only {slug} --record`")
    out = tmp_path / 'out'
    p = subprocess.run([str(BIN / 'rag-lab'), 'reproduce', '--only', slug, '--out', str(out), '--no-progress'],
                       cwd=clone, env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    meta = json.loads((out / 'reports' / slug / 'run_meta.json').read_text())
    assert meta['profile'] == 'default' and meta['llm_calls']['computed'] == 0, meta['llm_calls']
    recorded = _recorded_digests(digests.parent)
    assert table_digests(out / 'reports' / slug) == recorded
    assert table_digests(clone / 'reports' / slug) == recorded   # and the committed tables are those of the records


def test_comparison_recomputes_its_published_table_on_a_clean_checkout(tmp_path):
    "The cross-paper chapter (no model call) rerun on a fresh clone from the chapters' published predictions writes its "
    "published tables and figure again, byte for byte (wall-time lines aside)."
    from rag_lab.report import table_digests
    clone = tmp_path / 'clone'
    subprocess.run(['git', 'clone', '-q', str(REPO), str(clone)], check=True)
    published = clone / 'reports' / 'comparison'
    if not (published / 'cross_paper.csv').exists(): pytest.fail("no published reports/comparison: run `rag-lab reproduce --only comparison`")
    before, png = table_digests(published), (clone / 'figures' / 'comparison' / 'accuracy_vs_compute.png').read_bytes()
    env = {k: v for k, v in os.environ.items() if k not in ('IN_TEST', 'RAG_LAB_RECORDS', 'RAG_LAB_OUT')} | dict(PYTHONPATH=str(clone))
    p = subprocess.run([str(BIN / 'rag-lab'), 'reproduce', '--only', 'comparison', '--no-progress'],
                       cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    assert json.loads((published / 'run_meta.json').read_text())['profile'] == 'default'
    assert {'cross_paper.csv'} <= {Path(f).name for f in before}, before
    assert table_digests(published) == before
    assert (clone / 'figures' / 'comparison' / 'accuracy_vs_compute.png').read_bytes() == png
