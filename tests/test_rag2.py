"""Tests of rag_lab.papers.rag2: ΔPPL labels, the snippet filter and its window, the all-filtered fallback, malformed items;
the headline's machinery: leak-free nested samples, answer protocols, paired rows, the filter's AUROC interval, cost."""
import os
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

os.environ.setdefault('HF_HUB_OFFLINE', '1')
from rag_lab.calls import LLMCache, Ledger
from rag_lab.llm import LlamaCppLLM
from rag_lab.text import Corpus, Document
from rag_lab.papers.rag2 import (PARAMS, PROFILES, RAG2_SYSTEMS, MiniLMFilter, MultiCorpus, answer_item, answer_messages, apply_filter,
                                 calibrate_filter_threshold, check_mcq, comparison_of, corpus_share, cost_rows, delta_ppl, filter_training_items,
                                 filter_report, format_mcq, helpful_threshold, make_query, out_of_fold_proba,
                                 paired_accuracy_rows, parse_mcq_answer, ppl_labels, rag2_prompt, query_rationale_messages,
                                 rationale_ppl, retrieve, run_compute, EXPERT_SYSTEM, RATIONALE_INSTRUCTION)
from rag_lab.data import DEV_TAIL, dev_items, load_mirage, nested_sample, test_items
from rag_lab.metrics import compare_paired
from rag_lab.config import resolve_params, parse_param
import pandas as pd

SMOL = 'smollm2-135m-instruct-q4_1'
Q = 'Which vitamin deficiency causes scurvy?'
OPTS = {'A': 'Vitamin A', 'B': 'Vitamin C', 'C': 'Vitamin D', 'D': 'Vitamin K'}


@pytest.fixture(scope='module')
def smol(tmp_path_factory):
    return LlamaCppLLM(SMOL, n_threads=1, cache=LLMCache(tmp_path_factory.mktemp('c') / 'calls.sqlite'), ledger=Ledger())


@pytest.fixture(scope='module')
def minilm_filter():
    qs = [Q] * 4 + ['What causes rickets?'] * 4
    sn = ['Scurvy results from vitamin C deficiency.', 'Vitamin C is ascorbic acid; lack of it causes scurvy.',
          'The stock market fell today.', 'Football scores from the weekend.',
          'Rickets is due to vitamin D deficiency.', 'Lack of vitamin D softens bones in children (rickets).',
          'A new phone was released.', 'The weather will be sunny.']
    return MiniLMFilter().fit(qs, sn, [1, 1, 0, 0, 1, 1, 0, 0])


# ---------------------------------------------------------------- ΔPPL: sign and threshold
def test_delta_ppl_sign_on_a_constructed_case(smol):
    "A snippet that states the rationale lowers its perplexity (ΔPPL > 0); an unrelated one helps less."
    rationale = "Scurvy is caused by a lack of vitamin C (ascorbic acid), which is needed to make collagen. The answer is (B)."
    base = rationale_ppl(smol, Q, OPTS, rationale)
    same = rationale_ppl(smol, Q, OPTS, rationale, snippet=rationale)
    other = rationale_ppl(smol, Q, OPTS, rationale, snippet='The 1998 football world cup was held in France.')
    d_same, d_other = delta_ppl(base, same), delta_ppl(base, other)
    assert d_same > 0 and d_same > d_other
    # the score went through the LLM layer's cache: a second call is a hit and gives the same number
    assert rationale_ppl(smol, Q, OPTS, rationale, snippet=rationale) == same
    assert smol.ledger.frame().cached.any()
    # threshold on the constructed case: of four pairs, the top 25% is exactly the snippet that states the rationale
    deltas = [d_same, d_other, -abs(d_other) - 1, 0.0]
    tau = helpful_threshold(deltas, 0.25)
    assert max(d_other, 0.0) < tau <= d_same
    assert ppl_labels(deltas, tau).tolist() == [1, 0, 0, 0]
    assert ppl_labels(deltas, tau, require_gain=True).tolist() == [1, 0, 0, 0]


