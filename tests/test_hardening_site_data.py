"""Hardening, third round (issue 34): the site never reads model output as Markdown or directives; answer parsers
count hostile input as unparseable; a data file is parsed from the very bytes that were verified, and a directory or a
FIFO in its place is one clear DataError (a FIFO never blocks)."""
import hashlib, html.parser, os, re, threading
from pathlib import Path
import pandas as pd
import pytest
import rag_lab.data as data
from rag_lab.data import DataError, DataFile
from rag_lab.parsing import parse_json_verdict, parse_mirage_output, tally
from rag_lab.report import csv_text
from rag_lab.pages import item_browser

SECRET = 'SECRET-8f2c1e-never-published'
HEADING = 'Injected Heading From A Model'


# ---------------------------------------------------------------- the site's item pages
def _hostile_items(secret_file: str) -> pd.DataFrame:
    "Items whose model outputs try to end the HTML block: a blank line, a Markdown heading, an include directive."
    raws = [f'yes, because\n\n# {HEADING}\n\nand more',
            f'no\n\n```{{include}} {secret_file}\n```\n\nafter the directive',
            f'maybe\n\n```{{eval-rst}}\n.. include:: {secret_file}\n```',
            '\r\rcarriage returns\r\n\r\nand $x$ {math}`y` <b>bold</b> &amp; *stars*',
            '\nstarts with a line break\u2028and a line separator\x0c and a form feed']
    return pd.DataFrame(dict(dataset='pubmedqa', item_id=[str(i) for i in range(len(raws))], system='RAG',
                             pred='A', gold=['A', 'B', 'A', 'C', 'A'], correct=[1, 0, 1, 0, 1],
                             confidence=[0.9, float('nan'), 0.5, 0.25, 1.0],
                             option_logprobs=['{"A": -0.1054, "B": -2.3026}', '', '{"A": -0.6931}', '', ''],
                             raw=raws, calls=['4f210eef9f164fc0 e26b21dfbe194dd8', '', '25f58eceec69df8e', '', ''],
                             response=raws, note=['# not a heading either', 'x\n\ny', '', '', '']))   # a chapter's own text column


def _roundtrip(df: pd.DataFrame, tmp_path: Path) -> pd.DataFrame:
    "The items as the site reads them: written as an items CSV, read back as site_sources reads it."
    p = tmp_path / 'items_hostile.csv'; p.write_text(csv_text(df))
    return pd.read_csv(p, dtype={'item_id': str})


def _myst_tokens(page: str):
    "The page parsed by MyST's markdown-it, configured as the site's _config.yml configures it."
    from markdown_it.renderer import RendererHTML
    from myst_parser.config.main import MdParserConfig
    from myst_parser.parsers.mdit import create_md_parser
    md = create_md_parser(MdParserConfig(enable_extensions={'dollarmath', 'amsmath', 'html_image'}), RendererHTML)
    return md.parse(page)


class _PreTexts(html.parser.HTMLParser):
    "The text of every <pre> in a page as a browser shows it: character references decoded, a line break right after <pre> dropped."
    def __init__(self):
        super().__init__(convert_charrefs=True); self.pres, self._in = [], False
    def handle_starttag(self, tag, attrs):
        if tag == 'pre': self._in = True; self.pres.append(None)
    def handle_endtag(self, tag):
        if tag == 'pre': self._in = False
    def handle_data(self, d):
        if self._in: self.pres[-1] = (d[1:] if d[:1] == '\n' else d) if self.pres[-1] is None else self.pres[-1] + d


def test_item_page_is_a_heading_and_one_raw_html_block_under_myst(tmp_path):
    page = item_browser(_roundtrip(_hostile_items('../secret.txt'), tmp_path), 'demo: items_hostile *x* $y$')
    kinds = [t.type for t in _myst_tokens(page)]
    assert kinds == ['heading_open', 'inline', 'heading_close', 'html_block'], kinds   # no data read as Markdown
    assert [c.type for c in _myst_tokens(page)[1].children] == ['text']   # the title is text, never emphasis or math
    body = page.split('\n', 2)[2]
    assert all(line.strip() for line in body.splitlines()), 'a blank line would end the raw HTML block'


