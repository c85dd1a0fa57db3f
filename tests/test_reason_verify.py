"""Reason and Verify parts (rag_lab.papers.reason_verify): segmentation, label parsing, empty evidence / retrieval, decontamination."""
import math
from collections import Counter
import numpy as np
import pandas as pd
import pytest
from rag_lab.metrics import MIN_DECIDABLE_N
from rag_lab.retrieval import BM25Index, Reranker
from rag_lab.text import Corpus, Document
from rag_lab.papers.reason_verify import CATEGORIES, Demo, Verifier, VerifyTask, agreement, call_accounting, content_words, decontaminate, faithfulness, normalize_label, parse_answer, parse_decomposed, parse_direct, query_overlap, rationale_messages, render_evidence, retrieve_evidence, rewrite_needed, segment_rationale, select_demos, shares_pmid, strip_answer_lines, unique_calls, vanilla_messages


# --- segmentation on tricky text ---------------------------------------------------------------------------------
@pytest.mark.parametrize('text,expected', [
    # abbreviations, initials and decimals never end a sentence
    ('Smith et al. reported a 2.5-fold rise (p < 0.001), i.e. a large effect in adults aged 40-65 years.',
     ['Smith et al. reported a 2.5-fold rise (p < 0.001), i.e. a large effect in adults aged 40-65 years.']),
    ('Dr. J. Doe measured serum ferritin levels. Iron overload was common in cirrhosis [P2].',
     ['Dr. J. Doe measured serum ferritin levels.', 'Iron overload was common in cirrhosis [P2].']),
    # semicolon and a clause marker split; the marker stays with its clause
    ('Metformin lowered HbA1c [P1]; weight fell modestly [P3], therefore glycaemic control improved.',
     ['Metformin lowered HbA1c [P1];', 'weight fell modestly [P3],', 'therefore glycaemic control improved.']),
    # a pronoun-only continuation joins the preceding clause
    ('Statins reduce LDL cholesterol, which suggests it helps.',
     ['Statins reduce LDL cholesterol, which suggests it helps.']),
    # bullets and numbered lists are units; the answer line is dropped
    ('1. Vitamin D improved bone density [P1].\n2) Fracture rates did not change [P2].\nFINAL ANSWER: B. no',
     ['Vitamin D improved bone density [P1].', 'Fracture rates did not change [P2].']),
    ('* Sub-claim: BRCA1 mutations raise breast cancer risk [P4].\n- They also raise ovarian risk [P4].\nANSWER UNAVAILABLE',
     ['Sub-claim: BRCA1 mutations raise breast cancer risk [P4].', 'They also raise ovarian risk [P4].']),
    ('', []),
    ('FINAL ANSWER: A. yes', []),
])
def test_segmentation(text, expected):
    got = segment_rationale(text)
    assert got == expected
    assert Counter(content_words(' '.join(got))) == Counter(content_words(strip_answer_lines(text)))


def test_segmentation_is_deterministic_and_keeps_citations():
    text = 'However, the trial was small [P2]. Because dropout was high, although adherence was good, bias is likely [P3].'
    a, b = segment_rationale(text), segment_rationale(text)
    assert a == b and all(s.strip() for s in a)
    assert '[P2]' in a[0] and any('[P3]' in s for s in a)


# --- verifier output that is not one of the 8 labels ------------------------------------------------------------
def test_invalid_verifier_labels_stay_unlabelled_and_counted():
    labels = parse_direct('{"labels": ["CORRECT-EXPLICIT", "SUPPORTED", "correct implicit", "INCORRECT-PARTIAL"]}', 4)
    assert labels == ['CORRECT-EXPLICIT', None, 'CORRECT-IMPLICIT', None]
    assert faithfulness(labels) == 1.0          # only labelled statements count; nothing mapped to a default
    assert parse_direct('{"labels": ["CORRECT-EXPLICIT"]}', 3) == [None] * 3   # wrong count: untrusted
    assert parse_direct('not json at all', 2) == [None, None]
    assert parse_decomposed('{"statements": [{"relevant": "yes", "support": "explicit", "logical": true, '
                            '"outside_correct": true}]}', 1) == [None]
    assert math.isnan(faithfulness([None, None]))
    assert normalize_label('CORRECT') is None and normalize_label(None) is None
    r = agreement(['CORRECT-EXPLICIT', None, 'INCORRECT-FALSE'], ['CORRECT-EXPLICIT', 'INCORRECT-FALSE', None])
    assert (r['n_pairs'], r['n_dropped']) == (1, 2)
    with pytest.raises(ValueError, match='normalise'):
        faithfulness(['SUPPORTED'])


class _FakeLLM:
    "Returns canned text; records the prompts (stands in for rag_lab.llm's LLM in a unit test)."
    model = 'fake'
    def __init__(self, text): self.text, self.calls = text, []
    def chat(self, msgs, **kw):
        self.calls.append((msgs, kw))
        return type('G', (), {'text': self.text})()


