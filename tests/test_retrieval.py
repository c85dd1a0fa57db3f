"Adversarial and property tests of rag_lab.retrieval (BM25, dense, RRF, rerankers) on small local corpora."
import os
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from rag_lab.text import Document, Corpus, tokenize, split_sentences, sliding_windows
from rag_lab.retrieval import BM25Index, RankBM25Index, same_rankings, Vocab, ContrastiveDualEncoder, DenseIndex, rrf, FeatureReranker, CrossEncoderReranker, as_queries

DOCS = ['aspirin reduces fever in adults', 'fever and cough in children with influenza', 'statins lower ldl cholesterol',
        'aspirin and statins in cardiovascular prevention', 'influenza vaccination of older adults',
        'cholesterol transport in the liver', 'children fever paracetamol dosing', 'hypertension treatment in adults']

@pytest.fixture(scope='module')
def corpus():
    return Corpus([Document(f'd{i}', f'title {i}', t) for i, t in enumerate(DOCS)], name='toy')

@pytest.fixture(scope='module')
def bm25(corpus): return BM25Index(corpus)

# --- bad input -----------------------------------------------------------------------------------------------------
def test_empty_query_is_an_error(bm25):
    with pytest.raises(ValueError, match='empty query'): bm25.search(['   '])
    with pytest.raises(ValueError, match='empty query'): bm25.scores('')

def test_query_with_no_known_tokens_gives_empty_ranking(bm25, corpus):
    assert bm25.search({'q': 'zebra xylophone ###'}) == {'q': {}}
    assert RankBM25Index(corpus).search({'q': 'zebra xylophone'}) == {'q': {}}

def test_empty_corpus_is_refused():
    with pytest.raises(ValueError, match='empty corpus'): BM25Index(Corpus([]))
    with pytest.raises(ValueError, match='empty corpus'): RankBM25Index(Corpus([]))
    with pytest.raises(ValueError, match='empty corpus'): DenseIndex(Corpus([]), None)

def test_duplicate_ids_are_refused():
    with pytest.raises(ValueError, match='duplicate document ids'): Corpus([Document('a', '', 'x'), Document('a', '', 'y')])
    with pytest.raises(ValueError, match='duplicate document ids'): Corpus([Document(1, '', 'x'), Document('1', '', 'y')])

def test_k_larger_than_corpus(bm25, corpus):
    run = bm25.search(['fever'], k=10_000)['0']
    assert set(run) == {'d0', 'd1', 'd6'}                               # every matching document, no padding
    enc = ContrastiveDualEncoder(Vocab(DOCS), dim=8)
    assert len(DenseIndex(corpus, enc, cache=False).search(['fever'], k=10_000)['0']) == len(corpus)

@pytest.mark.parametrize('k', [0, -3, 2.5, None])
def test_bad_k(bm25, k):
    with pytest.raises(ValueError, match='positive integer'): bm25.search(['fever'], k=k)

def test_single_string_is_not_a_query_list(bm25):
    with pytest.raises(TypeError, match='not a single string'): bm25.search('fever')
    with pytest.raises(TypeError, match='must be strings'): as_queries({'q': 3})

def test_unknown_bm25_method(corpus):
    with pytest.raises(ValueError, match='unknown BM25 method'): BM25Index(corpus, method='okapi')

def test_load_refuses_other_corpus(bm25, tmp_path):
    bm25.save(tmp_path / 'ix')
    other = Corpus([Document('z', '', 'fever')])
    with pytest.raises(ValueError, match='other documents'): BM25Index.load(tmp_path / 'ix', other)
    with pytest.raises(FileNotFoundError): BM25Index.load(tmp_path / 'nothing', other)

# --- BM25: bm25s agrees with the rank-bm25 reference --------------------------------------------------------------
@pytest.mark.parametrize('method', ['lucene', 'robertson'])
def test_bm25s_matches_rank_bm25(corpus, method):
    qs = {'a': 'aspirin fever', 'b': 'influenza in children', 'c': 'cholesterol statins liver adults', 'd': 'in the'}
    fast, ref = BM25Index(corpus, method=method).search(qs, k=5), RankBM25Index(corpus, method=method).search(qs, k=5)
    assert same_rankings(fast, ref)

def test_textbook_bm25_value():
    c = Corpus([Document('a', '', 'x y'), Document('b', '', 'y z z')])
    s = BM25Index(c).scores('z')
    idf = np.log(1 + (2 - 1 + 0.5) / (1 + 0.5))
    tf, dl, avg = 2, 3, 2.5
    assert s[0] == 0 and np.isclose(s[1], idf * tf * 2.2 / (tf + 1.2 * (1 - 0.75 + 0.75 * dl / avg)), rtol=1e-6)

