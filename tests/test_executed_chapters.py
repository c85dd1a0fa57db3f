"""The published run's executed chapters, committed under reports/executed/: a reader opens each on its findings (the main
metric per system, the headline comparisons), sees its figures inline, and reads the run that made the published CSVs."""
import json
import pytest
from rag_lab.config import repo_root
from rag_lab.papers import CHAPTERS
from rag_lab.report import table_digests

ROOT = repo_root()
PUBLISHED = [s for s in CHAPTERS if (ROOT / 'reports' / s / 'run_meta.json').exists()]

def _executed(slug: str) -> dict:
    path = ROOT / 'reports' / 'executed' / CHAPTERS[slug].notebook
    assert path.exists(), f"{path} is missing: `make reproduce` writes it beside the tables; commit it with them"
    assert path.stat().st_size < 2_000_000, f"{path} is {path.stat().st_size / 1e6:.1f} MB (limit 2 MB)"
    return json.loads(path.read_text())

def test_every_chapter_is_published():
    assert set(PUBLISHED) == set(CHAPTERS)

@pytest.mark.parametrize('slug', PUBLISHED)
def test_the_executed_chapter_is_the_run_behind_the_published_tables(slug):
    nb = _executed(slug)
    assert nb['metadata']['rag_lab']['tables'] == table_digests(ROOT / 'reports' / slug), (
        f"reports/executed/{CHAPTERS[slug].notebook} no longer matches reports/{slug}/*.csv: republish the chapter "
        f"(`rag-lab reproduce --only {slug}`) and commit its executed copy with its tables")

@pytest.mark.parametrize('slug', PUBLISHED)
def test_the_executed_chapter_opens_on_its_findings(slug):
    cells = _executed(slug)['cells']
    tagged = [i for i, c in enumerate(cells) if 'findings' in c['metadata'].get('tags', [])]
    first_code = next(i for i, c in enumerate(cells) if c['cell_type'] == 'code')
    assert tagged == [1] and cells[0]['cell_type'] == 'markdown' and ''.join(cells[0]['source']).startswith('# '), tagged
    assert first_code > 1
    text = ''.join(cells[1]['source'])
    stem, metric = CHAPTERS[slug].findings
    assert '## Findings of this run' in text and f'`{stem}.csv`' in text and '\n|---|' in text, text[:500]
    body = [l for l in text.splitlines() if l.startswith('| ') and not l.startswith('| system')]
    assert len(body) >= 2 and all('nan' not in l.lower() for l in body), body
    for _, row, _ in CHAPTERS[slug].claims:   # every comparison the README quotes, with its verdict
        assert any(l.startswith('- ' + row.replace('*', '\\*')) and '— **' in l for l in text.splitlines()), row

@pytest.mark.parametrize('slug', PUBLISHED)
def test_the_executed_chapter_shows_its_figures_and_folds_its_plumbing(slug):
    cells = _executed(slug)['cells']
    shown = sum('image/png' in o.get('data', {}) for c in cells for o in c.get('outputs', []))
    saved = len(list((ROOT / 'figures' / slug).glob('*.png')))
    assert shown >= saved > 0, (shown, saved)
    assert not [c for c in cells for o in c.get('outputs', []) if o.get('output_type') == 'error']
    params = [c for c in cells if {'parameters', 'injected-parameters'} & set(c['metadata'].get('tags', []))]
    assert params and all('hide-cell' in c['metadata']['tags'] for c in params)
    assert not [c for c in cells if 'execution' in c['metadata'] or 'papermill' in c['metadata']]   # times: run_meta.json