def test_item_page_keeps_every_output_exactly_and_shows_the_core_columns(tmp_path):
    df = _hostile_items('../secret.txt')
    page = item_browser(_roundtrip(df, tmp_path), 'demo')
    p = _PreTexts(); p.feed(page)
    norm = lambda s: s.replace('\r\n', '\n').replace('\r', '\n')   # a CSV round trip may turn \r into \n
    for raw in df.raw:
        assert norm(raw) in [norm(t or '') for t in p.pres], raw          # every output shown whole, line breaks and all
    for header in ('confidence', 'option log-probs', 'raw output', 'calls'):
        assert f'<th>{header}</th>' in page
    assert '<code>4f210eef9f164fc0</code>' in page and 'call-4f210eef' not in page   # no calls page given: keys as plain text
    assert 'A: -0.1054' in page                                       # option log-probabilities one per option


def _build_book(src: Path, pages: dict[str, str]) -> Path:
    "A Jupyter Book with the site's own configuration and these pages, built as `rag-lab site` builds it."
    from rag_lab import pages as report   # the site's pages and build (07b_pages)
    (src / '_static').mkdir(parents=True); (src / '_extra').mkdir()
    (src / '_config.yml').write_text(report._SITE_CONFIG)
    (src / 'intro.md').write_text('# Intro\n')
    for name, text in pages.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True); (src / name).write_text(text)
    (src / '_toc.yml').write_text(report._toc({'Per-item outputs': [n.removesuffix('.md') for n in pages]}))
    return report.jupyter_book(src, src.parent / 'built').parent