words = st.sampled_from('alpha beta gamma delta eps zeta eta theta iota kappa'.split())
@settings(max_examples=25, deadline=None)
@given(docs=st.lists(st.lists(words, min_size=1, max_size=12).map(' '.join), min_size=2, max_size=15),
       query=st.lists(words, min_size=1, max_size=4).map(' '.join))
def test_bm25_property_same_as_reference(docs, query):
    c = Corpus([Document(str(i), '', t) for i, t in enumerate(docs)])
    assert same_rankings(BM25Index(c).search([query], k=len(docs)), RankBM25Index(c).search([query], k=len(docs)))

def test_save_load_roundtrip(bm25, corpus, tmp_path):
    bm25.save(tmp_path / 'ix')
    assert BM25Index.load(tmp_path / 'ix', corpus).search(['aspirin fever']) == bm25.search(['aspirin fever'])

# --- text utilities ------------------------------------------------------------------------------------------------
@given(st.text(max_size=200))
def test_tokenize_is_lowercase_alnum(text):
    assert all(t.isascii() and t.isalnum() and t == t.lower() for t in tokenize(text))

@given(st.integers(0, 60), st.integers(1, 10), st.integers(1, 10))
def test_windows_cover_every_token(n, size, stride):
    "Windows are contiguous, in order, of full size, and together cover every position (tokens named by position)."
    stride = min(stride, size)        # stride > size skips tokens by design
    toks = [f't{i}' for i in range(n)]
    ws = sliding_windows(toks, size, stride)
    if n == 0:
        assert ws == []; return
    pos = [[int(t[1:]) for t in w] for w in ws]
    assert {i for p in pos for i in p} == set(range(n))                       # every token is in some window
    assert all(p == list(range(p[0], p[0] + len(p))) for p in pos)            # each window is a contiguous slice
    assert all(len(p) == min(size, n) for p in pos)                           # full windows only
    starts = [p[0] for p in pos]
    assert starts == sorted(set(starts)) and all(b - a <= stride for a, b in zip(starts, starts[1:]))
    assert ws[0] == toks[:size] and ws[-1] == toks[-min(size, n):]

def test_sentence_filter():
    assert split_sentences('Ok. ' * 5) == []
    assert split_sentences('') == []

# --- RRF -----------------------------------------------------------------------------------------------------------
runs_st = st.dictionaries(st.sampled_from(list('abcdefgh')), st.floats(0, 10), max_size=8)
@given(runs_st, runs_st, st.integers(1, 100))
def test_rrf_properties(r1, r2, k):
    a = {'q': dict(sorted(r1.items(), key=lambda x: -x[1]))}; b = {'q': dict(sorted(r2.items(), key=lambda x: -x[1]))}
    f = rrf([a, b], k=k, top=None)['q']
    assert set(f) == set(r1) | set(r2)
    assert list(f.values()) == sorted(f.values(), reverse=True)
    assert all(v <= 2 / (k + 1) + 1e-12 for v in f.values())

def test_rrf_bad_input():
    with pytest.raises(ValueError, match='at least one'): rrf([])
    with pytest.raises(ValueError, match='k must be'): rrf([{'q': {}}], k=0)

# --- dense ---------------------------------------------------------------------------------------------------------
def test_dense_training_learns_pairs(corpus):
    qs = ['aspirin fever', 'statins cholesterol', 'influenza vaccine', 'hypertension']
    ds = [DOCS[0], DOCS[2], DOCS[4], DOCS[7]]
    enc = ContrastiveDualEncoder(Vocab(qs + ds), dim=16).fit(qs, ds, epochs=30, batch_size=4, lr=0.05)
    assert enc.history[-1] < enc.history[0]
    run = DenseIndex(corpus, enc, cache=False).search(qs, k=1)
    assert [list(run[str(i)])[0] for i in range(4)] == ['d0', 'd2', 'd4', 'd7']
    e = enc.encode(['unknown words only'], is_query=True)
    assert e.shape == (1, 16) and not np.isnan(e).any()
    with pytest.raises(ValueError, match='aligned'): enc.fit(qs, ds[:2])

# --- rerankers -----------------------------------------------------------------------------------------------------
def test_feature_reranker_permutes_head_and_keeps_tail(bm25, corpus):
    qs = {'a': 'aspirin fever', 'b': 'cholesterol liver', 'c': 'influenza adults'}
    rel = {'a': {'d0'}, 'b': {'d5'}, 'c': {'d4'}}
    fr = FeatureReranker(bm25).fit(qs, rel, bm25.search(qs, k=8))
    first = bm25.search(qs, k=8)
    out = fr.rerank(qs, first, top=2)
    for q in qs:
        assert set(out[q]) == set(first[q]) and list(out[q])[2:] == list(first[q])[2:]
        assert list(out[q].values()) == sorted(out[q].values(), reverse=True)
    with pytest.raises(ValueError, match='without text'): fr.rerank({'a': 'x'}, first)
    with pytest.raises(ValueError, match='both relevant'): FeatureReranker(bm25).fit(qs, {}, first)

