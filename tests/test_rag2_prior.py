"""Tests of RAG²'s rows against the answer prior: `headline_rows` (report.prior_rows over the pooled subset and each
dataset, the published paired values unchanged) and `content_free_answers` (the content-free prompt of each system)."""
import os
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

os.environ.setdefault('HF_HUB_OFFLINE', '1')
from rag_lab.parsing import ParsedAnswer
from rag_lab.metrics import content_free_bias, gold_logprob
from rag_lab.report import GOLD_LOGPROB, MARGIN_AUROC, calibration_offsets, calibration_rows
from rag_lab.papers.rag2 import (CONTENT_FREE, RAG2_SYSTEMS, answer_messages, comparison_of, content_free_answers, headline_rows,
                                 paired_accuracy_rows, EXPERT_SYSTEM)

OPTS = {'A': 'Vitamin A', 'B': 'Vitamin C', 'C': 'Vitamin D', 'D': 'Vitamin K'}
SYS = ['closed book', 'RAG²']


def _lp(pred: str, letters: str = 'ABCD') -> dict:
    return {o: (-0.3 if o == pred else -1.9) for o in letters}


def _frame(rows: dict[str, list[tuple[str, str, str]]]) -> pd.DataFrame:
    "dataset -> [(gold, closed-book answer, RAG² answer)]: items_headline rows, ids that do not sort in sample order."
    return pd.DataFrame([dict(dataset=ds, item_id=f'{ds}-{len(items) - i:03d}', system=s, gold=g, pred=p, correct=p == g,
                              option_logprobs=_lp(p))
                         for ds, items in rows.items() for i, (g, cb, r2) in enumerate(items) for s, p in zip(SYS, (cb, r2))])


letter = st.sampled_from('ABCD')


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(letter, letter, letter), min_size=2, max_size=40), st.lists(st.tuples(letter, letter, letter), min_size=2, max_size=40))
def test_headline_rows_keep_every_paired_value_and_interval(d1, d2):
    "The prior rows repeat paired_accuracy_rows' accuracies, differences and intervals exactly: items keep their sample order."
    f = _frame({'d1': d1, 'd2': d2})
    names = {'d1': 'D1', 'd2': 'D2'}
    hr = headline_rows(f, SYS, [('RAG²', 'closed book')], names, pooled='pooled', dev_gold={'d1': ['A'], 'd2': ['B']})
    par = paired_accuracy_rows(f, SYS, [('RAG²', 'closed book')], names, pooled='pooled')
    g, p = hr.set_index(['row', 'metric']), par.set_index(['row', 'metric'])
    for key in p.index:
        for c in ('ours', 'ci_low', 'ci_high', 'n'):
            a, b = g.loc[key, c], p.loc[key, c]
            assert (pd.isna(a) and pd.isna(b)) or a == pytest.approx(b, abs=1e-12), (key, c)
    assert hr.row.iloc[0].endswith('/ pooled')   # the pooled subset first: the scorecard reads its first verdict


def test_pooled_constant_answers_each_item_with_its_own_datasets_dev_majority():
    f = _frame({'d1': [('A', 'A', 'A'), ('A', 'B', 'A'), ('C', 'C', 'C')], 'd2': [('D', 'A', 'D'), ('D', 'D', 'D'), ('B', 'B', 'A')]})
    hr = headline_rows(f, SYS, [('RAG²', 'closed book')], {'d1': 'D1', 'd2': 'D2'}, pooled='pooled',
                       dev_gold={'d1': list('AAB'), 'd2': list('DDC')}).set_index(['row', 'metric'])
    assert hr.ours['dev majority / pooled', 'accuracy (%)'] == pytest.approx(100 * 4 / 6)   # A on d1's two A, D on d2's two D
    assert hr.ours['always-A / D1', 'accuracy (%)'] == pytest.approx(100 * 2 / 3)
    assert hr.ours['always-D / D2', 'accuracy (%)'] == pytest.approx(100 * 2 / 3)
    assert "d1 A, d2 D" in hr.note['dev majority / pooled', 'accuracy (%)']
    items = [('A', 'A', 'A'), ('A', 'B', 'A'), ('C', 'C', 'C'), ('D', 'A', 'D'), ('D', 'D', 'D'), ('B', 'B', 'A')]
    assert hr.ours['RAG² / pooled', GOLD_LOGPROB] == pytest.approx(np.mean([gold_logprob(_lp(r), g) for g, _, r in items]))
    with pytest.raises(ValueError, match='no dev split'):
        headline_rows(f, SYS, [], {'d1': 'D1', 'd2': 'D2'}, pooled='pooled', dev_gold={'d1': ['A']})


def test_pooled_calibrated_rows_only_when_every_dataset_shares_the_offsets():
    f = _frame({'d1': [('A', 'B', 'A')] * 3, 'd2': [('B', 'B', 'B')] * 3})
    off = {'A': 1.5, 'B': -0.5, 'C': -0.5, 'D': -0.5}
    same = {'d1': {'closed book': off}, 'd2': {'closed book': dict(off)}}
    rows = headline_rows(f, SYS, [], {'d1': 'D1', 'd2': 'D2'}, pooled='pooled', calibration=same, calibration_label='cal').set_index(['row', 'metric'])
    assert rows.ours['closed book, cal / pooled', 'accuracy (%)'] == pytest.approx(50.0)   # +1.5 on A, −0.5 on B: every answer becomes A (right on d1, wrong on d2)
    assert rows.ours['closed book, cal / D1', 'accuracy (%)'] == pytest.approx(100.0) and rows.ours['closed book, cal / D2', 'accuracy (%)'] == 0
    assert ('RAG², cal / pooled', 'accuracy (%)') not in rows.index   # RAG² has no offsets: no calibrated row
    other = {'d1': {'closed book': off}, 'd2': {'closed book': {'A': -0.9, 'B': 0.3, 'C': 0.3, 'D': 0.3}}}
    rows = headline_rows(f, SYS, [], {'d1': 'D1', 'd2': 'D2'}, pooled='pooled', calibration=other, calibration_label='cal')
    assert not (rows.row == 'closed book, cal / pooled').any() and (rows.row == 'closed book, cal / D2').any()


