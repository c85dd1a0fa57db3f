"""VERIRAG: property tests of the HV / threshold math and adversarial tests of the audit pipeline."""
import json, math, re
import numpy as np
import pandas as pd
import pytest
from hypothesis import assume, given, settings, strategies as st

from rag_lab.calls import LLMCache, Ledger
from rag_lab.llm import LLM
from rag_lab.metrics import metrics_from_confusion, paired_auroc_difference
from rag_lab.report import ITEM_COLUMNS
from rag_lab.papers.verirag_hv import (ALPHA_GRID, CHECK_IDS, K, BoldnessModel, HVParams, PaperAudit, accept, audit_vectors, calibrate,
    chunk_redundancy, claim_features, classification_summary, effective_contribution, grades_to_audit, hv_score, judge_agreement, log_odds,
    paired_f1_difference, paper_quality, prediction_summary, prevalence_macro_f1, score_claim, sigmoid, tallies, tau_auto)
from rag_lab.papers.verirag import (PROBES, SELECTIVE_REPORTING, VERIRAG_SYSTEM, claim_features_of, degrade_methods, degrade_pairs,
    grade_checks, is_question, judge_sample, paper_stances, parse_probes, stance_options, uniform_audits)
from rag_lab.papers.verirag import (ANSWERS_VALID, AUROC, CALIBRATED, CONTENT_FREE, JUSTIFICATION_CHARS, LABEL_METRICS, PREVALENCE_F1,
    SUMMARY_METRICS, BaselineRun, ClaimCase, ClaimFeatures, EvidencePaper, PaperMethods, ProbeAnswer, VeriragParams, audit_claim, audit_methods,
    audit_status, calibrated_verdict, check_pass_rates, claim_items, first_per_set, claim_cases, compare_rows, compare_verdicts,
    content_free_offsets, fit_valid_bias, no_better_than_constant, predicted_valid, run_baseline, score_rows, score_verdicts, stance_confusion,
    temporal_scenarios, valid_logprobs, valid_score, verirag_scores, verirag_verdicts)

tally = st.floats(0, 50, allow_nan=False)
alpha = st.floats(0, 3, allow_nan=False)
lam = st.floats(1e-3, 5, allow_nan=False)
delta = st.floats(1e-3, 10, allow_nan=False)

# --- properties of the math (Prop. 3.1-3.3 and the closed form)

@given(tally, tally, tally, alpha, lam)
def test_closed_form_equals_sigmoid_form_and_is_bounded(hs, hr, hn, a, l):
    hv = hv_score(hs, hr, hn, a, l)
    assert math.isclose(hv, sigmoid(log_odds(hs, hr, hn, a, l)), rel_tol=1e-9, abs_tol=1e-12)
    assert 0 < hv < 1

@given(tally, tally, tally, alpha, lam, delta)
def test_monotone_in_support_and_refutation(hs, hr, hn, a, l, d):
    assert hv_score(hs + d, hr, hn, a, l) > hv_score(hs, hr, hn, a, l) or hv_score(hs, hr, hn, a, l) > 1 - 1e-12
    assert hv_score(hs, hr + d, hn, a, l) < hv_score(hs, hr, hn, a, l) or hv_score(hs, hr, hn, a, l) < 1e-12

@given(tally, tally, tally, st.floats(0.05, 3), lam, delta)
def test_neutral_evidence_lowers_hv_when_alpha_positive(hs, hr, hn, a, l, d):
    assert hv_score(hs, hr, hn + d, a, l) <= hv_score(hs, hr, hn, a, l)

@given(alpha, lam)
def test_no_evidence_gives_one_half(a, l):
    assert hv_score(0, 0, 0, a, l) == 0.5

@given(st.floats(0, 1), st.integers(0, 30), st.integers(1, 10), st.floats(0, 1), st.integers(1, 5))
def test_tau_auto_bounded_and_non_decreasing_in_evidence(base, n_ev, n_base, c, more):
    t = tau_auto(base, n_ev, n_base, c)
    assert 0.5 <= t <= 0.95
    assert tau_auto(base, n_ev + more, n_base, c) >= t

@given(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=K, max_size=K),
       st.lists(st.sampled_from([0.0, 1.0]), min_size=K, max_size=K))
def test_quality_is_a_mean_in_unit_interval(v, m):
    q = paper_quality(v, m)
    if sum(m) == 0: assert math.isnan(q)
    else: assert 0 <= q <= 1 and math.isclose(q, sum(a * b for a, b in zip(v, m)) / sum(m))

def test_duplicate_chunk_is_fully_redundant():
    assert chunk_redundancy(['statins lower LDL cholesterol', 'a different topic entirely', 'statins lower LDL cholesterol'])[2] == pytest.approx(1.0)

# --- lambda = 0 edge

def test_lambda_zero_edge():
    assert hv_score(0.4, 0, 0, 1.0, 0) == 1.0 and hv_score(0, 0.4, 0, 1.0, 0) == 0.0
    assert log_odds(0.4, 0, 0, 1.0, 0) == math.inf and log_odds(0, 0.4, 0, 1.0, 0) == -math.inf
    # no decisive evidence: the lambda -> 0+ limit, not a division error
    for hn, a in [(0, 1.0), (0.7, 1.0), (0.7, 0.0)]:
        assert hv_score(0, 0, hn, a, 0) == pytest.approx(hv_score(0, 0, hn, a, 1e-12), abs=1e-9)
    assert hv_score(0.3, 0.6, 0.2, 1.0, 0) == pytest.approx(hv_score(0.3, 0.6, 0.2, 1.0, 1e-12), abs=1e-9)
    with pytest.raises(ValueError, match='lambda'): hv_score(1, 1, 0, 1.0, -0.1)

def _audit(pid, stance, applicable=True):
    _, mask = grades_to_audit((['Pass'] * 7 + ['NA', 'Pass', 'NA', 'NA']) if applicable else ['NA'] * K)
    return PaperAudit(pid, stance, mask, {c: 'Pass' for c, a in mask.items() if a}, [f'finding number {pid} on vitamin D'])