@pytest.fixture(scope='module')
def tiny_cross_encoder(tmp_path_factory):
    "A randomly initialised 2-layer BERT with a 1-logit head and a word-piece vocabulary, saved locally."
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast
    d = tmp_path_factory.mktemp('tiny_ce')
    vocab = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + sorted({t for x in DOCS for t in tokenize(x)} | {'title', '0', '1', '2', '3', '4', '5', '6', '7'})
    (d / 'vocab.txt').write_text('\n'.join(vocab))
    BertTokenizerFast(vocab_file=str(d / 'vocab.txt')).save_pretrained(d)
    cfg = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                     max_position_embeddings=64, num_labels=1)
    BertForSequenceClassification(cfg).save_pretrained(d)
    return d

@pytest.mark.parametrize('backend', ['sentence-transformers', 'flag'])
def test_cross_encoder_plumbing(tiny_cross_encoder, bm25, corpus, backend):
    ce = CrossEncoderReranker(tiny_cross_encoder, corpus, backend=backend, max_length=64)
    first = bm25.search({'a': 'aspirin fever', 'b': 'influenza'}, k=5)
    s = ce.score('aspirin fever', list(first['a']))
    assert s.shape == (len(first['a']),) and np.isfinite(s).all()
    assert np.allclose(s, ce.score('aspirin fever', list(first['a'])))   # deterministic in eval mode
    out = ce.rerank({'a': 'aspirin fever', 'b': 'influenza'}, first, top=3)
    assert all(set(out[q]) == set(first[q]) for q in first)
    assert ce.score('x', []).shape == (0,)

def test_cross_encoder_backends_agree(tiny_cross_encoder, corpus):
    ids = ['d0', 'd1', 'd2']
    a = CrossEncoderReranker(tiny_cross_encoder, corpus, backend='sentence-transformers', max_length=64).score('aspirin', ids)
    b = CrossEncoderReranker(tiny_cross_encoder, corpus, backend='flag', max_length=64).score('aspirin', ids)
    assert np.argsort(a).tolist() == np.argsort(b).tolist()

def test_unknown_cross_encoder_backend(corpus):
    with pytest.raises(ValueError, match='unknown cross-encoder backend'): CrossEncoderReranker('x', corpus, backend='onnx')

# --- concurrent runs share the embedding cache ------------------------------------------------------------------
def test_runs_encoding_the_same_texts_at_once_all_get_the_embeddings(tmp_path, monkeypatch):
    "Two notebooks running in parallel (the determinism test does this) once crashed renaming one shared temp file."
    import threading
    from concurrent.futures import ThreadPoolExecutor
    from rag_lab.retrieval import cached_encode
    monkeypatch.setenv('RAG_LAB_CACHE', str(tmp_path))
    writers = 6
    together = threading.Barrier(writers)
    class SlowEncoder:
        name = 'fake/encoder'
        def encode(self, texts, is_query=False):
            together.wait(timeout=60)   # every writer misses the cache, then all write the same entry at once
            return np.full((len(texts), 50_000), 0.5, dtype=np.float32)
    texts = [f'text {i}' for i in range(40)]
    with ThreadPoolExecutor(writers) as ex: got = list(ex.map(lambda _: cached_encode(SlowEncoder(), texts), range(writers)))
    assert all(g.shape == (40, 50_000) and (g == 0.5).all() for g in got)
    files = sorted(p.name for p in (tmp_path / 'embeddings' / 'fake_encoder').iterdir())
    assert len(files) == 40 and all(f.startswith('d-') and f.endswith('.npy') for f in files)   # one per text, no temp file left
    np.testing.assert_array_equal(cached_encode(SlowEncoder(), texts), got[0])   # a cache hit: encode is not called again


# --- the lazy dense index ---------------------------------------------------------------------------------------------
def test_dense_index_encodes_only_what_is_scored_then_the_rest_once(tmp_path, monkeypatch):
    "Reranking encodes the candidates only; a full search encodes the others, each document once, disk-cached per text."
    from rag_lab.retrieval import IndexReranker
    monkeypatch.setenv('RAG_LAB_CACHE', str(tmp_path))
    asked = []
    class Hashing:
        "A per-text encoder (a row depends on its text only), counting what it is asked to encode."
        name = 'hashing'
        def encode(self, texts, is_query=False):
            asked.extend(texts)
            v = np.array([[hash((t, j)) % 97 + 1 for j in range(8)] for t in texts], np.float32).reshape(len(texts), 8)
            return v / np.linalg.norm(v, axis=1, keepdims=True)
    docs = Corpus([Document(f'd{i}', '', f'document number {i}') for i in range(30)], name='thirty')
    idx = DenseIndex(docs, Hashing())
    assert idx.n_encoded == 0 and asked == []
    s = IndexReranker(idx).score('a query', ['d3', 'd7', 'd3'])
    assert idx.n_encoded == 2 and sorted(asked) == ['a query', 'document number 3', 'document number 7'] and s.shape == (3,)
    run = idx.search(['a query'], k=5)
    assert idx.n_encoded == 30 and len(asked) == 1 + 30 + 1   # 28 more documents (+ the query again), none twice
    eager = DenseIndex(docs, Hashing(), cache=False)          # uncached: the whole corpus at construction
    assert eager.n_encoded == 30 and run == eager.search(['a query'], k=5)
    np.testing.assert_array_equal(idx.doc_emb, eager.doc_emb)
    asked.clear(); again = DenseIndex(docs, Hashing())         # a new index over the same texts: all from the disk cache
    np.testing.assert_array_equal(again.doc_emb, eager.doc_emb); assert asked == []