def test_threshold_is_the_top_quantile_and_require_gain_never_labels_a_perplexity_increase():
    deltas = [-1.0, 0.2, 0.5, 3.0, 1.5, -0.3, 0.0, 2.0]
    tau = helpful_threshold(deltas, 0.25)
    assert tau == pytest.approx(np.quantile(deltas, 0.75))
    assert ppl_labels(deltas, tau).tolist() == [0, 0, 0, 1, 0, 0, 0, 1]
    hurting = [-3.0, -2.0, -1.0, -0.5]  # every snippet raises the perplexity
    assert ppl_labels(hurting, helpful_threshold(hurting, 0.25)).tolist() == [0, 0, 0, 1]  # paper: the least harmful
    assert ppl_labels(hurting, helpful_threshold(hurting, 0.25), require_gain=True).sum() == 0
    with pytest.raises(ValueError, match='no ΔPPL'): helpful_threshold([], 0.25)
    with pytest.raises(ValueError, match='helpful_quantile'): helpful_threshold([1.0], 1.0)
    with pytest.raises(ValueError, match='positive'): delta_ppl(0.0, 2.0)
    with pytest.raises(ValueError, match='empty rationale'): rationale_ppl(None, Q, OPTS, '  ')


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-50, 50, allow_nan=False), min_size=1, max_size=200, unique=True),
       st.floats(0.05, 0.95))
def test_helpful_share_never_exceeds_the_quantile(deltas, q):
    tau = helpful_threshold(deltas, q)
    lab, strict = ppl_labels(deltas, tau), ppl_labels(deltas, tau, require_gain=True)
    assert 1 <= lab.sum() <= int(np.ceil(q * len(deltas))) + 1
    assert all(d > 0 for d, l in zip(deltas, strict) if l) and (strict <= lab).all()


# ---------------------------------------------------------------- the filter's window
def test_a_snippet_longer_than_the_filter_window(minilm_filter):
    f = minilm_filter
    long_snip = ' '.join(['The weather will be sunny and the stock market fell today.'] * 40 +
                         ['Scurvy results from vitamin C deficiency.'] * 12)  # the helpful part is past the first window
    assert len(f.tok.tokenize(long_snip)) > 3 * f.window
    wins = f.windows(long_snip)
    assert len(wins) > 1 and all(len(f.tok.tokenize(w)) <= f.window for w in wins)
    assert 'scurvy' in wins[-1].lower()  # the windows reach the end: nothing is truncated away
    p_long = f.predict_proba([Q], [long_snip])[0]
    assert p_long == pytest.approx(f.predict_proba([Q] * len(wins), wins).max())
    p_first = f.predict_proba([Q], [wins[0]])[0]  # what a filter that truncates at its window would see
    assert p_first < 0.5 and p_long > p_first + 0.1


