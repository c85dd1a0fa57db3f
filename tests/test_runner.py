"""`rag-lab reproduce`: bad requests refused before running; a failing notebook reported, nothing half-written."""
import json, os, subprocess, sys
from pathlib import Path
import nbformat
import pytest
from rag_lab.config import param_schema
from rag_lab.papers import CHAPTERS
from rag_lab.runner import main, notebook_parameters

REPO = Path(__file__).resolve().parents[1]

BIN = Path(sys.executable).parent

def _paper_nb(path: Path, body: str) -> None:
    "A minimal paper notebook with a papermill parameters cell."
    params = nbformat.v4.new_code_cell('profile = None\nn = None\nseed = None', metadata={'tags': ['parameters']})
    code = ("import pandas as pd\nfrom rag_lab.report import start_run\n"
            "P, res = start_run('reason_verify', profile, n=n, seed=seed)\n" + body)
    nb = nbformat.v4.new_notebook(cells=[params, nbformat.v4.new_code_cell(code)])
    nb.metadata['kernelspec'] = {'name': 'python3', 'display_name': 'Python 3', 'language': 'python'}
    nbformat.write(nb, path)

WRITE_TABLE = ("res.table('table2', pd.DataFrame(dict(row=['MedRAG (MedCorp + RRF-4 Retriever) / + GPT-4'], "
               "metric=['BioASQ-Y/N'], ours=[float(P.n)])), model='toy', n=P.n)\nres.finish()\n")

def _run(*args, cwd=None):
    return subprocess.run([str(BIN / 'rag-lab'), *args], capture_output=True, text=True, timeout=300, cwd=cwd)

@pytest.mark.parametrize('args,msg', [
    (['--profile', 'fast'], 'unknown profile'),
    (['--only', 'nope'], 'unknown paper'),
    (['-p', 'nn=3', '--only', 'reason_verify'], 'unknown parameter'),
    (['-p', 'n=abc', '--only', 'reason_verify'], 'bad value'),
    (['-p', 'n=0', '--only', 'reason_verify'], 'bad value'),
    (['-p', 'n', '--only', 'reason_verify'], 'name=value'),
    (['-p', 'seed=4294967296', '--only', 'reason_verify'], 'less than or equal to 4294967295'),
    (['-p', 'bm25_k=100000', '--only', 'reason_verify'], 'less than or equal to 1000'),
    (['-p', 'profile=paper', '--only', 'reason_verify'], 'with --profile, not -p'),
    (['-p', 'reason_verify.profile=paper', '--only', 'reason_verify'], 'with --profile, not -p'),
    (['-p', 'out_dir=/etc', '--only', 'reason_verify'], 'unknown parameter'),
])
def test_bad_requests_exit_2_before_running(args, msg, tmp_path):
    r = _run('reproduce', *args, '--out', str(tmp_path))
    assert r.returncode == 2 and msg in r.stderr, r.stderr
    assert not (tmp_path / 'reports').exists()          # nothing ran, nothing written

def test_parameter_not_exposed_by_notebook_is_refused(tmp_path):
    nbs = tmp_path / 'nbs'; nbs.mkdir()
    _paper_nb(nbs / '10_reason_verify.ipynb', WRITE_TABLE)
    r = _run('reproduce', '--notebooks', str(nbs), '--only', 'reason_verify', '-p', 'bm25_k=5', '--out', str(tmp_path / 'o'))
    assert r.returncode == 2 and 'does not expose' in r.stderr

def test_failing_notebook_keeps_previous_outputs_and_exits_1(tmp_path):
    nbs, out = tmp_path / 'nbs', tmp_path / 'out'; nbs.mkdir()
    _paper_nb(nbs / '10_reason_verify.ipynb', WRITE_TABLE)
    ok = _run('reproduce', '--notebooks', str(nbs), '--profile', 'smoke', '-p', 'n=7', '--out', str(out), '--no-progress')
    assert ok.returncode == 0, ok.stdout + ok.stderr
    table = out / 'reports' / 'reason_verify' / 'table2.csv'
    before = table.read_text()
    assert ',92.56,7,,,off,7,smoke,toy,' in before      # paper beside ours (no interval), its check, n, profile, model
    # now the notebook writes a table and then raises: the half-finished run must not replace the good outputs
    _paper_nb(nbs / '10_reason_verify.ipynb', WRITE_TABLE.replace('res.finish()', "raise RuntimeError('boom in analysis')"))
    bad = _run('reproduce', '--notebooks', str(nbs), '--profile', 'smoke', '-p', 'n=9', '--out', str(out), '--no-progress')
    assert bad.returncode == 1
    assert 'FAILED reason_verify' in bad.stdout and 'boom in analysis' in bad.stdout + bad.stderr
    assert table.read_text() == before
    assert 'failed in cell' in (out / 'reports' / 'index.md').read_text()
    assert (out / 'reports' / 'executed' / 'failed' / '10_reason_verify.ipynb').exists()   # the failed run's executed copy shows the error
    assert (out / 'reports' / 'executed' / '10_reason_verify.ipynb').exists()   # beside the published one, which stays
    assert not (nbs / 'reports').exists() and sorted(p.name for p in nbs.iterdir()) == ['10_reason_verify.ipynb']

