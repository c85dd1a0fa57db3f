"""Dev splits (issue 28): every chapter's tuned values come from a declared dev split that shares no item with its
headline. For every chapter and profile (resolved as the runner resolves it, `config.resolve_params`), the headline
items are computed exactly as the chapter computes them and set against its dev items: by item id, for PubMedQA also
by PMID, for VERIRAG by claim id and claim text, for claim_aware by SciFact claim id. Also: RAG²'s filter trains
inside MedMCQA's dev split, `test_items` refuses an `n` that would reach the dev split, and a `paper` profile's
`n = None` is the whole dataset minus its dev split."""
import json
from functools import lru_cache
from pathlib import Path
import pytest
from rag_lab import data   # the module, not `from rag_lab.data import test_items`: pytest would collect that name
from rag_lab.config import PROFILES, resolve_params
from rag_lab.papers.rag2 import filter_training_items
from rag_lab.papers.verirag import claim_cases

REPO = Path(__file__).resolve().parents[1]
CHAPTERS = ('reason_verify', 'rag2', 'pubmed_reasoner', 'comparison', 'verirag', 'claim_aware')

# ---------------------------------------------------------------- the helpers every check goes through
def norm(text: str) -> str: return ' '.join(str(text).lower().split())   # claim text: case and spacing aside

def overlap(headline, dev) -> set:
    "The keys (ids, PMIDs, texts) that are in both the headline and the dev split."
    return set(headline) & set(dev)

def assert_disjoint(name: str, headline, dev) -> None:
    shared = overlap(headline, dev)
    assert not shared, f"{name}: {len(shared)} dev item(s) among the headline items, e.g. {sorted(shared)[:3]}"

def pmids(df) -> set: return {p for ps in df.pmids for p in ps}

def all_ids(ds: str) -> set:
    "Every item id of a dataset as the chapters sample it, straight from the loader."
    df = data.load_mirage('mmlu' if ds == 'mmlu_ck' else ds)
    return set(df.id[df.id.str.startswith('clinical_knowledge-')] if ds == 'mmlu_ck' else df.id)

# ---------------------------------------------------------------- each chapter's headline and dev items, as it computes them
# The lines that draw each chapter's headline (and dev/training) items: the replicas below follow them, and
# test_chapters_still_sample_this_way fails when a chapter draws its items another way.
SAMPLE_LINES = {
    'reason_verify': ('10_reason_verify.ipynb', ["items = {ds: test_items(ds, P.n, seed=P.seed)", "train = load_pubmedqa('train')"]),
    'rag2': ('30_rag2.ipynb', ["samples = {d: test_items(d, P.n, seed=P.seed) for d in RUN_DS}",
                               "samples['pubmedqa'] = test_items('pubmedqa', P.n_pubmedqa, seed=P.seed)",
                               "samples['bioasq'] = test_items('bioasq', P.n_bioasq, seed=P.seed)",
                               "trainset = filter_training_items(TRAIN_DS, P.train_n, seed=P.seed)"]),
    'pubmed_reasoner': ('50_pubmed_reasoner.ipynb', ["pq = test_items('pubmedqa', P.n, P.seed)", "ck = test_items('mmlu_ck', P.n_mmlu, P.seed)"]),
    'comparison': ('60_comparison.ipynb', ["items = shared_items(load_predictions(SOURCE, P.dataset, available), P.min_shared)"]),
    'verirag': ('40_verirag.ipynb', ["test_cases = claim_cases(P.claim_sets, 'test', P.n, P.seed)",
                                     "train_cases = claim_cases(P.claim_sets, 'train', P.n_train, P.seed)"]),
    'claim_aware': ('20_claim_aware.ipynb', ["test_ids = test_ids_all[:P.n] if P.n else test_ids_all",
                                             "train_pairs = qrels['train'].merge(queries, on='qid')"]),
}

@lru_cache(maxsize=None)
def cases(claim_sets: str, split: str, n: int | None, seed: int) -> tuple:
    return tuple(claim_cases(claim_sets, split, n, seed))

@lru_cache(maxsize=None)
def scifact_beir():
    _, queries, qrels = data.load_scifact_beir()
    return queries, qrels

def mirage_pairs(name: str, headline, dev) -> list[tuple[str, set, set]]:
    "(check, headline keys, dev keys): ids, and for PubMedQA the PMIDs too."
    out = [(f'{name} ids', set(headline.id.astype(str)), set(dev.id.astype(str)))]
    if name.startswith('pubmedqa'): out.append((f'{name} PMIDs', pmids(headline), pmids(dev)))
    return out

def rag2_items(P) -> tuple[dict, object]:
    "RAG²'s headline and co-headline samples per dataset and its filter's training questions, as its chapter draws them."
    samples = {d: data.test_items(d, P.n, seed=P.seed) for d in P.datasets.split(',')}
    if P.n_pubmedqa != 0: samples['pubmedqa'] = data.test_items('pubmedqa', P.n_pubmedqa, seed=P.seed)
    if P.n_bioasq != 0: samples['bioasq'] = data.test_items('bioasq', P.n_bioasq, seed=P.seed)
    return samples, filter_training_items(P.train_datasets.split(','), P.train_n, seed=P.seed)