# ---------------------------------------------------------------- all snippets filtered out
def test_all_snippets_filtered_out_falls_back_to_closed_book(minilm_filter):
    "The RAG² inference step (filter -> prompt): off-topic snippets are all rejected and the prompt is the closed-book one."
    docs = ['The weather will be sunny.', 'Football scores from the weekend.']
    msgs, kept, fallback = rag2_prompt(minilm_filter, Q, OPTS, ['d1', 'd2'], docs, threshold=0.5)
    assert kept == [] and fallback
    assert msgs == answer_messages(Q, OPTS)  # exactly the no-retrieval prompt
    assert not any(d in msgs[-1]['content'] for d in docs) and 'Documents' not in msgs[-1]['content']
    # the same step with one helpful snippet among them keeps it, and only it
    msgs, kept, fallback = rag2_prompt(minilm_filter, Q, OPTS, ['d1', 'd3'], [docs[0], 'Scurvy results from vitamin C deficiency.'], 0.5)
    assert kept == ['d3'] and not fallback and 'Scurvy results' in msgs[-1]['content'] and docs[0] not in msgs[-1]['content']
    assert rag2_prompt(minilm_filter, Q, OPTS, [], [], 0.5) == (answer_messages(Q, OPTS), [], True)  # nothing retrieved
    none_helpful = MiniLMFilter().fit([Q, Q], docs, [0, 0])  # labels of one class: a constant filter, no crash
    assert none_helpful.predict_proba([Q] * 2, docs).tolist() == [0.0, 0.0]
    assert rag2_prompt(none_helpful, Q, OPTS, ['d1', 'd2'], docs, calibrate_filter_threshold([0.0, 0.0]))[2]
    assert apply_filter([], [], 0.5) == ([], True)
    with pytest.raises(ValueError, match='probabilities'): apply_filter([0.9], ['a', 'b'], 0.5)
    with pytest.raises(ValueError, match='snippet texts'): rag2_prompt(minilm_filter, Q, OPTS, ['d1'], [], 0.5)


# ---------------------------------------------------------------- the filter's decision threshold and held-out report
def test_calibrated_threshold_keeps_the_helpful_share_of_training_pairs():
    rng = np.random.default_rng(0)
    p = rng.uniform(0.01, 0.45, 40)  # every probability below 0.5: a fixed 0.5 keeps nothing
    assert (p >= 0.5).sum() == 0
    thr = calibrate_filter_threshold(p, keep_share=0.25)
    assert (p >= thr).sum() == 10 and thr < 0.5
    assert calibrate_filter_threshold(p, 0.25, threshold=0.5) == 0.5  # a fixed value wins
    assert calibrate_filter_threshold([0.0, 0.0, 0.0], 0.25) == 0.5  # constant filter: no ranking to calibrate
    with pytest.raises(ValueError, match='threshold'): calibrate_filter_threshold(p, 0.25, threshold=0.0)
    with pytest.raises(ValueError, match='keep_share'): calibrate_filter_threshold(p, 1.0)
    with pytest.raises(ValueError, match='no training'): calibrate_filter_threshold([], 0.25)


class _RecordingFilter:
    "Scores a pair 1 if its question was seen in training, else 0 (a memoriser): exposes any leakage across folds."
    def __init__(self): self.seen = set()
    def clone(self): return _RecordingFilter()
    def fit(self, qs, sn, y): self.seen = set(qs); return self
    def predict_proba(self, qs, sn): return np.array([float(q in self.seen) for q in qs])


def test_out_of_fold_probabilities_never_come_from_a_filter_that_saw_the_question():
    qs = [f'q{i}' for i in range(10) for _ in range(3)]
    p = out_of_fold_proba(_RecordingFilter(), qs, ['s'] * 30, [0, 1, 0] * 10, groups=qs, n_folds=4)
    assert p.shape == (30,) and (p == 0).all()
    with pytest.raises(ValueError, match='at least 2 questions'): out_of_fold_proba(_RecordingFilter(), ['q'] * 2, ['s'] * 2, [0, 1], ['q'] * 2)


def test_filter_report_counts_a_reject_everything_filter_as_chance():
    y = [1, 0, 0, 0, 1, 0, 0, 0]
    r = filter_report(y, [0.1] * 8, threshold=0.5)  # the audited failure: every pair predicted NOT_HELPFUL
    assert r['accuracy'] == r['majority_baseline'] == 75.0 and r['balanced_accuracy'] == 50.0 and r['predicted_helpful'] == 0
    assert r['helpful_base_rate'] == 25.0 and r['accuracy_lo'] <= 75.0 <= r['accuracy_hi']
    r = filter_report(y, [0.9, 0.1, 0.2, 0.1, 0.6, 0.7, 0.1, 0.1], threshold=0.5)
    assert r['predicted_helpful'] == 3 and r['accuracy'] == 87.5 and r['balanced_accuracy'] == pytest.approx(100 * (1 + 5 / 6) / 2)
    assert r['roc_auc'] == pytest.approx(100 * 11 / 12)
    with pytest.raises(ValueError, match='labels'): filter_report([1], [0.1, 0.2], 0.5)


