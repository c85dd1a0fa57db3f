"""The BGE paths go through FlagEmbedding: `FlagReranker` behind `make_reranker('bge')` and `CrossEncoderReranker`, `FlagModel`
behind `FlagEncoder`. No hub is reachable, so each test builds a tiny random checkpoint of the real architecture (XLM-RoBERTa
with a one-logit head, as bge-reranker-v2-m3; BERT with [CLS] pooling, as bge-small-en-v1.5) and checks FlagEmbedding's
numbers against the same model run directly with transformers."""
import os
os.environ.setdefault('HF_HUB_OFFLINE', '1')
import numpy as np
import pytest
import torch
from rag_lab.text import Document, Corpus, tokenize
from rag_lab.retrieval import CrossEncoderReranker, DenseIndex, EmbeddingReranker, FlagEncoder, make_reranker

DOCS = ['aspirin reduces fever in adults', 'fever and cough in children with influenza', 'statins lower ldl cholesterol',
        'aspirin and statins in cardiovascular prevention', 'influenza vaccination of older adults',
        'cholesterol transport in the liver', 'children fever paracetamol dosing and the risk of liver damage in infants',
        'hypertension treatment in adults']
QUERIES = ['aspirin fever', 'does influenza vaccination protect older adults from cough', 'liver']
INSTRUCTION = 'Represent this sentence for searching relevant passages: '


@pytest.fixture(scope='module')
def corpus():
    return Corpus([Document(f'd{i}', f'title {i}', t) for i, t in enumerate(DOCS)], name='toy')


@pytest.fixture(scope='module')
def tiny_reranker(tmp_path_factory):
    "A random 2-layer XLM-RoBERTa with a 1-logit head and a unigram (sentencepiece-style) tokenizer trained here, saved locally."
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification, XLMRobertaTokenizerFast
    d = tmp_path_factory.mktemp('tiny_bge_reranker')
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.train_from_iterator([*DOCS, *QUERIES, 'title 0 1 2 3 4 5 6 7'] * 4,
                            trainers.UnigramTrainer(vocab_size=200, unk_token='<unk>',
                                                    special_tokens=['<s>', '<pad>', '</s>', '<unk>', '<mask>']))
    # XLM-R's pair layout: <s> query </s></s> passage </s>
    tok.post_processor = processors.TemplateProcessing(single='<s> $A </s>', pair='<s> $A </s> </s> $B </s>',
                                                       special_tokens=[('<s>', 0), ('</s>', 2)])
    fast = XLMRobertaTokenizerFast(tokenizer_object=tok)
    fast.save_pretrained(d)
    torch.manual_seed(0)
    cfg = XLMRobertaConfig(vocab_size=len(fast), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=130, num_labels=1, pad_token_id=1,
                           bos_token_id=0, eos_token_id=2, initializer_range=0.5)   # wide weights: scores far apart
    XLMRobertaForSequenceClassification(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope='module')
def tiny_encoder(tmp_path_factory):
    "A random 2-layer BERT (no head) with a word-piece vocabulary written here, saved locally."
    from transformers import BertConfig, BertModel, BertTokenizerFast
    d = tmp_path_factory.mktemp('tiny_bge_encoder')
    words = {t for x in [*DOCS, *QUERIES, INSTRUCTION, 'title 0 1 2 3 4 5 6 7'] for t in tokenize(x)}
    (d / 'vocab.txt').write_text('\n'.join(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]', ':', *sorted(words)]))
    BertTokenizerFast(vocab_file=str(d / 'vocab.txt')).save_pretrained(d)
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=len(words) + 6, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=64, initializer_range=0.5)).save_pretrained(d)
    return d


def direct_logits(path, pairs, max_length=512):
    "The relevance logit of each (query, passage) pair, one pair at a time (no padding), straight from transformers."
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    tok, net = AutoTokenizer.from_pretrained(path), AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return np.array([net(**tok(q, p, truncation='only_second', max_length=max_length, return_tensors='pt')).logits[0, 0].item()
                         for q, p in pairs])


