"""PubMed client <-> local E-utilities service, query syntax and normalisation, and the agent's guards."""
import json, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
import pytest
from hypothesis import given, settings, strategies as st
import re
from rag_lab.eutils import FIELD_TAGS, LocalEutilsServer, LocalPubMed, PubMedClient, PubMedError, PubMedQueryError, QuerySyntaxError, UnsupportedFieldError, normalize_query, parse_query, render_query, scope_query, mesh_terms
from dataclasses import replace
import numpy as np
from rag_lab.papers.pubmed_reasoner import (AgentConfig, Question, ScriptedLLM, audit_citations, closed_book, gold_rank, justification, article_sentences,
                                            no_reflection, plain_rag, pubmed_reasoner, question_query, ratio_ci, read_final_answer,
                                            CONTENT_FREE, content_free_question)
from rag_lab.text import tokenize
from rag_lab.text import Corpus, Document


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
    return re.search(r'in this order: (.*?)\.\n', p)[1].split(' | ')

def _lists(triples):
    "A critique reply's three positional Yes/No lists from (coverage, alignment, redundant) per term."
    return {k: [t[i] for t in triples] for i, k in enumerate(('coverage', 'alignment', 'redundant'))}

PQ = {'A': 'yes', 'B': 'no', 'C': 'maybe'}

def _agent_script(state, cite='[PMID: 101]'):
    """Critic judging the query's real terms, whose covered share grows each round (0, 1/2, 1) and which always calls
    some term redundant, so only the budget stops it; every revision is new."""
    def reply(p):
        if 'Judge each query term' in p:
            state['round'] += 1
            k = state['round']
            # an OR-group with Asthma: every revision is new and still has hits (a zero-hit query is never 'covered')
            return json.dumps(_lists([('Yes' if i < k - 1 else 'No', 'Yes', 'Yes') for i, t in enumerate(_judged(p))])
                              | {'concepts': [['Asthma', ['Leukotrienes', 'Child', 'Adolescent', 'Steroids'][k % 4]]]})
        if 'Propose MeSH headings' in p: return json.dumps({'concepts': [['Asthma']]})
        if 'plausibly relevant' in p: return json.dumps({'keep': ['101', '102']})
        if 'directly addresses the question' in p: return json.dumps({'items': [{'pmid': '101', 'sentences': [1], 'aligned': 'Yes'}], 'sufficient': 'No'})
        return f'yes, leukotrienes matter in asthma {cite}\nFINAL ANSWER: A'
    return reply

QUESTION = Question('q', 'Do leukotrienes matter in asthma?', dict(PQ), 'A', max_year=2020)
LEAN_CFG = dict(mesh_candidates=False, evidence_summary=False)

@pytest.mark.parametrize('budget', [1, 2, 3])
def test_critic_loop_hits_its_budget(client, budget):
    state = dict(round=0)
    r = pubmed_reasoner(ScriptedLLM(_agent_script(state)), client, QUESTION, AgentConfig(critic_iters=budget, **LEAN_CFG))
    assert r.stop_reason == 'budget'
    assert r.calls.made['critique'] == budget and 'refine' not in r.calls.made   # verdicts and revision in one call
    assert len(r.queries) == budget + 1 and len(set(r.queries)) == budget + 1      # every round adopted a new revision
    assert r.searches == budget + 1                                # one per critic round + the final retrieval
    assert [t['covered_aligned'] for t in r.trace if 'round' in t] == [0, 0.5, 1.0][:budget]
    assert r.final_query == r.queries[-1]                          # at the budget the last revision is q* (official code)

def _critic(verdicts):
    """Agent script with a two-term first query (Asthma AND Leukotrienes), a new revision (Asthma OR Child), and a
    critic answering `verdicts(round, terms)` -> [(coverage, alignment)], one per term it judges, in order."""
    state = dict(round=0)
    def reply(p):
        if 'Judge each query term' in p:
            state['round'] += 1
            return json.dumps(_lists([(c, a, 'No') for c, a in verdicts(state['round'], _judged(p))]) | {'concepts': [['Asthma', 'Child']]})
        if 'Propose MeSH headings' in p: return json.dumps({'concepts': [['Asthma'], ['Leukotrienes']]})
        return _agent_script(dict(round=0))(p)
    return reply

FIRST, REFINED = '"Asthma"[mesh] AND "Leukotrienes"[mesh]', '"Asthma"[mesh] OR "Child"[mesh]'