# ---------------------------------------------------------------- malformed items
@pytest.mark.parametrize('options, msg', [
    ({'A': 'yes'}, 'at least 2 options'), ({'A': 'yes', 'AB': 'no'}, 'single letter'), ({'A': 'yes', 'B': ''}, 'has no text'),
    ({'A': 'yes', 'B': None}, 'has no text'), (['yes', 'no'], 'mapping'), ({'A': 'x', 'a': 'y'}, 'appears twice')])
def test_a_question_with_malformed_options_is_refused(options, msg):
    for build in (check_mcq, format_mcq, query_rationale_messages, answer_messages):
        with pytest.raises(ValueError, match=msg): build(Q, options)
    with pytest.raises(ValueError, match='question text is empty'): check_mcq('', OPTS)


@pytest.mark.parametrize('answer', ['E', 'AB', '', ' ', 2])
def test_a_question_whose_gold_answer_is_not_an_option_is_refused(answer):
    with pytest.raises(ValueError, match='gold answer .* is not among the options A, B, C, D'):
        check_mcq(Q, OPTS, answer=answer)
    assert check_mcq(Q, OPTS, answer='b') == OPTS  # a lower-case letter of an existing option is fine


def test_answers_that_name_no_option_are_unparseable_not_guessed():
    assert parse_mcq_answer('the answer is (B)', OPTS).answer == 'B'
    assert parse_mcq_answer('B. Vitamin K', OPTS).status == 'unparseable'
    assert parse_mcq_answer('', OPTS).status == 'missing' and parse_mcq_answer(None, OPTS).status == 'missing'
    assert parse_mcq_answer('the answer is (E)', OPTS).answer is None


# ---------------------------------------------------------------- retrieval and splits
def test_balanced_retrieval_draws_from_every_corpus_and_shares_add_up():
    docs = [Document(f'big{i}', '', f'Vitamin C deficiency causes scurvy, case {i}.', metadata={'source': 'big'}) for i in range(8)]
    docs += [Document('s1', '', 'Collagen synthesis needs vitamin C.', metadata={'source': 'small'}),
             Document('t1', '', 'Rickets is vitamin D deficiency.', metadata={'source': 'tiny'})]
    mc = MultiCorpus.build(Corpus(docs, name='t'))
    q = 'Vitamin C deficiency causes scurvy.'
    assert set(mc.source_of[d] for d in retrieve(mc, q, 'stacked', k=3)) == {'big'}
    assert set(mc.source_of[d] for d in retrieve(mc, q, 'balanced', k=3, per_corpus=1)) == {'big', 'small', 'tiny'}
    # like for like: the same candidate count and reranker from one pooled BM25 ranking, no quota -> the big corpus only
    assert set(mc.source_of[d] for d in retrieve(mc, q, 'pooled_rerank', k=3, per_corpus=1)) == {'big'}
    # MiniLM as both first stage and reranker makes balanced collapse into stacked (k <= per_corpus)
    assert retrieve(mc, q, 'balanced', k=3, per_corpus=3, first_stage='dense') == retrieve(mc, q, 'stacked', k=3)
    assert retrieve(mc, 'zzzz qqqq', 'balanced', k=3) == []  # no query term in any corpus: nothing, not an error
    with pytest.raises(ValueError, match='first_stage'): retrieve(mc, q, 'balanced', first_stage='splade')
    share = corpus_share(mc, [retrieve(mc, q, 'medrag', k=3), retrieve(mc, q, 'balanced', k=3, per_corpus=1)])
    assert sum(share.values()) == pytest.approx(1.0) and corpus_share(mc, [[]]) == {'big': 0.0, 'small': 0.0, 'tiny': 0.0}
    with pytest.raises(ValueError, match='unknown strategy'): retrieve(mc, q, 'pooled')
    with pytest.raises(ValueError, match='k must be'): retrieve(mc, q, 'stacked', k=0)
    with pytest.raises(ValueError, match="metadata\\['source'\\]"): MultiCorpus.build(Corpus([Document('x', '', 'y')]))


