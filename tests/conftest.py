"""Shared pytest setup: point the loaders at the offline data mirror and keep outputs out of the repository."""
import os
from pathlib import Path
import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / 'shared' / 'data'

def pytest_configure(config):
    if not os.environ.get('RAG_LAB_DATA') and SHARED_DATA.exists():
        os.environ['RAG_LAB_DATA'] = str(SHARED_DATA)
    config.addinivalue_line('markers', 'xdist_group(name): run on the same pytest-xdist worker as the rest of the group')
    config.addinivalue_line('markers', 'warm_corpus: run after the rest of its corpus group, which encodes the corpus it reads')

SHARED_SCOPES = ('class', 'module', 'package')   # session fixtures are per worker process whatever the grouping

@pytest.hookimpl(tryfirst=True)   # before pytest-xdist reads the marks (tools/run_tests.sh runs `-n 2 --dist loadgroup`)
def pytest_collection_modifyitems(config, items):
    "A test that uses a fixture built once for its file (or wider) joins its file's xdist group: the fixture is then built "
    "on one worker, not on each. Every other test goes to whichever worker is free."
    for item in items:
        info = getattr(item, '_fixtureinfo', None)
        if info is None or item.get_closest_marker('xdist_group'): continue
        # the project's own fixtures only (pytest's built-in ones have an empty baseid)
        if any(fd.scope in SHARED_SCOPES and fd.baseid for fds in info.name2fixturedefs.values() for fd in fds):
            item.add_marker(pytest.mark.xdist_group(item.path.name))
    # a group's tests run on one worker in collection order: a test that reads a small part of a corpus goes after the
    # ones that encode all of it (the class benchmark's reason_verify replay: 335 s first in a clean CI, 39 s after)
    items[:] = sorted(items, key=lambda i: i.get_closest_marker('warm_corpus') is not None)

LOADGROUP_BROKEN_FROM = (9, 2)   # pytest 9.2 drops pytest-xdist's group suffix on node ids (pytest-xdist issue 1386)

def _refuse_ungrouped(why: str) -> None:
    raise pytest.UsageError(f"--dist loadgroup cannot group the tests here: {why}. Every group would be spread over the "
                            f"workers without a word, each building the shared fixtures again: install pytest<9.2 "
                            f"(settings.ini pins it), or run without -n")

@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    "On the controller: a pytest known to drop the group suffix is refused before any worker starts."
    version = tuple(int(x) for x in pytest.__version__.split('.')[:2] if x.isdigit())
    if config.getoption('dist', 'no') == 'loadgroup' and version >= LOADGROUP_BROKEN_FROM:
        _refuse_ungrouped(f"pytest {pytest.__version__} drops pytest-xdist's group suffix (pytest-xdist issue 1386)")

def pytest_collection_finish(session):
    "On a worker under `--dist loadgroup`: every grouped test's node id carries its group (xdist's `@group` suffix, what "
    "the scheduler groups by), whatever else might drop it."
    if not getattr(session.config.option, 'loadgroup', False): return   # set on the workers only
    lost = [i.nodeid for i in session.items if i.get_closest_marker('xdist_group') and '@' not in i.nodeid]
    if lost: _refuse_ungrouped(f"{len(lost)} grouped test(s) lack pytest-xdist's group suffix, e.g. {lost[0]}")

# chapters whose runs spend most of their time encoding their corpus with MiniLM (embeddings cached by text under
# .cache/embeddings): the tests that run them share one xdist group, so one worker runs them one after another and
# encodes each text once; on two workers at once, both would encode it (a clean CI measured the class benchmark's
# reason_verify replay at 300 s beside the others, 39 s after them)
CORPUS_ENCODERS = ('reason_verify', 'rag2')

def shares_corpus(slug: str) -> list:
    "The marks of a test that runs chapter `slug`: its corpus's xdist group for the CORPUS_ENCODERS, else none."
    return [pytest.mark.xdist_group(f'corpus-{slug}')] if slug in CORPUS_ENCODERS else []

@pytest.fixture
def repo() -> Path:
    return REPO