def test_lambda_zero_through_score_claim():
    r = score_claim([_audit('p1', 'Supports')], base=0.9, n_base=1, params=HVParams(1.0, 0.0, 0.0))
    assert (r['hv'], r['valid']) == (1.0, True)                    # one-sided evidence is decisive at λ = 0
    r = score_claim([_audit('p1', 'Refutes')], base=0.3, n_base=1, params=HVParams(1.0, 0.0, 0.0), dynamic_threshold=False)
    assert (r['hv'], r['valid']) == (0.0, False)
    r = score_claim([], base=0.3, n_base=1, params=HVParams(0.0, 0.0, 0.0), dynamic_threshold=False)
    assert (r['hv'], r['tau'], r['valid']) == (0.5, 0.5, False)     # no evidence at λ = 0: the limit 0.5, not accepted

# --- a paper with no applicable checks

def test_paper_without_applicable_checks_carries_no_weight():
    _, mask = grades_to_audit(['NA'] * K)
    assert not any(mask.values())
    audit = PaperAudit('p', 'Supports', mask, {}, ['an opinion on vitamin C'])
    assert math.isnan(audit.quality) and effective_contribution(audit.quality, 1.0) == 0.0
    r = score_claim([audit], base=0.6, n_base=1, params=HVParams(1.0, 0.1, 0.05))
    assert (r['h_s'], r['hv'], r['valid']) == (0.0, 0.5, False)
    with pytest.raises(ValueError, match='non-applicable'): audit_vectors({'C1': 'Pass'}, mask)

@given(st.floats(0, 0.5), st.booleans(), alpha, st.floats(0, 5))
def test_no_applicable_checks_is_never_accepted_even_at_the_lowest_bar(base, dynamic, a, l):
    # tau_base <= 0.5 and (with dynamic off) the fixed bar 0.5: HV = 0.5 sits exactly on the floor
    opinion = _audit('op', 'Supports', applicable=False)
    assert not any(opinion.mask.values())
    r = score_claim([opinion], base=base, n_base=1, params=HVParams(a, l, 0.0), dynamic_threshold=dynamic)
    assert (r['h_s'], r['hv'], r['tau'], r['valid']) == (0.0, 0.5, 0.5, False)

# --- all evidence neutral

@given(st.lists(st.floats(0.01, 1), min_size=1, max_size=6), st.floats(0.05, 3), lam, st.floats(0, 1))
def test_all_neutral_evidence_is_never_accepted(etas, a, l, base):
    hs, hr, hn = tallies(['Neutral'] * len(etas), etas)
    assert (hs, hr) == (0.0, 0.0)
    hv = hv_score(hs, hr, hn, a, l)
    assert hv < 0.5 <= tau_auto(base, len(etas), 1, 0.05)

@given(st.integers(1, 5), st.floats(0, 0.5), lam, st.booleans())
def test_all_neutral_evidence_with_alpha_zero_is_never_accepted(k, base, l, dynamic):
    # alpha = 0 switches the neutral penalty off: HV is exactly 0.5, and the floor of the bar is 0.5
    r = score_claim([_audit(f'n{i}', 'Neutral') for i in range(k)], base=base, n_base=k, params=HVParams(0.0, l, 0.0),
                    dynamic_threshold=dynamic)
    assert r['h_n'] > 0 and r['hv'] == pytest.approx(0.5) and r['tau'] == 0.5 and not r['valid']

@given(tally, tally, st.floats(0.5, 0.95))
def test_accept_is_strict_and_needs_decisive_evidence(hs, hn, tau):
    assert not accept(hv_score(0, 0, hn, 0.0, 0.1), tau, 0, 0)
    assert not accept(tau, tau, hs, 0)                               # on the bar is not over it
    with pytest.raises(ValueError, match='threshold'): accept(0.9, 0.49, 1, 0)

def test_failed_audits_still_count_in_n_ev():
    a = _audit('p1', 'Supports')
    one = score_claim([a], base=0.6, n_base=1, params=HVParams(1.0, 0.1, 0.05))
    three = score_claim([a], base=0.6, n_base=1, params=HVParams(1.0, 0.1, 0.05), n_ev=3)
    assert (one['n_ev'], three['n_ev']) == (1, 3) and three['tau'] == pytest.approx(one['tau'] + 0.1)
    with pytest.raises(ValueError, match='papers'): score_claim([a, a], base=0.6, n_base=1, params=HVParams(), n_ev=1)

def test_calibrate_tie_break_avoids_alpha_zero_unless_strictly_best():
    yt = [True, False, True, False]
    every = lambda p: pd.DataFrame(dict(valid=yt))                                         # every grid point ties
    best, grid = calibrate(every, yt)
    assert best.alpha == ALPHA_GRID[1] and grid.tied.all() and grid.chosen.sum() == 1
    best, _ = calibrate(lambda p: pd.DataFrame(dict(valid=[True, p.alpha > 0, True, False])), yt)
    assert best.alpha == 0.0                                                               # strictly best
    margin = lambda p: pd.DataFrame(dict(valid=yt, margin=[p.c, -p.c, p.c, -p.c]))         # larger C: further from the bar
    best, _ = calibrate(margin, yt)
    assert best.alpha > 0 and best.c == max(grid.c)
    with pytest.raises(ValueError, match='margins'): calibrate(lambda p: pd.DataFrame(dict(valid=yt, margin=[0.1] * 4))[:3], yt)

def test_prediction_summary_flags_one_class_and_compares_with_all_invalid():
    s = prediction_summary([True] * 5 + [False] * 95, [False] * 100)
    assert s['one_class'] and s['predicted_valid_rate'] == 0 and s['f1_minus_all_invalid'] == 0
    assert s['all_invalid_f1'] == pytest.approx(0.48718, abs=5e-6)
    s = prediction_summary([True, False] * 10, [True, False] * 10)
    assert not s['one_class'] and s['f1_lo'] == s['f1_hi'] == 1.0 and s['all_invalid_f1'] == pytest.approx(1 / 3)