def test_verifier_with_free_text_label_output():
    llm = _FakeLLM('{"labels": ["MOSTLY-CORRECT", "INCORRECT-FALSE"]}')
    v = Verifier(llm, 'direct', constrained=False)
    out = v.verify_many([VerifyTask('q?', '[P1] doc', ['Claim one is here.', 'Claim two is here.']),
                         VerifyTask('q?', '[P1] doc', [])])
    assert out == [[None, 'INCORRECT-FALSE'], []]
    assert len(llm.calls) == 1 and llm.calls[0][1]['json_schema'] is None   # the empty rationale costs no call


# --- empty evidence set / retrieval that returns nothing ---------------------------------------------------------
class _ConstReranker(Reranker):
    def __init__(self, value): self.value = value
    def score(self, q, ids): return np.full(len(ids), self.value)


@pytest.fixture
def tiny():
    c = Corpus([Document('1', 'Aspirin', 'Aspirin lowers the risk of myocardial infarction in adults.'),
                Document('2', 'Statins', 'Statins lower LDL cholesterol in most patients.')], name='tiny')
    return c, BM25Index(c)


def test_empty_evidence_set(tiny):
    corpus, _ = tiny
    assert query_overlap('Does aspirin work?', []) == 0.0
    assert rewrite_needed(0.0, 0.0)
    block = render_evidence([], 'Does aspirin work?')
    assert block == '(no documents were retrieved)'
    for ds in ('bioasq', 'pubmedqa'):
        for msgs in (rationale_messages('Does aspirin work?', block, ds), vanilla_messages('Does aspirin work?', block, ds)):
            assert 'no documents were retrieved' in msgs[-1]['content'] and 'ANSWER UNAVAILABLE' in msgs[-1]['content']
    assert parse_answer('ANSWER UNAVAILABLE', 'bioasq').status == 'unavailable'


class _ScriptedLLM:
    "Answers each call with the next scripted reply; records the prompts (a fake backend for the verifier path)."
    model = 'scripted'
    def __init__(self, *replies): self.replies, self.calls = list(replies), []
    def chat(self, msgs, **kw):
        self.calls.append((msgs, kw))
        return type('G', (), {'text': self.replies.pop(0)})()


def test_verifier_on_the_empty_evidence_block():
    block = render_evidence([], 'Does aspirin prevent stroke?')
    statements = ['Aspirin inhibits platelet aggregation [P1].', 'Stroke risk therefore falls in older adults.']
    task = VerifyTask('Does aspirin prevent stroke?', block, statements)
    # A: the labels a verifier should give when nothing was retrieved are parsed, and Faith(R) is defined
    llm = _ScriptedLLM('{"labels": ["CORRECT-MISSING", "INCORRECT-MISSING"]}')
    labels = Verifier(llm, 'direct').verify_many([task])
    assert labels == [['CORRECT-MISSING', 'INCORRECT-MISSING']] and faithfulness(labels[0]) == 0.5
    sent = llm.calls[0][0][-1]['content']
    assert '(no documents were retrieved)' in sent and 'S2. Stroke risk' in sent   # the empty block reached the verifier
    assert llm.calls[0][1]['json_schema']['properties']['labels']['minItems'] == 2
    # B: 'absent' support maps to the MISSING categories through the fixed rule
    llm = _ScriptedLLM('{"statements": [{"relevant": true, "support": "absent", "logical": true, "outside_correct": true},'
                       '{"relevant": true, "support": "absent", "logical": true, "outside_correct": false}]}')
    labels = Verifier(llm, 'decomposed').verify_many([task])
    assert labels == [['CORRECT-MISSING', 'INCORRECT-MISSING']] and '(no documents were retrieved)' in llm.calls[0][0][-1]['content']
    # a reply with nothing usable leaves every statement unlabelled, and Faith(R) is NaN (documented in faithfulness)
    labels = Verifier(_ScriptedLLM('There are no documents, so nothing can be checked.'), 'direct').verify_many([task])
    assert labels == [[None, None]] and math.isnan(faithfulness(labels[0]))


def test_trigger_needs_an_evidence_score():
    assert rewrite_needed(0.2, 0.9) and rewrite_needed(0.9, 0.2) and not rewrite_needed(0.9, 0.9)
    with pytest.raises(ValueError, match='follows reranking'):
        rewrite_needed(0.9, None)   # no reranker: Algorithm 1 has no trigger (the no-rerank path never calls it)


