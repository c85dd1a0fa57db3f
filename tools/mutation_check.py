"""Mutation check of the statistics: do the tests catch a wrong p-value, verdict or tolerance?

Each mutant below is a plausible mistake in `rag_lab/metrics.py` or `rag_lab/report.py` that once survived the test
suite (issue 34). For each one this script

1. copies the package `rag_lab/` into a temporary folder (the worktree's files are never touched),
2. applies the mutant to the copy (one exact source replacement; if the source line is not found exactly once the
   script stops with exit 2: the code changed and the mutant must be updated, never silently skipped),
3. runs the tests that guard it (`tests/test_statistics_pinned.py`) against the copy (`python -P`, PYTHONPATH = the
   copy; the script first checks that the copy is what gets imported), and
4. reports the mutant as **killed** (the tests failed) or **survived** (they passed).

The unmutated copy is run first: it must pass, or "killed" would mean nothing.

Usage, from the repository root, with the project's venv:

    .venv/bin/python tools/mutation_check.py            # all five mutants
    .venv/bin/python tools/mutation_check.py -k mcnemar # the mutants whose name contains 'mcnemar'
    .venv/bin/python tools/mutation_check.py --tests tests/test_metrics.py   # would these other tests catch them?

Exit status: 0 when every mutant is killed, 1 when any survives, 2 when the check itself could not run (a mutant no
longer applies, the unmutated tests fail, or the copy is not what the tests import). `tests/test_statistics_pinned.py`
runs this script (about a minute), so CI fails when a mutant survives.
"""
from __future__ import annotations
import argparse, os, shutil, subprocess, sys, tempfile, time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TESTS = ['tests/test_statistics_pinned.py']


@dataclass(frozen=True)
class Mutant:
    name: str     # what the mistake is
    module: str   # file under rag_lab/
    old: str      # the exact source text, found exactly once
    new: str      # the mistake


MUTANTS = [
    Mutant('paired bootstrap p one-sided', 'metrics.py',
           'p = min(1.0, 2 * min((d <= 0).mean(), (d >= 0).mean()))', 'p = float((d <= 0).mean())'),
    Mutant('mcnemar one-sided', 'metrics.py',
           'binomtest(only_a, only_a + only_b, 0.5).pvalue', "binomtest(only_a, only_a + only_b, 0.5, alternative='greater').pvalue"),
    Mutant('verdict lo >= 0', 'metrics.py',
           "return 'confirmed' if lo > 0 else", "return 'confirmed' if lo >= 0 else"),
    Mutant('OK tolerance x10', 'report.py',
           "if gap <= tol * (1 + 1e-9): return 'OK'", "if gap <= 10 * tol * (1 + 1e-9): return 'OK'"),
    Mutant('MIN_DECIDABLE_N 30 -> 10', 'metrics.py',
           'MIN_DECIDABLE_N = 30', 'MIN_DECIDABLE_N = 10'),
]


class CheckError(RuntimeError):
    "The mutation check could not be carried out (exit 2)."


def package_copy(dest: Path, mutant: Mutant | None = None) -> Path:
    "A copy of rag_lab/ under `dest` (the folder to put on PYTHONPATH), with `mutant` applied."
    shutil.copytree(REPO / 'rag_lab', dest / 'rag_lab', ignore=shutil.ignore_patterns('__pycache__'))
    if mutant:
        p = dest / 'rag_lab' / mutant.module
        src = p.read_text()
        if src.count(mutant.old) != 1:
            raise CheckError(f"mutant {mutant.name!r}: {mutant.old!r} occurs {src.count(mutant.old)} times in "
                             f"rag_lab/{mutant.module} (expected once): the code changed, update the mutant")
        p.write_text(src.replace(mutant.old, mutant.new))
    return dest


def _env(pkg: Path) -> dict:
    return {**os.environ, 'PYTHONPATH': str(pkg), 'RAG_LAB_MUTATION_CHECK': '1', 'PYTHONDONTWRITEBYTECODE': '1'}


def run_tests(pkg: Path, tests: list[str] = TESTS) -> subprocess.CompletedProcess:
    "The guarding tests run against the package copy at `pkg` (after checking that the copy is what is imported)."
    # -P: the current folder (the repository, with its own rag_lab/) is not put first on sys.path
    who = subprocess.run([sys.executable, '-P', '-c', 'import rag_lab; print(rag_lab.__file__)'], env=_env(pkg),
                         capture_output=True, text=True, cwd=REPO)
    if who.returncode or not Path(who.stdout.strip()).resolve().is_relative_to(pkg.resolve()):
        raise CheckError(f"the tests would not import the copy in {pkg}: {who.stdout.strip() or who.stderr.strip()[-500:]}")
    return subprocess.run([sys.executable, '-P', '-m', 'pytest', '-q', '-x', '-p', 'no:cacheprovider', *tests],
                          env=_env(pkg), capture_output=True, text=True, cwd=REPO)


def check(mutants: list[Mutant], # the mutants to try
          tests: list[str] = TESTS, # pytest arguments: the tests that must catch them
         ) -> dict[str, str]:
    "Mutant name -> 'killed' or 'survived'; raises CheckError when the check cannot be trusted."
    out = {}
    with tempfile.TemporaryDirectory(prefix='rag_lab_mutants_') as tmp:
        t = time.monotonic()
        base = run_tests(package_copy(Path(tmp) / 'unmutated'), tests)
        if base.returncode:
            raise CheckError("the guarding tests fail on the unmutated package, so no mutant can be judged:\n"
                             + base.stdout[-3000:] + base.stderr[-2000:])
        print(f"unmutated: tests pass ({time.monotonic() - t:.0f} s)", flush=True)
        for i, m in enumerate(mutants):
            t = time.monotonic()
            r = run_tests(package_copy(Path(tmp) / f'mutant{i}', m), tests)
            if r.returncode not in (0, 1):   # 2-5: interrupted, internal or usage error, nothing collected
                raise CheckError(f"mutant {m.name!r}: pytest ended with status {r.returncode}:\n{r.stdout[-3000:]}{r.stderr[-2000:]}")
            out[m.name] = 'killed' if r.returncode == 1 else 'survived'
            failed = [l.split(' ')[1] for l in r.stdout.splitlines() if l.startswith('FAILED ')]
            print(f"{m.name} (rag_lab/{m.module}): {out[m.name]}" + (f" by {failed[0]}" if failed else '')
                  + f" ({time.monotonic() - t:.0f} s)", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    ap.add_argument('-k', default='', help='only the mutants whose name contains this text')
    ap.add_argument('--tests', nargs='+', default=TESTS, help=f'the tests that must catch the mutants (default: {" ".join(TESTS)})')
    args = ap.parse_args(argv)
    mutants = [m for m in MUTANTS if args.k.lower() in m.name.lower()]
    if not mutants: print(f"no mutant matches {args.k!r}", file=sys.stderr); return 2
    try: result = check(mutants, args.tests)
    except CheckError as e: print(f"mutation check could not run: {e}", file=sys.stderr); return 2
    survived = [n for n, v in result.items() if v == 'survived']
    print(f"{len(result) - len(survived)} killed, {len(survived)} survived" + (f": {', '.join(survived)}" if survived else ''))
    return 1 if survived else 0


if __name__ == '__main__':
    sys.exit(main())
