"""The fresh-clone benchmark's record (`reports/bench/fresh.json`): six stages in order, each a finite number of seconds
>= 0, a CPU model and a core count, and a total that is the sum of the stages; the stage log it is built from."""
import json, math
from pathlib import Path
import pytest
from conftest import shares_corpus
from rag_lab.bench import FRESH_STAGES, check_fresh, fresh_cache, fresh_result, stage_seconds

REPO = Path(__file__).resolve().parents[1]


def _record(**kw):
    return fresh_result(install=312.4, data=3.2, run=700.0, logged=dict(encoding=240.5, training=61.25, report=12.0), **kw)


def test_a_record_adds_up_and_replay_is_the_rest_of_the_chapters_time():
    r = check_fresh(_record(profile='default'))
    assert list(r['stages']) == list(FRESH_STAGES) and r['cores'] >= 1 and r['cpu']
    assert r['stages']['replay'] == pytest.approx(700.0 - 240.5 - 61.25 - 12.0)
    assert r['total_seconds'] == pytest.approx(312.4 + 3.2 + 700.0)
    assert check_fresh(json.loads(json.dumps(r))) == r   # as written and read back


@pytest.mark.parametrize('edit,message', [
    (lambda r: r | dict(total_seconds=r['total_seconds'] + 1), 'not the sum'),
    (lambda r: r | dict(stages={k: v for k, v in r['stages'].items() if k != 'training'}), 'in that order'),
    (lambda r: r | dict(stages=dict(reversed(list(r['stages'].items())))), 'in that order'),
    (lambda r: r | dict(stages=r['stages'] | dict(data=-0.5)), '>= 0'),
    (lambda r: r | dict(stages=r['stages'] | dict(data=math.nan)), '>= 0'),
    (lambda r: r | dict(stages=r['stages'] | dict(data='3 s')), '>= 0'),
    (lambda r: r | dict(cores=0), 'cores'),
    (lambda r: r | dict(cpu=''), 'cpu'),
    (lambda r: {k: v for k, v in r.items() if k != 'total_seconds'}, 'lacks'),
])
def test_a_broken_record_is_refused(edit, message):
    with pytest.raises(ValueError, match=message): check_fresh(edit(_record()))


def test_the_chapters_cannot_log_more_time_than_they_took():
    "Encoding, training and report happen inside the chapters' run: more of them than its wall time is a broken log."
    with pytest.raises(ValueError, match='>= 0'):
        check_fresh(fresh_result(install=0, data=1, run=10, logged=dict(encoding=8, training=3, report=0)))


def test_two_lanes_sum_the_stages_over_the_lanes_and_total_the_wall():
    "With two notebooks at a time the in-chapter stages add up to the chapters' seconds summed, the total to the run's wall."
    walls = dict(rag2=600.0, reason_verify=300.0, verirag=100.0)
    r = check_fresh(_record(jobs=2, chapter_seconds=walls))
    assert r['lane_seconds'] == pytest.approx(1000.0) and r['run_seconds'] == pytest.approx(700.0)
    assert r['stages']['replay'] == pytest.approx(1000.0 - 240.5 - 61.25 - 12.0)
    assert r['total_seconds'] == pytest.approx(312.4 + 3.2 + 700.0) and r['total_seconds'] < sum(r['stages'].values())
    assert check_fresh(json.loads(json.dumps(r))) == r
    for edit, message in [(dict(total_seconds=r['total_seconds'] + 5), "run's wall"), (dict(lane_seconds=900.0), "lanes"),
                          (dict(chapter_seconds=walls | dict(rag2=500.0)), "chapters' seconds"), (dict(jobs=0), 'jobs')]:
        with pytest.raises(ValueError, match=message): check_fresh(r | edit)
    with pytest.raises(ValueError, match='each chapter'): _record(jobs=2)


def test_stage_log_sums_per_stage_and_refuses_an_unknown_stage(tmp_path):
    log = tmp_path / 'stages.jsonl'
    log.write_text(''.join(json.dumps(d) + '\n' for d in [dict(stage='encoding', seconds=1.5, what='a'),
                   dict(stage='encoding', seconds=2.0, what='b'), dict(stage='report', seconds=0.25, what='c')]))
    assert stage_seconds(log) == dict(encoding=3.5, training=0.0, report=0.25)
    assert stage_seconds(tmp_path / 'none.jsonl') == dict(encoding=0.0, training=0.0, report=0.0)
    log.write_text(json.dumps(dict(stage='replay', seconds=1, what='x')) + '\n')
    with pytest.raises(ValueError, match="unknown stage 'replay'"): stage_seconds(log)


def test_a_fresh_cache_holds_only_what_the_install_leaves(tmp_path):
    src = tmp_path / 'cache'
    for d in ('models', 'llama-server', 'embeddings', 'llm'): (src / d).mkdir(parents=True)
    dest = fresh_cache(tmp_path / 'fresh', src)
    assert sorted(p.name for p in dest.iterdir()) == ['llama-server', 'models'] and (dest / 'models').is_symlink()
    with pytest.raises(ValueError, match='not empty'): fresh_cache(dest, src)


def test_the_published_benchmark_if_any_is_valid():
    "A committed `reports/bench/fresh.json` (the closing figures of issue 36) passes the same check."
    p = REPO / 'reports' / 'bench' / 'fresh.json'
    if not p.exists(): pytest.skip('no published fresh-clone benchmark yet (make bench-fresh writes it)')
    check_fresh(json.loads(p.read_text()))


