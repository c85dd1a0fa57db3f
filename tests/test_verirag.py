"""VERIRAG: property tests of the HV / threshold math and adversarial tests of the audit pipeline."""
import json, math
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings, strategies as st

from rag_lab.llm import LLM, LLMCache, Ledger
from rag_lab.verirag import (CHECK_IDS, K, HVParams, PaperAudit, PaperExtraction, applicable_checks, audit_vectors,
                             binary_metrics, chunk_redundancy, effective_contribution, hv_score, log_odds,
                             metrics_from_confusion, paper_quality, score_claim, sigmoid, tallies, tau_auto)
from rag_lab.verirag_pipeline import (ClaimCase, EvidencePaper, audit_case, audit_paper, audit_schema, predicted_valid,
                                      run_baseline, temporal_scenarios, verirag_verdicts)
from rag_lab.verirag import BoldnessModel, claim_features

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

# --- all evidence neutral

@given(st.lists(st.floats(0.01, 1), min_size=1, max_size=6), st.floats(0.05, 3), lam, st.floats(0, 1))
def test_all_neutral_evidence_is_never_accepted(etas, a, l, base):
    hs, hr, hn = tallies(['Neutral'] * len(etas), etas)
    assert (hs, hr) == (0.0, 0.0)
    hv = hv_score(hs, hr, hn, a, l)
    assert hv < 0.5 <= tau_auto(base, len(etas), 1, 0.05)

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
    from rag_lab.verirag_pipeline import selfrag_schema
    S = selfrag_schema(['111', '222'])
    one = lambda pid: dict(passage_id=pid, relevant=True, support='No Support')
    assert len(S.model_validate(dict(critiques=[one('111'), one('222')])).critiques) == 2
    for bad in ([one('111')], [one('111'), one('222'), one('111')], [one('111'), one('999')]):
        with pytest.raises(ValidationError): S.model_validate(dict(critiques=bad))
    assert S.model_json_schema()['properties']['critiques']['maxItems'] == 2  # what the llama.cpp grammar enforces