def direct_cls(path, texts, max_length):
    "BGE's embedding as FlagModel defines it: the last layer's [CLS] vector, L2-normalised."
    from transformers import AutoModel, AutoTokenizer
    tok, net = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    with torch.no_grad():
        cls = torch.stack([net(**tok(t, truncation=True, max_length=max_length, return_tensors='pt')).last_hidden_state[0, 0]
                           for t in texts])
    return torch.nn.functional.normalize(cls, dim=-1).numpy()


# ---------------------------------------------------------------- the reranker: FlagReranker
def test_flag_reranker_scores_are_the_models_logits(tiny_reranker, corpus):
    ids = [f'd{i}' for i in range(len(DOCS))]
    ce = CrossEncoderReranker(tiny_reranker, corpus)   # backend 'flag' is the default
    from FlagEmbedding import FlagReranker
    assert ce.backend == 'flag' and isinstance(ce.model, FlagReranker)
    for q in QUERIES:
        want = direct_logits(tiny_reranker, [(q, corpus[d].full_text) for d in ids])
        got = ce.score(q, ids)
        assert got.shape == (len(ids),)                    # one score per (query, passage) pair
        assert np.abs(got - want).max() < 1e-5             # FlagReranker pads and length-sorts; the logits do not move
        assert np.ptp(want) > 0.1                          # far apart, so a misaligned score would show
        assert np.array_equal(got, ce.score(q, ids))       # deterministic
        rev = ids[::-1]
        assert np.abs(ce.score(q, rev) - want[::-1]).max() < 1e-5   # each score stays with its passage
    assert ce.score('aspirin', []).shape == (0,)


def test_normalised_scores_are_the_sigmoid_of_the_logits(tiny_reranker, corpus):
    ids = ['d0', 'd3', 'd6']
    raw = CrossEncoderReranker(tiny_reranker, corpus, normalize=False).score('aspirin fever', ids)
    sig = CrossEncoderReranker(tiny_reranker, corpus, normalize=True).score('aspirin fever', ids)
    want = 1 / (1 + np.exp(-direct_logits(tiny_reranker, [('aspirin fever', corpus[d].full_text) for d in ids])))
    assert np.abs(sig - want).max() < 1e-5 and np.abs(sig - 1 / (1 + np.exp(-raw))).max() < 1e-12
    assert ((sig > 0) & (sig < 1)).all()


def test_sentence_transformers_backend_is_on_the_same_scale(tiny_reranker, corpus):
    "sentence-transformers squashes a one-logit head by default; told which scale, both backends give the same numbers."
    ids = ['d1', 'd4', 'd7']
    for normalize in (False, True):
        a = CrossEncoderReranker(tiny_reranker, corpus, backend='flag', normalize=normalize).score('influenza', ids)
        b = CrossEncoderReranker(tiny_reranker, corpus, backend='sentence-transformers', normalize=normalize).score('influenza', ids)
        assert np.abs(a - b).max() < 1e-5, normalize


def test_make_reranker_bge_is_the_normalised_flag_reranker(tiny_reranker, corpus):
    from FlagEmbedding import FlagReranker
    rr = make_reranker('bge', corpus, str(tiny_reranker))
    assert isinstance(rr, CrossEncoderReranker) and isinstance(rr.model, FlagReranker) and rr.normalize
    assert rr.name == f'cross-encoder {tiny_reranker}'
    ids = ['d0', 'd1', 'd2', 'd3', 'd4']
    s = rr.score('aspirin fever', ids)
    want = 1 / (1 + np.exp(-direct_logits(tiny_reranker, [('aspirin fever', corpus[d].full_text) for d in ids])))
    assert np.abs(s - want).max() < 1e-5 and ((0 <= s) & (s <= 1)).all()   # the scale tau_evid = 0.5 is read on
    out = rr.rerank({'q': 'aspirin fever'}, {'q': {d: 0.0 for d in ids + ['d5', 'd6']}}, top=5)['q']
    assert list(out)[:5] == [ids[i] for i in np.argsort(-want, kind='stable')] and list(out)[5:] == ['d5', 'd6']