README_STAGE_NAMES = dict(install='install', data='data checks', encoding='encoding', training='training', replay='replay',
                          report='reports')


def test_the_readme_quotes_the_committed_fresh_benchmark():
    "The README's fresh-clone figures are those `make bench-fresh` wrote: the total, every stage, every chapter, the lanes."
    r = check_fresh(json.loads((REPO / 'reports' / 'bench' / 'fresh.json').read_text()))
    text = ' '.join((REPO / 'README.md').read_text().split())
    quoted = [f"**{r['total_seconds'] / 60:.1f} min**", *(f"{README_STAGE_NAMES[k]} {v:.0f} s" for k, v in r['stages'].items()),
              *(f"{slug} {v:.0f} s" for slug, v in r.get('chapter_seconds', {}).items())]
    if r.get('jobs', 1) > 1: quoted += [f"{r['jobs']} notebooks at a time", f"{r['run_seconds']:.0f} s wall"]
    assert not [q for q in quoted if q not in text], [q for q in quoted if q not in text]


def _class_record(**chapters):
    from rag_lab.bench import CLASS_SECONDS_LIMIT
    cs = {k: dict(seconds=s, replayed=10, computed=c, within_limit=s <= CLASS_SECONDS_LIMIT and c == 0) for k, (s, c) in chapters.items()}
    return dict(cpu='AMD EPYC', cores=2, limit_seconds=CLASS_SECONDS_LIMIT, chapters=cs, total_seconds=sum(s for s, _ in chapters.values()))


@pytest.mark.parametrize('edit,message', [
    (lambda r: r | dict(total_seconds=r['total_seconds'] + 1), 'not the sum'),
    (lambda r: r | dict(chapters={}), 'no chapters'),
    (lambda r: r | dict(chapters=r['chapters'] | dict(a=r['chapters']['a'] | dict(seconds=-1.0))), '>= 0'),
    (lambda r: r | dict(chapters=r['chapters'] | dict(a=r['chapters']['a'] | dict(computed='0'))), '>= 0'),
    (lambda r: r | dict(chapters=r['chapters'] | dict(b=r['chapters']['b'] | dict(within_limit=True))), 'within_limit'),
    (lambda r: {k: v for k, v in r.items() if k != 'cpu'}, 'lacks'),
])
def test_a_broken_class_record_is_refused(edit, message):
    from rag_lab.bench import check_class
    r = _class_record(a=(30.0, 0), b=(75.0, 0))   # b took longer than the limit: not within it
    assert check_class(r) == r and not r['chapters']['b']['within_limit']
    with pytest.raises(ValueError, match=message): check_class(edit(r))


@shares_corpus('reason_verify')[0]   # beside the other reason_verify runs' worker it would encode the corpus again
@pytest.mark.warm_corpus
def test_the_class_benchmark_times_a_real_replay_of_the_teaching_path(tmp_path):
    "One chapter of the class profile through `python -m rag_lab.bench class`: a valid record, every call replayed. The "
    "same run is the teaching path's test (its outputs kept): `--profile class` replays the default records for 20 items "
    "(0 calls computed: its fresh budget is 0, so a missing record stops it), and its tables, index and run record say "
    "it is a scratch run."
    import os, subprocess, sys
    runs = tmp_path / 'runs'
    env = {**os.environ, 'RAG_LAB_LLM_CACHE': 'off'}   # the records alone
    p = subprocess.run([sys.executable, '-m', 'rag_lab.bench', 'class', '--only', 'reason_verify', '--out', str(tmp_path),
                        '--keep', str(runs)], capture_output=True, text=True, cwd=REPO, timeout=900, env=env)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    from rag_lab.bench import check_class
    r = check_class(json.loads((tmp_path / 'reports' / 'bench' / 'class.json').read_text()))
    c = r['chapters']['reason_verify']
    assert c['computed'] == 0 and c['replayed'] > 0, c
    assert '| reason_verify |' in (tmp_path / 'reports' / 'bench' / 'class.md').read_text()
    out = runs / 'reason_verify'
    meta = json.loads((out / 'reports' / 'reason_verify' / 'run_meta.json').read_text())
    assert meta['llm_calls']['computed'] == 0 and meta['llm_calls']['record'] > 100, meta['llm_calls']
    assert meta['params']['n'] == 20 and meta['banner'].startswith('scratch run: profile class, n = 20'), meta.get('banner')
    published_n = json.loads((REPO / 'reports' / 'reason_verify' / 'run_meta.json').read_text())['params']['n']
    assert f'published n = {published_n}' in meta['banner']
    index = (out / 'reports' / 'index.md').read_text()
    assert 'Scratch run, not the published results' in index and meta['banner'] in index
    assert f"**{meta['banner']}**" in (out / 'reports' / 'reason_verify' / 'headline.md').read_text()


def test_the_readme_quotes_the_committed_class_benchmark():
    "The README's class timings are the ones `make bench-class` wrote (reports/bench/class.json), each within the limit."
    from rag_lab.bench import check_class
    r = check_class(json.loads((REPO / 'reports' / 'bench' / 'class.json').read_text()))
    text = ' '.join((REPO / 'README.md').read_text().split())
    for slug, c in r['chapters'].items():
        assert f"{slug} {c['seconds']:.1f} s" in text, slug
        assert c['within_limit'], (slug, c)
    assert f"({r['total_seconds']:.1f} s in all)" in text