def test_per_check_kappa_and_constant_judges():
    a = pd.DataFrame(dict(paper_id=['p1', 'p2', 'p3', 'p1', 'p2', 'p3'], check=['C1'] * 3 + ['C4'] * 3,
                          verdict=['Pass', 'Pass', 'Pass', 'Pass', 'Fail', 'Uncertain']))
    b = a.assign(verdict=['Pass', 'Pass', 'Fail', 'Pass', 'Fail', 'Uncertain'])
    per, pooled = judge_agreement(a, b)
    c1, c4 = per.set_index('check').loc['C1'], per.set_index('check').loc['C4']
    assert c1.constant and c1.kappa == 0.0 and c1.agreement == pytest.approx(200 / 3)  # agreement without information
    assert not c4.constant and c4.kappa == 1.0 and c4['B Fail %'] == pytest.approx(100 / 3)
    per, pooled = judge_agreement(a[:3], a[:3])
    assert per.constant[0] and math.isnan(per.kappa[0]) and math.isnan(pooled)            # both constant: undefined

# --- a scripted backend: chat answers and scored options keyed by a phrase of the prompt

class ScriptedLLM(LLM):
    "A backend double answering from scripts keyed by a phrase of the prompt (the LLM layer's cache and ledger stay real)."
    backend = 'scripted'
    def __init__(self, script, tmp_path, choices=None):
        super().__init__('scripted', cache=LLMCache(tmp_path / 'calls.sqlite'), ledger=Ledger())
        self.script, self.choices = script, choices or {}   # choices: (prompt phrase, prefix ending) -> option to prefer
        self.fingerprint = 'scripted-v2:' + json.dumps([script, sorted(map(list, self.choices.items()))], sort_keys=True)
    def _chat_batch(self, batch, cfg):
        out = []
        for msgs in batch:
            prompt = '\n'.join(m['content'] for m in msgs if m['role'] == 'user')
            text = next(v for k, v in self.script.items() if k in prompt)
            out.append(dict(text=text, finish_reason='stop', prompt_tokens=len(prompt.split()), completion_tokens=len(text.split())))
        return out
    def _choose(self, context, prefix, options):
        prompt = '\n'.join(m['content'] for m in context if m['role'] == 'user')
        want = next((o for (k, end), o in self.choices.items() if k in prompt and prefix.endswith(end)), None)
        return dict(logprobs=[0.0 if o.strip() == want else -3.0 for o in options], n_tokens=[1] * len(options),
                    context_tokens=len(prompt.split()))

TEXT = ('Background: falls are common in older adults. Methods: In this randomised, double-blind, placebo-controlled trial '
        'we randomised 200 adults aged 70 or more to vitamin D or placebo for one year; outcome assessors were blinded and '
        'the analysis followed intention to treat, with multiple imputation for the 12 participants lost to follow-up. '
        'Results: Vitamin D reduced falls by 20 percent (95% CI 5-30). Conclusion: vitamin D reduces falls in older adults.')
SNIPPET = 'Vitamin D reduced falls by 20 percent.'

def _case():
    papers = {p: EvidencePaper(p, {'t1': 'A trial', 'g': 'The vitamin D trial', 't2': ''}[p], TEXT if p != 't2' else SNIPPET, 'gold' if p == 'g' else 'topical',
                               'Supports' if p == 'g' else None) for p in ('t1', 'g', 't2')}
    return ClaimCase('c1', 'scifact', 'test', 'Vitamin D reduces falls in adults.', True, papers,
                     temporal_scenarios('t1', ['g'], ['t2']))

RCT_GRADES = ['Pass'] * 7 + ['NA', 'Pass', 'NA', 'NA']   # a trial: C8, C10, C11 do not apply
GOOD = json.dumps(dict(grades=RCT_GRADES))
FEATURES = json.dumps(dict(specificity=6, testability=7, required_standard='Robust Study',
                           agree_probe='Does vitamin D reduce falls?', conflict_probe='Does vitamin D not reduce falls?',
                           paraphrase_probe='Do falls drop with vitamin D?'))
AUDIT = 'You audit the methods'
RCT_CHOICES = {('Check C8 ', 'Answer:'): 'D', ('Check C10 ', 'Answer:'): 'D', ('Check C11 ', 'Answer:'): 'D', ('Check C', 'Answer:'): 'A'}
PROBES_TEXT = 'Agree: Yes\nConflict: No\nParaphrase: Does vitamin D reduce falls in adults?'
SCRIPT = {'Write three short yes/no questions': PROBES_TEXT}

def _contexts(llm, kind='choice'):
    "The recorded requests of one kind, in the order they were made."
    return [llm.ledger.calls[r.key]['request'] for r in llm.ledger.records if llm.ledger.calls[r.key]['request']['kind'] == kind]

def test_methods_audit_is_check_by_check_after_one_shared_prefix(tmp_path):
    llm = ScriptedLLM({}, tmp_path, choices=RCT_CHOICES)
    m = audit_methods(llm, _case().papers['g'])
    assert m.status == 'ok' and [c for c, a in m.mask.items() if not a] == ['C8', 'C10', 'C11'] and len(m.calls) == K
    assert set(m.verdicts) == {c for c, a in m.mask.items() if a} and set(m.verdicts.values()) == {'Pass'}
    reqs = _contexts(llm)
    assert [r['options'] for r in reqs] == [[' A', ' B', ' C', ' D']] * K and {r['prefix'] for r in reqs} == {'Answer:'}
    users = [r['context'][1]['content'] for r in reqs]
    assert all(r['context'][0] == {'role': 'system', 'content': VERIRAG_SYSTEM} for r in reqs)   # an explicit system message
    head = users[0].split('Check C1 ')[0]
    assert all(u.startswith(head) and u.count('Check C') == 1 for u in users)             # the paper first, shared; one check each
    assert [u.split('Check ')[1].split(' ')[0] for u in users] == list(CHECK_IDS)          # consecutive calls, checklist order
    snip = audit_methods(llm, _case().papers['t2'])                                        # an untitled snippet: NA by rule, no call
    assert (snip.rule, snip.calls, any(snip.mask.values())) == ('untitled snippet', [], False) and len(_contexts(llm)) == K