@pytest.fixture(scope='module')
def toy():
    "Three abstracts for the PubMed query language and the local E-utilities service (markup characters on purpose)."
    from rag_lab.text import Corpus, Document
    return Corpus([
        Document('101', 'Leukotrienes in asthma', 'Montelukast blocks leukotriene receptors in bronchial asthma.',
                 metadata=dict(year=2005, mesh=['Asthma', 'Leukotrienes'])),
        Document('102', 'Childhood asthma trial', 'Inhaled steroids for asthma in children & adolescents <12y.',
                 metadata=dict(year=2012, mesh=['Asthma', 'Child'])),
        Document('103', 'Screening', 'CT screening for small cell lung carcinoma.',
                 metadata=dict(year=None, mesh=['Small Cell Lung Carcinoma']))], name='toy')

@pytest.fixture(scope='module')
def llama_server_bin() -> Path:
    "llama.cpp's server, built once from the vendored sources (cached); the test is skipped only where it cannot be built."
    import shutil
    from rag_lab.server import llama_server_binary
    missing = [t for t in ('cmake', 'c++') if shutil.which(t) is None]
    if missing and not sorted(REPO.glob('.cache/llama-server/*/llama-server')):
        pytest.skip(f"llama-server cannot be built here: {', '.join(missing)} not installed (and no cached build)")
    return llama_server_binary(build=True, jobs=2)   # cached: instant after the first build

def readme_reproduce_commands() -> list[str]:
    "Every `rag-lab reproduce` command in README.md, continuation lines joined, without comments or VAR=value prefixes."
    import re
    lines = (REPO / 'README.md').read_text().replace('\\\n', ' ').splitlines()
    env = r'(?:[A-Z_]+=\S+\s+)*'
    return [re.sub(f'^{env}', '', l.split('#')[0].strip()) for l in lines
            if re.match(rf'^{env}(\.venv/bin/)?rag-lab reproduce', l.strip())]

@pytest.fixture
def out_env(tmp_path, monkeypatch) -> Path:
    "Outputs of the code under test go to a temp folder, never into the repository."
    monkeypatch.setenv('RAG_LAB_OUT', str(tmp_path / 'out'))
    return tmp_path / 'out'



def records_in(folder: Path) -> list[dict]:
    "Every call recorded in a records folder (its calls-*.jsonl.gz shards), parsed."
    import gzip, json
    return [json.loads(line) for f in sorted(Path(folder).glob('calls-*.jsonl.gz')) for line in gzip.open(f, 'rt') if line.strip()]

def used_records(slug: str, profile: str) -> list[dict]:
    "The committed records a chapter's published run uses (`records/<slug>/<profile>/used.txt.gz`), parsed."
    import gzip
    folder = REPO / 'records' / slug / profile
    used = set(gzip.decompress((folder / 'used.txt.gz').read_bytes()).decode().split())
    return [r for r in records_in(folder) if r['key'] in used]

# A test fixture, not library code: a tiny random Llama checkpoint for the transformers backend (no hub here).
from pathlib import Path
def build_tiny_checkpoint(dest: Path | str, # folder to write
                          seed: int = 0, # weight initialisation seed
                         ) -> Path: # the checkpoint folder
    "Write a tiny random LlamaForCausalLM with a word-level tokenizer and a ChatML template (for tests and lessons)."
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    dest = Path(dest); dest.mkdir(parents=True, exist_ok=True)
    specials = ['<pad>', '<s>', '</s>', '<unk>', '<|im_start|>', '<|im_end|>']
    corpus = ["the answer is yes", "the answer is no", "paris is the capital of france", "user assistant system",
              "aspirin reduces fever and pain", "what is the capital of france", "final answer a b c maybe"]
    raw = Tokenizer(models.WordLevel(unk_token='<unk>'))
    raw.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit()])
    raw.decoder = decoders.WordPiece(prefix='##')  # joins words with spaces
    raw.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=specials))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, bos_token='<s>', eos_token='<|im_end|>', pad_token='<pad>',
                                  unk_token='<unk>')
    tok.chat_template = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
                         "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    LlamaForCausalLM(cfg).save_pretrained(dest); tok.save_pretrained(dest)
    return dest
