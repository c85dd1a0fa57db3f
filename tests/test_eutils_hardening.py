"""Hardening of the local E-utilities service and the client (issue 34): half-open connections, bursts of clients,
control characters, punctuation-only terms, and Retry-After values a server may send."""
import email.utils, math, select, socket, threading, time, urllib.error, urllib.parse, urllib.request
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import pytest
import rag_lab.eutils as eutils
from rag_lab.eutils import LocalEutilsServer, LocalPubMed, PubMedClient, PubMedError, QuerySyntaxError, compose_query, normalize_query, parse_query
from rag_lab.text import Corpus, Document


@pytest.fixture(scope='module')
def lp(toy): return LocalPubMed(toy)

@pytest.fixture(scope='module')
def server(lp):
    with LocalEutilsServer(lp) as s: yield s

def _get(base_url: str, utility: str, timeout: float = 10, **params) -> tuple[int, bytes]:
    "(status, body) of one GET, whatever the status."
    url = f'{base_url}/{utility}?{urllib.parse.urlencode(params)}'
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r: return r.status, r.read()
    except urllib.error.HTTPError as e: return e.code, e.read()

ESEARCH_ASTHMA = b'GET /entrez/eutils/esearch.fcgi?db=pubmed&term=asthma%5Bmesh%5D HTTP/1.0\r\nHost: x\r\n\r\n'

def _read_all(s: socket.socket) -> bytes:
    chunks = []
    while (b := s.recv(65536)): chunks.append(b)
    return b''.join(chunks)

# ---------------------------------------------------------------- 1. half-open connections neither hold threads nor stay open
def test_half_open_connections_are_bounded_and_timed_out_while_a_normal_client_is_answered(lp):
    with LocalEutilsServer(lp, workers=4, timeout=3.0) as srv:   # all 300 are still half-open when the client asks
        port = srv.httpd.server_address[1]
        base = threading.active_count()
        held = []
        for i in range(300):   # half of them silent, half stopping inside the headers
            s = socket.create_connection(('127.0.0.1', port), timeout=5)
            if i % 2: s.sendall(b'GET /entrez/eutils/esearch.fcgi?term=asthma HTTP/1.0\r\nHost: x\r\n')
            held.append(s)
        t0 = time.monotonic()
        r = PubMedClient(srv.base_url, requests_per_second=200, retries=0, timeout=5).esearch('asthma[mesh]')
        assert r.count == 2 and time.monotonic() - t0 < 2, time.monotonic() - t0
        extra = threading.active_count() - base
        assert extra <= 4, f"{extra} threads for 300 half-open connections and one request"
        # each half-open connection is answered 408 and closed once its time is up
        for s in held: s.settimeout(10)
        answers = [_read_all(s) for s in held]
        for s in held: s.close()
        assert all(a.startswith(b'HTTP/1.0 408') for a in answers), {a[:40] for a in answers}
        assert ET.fromstring(answers[0].split(b'\r\n\r\n', 1)[1]).findtext('ERROR').startswith('request not complete within 3 s')
        # and the service goes on
        assert PubMedClient(srv.base_url, requests_per_second=200, retries=0).esearch('asthma[mesh]').count == 2

def test_a_dripping_client_is_cut_at_the_total_deadline_not_per_read(lp):
    with LocalEutilsServer(lp, workers=2, timeout=1.0) as srv:
        s = socket.create_connection(('127.0.0.1', srv.httpd.server_address[1]), timeout=10)
        t0, got = time.monotonic(), b''
        for ch in ESEARCH_ASTHMA[:-4]:   # one byte every 0.1 s: each read is quick, the request never ends in time
            s.sendall(bytes([ch]))
            if select.select([s], [], [], 0.1)[0] or time.monotonic() - t0 > 4: break   # the service answered
        got = _read_all(s); s.close()
        assert time.monotonic() - t0 < 4 and got.startswith(b'HTTP/1.0 408'), (time.monotonic() - t0, got[:60])

def test_a_post_whose_body_never_comes_does_not_hold_a_handler(lp):
    with LocalEutilsServer(lp, workers=1, timeout=3.0) as srv:
        s = socket.create_connection(('127.0.0.1', srv.httpd.server_address[1]), timeout=10)
        s.sendall(b'POST /entrez/eutils/esearch.fcgi HTTP/1.0\r\nContent-Length: 100\r\n\r\ndb=pubmed')
        t0 = time.monotonic()   # the only handler is free: a normal request is answered at once
        assert PubMedClient(srv.base_url, requests_per_second=200, retries=0, timeout=5).esearch('asthma[mesh]').count == 2
        assert time.monotonic() - t0 < 2.5   # well before the stalled POST's 3 s are up
        assert _read_all(s).startswith(b'HTTP/1.0 408'); s.close()

# ---------------------------------------------------------------- 2. a burst of 200 clients: all answered
def _somaxconn() -> int:
    try: return int(open('/proc/sys/net/core/somaxconn').read())
    except (OSError, ValueError): return 4096