def test_uniform_audits_are_detected_and_offsets_can_break_them(tmp_path):
    llm = ScriptedLLM({}, tmp_path, choices={('Check C', 'Answer:'): 'C'})                  # a model that says Uncertain to everything
    m = audit_methods(llm, _case().papers['g'])
    assert uniform_audits({'g': m}) == dict(audited=1, uniform=1, uniform_pct=100.0, by_grade={'Uncertain': 1}, not_papers=0, unparseable=0)
    off = {c: {'Pass': 3.0, 'Fail': 0.0, 'Uncertain': 0.0, 'NA': 0.0} if c == 'C1' else {g: 0.0 for g in ('Pass', 'Fail', 'Uncertain', 'NA')}
           for c in CHECK_IDS}
    m2 = grade_checks('g', m.grade_logprobs, off)
    assert m2.grades['C1'] == 'Pass' and uniform_audits({'g': m2})['uniform'] == 0
    assert uniform_audits({'s': audit_methods(llm, _case().papers['t2'])})['audited'] == 0   # a snippet is not a uniform audit

def test_json_methods_audit_outside_schema_is_unparseable_not_defaulted(tmp_path):
    bad = json.dumps(dict(grades=RCT_GRADES[:-1] + ['Maybe']))
    llm = ScriptedLLM({AUDIT: bad, **SCRIPT}, tmp_path)
    m = audit_methods(llm, _case().papers['g'], mode='json')
    assert m.status == 'unparseable' and m.verdicts is None and len(m.raw) == 2          # first answer + one repair
    case = _case()
    ids = case.scenarios['TY1']
    ca = audit_claim(llm, case, ids, {p: m for p in ids})
    assert audit_status([ca]) == {'claims': 1, 'features_unparseable': 0, 'methods_unparseable': 2}
    assert all(r.audit is None for r in ca.records.values())                             # no weight, not a default quality
    bm = BoldnessModel().fit(np.array([claim_features(5, 5, 'Robust Study'), claim_features(9, 9, 'Settled Science')]), [0, 1])
    sc = verirag_scores([ca], 'TY1', bm, HVParams()).iloc[0]
    assert (sc.verdict, sc.n_ev, sc.dropped, sc.h_s) == ('Invalid', 2, 2, 0.0)
    with pytest.raises(ValueError, match='audit mode'): audit_methods(llm, case.papers['g'], mode='xml')

def test_each_stance_prompt_holds_one_paper_and_no_earlier_answer(tmp_path):
    case = _case()
    case.papers['t1'] = EvidencePaper('t1', 'Bone density', 'Calcium intake was unrelated to bone density in this cohort. ' * 8, 'topical')
    case.papers['g'] = EvidencePaper('g', 'Vitamin D and falls', 'Vitamin D did not reduce falls in adults in this trial. ' * 8, 'gold', 'Refutes')
    want = {'t1': 'Neutral', 'g': 'Refutes', 't2': 'Supports'}
    letter = {p: next(k for k, s in stance_options(case.claim_id, p).items() if s == want[p]) for p in want}
    llm = ScriptedLLM({}, tmp_path, choices={('Calcium intake', 'Answer:'): letter['t1'], ('did not reduce', 'Answer:'): letter['g'],
                                             ('reduced falls by 20', 'Answer:'): letter['t2']})
    st_ = paper_stances(llm, case, case.scenarios['TY3'], 'scored')
    assert {p: a.answer for p, a in st_.items()} == want                                   # refuting evidence can win
    assert set(st_['g'].logprobs) == {'Supports', 'Refutes', 'Neutral'} and st_['g'].confidence > 0.5
    reqs = _contexts(llm)
    assert len(reqs) == 3 and {r['prefix'] for r in reqs} == {'Answer:'}                   # nothing written before the answer
    for r, p in zip(reqs, case.scenarios['TY3']):
        msgs = r['context']
        assert [m['role'] for m in msgs] == ['system', 'user'] and r['options'] == [' A', ' B', ' C']   # one-token letters, no earlier turn
        others = [q for q in case.scenarios['TY3'] if q != p]
        assert all(case.papers[q].text.split('.')[0] not in msgs[1]['content'] for q in others)   # no other paper
        assert not re.search(r'\[\d\]\s*:', msgs[1]['content']) and 'supports' not in msgs[1]['content'].split('Answer with')[1].lower()

def test_free_text_stances_unparseable_are_counted_scored_ones_never(tmp_path):
    llm = ScriptedLLM({'key stance holds': '{"stance": "maybe"}', **SCRIPT, 'Rate this research claim': FEATURES}, tmp_path)
    case = _case()
    ids = case.scenarios['TY1']
    methods = {p: audit_methods(llm, case.papers[p]) for p in ids}
    free = audit_claim(llm, case, ids, methods, mode='free_text')
    assert audit_status([free])['stance_unparseable'] == 2 and all(r.stance.status == 'unparseable' for r in free.records.values())
    scored = audit_claim(llm, case, ids, methods, mode='scored')
    assert audit_status([scored]) == {'claims': 1, 'features_unparseable': 0, 'ok': 2}
    conf = stance_confusion([scored], by_set=True)
    assert int(conf.loc[('scifact', 'gold Supports')].sum()) == 1 and int(conf.loc[('scifact', 'topical (no annotation)')].sum()) == 1
    with pytest.raises(ValueError, match='answer mode'): audit_claim(llm, case, ids, methods, mode='parsed')

@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(categories=('L', 'N', 'Zs', 'P')), min_size=1, max_size=200).filter(lambda s: re.search(r'\w', s)),
       st.sampled_from(['Yes', 'No', 'Unsure', '', 'Agree: yes\nConflict: no', 'Agree: Vitamin D works.']))
def test_every_probe_is_a_question(claim, model_text):
    probes, src = parse_probes(model_text, claim)
    assert set(probes) == set(PROBES) and all(is_question(q) for q in probes.values())
    assert set(src.values()) == {'template'}                                               # none of these outputs is a question

