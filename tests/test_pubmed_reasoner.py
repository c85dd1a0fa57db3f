"""PubMed client <-> local E-utilities service, query syntax and normalisation, and the agent's guards."""
import json, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import pytest
from hypothesis import given, settings, strategies as st
import re
from rag_lab.eutils import FIELD_TAGS, LocalEutilsServer, LocalPubMed, PubMedClient, PubMedError, PubMedQueryError, QuerySyntaxError, UnsupportedFieldError, normalize_query, parse_query, render_query, scope_query, mesh_terms
from rag_lab.papers.pubmed_reasoner import AgentConfig, Question, ScriptedLLM, audit_citations, pubmed_reasoner
from rag_lab.text import Corpus, Document

@pytest.fixture(scope='module')
def toy():
    return Corpus([
        Document('101', 'Leukotrienes in asthma', 'Montelukast blocks leukotriene receptors in bronchial asthma.',
                 metadata=dict(year=2005, mesh=['Asthma', 'Leukotrienes'])),
        Document('102', 'Childhood asthma trial', 'Inhaled steroids for asthma in children & adolescents <12y.',
                 metadata=dict(year=2012, mesh=['Asthma', 'Child'])),
        Document('103', 'Screening', 'CT screening for small cell lung carcinoma.',
                 metadata=dict(year=None, mesh=['Small Cell Lung Carcinoma']))], name='toy')

@pytest.fixture(scope='module')
def server(toy):
    with LocalEutilsServer(LocalPubMed(toy)) as s: yield s

@pytest.fixture
def client(server):
    return PubMedClient(server.base_url, requests_per_second=200)

def test_round_trip(client, toy):
    r, arts = client.search_and_fetch('asthma[mesh] AND 2000:2020[pdat]', retmax=5)
    assert r.count == 2 and set(r.ids) == {'101', '102'}
    assert [a.pmid for a in arts] == r.ids                         # efetch keeps the esearch order
    a = {x.pmid: x for x in arts}['102']
    assert (a.title, a.abstract, a.mesh, a.year) == (toy['102'].title, toy['102'].text, ['Asthma', 'Child'], 2012)
    assert client.counts == {'esearch': 1, 'efetch': 1}

def test_retmax_retstart_and_sort(client):
    assert client.esearch('asthma[mesh]', retmax=1).ids == client.esearch('asthma[mesh]').ids[:1]
    assert client.esearch('asthma[mesh]', retmax=1, retstart=1).ids == client.esearch('asthma[mesh]').ids[1:2]
    assert client.esearch('asthma[mesh]', sort='pub_date').ids == ['102', '101']

def test_empty_result_set(client):
    r = client.esearch('asthma[mesh] AND 1950:1960[pdat]')
    assert (r.count, r.ids) == (0, [])
    assert client.efetch(r.ids) == [] and client.efetch(['999999']) == []

def test_unknown_mesh_is_reported_not_silent(client):
    r = client.esearch('frobnicosis[mesh] OR asthma[mesh]')
    assert r.count == 2 and r.not_found == ['frobnicosis']

@pytest.mark.parametrize('query,why', [
    ('(asthma[mesh] AND child[mesh]', "'(' at position 0 is never closed"),
    ('asthma[mesh]) OR child[mesh]', "')' at position 12 has no matching '('"),
    ('asthma[foo]', 'unknown field tag [foo]'),
    ('asthma[mesh] AND x[bogus field]', 'unknown field tag [bogus field]'),
    ('asthma[mesh] AND', 'no right-hand term'),
    ('2020:2010[pdat]', 'runs backwards'),
    ('"asthma', 'unterminated quoted phrase')])
def test_malformed_queries_clear_errors_both_sides(server, query, why):
    with pytest.raises(QuerySyntaxError, match=None) as e:        # the client refuses before sending
        PubMedClient(server.base_url, requests_per_second=200).esearch(query)
    assert why in str(e.value)
    before = server.requests
    with pytest.raises(PubMedQueryError) as e:                      # the service answers with the same clear error
        PubMedClient(server.base_url, requests_per_second=200, validate=False).esearch(query)
    assert why in str(e.value) and server.requests == before + 1