def test_question_whose_retrieval_returns_nothing(tiny):
    _, bm25 = tiny
    calls = []
    def rewriter(q): calls.append(q); return 'zebrafish xylophone'   # the rewrite finds nothing either
    ev = retrieve_evidence('Is quux frobnicated?', bm25, _ConstReranker(0.9), k=20, m=5, rewriter=rewriter)
    assert ev.ids == [] and ev.scores == [] and ev.overlap == 0.0 and ev.evidence == 0.0
    assert ev.triggered and ev.rewrite_status == 'rewritten' and calls == ['Is quux frobnicated?']
    ev = retrieve_evidence('Is quux frobnicated?', bm25, None, k=20, m=5)
    assert ev.ids == [] and not ev.triggered                      # no reranker: no trigger, empty evidence
    ev = retrieve_evidence('???', bm25, _ConstReranker(0.9), rewriter=None)   # no token at all
    assert ev.ids == [] and ev.triggered and ev.rewrite_status == 'no rewriter'


def test_rewrite_only_when_triggered(tiny):
    _, bm25 = tiny
    seen = []
    ev = retrieve_evidence('Does aspirin lower myocardial infarction risk?', bm25, _ConstReranker(0.9), m=1,
                           rewriter=lambda q: seen.append(q) or q)
    assert not ev.triggered and seen == [] and ev.ids == ['1']
    ev = retrieve_evidence('Does aspirin lower myocardial infarction risk?', bm25, _ConstReranker(0.2), m=1,
                           rewriter=lambda q: q)                   # low evidence score fires; identical rewrite unusable
    assert ev.triggered and ev.rewrite_status == 'unusable' and ev.ids == ['1']


# --- decontamination removes a planted duplicate -----------------------------------------------------------------
def test_decontamination_removes_planted_duplicate():
    from rag_lab.retrieval import SentenceTransformerEncoder
    enc = SentenceTransformerEncoder()
    test_qs = ['Does metformin reduce the risk of colorectal cancer in diabetic patients?',
               'Is vitamin D supplementation associated with fewer hip fractures in the elderly?']
    pool = pd.DataFrame(dict(
        qid=['p1', 'p2', 'p3', 't2'],
        question=['Does metformin lower the risk of colorectal cancer in patients with diabetes?',   # planted paraphrase
                  'Do statins improve survival after sepsis?',
                  'Is coffee consumption linked to Parkinson disease?',
                  'Some other text under a test id'],                                                 # a test question id
        answer=['A', 'B', 'A', 'A']))
    pool_emb, test_emb = enc.encode(list(pool.question), True), enc.encode(test_qs, True)
    kept, removed = decontaminate(pool, pool_emb, ['t1', 't2'], test_emb, threshold=0.9)
    assert list(kept.qid) == ['p2', 'p3']
    assert dict(zip(removed.qid, removed.reason)) == {'p1': 'near-duplicate', 't2': 'evaluation question'}
    assert removed.set_index('qid').max_cos['p1'] >= 0.9
    # a demonstration sharing a PMID with the question is masked for that question only
    assert shares_pmid(['p3', '111'], ['111']) and not shares_pmid(['p3', '222'], ['111'])
    sel = select_demos(test_emb[0], pool_emb[1:3], ['B', 'A'], 2, allowed=np.array([True, False]))
    assert sel == [0]


def test_demo_prompt_carries_gold_only_when_asked():
    d = Demo('d', 'Do statins lower LDL?', 'A', ['Statins'], 'Statins lower LDL [P1].\nFINAL ANSWER: A. yes')
    m = rationale_messages('q?', '[P1] x', 'bioasq', [d])[-1]['content']
    assert m.count('FINAL ANSWER: A. yes') == 1 and 'A. yes, B. no>' in m and 'The correct answer is' not in m   # the demo's line; the format line
    assert 'The correct answer is B. no' in rationale_messages('q?', '[P1] x', 'bioasq', gold='B')[-1]['content']
    assert set(CATEGORIES) == {f'{a}-{b}' for a, bs in (('CORRECT', ('EXPLICIT', 'IMPLICIT', 'ADDITIONAL', 'MISSING')),
                               ('INCORRECT', ('FALSE', 'DEVIATING', 'ILLOGICAL', 'MISSING'))) for b in bs}


# --- model calls shared by experiments are counted once -----------------------------------------------------------
def _record(exp, prompt_tokens, seconds, cached):
    return dict(experiment=exp, kind='chat', backend='fake', model='m', prompt_tokens=prompt_tokens, completion_tokens=10,
                seconds=seconds, wall=0.0, cached=cached)