def test_regression_keeps_the_best_query(client):
    # round 1: one of two terms covered and aligned (1/2); round 2: none (0) -> stop, and q* is round 1's query
    crit = lambda k, terms: [('Yes', 'Yes' if k == 1 and i == 0 else 'No') for i, t in enumerate(terms)]
    r = pubmed_reasoner(ScriptedLLM(_critic(crit)), client, QUESTION, AgentConfig(critic_iters=3, **LEAN_CFG))
    assert r.stop_reason == 'no gain in coverage/alignment'
    assert [t['covered_aligned'] for t in r.trace if 'round' in t] == [0.5, 0.0]
    assert r.queries == [FIRST, REFINED, FIRST] and r.final_query == FIRST   # re-issued for Stage 2
    assert r.searches == 3 and [t['retrieved'] for t in r.trace if t.get('stage') == 2] == [1]   # Stage 2 read q*'s one record

def test_critique_omitting_terms_does_not_end_the_round(client):
    # the critic answers only for the first query term, all Yes: the omitted term counts as No, so round 1 revises
    r = pubmed_reasoner(ScriptedLLM(_critic(lambda k, terms: [('Yes', 'Yes')])), client, QUESTION, AgentConfig(critic_iters=3, **LEAN_CFG))
    first = [t for t in r.trace if 'round' in t][0]
    assert (first['covered_aligned'], first['unjudged']) == (0.5, 1)
    assert r.queries[1] == REFINED                              # round 1 revised the query instead of accepting it

@pytest.mark.parametrize('revision', [[['term', 'synonym']], [['<MeSH heading>'], ['...']], [['Term'], ['synonyms']], []])
def test_a_copied_format_placeholder_never_becomes_the_search(client, revision):
    # the 1.5B often copies the format's placeholders; a revision made only of them is unusable and q* stays the best query
    reply = lambda p: (json.dumps(_lists([('Yes', 'No', 'No'), ('Yes', 'No', 'No')]) | {'concepts': revision}) if 'Judge each query term' in p
                       else _critic(None)(p))
    r = pubmed_reasoner(ScriptedLLM(reply), client, QUESTION, AgentConfig(critic_iters=2, **LEAN_CFG))
    assert r.stop_reason == 'refinement unusable' and r.final_query == FIRST
    assert not any(re.search(r'"(term|synonym)s?"|<', q, re.I) for q in r.queries)

def test_unreadable_critique_keeps_q0(client):
    junk = lambda p: 'not json' if 'Judge each query term' in p else _critic(None)(p)
    r = pubmed_reasoner(ScriptedLLM(junk), client, QUESTION, AgentConfig(critic_iters=3, **LEAN_CFG))
    assert (r.stop_reason, r.final_query, r.calls.unparseable) == ('critique unparseable', FIRST, {'critique': 1})

def test_reading_stops_at_the_first_sufficient_batch(client):
    # four records kept, batches of one: the second reading says "sufficient" -> two reading calls, not four
    state = dict(reads=0)
    def reply(p):
        if 'directly addresses the question' in p:
            state['reads'] += 1
            pmid = re.search(r'New articles, their sentences numbered:\n\[PMID: (\d+)\]', p)[1]
            return json.dumps({'items': [{'pmid': pmid, 'sentences': [1], 'aligned': 'Yes'}], 'sufficient': 'Yes' if state['reads'] == 2 else 'No'})
        if 'Propose MeSH headings' in p: return json.dumps({'concepts': [['Asthma', 'Small Cell Lung Carcinoma']]})
        if 'plausibly relevant' in p: return json.dumps({'keep': ['101', '102', '103']})
        return _agent_script(dict(round=0))(p)
    q = Question('q', 'Asthma or lung cancer?', dict(PQ), 'A')          # no date limit: all three records
    r = pubmed_reasoner(ScriptedLLM(reply), client, q, AgentConfig(critic_iters=0, batch_size=1, **LEAN_CFG))
    stage2 = [t for t in r.trace if t.get('stage') == 2][0]
    assert (r.calls.made['read'], stage2['read'], stage2['stop'], len(r.evidence)) == (2, 2, 'sufficient', 2)