def headline_vs_dev(slug: str, profile: str) -> list[tuple[str, set, set]]:
    "Every (check, headline keys, dev keys) of a chapter under a profile."
    P = resolve_params(slug, profile)
    if slug == 'reason_verify':
        out = []
        for ds in P.datasets.split(','):
            out += mirage_pairs(ds, data.test_items(ds, P.n, seed=P.seed), data.dev_items(ds, P.seed))
        if 'pubmedqa' in P.datasets.split(','):   # Table 3's demonstration pool T*: PQA-L train
            pool = set(data.load_pubmedqa('train').pmid)
            assert pool <= set(data.dev_items('pubmedqa', P.seed).id)
            out.append(('pubmedqa demonstration pool', set(data.test_items('pubmedqa', P.n, seed=P.seed).id), pool))
        return out
    if slug == 'rag2':
        samples, trainset = rag2_items(P)
        out = [p for d, s in samples.items() for p in mirage_pairs(d, s, data.dev_items(d, P.seed))]
        return out + [(f'{d} filter training', set(samples[d].id) if d in samples else set(), set(trainset.id[trainset.dataset == d]))
                      for d in P.train_datasets.split(',')]
    if slug == 'pubmed_reasoner':
        return (mirage_pairs('pubmedqa', data.test_items('pubmedqa', P.n, P.seed), data.dev_items('pubmedqa', P.seed))
                + mirage_pairs('mmlu_ck', data.test_items('mmlu_ck', P.n_mmlu, P.seed), data.dev_items('mmlu_ck', P.seed)))
    if slug == 'comparison':   # the PubMedQA* items its three source chapters share under the same profile
        shared = set.intersection(*[set(h) for name, h, _ in
                                    [t for s in ('reason_verify', 'rag2', 'pubmed_reasoner') for t in headline_vs_dev(s, profile)]
                                    if name == 'pubmedqa ids'])
        head = data.test_items('pubmedqa', P.n, seed=P.seed)
        assert shared <= set(data.test_items('pubmedqa', None, seed=P.seed).id)
        return mirage_pairs('pubmedqa', head, data.dev_items('pubmedqa', P.seed)) + [
            ('pubmedqa shared by the chapters', shared, set(data.dev_items('pubmedqa', P.seed).id))]
    if slug == 'verirag':
        test, train = cases(P.claim_sets, 'test', P.n, P.seed), cases(P.claim_sets, 'train', P.n_train, P.seed)
        assert test and train
        return [('claim ids', {c.claim_id for c in test}, {c.claim_id for c in train}),
                ('claim texts', {norm(c.claim) for c in test}, {norm(c.claim) for c in train})]
    if slug == 'claim_aware':
        queries, qrels = scifact_beir()
        test_ids_all = [q for q in queries.qid if q in set(qrels['test'].qid)]
        test_ids = test_ids_all[:P.n] if P.n else test_ids_all
        return [('SciFact claim ids (BEIR test = SciFact dev vs train)', set(test_ids), set(qrels['train'].qid))]
    raise KeyError(slug)

# ---------------------------------------------------------------- the checks
@pytest.mark.parametrize('profile', PROFILES)
@pytest.mark.parametrize('slug', CHAPTERS)
def test_no_dev_item_is_a_headline_item(slug, profile):
    checks = headline_vs_dev(slug, profile)
    assert checks
    for name, head, dev in checks:
        assert head and dev, f"{slug}/{profile}/{name}: an empty side proves nothing"
        assert_disjoint(f'{slug}/{profile}/{name}', head, dev)

def test_the_helper_detects_an_overlap():
    "The same helper fails on a deliberately leaky pair: a dev split with one headline item in it, and the old `n = None`."
    head, dev = data.test_items('bioasq', 150), data.dev_items('bioasq')
    leaky = dev.assign(id=[head.id[0], *dev.id[1:]])
    assert overlap(head.id, leaky.id) == {head.id[0]}
    with pytest.raises(AssertionError, match='1 dev item'): assert_disjoint('leaky', head.id, leaky.id)
    everything = data.nested_sample(data.load_mirage('bioasq'), None)   # the whole dataset as headline (before dev splits)
    assert len(overlap(everything.id, dev.id)) == len(dev) == data.DEV_TAIL['bioasq']
    with pytest.raises(AssertionError, match='100 dev item'): assert_disjoint('all items', everything.id, dev.id)
    with pytest.raises(AssertionError, match='1 dev item'):   # and by PMID: a headline article among the dev split's
        pq = data.dev_items('pubmedqa')
        assert_disjoint('pmids', pmids(data.test_items('pubmedqa', 5)), pmids(pq) | {data.test_items('pubmedqa', 1).pmids[0][0]})