def test_query_variants():
    assert make_query(Q, OPTS, 'Ascorbate builds collagen. The answer is (B).') == 'Ascorbate builds collagen.'
    assert make_query(Q, OPTS, 'r', 'question') == format_mcq(Q, OPTS)
    assert make_query(Q, OPTS, 'r', 'question+rationale').endswith('\nr')


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_filter_training_items_are_the_end_of_each_dev_split(data):
    "Training = the end of each dataset's declared dev split: never an evaluation item, whatever n and seed."
    n_train = data.draw(st.integers(1, DEV_TAIL['bioasq']))
    seed = data.draw(st.integers(0, 2**32 - 1))
    tr = filter_training_items(['medmcqa', 'bioasq'], n_train, seed)
    for d in ('medmcqa', 'bioasq'):
        perm = nested_sample(load_mirage(d), None, seed)
        got = tr[tr.dataset == d]
        assert got.id.tolist() == perm.id[len(perm) - n_train:].tolist()     # the end of the permutation
        assert set(got.id) <= set(dev_items(d, seed).id) and not set(got.id) & set(test_items(d, None, seed).id)


def test_filter_training_items_refuse_impossible_sizes():
    with pytest.raises(ValueError, match="medmcqa's dev split, which holds 1000"): filter_training_items(['medmcqa'], 1001)
    with pytest.raises(ValueError, match="bioasq's dev split, which holds 100"): filter_training_items(['medmcqa', 'bioasq'], 101)
    with pytest.raises(ValueError, match="dev split"): filter_training_items(['pubmedqa'], 0)


# ---------------------------------------------------------------- parameters of the headline
def test_headline_parameters_are_validated_before_work():
    p = resolve_params('rag2', 'default')
    assert (p.n, p.n_secondary, p.n_pubmedqa, p.n_bioasq, p.answer_mode, p.table5_models) == (50, 17, 150, 150, 'scored', '')
    assert (p.train_datasets, p.train_n, p.label_k, p.label_kind, p.max_tokens, p.snippet_words) == ('medmcqa,pubmedqa,bioasq', 50, 2, 'dev', 160, 120)
    assert parse_param('rag2', 'answer_mode', 'free_text') == 'free_text'
    for name, bad in [('answer_mode', 'guess'), ('n_pubmedqa', '-1'), ('n_bioasq', '-1'), ('n_secondary', '0'), ('yesno_systems', 'closed book'),
                      ('yesno_systems', 'RAG²,oracle'), ('topk_grid', '1,0'), ('topk_grid', 'x'), ('label_kind', 'vote'),
                      ('train_datasets', 'medmcqa,scifact'), ('train_n', '0')]:
        with pytest.raises(ValueError): parse_param('rag2', name, bad)
    assert PARAMS(yesno_systems='RAG² , standard RAG').yesno_systems == 'RAG²,standard RAG'
    assert set(PROFILES) == {'smoke', 'default', 'paper'} and PROFILES['paper']['n'] is None


# ---------------------------------------------------------------- answer protocols: scored never unparseable, free text counted
class _ScriptedLLM:
    "Writes `reply`; scores `likely` highest. Records the order of calls (the protocols must run back to back)."
    def __init__(self, reply, likely='B'): self.reply, self.likely, self.calls = reply, likely, []
    def chat(self, messages, max_tokens=None):
        self.calls.append('chat'); return type('G', (), {'text': self.reply})()
    def choose_option(self, messages, options, prefix=''):
        from rag_lab.parsing import ParsedAnswer
        self.calls.append('choose')
        lp = {k: (-0.2 if k == self.likely else -4.0) for k in options}
        return ParsedAnswer(status='ok', answer=self.likely, logprobs=lp, confidence=0.9)