# --- the ONNX encoder path -----------------------------------------------------------------------------------------
@pytest.fixture(scope='module')
def tiny_sentence_model(tmp_path_factory):
    "A random 2-layer BERT with mean pooling, saved as a sentence-transformers folder (no hub)."
    import torch
    from sentence_transformers import SentenceTransformer
    try: from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    except ImportError: from sentence_transformers.models import Pooling, Transformer   # before 5.x moved them
    from transformers import BertConfig, BertModel, BertTokenizerFast
    bert, st = tmp_path_factory.mktemp('tiny_bert'), tmp_path_factory.mktemp('tiny_st')
    words = sorted({t for d in DOCS for t in tokenize(d)} | {'title', *map(str, range(8))})
    (bert / 'vocab.txt').write_text('\n'.join(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', *words]))
    BertTokenizerFast(vocab_file=str(bert / 'vocab.txt')).save_pretrained(bert)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(words) + 5, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=64)).save_pretrained(bert)
    word = Transformer(str(bert), max_seq_length=48)
    dim = getattr(word, 'get_embedding_dimension', None) or word.get_word_embedding_dimension   # renamed in 5.x
    SentenceTransformer(modules=[word, Pooling(dim())], device='cpu').save(str(st))
    return st


def test_the_onnx_export_is_made_once_per_model_and_encodes_as_torch_does(tiny_sentence_model, tmp_path, monkeypatch):
    "onnx_checkpoint exports into the cache once, keyed by the model's files (an edited model gets its own export); the "
    "ONNX encoder's rows are PyTorch's to rounding, the same bits on any batch and thread count, in a cache of their own."
    import shutil
    from rag_lab.retrieval import SentenceTransformerEncoder, onnx_checkpoint
    monkeypatch.setenv('RAG_LAB_CACHE', str(tmp_path / 'cache'))
    first = onnx_checkpoint(tiny_sentence_model)
    assert first.is_relative_to(tmp_path / 'cache' / 'models' / 'onnx') and (first / 'onnx' / 'model.onnx').is_file()
    stamp = (first / 'onnx' / 'model.onnx').stat().st_mtime_ns
    assert onnx_checkpoint(tiny_sentence_model) == first and (first / 'onnx' / 'model.onnx').stat().st_mtime_ns == stamp
    assert not [p for p in first.parent.iterdir() if p.name.startswith('.')]   # no staging folder left behind
    edited = tmp_path / 'edited'
    shutil.copytree(tiny_sentence_model, edited)
    (edited / 'config_sentence_transformers.json').write_text((edited / 'config_sentence_transformers.json').read_text() + ' ')
    assert onnx_checkpoint(edited) != first
    onnx = SentenceTransformerEncoder(tiny_sentence_model, max_seq_length=48)
    torch_enc = SentenceTransformerEncoder(tiny_sentence_model, max_seq_length=48, backend='torch')
    rows = onnx.encode(DOCS)
    np.testing.assert_allclose(rows, torch_enc.encode(DOCS), atol=1e-5)
    np.testing.assert_array_equal(np.concatenate([onnx.encode(DOCS[:3]), onnx.encode(DOCS[3:])]), rows)
    np.testing.assert_array_equal(SentenceTransformerEncoder(tiny_sentence_model, max_seq_length=48, threads=2).encode(DOCS), rows)
    assert onnx.name == torch_enc.name and onnx.cache_name != torch_enc.cache_name


@pytest.mark.parametrize('kwargs, message', [(dict(backend='tf'), "'onnx' or 'torch'"), (dict(backend='torch', threads=2), "backend='onnx' only"),
                                             (dict(threads=0), 'positive')])
def test_an_impossible_encoder_backend_is_refused_before_loading(kwargs, message):
    from rag_lab.retrieval import SentenceTransformerEncoder
    with pytest.raises(ValueError, match=message): SentenceTransformerEncoder('/nonexistent/model', **kwargs)