def test_evidence_from_a_batch_is_kept_only_for_its_own_aligned_articles(client):
    # the reader quotes sentence 1 of the batch's article and names a sentence 40 it does not have: one finding, one bad number
    items = [{'pmid': '101', 'sentences': [1, 40], 'aligned': 'Yes'}]
    reply = lambda p: json.dumps({'items': items, 'sufficient': 'No'}) if 'directly addresses the question' in p else _critic(None)(p)
    r = pubmed_reasoner(ScriptedLLM(reply), client, Question('q', 'Asthma?', dict(PQ), 'A', max_year=2020),
                        AgentConfig(critic_iters=0, **LEAN_CFG))
    first = article_sentences(client.efetch(['101'])[0])[0]
    assert r.evidence == [('101', first)]                                # quoted whole: the article's own first sentence
    assert {k: [t for t in r.trace if t.get('stage') == 2][0][k] for k in ('aligned', 'bad_numbers')} == dict(aligned=1, bad_numbers=1)
    # a PMID outside the batch (or the format's '<pmid>') is outside the reading's schema: unparseable, counted, no evidence
    outside = lambda p: json.dumps({'items': [{'pmid': '<pmid>', 'sentences': [1], 'aligned': 'Yes'}], 'sufficient': 'No'}) if 'directly addresses the question' in p else _critic(None)(p)
    r = pubmed_reasoner(ScriptedLLM(outside), client, Question('q', 'Asthma?', dict(PQ), 'A', max_year=2020), AgentConfig(critic_iters=0, **LEAN_CFG))
    assert r.evidence == [] and r.calls.unparseable.get('read', 0) >= 1

def test_ablations_reuse_the_agents_calls(client):
    # with the cache on, 'no reflection' computes only its own response: its Stage-1 calls are the agent's, replayed
    llm = ScriptedLLM(_agent_script(dict(round=0)))
    llm.cache.mode = 'on'
    cfg = AgentConfig(critic_iters=1, **LEAN_CFG)
    full = pubmed_reasoner(llm, client, QUESTION, cfg)
    n0 = len(llm.ledger.records)
    nr = no_reflection(llm, client, QUESTION, cfg)
    fresh = [r for r in llm.ledger.records[n0:] if r.source == 'computed']
    assert nr.final_query == full.final_query
    assert nr.calls.made['query_plan'] == nr.calls.made['critique'] == 1
    assert [r.kind for r in fresh] == ['choice']               # only its scored answer; Stage 1 came from the cache
    n1 = len(llm.ledger.records)
    nsc = pubmed_reasoner(llm, client, QUESTION, replace(cfg, critic_iters=0), system='no self-critic')
    assert llm.ledger.records[n1].source == 'cache'            # its plan is the agent's plan
    assert nsc.final_query == full.queries[0]

def test_traced_calls_of_an_ablation_include_those_it_shares_with_the_agent(client):
    # the chapter's items list each run's calls (Ledger.trace): a call 'no reflection' takes from the cache is in its list too
    llm = ScriptedLLM(_agent_script(dict(round=0)))
    llm.cache.mode = 'on'
    cfg = AgentConfig(critic_iters=1, **LEAN_CFG)
    with llm.ledger.trace() as full_keys: pubmed_reasoner(llm, client, QUESTION, cfg)
    n0 = len(llm.ledger.records)
    with llm.ledger.trace() as nr_keys: no_reflection(llm, client, QUESTION, cfg)
    made = llm.ledger.records[n0:]
    assert nr_keys == [r.key for r in made] and all(nr_keys)            # every call, in call order, cache hits included
    shared = [r.key for r in made if r.source == 'cache']
    assert shared and set(shared) <= set(full_keys)                     # Stage 1: the agent's calls, listed in both runs
    assert len(full_keys) == n0 and len(set(full_keys) - set(nr_keys)) > 0

def test_scored_answers_exist_when_the_response_is_junk(client):
    junk = ScriptedLLM(lambda p: 'FINAL ANSWER: perhaps' if 'Explain your answer' in p else _critic(None)(p), chooser=lambda prompt, prefix: 'B')
    r = pubmed_reasoner(junk, client, QUESTION, AgentConfig(critic_iters=0, answer_mode='scored', **LEAN_CFG))
    assert (r.answer, r.scored.answer, r.free, r.raw) == ('B', 'B', None, '')   # one protocol: scored right after the prompt
    r = pubmed_reasoner(junk, client, QUESTION, AgentConfig(critic_iters=0, answer_mode='free_text', **LEAN_CFG))
    assert (r.answer, r.scored.answer, r.free.status, r.calls.unparseable.get('answer')) == (None, 'B', 'unparseable', 1)

def test_direct_baselines_write_no_response_unless_free_text(client):
    llm = ScriptedLLM(_agent_script(dict(round=0)))
    for mode in ('scored', 'free_text'):
        cfg = AgentConfig(top_k=2, answer_mode=mode)
        cb, pr = closed_book(llm, QUESTION, cfg), plain_rag(llm, client, QUESTION, cfg)
        assert (cb.raw == '', pr.raw == '') == ((True, True) if mode == 'scored' else (False, False))
        assert cb.answer == pr.answer == 'A' and pr.retrieved == ['101', '102'][:len(pr.retrieved)] and pr.searches == 1

