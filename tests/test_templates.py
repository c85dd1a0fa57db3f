"""The templates for the next paper (`nbs/templates/`, CONTRIBUTING.md) follow the project's contracts as they are now:
the method template runs against the current library, the chapter template has what the runner and the results
contract need."""
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEMPLATES = REPO / 'nbs' / 'templates'


def _cells(name: str) -> list[dict]:
    return json.loads((TEMPLATES / name).read_text())['cells']


def test_the_method_template_runs_against_the_current_library():
    "Every code cell of the method template runs (its parameter class, capability check, prompt builder and lessons)."
    ns: dict = {}
    for c in _cells('N1_slug_method.ipynb'):
        src = ''.join(c['source'])
        if c['cell_type'] == 'code' and not src.startswith('#| default_exp'): exec(compile(src, 'N1_slug_method', 'exec'), ns)
    assert ns['PARAMS'] is ns['TemplateParams'] and set(ns['PROFILES']) == {'smoke', 'default', 'paper'}
    from rag_lab.report import prompt_digests   # the naming rule the digests rely on
    assert 'answer_messages' in ns and 'ANSWER_SYSTEM' in ns


def test_the_chapter_template_has_what_the_runner_and_the_contracts_need():
    cells = _cells('N0_slug.ipynb')
    params = [c for c in cells if 'parameters' in c['metadata'].get('tags', [])]
    code = '\n'.join(''.join(c['source']) for c in cells if c['cell_type'] == 'code')
    assert len(params) == 1 and 'profile = None' in ''.join(params[0]['source'])
    for needed in ("start_notebook('<slug>', globals())", 'accuracy_row', 'comparison_rows', 'res.items', 'res.finish()'):
        assert needed in code, needed
    assert cells[0]['source'][0].startswith('# ') and any(l.startswith('> ') for l in cells[0]['source'])