@pytest.mark.parametrize('slug', CHAPTERS)
def test_chapters_still_sample_this_way(slug):
    "The replicas above follow these lines of each chapter; if a chapter draws its items another way, update both."
    nb, needed = SAMPLE_LINES[slug]
    code = '\n'.join(''.join(c['source']) for c in json.loads((REPO / 'nbs' / nb).read_text())['cells'] if c['cell_type'] == 'code')
    for line in needed: assert line in code, f"{nb} no longer contains {line!r}"

@pytest.mark.parametrize('profile', PROFILES)
def test_rag2_filter_trains_inside_the_dev_splits(profile):
    P = resolve_params('rag2', profile)
    samples, trainset = rag2_items(P)
    for d in P.train_datasets.split(','):
        got, dev = trainset[trainset.dataset == d], data.dev_items(d, P.seed)
        assert len(got) == P.train_n and set(got.id) <= set(dev.id)
        assert got.id.tolist() == dev.id[len(dev) - P.train_n:].tolist()   # the end of the dev split
        assert not set(got.id) & set(data.test_items(d, None, seed=P.seed).id)
    with pytest.raises(ValueError, match="medmcqa's dev split, which holds 1000"):
        filter_training_items(['medmcqa'], data.DEV_TAIL['medmcqa'] + 1, seed=P.seed)

@pytest.mark.parametrize('ds', list(data.DEV_SPLITS))
def test_test_items_refuses_an_n_that_reaches_dev(ds):
    pool = len(data.test_items(ds, None))
    assert data.test_items(ds, pool).id.tolist() == data.test_items(ds, None).id.tolist()   # the largest n allowed
    with pytest.raises(ValueError, match=rf"{ds}: n={pool + 1} headline items asked, but its headline pool holds {pool} .*dev split"):
        data.test_items(ds, pool + 1)
    with pytest.raises(ValueError, match='headline pool'): data.test_items(ds, -1)

def test_a_chapter_asking_past_the_pool_is_refused():
    "A run's `n` beyond the pool fails when the chapter samples, naming the dataset and its dev split."
    P = resolve_params('reason_verify', 'default', n=600)
    with pytest.raises(ValueError, match=r'bioasq: n=600 .* holds 518 of 618 .*dev split: the last 100'):
        [data.test_items(ds, P.n, seed=P.seed) for ds in P.datasets.split(',')]

PAPER_NONE = {'reason_verify': {'bioasq': 'n', 'pubmedqa': 'n'}, 'rag2': {'medqa': 'n', 'mmlu': 'n'},
              'pubmed_reasoner': {'pubmedqa': 'n', 'mmlu_ck': 'n_mmlu'}}   # datasets a `paper` profile samples with n = None

@pytest.mark.parametrize('slug', PAPER_NONE)
def test_paper_profile_n_none_is_the_pool_minus_dev(slug):
    P = resolve_params(slug, 'paper')
    for ds, knob in PAPER_NONE[slug].items():
        assert getattr(P, knob) is None
        head, dev = data.test_items(ds, None, seed=P.seed), data.dev_items(ds, P.seed)
        whole = all_ids(ds)
        if ds == 'pubmedqa': assert set(head.id) == whole and not overlap(head.id, dev.id)   # its dev split is PQA-L train
        else: assert set(head.id) == whole - set(dev.id) and len(head) == len(whole) - data.DEV_TAIL[ds]
    if slug == 'rag2':   # MedMCQA's headline: the pool too, whatever train_n
        samples, _ = rag2_items(P)
        assert len(samples['medmcqa']) == 4183 - data.DEV_TAIL['medmcqa']

@pytest.mark.parametrize('profile', ['default', 'paper'])
def test_verirag_whole_claim_pools_are_disjoint(profile):
    "Not only the first n: every eligible train claim against every eligible test claim, by id and by text."
    P = resolve_params('verirag', profile)
    test, train = cases(P.claim_sets, 'test', None, P.seed), cases(P.claim_sets, 'train', None, P.seed)
    assert_disjoint('verirag claim ids', {c.claim_id for c in test}, {c.claim_id for c in train})
    assert_disjoint('verirag claim texts', {norm(c.claim) for c in test}, {norm(c.claim) for c in train})
    assert {c.split for c in test} == {'test'} and {c.split for c in train} == {'train'}

# SciFact itself repeats two claims in train and dev (ids 871/870 and 1291/1292), with the same cited abstract and no
# rationale: claim_aware's models are trained on their train copies and its headline (n = None) evaluates the dev ones.
# They are in the data as released; this pins them so that no other shared text goes unnoticed.
SCIFACT_REPEATED_CLAIMS = {'obesity decreases life quality.', 'there is no association between hnf4a mutations and diabetes risks.'}

def test_claim_aware_text_overlap_is_only_scifacts_own_repeats():
    queries, qrels = scifact_beir()
    text = dict(zip(queries.qid, queries.text))
    shared = overlap({norm(text[q]) for q in set(qrels['test'].qid)}, {norm(text[q]) for q in set(qrels['train'].qid)})
    assert shared == SCIFACT_REPEATED_CLAIMS