@pytest.mark.parametrize('reply, status, answer', [('B', 'ok', 'B'), ('The answer is (C).', 'ok', 'C'), ('', 'missing', None),
                                                   ('   ', 'missing', None), ('E', 'unparseable', None), ('B. Vitamin K', 'unparseable', None),
                                                   ('I am not sure', 'unparseable', None)])
def test_free_text_answers_are_parsed_or_counted_never_defaulted(reply, status, answer):
    llm = _ScriptedLLM(reply)
    a = answer_item(llm, answer_messages(Q, OPTS), OPTS, modes=('scored', 'free_text'))
    assert (a['free_text'].status, a['free_text'].answer) == (status, answer)
    assert a['scored'].answer in OPTS and a['scored'].status == 'ok'   # the scored protocol always names an option
    assert llm.calls == ['choose', 'chat']                           # in the order asked: the second reuses the prefill


def test_answer_item_refuses_bad_modes_and_bad_options():
    for modes in [(), ('scored', 'scored'), ('letter',)]:
        with pytest.raises(ValueError, match='modes'): answer_item(_ScriptedLLM('B'), answer_messages(Q, OPTS), OPTS, modes)
    with pytest.raises(ValueError, match='at least 2 options'): answer_item(_ScriptedLLM('B'), [], {'A': 'x'})


def test_scored_answers_with_the_smoke_model_are_options_with_normalised_confidence(smol):
    a = answer_item(smol, answer_messages(Q, OPTS), OPTS, modes=('scored', 'free_text'))
    s = a['scored']
    assert s.answer in OPTS and set(s.logprobs) == set(OPTS) and 0.25 <= s.confidence <= 1
    assert s.answer == max(s.logprobs, key=s.logprobs.get)
    assert a['free_text'].status in ('ok', 'unparseable', 'missing')
    yn = {'A': 'yes', 'B': 'no', 'C': 'maybe'}   # PubMedQA* options
    assert answer_item(smol, answer_messages('Is scurvy caused by vitamin C deficiency?', yn), yn)['scored'].answer in yn


# ---------------------------------------------------------------- paired headline rows
def _items(cols: dict[str, list[int]], dataset='d1') -> pd.DataFrame:
    return pd.DataFrame([dict(dataset=dataset, item_id=f'{dataset}-{i}', system=s, correct=bool(v))
                         for s, vals in cols.items() for i, v in enumerate(vals)])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=2, max_size=60))
def test_paired_rows_agree_with_compare_paired_and_the_verdict_with_the_interval(pairs):
    m, b = [int(x) for x, _ in pairs], [int(y) for _, y in pairs]
    rows = paired_accuracy_rows(_items({'RAG²': m, 'closed book': b}), ['closed book', 'RAG²'], [('RAG²', 'closed book')], {'d1': 'D1'})
    get = lambda r, k, col='ours': rows[(rows.row == r) & (rows.metric == k)][col].item()
    c = compare_paired(np.array(m, bool), np.array(b, bool))
    assert get('RAG² vs closed book / D1', 'Δ accuracy (points)') == pytest.approx(100 * (np.mean(m) - np.mean(b)))
    assert get('RAG² vs closed book / D1', 'Δ accuracy (points)', 'ci_low') == pytest.approx(c['lo'])
    assert get('RAG² vs closed book / D1', 'McNemar p') == pytest.approx(c['p_mcnemar'])
    assert get('RAG² vs closed book / D1', 'Δ accuracy (points)', 'ci_high') == pytest.approx(c['hi'])
    verdict = rows[rows.row == 'RAG² vs closed book / D1'].note.iloc[0].split(':')[0]
    assert verdict == c['verdict']   # the rows carry compare_paired's verdict; the rule itself is pinned in test_statistics_pinned
    assert get('RAG² / D1', 'accuracy (%)', 'ci_low') <= get('RAG² / D1', 'accuracy (%)') <= get('RAG² / D1', 'accuracy (%)', 'ci_high')
    assert not rows.metric.str.contains('CI').any()   # the results contract: intervals are columns, never rows
    back = comparison_of(rows, 'RAG² vs closed book / D1')   # read back as compare_paired gave it
    assert (back['diff'], back['lo'], back['hi']) == pytest.approx((c['diff'], c['lo'], c['hi'])) and back['verdict'] == verdict