def test_features_are_scored_and_every_ciber_probe_prompt_asks_a_question(tmp_path):
    llm = ScriptedLLM({**SCRIPT, 'Decide whether the evidence supports': 'Snippet [2] says so.'}, tmp_path,
                      choices={('"N/A"', 'Answer:'): 'A', ('How specific', 'Answer:'): '7', ('How directly', 'Answer:'): '7',
                               ('least evidence', 'Answer:'): 'C'})
    f, detail = claim_features_of(llm, 'Vitamin D reduces falls in adults.')
    assert f.specificity == pytest.approx(f.testability) and 7.0 < f.specificity < 8.0      # the probability-weighted digit, shifted to 1-10
    assert (f.required_standard, detail['standard_raw']) == ('Settled Science', 'Settled Science') and detail['probe_sources'] == {'agree_probe': 'template', 'conflict_probe': 'template', 'paraphrase_probe': 'model'}
    assert f.paraphrase_probe == 'Does vitamin D reduce falls in adults?' and f.agree_probe == 'Does the evidence show that vitamin D reduces falls in adults?'
    run_baseline(llm, 'CIBER', _case(), 'TY1', f)
    questions = [m['content'].split('Question: ')[1].split('\n')[0] for r in _contexts(llm) for m in r['context']
                 if m['role'] == 'user' and 'Question: ' in m['content']]
    assert len(questions) == 3 and all(is_question(q) for q in questions)                  # never "Question: Yes"

def test_degrade_methods_removes_the_methods_and_keeps_the_rest():
    text, kinds = degrade_methods(TEXT)
    assert kinds == ['blinding', 'control', 'randomisation', 'sample', 'selective reporting']
    assert not re.search(r'randomi[sz]ed|double-blind|placebo-controlled|\bblinded\b', text, re.I)
    assert '20 adults aged 70' in text and '12 participants' in text and '95% CI 5-30' in text   # 200 -> 20; a count under 20 stays
    assert SELECTIVE_REPORTING in text and 'Vitamin D reduced falls by 20 percent' in text
    assert degrade_methods(TEXT) == (text, kinds)                                            # deterministic
    assert degrade_methods(text)[1] == ['sample', 'selective reporting']                     # only what is left: 20 -> 2 and the sentence again
    pairs = degrade_pairs([_case().papers[p] for p in ('t1', 'g', 't2')], 5)
    assert [(s.paper_id, d.paper_id) for s, d, _ in pairs] == [('t1', 't1~degraded'), ('g', 'g~degraded')]   # the snippet is no paper
    assert all(d.title == s.title and d.text != s.text for s, d, _ in pairs)

def test_judge_sample_is_stratified_by_source_and_grade_profile():
    def pm(pid, grades): return PaperMethods(pid, 'ok', *reversed(grades_to_audit(grades)))
    methods = {f'sf{i}': pm(f'sf{i}', ['Pass'] * K) for i in range(20)} | {f'hv{i}': pm(f'hv{i}', ['Fail'] * K) for i in range(3)}
    methods |= {'mix': pm('mix', ['Pass', 'Fail'] * 5 + ['NA']), 'deg': pm('deg', ['Uncertain'] * K)}
    source = {p: 'scifact' if p.startswith('sf') or p == 'mix' else 'healthver' if p.startswith('hv') else 'degraded copy' for p in methods}
    s = judge_sample(methods, source, 4)
    assert sorted(source[p] for p in s) == ['degraded copy', 'healthver', 'scifact', 'scifact'] and 'mix' in s
    assert len(judge_sample(methods, source, 100)) == len(methods)
    first = dict(list(methods.items())[:5]) | {'deg': methods['deg']}                       # a smaller run: the first papers of the same order
    assert set(judge_sample(first, source, 3)) <= set(judge_sample(methods, source, 40))     # nested: its calls replay from the larger run

def test_each_result_lists_the_calls_behind_it_and_tracing_changes_no_call(tmp_path):
    llm = ScriptedLLM({**SCRIPT, 'Decide whether the evidence supports': 'Snippet [2] says so.'},
                      tmp_path, choices={**RCT_CHOICES, ('Decide whether', 'Verdict:'): 'Supports', ('Question:', 'Answer:'): 'Yes'})
    case = _case()
    ids = case.scenarios['TY1']
    methods = {p: audit_methods(llm, case.papers[p]) for p in ids}
    assert [len(m.calls) for m in methods.values()] == [K, K]                               # eleven checks each
    ca = audit_claim(llm, case, ids, methods)
    assert len(ca.feature_calls) == 5 and len(ca.stance_calls) == len(ids)                  # the standard's prior, 3 scored features, the probes; one stance per paper
    assert ca.calls('TY0') == methods['t1'].calls + ca.feature_calls + ca.stance_calls     # only the scenario's methods audits
    assert ca.calls('TY1') == methods['t1'].calls + methods['g'].calls + ca.feature_calls + ca.stance_calls
    cot = run_baseline(llm, 'COT-RAG', case, 'TY1', ca.features)
    ciber = run_baseline(llm, 'CIBER', case, 'TY1', ca.features)
    assert len(cot.calls) == 2 and ciber.calls[:2] == cot.calls and len(ciber.calls) == 5  # its COT-RAG repeat (cached), 3 probes
    assert ciber.confidence is None and ciber.detail['m_s'] > 0.5                            # no option scored for CIBER's verdict
    made = [r.key for r in llm.ledger.records]                                              # the calls, in the order they were made
    assert made == [k for m in methods.values() for k in m.calls] + ca.feature_calls + ca.stance_calls + cot.calls + ciber.calls
    assert [r.source for r in llm.ledger.records[-5:-3]] == ['cache', 'cache']
    # the items rows: the contract's columns first; each row lists the calls behind it
    bm = BoldnessModel().fit(np.array([claim_features(5, 5, 'Robust Study'), claim_features(9, 9, 'Settled Science')]), [0, 1])
    items = pd.DataFrame(claim_items(ca, verirag_scores([ca], 'TY1', bm, HVParams()).iloc[0], {'COT-RAG': cot, 'CIBER': ciber}, 'TY1'))
    assert list(items.columns[:len(ITEM_COLUMNS)]) == list(ITEM_COLUMNS) and list(items.system) == ['VERIRAG', 'COT-RAG', 'CIBER', 'always-Valid', 'all-Invalid']
    it = items.set_index('system')
    assert (it.calls['VERIRAG'], it.calls['COT-RAG'], it.calls['CIBER'], it.calls['all-Invalid'], it.calls['always-Valid']) == \
           (ca.calls('TY1'), cot.calls, ca.feature_calls + ciber.calls, [], [])            # CIBER reads the features
    assert (it.pred['always-Valid'], it.valid_score['CIBER'], it.valid_score['COT-RAG']) == ('Valid', ciber.detail['m_s'] - ciber.detail['m_r'],
                                                                                             valid_score('COT-RAG', cot))
    assert math.isnan(it.valid_score['all-Invalid'])                                        # a constant has no score
    assert math.isnan(it.confidence['VERIRAG']) and math.isnan(it.confidence['CIBER']) and it.confidence['COT-RAG'] == cot.confidence
    assert (it.supports_mass['CIBER'], it.option_logprobs['COT-RAG'], it.option_logprobs['VERIRAG'], it.raw['VERIRAG']) == \
           (ciber.detail['m_s'], cot.logprobs, '', '')                                         # scored stances: no text to read
    assert list(items.correct) == [it.pred[s] == it.gold[s] for s in items.system] and not it.correct['all-Invalid']


