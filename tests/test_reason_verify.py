"""Reason and Verify parts (rag_lab.papers.reason_verify): segmentation, label parsing, empty evidence / retrieval, decontamination."""
import math
from collections import Counter
import numpy as np
import pandas as pd
import pytest
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
    assert m.count('FINAL ANSWER: A. yes') == 2 and 'The correct answer is' not in m   # demo line + allowed line
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