def test_call_accounting_counts_shared_calls_once_and_tells_cold_from_cached():
    cold = pd.DataFrame([_record('static/k0', 100, 2.5, False), _record('dynamic/k0', 100, 2.5, True),
                         _record('verify/A', 300, 4.0, False), _record('verify/A', 300, 4.0, True)])
    a = call_accounting(cold)
    assert (a['calls_made'], a['distinct_calls'], a['computed'], a['from_earlier_run'], a['served_from_cache']) == (4, 2, 2, 0, 2)
    assert (a['prompt_tokens'], a['completion_tokens'], a['seconds']) == (400, 20, 6.5)
    warm = call_accounting(cold.assign(cached=True))   # the rerun: same distinct totals, nothing computed
    assert (warm['distinct_calls'], warm['computed'], warm['from_earlier_run'], warm['prompt_tokens']) == (2, 0, 2, 400)
    keyed = unique_calls(cold.assign(key=['k1', 'k1', 'k2', 'k3']))   # a recorded cache key wins over the fallback identity
    assert keyed.repeats.tolist() == [2, 1, 1]
    with pytest.raises(ValueError, match='ledger frame'): unique_calls(pd.DataFrame({'experiment': ['x']}))


# --- the headline decision: answers, paired comparisons, intervals, cost ----------------------------------------
from hypothesis import given, settings, strategies as st
from sklearn.metrics import roc_auc_score
from rag_lab.metrics import auroc_ci
from rag_lab.parsing import ParsedAnswer
from rag_lab.papers.reason_verify import (COMPARISONS, SYSTEMS, ReasonVerifyParams, answer_direct, answer_with_rationale,
                                          closed_book_messages, cost_per_item, decomposed_messages, direct_messages,
                                          headline_paper_values, headline_rows, kappa_ci, rationale_prefix, shot_counts)


class _Canned:
    "A stand-in LLM: a canned reply, canned option log-probabilities, and a log of what it was asked."
    model = 'canned'
    def __init__(self, text='', logprobs=None): self.text, self.lp, self.asked = text, logprobs or {}, []
    def chat(self, messages, max_tokens=None):
        self.asked.append(('chat', max_tokens))
        return type('G', (), dict(text=self.text, finish_reason='length' if max_tokens == 1 else 'stop'))()
    def choose_option(self, messages, options, prefix):
        self.asked.append(('choose', prefix))
        best = max(options, key=lambda k: self.lp.get(k, -9.0))
        return ParsedAnswer(status='ok', answer=best, logprobs={k: self.lp.get(k, -9.0) for k in options}, confidence=0.9)


@pytest.mark.parametrize('reply,free', [
    ('The trial was small [P1].\nFINAL ANSWER: C. maybe', ('C', 'ok')),
    ('The trial was small [P1].\nANSWER UNAVAILABLE', (None, 'unavailable')),
    ('The trial was small [P1]. I would say it depends.', (None, 'unparseable')),
    ('', (None, 'unparseable')),
])
def test_scored_answer_follows_the_rationale_and_the_free_text_parse_is_counted(reply, free):
    llm = _Canned(reply, {'A': -2.0, 'B': -0.1, 'C': -3.0})
    r = answer_with_rationale(llm, [{'role': 'user', 'content': 'q'}], 'pubmedqa')
    assert (r['pred'], r['status']) == ('B', 'ok')                     # scored: always an answer, never defaulted from text
    assert (r['free_text_pred'], r['free_text_status']) == free        # the paper's parse of the same rationale, beside it
    prefix = llm.asked[-1][1]
    assert prefix.endswith('FINAL ANSWER:') and 'ANSWER UNAVAILABLE' not in prefix and prefix.count('FINAL ANSWER') == 1
    f = answer_with_rationale(_Canned(reply), [{'role': 'user', 'content': 'q'}], 'pubmedqa', mode='free_text')
    assert (f['pred'], f['status']) == free and f['logprobs'] is None  # free text: unparseable stays unanswered


def test_free_text_mode_never_scores_and_scored_mode_never_generates_for_direct_answers():
    llm = _Canned('FINAL ANSWER: B. no', {'A': -0.5, 'B': -1.0})
    msgs = closed_book_messages('Is the sky blue?', 'bioasq')
    assert answer_direct(llm, msgs, 'bioasq')['pred'] == 'A' and [k for k, _ in llm.asked] == ['choose']
    llm.asked.clear()
    assert answer_direct(llm, msgs, 'bioasq', mode='free_text')['pred'] == 'B' and [k for k, _ in llm.asked] == ['chat']
    with pytest.raises(ValueError, match='unknown answer mode'): answer_with_rationale(llm, msgs, 'bioasq', mode='vote')
    with pytest.raises(ValueError, match='unknown dataset'): answer_direct(llm, msgs, 'medqa')


def test_rationale_prefix_drops_every_answer_line():
    assert rationale_prefix('A [P1].\nFINAL ANSWER: A. yes\nFINAL ANSWER: B. no') == 'A [P1].\nFINAL ANSWER:'
    assert rationale_prefix('  \nANSWER UNAVAILABLE') == 'FINAL ANSWER:'