def test_pooled_rows_come_first_and_average_equal_sized_datasets():
    a = _items({'RAG²': [1, 1, 0, 0], 'closed book': [1, 0, 0, 0]}, 'd1')
    b = _items({'RAG²': [1, 1, 1, 1], 'closed book': [0, 0, 1, 1]}, 'd2')
    rows = paired_accuracy_rows(pd.concat([a, b]), ['closed book', 'RAG²'], [('RAG²', 'closed book')], {'d1': 'D1', 'd2': 'D2'},
                                pooled='all (pooled)', paper_diffs={('RAG² vs closed book', 'all (pooled)'): 6.1})
    assert rows.row.iloc[0].endswith('/ all (pooled)')   # the index's headline verdict is the first comparison note
    pooled = rows[(rows.row == 'RAG² / all (pooled)') & (rows.metric == 'accuracy (%)')].ours.item()
    assert pooled == pytest.approx(np.mean([50.0, 100.0])) and rows[rows.row == 'RAG² / all (pooled)'].n.iloc[0] == 8
    assert 'paper +6.1' in rows[rows.row == 'RAG² vs closed book / all (pooled)'].note.iloc[0]
    no_disagreement = paired_accuracy_rows(_items({'RAG²': [1, 0, 1], 'closed book': [1, 0, 1]}), ['RAG²'], [('RAG²', 'closed book')], {'d1': 'D1'})
    assert no_disagreement[no_disagreement.metric == 'McNemar p'].ours.item() == 1.0
    assert no_disagreement[no_disagreement.row == 'RAG² vs closed book / D1'].note.iloc[0].startswith('undecided')


def test_unpaired_comparisons_are_refused():
    it = _items({'RAG²': [1, 0, 1], 'closed book': [1, 0, 1]})
    with pytest.raises(ValueError, match='unpaired'):
        paired_accuracy_rows(it.iloc[:-1], ['RAG²'], [('RAG²', 'closed book')], {'d1': 'D1'})
    # a system missing altogether has no rows, rather than an error (e.g. a PubMedQA* run without standard RAG)
    assert not paired_accuracy_rows(it, RAG2_SYSTEMS, [('standard RAG', 'closed book')], {'d1': 'D1'}).row.str.contains('standard RAG').any()


# ---------------------------------------------------------------- the filter's AUROC with a question-level interval
def test_filter_auroc_is_rank_based_and_its_interval_resamples_questions():
    "The filter's AUROC (metrics.auroc_ci with the question as group): pairs of one question are resampled together."
    from rag_lab.metrics import auroc_ci
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, 90).astype(bool); y[:2] = [False, True]
    g = [f'q{i // 3}' for i in range(90)]
    s = y * 0.6 + rng.uniform(size=90)
    r = auroc_ci(s, y, groups=g)
    assert r['lo'] <= r['auroc'] <= r['hi'] and 0.5 < r['auroc'] <= 1 and (r['n'], r['n_groups']) == (90, 30)
    assert auroc_ci(np.exp(3 * s), y, groups=g, n_boot=50)['auroc'] == pytest.approx(r['auroc'])   # a monotone transform changes nothing
    assert auroc_ci(-s, y, groups=g, n_boot=50)['auroc'] == pytest.approx(1 - r['auroc'])
    assert auroc_ci(s, y, groups=[str(i) for i in range(90)], n_boot=50)['n_groups'] == 90   # every pair its own question
    assert np.isnan(auroc_ci([0.1, 0.2, 0.3], [True] * 3, groups=['a', 'b', 'c'])['auroc'])
    assert auroc_ci([0.1, float('nan'), 0.3], [False, True, True], groups=['a', 'b', 'c'])['n'] == 2   # no score: left out
    with pytest.raises(ValueError, match='length'): auroc_ci([0.1, 0.2], [False, True], groups=['a'])