def test_content_free_question_and_plain_rags_empty_search(client):
    cf = content_free_question(PQ)
    assert (cf.text, cf.options, cf.max_year, cf.exclude_pmids) == (CONTENT_FREE, PQ, None, ())
    assert set(content_free_question({'A': 'fever', 'B': 'rash'}, blank_options=True).options.values()) == {CONTENT_FREE}
    # 'N/A' has no content word: plain RAG searches nothing and answers from no evidence, with the closed book's very call
    llm = ScriptedLLM(_agent_script(dict(round=0)), chooser=lambda prompt, prefix: 'B')
    pr, cb = plain_rag(llm, client, cf, AgentConfig(top_k=2)), closed_book(llm, cf, AgentConfig(top_k=2))
    assert (pr.queries, pr.searches, pr.retrieved, pr.evidence, pr.stop_reason) == ([], 0, [], [], 'no content words to search')
    keys = [r.key for r in llm.ledger.records]
    assert len(keys) == 2 and keys[0] == keys[1] and pr.scored.logprobs == cb.scored.logprobs and pr.answer == 'B'
    ok = plain_rag(llm, client, QUESTION, AgentConfig(top_k=2))   # a question with content words still searches
    assert ok.searches == 1 and ok.queries and ok.stop_reason == ''

def test_audit_without_citations_is_not_grounded():
    a = audit_citations('Yes, definitely.', ['1'], ['1'])
    assert (a['cited'], a['grounded'], a['flags'], a['supported']) == ([], False, [], 0)
    assert (a['statements'], a['statements_cited'], a['statement_coverage']) == (1, 0, 0.0)

def test_statement_citation_coverage():
    a = audit_citations('A holds [PMID: 1]. B holds too. [PMID: 1, 2] C is invented [PMID: 7]. D has none.', ['1', '2'], ['1'])
    assert (a['statements'], a['statements_cited'], a['statement_coverage']) == (4, 2, 0.5)
    assert a['never_retrieved'] == ['7'] and a['grounded'] and a['supported'] == 1 and a['outside_evidence'] == ['2']

# ---------------------------------------------------------------- answers: the free-text protocol and the scored prefix
@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_read_final_answer_names_an_option_or_nothing(text):
    p = read_final_answer(text, PQ)
    assert (p.status == 'ok') == (p.answer is not None) and p.answer in (None, 'A', 'B', 'C')
    assert not re.search(r'FINAL\s+ANSWER\s*[:\-]', justification(text), re.I)   # the scored answer never sees an answer line

@pytest.mark.parametrize('text,want', [('ok\nFINAL ANSWER: A', 'A'), ('FINAL ANSWER: A\nFINAL ANSWER: B', 'B'), ('final answer - c', 'C'),
                                       ('FINAL ANSWER: maybe.', 'C'), ('FINAL ANSWER: A. no', None), ('FINAL ANSWER:', None),
                                       ('The answer is B.', 'B'), ('the answer is yes but FINAL ANSWER: D', None), ('', None),
                                       ('**FINAL ANSWER: B**', 'B'), ('<FINAL ANSWER: C>', 'C'), ('x.>\nFINAL ANSWER: <A>', 'A')])
def test_read_final_answer_cases(text, want):
    assert read_final_answer(text, PQ).answer == want

@settings(max_examples=200, deadline=None)
@given(st.text(max_size=200), st.sampled_from(['A', 'B', 'C']))
def test_justification_drops_the_answer_line_and_only_it(body, key):
    assume_clean = not re.search(r'FINAL\s+ANSWER\s*[:\-]', body, re.I)
    text = f'{body}\nFINAL ANSWER: {key}'
    if assume_clean:
        assert justification(text) == body.strip()
        assert read_final_answer(text, PQ).answer == key

# ---------------------------------------------------------------- plain RAG's query, metrics, parameters
@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.characters(codec='utf-8', categories=('L', 'N', 'P', 'S', 'Zs')), max_size=200))
def test_question_query_is_valid_and_made_of_the_questions_words(text):
    try: q = question_query(text)
    except QuerySyntaxError: return
    tree = parse_query(q)
    from rag_lab.eutils import query_terms
    terms = [t.text for t in query_terms(tree)]
    assert terms and len(terms) <= 12 and all(t in tokenize(text) for t in terms)
    assert all(t.field == 'all' for t in query_terms(tree)) and ' AND ' not in q and ' NOT ' not in q