def test_score_and_compare_rows_hold_each_interval_beside_its_value():
    truth = [True, False] * 10
    verdicts = ['Valid', 'Invalid'] * 8 + ['Invalid', 'Valid', 'unparseable', 'Invalid']
    m = score_verdicts(truth, verdicts, seed=1)
    rows = score_rows('VERIRAG / toy', m)
    assert [r['metric'] for r in rows] == ['accuracy (%)', 'macro-F1', 'MCC', PREVALENCE_F1, ANSWERS_VALID, 'unparseable answers']   # no score: no AUROC
    assert m['accuracy'] == pytest.approx(85.0) and (m['answers_valid'], m['unparseable']) == (45.0, 1)   # 9 of 20 said Valid, 1 unreadable
    for r, k in zip(rows, ('accuracy', 'macro_f1', 'mcc', 'macro_f1_paper')):
        assert (r['ours'], r['ci_low'], r['ci_high'], r['n']) == (m[k], m[f'{k}_lo'], m[f'{k}_hi'], 20)
    assert rows[0]['note'] == 'TP/FP/FN/TN 8/1/2/9; predicted Valid 0.45; 1 unparseable (scored wrong)'
    assert [r['metric'] for r in score_rows('x / y', m, metrics=('macro-F1',))] == ['macro-F1']
    assert score_rows('x / y', m, note='no better than always-Valid')[0]['note'].endswith('(scored wrong); no better than always-Valid')
    scored = score_verdicts(truth, verdicts, seed=1, score=[1.0, -1.0] * 10)
    assert [r['metric'] for r in score_rows('x / y', scored)][4] == AUROC and scored['auroc'] == 1.0
    d = compare_verdicts(truth, verdicts, ['Invalid'] * 20, seed=1)
    rows = compare_rows('VERIRAG vs all-Invalid / toy', d)
    assert [r['metric'] for r in rows] == ['Δ accuracy (points)', 'McNemar p', 'Δ macro-F1']   # no scores: no Δ AUROC, no verdict called
    assert (rows[0]['ours'], rows[0]['ci_low'], rows[0]['ci_high']) == (d['acc']['diff'], d['acc']['lo'], d['acc']['hi'])
    assert (rows[2]['ours'], rows[2]['ci_low'], rows[2]['ci_high']) == (d['f1']['diff'], d['f1']['lo'], d['f1']['hi'])
    assert 'ci_low' not in rows[1] and len({r['note'] for r in rows}) == 1 and rows[0]['note'].startswith('undecided: too few paired items')
    d = compare_verdicts(truth * 2, verdicts * 2, ['Invalid'] * 40, seed=1, method_score=[1.0, -1.0] * 20, baseline_score=[0.0] * 40)
    rows = compare_rows('VERIRAG vs all-Invalid / toy', d)
    assert rows[-1]['metric'] == 'Δ AUROC' and (rows[-1]['ours'], d['auroc']['b']) == (0.5, 0.5)   # a constant ranks nothing
    assert d['f1']['lo'] > 0 and d['verdict'] == 'confirmed' and rows[0]['note'].startswith('confirmed: ')
    assert not any(re.search(r'CI (low|high)', r['metric']) for r in rows)                  # what `Results.table` refuses

def test_selfrag_schema_wants_one_critique_per_passage():
    from pydantic import ValidationError
    from rag_lab.papers.verirag import selfrag_schema
    S = selfrag_schema(2)
    one = lambda n: dict(passage=n, relevant=True, support='No Support')
    assert len(S.model_validate(dict(critiques=[one('1'), one('2')])).critiques) == 2
    for bad in ([one('1')], [one('1'), one('2'), one('1')], [one('1'), one('3')]):
        with pytest.raises(ValidationError): S.model_validate(dict(critiques=bad))
    assert S.model_json_schema()['properties']['critiques']['maxItems'] == 2  # what the llama.cpp grammar enforces

# --- the paired statistics of the headline

labels = st.lists(st.tuples(st.booleans(), st.booleans(), st.booleans()), min_size=2, max_size=60)

@settings(max_examples=40, deadline=None)
@given(labels)
def test_summary_intervals_contain_the_estimate_and_agree_with_sklearn(rows):
    from sklearn.metrics import confusion_matrix, f1_score, matthews_corrcoef
    yt, ya, _ = map(list, zip(*rows))
    s = classification_summary(yt, ya, n_boot=200)
    assert s['macro_f1'] == pytest.approx(f1_score(yt, ya, average='macro', labels=[False, True], zero_division=0))
    assert s['mcc'] == pytest.approx(matthews_corrcoef(yt, ya) if len(set(yt) | set(ya)) > 1 else 0.0)
    assert s['accuracy'] == pytest.approx(100 * np.mean(np.array(yt) == np.array(ya))) and s['n'] == len(yt)
    for k in ('accuracy', 'macro_f1', 'mcc'):
        assert s[f'{k}_lo'] - 1e-9 <= s[f'{k}_hi']
    tn, fp, fn, tp = confusion_matrix(yt, ya, labels=[False, True]).ravel()
    assert (s['tp'], s['fp'], s['fn'], s['tn']) == (tp, fp, fn, tn)

