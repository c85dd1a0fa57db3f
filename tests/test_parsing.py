"""Answer parsing never invents an answer; accuracy and bootstrap behave."""
import json
import numpy as np
import pytest
from hypothesis import given, strategies as st, settings
from rag_lab.parsing import parse_option, parse_mirage_output, mirage_locate_answer, parse_final_answer
from rag_lab.metrics import accuracy, bootstrap_ci, paired_bootstrap

YN = {'A': 'yes', 'B': 'no', 'C': 'maybe'}
MCQ = {'A': 'Aspirin', 'B': 'Heparin', 'C': 'Warfarin', 'D': 'None of the above'}

@given(st.text(max_size=200))
@settings(max_examples=300, deadline=None)
def test_parse_option_total_and_honest(text):
    p = parse_option(text, YN)
    assert p.status in ('ok', 'unparseable', 'missing')
    assert (p.answer in YN) if p.ok else p.answer is None

@given(st.sampled_from(list(MCQ)), st.sampled_from(['{k}', '{k}.', '({k})', '{k}. {v}', 'Option {k}', '{v}']))
def test_parse_option_reads_every_honest_format(k, fmt):
    assert parse_option(fmt.format(k=k, v=MCQ[k]), MCQ).answer == k

def test_contradictory_letter_and_text_is_unparseable():
    assert parse_option('A. no', YN).status == 'unparseable'

@given(st.text(max_size=300))
@settings(max_examples=300, deadline=None)
def test_parse_mirage_output_never_crashes(raw):
    p = parse_mirage_output(raw, YN)
    assert p.answer is None or p.answer in YN

def test_unparseable_is_never_mapped_to_a_default():
    raw = json.dumps({'step_by_step_thinking': 'unclear', 'answer_choice': 'cannot determine'})
    assert parse_mirage_output(raw, YN).answer is None
    assert mirage_locate_answer(raw) == 'A'            # what MIRAGE's own script would have done
    assert accuracy([None], ['A'])['acc'] == 0.0

def test_truncated_json_uses_the_answer_field():
    assert parse_mirage_output('{"step_by_step_thinking": "x" "answer_choice": "B. no"}', YN).answer == 'B'
    assert parse_mirage_output('{"step_by_step_thinking": "cut off mid', YN).status == 'unparseable'

def test_bootstrap_interval_contains_estimate_and_narrows_with_n():
    rng = np.random.default_rng(0)
    small, big = rng.random(50) < 0.7, rng.random(2000) < 0.7
    lo_s, hi_s = bootstrap_ci(small); lo_b, hi_b = bootstrap_ci(big)
    assert lo_s <= small.mean() <= hi_s and lo_b <= big.mean() <= hi_b
    assert hi_b - lo_b < hi_s - lo_s

def test_paired_bootstrap_detects_a_real_difference_and_not_a_null_one():
    rng = np.random.default_rng(1)
    a = (rng.random(500) < 0.8).astype(float)
    assert paired_bootstrap(a, a)['p'] == 1.0
    b = a.copy(); b[:60] = 0
    r = paired_bootstrap(a, b)
    assert r['lo'] > 0 and r['p'] < 0.01
    with pytest.raises(ValueError, match='equal-length'): paired_bootstrap(a, b[:10])
    with pytest.raises(ValueError, match='at least one'): paired_bootstrap([], [])

FORMATS = ['{k}', '{k}.', '({k})', '{k}. {v}', '{v}']

@given(st.sampled_from(list(MCQ)), st.sampled_from(list(MCQ)), st.sampled_from(FORMATS), st.sampled_from(FORMATS),
       st.sampled_from(['{a} or {b}', '{a}/{b}', '{a}, {b}', '{a}\n{b}']))
def test_a_final_answer_naming_two_options_is_never_read_as_one(k1, k2, f1, f2, join):
    "`FINAL ANSWER: A. yes, B. no` hedges: it must be unparseable (counted), never the first option named."
    if k1 == k2: return
    a, b = f1.format(k=k1, v=MCQ[k1]), f2.format(k=k2, v=MCQ[k2])
    text = 'FINAL ANSWER: ' + join.format(a=a, b=b)
    if join == '{a}\n{b}' and '.' not in f2 and '(' not in f2: return   # a bare second line is prose, not an option list
    assert parse_final_answer(text, MCQ).status == 'unparseable', text

@given(st.sampled_from(list(MCQ)), st.sampled_from(FORMATS), st.sampled_from(['', '.', ' because it works', ', since it works']))
def test_a_final_answer_naming_one_option_is_read(k, fmt, tail):
    text = 'Reasoning here. FINAL ANSWER: ' + fmt.format(k=k, v=MCQ[k]) + tail
    assert parse_final_answer(text, MCQ).answer == k, text