def test_prompts_on_the_same_evidence_share_their_opening():
    "llama.cpp reuses the longest shared prefix: every prompt with documents must open identically."
    block, q = '[P1] Aspirin. Aspirin inhibits platelets.', 'Does aspirin prevent stroke?'
    msgs = [rationale_messages(q, block, 'bioasq'), vanilla_messages(q, block, 'bioasq'),
            direct_messages(q, block, ['Aspirin inhibits platelets [P1].']), decomposed_messages(q, block, ['Aspirin inhibits platelets [P1].'])]
    openings = {(m[0]['content'], m[1]['content'].split(f'Question: {q}')[0]) for m in msgs}
    assert len(openings) == 1 and all(f'Question: {q}' in m[1]['content'] for m in msgs)
    assert closed_book_messages(q, 'bioasq')[0] == msgs[0][0] and 'Documents' not in closed_book_messages(q, 'bioasq')[1]['content']


def test_parameters_refuse_contradictions_before_any_work():
    assert shot_counts('3, 0 ,3') == [0, 3]
    for bad in ('', '9', '-1', '1;2', 'x'):
        with pytest.raises(ValueError): shot_counts(bad)
    with pytest.raises(ValueError, match='answer_mode=free_text'): ReasonVerifyParams(backend='openai', model='m')
    assert ReasonVerifyParams(backend='openai', model='m', answer_mode='free_text').backend == 'openai'
    with pytest.raises(ValueError): ReasonVerifyParams(answer_mode='vote')
    with pytest.raises(ValueError, match='cannot exceed bm25_k'): ReasonVerifyParams(bm25_k=4, rerank_m=5)


def _preds(correct: dict[str, list[bool]], ds='bioasq', gold='A'):
    return pd.DataFrame([dict(dataset=ds, item_id=f'q{i}', system=s, gold=gold, pred=gold if ok else 'B')
                         for s, col in correct.items() for i, ok in enumerate(col)])


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=2, max_size=40), st.randoms(use_true_random=False))
def test_headline_rows_are_paired_and_do_not_depend_on_row_order(outcomes, rnd):
    cb, rag, rv = map(list, zip(*outcomes))
    preds = _preds({'closed book': cb, 'BM25 RAG': rag, 'Reason and Verify': rv})
    shuffled = preds.sample(frac=1.0, random_state=rnd.randint(0, 10_000)).reset_index(drop=True)
    a, b = headline_rows(preds, ['bioasq']), headline_rows(shuffled, ['bioasq'])
    pd.testing.assert_frame_equal(a, b)                                  # items are aligned by id, not by position
    h = a.set_index(['row', 'metric'])
    for m, base in COMPARISONS:
        row = f'{m} vs {base} / BioASQ-Y/N'
        acc = lambda s: h.ours[f'{s} / BioASQ-Y/N', 'accuracy (%)']
        assert abs(h.ours[row, 'Δ accuracy (points)'] - (acc(m) - acc(base))) < 1e-9
        lo, hi, v = h.ci_low[row, 'Δ accuracy (points)'], h.ci_high[row, 'Δ accuracy (points)'], h.note[row, 'McNemar p'].split(':')[0]
        assert v == ('undecided' if len(outcomes) < MIN_DECIDABLE_N else 'confirmed' if lo > 0 else 'refuted' if hi < 0 else 'undecided')
        assert 0 <= h.ours[row, 'McNemar p'] <= 1 and h.n[row, 'McNemar p'] == len(outcomes)
    assert not a.metric.str.contains('CI').any()                         # intervals are columns of their value's row
    for s in SYSTEMS:
        r = f'{s} / BioASQ-Y/N'
        assert 0 <= h.ci_low[r, 'accuracy (%)'] <= h.ci_high[r, 'accuracy (%)'] <= 100


def test_headline_rows_refuse_unpaired_or_duplicated_items_and_count_missing_answers():
    preds = _preds({'closed book': [True, False, True], 'BM25 RAG': [True, True, False], 'Reason and Verify': [True, True, True]})
    with pytest.raises(ValueError, match='same items'): headline_rows(preds.iloc[:-1], ['bioasq'])
    with pytest.raises(ValueError, match='two predictions'): headline_rows(pd.concat([preds, preds.iloc[:1]]), ['bioasq'])
    missing = preds.assign(pred=[None if s == 'Reason and Verify' and i == 'q0' else p for s, i, p in zip(preds.system, preds.item_id, preds.pred)])
    h = headline_rows(missing, ['bioasq']).set_index(['row', 'metric'])
    assert abs(h.ours['Reason and Verify / BioASQ-Y/N', 'accuracy (%)'] - 200 / 3) < 1e-9      # no answer: wrong, not dropped
    assert h.note['Reason and Verify / BioASQ-Y/N', 'accuracy (%)'].startswith('1 of 3 without an answer')