@pytest.mark.parametrize('query', ['asthma[majr]', 'smith j[au]', 'review[pt]', 'english[la]', 'x[tw]', 'x[ab]', 'x[ti]', 'therapy[sh]',
                                   'asthma[MeSH Major Topic]', 'x[Text Word]', 'x[Publication Type]', '2020[dp]', '"a b"[tiab:~3]',
                                   'x[ta]', 'x[ad]', 'x[ot]', 'x[nm]', 'x[sb]', '2019/01/01:2020[edat]', 'x[1au]', 'x[lastau]'])
def test_real_ncbi_field_tags_parse(query):
    parse_query(query)                                             # the client would send it (validate=True)

def test_local_service_honours_what_it_can(client):
    assert client.esearch('asthma[majr]').ids == client.esearch('asthma[mesh]').ids        # no major flags: [majr] = [mesh]
    assert client.esearch('asthma[majr] AND leukotrienes[MeSH Terms]').ids == ['101']
    assert client.esearch('steroids[ab]').ids == ['102'] and client.esearch('steroids[ti]').ids == []
    assert client.esearch('child[tw]').ids == ['102']                                      # a MeSH heading is a text word
    assert client.esearch('asthma[mh] AND 2010:2015[dp]').ids == ['102']
    assert client.esearch('"bronchial asthma"[Title/Abstract]').ids == ['101']

@pytest.mark.parametrize('query,tag', [('smith j[au]', 'au'), ('asthma[mesh] AND review[pt]', 'pt'), ('english[la]', 'la'),
                                       ('"lung carcinoma"[tiab:~2]', 'tiab:~2'), ('2019:2020[edat]', 'edat')])
def test_local_service_refuses_the_rest_clearly(server, client, query, tag):
    with pytest.raises(UnsupportedFieldError, match=re.escape(f'field [{tag}]')):
        LocalPubMed(server.pubmed.corpus).search(query)
    with pytest.raises(PubMedQueryError, match=re.escape(f'field [{tag}]') + '.*not supported by the local service'):
        client.esearch(query)

def test_field_tags_are_case_and_space_insensitive():
    assert parse_query('x[MeSH  Terms]') == parse_query('x[mh]') == parse_query('x[MESH]')
    assert len(set(FIELD_TAGS.values())) > 40                      # the whole PubMed tag list, not a subset

def test_service_refuses_other_databases(server):
    c = PubMedClient(server.base_url, requests_per_second=200)
    with pytest.raises(PubMedQueryError, match='only db=pubmed'):
        c._request('esearch.fcgi', {'db': 'pmc', 'term': 'x'})

class _Scripted(BaseHTTPRequestHandler):
    "Answers from a script: a list of (status, headers, body) consumed in order."
    script: list = []
    hits = 0
    def log_message(self, *a): pass
    def do_GET(self):
        type(self).hits += 1
        status, headers, body = self.script.pop(0) if self.script else (200, {}, b'<eSearchResult><Count>0</Count><IdList/></eSearchResult>')
        self.send_response(status)
        for k, v in headers.items(): self.send_header(k, v)
        self.end_headers(); self.wfile.write(body)
    do_POST = do_GET

@pytest.fixture
def scripted():
    httpd = ThreadingHTTPServer(('127.0.0.1', 0), _Scripted)
    t = threading.Thread(target=httpd.serve_forever, daemon=True); t.start()
    _Scripted.hits = 0
    yield _Scripted, f'http://127.0.0.1:{httpd.server_address[1]}'
    httpd.shutdown(); httpd.server_close()

def test_retries_transient_failures(scripted):
    h, url = scripted
    ok = b'<eSearchResult><Count>1</Count><IdList><Id>7</Id></IdList></eSearchResult>'
    h.script = [(503, {}, b'busy'), (429, {'Retry-After': '0'}, b''), (200, {}, ok)]
    r = PubMedClient(url, requests_per_second=200, retries=3, backoff=0.01).esearch('asthma[mesh]')
    assert r.ids == ['7'] and h.hits == 3

def test_gives_up_with_a_clear_error(scripted):
    h, url = scripted
    h.script = [(500, {}, b'')] * 5
    with pytest.raises(PubMedError, match='failed after 3 attempts; last error: HTTP 500'):
        PubMedClient(url, requests_per_second=200, retries=2, backoff=0.01).esearch('asthma[mesh]')

def test_no_retry_on_client_errors(scripted):
    h, url = scripted
    h.script = [(404, {}, b'not here')]
    with pytest.raises(PubMedError, match='HTTP 404'):
        PubMedClient(url, requests_per_second=200, retries=3, backoff=0.01).esearch('asthma[mesh]')
    assert h.hits == 1

