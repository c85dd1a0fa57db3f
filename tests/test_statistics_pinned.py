"""The statistics behind every verdict, pinned against values computed by hand and at their boundaries: the exact
McNemar p, the two-sided paired-bootstrap p, the verdict at lo = 0 and at n = 29 / 30, and the OK tolerance at exactly
half a unit of the paper's last printed digit. `tools/mutation_check.py` checks that these tests catch each wrong
version of the code they guard (a one-sided test, `lo >= 0`, a tolerance ten times too wide, decisions from 10 items);
the last test here runs it."""
import math, os, subprocess, sys
from math import comb
from pathlib import Path
import numpy as np
import pytest
from rag_lab.metrics import MIN_DECIDABLE_N, compare_paired, mcnemar, paired_bootstrap, verdict
from rag_lab.report import check_against_paper, printed_tolerance

REPO = Path(__file__).resolve().parents[1]
NAN = float('nan')


def _pairs(only_a: int, only_b: int, both: int = 0, neither: int = 0) -> tuple[np.ndarray, np.ndarray]:
    "Per-item correctness of two systems with these counts of (A only, B only, both, neither) right."
    a = [True] * only_a + [False] * only_b + [True] * both + [False] * neither
    b = [False] * only_a + [True] * only_b + [True] * both + [False] * neither
    return np.array(a), np.array(b)


# ---------------------------------------------------------------- McNemar: exact, two-sided
@pytest.mark.parametrize('only_a, only_b, by_hand', [
    (1, 7, 2 * (comb(8, 0) + comb(8, 1)) / 2 ** 8),      # P(X <= 1) + P(X >= 7), X ~ Bin(8, 1/2): 18/256
    (7, 1, 2 * (comb(8, 0) + comb(8, 1)) / 2 ** 8),      # the same test with the systems swapped
    (0, 5, 2 / 2 ** 5),                                  # P(X = 0) + P(X = 5) = 1/16
    (15, 0, 2 / 2 ** 15),
    (3, 3, 1.0), (2, 3, 1.0),                            # balanced: every outcome is as extreme, p = 1
    (0, 0, 1.0)])                                        # never disagree: 1.0 by definition
def test_mcnemar_is_the_exact_two_sided_binomial_p(only_a, only_b, by_hand):
    a, b = _pairs(only_a, only_b, both=5, neither=3)     # concordant pairs never enter the test
    assert mcnemar(a, b) == pytest.approx(by_hand, rel=1e-12, abs=1e-15)


# ---------------------------------------------------------------- paired bootstrap p: two-sided
def test_paired_bootstrap_p_is_two_sided_by_hand():
    # Two items with per-item differences +1 and 0. A resample draws item 1 twice (d = 1) with probability 1/4,
    # once (d = 1/2) with 1/2, never (d = 0) with 1/4: P(d <= 0) = 1/4, P(d >= 0) = 1, two-sided p = 2 * 1/4 = 1/2
    # (one-sided it would be 1/4 or 1). Monte-Carlo error of 20,000 resamples: 2 * sqrt(1/4 * 3/4 / 20000) = 0.006.
    assert paired_bootstrap([1, 0], [0, 0], n_boot=20000)['p'] == pytest.approx(0.5, abs=0.03)
    assert paired_bootstrap([0, 0], [1, 0], n_boot=20000)['p'] == pytest.approx(0.5, abs=0.03)   # the other direction
    assert paired_bootstrap([1, 0, 1], [1, 0, 1])['p'] == 1.0        # identical systems: no evidence at all
    assert paired_bootstrap([1, 1, 1], [0, 0, 0])['p'] == 0.0        # every resample favours A


# ---------------------------------------------------------------- the verdict: at lo = 0, hi = 0, n = 29 / 30
@pytest.mark.parametrize('lo, hi, expected', [(0.0, 5.0, 'undecided'), (1e-12, 5.0, 'confirmed'),
                                              (-5.0, 0.0, 'undecided'), (-5.0, -1e-12, 'refuted'),
                                              (0.0, 0.0, 'undecided'), (-1.0, 1.0, 'undecided'), (NAN, 1.0, 'undecided')])