@pytest.mark.timeout(300)
def test_hostile_outputs_never_reach_the_built_site_as_markup(tmp_path):
    secret = tmp_path / 'secret.txt'; secret.write_text(SECRET)
    df = _hostile_items(os.path.relpath(secret, tmp_path / 'src' / 'items'))   # MyST reads a path relative to the page
    pages = {'items/demo-hostile.md': item_browser(_roundtrip(df, tmp_path), 'demo: items_hostile'),
             'items/demo-benign.md': item_browser(_roundtrip(df.assign(raw='ok', response='ok', note=''), tmp_path), 'demo: items_benign')}
    site = _build_book(tmp_path / 'src', pages)
    text, benign = (site / 'items' / 'demo-hostile.html').read_text(), (site / 'items' / 'demo-benign.html').read_text()
    leaked = [p for p in site.rglob('*') if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert not leaked, f'the include directive in a model output published a local file: {leaked}'
    assert not re.search(rf'<h[1-6][^>]*>[^<]*{HEADING}', text) and 'id="injected-heading' not in text, 'a model output added a heading'
    assert len(re.findall(r'<h[1-6][ >]', text)) == len(re.findall(r'<h[1-6][ >]', benign)), 'a model output added a heading'
    p = _PreTexts(); p.feed(text)
    assert any(f'# {HEADING}' in (t or '') for t in p.pres)                   # shown as the text it is
    assert text.count('<details id=') == text.count('</details>') == len(df)   # one anchored entry per item
    assert text.count('<pre>') == text.count('</pre>')


# ---------------------------------------------------------------- answer parsers: counted, never a crash
LABELS = ['SUPPORTS', 'REFUTES', 'NOT ENOUGH INFO']
YN = {'A': 'yes', 'B': 'no', 'C': 'maybe'}


@pytest.mark.parametrize('text', ["{1: 'SUPPORTS'}", "{1: 'x', 'verdict': 'SUPPORTS'}", "{(1, 2): 'REFUTES'}",
                                  "{None: 'SUPPORTS', 'verdict': 'SUPPORTS'}"])
def test_json_verdict_with_a_non_string_key_is_unparseable(text):
    p = parse_json_verdict(text, LABELS)
    assert (p.status, p.answer, p.raw) == ('unparseable', None, text)
    assert tally([p])['unparseable'] == 1


@pytest.mark.parametrize('raw', ['[' * 100000, '{"a": ' * 100000, '[' * 100000 + ']' * 100000])
def test_deeply_nested_mirage_output_is_unparseable(raw):
    p = parse_mirage_output(raw, YN)
    assert (p.status, p.answer) == ('unparseable', None) and p.raw == raw
    assert tally([p])['unparseable'] == 1


def test_deeply_nested_mirage_output_still_reads_a_stated_answer():
    p = parse_mirage_output('[' * 100000 + '"answer_choice": "B. no"', YN)   # not JSON, but it says its answer
    assert (p.status, p.answer) == ('ok', 'B')


# ---------------------------------------------------------------- data: parse the bytes that were verified
REL = 'claim_verification/covidfact/COVIDFACT_dataset.jsonl'
GOOD = b'{"claim": "good", "label": "SUPPORTED"}\n'
EVIL = b'{"claim": "evil", "label": "SUPPORTED"}\n'    # same size: only the content differs


@pytest.fixture
def mirror(tmp_path, monkeypatch):
    "A temporary RAG_LAB_DATA mirror holding one registered file (COVID-Fact) with toy content."
    monkeypatch.setenv('RAG_LAB_DATA', str(tmp_path / 'mirror'))
    monkeypatch.setitem(data.REGISTRY, REL, DataFile(REL, hashlib.sha256(GOOD).hexdigest(), 'test'))
    p = tmp_path / 'mirror' / REL
    p.parent.mkdir(parents=True)
    return p


def test_file_swapped_with_same_size_and_mtime_after_a_verified_load_is_refused(mirror):
    mirror.write_bytes(GOOD)
    assert data.load_covidfact().claim.tolist() == ['good']
    st = mirror.stat()
    mirror.write_bytes(EVIL); os.utime(mirror, ns=(st.st_atime_ns, st.st_mtime_ns))   # a cache keyed by (size, mtime) cannot tell
    with pytest.raises(DataError, match='Checksum mismatch') as e: data.load_covidfact()
    assert str(mirror) in str(e.value)


def test_file_swapped_between_hashing_and_parsing_is_never_parsed(mirror, monkeypatch):
    mirror.write_bytes(GOOD)
    real, swapped = hashlib.sha256, []
    class SwapAfterHashing:
        "sha256 that replaces the file the moment its digest has been computed (the race between check and parse)."
        def __init__(self, *a): self.h = real(*a)
        def update(self, b): self.h.update(b)
        def digest(self): return self.h.digest()
        def hexdigest(self):
            d = self.h.hexdigest()
            if not swapped: mirror.write_bytes(EVIL); swapped.append(d)
            return d
    monkeypatch.setattr(hashlib, 'sha256', SwapAfterHashing)
    try: claims = data.load_covidfact().claim.tolist()
    except DataError: claims = None      # refusing is fine too; parsing unverified bytes is not
    assert swapped and claims in (['good'], None), claims


def test_directory_in_place_of_a_data_file_is_a_data_error(mirror):
    mirror.mkdir()
    with pytest.raises(DataError, match='not a regular file') as e: data.load_covidfact()
    assert str(mirror) in str(e.value) and 'directory' in str(e.value)


@pytest.mark.skipif(not hasattr(os, 'mkfifo'), reason='no FIFOs on this platform')
def test_fifo_in_place_of_a_data_file_is_a_data_error_and_never_blocks(mirror):
    os.mkfifo(mirror)
    result = []
    def load():
        try: data.load_covidfact(); result.append('loaded')
        except Exception as e: result.append(e)
    t = threading.Thread(target=load, daemon=True); t.start(); t.join(10)
    if t.is_alive():   # blocked opening the FIFO: release it (a writer end) so the thread can finish
        os.close(os.open(mirror, os.O_WRONLY | os.O_NONBLOCK)); t.join(5)
        pytest.fail(f'loading a FIFO in place of {REL} blocked')
    assert len(result) == 1 and isinstance(result[0], DataError), result
    assert str(mirror) in str(result[0]) and 'FIFO' in str(result[0])
