"""The local biomedical corpus and the MeSH vocabulary / indexer."""
import pytest
from rag_lab.data import CHECK_TAGS, MeshIndexer, biomedical_corpus, corpus_summary, evaluate_mesh_indexer, fitted_mesh_indexer, mesh_prf, mesh_vocabulary

@pytest.fixture(scope='module')
def corpus():
    return biomedical_corpus()

def test_vocabulary_maps_entry_terms_and_explodes():
    v = mesh_vocabulary()
    assert v.descriptor('Heart Attack') == 'Myocardial Infarction'
    assert v.descriptor('  myocardial   INFARCTION ') == 'Myocardial Infarction'
    assert v.descriptor('') is None and v.descriptor('zzz qqq') is None
    assert 'Small Cell Lung Carcinoma' in v.narrower('Lung Neoplasms')
    assert v.narrower('Not A Heading') == {'Not A Heading'}

def test_corpus_sources_ids_and_metadata(corpus):
    ids = [d.id for d in corpus]
    assert len(ids) == len(set(ids)) == len(corpus)
    by = {}
    for d in corpus: by.setdefault(d.metadata['source'], []).append(d)
    assert set(by) == {'pubmedqa', 'bioasq', 'scifact'}
    assert len(by['pubmedqa']) == 1000 and len(by['scifact']) == 5183
    assert all(d.metadata['mesh_source'] == 'gold' and d.metadata['mesh'] for d in by['pubmedqa'])
    assert all(d.metadata['mesh_source'] == 'indexer' and d.metadata['year'] is None for d in by['bioasq'] + by['scifact'])
    assert all(d.id.startswith('sf') for d in by['scifact'])             # SciFact ids can never collide with PMIDs
    assert all(d.full_text.strip() for d in corpus)                      # 167 BioASQ records are title-only

def test_pubmedqa_abstract_includes_conclusion(corpus):
    from rag_lab.data import load_pubmedqa
    r = load_pubmedqa().iloc[0]
    d = corpus[r.pmid]
    assert d.title == r.question and d.text.endswith(r.long_answer) and d.text.startswith(r.contexts[0])

def test_summary_totals(corpus):
    s = corpus_summary(corpus)
    assert s.loc['total', 'documents'] == len(corpus) == s.documents.drop('total').sum()
    assert s.loc['total', 'share_of_pubmed'] < 1e-3
    paper = corpus_summary(corpus, reference_size=23_000_000)   # a chapter passes the size its paper retrieved from
    assert paper.loc['total', 'share_of_pubmed'] == pytest.approx(len(corpus) / 23_000_000)
    assert paper.loc['total', 'share_of_pubmed'] > s.loc['total', 'share_of_pubmed']
    with pytest.raises(ValueError, match='positive'): corpus_summary(corpus, reference_size=0)

def test_bad_sources_refused():
    with pytest.raises(ValueError, match='unknown'): biomedical_corpus(('pubmedqa', 'medline'))
    with pytest.raises(ValueError): biomedical_corpus(())

def test_prf_definitions():
    m = mesh_prf([['A', 'B'], []], [['A'], ['C']])
    assert m['micro_precision'] == 0.5 and m['micro_recall'] == 0.5
    assert m['macro_precision'] == 0.5 and m['macro_recall'] == 0.5  # precision over items that predict something
    e = mesh_prf([['Humans', 'A']], [['Humans', 'A', 'B']], exclude=CHECK_TAGS)
    assert (e['micro_precision'], e['micro_recall']) == (1.0, 0.5)
    with pytest.raises(ValueError): mesh_prf([['A']], [['A'], ['B']])

def test_indexer_fit_checks_lengths():
    with pytest.raises(ValueError, match='2 texts but 1'): MeshIndexer().fit(['a', 'b'], [['A']])

def test_indexer_is_held_out_and_better_than_dictionary():
    fitted, raw = evaluate_mesh_indexer(fitted_mesh_indexer()), evaluate_mesh_indexer(MeshIndexer())
    for df in (fitted, raw):
        assert df[['micro_precision', 'micro_recall', 'macro_precision', 'macro_recall']].apply(lambda c: c.between(0, 1)).all().all()
        assert (df.n == 500).all()
    assert (fitted.micro_precision > raw.micro_precision).all()
