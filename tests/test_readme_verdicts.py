"""Issue 28: the README's verdict table is generated from the published tables. The committed README says what the
committed CSVs say (what CI checks), a block edited by hand fails `rag-lab readme --check`, every claim the registry
declares names exactly one row of its table, and only the main job regenerates the block."""
import shutil
from pathlib import Path
import pandas as pd
import pytest
from rag_lab import runner
from rag_lab.papers import CHAPTERS
from rag_lab.runner import VERDICTS_BEGIN, VERDICTS_END, main, readme_with_verdicts, verdict_markdown

REPO = Path(__file__).resolve().parents[1]

def _block(text: str) -> str:
    "What a README holds between its verdict markers."
    return text[text.index(VERDICTS_BEGIN) + len(VERDICTS_BEGIN) + 1:text.index(VERDICTS_END)]


def test_the_readmes_verdict_table_is_the_one_the_committed_tables_give():
    "The committed README's block equals `verdict_markdown` of the committed reports; `rag-lab readme` regenerates it."
    text = (REPO / 'README.md').read_text(encoding='utf-8')
    assert _block(text) == verdict_markdown(REPO), "README.md's verdict table differs from reports/*/: run `rag-lab readme`"
    assert readme_with_verdicts(text, verdict_markdown(REPO)) == text


def test_the_check_fails_on_a_readme_whose_block_was_edited_by_hand(tmp_path, capsys):
    "A hand edit inside the block: --check exits 1 with a diff and changes nothing; `rag-lab readme` restores the block."
    readme = tmp_path / 'README.md'
    shutil.copy(REPO / 'README.md', readme)
    check = ['readme', '--check', '--readme', str(readme), '--out', str(REPO)]
    assert main(check) == 0
    text = readme.read_text(encoding='utf-8')
    line = next(l for l in _block(text).splitlines() if l.startswith('| `'))
    edited = text.replace(line, line.replace(' | ', ' | (by hand) ', 1)) + '\nA line of prose added below.\n'
    readme.write_text(edited, encoding='utf-8')
    capsys.readouterr()
    assert main(check) == 1
    out, err = capsys.readouterr()
    assert f"\n-{line.replace(' | ', ' | (by hand) ', 1)}\n" in out and f'\n+{line}\n' in out, out   # the diff names the line
    assert 'differs from the published tables' in err
    assert readme.read_text(encoding='utf-8') == edited   # --check writes nothing
    assert main(['readme', '--readme', str(readme), '--out', str(REPO)]) == 0
    assert readme.read_text(encoding='utf-8') == text + '\nA line of prose added below.\n'   # only the block was rewritten
    assert main(check) == 0


def test_a_readme_without_the_markers_is_refused(tmp_path, capsys):
    readme = tmp_path / 'README.md'
    readme.write_text('# rag_lab\n\n| chapter | claim |\n|---|---|\n', encoding='utf-8')
    assert main(['readme', '--readme', str(readme), '--out', str(REPO)]) == 2
    assert 'has no verdict block' in capsys.readouterr().err
    assert readme.read_text(encoding='utf-8') == '# rag_lab\n\n| chapter | claim |\n|---|---|\n'


@pytest.mark.parametrize('slug', list(CHAPTERS))
def test_every_declared_claim_names_exactly_one_row_of_the_committed_tables(slug):
    for table, row, metric in CHAPTERS[slug].claims:
        t = pd.read_csv(REPO / 'reports' / slug / f'{table}.csv', dtype={'row': str, 'metric': str})
        assert ((t.row == row) & (t.metric == metric)).sum() == 1, (slug, table, row, metric)


@pytest.fixture
def fake_repo(tmp_path, monkeypatch):
    "A checkout holding the rag2 chapter and a README with a stale block; `_run_all` publishes the committed rag2 outputs."
    repo = tmp_path / 'repo'
    (repo / 'nbs').mkdir(parents=True)
    (repo / 'settings.ini').write_text('[DEFAULT]\n')
    shutil.copy(REPO / 'nbs' / CHAPTERS['rag2'].notebook, repo / 'nbs')   # the runner reads its parameters cell
    (repo / 'README.md').write_text(f'# fake\n\n{VERDICTS_BEGIN}\n| stale |\n{VERDICTS_END}\n')
    monkeypatch.chdir(repo)   # repo_root() is this checkout
    monkeypatch.delenv('RAG_LAB_OUT', raising=False)
    monkeypatch.setenv('RAG_LAB_RECORDS_DIR', str(tmp_path / 'records'))
    def run_all(plan, profile, nbs_dir, root, progress, env, jobs, envs=None, replaying=()):   # instead of papermill: the committed tables, published
        shutil.copytree(REPO / 'reports' / 'rag2', root / 'reports' / 'rag2', dirs_exist_ok=True)
        return {s: 'ok' for s in plan}
    monkeypatch.setattr(runner, '_run_all', run_all)
    return repo


def test_the_main_job_regenerates_the_readme_and_no_other_run_does(fake_repo, tmp_path, capsys):
    readme, stale = fake_repo / 'README.md', (fake_repo / 'README.md').read_text()
    nbs = str(fake_repo / 'nbs')
    assert runner.reproduce('default', ['rag2'], notebooks=nbs, out=str(tmp_path / 'scratch'), progress=False) == 0
    assert runner.reproduce('smoke', ['rag2'], notebooks=nbs, publish=True, progress=False) == 0   # published, another profile
    assert readme.read_text() == stale
    assert runner.reproduce('default', ['rag2'], notebooks=nbs, publish=True, progress=False) == 0
    assert _block(readme.read_text()) == verdict_markdown(fake_repo) and '| `rag2` |' in readme.read_text()
    assert 'verdict table regenerated' in capsys.readouterr().out


def test_the_main_job_says_so_when_it_cannot_regenerate_the_readme(fake_repo, capsys):
    (fake_repo / 'README.md').write_text('# fake, without markers\n')
    assert runner.reproduce('default', ['rag2'], notebooks=str(fake_repo / 'nbs'), publish=True, progress=False) == 1
    assert 'has no verdict block' in capsys.readouterr().err
