"""Issue 34, third round: `-p` values typed strictly and scoped without order effects; a corrupt or stray file is one
message naming it; a recording run checks its records folder first; staging folders of killed runs are cleaned, and
a failed run never replaces the published executed notebook."""
import os, signal, subprocess, time
from pathlib import Path
import pytest
from rag_lab.config import parse_param
from rag_lab.runner import UsageError, plan_run
from test_runner import BIN, REPO, WRITE_TABLE, _paper_nb, _run

NBS = REPO / 'nbs'

def _tiny(tmp_path: Path, body: str = WRITE_TABLE) -> Path:
    "A notebooks folder holding one tiny reason_verify chapter."
    nbs = tmp_path / 'nbs'; nbs.mkdir(exist_ok=True)
    _paper_nb(nbs / '10_reason_verify.ipynb', body)
    return nbs

def _reproduce(nbs: Path, out: Path, *args: str):
    return _run('reproduce', '--notebooks', str(nbs), '--profile', 'smoke', '--out', str(out), '--no-progress', *args)

def _one_line_naming(stderr: str, path: Path) -> None:
    "The error is one line that names the file, and no traceback."
    assert 'Traceback' not in stderr, stderr
    assert any(str(path) in l for l in stderr.splitlines()), stderr


# 1. Parameters: numbers strictly (JSON `true` is not 1; `1.0` is not the integer 1)

@pytest.mark.parametrize('slug,name,text,msg', [
    ('reason_verify', 'n', 'true', 'a boolean is not a number'),
    ('reason_verify', 'seed', 'false', 'a boolean is not a number'),
    ('reason_verify', 'temperature', 'true', 'a boolean is not a number'),
    ('rag2', 'filter_threshold', 'true', 'a boolean is not a number'),
    ('reason_verify', 'n', '1.0', 'an integer is expected'),
    ('reason_verify', 'max_tokens', '1e3', 'an integer is expected'),
])
def test_a_boolean_or_a_decimal_is_not_taken_for_an_integer(slug, name, text, msg):
    with pytest.raises(ValueError, match='bad value') as e: parse_param(slug, name, text)
    assert msg in str(e.value) and f'{slug}.{name}' in str(e.value), e.value

def test_numbers_and_booleans_that_are_what_they_say_still_parse():
    assert parse_param('reason_verify', 'n', '5') == 5 and parse_param('reason_verify', 'n', 'None') is None
    assert parse_param('reason_verify', 'temperature', '1') == 1.0 and isinstance(parse_param('reason_verify', 'temperature', '1'), float)
    assert parse_param('rag2', 'filter_threshold', 'null') is None
    assert parse_param('rag2', 'require_gain', 'false') is False and parse_param('pubmed_reasoner', 'relax_empty', 'true') is True
    assert parse_param('reason_verify', 'model', '123') == '123'   # a string parameter keeps the text

def test_n_true_on_the_command_line_is_refused_before_any_work(tmp_path):
    r = _reproduce(_tiny(tmp_path), tmp_path / 'out', '-p', 'n=true')
    assert r.returncode == 2 and 'a boolean is not a number' in r.stderr and 'Traceback' not in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / 'out' / 'reports').exists()


# 2. A chapter's own value wins over the global one, whatever their order; one name twice in one scope is refused

@pytest.mark.parametrize('params', [['claim_aware.seed=5', 'seed=3'], ['seed=3', 'claim_aware.seed=5']])
def test_the_chapters_own_value_wins_in_either_order(params):
    plan = plan_run(['reason_verify', 'claim_aware'], params, NBS, 'smoke')
    assert plan == {'reason_verify': {'seed': 3}, 'claim_aware': {'seed': 5}}, plan

@pytest.mark.parametrize('params', [['seed=3', 'seed=4'], ['claim_aware.seed=5', 'claim_aware.seed=6']])
def test_one_parameter_given_twice_with_different_values_is_refused(params):
    with pytest.raises(UsageError, match='given twice') as e: plan_run(['reason_verify', 'claim_aware'], params, NBS, 'smoke')
    assert all(p in str(e.value) for p in params), e.value
    assert plan_run(['claim_aware'], ['seed=3', 'seed=3'], NBS, 'smoke') == {'claim_aware': {'seed': 3}}   # the same twice: harmless

def test_the_help_says_which_value_wins():
    r = _run('reproduce', '--help')
    text = ' '.join(r.stdout.split())
    assert r.returncode == 0 and 'slug.name=value wins over name=value whatever their order' in text, text
    assert 'an integer parameter takes 3, not 3.0 or true' in text, text


# 3. Tracebacks instead of messages