@settings(max_examples=40, deadline=None)
@given(labels)
def test_paired_f1_difference_is_antisymmetric_and_zero_for_equal_systems(rows):
    yt, ya, yb = map(list, zip(*rows))
    ab, ba = paired_f1_difference(yt, ya, yb, n_boot=200), paired_f1_difference(yt, yb, ya, n_boot=200)
    assert ab['diff'] == pytest.approx(-ba['diff']) and ab['lo'] == pytest.approx(-ba['hi']) and ab['hi'] == pytest.approx(-ba['lo'])
    assert {ab['verdict'], ba['verdict']} in ({'undecided'}, {'confirmed', 'refuted'})
    same = paired_f1_difference(yt, ya, ya, n_boot=200)
    assert (same['diff'], same['lo'], same['hi'], same['verdict']) == (0.0, 0.0, 0.0, 'undecided')

def test_classification_summary_refuses_unpaired_or_empty_input():
    with pytest.raises(ValueError): classification_summary([True, False], [True])
    with pytest.raises(ValueError): classification_summary([], [])

def test_check_pass_rates_count_distinct_audited_papers():
    verdicts, mask = grades_to_audit(RCT_GRADES)
    ok = verdicts | {'C1': 'Fail'}
    pr = check_pass_rates({'a': PaperMethods('a', 'ok', mask, ok), 'b': PaperMethods('b', 'ok', mask, verdicts),
                           'c': PaperMethods('c', 'unparseable')}).set_index('check')
    assert pr.loc['C1', 'applicable'] == 2 and pr.loc['C1', 'Fail %'] == 50 and pr.loc['C1', 'Pass %'] == 50
    assert pr.loc['C8', 'applicable'] == 0 and math.isnan(pr.loc['C8', 'Pass %'])          # no applicable paper: no rate

# --- parameters and samples

def test_parameters_are_refused_before_work():
    with pytest.raises(ValueError, match='cannot also be secondary'): VeriragParams(scenario='TY1', secondary_scenarios='TY0,TY1')
    with pytest.raises(ValueError, match='cannot exceed n'): VeriragParams(n=5, n_secondary=6)
    with pytest.raises(ValueError, match='unknown scenario'): VeriragParams(scenario='TY2')
    with pytest.raises(ValueError, match='audit_mode=json'): VeriragParams(backend='openai', model='gpt-4o', answer_mode='free_text')
    with pytest.raises(ValueError, match='free_text'): VeriragParams(backend='openai', model='gpt-4o', audit_mode='json')
    assert VeriragParams(secondary_scenarios='NONE').secondary == []
    with pytest.raises(ValueError, match='audit_calibration=none'): VeriragParams(audit_mode='json', audit_calibration='content_free')
    assert (VeriragParams().audit_calibration, VeriragParams(audit_mode='json').audit_calibration) == ('content_free', 'none')
    # a calibration of option scores with free-text verdicts (which have none) is refused before any work
    for cal in ('dev', 'content_free'):
        with pytest.raises(ValueError, match=f'calibration={cal} shifts option scores'): VeriragParams(answer_mode='free_text', calibration=cal)
    with pytest.raises(ValueError): VeriragParams(calibration='test')
    assert (VeriragParams().calibration, VeriragParams(answer_mode='free_text').calibration) == ('dev', 'none')   # free text: none by default
    from rag_lab.config import check_params, resolve_params
    assert resolve_params('verirag', 'paper').calibration == 'none'                       # the paper profile's free text runs uncalibrated
    with pytest.raises(ValueError, match='do not fit together'): check_params('verirag', 'default', {'answer_mode': 'free_text', 'calibration': 'dev'})
    assert check_params('verirag', 'default', {'answer_mode': 'free_text'}) == {'answer_mode': 'free_text'}
    assert check_params('verirag', 'smoke', {'calibration': 'content_free'}) == {'calibration': 'content_free'}

def test_samples_are_nested_and_splits_disjoint():
    small, large = claim_cases('healthver,covidfact', 'test', 2, 7), claim_cases('healthver,covidfact', 'test', 4, 7)
    assert [c.claim_id for c in first_per_set(large, 2)] == [c.claim_id for c in small]
    train = claim_cases('healthver,covidfact', 'train', 4, 7)
    assert not {c.claim_id for c in train} & {c.claim_id for c in large}
    test_papers = {p for c in large for p in c.papers}
    assert all(p.startswith('hv-test-') for p in test_papers if p.startswith('hv-'))   # paper ids cannot collide across splits

# --- metrics

def test_paper_confusion_matrices_reproduce_table3():
    from importlib import resources
    cm = pd.read_csv(resources.files('rag_lab') / 'paper_tables' / 'verirag' / 'derived_confusion_matrices.csv')
    paper = pd.read_csv(resources.files('rag_lab') / 'paper_tables' / 'verirag' / 'table3.csv')
    for r in cm[cm.table == 'table3'].itertuples():
        want = paper[(paper.row == r.row) & (paper.metric == r.metric)].paper.iloc[0]
        assert metrics_from_confusion(r.tp, r.fp, r.fn, r.tn)['macro_f1'] == pytest.approx(want, abs=5e-5)


# --- priors, thresholds and calibration (issue 28)

def test_valid_scores_pool_the_final_options_and_calibration_shifts_only_the_prior():
    run = BaselineRun('Valid', 0.4, {'Supports': -1.0, 'Refutes': -1.2, 'Neutral': -1.3, 'Unverifiable': -6.0})
    lp = valid_logprobs('COT-RAG', run)
    assert lp['Valid'] == -1.0 and lp['Invalid'] == pytest.approx(np.logaddexp.reduce([-1.2, -1.3, -6.0]))
    assert valid_score('COT-RAG', run) == pytest.approx(lp['Valid'] - lp['Invalid']) and valid_score('COT-RAG', run) < 0   # the argmax says Valid, the pooled odds do not
    assert calibrated_verdict('COT-RAG', run, {'Valid': 0.0, 'Invalid': 0.0}) == 'Invalid'
    assert calibrated_verdict('COT-RAG', run, {'Valid': 1.0, 'Invalid': -1.0}) == 'Valid'
    assert valid_logprobs('CIBER', run) is None and math.isnan(valid_score('Self-RAG', BaselineRun('unparseable')))
    assert calibrated_verdict('FLARE', BaselineRun('unparseable'), {'Valid': 0.0, 'Invalid': 0.0}) == 'unparseable'   # nothing to shift
    assert set(CALIBRATED) == {'COT-RAG', 'Self-RAG', 'FLARE'}