def test_paper_values_come_from_the_named_rows_and_only_same_model_differences():
    t2 = pd.DataFrame(dict(row=['Closed-Book (No Retrieval; CoT Prompting) / GPT-3.5', 'Ours (Llama-3-8B-Instruct backbone) / Vanilla RAG (BM25)',
                                'Ours (Llama-3-8B-Instruct backbone) / + Reranking (0-shot)'], metric='BioASQ-Y/N', paper=[74.27, 82.3, 87.4]))
    values, diffs = headline_paper_values(t2, ['bioasq'])
    assert diffs == {('Reason and Verify', 'BM25 RAG', 'bioasq'): 5.1}
    assert {r for r, _ in values} == {*(f'{s} / BioASQ-Y/N' for s in SYSTEMS), 'Reason and Verify vs BM25 RAG / BioASQ-Y/N'}
    assert all('Table 2' in src for _, src in values.values())


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.booleans()), min_size=2, max_size=60))
def test_auroc_equals_the_library_and_is_invariant_to_monotone_rescaling(pairs):
    s, y = np.array([p[0] for p in pairs], float), np.array([p[1] for p in pairs])
    a = auroc_ci(s, y, n_boot=200)
    if y.all() or not y.any():
        assert math.isnan(a['auroc']); return
    assert abs(a['auroc'] - roc_auc_score(y, s)) < 1e-12
    assert abs(auroc_ci(np.exp(s) * 3 - 1, y, n_boot=200)['auroc'] - a['auroc']) < 1e-12
    assert abs(auroc_ci(s, ~y, n_boot=200)['auroc'] - (1 - a['auroc'])) < 1e-12
    assert a['lo'] <= a['hi']


def test_kappa_ci_resamples_rationales_and_ignores_unlabelled_statements():
    ref = [['CORRECT-EXPLICIT', 'INCORRECT-FALSE', None]] * 20 + [['CORRECT-IMPLICIT']] * 10
    oth = [['CORRECT-EXPLICIT', 'CORRECT-EXPLICIT', 'INCORRECT-FALSE']] * 20 + [['CORRECT-IMPLICIT']] * 10
    k = kappa_ci(ref, oth, n_boot=500)
    assert (k['n_pairs'], k['n_rationales']) == (50, 30)
    assert abs(k['kappa'] - agreement(sum(ref, []), sum(oth, []))['kappa']) < 1e-12
    assert -1 <= k['lo'] <= k['hi'] <= 1
    same = kappa_ci(ref, ref, n_boot=200)
    assert same['kappa'] == 1.0 and same['lo'] == same['hi'] == 1.0
    assert kappa_ci(ref[::-1], oth[::-1], n_boot=200)['kappa'] == k['kappa']   # the point estimate ignores order
    with pytest.raises(ValueError, match='rationales'): kappa_ci(ref, oth[:-1])


def test_cost_per_item_is_the_same_on_a_replay_and_refuses_what_it_cannot_divide():
    recs = pd.DataFrame([_record('bioasq/Reason and Verify', 600, 10.0, False), _record('bioasq/Reason and Verify', 700, 0.5, False),
                         _record('bioasq/BM25 RAG', 500, 9.0, False)])
    c = cost_per_item(recs, 'bioasq/Reason and Verify', n=1)
    assert c == {'calls per item': 2.0, 'prompt tokens per item': 1300.0, 'completion tokens per item': 20.0, 'compute seconds per item': 10.5}
    assert cost_per_item(recs.assign(cached=True), 'bioasq/Reason and Verify', n=1) == c
    with pytest.raises(ValueError, match='no call'): cost_per_item(recs, 'bioasq/closed book', n=1)
    with pytest.raises(ValueError, match='at least one item'): cost_per_item(recs, 'bioasq/BM25 RAG', n=0)


# --- issue 32: the trigger on the paper's scale, rewrites that cannot help, rationales that reason, a verifier that reads
from rag_lab.papers.reason_verify import (LETTERS, passage_text, PAPER_TRIGGER_RATES, PASSAGE_BUDGETS, ScoredVerifier, choose_passage_words,
                                          conclusion_reaches, copies_passages, fit_tau_evid, legend_order, rationale_body,
                                          rewrite_problem, role_llm, statement_messages)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.floats(0, 1)), min_size=1, max_size=60), st.sampled_from(sorted(PAPER_TRIGGER_RATES.values())))
def test_fit_tau_evid_reaches_the_closest_rate_on_its_grid(pairs, target):
    ov, ev = map(list, zip(*pairs))
    f = fit_tau_evid(ov, ev, target)
    rate = lambda t: np.mean([(o < 0.3) or (e < t) for o, e in pairs])
    assert f['rate'] == pytest.approx(rate(f['tau_evid']))
    assert all(abs(rate(t) - target) >= abs(f['rate'] - target) - 1e-12 for t in np.round(np.arange(0, 1.001, 0.01), 6))
    assert round(f['tau_evid'], 2) == f['tau_evid'] and f['n'] == len(pairs)


