"""Execute the library notebooks (nbs/00_*.ipynb to nbs/09_*.ipynb) in place so that each lesson keeps its output, as
nbdev projects do: a reader on a code host or in JupyterLab sees what every lesson shows without running it.
Cells run as under nbdev_test (IN_TEST=1: the smoke profile; `#| notest` cells and `nbdev_export()` calls skipped, and
their old outputs dropped); smoke outputs go to a temporary RAG_LAB_OUT, never into reports/. `make lessons` runs this,
then nbdev_clean. Usage: python tools/execute_lessons.py [notebook ...]   (default: every library notebook)"""
import os, sys, tempfile, time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LIBRARY = sorted(p for p in (REPO / 'nbs').glob('0[0-9]*.ipynb'))   # the shared machinery, in layer order

def skipped(cell) -> bool:
    "What nbdev_test leaves out: markdown, `#| notest` cells, `nbdev_export()` calls."
    return cell.cell_type != 'code' or '#| notest' in cell.source or 'nbdev_export' + '(' in cell.source

def execute(path: Path) -> float:
    "Run one notebook's lessons in its folder and write it back with their outputs; its seconds."
    from execnb.nbio import read_nb, write_nb
    from execnb.shell import CaptureShell
    nb, t0 = read_nb(path), time.time()
    for c in nb.cells:
        if c.cell_type == 'code': c.outputs, c.execution_count = [], None
    cwd = os.getcwd()
    try:
        os.chdir(path.parent)
        shell = CaptureShell(path, mpl_format='png')
        shell.run_all(nb, exc_stop=True, preproc=skipped)
    except Exception:
        sys.stderr.write(shell.prettytb(fname=path) + '\n'); raise SystemExit(f'{path.name}: a lesson failed; nothing written')
    finally: os.chdir(cwd)
    write_nb(nb, path)
    return time.time() - t0

if __name__ == '__main__':
    os.environ['IN_TEST'] = '1'
    os.environ.setdefault('RAG_LAB_OUT', tempfile.mkdtemp(prefix='lessons-'))
    sys.path.insert(0, str(REPO))
    todo = [REPO / 'nbs' / (n if n.endswith('.ipynb') else f'{n}.ipynb') for n in sys.argv[1:]] or LIBRARY
    for p in todo: print(f'{p.name}: {execute(p):.0f} s', flush=True)