def test_200_clients_connect_before_the_service_accepts_and_all_are_answered(lp):
    n = min(200, _somaxconn())   # the kernel caps the listen backlog at net.core.somaxconn
    srv = LocalEutilsServer(lp)  # listening, not yet accepting: every connection waits in the backlog
    try:
        port = srv.httpd.server_address[1]
        def connect(_):
            try: return socket.create_connection(('127.0.0.1', port), timeout=2)
            except OSError: return None
        with ThreadPoolExecutor(50) as ex: socks = list(ex.map(connect, range(n)))
        refused = sum(s is None for s in socks)
        assert refused == 0, f"{refused} of {n} connections not taken by the listen backlog"
        for s in socks: s.sendall(ESEARCH_ASTHMA); s.settimeout(10)
        srv.start()
        answers = [_read_all(s) for s in socks]
        for s in socks: s.close()
        assert all(a.startswith(b'HTTP/1.0 200') and b'<Count>2</Count>' in a for a in answers)
    finally: srv.stop()

def test_200_concurrent_clients_all_get_answers(lp):
    with LocalEutilsServer(lp) as srv:
        go = threading.Barrier(200)
        def ask(_):
            go.wait()
            try: return _get(srv.base_url, 'esearch.fcgi', timeout=8, term='asthma[mesh]')
            except OSError as e: return None, repr(e)
        t0 = time.monotonic()
        with ThreadPoolExecutor(200) as ex: got = list(ex.map(ask, range(200)))
        failed = [g for g in got if g[0] != 200]
        assert not failed, f"{len(failed)} of 200 failed, e.g. {failed[0]}"
        assert all(b'<Count>2</Count>' in body for _, body in got)
        assert time.monotonic() - t0 < 20

# ---------------------------------------------------------------- 3. control characters: never invalid XML
@pytest.mark.parametrize('code', range(0x20))
def test_a_control_character_never_yields_invalid_xml(server, code):
    ch = chr(code)
    for term in (f'asthma{ch}copd', f'"bronchial{ch}asthma"[tiab]', f'frob{ch}nication[mesh] OR asthma[mesh]',
                 f'asthma[me{ch}sh]', ch, f'asthma AND 2000:20{ch}10[pdat]'):
        status, body = _get(server.base_url, 'esearch.fcgi', term=term)
        root = ET.fromstring(body)                           # whatever the status, the body is XML
        assert status in (200, 400), (term, status)
        if status == 400: assert root.findtext('ERROR'), (term, body)
        if ch not in '\t\n\r' and term != ch:             # other controls are refused, naming the character
            assert status == 400 and f'U+{code:04X}' in root.findtext('ERROR'), (term, body)

def test_control_characters_are_refused_with_their_position_and_repaired_by_the_normaliser():
    with pytest.raises(QuerySyntaxError, match=r'control character U\+0001 at position 6'): parse_query('asthma\x01copd')
    for ok in ('asthma\tcopd', 'asthma\ncopd', 'asthma\r\ncopd'): parse_query(ok)    # tabs and line breaks are whitespace
    assert normalize_query('asthma\x01copd[mesh]') == normalize_query('asthma copd[mesh]')
    assert compose_query([['bronchial\x07asthma']]) == compose_query([['bronchial asthma']])

def test_efetch_of_a_record_holding_a_control_character_is_xml():
    c = Corpus([Document('7', 'Title\x0b with a vertical tab', 'Form\x0cfeed and \x00 NUL.', metadata=dict(year=2001, mesh=[]))], name='ctl')
    with LocalEutilsServer(LocalPubMed(c)) as srv:
        arts = PubMedClient(srv.base_url, requests_per_second=200).efetch(['7'])
    assert [a.pmid for a in arts] == ['7'] and arts[0].title == 'Title\ufffd with a vertical tab'

# ---------------------------------------------------------------- 4. a term with no searchable word matches nothing
@pytest.mark.parametrize('term', ['!!!', '---', '*', '.', '"!!!"', '!!![tiab]', '?[tw]'])
def test_a_punctuation_only_term_matches_nothing_and_is_reported(lp, term):
    r = lp.search(term)
    assert (r['count'], r['not_found']) == (0, [term.split('[')[0].strip('"')])
    assert lp.search(f'asthma[mesh] AND {term}')['count'] == 0
    assert lp.search(f'asthma[mesh] OR {term}')['count'] == 2

def test_punctuation_only_terms_through_the_service(server):
    c = PubMedClient(server.base_url, requests_per_second=200)
    for term in ('!!!', '---'):
        r = c.esearch(term)
        assert (r.count, r.ids, r.not_found) == (0, [], [term])

# ---------------------------------------------------------------- 5. Retry-After: capped, HTTP-dates read, nonsense ignored
class _Scripted(BaseHTTPRequestHandler):
    "Answers from a script: (status, headers, body) in order, then an esearch answer with one hit."
    script: list = []
    def log_message(self, *a): pass
    def do_GET(self):
        status, headers, body = self.script.pop(0) if self.script else (200, {}, b'<eSearchResult><Count>1</Count><IdList><Id>7</Id></IdList></eSearchResult>')
        self.send_response(status)
        for k, v in headers.items(): self.send_header(k, v)
        self.end_headers(); self.wfile.write(body)

