"""The notebooks are clean (nbdev_clean changes nothing) and the library is in sync (nbdev_export changes nothing)."""
import filecmp, shutil, subprocess, sys
from pathlib import Path
import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent

def _copy_project(dest: Path) -> Path:
    for name in ('settings.ini', 'setup.py', 'pyproject.toml'):
        if (REPO / name).exists(): shutil.copy2(REPO / name, dest / name)
    shutil.copytree(REPO / 'nbs', dest / 'nbs')
    shutil.copytree(REPO / 'rag_lab', dest / 'rag_lab', ignore=shutil.ignore_patterns('__pycache__'))
    return dest

def _diff(a: Path, b: Path, pattern: str) -> list[str]:
    "Files under `a` (any depth, e.g. rag_lab/papers/) that differ from their twin under `b`."
    return [str(p.relative_to(a)) for p in sorted(a.rglob(pattern))
            if '__pycache__' not in p.parts and (b / p.relative_to(a)).exists()
            and not filecmp.cmp(p, b / p.relative_to(a), shallow=False)]

@pytest.mark.parametrize('tool,folder,pattern', [('nbdev_clean', 'nbs', '*.ipynb'), ('nbdev_export', 'rag_lab', '*.py')])
def test_nbdev_tool_changes_nothing(tool, folder, pattern, tmp_path):
    work = _copy_project(tmp_path)
    r = subprocess.run([str(BIN / tool)], cwd=work, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    changed = _diff(work / folder, REPO / folder, pattern)
    assert not changed, f"`{tool}` changed {changed}: run `make sync` and commit"
    rel = lambda root: {str(p.relative_to(root)) for p in root.rglob(pattern) if '__pycache__' not in p.parts}
    new = sorted(rel(work / folder) - rel(REPO / folder))
    assert not new, f"`{tool}` created {new}: run `make sync` and commit"