def test_question_query_ranks_the_local_corpus(client):
    r = client.esearch(question_query('Does montelukast block leukotriene receptors in asthma?'))
    assert r.ids[0] == '101' and r.count >= 2                     # ORed words: a ranking, not a filter

@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=40))
def test_ratio_ci_brackets_the_ratio(pairs):
    num, den = [min(a, b) for a, b in pairs], [max(a, b) for a, b in pairs]
    v, lo, hi = ratio_ci(num, den)
    if sum(den) == 0: assert all(np.isnan([v, lo, hi])); return
    assert 0 <= lo <= v + 1e-12 and v <= hi + 1e-12 and hi <= 1
    assert ratio_ci(num[::-1], den[::-1])[0] == pytest.approx(v)    # order of items does not matter

def test_gold_rank_lifts_only_the_exclusion(client):
    q = Question('q', 'Asthma?', dict(PQ), 'A', max_year=2010, exclude_pmids=('101',), source_pmids=('101',))
    assert gold_rank(client, q, '"Asthma"[mesh]', depth=5) == 1
    assert gold_rank(client, Question(**{**q.__dict__, 'max_year': 2000}), '"Asthma"[mesh]', depth=5) is None   # the date limit stays
    assert gold_rank(client, q, None, depth=5) is None

@pytest.mark.parametrize('kw,msg', [(dict(n=150, n_free_text=10, n_secondary=20), 'the judge compares'), (dict(n_free_text=0, n_secondary=1), 'the judge compares'),
                                    (dict(n=-1), 'greater than or equal to 1'), (dict(n_mmlu=-1), 'greater than or equal to 0'),
                                    (dict(answer_mode='both'), 'scored'), (dict(top_k=0), 'greater than or equal to 1'), (dict(passage_chars=50), 'greater than or equal to 100')])
def test_bad_parameters_are_refused_before_work(kw, msg):
    from rag_lab.config import resolve_params
    with pytest.raises(ValueError, match=msg): resolve_params('pubmed_reasoner', 'default', **kw)

def test_profiles_are_valid_and_the_default_meets_the_sample_size_rule():
    from rag_lab.config import resolve_params
    d = resolve_params('pubmed_reasoner', 'default')
    assert d.n >= 150 and d.n_mmlu >= 50 and d.model == 'qwen2.5-coder-1.5b-instruct-q4_k_m' and d.answer_mode == 'scored'
    assert (d.n_free_text == 0 or d.n_free_text >= 50) and (d.n_secondary == 0 or d.n_secondary >= 50)   # secondary cells: none or >= 50
    p = resolve_params('pubmed_reasoner', 'paper')
    assert (p.n, p.max_articles, p.batch_size, p.critic_iters, p.lean) == (None, 20, 5, 3, False)
    with pytest.raises(ValueError, match="backend 'openai' cannot score"):   # refused before any work, not mid-run
        resolve_params('pubmed_reasoner', 'paper', backend='openai', model='gpt-4o')
    s = resolve_params('pubmed_reasoner', 'smoke')
    assert s.n <= 3 and s.n_secondary <= s.n_free_text <= s.n
    probe = resolve_params('pubmed_reasoner', 'default', n=3)          # the probe command of issue 19 is accepted
    assert (probe.subset('n_free_text', 3), probe.subset('n_secondary', 3)) == (3, 0)

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

# ---------------------------------------------------------------- the committed records, read (issue 29)
from conftest import used_records

def _used_records(profile: str) -> list[dict]: return used_records('pubmed_reasoner', profile)

def _user_text(rec: dict) -> str:
    m = rec['request'].get('messages') or rec['request'].get('context') or []
    return m[-1]['content'] if isinstance(m, list) and m else str(m)

@pytest.mark.parametrize('profile', ['smoke', 'default'])
def test_no_recorded_response_begins_with_template_text(profile):
    "Every response the published run uses was written to instructions, not a template: none starts with a placeholder."
    recs = [r for r in _used_records(profile) if 'text' in r['value'] and 'FINAL ANSWER' in _user_text(r) and 'JSON' not in _user_text(r)]
    assert recs, 'no response records to read'
    # the instruction (the prompt's last paragraph) shows no <...> placeholder; the evidence may say "P < .001"
    shown = [_user_text(r).rsplit('\n\n', 1)[-1] for r in recs]
    assert not [t for t in shown if re.search(r'<[A-Za-z][^<>]*>', t)], 'a response prompt still shows a <...> template'
    starts = [r['value']['text'].lstrip()[:40] for r in recs if r['value']['text'].lstrip().startswith(('<', 'two or three sentences'))]
    assert not starts, f'{len(starts)} of {len(recs)} responses begin with template text: {starts[:3]}'
