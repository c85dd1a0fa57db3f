"""VERIRAG: property tests of the HV / threshold math and adversarial tests of the audit pipeline."""
import json, math
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from rag_lab.llm import LLM, LLMCache, Ledger
from rag_lab.papers.verirag import ALPHA_GRID, CHECK_IDS, K, HVParams, PaperAudit, PaperExtraction, accept, applicable_checks, audit_vectors, binary_metrics, calibrate, chunk_redundancy, effective_contribution, hv_score, judge_agreement, log_odds, macro_f1_from_counts, metrics_from_confusion, paper_quality, prediction_summary, score_claim, sigmoid, tallies, tau_auto
from rag_lab.papers.verirag import JUSTIFICATION_CHARS, ClaimCase, EvidencePaper, ProbeAnswer, audit_case, audit_paper, audit_schema, predicted_valid, run_baseline, temporal_scenarios, verirag_scores, verirag_verdicts
from rag_lab.papers.verirag import BoldnessModel, claim_features

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

def _audit(pid, stance, design='randomized_trial', quantitative=True):
    x = PaperExtraction(study_design=design, human_participants=True, reports_quantitative_results=quantitative,
                        reports_subgroup_analyses=False, funding_or_conflicts_stated=True)
    mask = applicable_checks(x)
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
    x = PaperExtraction(study_design='other', human_participants=False, reports_quantitative_results=False,
                        reports_subgroup_analyses=False, funding_or_conflicts_stated=False)
    mask = applicable_checks(x)
    assert not any(mask.values())
    audit = PaperAudit('p', 'Supports', mask, {}, ['an opinion on vitamin C'])
    assert math.isnan(audit.quality) and effective_contribution(audit.quality, 1.0) == 0.0
    r = score_claim([audit], base=0.6, n_base=1, params=HVParams(1.0, 0.1, 0.05))
    assert (r['h_s'], r['hv'], r['valid']) == (0.0, 0.5, False)
    assert list(audit_schema([]).model_fields) == ['stance']
    with pytest.raises(ValueError, match='non-applicable'): audit_vectors({'C1': 'Pass'}, mask)

@given(st.floats(0, 0.5), st.booleans(), alpha, st.floats(0, 5))
def test_no_applicable_checks_is_never_accepted_even_at_the_lowest_bar(base, dynamic, a, l):
    # tau_base <= 0.5 and (with dynamic off) the fixed bar 0.5: HV = 0.5 sits exactly on the floor
    opinion = _audit('op', 'Supports', design='other', quantitative=False)
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

# --- LLM answers outside the schema

class ScriptedLLM(LLM):
    "A backend double that answers from a script keyed by a phrase of the prompt (the LLM layer's cache and ledger stay real)."
    backend = 'scripted'
    def __init__(self, script, tmp_path):
        super().__init__('scripted', cache=LLMCache(tmp_path / 'calls.sqlite'), ledger=Ledger())
        self.script, self.fingerprint = script, 'scripted-v1:' + json.dumps(script, sort_keys=True)
    def _chat_batch(self, batch, cfg):
        out = []
        for msgs in batch:
            prompt = msgs[0]['content']
            text = next(v for k, v in self.script.items() if k in prompt)
            out.append(dict(text=text, finish_reason='stop', prompt_tokens=len(prompt.split()), completion_tokens=len(text.split())))
        return out

RCT = json.dumps(dict(study_design='randomized_trial', human_participants=True, reports_quantitative_results=True,
                      reports_subgroup_analyses=False, funding_or_conflicts_stated=True))

def _case():
    papers = {p: EvidencePaper(p, 'A trial', 'We randomised 200 adults. Vitamin D reduced falls by 20 percent (95% CI 5-30).',
                               'gold' if p == 'g' else 'topical', 'Supports' if p == 'g' else None) for p in ('t1', 'g', 't2')}
    return ClaimCase('c1', 'test', 'test', 'Vitamin D reduces falls in adults.', True, papers, temporal_scenarios('t1', ['g'], ['t2']))

def test_audit_verdict_outside_schema_is_unparseable_not_defaulted(tmp_path):
    bad_audit = json.dumps({'stance': 'Supports', **{c: 'Maybe' for c in CHECK_IDS}})
    llm = ScriptedLLM({'describe the study': RCT, 'You audit one research paper': bad_audit,
                       'Rate this research claim': '{}'}, tmp_path)
    rec = audit_paper(llm, _case(), 'g')
    assert rec.status == 'audit_unparseable' and rec.audit is None and len(rec.raw) == 2   # first answer + one repair
    ca = audit_case(llm, _case(), scenarios=['TY1'])
    assert ca.features is None                                                              # '{}' misses every field
    assert verirag_verdicts([ca], 'TY1', BoldnessModel().fit(np.array([claim_features(5, 5, 'Robust Study')] * 2), [0, 1]),
                            HVParams()) == ['unparseable']
    assert predicted_valid(['unparseable'], [True]) == [False]                              # scored wrong, counted

FEATURES = json.dumps(dict(specificity=6, testability=7, claim_type='simple', required_standard='Robust Study',
                           agree_probe='Does vitamin D reduce falls?', conflict_probe='Does vitamin D not reduce falls?',
                           paraphrase_probe='Do falls drop with vitamin D?'))

