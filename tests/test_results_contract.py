"""The results contract's number format: every float a published CSV holds is written at a declared precision, so a
replay on another CPU (whose BLAS, torch or scikit-learn round the last bits differently) writes the same bytes.

The perturbation tests write the same tables twice through `Results.table` and `Results.items`, the second time with
every float moved a few units in the last place (ulps), and compare the files byte for byte."""
import re
from pathlib import Path
import numpy as np
import pandas as pd
import pytest
from rag_lab.report import CSV_SIGNIFICANT_DIGITS, Results, csv_number, start_run

REPO = Path(__file__).resolve().parents[1]


def _perturbed(df: pd.DataFrame, rng: np.random.Generator, ulps: int) -> pd.DataFrame:
    "Every float of `df` (numeric columns and floats inside object columns) moved `ulps` ulps up or down at random; "
    "an exact zero stays zero (the precision is relative: a CPU's rounding moves a value by a fraction of itself)."
    def move(x):
        if isinstance(x, (bool, np.bool_)) or not isinstance(x, (float, np.floating)) or not np.isfinite(x) or x == 0: return x
        to = np.inf if rng.random() < 0.5 else -np.inf
        for _ in range(ulps): x = np.nextafter(x, to)
        return float(x)
    return df.map(move)


def _realistic_rows(rng: np.random.Generator) -> pd.DataFrame:
    "Values of the kinds the chapters publish: accuracies k/n, bootstrap bounds, paired differences, p-values, "
    "Ridge coefficients, macro-F1, exact rounding ties (k/512) and tiny residues."
    n = rng.integers(2, 1001, 300)
    k = rng.integers(0, n + 1)
    vals = np.concatenate([k / n * 100, (k - rng.integers(0, n + 1)) / n * 100, rng.uniform(0, 1, 200) ** 6,
                           rng.normal(0, 1, 200), np.arange(1, 513) / 512, [0.1953125, 1 / 3, 2 / 3, 1e-17, -0.0]])
    return pd.DataFrame(dict(row=[f'system {i % 7} / subset {i % 3}' for i in range(len(vals))],
                             metric=[f'metric {i}' for i in range(len(vals))], ours=vals))


@pytest.mark.parametrize('ulps', [1, 3, 16])
def test_tables_are_written_identically_when_every_float_moves_in_its_last_bits(tmp_path, monkeypatch, ulps):
    monkeypatch.setenv('IN_TEST', '1')   # start_run's own output folder is a temporary one
    rng = np.random.default_rng(ulps)
    ours = _realistic_rows(rng)
    files = []
    for i, frame in enumerate([ours, _perturbed(ours, rng, ulps)]):
        _, res = start_run('reason_verify', 'smoke')
        res = Results(res.run, out_dir=tmp_path / str(i))
        res.table('perturbation', frame, model='m', n=10)
        items = pd.DataFrame(dict(dataset='d', item_id=[str(j) for j in range(len(frame))], system='s', pred='A', gold='B',
                                  correct=False, confidence=frame.ours.abs() / 100, option_logprobs='', raw='', calls='',
                                  margin=frame.ours, mixed=list(frame.ours)))
        res.items('perturbation', items)
        files.append([(res.report_dir / f).read_bytes() for f in ('perturbation.csv', 'items_perturbation.csv')])
    assert files[0] == files[1]
    assert not (files[0][0] == _perturbed(ours, rng, ulps).to_csv(index=False).encode())   # raw floats would differ


def test_the_perturbation_is_not_vacuous():
    "Written raw, the same perturbation changes the files: the test above can fail."
    rng = np.random.default_rng(0)
    ours = _realistic_rows(rng)
    assert ours.to_csv(index=False) != _perturbed(ours, rng, 1).to_csv(index=False)


def _significant_digits(text: str) -> int:
    mantissa = text.lstrip('-').split('e')[0].replace('.', '').lstrip('0')
    return len(mantissa)


def test_every_float_in_the_published_csvs_is_at_the_declared_precision():
    "No committed table holds a float with more significant digits than declared (counts are integers)."
    too_long = []
    for p in sorted((REPO / 'reports').glob('*/*.csv')):
        df = pd.read_csv(p, dtype=str, keep_default_na=False)
        numeric = pd.read_csv(p).select_dtypes('number').columns   # text columns (call keys such as '0695228496680e54') are not numbers
        for col in numeric:
            for v in df[col]:
                if re.fullmatch(r'-?\d+\.\d+(e[+-]?\d+)?|-?\d+e[+-]?\d+', v) and _significant_digits(v) > CSV_SIGNIFICANT_DIGITS:
                    too_long.append((p.relative_to(REPO).as_posix(), col, v))
    assert too_long == [], too_long[:10]


def test_csv_number_declared_rounding():
    "Half to even at the declared digit, after absorbing last-bit noise; counts stay integers; NaN is empty."
    assert [csv_number(v) for v in (44.666666666666664, 52.0, 0.1953125, 0.19531250000000003, 12720.0, float('nan'), -0.0)] == \
           ['44.6667', '52', '0.195312', '0.195312', '12720', '', '0']
    assert csv_number(1 / 3, sig=3) == '0.333' and csv_number(123456789.5) == '1.23457e+08'