@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(-3, 0), st.floats(-3, 0), st.booleans()), min_size=2, max_size=30), st.floats(-2, 2))
def test_fitted_offsets_sum_to_zero_and_follow_a_shifted_prior(rows, shift):
    assume(len({t for *_, t in rows}) == 2)   # one class only: the best offset is infinite, nothing to compare
    runs = [BaselineRun('Valid', logprobs={'Valid': v, 'Invalid': i, 'Uncertain': -9.0}) for v, i, _ in rows]
    truth = [t for _, _, t in rows]
    b = fit_valid_bias('Self-RAG', runs, truth)
    assert b['Valid'] + b['Invalid'] == pytest.approx(0.0, abs=1e-9)
    # the same runs with every Valid log-probability raised by `shift`: the fitted offset takes it back (the fit is shift-equivariant)
    moved = [BaselineRun('Valid', logprobs={'Valid': r.logprobs['Valid'] + shift, 'Invalid': r.logprobs['Invalid'], 'Uncertain': -9.0})
             for r in runs]
    b2 = fit_valid_bias('Self-RAG', moved, truth)
    assert b2['Valid'] - b2['Invalid'] == pytest.approx(b['Valid'] - b['Invalid'] - shift, abs=0.05)

def test_content_free_offsets_ask_the_baseline_about_nothing(tmp_path):
    llm = ScriptedLLM({'Decide whether the evidence supports': 'Nothing to go on.', 'Critique each snippet': '[1]: irrelevant'}, tmp_path,
                      choices={('Decide whether', 'Verdict:'): 'Supports', ('Now give a verdict', 'Verdict:'): 'Valid',
                               ('Assess the claim', 'Initial verdict:'): 'Supports', ('Assess the claim', 'one paper:'): 'no'})
    for b in CALIBRATED:
        off = content_free_offsets(llm, b)
        assert off['Valid'] < 0 < off['Invalid'] and off['Valid'] + off['Invalid'] == pytest.approx(0.0, abs=1e-12)   # undoes the lean to Valid
    users = [m['content'] for c in llm.ledger.calls.values() for m in c['request'].get('messages') or c['request'].get('context')
             if m['role'] == 'user' and m['content'].startswith('Evidence snippets')]
    assert len(users) >= len(CALIBRATED) and all(f'"{CONTENT_FREE}"' in u and u.startswith('Evidence snippets, numbered by paper:\n[1] N/A\n\n')
                                                 for u in users)   # nothing about any claim in any prompt
    with pytest.raises(ValueError, match='cannot be calibrated'): content_free_offsets(llm, 'CIBER')

@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.floats(-5, 5), st.floats(-5, 5), st.booleans()), min_size=2, max_size=50))
def test_paired_auroc_difference_is_antisymmetric_and_matches_sklearn(rows):
    from sklearn.metrics import roc_auc_score
    a, b, y = map(list, zip(*rows))
    ab, ba = paired_auroc_difference(a, b, y, n_boot=100), paired_auroc_difference(b, a, y, n_boot=100)
    if len(set(y)) < 2: assert math.isnan(ab['diff']); return
    assert ab['a'] == pytest.approx(roc_auc_score(y, a)) and ab['b'] == pytest.approx(roc_auc_score(y, b))
    assert ab['diff'] == pytest.approx(-ba['diff']) and ab['lo'] == pytest.approx(-ba['hi']) and ab['hi'] == pytest.approx(-ba['lo'])
    assert paired_auroc_difference(a, [0.0] * len(a), y, n_boot=100)['b'] == 0.5

@settings(max_examples=30, deadline=None)
@given(labels, st.integers(2, 4))
def test_prevalence_macro_f1_reweights_counts_and_ignores_duplication(rows, k):
    yt, ya, _ = map(list, zip(*rows))
    pf = prevalence_macro_f1(yt, ya, n_boot=100)
    if len(set(yt)) < 2: assert math.isnan(pf['macro_f1']); return
    assert prevalence_macro_f1(yt * k, ya * k, n_boot=100)['macro_f1'] == pytest.approx(pf['macro_f1'])   # only the rates matter
    share = np.mean(yt)   # at the claims' own share, it is the plain macro-F1
    assert prevalence_macro_f1(yt, ya, valid_share=float(share), n_boot=100)['macro_f1'] == pytest.approx(classification_summary(yt, ya, n_boot=10)['macro_f1'])

def test_a_system_inside_the_best_constants_interval_is_flagged():
    truth = [True] * 29 + [False] * 21
    constants = {l: score_verdicts(truth, [l] * 50) for l in ('Valid', 'Invalid')}
    lenient = score_verdicts(truth, ['Valid'] * 28 + ['Invalid'] + ['Valid'] * 21)   # Valid for all but one (Valid) claim
    assert no_better_than_constant(lenient, constants) == 'no better than always-Valid'
    good = score_verdicts(truth, ['Valid'] * 27 + ['Invalid'] * 2 + ['Invalid'] * 19 + ['Valid'] * 2)
    assert no_better_than_constant(good, constants) == ''


def test_chunk_redundancy_is_memoised_by_text_and_hands_out_its_own_array():
    "Calibration scores each claim's chunks once per grid point: the TF-IDF is computed once; a caller that edits the "
    "array it got changes nothing for the next caller."
    from rag_lab.papers.verirag_hv import chunk_redundancy, _redundancy_of
    chunks = ['aspirin lowers fever in adults', 'aspirin lowers fever in children']
    first = chunk_redundancy(chunks); first[:] = -1
    hits = _redundancy_of.cache_info().hits
    again = chunk_redundancy(tuple(chunks))
    assert _redundancy_of.cache_info().hits == hits + 1 and again[0] == 0 and 0.3 < again[1] < 1