def test_scores_use_the_scenario_size_and_report_dropped_audits(tmp_path):
    ok = json.dumps({'stance': 'Supports', **{c: 'Pass' for c, a in applicable_checks(PaperExtraction.model_validate_json(RCT)).items() if a}})
    llm = ScriptedLLM({'describe the study': RCT, 'Paper t1 (': '{"stance": "Maybe"}', 'You audit one research paper': ok,
                       'Rate this research claim': FEATURES}, tmp_path)
    ca = audit_case(llm, _case(), scenarios=['TY1'])
    assert ca.records['t1'].status == 'audit_unparseable' and ca.records['g'].status == 'ok'
    bm = BoldnessModel().fit(np.array([claim_features(5, 5, 'Robust Study'), claim_features(9, 9, 'Settled Science')]), [0, 1])
    sc = verirag_scores([ca], 'TY1', bm, HVParams(1.0, 0.1, 0.1)).iloc[0]
    assert (sc.n_ev, sc.dropped) == (2, 1)                                                # N_ev = papers in TY1, not parsed audits
    from rag_lab.papers.verirag import tau_base
    base = tau_base('Robust Study', float(bm.predict(claim_features(6, 7, 'Robust Study'))[0]))
    assert sc.tau == pytest.approx(float(np.clip(base + 0.1 * (2 / 1 - 1), 0.5, 0.95)))      # the failed audit still raises the bar

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

@given(st.lists(st.tuples(st.booleans(), st.booleans()), min_size=1, max_size=40))
def test_macro_f1_from_counts_matches_sklearn(pairs):
    yt, yp = zip(*pairs)
    m = binary_metrics(yt, yp)
    assert macro_f1_from_counts(m['tp'], m['fp'], m['fn'], m['tn']) == pytest.approx(m['macro_f1'])

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

def test_probe_justification_is_capped_so_the_json_can_close(tmp_path):
    with pytest.raises(Exception): ProbeAnswer.model_validate(dict(answer='Yes', justification='x' * (JUSTIFICATION_CHARS + 1)))
    assert ProbeAnswer.model_json_schema()['properties']['justification']['maxLength'] == JUSTIFICATION_CHARS
    cot = json.dumps(dict(relevant_statements='falls fell by 20 percent', verdict='Supports'))
    probe = json.dumps(dict(answer='Yes', justification='The trial reports fewer falls.'))
    llm = ScriptedLLM({'Decide whether the evidence supports': cot, 'Answer the question': probe}, tmp_path)
    from rag_lab.papers.verirag import ClaimFeatures
    run = run_baseline(llm, 'CIBER', _case(), 'TY1', ClaimFeatures.model_validate_json(FEATURES))
    assert run.verdict == 'Valid' and run.detail['stances'] == ['Supports', 'Supports', 'Supports', 'Refutes']

def test_audit_with_extra_check_is_rejected(tmp_path):
    # C8 does not apply to a randomised trial: a verdict for it is outside the schema
    extra = json.dumps({'stance': 'Supports', **{c: 'Pass' for c in CHECK_IDS}})
    llm = ScriptedLLM({'describe the study': RCT, 'You audit one research paper': extra}, tmp_path)
    assert audit_paper(llm, _case(), 'g').status == 'audit_unparseable'

def test_valid_audit_flows_into_hv(tmp_path):
    ok = json.dumps({'stance': 'Supports', **{c: 'Pass' for c, a in applicable_checks(PaperExtraction.model_validate_json(RCT)).items() if a}})
    llm = ScriptedLLM({'describe the study': RCT, 'You audit one research paper': ok}, tmp_path)
    rec = audit_paper(llm, _case(), 'g')
    assert rec.status == 'ok' and rec.audit.quality == 1.0 and rec.audit.stance == 'Supports'

def test_baseline_answer_outside_schema_is_unparseable(tmp_path):
    llm = ScriptedLLM({'Decide whether the evidence supports': json.dumps({'relevant_statements': 'x', 'verdict': 'Probably'})}, tmp_path)
    assert run_baseline(llm, 'CoT-RAG', _case(), 'TY1', None).verdict == 'unparseable'
    with pytest.raises(ValueError, match='unknown baseline'): run_baseline(llm, 'ReAct', _case(), 'TY1', None)

# --- metrics

def test_paper_confusion_matrices_reproduce_table3():
    from importlib import resources
    cm = pd.read_csv(resources.files('rag_lab') / 'paper_tables' / 'verirag' / 'derived_confusion_matrices.csv')
    paper = pd.read_csv(resources.files('rag_lab') / 'paper_tables' / 'verirag' / 'table3.csv')
    for r in cm[cm.table == 'table3'].itertuples():
        want = paper[(paper.row == r.row) & (paper.metric == r.metric)].paper.iloc[0]
        assert metrics_from_confusion(r.tp, r.fp, r.fn, r.tn)['macro_f1'] == pytest.approx(want, abs=5e-5)

def test_binary_metrics_refuses_bad_input():
    with pytest.raises(ValueError): binary_metrics([True], [True, False])
    with pytest.raises(ValueError): binary_metrics([], [])


def test_selfrag_schema_wants_one_critique_per_passage():
    from pydantic import ValidationError
    from rag_lab.papers.verirag import selfrag_schema
    S = selfrag_schema(['111', '222'])
    one = lambda pid: dict(passage_id=pid, relevant=True, support='No Support')
    assert len(S.model_validate(dict(critiques=[one('111'), one('222')])).critiques) == 2
    for bad in ([one('111')], [one('111'), one('222'), one('111')], [one('111'), one('999')]):
        with pytest.raises(ValidationError): S.model_validate(dict(critiques=bad))
    assert S.model_json_schema()['properties']['critiques']['maxItems'] == 2  # what the llama.cpp grammar enforces