def test_missing_checkpoint_fails_before_any_work(tmp_path, corpus, monkeypatch):
    import FlagEmbedding, huggingface_hub
    def never(*a, **k): raise AssertionError('FlagEmbedding was asked to load a checkpoint that does not exist')
    monkeypatch.setattr(FlagEmbedding, 'FlagReranker', never)
    monkeypatch.setattr(FlagEmbedding, 'FlagModel', never)
    with pytest.raises(FileNotFoundError, match='no cross-encoder folder at .*missing'):
        make_reranker('bge', corpus, tmp_path / 'missing')
    with pytest.raises(FileNotFoundError, match='no BGE encoder folder at'): FlagEncoder(tmp_path / 'missing')
    with pytest.raises(FileNotFoundError, match='has no config.json'): make_reranker('bge', corpus, tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, 'HF_HUB_OFFLINE', True)
    with pytest.raises(FileNotFoundError, match='HF_HUB_OFFLINE'): make_reranker('bge', corpus, 'rag-lab-tests/no-such-reranker')
    with pytest.raises(ValueError, match='unknown cross-encoder backend'): CrossEncoderReranker(tmp_path / 'missing', corpus, backend='onnx')


# ---------------------------------------------------------------- the dense encoder: FlagModel
def test_flag_encoder_is_normalised_cls_pooling(tiny_encoder):
    enc = FlagEncoder(tiny_encoder, max_length=32)
    from FlagEmbedding import FlagModel
    assert isinstance(enc.model, FlagModel)
    q, d = enc.encode(QUERIES, is_query=True), enc.encode(DOCS)
    assert q.dtype == d.dtype == np.float32 and q.shape == (len(QUERIES), 32) and d.shape == (len(DOCS), 32)
    assert np.abs(q - direct_cls(tiny_encoder, [INSTRUCTION + x for x in QUERIES], 32)).max() < 1e-5   # instruction on queries
    assert np.abs(d - direct_cls(tiny_encoder, DOCS, 32)).max() < 1e-5                                # documents as they are
    assert np.abs(np.linalg.norm(q, axis=1) - 1).max() < 1e-5
    assert np.abs(q - direct_cls(tiny_encoder, QUERIES, 32)).max() > 1e-3   # the instruction does change the vectors
    assert np.array_equal(q, enc.encode(QUERIES, is_query=True))
    assert enc.encode([], is_query=True).shape == (0, 32)
    plain = FlagEncoder(tiny_encoder, query_instruction=None, max_length=32)
    assert np.abs(plain.encode(QUERIES, is_query=True) - direct_cls(tiny_encoder, QUERIES, 32)).max() < 1e-5
    # the cache key tells the two apart (same folder, same length, another query text)
    assert enc.name != plain.name and enc.name.startswith(f'{tiny_encoder.name}-L32-q') and plain.name == f'{tiny_encoder.name}-L32'


def test_flag_encoder_serves_the_dense_interfaces(tiny_encoder, corpus, tmp_path, monkeypatch):
    monkeypatch.setenv('RAG_LAB_CACHE', str(tmp_path))   # the embedding cache of `EmbeddingReranker`
    enc = FlagEncoder(tiny_encoder, max_length=32)
    want = direct_cls(tiny_encoder, [INSTRUCTION + QUERIES[0]], 32) @ direct_cls(tiny_encoder, corpus.texts(), 32).T
    run = DenseIndex(corpus, enc, cache=False).search({'q': QUERIES[0]}, k=3)['q']
    assert list(run) == [corpus.ids[i] for i in np.argsort(-want[0], kind='stable')[:3]]
    s = EmbeddingReranker(corpus, encoder=enc).score(QUERIES[0], corpus.ids)
    assert np.abs(s - np.clip(want[0], 0, 1)).max() < 1e-5