@pytest.fixture
def scripted(monkeypatch):
    "(handler class, base url, recorded sleeps): time.sleep records instead of sleeping."
    httpd = ThreadingHTTPServer(('127.0.0.1', 0), _Scripted)
    t = threading.Thread(target=httpd.serve_forever, daemon=True); t.start()
    sleeps: list[float] = []
    monkeypatch.setattr(eutils.time, 'sleep', sleeps.append)
    yield _Scripted, f'http://127.0.0.1:{httpd.server_address[1]}', sleeps
    httpd.shutdown(); httpd.server_close()

def test_a_huge_retry_after_fails_at_once_naming_the_server_and_the_header(scripted):
    h, url, sleeps = scripted
    h.script = [(429, {'Retry-After': '100000'}, b'')]
    with pytest.raises(PubMedError, match=rf'esearch.fcgi at {url} answered HTTP 429 with Retry-After: 100000 .*at most 60 s'):
        PubMedClient(url, requests_per_second=200, retries=3, backoff=0.01).esearch('asthma[mesh]')
    assert not sleeps or max(sleeps) < 1, sleeps
    h.script = [(503, {'Retry-After': '1' * 400}, b'')]       # a number too large for a float: the same refusal
    with pytest.raises(PubMedError, match='at most 60 s'):
        PubMedClient(url, requests_per_second=200, retries=3, backoff=0.01).esearch('asthma[mesh]')

def test_retry_after_within_the_cap_is_honoured(scripted):
    h, url, sleeps = scripted
    h.script = [(503, {'Retry-After': '42'}, b'')]
    assert PubMedClient(url, requests_per_second=200, retries=2, backoff=0.01).esearch('asthma[mesh]').ids == ['7']
    assert 42 in sleeps and max(sleeps) == 42
    c = PubMedClient(url, requests_per_second=200, retries=2, backoff=0.01, max_retry_after=600)
    h.script = [(503, {'Retry-After': '500'}, b'')]; sleeps.clear()
    assert c.esearch('asthma[mesh]').ids == ['7'] and max(sleeps) == 500

def test_an_http_date_retry_after_is_read(scripted):
    h, url, sleeps = scripted
    h.script = [(503, {'Retry-After': email.utils.formatdate(time.time() + 30, usegmt=True)}, b'')]
    assert PubMedClient(url, requests_per_second=200, retries=2, backoff=0.01).esearch('asthma[mesh]').ids == ['7']
    assert 25 <= max(sleeps) <= 31, sleeps
    h.script = [(503, {'Retry-After': email.utils.formatdate(time.time() - 3600, usegmt=True)}, b'')]; sleeps.clear()
    assert PubMedClient(url, requests_per_second=200, retries=2, backoff=0.01).esearch('asthma[mesh]').ids == ['7']
    assert max(sleeps) < 1, sleeps                              # a date in the past: the client's own backoff
    h.script = [(503, {'Retry-After': email.utils.formatdate(time.time() + 86400, usegmt=True)}, b'')]
    with pytest.raises(PubMedError, match='Retry-After: .*GMT .*at most 60 s'):
        PubMedClient(url, requests_per_second=200, retries=2, backoff=0.01).esearch('asthma[mesh]')

@pytest.mark.parametrize('value', ['nan', 'inf', '-inf', '-5', '1e400', 'soon', '', '  ', 'Wed, 99 Foo 2015 07:28:00 GMT',
                                   'Wed, 21 Oct 99999 07:28:00 GMT', '0x10'])
def test_an_unreadable_retry_after_falls_back_to_the_clients_backoff(scripted, value):
    h, url, sleeps = scripted
    h.script = [(503, {'Retry-After': value}, b'')]
    assert PubMedClient(url, requests_per_second=200, retries=2, backoff=0.01).esearch('asthma[mesh]').ids == ['7']
    assert sleeps and all(math.isfinite(s) and 0 <= s < 1 for s in sleeps), sleeps

def test_an_unreadable_retry_after_is_named_when_the_client_gives_up(scripted):
    h, url, sleeps = scripted
    h.script = [(503, {'Retry-After': 'soon'}, b'')] * 3
    with pytest.raises(PubMedError, match=r"failed after 3 attempts; last error: HTTP 503 \(Retry-After 'soon' unreadable"):
        PubMedClient(url, requests_per_second=200, retries=2, backoff=0.01).esearch('asthma[mesh]')

def test_max_retry_after_is_checked():
    for bad in (-1, float('nan'), 'x'):
        with pytest.raises((ValueError, TypeError), match='max_retry_after must be'): PubMedClient('http://127.0.0.1:9', max_retry_after=bad)

def test_service_limits_are_checked(lp):
    for kw, msg in ((dict(workers=0), 'workers must be an integer >= 1'), (dict(workers=2.5), 'workers must be'),
                    (dict(timeout=0), 'timeout must be a number of seconds > 0'), (dict(timeout=float('inf')), 'timeout must be'),
                    (dict(timeout='10'), 'timeout must be')):
        with pytest.raises(ValueError, match=msg): LocalEutilsServer(lp, **kw)
