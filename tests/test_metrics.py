"Tests of rag_lab.metrics (ranx metrics, paired bootstrap, selective answering, evidence F1s)."
import math
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st
from rag_lab.metrics import as_qrels, ir_metrics, per_query, compare_runs, gate_sweep, risk_coverage, aurc, aurc_optimal
from rag_lab.metrics import token_f1, sentence_f1
from rag_lab.metrics import (binary_bootstrap_ci, binary_confusion, binary_metrics, bootstrap_ci, macro_f1_from_confusion,
    mcc_from_confusion, metrics_from_confusion, outcome_codes, paired_binary_bootstrap, paired_bootstrap)

QRELS = {'q1': {'d2', 'd5'}, 'q2': {'d1'}}
RUN = {'q1': {'d1': 5.0, 'd2': 4.0, 'd3': 3.0, 'd4': 2.0, 'd5': 1.0}, 'q2': {'d3': 2.0, 'd1': 1.5}}

def paper_ndcg(ranked, relevant, k):
    dcg = sum((2 ** (d in relevant) - 1) / math.log2(i + 2) for i, d in enumerate(ranked[:k]))
    return dcg / sum(1 / math.log2(i + 2) for i in range(min(k, len(relevant))))

def test_paper_definitions_agree_with_ranx():
    for k in (1, 2, 3, 5, 10):
        m = ir_metrics(QRELS, RUN, [f'ndcg@{k}', f'recall@{k}'])
        assert math.isclose(m[f'ndcg@{k}'], np.mean([paper_ndcg(list(RUN[q]), QRELS[q], k) for q in QRELS]), rel_tol=1e-9)
        assert math.isclose(m[f'recall@{k}'], np.mean([len(set(list(RUN[q])[:k]) & QRELS[q]) / len(QRELS[q]) for q in QRELS]), rel_tol=1e-9)

def test_qrels_forms_agree():
    df = pd.DataFrame(dict(qid=['q1', 'q1', 'q2'], doc_id=['d2', 'd5', 'd1'], score=[1, 1, 1]))
    assert as_qrels(df) == as_qrels(QRELS) == {'q1': {'d2': 1, 'd5': 1}, 'q2': {'d1': 1}}

def test_bad_runs():
    with pytest.raises(ValueError, match='without qrels'): ir_metrics(QRELS, {**RUN, 'zz': {'d1': 1.0}})
    with pytest.raises(ValueError, match='empty qrels'): ir_metrics({}, RUN)
    # a qrels query that retrieved nothing counts as zero rather than vanishing from the mean
    assert per_query(QRELS, {'q1': RUN['q1'], 'q2': {}}, 'ndcg@10')['q2'] == 0.0
    assert ir_metrics(QRELS, {'q1': RUN['q1']}, ['recall@5'])['recall@5'] == 0.5

def test_compare_runs_against_a_hand_computed_example():
    "Per-query nDCG@10 worked out by hand; the paired difference is their mean, inside its bootstrap interval."
    qrels = {'a': {'x'}, 'b': {'y'}, 'c': {'z'}, 'd': {'w'}}
    better = {q: {d: 2.0, 'n': 1.0} for q, d in (('a', 'x'), ('b', 'y'), ('c', 'z'), ('d', 'w'))}   # relevant at rank 1
    worse = {'a': {'n': 2.0, 'x': 1.0}, 'b': {'n': 2.0, 'y': 1.0}, 'c': {'z': 2.0, 'n': 1.0}, 'd': {'n': 2.0, 'w': 1.0}}
    # nDCG@10 with one relevant document: 1 at rank 1, 1/log2(3) at rank 2
    by_hand = np.mean([1 - 1 / math.log2(3)] * 3 + [0.0])
    c = compare_runs(qrels, better, worse, 'ndcg@10', n_boot=2000)
    assert math.isclose(c['a'], 1.0) and math.isclose(c['b'], (3 / math.log2(3) + 1) / 4)
    assert math.isclose(c['diff'], by_hand, rel_tol=1e-12)
    assert c['lo'] <= c['diff'] <= c['hi'] and c['lo'] >= 0        # never worse on any query: the interval stays >= 0
    assert math.isclose(compare_runs(qrels, worse, better, 'ndcg@10')['diff'], -by_hand, rel_tol=1e-12)
    same = compare_runs(QRELS, RUN, RUN, 'ndcg@10')
    assert same['diff'] == 0 and same['lo'] == 0 and same['hi'] == 0

# --- selective answering ------------------------------------------------------------------------------------------
def test_gate_sweep_counts():
    g = gate_sweep([10, 20, 30, 40], [1, 1, 0, 0], [0, 25, 50])
    assert g.answered.tolist() == [4, 2, 0] and g.risk[1] == 0 and math.isnan(g.risk[2])
    assert np.allclose(g.answer_rate + g.refusal_rate, 1)

def test_selective_bad_input():
    with pytest.raises(ValueError, match='empty'): risk_coverage([], [])
    with pytest.raises(ValueError, match='equal length'): aurc([1, 2], [0])
    with pytest.raises(ValueError, match='NaN'): gate_sweep([np.nan], [0], [0])

floats = st.integers(-100, 100).map(float)  # exact arithmetic, so rescaling cannot create ties
@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(floats, st.integers(0, 1)), min_size=1, max_size=40))
def test_aurc_properties(items):
    c, l = np.array([x[0] for x in items]), np.array([x[1] for x in items], float)
    rc = risk_coverage(c, l)
    assert rc.coverage.iloc[-1] == 1.0 and np.isclose(rc.risk.iloc[-1], l.mean())
    assert np.all(np.diff(rc.coverage) > 0)
    a = aurc(c, l)
    assert aurc_optimal(l) <= a + 1e-12 and 0 <= a <= 1
    assert np.isclose(aurc(c * 3 + 7, l), a)                          # invariant to monotone rescaling