@pytest.mark.parametrize('slug', [s for s, p in CHAPTERS.items() if (REPO / 'nbs' / p.notebook).exists()])
def test_paper_notebook_exposes_its_whole_schema_to_papermill(slug):
    "Every knob of the notebook's schema is a papermill parameter, readable by papermill itself (kernel and all)."
    import logging, papermill as pm
    path = REPO / 'nbs' / CHAPTERS[slug].notebook
    declared = notebook_parameters(path)
    assert declared == set(param_schema(slug).model_fields), set(param_schema(slug).model_fields) ^ declared
    logging.disable(logging.WARNING)
    try: assert set(pm.inspect_notebook(str(path))) == declared   # comments papermill cannot parse would drop names
    finally: logging.disable(logging.NOTSET)


@pytest.mark.parametrize('make_out,msg', [
    (lambda t: (t / 'afile').write_text('x') and t / 'afile', 'is an existing file'),
    (lambda t: Path('/proc/rag_lab_cannot_write_here'), 'is not writable'),
])
def test_bad_output_folder_is_one_clear_error_before_any_work(make_out, msg, tmp_path):
    out = make_out(tmp_path)
    r = _run('reproduce', '--only', 'reason_verify', '--out', str(out))
    assert r.returncode == 2 and msg in r.stderr and 'Traceback' not in r.stderr, r.stderr


def test_a_second_run_into_the_same_folder_fails_clearly_while_the_first_holds_it(tmp_path):
    from rag_lab.runner import output_lock, reproduce
    nbs, out = tmp_path / 'nbs', tmp_path / 'out'; nbs.mkdir(); out.mkdir()
    _paper_nb(nbs / '10_reason_verify.ipynb', WRITE_TABLE)
    with output_lock(out):     # a first run is writing here
        r = _run('reproduce', '--notebooks', str(nbs), '--profile', 'smoke', '--out', str(out), '--no-progress')
    assert r.returncode == 2 and 'being written by another' in r.stderr and str(os.getpid()) in r.stderr
    assert not (out / 'reports').exists()
    assert _run('reproduce', '--notebooks', str(nbs), '--profile', 'smoke', '--out', str(out), '--no-progress').returncode == 0


def test_concurrent_runs_into_one_folder_never_lose_tables(tmp_path):
    "Two runs started together: one runs, the other waits (--wait) and then runs; both tables are there, no staging left."
    nbs, out = tmp_path / 'nbs', tmp_path / 'out'; nbs.mkdir()
    _paper_nb(nbs / '10_reason_verify.ipynb', WRITE_TABLE + "import time; time.sleep(2)\n")
    procs = [subprocess.Popen([str(BIN / 'rag-lab'), 'reproduce', '--notebooks', str(nbs), '--profile', 'smoke', '-p', f'n={n}',
                               '--out', str(out), '--no-progress', '--wait'], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in (3, 4)]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    assert (out / 'reports' / 'reason_verify' / 'table2.csv').exists()
    assert not [p for p in out.iterdir() if p.name.startswith('.staging')]


def test_kernels_start_with_a_fixed_hash_seed(tmp_path):
    nbs, out = tmp_path / 'nbs', tmp_path / 'out'; nbs.mkdir()
    _paper_nb(nbs / '10_reason_verify.ipynb', WRITE_TABLE + "import os; open(os.environ['RAG_LAB_OUT'] + '/../seed.txt', 'w').write(os.environ.get('PYTHONHASHSEED', 'unset'))\n")
    env = {**os.environ, 'PYTHONHASHSEED': 'random'}
    r = subprocess.run([str(BIN / 'rag-lab'), 'reproduce', '--notebooks', str(nbs), '--profile', 'smoke', '--out', str(out),
                        '--no-progress'], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    from rag_lab.runner import KERNEL_HASHSEED
    assert (out / 'seed.txt').read_text() == KERNEL_HASHSEED


def test_misspelt_parameter_given_to_papermill_directly_stops_the_notebook(tmp_path):
    "Without the runner's checks: papermill only warns about an unknown parameter; the notebook itself refuses it."
    import papermill as pm
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell('profile = None\nseed = None\nn = None', metadata={'tags': ['parameters']}),
        nbformat.v4.new_code_cell("from rag_lab.report import start_notebook\nP, res = start_notebook('reason_verify', globals())")])
    nb.metadata['kernelspec'] = {'name': 'python3', 'display_name': 'Python 3', 'language': 'python'}
    nbformat.write(nb, tmp_path / 'nb.ipynb')
    with pytest.raises(pm.PapermillExecutionError) as e:
        pm.execute_notebook(str(tmp_path / 'nb.ipynb'), str(tmp_path / 'out.ipynb'), parameters=dict(profile='smoke', sed=3),
                            progress_bar=False, kernel_name='python3')
    assert "unknown parameter(s) ['sed']" in str(e.value) and 'valid: profile, seed, n' in str(e.value)