def test_fitted_threshold_is_the_papers_rate_not_its_scale():
    rng = np.random.default_rng(0)
    cos = rng.uniform(0.3, 0.7, 500)   # cosines: a scale on which 0.5 fires for about half the questions
    assert np.mean(cos < 0.5) > 0.4
    f = fit_tau_evid(np.ones(500), cos, PAPER_TRIGGER_RATES['bioasq'])
    assert abs(f['rate'] - 0.08) < 0.02 and f['tau_evid'] < 0.5


@pytest.mark.parametrize('rewrite,why', [
    ('Yes, aspirin lowers myocardial infarction risk', 'states an answer'),
    ('NO: aspirin does not prevent infarction', 'states an answer'),
    ('The answer is maybe', 'states an answer'),
    ('aspirin myocardial infarction risk lower', 'repeats the question'),
    ('aspirin', 'repeats the question'),
    ('acetylsalicylic acid aspirin myocardial infarction prevention', None),
    ('aspirin nonsteroidal anti-inflammatory infarction', None),   # "no" inside a word is no answer
])
def test_rewrites_that_state_an_answer_or_repeat_the_question_are_named(rewrite, why):
    assert rewrite_problem('Does aspirin lower myocardial infarction risk?', rewrite) == why


def test_a_rejected_rewrite_keeps_the_original_evidence_and_is_counted(tiny):
    _, bm25 = tiny
    q = 'Does aspirin lower myocardial infarction risk?'
    first = retrieve_evidence(q, bm25, _ConstReranker(0.2), m=1)
    for rewrite, status in (('Yes, statins lower cholesterol', 'rejected: states an answer'),
                            ('aspirin infarction risk', 'rejected: repeats the question'),
                            ('statins cholesterol', 'rewritten')):
        ev = retrieve_evidence(q, bm25, _ConstReranker(0.2), m=1, rewriter=lambda _: rewrite)
        assert ev.triggered and ev.rewrite_status == status and ev.candidate == rewrite
        if status.startswith('rejected'): assert ev.ids == first.ids and ev.rewritten is None
        else: assert ev.rewritten == rewrite and ev.ids == ['2']


def test_the_rationale_label_is_not_a_statement():
    raw = 'Rationale: Aspirin cut infarctions by a quarter (P1). Bleeding rose slightly (P2).\nFINAL ANSWER: A. yes'
    stmts = segment_rationale(raw)
    assert stmts and not any(s.lower().startswith('rationale') for s in stmts)
    assert Counter(content_words(' '.join(stmts))) == Counter(content_words(rationale_body(raw)))
    assert rationale_body('Rationale:\n[P1] Aspirin.') == '[P1] Aspirin.'


def test_copy_rate_sees_tag_lines_and_verbatim_runs_but_not_own_words():
    passage = 'In this randomised trial of 400 adults aspirin reduced the incidence of myocardial infarction by 25 percent over five years.'
    assert copies_passages('[P1] states that aspirin reduced infarction.', [passage])['tag_lines'] == 1
    assert copies_passages('Rationale:\n  [P2] aspirin reduced infarction.', [passage])['copied']
    verbatim = 'Rationale: In this randomised trial of 400 adults aspirin reduced the incidence of myocardial infarction (P1).'
    assert copies_passages(verbatim, [passage])['longest_run'] >= 12 and copies_passages(verbatim, [passage])['copied']
    own = 'Rationale: Aspirin cut heart attacks by a quarter in a large five-year trial (P1).\nFINAL ANSWER: A. yes'
    c = copies_passages(own, [passage])
    assert not c['copied'] and c['tag_lines'] == 0 and c['longest_run'] < 12


def test_passage_budget_rule_and_conclusion_reach():
    sents = [f'Sentence {i} says something about aspirin and bleeding risk here.' for i in range(10)]
    doc = Document('d', 'title', ' '.join(sents))
    need = [b for b in (10, 19, 20, 60, 200) if conclusion_reaches(doc, 'aspirin?', b)]
    assert need == [20, 60, 200]   # the closing two sentences (10 words each) are kept first, whatever the query
    doc2 = Document('e', 'title', 'Warfarin was given to the controls. Aspirin lowered stroke risk in trials. '
                                  'Methods were blinded by the sponsor. So the drug is safe to use.')
    assert doc2.sentences[-1] == 'So the drug is safe to use.'
    assert passage_text(doc2, 'Does aspirin lower stroke risk?', 14) == 'title. Methods were blinded by the sponsor. So the drug is safe to use.'   # the conclusion first
    assert passage_text(doc2, 'Does aspirin lower stroke risk?', 20) == ('title. Aspirin lowered stroke risk in trials. Methods were blinded '
                                                                        'by the sponsor. So the drug is safe to use.')   # then the query's sentence, in document order
    assert choose_passage_words({b: s for b, s in zip(PASSAGE_BUDGETS, (0.23, 0.39, 0.52, 0.66))}) == 120
    assert choose_passage_words({160: 0.9, 50: 0.5}) == 50 and choose_passage_words({50: 0.49, 90: 0.3}) == 50   # none reaches half: the cheapest
    with pytest.raises(ValueError): choose_passage_words({})