def test_a_corrupt_fresh_estimate_is_one_message_before_any_work(tmp_path, monkeypatch):
    records = tmp_path / 'records'
    est = records / 'reason_verify' / 'smoke' / 'fresh_estimate.json'; est.parent.mkdir(parents=True)
    est.write_text('{"fresh_hours": 0.5')   # cut off mid-write
    monkeypatch.setenv('RAG_LAB_RECORDS_DIR', str(records))
    r = _reproduce(_tiny(tmp_path), tmp_path / 'out', '--jobs', '2')
    assert r.returncode == 2, r.stdout + r.stderr
    _one_line_naming(r.stderr, est)
    assert not (tmp_path / 'out' / 'reports').exists()

def test_list_names_a_corrupt_run_meta_and_lists_every_other_chapter(tmp_path):
    meta = tmp_path / 'reports' / 'rag2' / 'run_meta.json'; meta.parent.mkdir(parents=True)
    meta.write_text('{"profile": "default",')
    r = subprocess.run([str(BIN / 'rag-lab'), 'list'], capture_output=True, text=True, timeout=300,
                       env={**os.environ, 'RAG_LAB_OUT': str(tmp_path)})
    assert r.returncode == 1, r.stdout + r.stderr
    _one_line_naming(r.stderr, meta)
    assert 'pubmed_reasoner: ' in r.stdout and 'comparison: ' in r.stdout   # the chapters after it are still listed

def test_a_stray_run_meta_without_tables_does_not_fail_a_successful_run(tmp_path):
    out = tmp_path / 'out'
    stray = out / 'reports' / 'rag2' / 'run_meta.json'; stray.parent.mkdir(parents=True)
    stray.write_text((REPO / 'reports' / 'rag2' / 'run_meta.json').read_text())   # its tables are not beside it
    r = _reproduce(_tiny(tmp_path), out, '-p', 'n=4')
    assert r.returncode == 0, r.stdout + r.stderr
    assert 'Traceback' not in r.stderr, r.stderr
    assert (out / 'reports' / 'reason_verify' / 'table2.csv').exists()
    assert 'reason_verify' in (out / 'reports' / 'index.md').read_text()   # the index is written; the stray folder is skipped


# 4. A recording run checks its records folder before it starts; tables.sha256 is rewritten only when it changes

RECORDING = ("from rag_lab.calls import LEDGER\n"   # one replayed call: finish() then writes tables.sha256 beside the records
             "LEDGER.calls['ab' * 32] = {'request': {'kind': 'chat'}, 'value': {'text': 'x', 'seconds': 1.0}}\n") + WRITE_TABLE

def test_a_recording_run_into_an_unwritable_records_folder_is_refused_before_any_work(tmp_path, monkeypatch):
    blocker = tmp_path / 'afile'; blocker.write_text('x')   # root writes through chmod; a path under a file it cannot
    monkeypatch.setenv('RAG_LAB_RECORDS_DIR', str(blocker / 'records'))
    r = _reproduce(_tiny(tmp_path, RECORDING), tmp_path / 'out', '--record')
    assert r.returncode == 2, r.stdout + r.stderr
    _one_line_naming(r.stderr, blocker / 'records' / 'reason_verify' / 'smoke')
    assert not (tmp_path / 'out' / 'reports').exists()
    monkeypatch.setenv('RAG_LAB_RECORDS_DIR', str(tmp_path / 'records'))   # the same run into a writable folder records
    assert _reproduce(_tiny(tmp_path, RECORDING), tmp_path / 'out', '--record').returncode == 0
    assert (tmp_path / 'records' / 'reason_verify' / 'smoke' / 'tables.sha256').exists()

def test_a_read_only_records_folder_is_refused(tmp_path, monkeypatch):
    from rag_lab import runner
    (tmp_path / 'records' / 'reason_verify').mkdir(parents=True)
    monkeypatch.setenv('RAG_LAB_RECORDS_DIR', str(tmp_path / 'records'))
    real = os.access
    monkeypatch.setattr(os, 'access', lambda p, mode, **kw: False if Path(p) == tmp_path / 'records' / 'reason_verify' else real(p, mode, **kw))
    with pytest.raises(UsageError, match='read-only') as e: runner.check_records_writable(['reason_verify'], 'smoke')
    assert str(tmp_path / 'records' / 'reason_verify' / 'smoke') in str(e.value)
    runner.check_records_writable(['claim_aware'], 'smoke')   # records/claim_aware/smoke can be created

