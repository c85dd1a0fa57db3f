"""Issue 35: the library notebooks (00-09) keep their lesson outputs, as nbdev projects do: a reader on a code host or in
JupyterLab sees what each lesson shows without running it (`make lessons` re-executes them, tools/execute_lessons.py)."""
import ast, json
from pathlib import Path
import pytest

REPO = Path(__file__).resolve().parents[1]
TEARDOWN = ('__exit__', 'close', 'stop', 'shutdown', 'cleanup', 'terminate')   # calls that end a lesson's fixture
LIBRARY = sorted(p.name for p in (REPO / 'nbs').glob('0[0-9]*.ipynb'))

def _lessons(nb: dict) -> list[dict]:
    "Code cells a reader runs to learn from: not exported, not skipped by nbdev_test, not the notebook's module line."
    src = lambda c: ''.join(c['source'])
    return [c for c in nb['cells'] if c['cell_type'] == 'code' and not src(c).lstrip().startswith(('#| export', '#| default_exp'))
            and '#| notest' not in src(c)]

def _shows_something(cell: dict) -> bool:
    "The cell ends with an expression (its value is displayed) or prints."
    try: body = ast.parse(''.join(cell['source'])).body
    except SyntaxError: return True   # a magic line: not ours to judge
    last = body[-1] if body else None
    teardown = (isinstance(last, ast.Expr) and isinstance(last.value, ast.Call) and isinstance(last.value.func, ast.Attribute)
                and last.value.func.attr in TEARDOWN)   # e.g. `srv.__exit__()`: returns None, shows nothing
    return bool(body) and not teardown and (isinstance(last, ast.Expr) or 'print(' in ''.join(cell['source']) or 'display(' in ''.join(cell['source']))

def test_there_are_library_notebooks():
    assert len(LIBRARY) >= 14 and LIBRARY[0].startswith('00_')

@pytest.mark.parametrize('name', LIBRARY)
def test_every_lesson_that_shows_a_result_has_its_output_saved(name):
    nb = json.loads((REPO / 'nbs' / name).read_text())
    lessons = _lessons(nb)
    showing = [c for c in lessons if _shows_something(c)]
    assert len(showing) >= 0.6 * len(lessons), f"{name}: only {len(showing)} of {len(lessons)} lessons show a result"
    missing = [c['id'] for c in showing if not c.get('outputs')]
    assert not missing, f"{name}: lessons without their saved output {missing}: run `make lessons` and commit"
    errors = [c['id'] for c in lessons for o in c.get('outputs', []) if o.get('output_type') == 'error']
    assert not errors, f"{name}: saved error outputs in {errors}"