def test_aurc_constant_signal_is_base_rate():
    assert np.isclose(aurc([1.0] * 10, [1, 0] * 5), 0.5)

# --- evidence F1 ------------------------------------------------------------------------------------------------
@settings(deadline=None)
@given(st.lists(st.text(alphabet='abc ', max_size=12), max_size=4))
def test_f1_bounds_and_identity(sents):
    assert 0 <= token_f1(sents, sents) <= 1 and 0 <= sentence_f1(sents, sents) <= 1
    if any(any(ch.isalnum() for ch in s) for s in sents): assert token_f1(sents, sents) == 1.0

# --- binary classification: macro-F1 and MCC

pairs = st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=40)

@settings(deadline=None)   # sklearn's first call imports modules: a loaded CI machine must not fail it on time
@given(pairs)
def test_binary_metrics_match_sklearn(rows):
    from sklearn.metrics import confusion_matrix, f1_score, matthews_corrcoef
    yt, yp = map(list, zip(*rows))
    m = binary_metrics(yt, yp)
    tn, fp, fn, tp = confusion_matrix(yt, yp, labels=[False, True]).ravel()
    assert binary_confusion(yt, yp) == (tp, fp, fn, tn) == (m['tp'], m['fp'], m['fn'], m['tn'])
    assert m['macro_f1'] == pytest.approx(f1_score(yt, yp, average='macro', labels=[False, True], zero_division=0), abs=1e-12)
    assert m['mcc'] == pytest.approx(matthews_corrcoef(yt, yp) if len(set(yt) | set(yp)) > 1 else 0.0, abs=1e-12)
    assert m['accuracy'] == pytest.approx(np.mean(np.array(yt) == np.array(yp))) and m['n'] == len(yt)
    assert metrics_from_confusion(m['tp'], m['fp'], m['fn'], m['tn']) == m

def test_binary_metrics_edge_cases():
    assert (macro_f1_from_confusion(0, 0, 0, 7), mcc_from_confusion(0, 0, 0, 7)) == (0.5, 0.0)   # one class: MCC 0/0 -> 0
    assert (macro_f1_from_confusion(0, 0, 5, 95), mcc_from_confusion(0, 0, 5, 95)) == (95 / 97.5 / 2, 0.0)
    assert mcc_from_confusion(0, 4, 4, 0) == -1.0 and macro_f1_from_confusion(0, 4, 4, 0) == 0.0
    with pytest.raises(ValueError, match='non-negative'): metrics_from_confusion(0, -1, 0, 3)
    with pytest.raises(ValueError, match='empty'): metrics_from_confusion(0, 0, 0, 0)
    with pytest.raises(TypeError): mcc_from_confusion(1.5, 0, 0, 1)
    with pytest.raises(ValueError): binary_metrics([True], [True, False])
    with pytest.raises(ValueError): binary_metrics([], [])
    with pytest.raises(ValueError): outcome_codes([True, False], [True])

def _f1_codes(c):
    "An independent macro-F1 of a resample of outcome codes (0 TN, 1 FP, 2 FN, 3 TP), for the resampling test."
    tn, fp, fn, tp = (int((c == k).sum()) for k in range(4))
    f = lambda a, b, d: 2 * a / (2 * a + b + d) if a + b + d else 0.0
    return (f(tp, fp, fn) + f(tn, fn, fp)) / 2

@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=2, max_size=50))
def test_binary_bootstraps_resample_outcome_codes_with_the_shared_draws(rows):
    yt, ya, yb = map(list, zip(*rows))
    ca, cb = outcome_codes(yt, ya), outcome_codes(yt, yb)
    assert binary_bootstrap_ci(yt, ya, n_boot=300, seed=3) == bootstrap_ci(ca, stat=_f1_codes, n_boot=300, seed=3)
    assert paired_binary_bootstrap(yt, ya, yb, n_boot=300, seed=3) == paired_bootstrap(ca, cb, stat=_f1_codes, n_boot=300, seed=3)
    lo, hi = binary_bootstrap_ci(yt, ya, 'mcc', n_boot=300)
    assert -1 <= lo <= hi <= 1


def test_auroc_has_the_bits_of_the_rank_sum_formula_with_scipy_ranks():
    "The searchsorted AUROC is the Mann-Whitney formula on scipy's average ranks bit for bit (ties, integer scores, "
    "one class, NaN), so that switching to it leaves every published AUROC and interval as it was."
    from scipy.stats import rankdata
    from rag_lab.metrics import _auroc
    rng = np.random.default_rng(7)
    for _ in range(3000):
        n = int(rng.integers(2, 120))
        s = [rng.normal(size=n), rng.integers(0, 4, size=n).astype(float), np.round(rng.normal(size=n), 1)][int(rng.integers(3))]
        y = rng.random(n) < rng.random()
        n1 = int(y.sum()); n0 = n - n1
        want = float((rankdata(s)[y].sum() - n1 * (n1 + 1) / 2) / (n1 * n0)) if n1 and n0 else float('nan')
        got = _auroc(s, y)
        assert got == want or (np.isnan(got) and np.isnan(want)), (s, y, got, want)
    assert np.isnan(_auroc(np.array([0.1, np.nan, 0.3]), np.array([True, False, False])))