def test_efetch_parses_inline_markup_and_reorders(scripted):
    h, url = scripted
    xml = b"""<PubmedArticleSet>
<PubmedArticle><MedlineCitation><PMID Version="1">2</PMID><Article><Journal><JournalIssue><PubDate><MedlineDate>1998 Jan-Feb</MedlineDate></PubDate></JournalIssue></Journal>
<ArticleTitle>Role of <i>IL-6</i> in sepsis</ArticleTitle><Abstract><AbstractText Label="BACKGROUND">Levels of <i>IL-6</i> rise.</AbstractText><AbstractText Label="RESULTS">They fall.</AbstractText></Abstract></Article>
<MeshHeadingList><MeshHeading><DescriptorName UI="D015850">Interleukin-6</DescriptorName></MeshHeading></MeshHeadingList></MedlineCitation></PubmedArticle>
<PubmedArticle><MedlineCitation><PMID Version="1">1</PMID><Article><ArticleTitle>Other</ArticleTitle></Article></MedlineCitation></PubmedArticle>
</PubmedArticleSet>"""
    h.script = [(200, {}, xml)]
    arts = PubMedClient(url, requests_per_second=200).efetch(['1', '2', '3'])
    assert [a.pmid for a in arts] == ['1', '2']
    assert arts[1].title == 'Role of IL-6 in sepsis' and arts[1].abstract == 'Levels of IL-6 rise. They fall.'
    assert (arts[1].mesh, arts[1].year, arts[0].abstract, arts[0].year) == (['Interleukin-6'], 1998, '', None)

def test_not_xml_is_an_error(scripted):
    h, url = scripted
    h.script = [(200, {}, b'<html>oops')]
    with pytest.raises(PubMedError, match='not XML'):
        PubMedClient(url, requests_per_second=200).esearch('asthma[mesh]')

def test_rate_limit_three_per_second(server):
    c = PubMedClient(server.base_url, api_key='')  # no key: 3/s
    t0 = time.perf_counter()
    for _ in range(4): c.esearch('asthma[mesh]')
    assert time.perf_counter() - t0 >= 0.99

def test_api_key_from_env(monkeypatch):
    monkeypatch.setenv('NCBI_API_KEY', 'k123')
    c = PubMedClient()
    assert c.api_key == 'k123' and c.limiter.gap == pytest.approx(0.1) and c.base_url.startswith('https://eutils.ncbi.nlm.nih.gov')

def test_scope_excludes_source_and_limits_dates(client):
    q = scope_query('asthma[mesh]', max_year=2010, exclude_pmids=['101'])
    assert client.esearch(q).ids == []
    assert client.esearch(scope_query('asthma[mesh]', max_year=2020, exclude_pmids=['101'])).ids == ['102']

def test_mesh_explosion_and_noexp(client):
    assert client.esearch('lung neoplasms[mesh]').ids == ['103']
    assert client.esearch('lung neoplasms[mesh:noexp]').ids == []

_ATOMS = st.sampled_from(['asthma', 'cancer[mesh]', '"lung neoplasms"[mh]', 'child[tiab]', 'AND', 'OR', 'NOT', '(', ')',
                          '2000:2010[pdat]', 'x[foo]', '"', '[', ']', 'leukotrienes[MeSH Terms]', '()'])

@settings(max_examples=150, deadline=None)
@given(st.lists(_ATOMS, max_size=12))
def test_normalize_is_valid_and_idempotent(atoms):
    raw = ' '.join(atoms)
    try: q = normalize_query(raw)
    except QuerySyntaxError as e:
        assert 'nothing searchable' in str(e) or 'date' in str(e)
        return
    assert render_query(parse_query(q)) == q
    assert normalize_query(q) == q
    assert all(t in ('Neoplasms', 'Lung Neoplasms', 'Leukotrienes') for t in mesh_terms(q))

def _judged(p):
    "The terms a critique prompt asks about."
    return re.search(r'Judge each query term: (.*?)\. coverage:', p)[1].split(', ')

