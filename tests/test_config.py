"""Profiles and parameter schemas: every profile of every paper validates; bad values are refused."""
import pytest
from rag_lab.config import PROFILES, resolve_params, parse_param, param_schema
from rag_lab.papers import CHAPTERS, PAPERS

@pytest.mark.parametrize("slug", CHAPTERS)
@pytest.mark.parametrize('profile', PROFILES)
def test_every_profile_resolves(slug, profile):
    p = resolve_params(slug, profile)
    assert p.profile == profile and p.seed >= 0

@pytest.mark.parametrize("slug", CHAPTERS)
def test_smoke_is_smaller_than_default(slug):
    s, d = resolve_params(slug, 'smoke'), resolve_params(slug, 'default')
    assert s.n is not None and (d.n is None or s.n < d.n)

@pytest.mark.parametrize('slug,name,text', [('rag2', 'helpful_quantile', '1.5'), ('rag2', 'helpful_quantile', 'x'),
                                            ('reason_verify', 'backend', 'gpt'), ('claim_aware', 'seed', '-1'),
                                            ('verirag', 'temperature', '3'), ('pubmed_reasoner', 'batch_size', '0')])
def test_bad_values_refused(slug, name, text):
    with pytest.raises(ValueError, match='bad value'):
        parse_param(slug, name, text)

def test_values_are_typed():
    assert parse_param('rag2', 'helpful_quantile', '0.3') == 0.3
    assert parse_param('reason_verify', 'n', 'None') is None
    assert parse_param('reason_verify', 'base_url', 'http://127.0.0.1:8000/v1') == 'http://127.0.0.1:8000/v1'

def test_git_commit_ignores_outputs_but_not_inputs(tmp_path):
    "A run after another run is not 'dirty' because the first rewrote reports/ or figures/; a changed input is."
    import subprocess
    from rag_lab.config import git_commit
    git = lambda *a: subprocess.run(['git', '-c', 'user.name=t', '-c', 'user.email=t@t', *a], cwd=tmp_path, check=True, capture_output=True)
    (tmp_path / 'reports').mkdir(); (tmp_path / 'reports' / 't.csv').write_text('a\n'); (tmp_path / 'nb.py').write_text('x = 1\n')
    rec = tmp_path / 'records' / 'p' / 'default'; rec.mkdir(parents=True)
    (rec / 'tables.sha256').write_text('a\n'); (rec / 'calls-all.jsonl.gz').write_bytes(b'1')
    git('init', '-q'); git('add', '.'); git('commit', '-qm', 'init')
    clean = git_commit(tmp_path)
    assert len(clean) == 40 and not clean.endswith('+dirty')
    (tmp_path / 'reports' / 't.csv').write_text('b\n'); (rec / 'tables.sha256').write_text('b\n')   # outputs of an earlier chapter
    assert git_commit(tmp_path) == clean
    (rec / 'calls-all.jsonl.gz').write_bytes(b'2')   # recorded calls are what a replay reads: an input
    assert git_commit(tmp_path) == clean + '+dirty'
    git('checkout', '-q', '--', str(rec / 'calls-all.jsonl.gz'))
    (tmp_path / 'nb.py').write_text('x = 2\n')
    assert git_commit(tmp_path) == clean + '+dirty'

def test_readme_table_follows_the_registry(repo):
    "The README's paper table lists exactly the registered papers, in order, with their chapter, method notebooks and module."
    import re
    text = (repo / 'README.md').read_text()
    table = text[text.index('| slug | paper | chapter'):].split('\n\n')[0]
    rows = [l for l in table.splitlines() if re.match(r'\| `[a-z_0-9]+` \|', l)]
    assert [re.match(r'\| `([a-z_0-9]+)`', l).group(1) for l in rows] == list(PAPERS)
    for line, p in zip(rows, PAPERS.values()):
        cells = [c.strip() for c in line.strip('|').split('|')]
        assert f'`nbs/{p.notebook}`' == cells[2], line
        assert all(f'`nbs/{m}`' in cells[3] for m in p.method), line
        assert f"`rag_lab/papers/{p.slug}.py`" in cells[4], line
        assert (repo / 'rag_lab' / 'papers' / f'{p.slug}.py').exists()

def test_old_module_names_are_gone(repo):
    "One name per paper: the pre-registry module names do not come back."
    for old in ('reasonverify', 'reasoner', 'evidence', 'verirag_pipeline', 'eval', 'ireval', 'pubmed', 'biocorpus'):
        assert not (repo / 'rag_lab' / f'{old}.py').exists(), old


@pytest.mark.parametrize('slug,kw,ok', [
    ('rag2', dict(backend='openai', model='m'), False),                                   # ΔPPL labels score after a chat prompt
    ('pubmed_reasoner', dict(backend='openai', model='m', answer_mode='free_text'), False),  # the answer step always scores
    ('verirag', dict(backend='openai', model='m'), False), ('verirag', dict(backend='openai', model='m', answer_mode='free_text', audit_mode='json'), True),
    ('reason_verify', dict(backend='openai', model='m'), False), ('reason_verify', dict(backend='openai', model='m', answer_mode='free_text'), True),
    ('rag2', dict(backend='transformers', model='m'), True),
])
def test_a_backend_that_cannot_run_the_chapter_is_refused_when_the_parameters_are_read(slug, kw, ok):
    "One table (config.BACKEND_CAPABILITIES) and each chapter's needs() decide; rag2 and pubmed_reasoner used to accept "
    "backend=openai and fail mid-run."
    if ok: resolve_params(slug, 'default', **kw)
    else:
        with pytest.raises(ValueError, match="backend 'openai' cannot score"): resolve_params(slug, 'default', **kw)


def test_verirag_over_an_openai_endpoint_needs_the_json_audit_too():
    "The scored methods audit also scores after a chat prompt: free-text answers alone are refused, naming the way out."
    with pytest.raises(ValueError, match="audit_mode=scored .* backend=openai cannot; use audit_mode=json"):
        resolve_params('verirag', 'default', backend='openai', model='m', answer_mode='free_text')
    assert resolve_params('verirag', 'default', backend='openai', model='m', answer_mode='free_text', audit_mode='json').audit_calibration == 'none'
