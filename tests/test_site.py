"""The website: built from a run's executed notebooks, opened in headless Chromium: every page loads, no broken link
or image, no console error, nothing fetched from outside the site. Two screenshots are kept as test artefacts."""
import functools, http.server, json, os, re, shutil, socketserver, subprocess, sys, threading
from pathlib import Path
import pandas as pd
from urllib.parse import urljoin, urlparse
import pytest

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CHROMIUM = shutil.which('chromium') or shutil.which('chromium-browser')
ARTEFACTS = Path(os.environ.get('RAG_LAB_ARTEFACTS', REPO / 'tests' / 'artefacts'))
CHROME_FLAGS = ['--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
                '--disable-component-update', '--disable-sync']


def _git_visible(repo: Path) -> list[str]:
    "What git shows changed where a run could write (other paths may be edited by people working in this checkout "
    "while the tests run); a new file in nbs/ would be an executed copy."
    lines = subprocess.run(['git', 'status', '--porcelain', '--untracked-files=all'], cwd=repo, capture_output=True, text=True).stdout.splitlines()
    return [l for l in lines if l[3:].startswith(('reports/', 'figures/', 'records/', 'runs/', 'data/'))
            or (l.startswith('??') and l[3:].startswith('nbs/'))]


@pytest.fixture(scope='module')
def scratch_run():
    """A smoke run of two chapters (one without and one with an LLM) as a user makes one, `rag-lab reproduce --profile
    smoke` in the repository with no --out: the site below is built from it, and it is held to writing into a scratch
    folder (one run for both: each would otherwise replay the same chapters). Yields the run's printout, its folder and
    what git showed before and after it; the folder is removed afterwards."""
    before = _git_visible(REPO)
    r = subprocess.run([str(BIN / 'rag-lab'), 'reproduce', '--profile', 'smoke', '--only', 'claim_aware', 'verirag', '--no-progress'],
                       capture_output=True, text=True, timeout=1500, cwd=REPO)
    dests = [Path(l.split()[2]) for l in r.stdout.splitlines() if l.startswith('writing to ') and '/runs/' in l]
    try:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        yield r, dests[0], before, _git_visible(REPO)
    finally:
        for d in dests: shutil.rmtree(d, ignore_errors=True)


def test_a_smoke_run_writes_to_scratch_and_leaves_git_status_clean(scratch_run):
    "Only the main job publishes: a smoke run writes under runs/ (git-ignored), says where, and changes nothing git sees."
    r, dest, before, after = scratch_run
    line = next(l for l in r.stdout.splitlines() if l.startswith('writing to '))
    assert dest.parent == REPO / 'runs' and dest.name.endswith('-smoke') and 'scratch' in line, line
    assert (dest / 'reports' / 'claim_aware' / 'table5.csv').exists() and (dest / 'reports' / 'index.md').exists()
    assert json.loads((REPO / 'reports' / 'claim_aware' / 'run_meta.json').read_text())['profile'] == 'default'
    assert after == before, (before, after)
    assert '## Scorecard' in r.stdout and '| claim_aware |' in r.stdout   # printed at the end