def _agent_script(state, cite='[PMID: 101]'):
    """Critic judging the query's real terms, whose covered share grows each round (0, 1/2, 1) and which always calls
    some term redundant, so only the budget stops it; refinements are always new."""
    def reply(p):
        if 'List up to 8 MeSH' in p: return json.dumps({'candidates': [{'term': 'Asthma', 'rationale': 'r'}]})
        if 'Judge each query term' in p:
            state['round'] += 1
            k = state['round']
            return json.dumps({'terms': [{'term': t, 'coverage': 'Yes' if i < k - 1 else 'No', 'alignment': 'Yes',
                                          'redundant': 'Yes', 'rationale': 'r'} for i, t in enumerate(_judged(p))]})
        if 'Revise the MeSH terms' in p:
            state['refine'] += 1
            # an OR-group with Asthma: every refinement is new and still has hits (a zero-hit query is never 'covered')
            return json.dumps({'concepts': [['Asthma', ['Leukotrienes', 'Child', 'Adolescent', 'Steroids'][state['refine'] % 4]]]})
        if 'Select the candidates' in p: return json.dumps({'concepts': [['Asthma']]})
        if 'plausibly relevant' in p: return json.dumps({'keep': ['101', '102']})
        if 'copy or paraphrase' in p: return json.dumps({'items': [{'pmid': '101', 'evidence': 'e', 'aligned': 'Yes'}]})
        if 'cover the main aspects' in p: return json.dumps({'sufficient': 'No', 'rationale': 'r'})
        if 'Summarise, article by article' in p: return json.dumps({'summary': 's [PMID: 101]'})
        return json.dumps({'answer': 'yes', 'rationale': f'yes, leukotrienes matter in asthma {cite}'})
    return reply

QUESTION = Question('q', 'Do leukotrienes matter in asthma?', {k: k for k in ('yes', 'no', 'maybe')}, 'yes', 'Answer.', max_year=2020)

@pytest.mark.parametrize('budget', [1, 2, 3])
def test_critic_loop_hits_its_budget(client, budget):
    state = dict(round=0, refine=0)
    r = pubmed_reasoner(ScriptedLLM(_agent_script(state)), client, QUESTION, AgentConfig(critic_iters=budget))
    assert r.stop_reason == 'budget'
    assert r.calls.made['critique'] == budget and r.calls.made.get('refine', 0) == budget - 1
    assert len(r.queries) == budget and len(set(r.queries)) == budget
    assert r.searches == budget + 1                                # one per critic round + the final retrieval
    assert [t['covered_aligned'] for t in r.trace if 'round' in t] == [0, 0.5, 1.0][:budget]
    assert r.final_query == r.queries[-1]                          # every round improved: the last query is q*

def _critic(verdicts):
    """Agent script with a two-term first query (Asthma AND Leukotrienes), a new refinement (Asthma OR Child), and a
    critic answering `verdicts(round, terms)` -> [(term, coverage, alignment)]."""
    state = dict(round=0)
    def reply(p):
        if 'Judge each query term' in p:
            state['round'] += 1
            return json.dumps({'terms': [{'term': t, 'coverage': c, 'alignment': a, 'redundant': 'No', 'rationale': 'r'}
                                         for t, c, a in verdicts(state['round'], _judged(p))]})
        if 'Select the candidates' in p: return json.dumps({'concepts': [['Asthma'], ['Leukotrienes']]})
        if 'Revise the MeSH terms' in p: return json.dumps({'concepts': [['Asthma', 'Child']]})
        return _agent_script(dict(round=0, refine=0))(p)
    return reply

FIRST, REFINED = '"Asthma"[mesh] AND "Leukotrienes"[mesh]', '"Asthma"[mesh] OR "Child"[mesh]'

def test_regression_keeps_the_best_query(client):
    # round 1: one of two terms covered and aligned (1/2); round 2: none (0) -> stop, and q* is round 1's query
    crit = lambda k, terms: [(t, 'Yes', 'Yes' if k == 1 and i == 0 else 'No') for i, t in enumerate(terms)]
    r = pubmed_reasoner(ScriptedLLM(_critic(crit)), client, QUESTION, AgentConfig(critic_iters=3))
    assert r.stop_reason == 'no gain in coverage/alignment'
    assert [t['covered_aligned'] for t in r.trace if 'round' in t] == [0.5, 0.0]
    assert r.queries == [FIRST, REFINED, FIRST] and r.final_query == FIRST   # re-issued for Stage 2
    assert r.searches == 3 and [t['retrieved'] for t in r.trace if t.get('stage') == 2] == [1]   # Stage 2 read q*'s one record