def test_verdict_needs_the_interval_strictly_off_zero(lo, hi, expected):
    assert verdict(lo, hi, 1000) == expected


def test_an_interval_touching_zero_is_undecided_end_to_end():
    # 30 items, the method wins one and ties the rest: diff = +3.3 points, but a resample misses the win with
    # probability (29/30)^30 = 0.36 > 0.025, so the interval's lower end is exactly 0
    m, b = _pairs(1, 0, neither=29)
    c = compare_paired(m, b)
    assert c['lo'] == 0.0 and c['diff'] > 0 and c['verdict'] == 'undecided'


def test_fewer_than_30_paired_items_never_decide():
    assert MIN_DECIDABLE_N == 30
    assert (verdict(1.0, 5.0, 29), verdict(1.0, 5.0, 30)) == ('undecided', 'confirmed')
    assert (verdict(-5.0, -1.0, 29), verdict(-5.0, -1.0, 30)) == ('undecided', 'refuted')
    # every item won: the interval is [100, 100], far above 0, and still 29 items decide nothing
    for n, won, lost in [(29, 'undecided', 'undecided'), (30, 'confirmed', 'refuted')]:
        w, l = np.ones(n, bool), np.zeros(n, bool)
        assert compare_paired(w, l)['lo'] == 100.0
        assert (compare_paired(w, l)['verdict'], compare_paired(l, w)['verdict']) == (won, lost), n


# ---------------------------------------------------------------- OK = within half a unit of the printed digit
@pytest.mark.parametrize('paper_text, ours, expected', [
    ('71.5', 71.55, 'OK'), ('71.5', 71.45, 'OK'),          # exactly half a unit (0.05) away
    ('71.5', 71.5501, 'close'), ('71.5', 71.4499, 'close'),  # a hair further
    ('0.7', 0.75, 'OK'),                                    # 0.75 - 0.7 is 0.05000000000000004 in floats: still OK
    ('0.662213', 0.6622135, 'OK'), ('0.662213', 0.6622136, 'close'),
    ('1,234', 1234.5, 'OK'), ('1,234', 1234.6, 'close'),
    ('71.5', 75.0, 'close'), ('71.5', 75.1, 'off')])       # close: within max(3 tol, 5% of 71.5 = 3.575)
def test_ok_means_within_half_a_unit_of_the_printed_digit(paper_text, ours, expected):
    from rag_lab.report import parse_reported
    assert check_against_paper(parse_reported(paper_text), ours, NAN, paper_text) == expected


@pytest.mark.parametrize('tol, ours, expected', [(0.01, 0.61, 'OK'), (0.01, 0.6101, 'close'), (0.01, 0.625, 'close'),
                                                 (0.01, 0.6301, 'off'), (0.1, 10.5, 'close'), (0.1, 10.51, 'off')])
def test_an_explicit_tolerance_is_used_as_given(tol, ours, expected):
    paper = 0.60 if ours < 1 else 10.0
    assert check_against_paper(paper, ours, tol) == expected


def test_printed_tolerance_is_half_a_unit_of_the_last_digit():
    assert [printed_tolerance(s) for s in ['71.5', '0.662213', '1,234', '12.3M', '2e-3', '+2.70', '5']] == \
        pytest.approx([0.05, 5e-7, 0.5, 5e4, 5e-4, 0.005, 0.5], rel=1e-12)


# ---------------------------------------------------------------- the mutation check
@pytest.mark.timeout(240)
def test_mutation_check_kills_every_mutant():
    "tools/mutation_check.py: each of the five wrong statistics is caught by the tests above (about a minute)."
    if os.environ.get('RAG_LAB_MUTATION_CHECK'): pytest.skip('inside the mutation check itself')
    r = subprocess.run([sys.executable, str(REPO / 'tools' / 'mutation_check.py')], capture_output=True, text=True,
                       timeout=230, cwd=REPO)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert r.stdout.count(': killed') == 5 and 'survived' not in r.stdout.replace('0 survived', ''), r.stdout