# ---------------------------------------------------------------- cost per system, fresh compute counted once
def test_cost_rows_charge_shared_calls_to_each_system_and_run_compute_counts_them_once():
    calls = pd.DataFrame([dict(experiment='closed book / MedQA', key='cb1', prompt_tokens=200, completion_tokens=0, seconds=4.0),
                          dict(experiment='closed book / MedQA', key='cb2', prompt_tokens=100, completion_tokens=0, seconds=2.0),
                          dict(experiment='RAG² / MedQA', key='rat1', prompt_tokens=250, completion_tokens=90, seconds=9.0),
                          dict(experiment='RAG² / MedQA', key='cb1', prompt_tokens=200, completion_tokens=0, seconds=4.0)])  # fallback = closed book
    c = cost_rows(calls, {'closed book / MedQA': 2, 'RAG² / MedQA': 1, 'standard RAG / MedQA': 2})
    get = lambda r, m: c[(c.row == r) & (c.metric == m)].ours.item()
    assert get('closed book / MedQA', 'prompt tokens per item') == 150 and get('closed book / MedQA', 'calls per item') == 1
    assert get('RAG² / MedQA', 'compute seconds per item') == 13.0
    assert get('RAG² / MedQA', 'estimated 1-thread seconds per item') == pytest.approx(450 / 49 + 90 / 19)
    assert get('standard RAG / MedQA', 'calls per item') == 0   # an experiment that made no call costs nothing, not an error
    fresh = run_compute(calls)
    assert (fresh['calls'], fresh['prompt_tokens'], fresh['completion_tokens'], fresh['seconds']) == (3, 550, 90, 15.0)
    with pytest.raises(ValueError, match='at least one'): cost_rows(calls, {'RAG² / MedQA': 0})


# ---------------------------------------------------------------- the committed records, read (issue 31)
from conftest import used_records

@pytest.mark.parametrize('profile', ['smoke', 'default'])
def test_every_recorded_prompt_has_the_chapters_system_message(profile):
    "No prompt the published run uses falls back to the chat template's default system message (e.g. 'You are Qwen...')."
    recs = used_records('rag2', profile)
    assert recs, 'no records to read'
    msgs = [r['request'].get('messages') or r['request'].get('context') for r in recs]
    bad = [m[-1]['content'][:60] for m in msgs if not (isinstance(m, list) and m[0] == {'role': 'system', 'content': EXPERT_SYSTEM})]
    assert not bad, f'{len(bad)} of {len(recs)} recorded prompts lack the system message: {bad[:3]}'

@pytest.mark.parametrize('profile', ['default'])
def test_recorded_rationales_finish(profile):
    "Rationales that finish: under 5% stop at max_tokens (issue 31's bar), read from the published run's records."
    gens = [r['value'] for r in used_records('rag2', profile) if r['request']['kind'] == 'chat' and RATIONALE_INSTRUCTION in r['request']['messages'][-1]['content']]
    assert len(gens) >= 100
    cut = sum(g['finish_reason'] == 'length' for g in gens)
    assert cut < 0.05 * len(gens), f'{cut} of {len(gens)} rationales stop at max_tokens'