class _Biased:
    "A judge with a pure position bias (always the first letter), logging every prompt."
    model = 'biased'
    def __init__(self): self.prompts = []
    def choose_option(self, messages, options, prefix=''):
        self.prompts.append(messages[1]['content'])
        return ParsedAnswer(status='ok', answer='A', logprobs={k: -float(j) for j, k in enumerate(options)}, confidence=None)


def test_scored_verifier_asks_once_per_statement_with_a_seeded_shuffle():
    stmts = [f'Statement number {i} about aspirin (P1).' for i in range(6)]
    task = VerifyTask('Does aspirin prevent MI?', '[P1] Aspirin. It inhibits platelets.', stmts)
    judge = _Biased()
    a = ScoredVerifier(judge, seed=1).verify_many([task, VerifyTask('q?', 'e', [])])
    assert len(judge.prompts) == 6 and a[1] == []   # one call per statement; an empty rationale costs nothing
    for i, p in enumerate(judge.prompts):
        legend = [l.split('. ', 1)[1] for l in p.split('Options:\n')[1].split('\nReply')[0].splitlines()]
        assert sorted(legend) == sorted(CATEGORIES) and f'Classify statement S{i + 1}' in p
        assert a[0][i] == legend[0]   # the bias picks whatever that call listed first
    b = ScoredVerifier(_Biased(), seed=2).verify_many([task])
    assert a[0] != b[0] and ScoredVerifier(_Biased(), seed=1).verify_many([task])[0] == a[0]   # seeded, and seed-dependent
    assert legend_order([a[0]])['in_legend_order'] == 0   # the bias no longer writes the legend
    assert len(set(a[0])) > 2   # a position bias spreads over categories instead of one label
    with pytest.raises(ValueError, match='eight categories'): statement_messages('q', 'e', stmts, 0, list(CATEGORIES)[:-1])
    assert LETTERS == 'ABCDEFGH'


def test_scored_verifier_rotations_cancel_a_position_bias_and_pairs_are_disjoint():
    task = VerifyTask('Does aspirin prevent MI?', '[P1] Aspirin. It inhibits platelets.', ['Aspirin inhibits platelets (P1).', 'It is cheap.'])
    judge = _Biased()
    assert ScoredVerifier(judge, seed=3, rotations=range(8)).verify_many([task]) == [[None, None]]   # a pure position bias: a tie, no label
    assert len(judge.prompts) == 16   # one call per rotation and statement
    a, a2 = ScoredVerifier.pair(judge, seed=3, per_verifier=2)
    assert (a.rotations, a2.rotations) == ((0, 4), (2, 6)) and a.order(task, 1) == a2.order(task, 1)   # same base order
    for r in range(8): assert a.order(task, 0, r) == a.order(task, 0)[r:] + a.order(task, 0)[:r]
    with pytest.raises(ValueError, match='distinct'): ScoredVerifier(judge, rotations=())
    with pytest.raises(ValueError, match='1, 2 or 4'): ScoredVerifier.pair(judge, per_verifier=8)


def test_legend_order_counts_only_multi_statement_replies():
    L = list(CATEGORIES)
    assert legend_order([L[:2], L[:3], [L[0]], [L[1], L[0]], L[:2] + [L[5]]]) == dict(multi=4, in_legend_order=2, starts_explicit_implicit=3)


def test_verifier_protocol_follows_what_the_backend_can_do_and_servers_get_the_base_url():
    assert ReasonVerifyParams().verifier_protocol == 'scored'
    assert ReasonVerifyParams(verifier_backend='openai', verifier_model='gpt-4o').verifier_protocol == 'json'
    with pytest.raises(ValueError, match='verifier A'):
        ReasonVerifyParams(verifier_backend='openai', verifier_model='gpt-4o', verifier_mode='scored')
    got = []
    p = ReasonVerifyParams(base_url='http://localhost:8080/v1')
    for backend in ('llamaserver', 'openai', 'llamacpp', None):
        role_llm(p, backend, None, make=lambda params, **kw: got.append((kw['backend'], kw['base_url'])))
    assert got == [('llamaserver', 'http://localhost:8080/v1'), ('openai', 'http://localhost:8080/v1'), ('llamacpp', None), ('llamacpp', None)]