def test_tables_digests_are_not_rewritten_when_unchanged(tmp_path):
    from rag_lab.config import RunInfo, resolve_params
    from rag_lab.report import Results
    res = Results(RunInfo.start(resolve_params('reason_verify', 'smoke'), 'reason_verify'), tmp_path / 'out')
    res.report_dir.mkdir(parents=True); (res.report_dir / 'table2.csv').write_text('row,metric,ours\na,b,1\n')
    digests = tmp_path / 'records' / 'tables.sha256'
    res._note_digests(digests)
    first = digests.stat()
    res._note_digests(digests)
    assert (digests.stat().st_ino, digests.stat().st_mtime_ns) == (first.st_ino, first.st_mtime_ns)   # not rewritten
    (res.report_dir / 'table2.csv').write_text('row,metric,ours\na,b,2\n')
    res._note_digests(digests)
    assert digests.stat().st_ino != first.st_ino   # a changed table: rewritten


# 5. Staging: a killed run's folder is cleaned at the next start, a live one never; the executed notebook is staged too

def test_a_killed_runs_staging_folder_is_removed_by_the_next_run(tmp_path):
    out, marker = tmp_path / 'out', tmp_path / 'kernel.pid'
    nbs = _tiny(tmp_path, f"import os, pathlib, time\npathlib.Path({str(marker)!r}).write_text(str(os.getpid()))\ntime.sleep(600)\n")
    p = subprocess.Popen([str(BIN / 'rag-lab'), 'reproduce', '--notebooks', str(nbs), '--profile', 'smoke', '--out', str(out),
                          '--no-progress'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            if marker.exists() and marker.read_text(): break
            time.sleep(0.5)
        assert marker.exists(), 'the notebook never started'
    finally:
        os.kill(p.pid, signal.SIGKILL); p.wait()   # the runner dies: no cleanup
        if marker.exists() and marker.read_text():
            try: os.kill(int(marker.read_text()), signal.SIGKILL)   # and its kernel (started by this test, through the runner)
            except ProcessLookupError: pass
    left = [d for d in out.iterdir() if d.name.startswith('.staging-')]
    assert len(left) == 1, left
    old = out / '.staging-rag2-legacy'; old.mkdir()   # an older runner's folder (no owner file), untouched for two days
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    _paper_nb(nbs / '10_reason_verify.ipynb', WRITE_TABLE)
    r = _reproduce(nbs, out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not [d for d in out.iterdir() if d.name.startswith('.staging-')], list(out.iterdir())
    assert left[0].name in r.stdout and old.name in r.stdout, r.stdout   # says what it removed

def test_a_live_runs_staging_folder_is_never_removed(tmp_path):
    from rag_lab.config import new_staging as _new_staging, clean_stale_staging
    out = tmp_path / 'out'; out.mkdir()
    live, owner = _new_staging(out, 'verirag')   # a run of this process, alive
    fresh = out / '.staging-rag2-justmade'; fresh.mkdir()   # no owner file yet, but new: may be a run starting
    try:
        assert clean_stale_staging(out) == [] and live.is_dir() and fresh.is_dir()
        r = _reproduce(_tiny(tmp_path), out)
        assert r.returncode == 0 and live.is_dir(), r.stdout + r.stderr
    finally: owner.close()
    assert clean_stale_staging(out) == [live]   # its run is gone now

def test_a_failed_run_keeps_the_published_executed_notebook(tmp_path):
    nbs, out = _tiny(tmp_path), tmp_path / 'out'
    executed, failed = out / 'reports' / 'executed' / '10_reason_verify.ipynb', out / 'reports' / 'executed' / 'failed' / '10_reason_verify.ipynb'
    assert _reproduce(nbs, out, '-p', 'n=7').returncode == 0
    good = executed.read_bytes()
    _paper_nb(nbs / '10_reason_verify.ipynb', WRITE_TABLE.replace('res.finish()', "raise RuntimeError('boom in analysis')"))
    bad = _reproduce(nbs, out, '-p', 'n=9')
    assert bad.returncode == 1
    assert executed.read_bytes() == good   # the notebook that made the published tables
    assert 'boom in analysis' in failed.read_text() and str(failed) in bad.stderr, bad.stderr
    assert not [d for d in out.iterdir() if d.name.startswith('.staging-')]
    _paper_nb(nbs / '10_reason_verify.ipynb', WRITE_TABLE)
    assert _reproduce(nbs, out, '-p', 'n=8').returncode == 0
    assert not failed.exists() and executed.read_bytes() != good   # a success replaces it and clears the failed copy


def test_the_scorecard_skips_a_chapter_folder_that_holds_no_tables(tmp_path):
    "A stray reports/<slug>/run_meta.json without tables is left out of the scorecard (it used to raise 'No objects to concatenate')."
    from rag_lab.report import scorecard
    (tmp_path / 'reports' / 'rag2').mkdir(parents=True)
    (tmp_path / 'reports' / 'rag2' / 'run_meta.json').write_text('{}')
    assert scorecard(tmp_path).empty