@pytest.fixture(scope='module')
def site(scratch_run):
    "The scratch run's website."
    out = scratch_run[1]
    r = subprocess.run([str(BIN / 'rag-lab'), 'site', '--out', str(out)], capture_output=True, text=True, timeout=900, cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out / 'reports' / 'site' / '_build' / 'html'


@pytest.fixture(scope='module')
def server(site):
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *a: None
    with socketserver.TCPServer(('127.0.0.1', 0), handler) as httpd:
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        yield f'http://127.0.0.1:{httpd.server_address[1]}/'
        httpd.shutdown()


def test_site_has_every_part(site):
    pages = {p.relative_to(site).as_posix() for p in site.rglob('*.html')}
    assert {'intro.html', 'scorecard.html', 'papers/20_claim_aware.html', 'papers/40_verirag.html'} <= pages, sorted(pages)
    assert any(p.startswith('items/verirag') for p in pages), sorted(pages)      # the per-item browser of an LLM paper
    assert any(p.startswith('library/04c_llm') for p in pages)                     # library notebooks as API chapters
    assert (site / 'mathjax' / 'tex-chtml-full.js').exists()          # MathJax is served by the site itself
    # index.html is Jupyter Book's redirect page, without an icon link: a browser that asks for /favicon.ico first got a 404
    assert (site / 'favicon.ico').read_bytes()[:4] == b'\x00\x00\x01\x00'   # an ICO file
    text = (site / 'papers' / '20_claim_aware.html').read_text()
    assert '<img' in text and 'table5' in text                                    # executed: tables and figures inline


def test_a_scratch_site_opens_on_its_own_labelled_results(site):
    "The smoke run is a scratch run: its landing page is its own scorecard and verdicts under a banner, not the README."
    intro = (site / 'intro.html').read_text()
    assert 'Scratch run, not the published results' in intro and 'scratch run: profile smoke' in intro
    assert 'What it found' not in intro                                   # the README's published findings are not shown
    card = (site / 'scorecard.html').read_text()
    assert 'href="papers/20_claim_aware.html"' in card and 'within_5pct' not in card   # plain headers, chapters linked


def test_a_chapter_page_opens_on_its_findings_and_prints_no_raw_pipe_tables(site):
    "Findings (main metric per system, headline verdicts) right under the title, before any code; printed markdown rendered."
    for page in ('papers/20_claim_aware.html', 'papers/40_verirag.html'):
        text = (site / page).read_text()
        assert 'Findings of this run' in text and text.index('Findings of this run') < text.index('cell_input'), page
        assert '<table' in text[text.index('Findings of this run'):text.index('cell_input')], page   # the findings table rendered
        outputs = [seg.split('<div class="cell ')[0] for seg in text.split('class="cell_output')[1:]]
        assert outputs and not [o for o in outputs if re.search(r'\|\s*:?-{3,}:?\s*\|', o)], page   # no table left as pipes


def test_a_number_leads_to_its_items_and_their_calls(site):
    "HELM-style trail: headline rows link to their items, each item has an anchor, its question and its calls' page."
    from rag_lab.pages import anchor
    out = site.parents[3]   # <out>/reports/site/_build/html
    results = (site / 'results' / 'verirag.html').read_text()
    assert 'ours [95% CI]' in results and 'nan' not in re.sub(r'<[^>]+>', ' ', results).lower().split()
    assert re.search(r'href="\.\./items/verirag-headline\.html#system-[^"]+"', results), 'no headline row links to its items'
    page = (site / 'items' / 'verirag-headline.html').read_text()
    items = pd.read_csv(out / 'reports' / 'verirag' / 'items_headline.csv', dtype={'item_id': str})
    for r in items.drop_duplicates(['dataset', 'item_id']).itertuples():
        assert f'id="{anchor(r.dataset, r.item_id)}"' in page, r.item_id        # an anchor per item
    assert 'href="../calls/verirag-headline.html#call-' in page                 # items link to their recorded calls
    calls = (site / 'calls' / 'verirag-headline.html').read_text()
    assert 'id="call-' in calls and '→' in calls and '[user]' in calls       # prompt, then output
    assert (site / 'items' / 'verirag-headline-disagreements.html').exists()
    for slug in ('claim_aware', 'verirag'):   # every figure captioned
        figs = list((out / 'figures' / slug).glob('*.png'))
        assert (site / 'results' / f'{slug}.html').read_text().count('<figcaption') == len(figs), slug


def test_every_page_loads_in_headless_chromium_without_errors(site, server):
    assert CHROMIUM, "headless Chromium is needed for this test: apt-get install chromium (.ci/run does)"
    from playwright.sync_api import sync_playwright
    ARTEFACTS.mkdir(parents=True, exist_ok=True)
    problems, seen = [], set()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROME_FLAGS)
        page = browser.new_page(viewport={'width': 1280, 'height': 900})
        def on_request(req):
            if urlparse(req.url).hostname not in ('127.0.0.1', None) and not req.url.startswith('data:'):
                problems.append(f'{page.url}: external request {req.url}')
        page.on('request', on_request)
        page.on('console', lambda m: m.type == 'error' and problems.append(f'{page.url}: console error {m.text}'))
        page.on('pageerror', lambda e: problems.append(f'{page.url}: page error {e}'))
        def on_failed(req):   # a request the next page.goto cancelled (Chromium asks for the favicon late) is not a fault
            cancelled = req.failure == 'net::ERR_ABORTED' and (site / urlparse(req.url).path.lstrip('/')).is_file()
            if not cancelled: problems.append(f'{page.url}: failed {req.url} {req.failure}')
        page.on('requestfailed', on_failed)
        page.on('response', lambda r: r.status >= 400 and problems.append(f'{page.url}: HTTP {r.status} {r.url}'))
        for rel in sorted(p.relative_to(site).as_posix() for p in site.rglob('*.html') if '_static' not in p.parts):
            url = urljoin(server, rel)
            page.goto(url, wait_until='networkidle')
            broken = page.evaluate("[...document.images].filter(i => !i.complete || i.naturalWidth === 0).map(i => i.src)")
            problems += [f'{rel}: broken image {b}' for b in broken]
            for href in page.evaluate("[...document.querySelectorAll('a[href]')].map(a => a.href)"):
                target = urlparse(href)
                if target.hostname == '127.0.0.1' and target.path not in seen:
                    seen.add(target.path)
                    if not (site / target.path.lstrip('/')).exists() and not target.path.endswith('/'):
                        problems.append(f'{rel}: broken link {href}')
            # no markdown table left as raw pipes outside code (a chapter's printed tables render as tables)
            pipes = page.evaluate(r"""(() => { const m = (document.querySelector('main') || document.body).cloneNode(true);
                m.querySelectorAll('.cell_input, div.highlight-python, div.highlight-bash').forEach(e => e.remove());
                return m.textContent.split('\n').filter(l => /^\s*\|[\s:|-]*-{3,}[\s:|-]*\|\s*$/.test(l)).length; })()""")
            if pipes: problems.append(f'{rel}: {pipes} raw pipe table rule(s) shown as text')
            if rel == 'intro.html': page.screenshot(path=str(ARTEFACTS / 'site-landing.png'), full_page=False)
            if rel == 'intro.html':   # the README's paper table fits the page: long paths wrap instead of scrolling sideways
                overflow = page.evaluate("[...document.querySelectorAll('main table')].map(t => t.scrollWidth - t.parentElement.clientWidth)")
                problems += [f'{rel}: table {i} is {o} px wider than the page' for i, o in enumerate(overflow) if o > 1]
            if rel == 'papers/20_claim_aware.html': page.screenshot(path=str(ARTEFACTS / 'site-claim_aware.png'), full_page=False)
            if rel == 'items/verirag-headline.html': page.screenshot(path=str(ARTEFACTS / 'site-items.png'), full_page=False)
        browser.close()
    assert not problems, '\n'.join(problems[:30])
    assert (ARTEFACTS / 'site-landing.png').stat().st_size > 10_000 and (ARTEFACTS / 'site-claim_aware.png').stat().st_size > 10_000


def test_a_link_to_an_item_opens_its_answers(site, server):
    "An item's anchor opens its collapsed <details> (open_target.js), on arrival and on a later jump within the page."
    assert CHROMIUM, "headless Chromium is needed for this test: apt-get install chromium (.ci/run does)"
    from playwright.sync_api import sync_playwright
    page_file = site / 'items' / 'verirag-headline.html'
    item = re.findall(r'<details id="([^"]+)"', page_file.read_text())[0]
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROME_FLAGS)
        page = browser.new_page(viewport={'width': 1280, 'height': 900})
        page.goto(urljoin(server, 'items/verirag-headline.html') + f'#{item}', wait_until='networkidle')
        assert page.evaluate(f"document.getElementById({item!r}).open"), 'the linked item arrived collapsed'
        page.evaluate(f"document.getElementById({item!r}).open = false; window.location.hash = 'main-content'")
        page.evaluate(f"window.location.hash = {item!r}")   # a jump within the page, as from the system list above it
        page.wait_for_function(f"document.getElementById({item!r}).open", timeout=5000)
        browser.close()