def test_version_list_and_params(repo):
    from rag_lab import __version__
    r = _run('--version')
    assert r.returncode == 0 and r.stdout.strip() == f'rag_lab {__version__}', r.stdout + r.stderr
    r = _run('list')
    assert r.returncode == 0, r.stderr
    for slug, p in CHAPTERS.items():
        assert f'{slug}: ' in r.stdout and p.notebook in r.stdout
    assert 'last published run: profile default' in r.stdout   # the committed claim_aware results
    r = _run('params', 'claim_aware')
    assert r.returncode == 0 and 'rrf_k (int): smoke=60, default=60, class=60, paper=60' in r.stdout, r.stdout
    assert 'dense_epochs (int): smoke=2, default=40, class=5, paper=40' in r.stdout   # the class profile trains briefly
    r = _run('params', 'nope')
    assert r.returncode == 2 and 'unknown paper' in r.stderr


# a smoke run writing to a scratch folder and leaving git status clean: tests/test_site.py, whose site is built from that run


def test_the_users_llm_threads_reach_the_kernel(monkeypatch, tmp_path):
    "RAG_LAB_LLM_THREADS=1 set by the user must reach every kernel; with --jobs 1 the runner used to overwrite it with "
    "None, which dropped it, so each kernel ran llama.cpp on every core (on a shared machine 5-20x slower)."
    from rag_lab import runner
    seen = []
    monkeypatch.setattr(runner, 'run_notebook', lambda slug, p, nbs, root, progress, env: seen.append({**os.environ, **env}) or 'ok')
    monkeypatch.setenv('RAG_LAB_LLM_THREADS', '1')
    runner._run_all({'claim_aware': {}}, 'smoke', REPO / 'nbs', tmp_path, False, dict(RAG_LAB_RECORD=None), jobs=1)
    assert seen[-1].get('RAG_LAB_LLM_THREADS') == '1'
    monkeypatch.delenv('RAG_LAB_LLM_THREADS')
    runner._run_all({'claim_aware': {}, 'verirag': {}}, 'smoke', REPO / 'nbs', tmp_path, False, {}, jobs=2)
    assert seen[-1].get('RAG_LAB_LLM_THREADS') == str(max(1, len(os.sched_getaffinity(0)) // 2))


def test_the_users_run_state_reaches_the_kernel_and_a_bad_value_is_refused_first(tmp_path, monkeypatch):
    "The run state travels as one object (`RunContext`): the user's RAG_LAB_RECORDS=off and RAG_LAB_LLM_THREADS reach the "
    "kernel (RAG_LAB_RECORDS used to be dropped by the runner unless --fresh), and RAG_LAB_LLM_CACHE=bogus is refused "
    "before any notebook starts (it used to fail inside the kernel)."
    nbs, out = tmp_path / 'nbs', tmp_path / 'out'; nbs.mkdir()
    _paper_nb(nbs / '10_reason_verify.ipynb', WRITE_TABLE.replace("model='toy'", "model='toy'").replace(
        "res.finish()", "from rag_lab.config import run_context\nctx = run_context()\n"
        "res.table('state', pd.DataFrame(dict(row=[ctx.records_mode], metric=[str(ctx.llm_threads)], ours=[1.0])))\nres.finish()"))
    monkeypatch.setenv('RAG_LAB_RECORDS', 'off'); monkeypatch.setenv('RAG_LAB_LLM_THREADS', '1')
    ok = _run('reproduce', '--notebooks', str(nbs), '--profile', 'smoke', '-p', 'n=3', '--out', str(out), '--no-progress')
    assert ok.returncode == 0, ok.stdout + ok.stderr
    state = (out / 'reports' / 'reason_verify' / 'state.csv').read_text().splitlines()[1]
    assert state.startswith('off,1,'), state
    monkeypatch.setenv('RAG_LAB_LLM_CACHE', 'bogus')
    bad = _run('reproduce', '--notebooks', str(nbs), '--profile', 'smoke', '-p', 'n=3', '--out', str(tmp_path / 'o2'), '--no-progress')
    assert bad.returncode == 2 and 'RAG_LAB_LLM_CACHE' in bad.stderr, bad.stderr
    assert not (tmp_path / 'o2' / 'reports').exists()


def test_parallel_lanes_start_the_longest_chapters_first(monkeypatch, tmp_path, capsys):
    "With --jobs 2 the chapters start by the compute their records took (most first); dependent chapters still run last."
    from rag_lab import runner
    started = []
    monkeypatch.setattr(runner, 'run_notebook', lambda slug, p, nbs, root, progress, env: started.append(slug) or 'ok')
    plan = {s: {} for s in ('claim_aware', 'reason_verify', 'rag2', 'comparison')}   # registry order
    runner._run_all(plan, 'smoke', REPO / 'nbs', tmp_path, False, {}, jobs=1)
    assert started == list(plan)   # one lane: registry order
    started.clear()
    runner._run_all(plan, 'smoke', REPO / 'nbs', tmp_path, False, {}, jobs=2)
    want = runner.longest_first(['claim_aware', 'reason_verify', 'rag2'], 'smoke')
    assert want[-1] == 'claim_aware' and started[-1] == 'comparison'   # no LLM call: shortest; reads the others: last
    assert set(started[:2]) == set(want[:2]) and set(started[:3]) == set(want)   # the two longest start together
    out = capsys.readouterr().out
    assert all(f'[{i}/4] {s} ' in out for i, s in enumerate(want + ['comparison'], 1)), out


def test_every_reproduce_command_in_the_readme_passes_validation():
    "The README's `rag-lab reproduce` examples are accepted as written (before, each -p value was checked alone against "
    "the default profile, so `--profile paper -p backend=openai` for verirag was refused)."
    import shlex
    from conftest import readme_reproduce_commands
    from rag_lab.runner import _parser, plan_run
    repo = Path(__file__).resolve().parents[1]
    cmds = readme_reproduce_commands()
    assert len(cmds) >= 7, cmds
    assert any('pubmed_reasoner.n_free_text=3' in c for c in cmds)   # the budget's sample command, whole
    for cmd in cmds:
        a = _parser().parse_args(shlex.split(cmd)[1:])
        plan_run(a.only, a.param, repo / 'nbs', a.profile)   # raises UsageError if refused


def _budget_records(tmp_path, rng):
    "A chapter of 400 calls of two kinds with spread-out token counts, and the seconds a fresh run would measure for each."
    from rag_lab.calls import CallRecords
    from rag_lab.runner import nominal_seconds
    recs, calls, truth = CallRecords(tmp_path / 'records'), {}, {}
    for i in range(400):
        if i % 2:
            req, v = {'kind': 'chat', 'i': i}, {'prompt_tokens': int(rng.integers(50, 2000)), 'completion_tokens': int(rng.integers(0, 300))}
            speed = 2.2     # this machine's chat calls run 2.2x slower than nominal ...
        else:
            req, v = {'kind': 'choice', 'i': i}, {'context_tokens': int(rng.integers(50, 2000)), 'n_tokens': [1, 1, 1]}
            speed = 0.4     # ... its scored answers 2.5x faster (KV reuse)
        v['seconds'] = 1.0  # what the records say has nothing to do with today's speed
        calls[f'k{i}'] = {'request': req, 'value': v}
        truth[f'k{i}'] = nominal_seconds(req['kind'], v) * speed * float(rng.lognormal(0, 0.3))
    recs.write('rag2', 'default', calls)
    return recs, truth

def test_fresh_compute_estimate_covers_the_truth_from_a_random_sample(tmp_path):
    "The budget's ratio estimator is unbiased for a random sample: its 95% CI covers the full recomputation's total."
    import numpy as np
    from rag_lab.runner import estimate_fresh_compute
    rng = np.random.default_rng(7)
    recs, truth = _budget_records(tmp_path, rng)
    total, covered, errors = sum(truth.values()) / 3600, 0, []
    for trial in range(40):
        keys = rng.choice(sorted(truth), 40, replace=False)
        est = estimate_fresh_compute(recs, {k: truth[k] for k in keys}, n_boot=400, seed=trial).iloc[0]
        covered += est.ci_low <= total <= est.ci_high
        errors.append(est.fresh_hours / total - 1)
    assert covered >= 32, (covered, total)          # nominal 95%: at least 80% of 40 trials
    assert abs(np.mean(errors)) < 0.03, np.mean(errors)
    # the records' own seconds (1 s each) would have said 0.11 h; the nominal time alone misses the per-kind speeds
    assert abs(est.recorded_hours - 400 / 3600) < 1e-9 and abs(est.nominal_hours / total - 1) > 0.2

def test_budget_command_refuses_a_cache_without_recorded_calls(tmp_path, capsys):
    from rag_lab.calls import LLMCache
    assert main(['records', 'budget', '--cache', str(tmp_path / 'missing.sqlite')]) == 2
    assert 'no LLM cache at' in capsys.readouterr().err
    cache = LLMCache(tmp_path / 'calls.sqlite')
    cache.put('not-a-recorded-call', {'text': 'x', 'seconds': 3.0}, kind='chat')
    assert main(['records', 'budget', '--cache', str(cache.path)]) == 2
    assert 'holds none of the default profile' in capsys.readouterr().err

def test_lanes_start_by_the_measured_estimate_when_there_is_one(tmp_path, monkeypatch):
    "Records made under a since-fixed bug overstate some chapters: a saved fresh estimate outranks the records' seconds."
    from rag_lab import calls
    from rag_lab.calls import CallRecords
    from rag_lab.runner import FRESH_ESTIMATE, longest_first
    recs = CallRecords(tmp_path / 'records')
    for slug, secs in (('reason_verify', 900.0), ('rag2', 100.0)):
        recs.write(slug, 'default', {f'{slug}-k': {'request': {'kind': 'chat'}, 'value': {'text': 'x', 'seconds': secs}}})
    monkeypatch.setattr(calls, 'call_records', lambda: recs)
    assert longest_first(['rag2', 'reason_verify'], 'default') == ['reason_verify', 'rag2']
    (recs.folder('rag2', 'default') / FRESH_ESTIMATE).write_text(json.dumps({'fresh_hours': 0.5}))   # 1800 s measured
    assert longest_first(['rag2', 'reason_verify'], 'default') == ['rag2', 'reason_verify']

    # a replay is weighed by its measured replay time (the committed fresh benchmark), not by compute it will not do
    from rag_lab import runner as rn
    monkeypatch.setattr(rn, 'replay_seconds', lambda profile: {'rag2': 60.0, 'reason_verify': 600.0})
    assert longest_first(['rag2', 'reason_verify'], 'default', replaying=['rag2', 'reason_verify']) == ['reason_verify', 'rag2']
    assert longest_first(['rag2', 'reason_verify'], 'default', replaying=['reason_verify']) == ['rag2', 'reason_verify']


def test_replay_seconds_come_from_the_fresh_benchmark_of_that_profile(tmp_path, monkeypatch):
    from rag_lab import runner as rn
    monkeypatch.setattr(rn, 'repo_root', lambda: tmp_path)
    assert rn.replay_seconds('default') == {}   # no benchmark: nothing measured
    (tmp_path / 'reports' / 'bench').mkdir(parents=True)
    bench = tmp_path / rn.FRESH_BENCH
    bench.write_text(json.dumps({'profile': 'default', 'chapter_seconds': {'rag2': 661.2}}))
    assert rn.replay_seconds('default') == {'rag2': 661.2} and rn.replay_seconds('smoke') == {}
    bench.write_text('{"profile": "default"')
    with pytest.raises(rn.UsageError, match='fresh.json is unreadable'): rn.replay_seconds('default')


def test_a_run_that_would_compute_without_llama_cpp_is_refused_before_it_starts(monkeypatch):
    "`make reproduce` installs no llama-cpp-python; a chapter that would compute llamacpp calls is refused, naming `make install`."
    import importlib.util
    from rag_lab import runner as rn
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, 'find_spec', lambda name, *a: None if name == 'llama_cpp' else real(name, *a))
    plan = {'rag2': {'answer_mode': 'free_text'}, 'claim_aware': {}}
    with pytest.raises(rn.UsageError, match='rag2 would compute.*make install'): rn.check_backend_installed(plan, 'default', ['rag2', 'claim_aware'])
    rn.check_backend_installed(plan, 'default', [])   # a replay computes nothing: no backend needed
    served = {'rag2': {'backend': 'llamaserver', 'base_url': 'http://localhost:1/v1'}}
    rn.check_backend_installed(served, 'default', ['rag2'])   # a server backend needs no llama-cpp-python


def test_a_run_that_would_compute_for_hours_prints_its_estimate_and_asks_for_a_flag(tmp_path):
    "Parameters the records do not cover (another answer mode) mean hours of fresh calls on a CPU: the run prints the "
    "chapter's measured estimate and stops before any notebook starts, unless --allow-fresh is given."
    r = _run('reproduce', '--only', 'rag2', '-p', 'answer_mode=free_text', '--out', str(tmp_path / 'o'), '--no-progress')
    assert r.returncode == 2 and '--allow-fresh' in r.stderr, r.stdout + r.stderr
    assert 'rag2: ≈' in r.stdout and ' h of fresh LLM calls' in r.stdout, r.stdout   # the estimate comes first
    assert not (tmp_path / 'o' / 'reports').exists()
    r = _run('reproduce', '--only', 'reason_verify', '--profile', 'paper', '--out', str(tmp_path / 'p'), '--no-progress')
    assert r.returncode == 2 and 'unknown (no estimate)' in r.stdout, r.stdout + r.stderr   # the paper's models: never silent


def test_a_scratch_run_is_named_by_its_overrides(tmp_path):
    "A run with -p and no --out goes to runs/<date>-<time>-<profile>-<overrides>/, never to a folder that reads like the default run."
    from rag_lab.runner import destination
    dest, published = destination('default', ['n=20', 'reason_verify.n_secondary=5'])
    assert not published and Path(dest).name.endswith('-default-n=20-reason_verify.n_secondary=5'), dest


# the class profile's replay (the teaching path) is tested on the run tests/test_bench.py times:
# test_the_class_benchmark_times_a_real_replay_of_the_teaching_path


def test_try_it_reruns_the_chapter_into_its_own_scratch_folder_and_shows_that_runs_findings(monkeypatch, tmp_path):
    "Issue 35: a chapter's runnable 'Try it' cell. The run itself is `reproduce` (tested above); here what try_it asks of it."
    from rag_lab import runner
    asked = []
    def fake_reproduce(profile, only, params, out=None, allow_fresh=False, **kw):
        asked.append((profile, only, params, out, allow_fresh)); return 0
    monkeypatch.setattr(runner, 'reproduce', fake_reproduce)
    monkeypatch.setattr(runner, 'findings_markdown', lambda root, slug: f'## Findings of this run\n{slug} at {root}')
    for var in ('RAG_LAB_NOTEBOOK', 'IN_TEST'): monkeypatch.delenv(var, raising=False)   # as in JupyterLab
    shown = runner.try_it('claim_aware', rrf_k=10)
    (profile, only, params, out, fresh), = asked
    assert (profile, only, params, fresh) == ('smoke', ['claim_aware'], ['rrf_k=10'], False)
    assert Path(out).parent.name == 'runs' and 'rrf_k' in Path(out).name   # a scratch folder named by the change
    assert shown.data.startswith('## Findings of this run\nclaim_aware at ') and out in shown.data
    with pytest.raises(runner.UsageError, match='unknown parameter'): runner.try_it('claim_aware', nope=1)   # before any run
    assert len(asked) == 1
    monkeypatch.setattr(runner, 'reproduce', lambda *a, **k: 2)
    with pytest.raises(runner.UsageError, match='was refused'): runner.try_it('rag2', profile='class', query_variant='question')
    monkeypatch.setenv('RAG_LAB_NOTEBOOK', 'rag2')   # a batch run of a chapter never starts another run
    assert 'Skipped in a batch run' in runner.try_it('rag2', query_variant='question').data
