"""The packaged copy of the papers' reported numbers is identical to the shared extraction, and parses."""
import pandas as pd
from pathlib import Path
import pytest
from rag_lab.report import paper_table, PAPER_SLUGS

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / 'shared' / 'papers' / 'tables'
PACKAGED = REPO / 'rag_lab' / 'paper_tables'

@pytest.mark.skipif(not SHARED.exists(), reason='shared/ not beside the checkout')
def test_packaged_tables_equal_shared():
    shared = sorted(p.relative_to(SHARED) for p in SHARED.glob('*/*.csv'))
    packaged = sorted(p.relative_to(PACKAGED) for p in PACKAGED.glob('*/*.csv'))
    assert shared == packaged
    for p in shared:   # the packaged copy may add a `tol` column (how close counts as OK); everything else is the paper's
        ours = pd.read_csv(PACKAGED / p, dtype=str, keep_default_na=False)
        pd.testing.assert_frame_equal(ours.drop(columns='tol', errors='ignore'), pd.read_csv(SHARED / p, dtype=str, keep_default_na=False))


def test_tolerances_are_non_negative_numbers():
    for csv in PACKAGED.glob('*/*.csv'):
        df = pd.read_csv(csv, dtype=str, keep_default_na=False)
        if 'tol' not in df: continue
        tol = pd.to_numeric(df.tol.replace('', None))
        assert (tol.dropna() >= 0).all(), csv

@pytest.mark.parametrize('slug', PAPER_SLUGS)
def test_every_reported_number_parses(slug):
    for csv in (PACKAGED / slug).glob('*.csv'):
        if csv.stem == 'derived_confusion_matrices': continue   # different header: counts, not reported cells
        t = paper_table(slug, csv.stem)
        printed = t.paper_text.str.strip() != ''
        bad = t[printed & t.paper.isna()]
        assert bad.empty, f"{csv.name}: unparsed values {bad.paper_text.tolist()[:5]}"


def test_results_table_checks_each_row_against_the_tolerance_in_the_data(tmp_path):
    "claim_aware Table 5: BM25 rows must agree to the printed digit (tol blank), trained rows within their `tol` 0.01."
    from rag_lab.config import RunInfo
    from rag_lab.report import Results
    paper = paper_table('claim_aware', 'table5').set_index(['row', 'metric']).paper
    ours = pd.DataFrame([('BM25', 'nDCG@10', paper['BM25', 'nDCG@10']),                         # the same number: OK
                         ('BM25', 'Recall@10', paper['BM25', 'Recall@10'] + 0.001),             # off by 1e-3: a digit off, close
                         ('Dense-Contrastive', 'nDCG@10', paper['Dense-Contrastive', 'nDCG@10'] + 0.008),  # within 0.01: OK
                         ('Dense-Contrastive', 'Recall@10', paper['Dense-Contrastive', 'Recall@10'] - 0.2),  # off
                         ('Dense-MiniLM', 'nDCG@10', 0.5)],                                      # no paper value: no check
                        columns=['row', 'metric', 'ours'])
    res = Results(RunInfo(slug='claim_aware', profile='smoke', params=dict(seed=1), git_commit='-', started='-', packages={}), out_dir=tmp_path)
    t = res.table('table5', ours, paper_rows='matched').set_index(['row', 'metric'])
    assert t.check.to_dict() == {('BM25', 'nDCG@10'): 'OK', ('BM25', 'Recall@10'): 'close', ('Dense-Contrastive', 'nDCG@10'): 'OK',
                                 ('Dense-Contrastive', 'Recall@10'): 'off', ('Dense-MiniLM', 'nDCG@10'): ''}
    written = pd.read_csv(tmp_path / 'reports' / 'claim_aware' / 'table5.csv', keep_default_na=False)
    assert list(written.columns[:7]) == ['row', 'metric', 'paper', 'ours', 'ci_low', 'ci_high', 'check'] and 'off' in set(written.check)


def test_runtimes_on_the_papers_hardware_are_shown_but_never_judged(tmp_path):
    "claim_aware Table 9 (tol inf): check 'not comparable' survives the CSV round trip, and the scorecard leaves the row out."
    from rag_lab.config import RunInfo
    from rag_lab.report import Results, scorecard
    ours = pd.DataFrame([('BM25 retrieval (300 queries, top-200)', 'Time (s)', 0.13)], columns=['row', 'metric', 'ours'])
    res = Results(RunInfo(slug='claim_aware', profile='smoke', params=dict(seed=1), git_commit='-', started='-', packages={}), out_dir=tmp_path)
    assert res.table('table9', ours, paper_rows='matched').check.tolist() == ['not comparable']
    res.finish()
    written = pd.read_csv(tmp_path / 'reports' / 'claim_aware' / 'table9.csv')
    assert written.check.tolist() == ['not comparable']          # not read back as NaN, unlike 'n/a'
    sc = scorecard(tmp_path).set_index('paper').loc['claim_aware']
    assert (sc.paper_cells, sc.compared, sc.ok_close_off) == (1, 0, '0/0/0')