def test_critique_omitting_terms_does_not_end_the_search(client):
    # the critic answers only for the first query term, all Yes: the omitted term counts as No, so the search goes on
    r = pubmed_reasoner(ScriptedLLM(_critic(lambda k, terms: [(terms[0], 'Yes', 'Yes')])), client, QUESTION, AgentConfig(critic_iters=3))
    first = [t for t in r.trace if 'round' in t][0]
    assert (first['covered_aligned'], first['unjudged']) == (0.5, 1)
    assert r.stop_reason != 'all signals positive' and r.calls.made['refine'] == 1

def test_audit_without_citations_is_not_grounded():
    a = audit_citations('Yes, definitely.', ['1'], ['1'])
    assert (a['cited'], a['grounded'], a['flags']) == ([], False, [])
    assert (a['statements'], a['statements_cited'], a['statement_coverage']) == (1, 0, 0.0)

def test_statement_citation_coverage():
    a = audit_citations('A holds [PMID: 1]. B holds too. [PMID: 1, 2] C is invented [PMID: 7]. D has none.', ['1', '2'], ['1'])
    assert (a['statements'], a['statements_cited'], a['statement_coverage']) == (4, 2, 0.5)
    assert a['never_retrieved'] == ['7'] and a['grounded']


# ---------------------------------------------------------------- hostile input: bounded, answered, never a dropped connection
import socket, urllib.request

def _raw_post(server, body: bytes) -> tuple[int, bytes]:
    req = urllib.request.Request(f'{server.base_url}/esearch.fcgi', data=body, method='POST')
    try:
        with urllib.request.urlopen(req, timeout=10) as r: return r.status, r.read()
    except urllib.error.HTTPError as e: return e.code, e.read()

@pytest.mark.parametrize('query,why', [
    ('(' * 600 + 'asthma' + ')' * 600, 'nested 600 deep'),
    (' OR '.join(f't{i}' for i in range(300)), 'query of 300 terms'),
    ('asthma ' * 1000, 'characters; at most'),
])
def test_oversized_queries_get_a_400_with_a_message_and_the_service_goes_on(server, client, query, why):
    from urllib.parse import urlencode
    status, body = _raw_post(server, urlencode(dict(db='pubmed', term=query)).encode())
    assert status == 400 and why in body.decode(), body[:300]
    with pytest.raises(QuerySyntaxError, match=why.split()[0]): normalize_query(query)   # the normaliser's own error only
    assert client.esearch('asthma[mesh]').count == 2            # still serving

def test_invalid_utf8_body_gets_a_400(server, client):
    status, body = _raw_post(server, b'db=pubmed&term=asthma\xff\xfe')
    assert status == 400 and b'unreadable request' in body
    assert client.esearch('asthma[mesh]').count == 2

def _slow_server(behaviour):
    "A one-shot TCP server on localhost: `behaviour(conn)` answers the first connection."
    srv = socket.socket(); srv.bind(('127.0.0.1', 0)); srv.listen(4)
    def serve():
        while True:
            try: conn, _ = srv.accept()
            except OSError: return
            threading.Thread(target=behaviour, args=(conn,), daemon=True).start()
    threading.Thread(target=serve, daemon=True).start()
    return srv, f'http://127.0.0.1:{srv.getsockname()[1]}'

def _drip(conn):
    try:
        conn.recv(65536)
        conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Type: text/xml\r\nContent-Length: 100000\r\n\r\n')
        for _ in range(600): conn.sendall(b'<'); time.sleep(0.2)   # one byte every 0.2 s: each read is quick
    except OSError: pass
    finally: conn.close()

def _flood(conn):
    try:
        conn.recv(65536)
        conn.sendall(b'HTTP/1.1 200 OK\r\nContent-Type: text/xml\r\n\r\n')
        for _ in range(100): conn.sendall(b'x' * 65536)
    except OSError: pass
    finally: conn.close()

def test_a_server_that_drips_bytes_hits_the_total_deadline():
    srv, url = _slow_server(_drip)
    try:
        t0 = time.monotonic()
        with pytest.raises(PubMedError, match='within 1 s'):
            PubMedClient(url, requests_per_second=200, retries=1, backoff=0.01, timeout=1).esearch('asthma')
        assert time.monotonic() - t0 < 6
    finally: srv.close()

def test_an_oversized_answer_is_refused():
    srv, url = _slow_server(_flood)
    try:
        with pytest.raises(PubMedError, match='sent more than 100000 bytes'):
            PubMedClient(url, requests_per_second=200, retries=0, max_bytes=100_000).esearch('asthma')
    finally: srv.close()