def test_yes_no_subset_gets_always_yes_the_margin_auroc_and_a_two_witness_verdict():
    yes, no = {'A': -0.2, 'B': -2.0, 'C': -3.0}, {'A': -2.0, 'B': -0.2, 'C': -3.0}
    rows = [dict(dataset='pubmedqa', item_id=str(i), system=s, gold=g, pred='A', option_logprobs=(yes if (g == 'A') == (s == 'RAG²') else no) if s == 'RAG²' else yes)
            for i, g in enumerate('AB' * 20) for s in SYS]
    t = headline_rows(pd.DataFrame(rows), SYS, [('RAG²', 'closed book')], {'pubmedqa': 'PubMedQA*'}, dev_gold={'pubmedqa': list('AAB')},
                      names={'A': 'yes', 'B': 'no', 'C': 'maybe'}, yes_no=('A', 'B')).set_index(['row', 'metric'])
    assert t.ours['always-yes / PubMedQA*', 'accuracy (%)'] == pytest.approx(50.0)
    assert 'dev majority' in t.note['always-yes / PubMedQA*', 'accuracy (%)']
    assert t.ours['RAG² / PubMedQA*', MARGIN_AUROC] == pytest.approx(1.0) and t.ours['closed book / PubMedQA*', MARGIN_AUROC] == pytest.approx(0.5)
    # the accuracies tie (both always answer yes), the log-probabilities do not: undecided, never confirmed
    back = comparison_of(t.reset_index(), 'RAG² vs closed book / PubMedQA*')
    assert back['verdict'] == 'undecided' and back['diff'] == 0


class _Seen:
    "Records each scored prompt; leans to option A."
    def __init__(self): self.asked = []
    def choose_option(self, messages, options, prefix=''):
        self.asked.append((messages, dict(options), prefix))
        lp = {k: (-0.5 if k == 'A' else -1.5) for k in options}
        return ParsedAnswer(status='ok', answer='A', logprobs=lp, confidence=0.5)


class _Const:
    def __init__(self, p): self.p, self.seen = p, []
    def predict_proba(self, qs, sn): self.seen.append((list(qs), list(sn))); return np.full(len(sn), self.p)


def test_content_free_prompts_of_each_system():
    m, rejecting = _Seen(), _Const(0.1)
    cf = content_free_answers(m, OPTS, rejecting, threshold=0.5, top_k=3)
    assert list(cf) == list(RAG2_SYSTEMS)
    texts = [msgs[-1]['content'] for msgs, _, _ in m.asked]
    assert not any('Vitamin' in t or 'scurvy' in t for t in texts)                         # no content of a real item
    assert all(opts == {k: CONTENT_FREE for k in OPTS} and prefix == 'Answer:' for _, opts, prefix in m.asked)
    assert cf['closed book']['messages'] == answer_messages(CONTENT_FREE, {k: CONTENT_FREE for k in OPTS})
    assert cf['standard RAG']['messages'] == cf['RAG² without filter']['messages'] == answer_messages(
        CONTENT_FREE, {k: CONTENT_FREE for k in OPTS}, [CONTENT_FREE] * 3)
    assert cf['RAG²']['messages'] == cf['closed book']['messages'] and cf['RAG²']['snippets'] == 0   # filtered out: the fallback
    assert rejecting.seen == [([f'{CONTENT_FREE}\n' + '\n'.join(f'{k}. {CONTENT_FREE}' for k in OPTS)] * 3, [CONTENT_FREE] * 3)]   # the filter saw them
    assert all([x['role'] for x in m] == ['system', 'user'] and m[0]['content'] == EXPERT_SYSTEM
               for m in (a['messages'] for a in cf.values()))   # the chapter's system message, as the headline's
    kept = content_free_answers(_Seen(), OPTS, _Const(0.9), 0.5, 3, systems=['RAG²'])['RAG²']
    assert kept['messages'] == cf['standard RAG']['messages'] and kept['snippets'] == 3
    off = content_free_bias(cf['closed book']['answer'].logprobs)
    assert sum(off.values()) == pytest.approx(0) and off['A'] < 0 < off['B']   # the lean toward A, undone


def test_content_free_keeps_answer_labels_and_refuses_unknown_systems():
    m = _Seen()
    yn = content_free_answers(m, {'A': 'yes', 'B': 'no', 'C': 'maybe'}, None, 0.5, 1, systems=['closed book'], label_options=True)
    assert 'A. yes\nB. no\nC. maybe' in yn['closed book']['messages'][-1]['content']
    assert 'Question:\nN/A\n' in yn['closed book']['messages'][-1]['content']
    with pytest.raises(ValueError, match='no content-free prompt'): content_free_answers(m, OPTS, None, 0.5, 1, systems=['oracle'])
    with pytest.raises(ValueError, match='top_k'): content_free_answers(m, OPTS, None, 0.5, 0)
    # the offsets as a chapter writes them (its `calibration` table), read back for the cross-paper chapter
    off = content_free_bias(yn['closed book']['answer'].logprobs)
    assert calibration_offsets(calibration_rows({'closed book / PubMedQA*': off})) == {'closed book / PubMedQA*': off}
