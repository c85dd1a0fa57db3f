"""The data registry: verified paths, clear errors, and nothing half-written on a failed or corrupt download."""
import hashlib, http.server, io, os, tarfile, threading
from functools import partial
from pathlib import Path
import pytest
import rag_lab.data as data
from rag_lab.data import DataError, DataFile, data_path, REGISTRY

@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    "No mirror: the repo-style download cache is an empty temp folder."
    monkeypatch.delenv('RAG_LAB_DATA', raising=False)
    monkeypatch.setattr(data, 'data_root', lambda: tmp_path / 'data')
    return tmp_path / 'data'

@pytest.fixture
def http_dir(tmp_path):
    "A real HTTP server on 127.0.0.1 serving a temp folder."
    root = tmp_path / 'served'; root.mkdir()
    srv = http.server.ThreadingHTTPServer(('127.0.0.1', 0), partial(http.server.SimpleHTTPRequestHandler, directory=str(root)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield root, f'http://127.0.0.1:{srv.server_address[1]}'
    srv.shutdown()

def _register(monkeypatch, f: DataFile):
    monkeypatch.setitem(REGISTRY, f.path, f)

def test_every_registered_file_verifies_against_the_mirror():
    if not os.environ.get('RAG_LAB_DATA'): pytest.skip('no mirror configured')
    assert data.verify_all().ok.all()

def test_missing_mirror_folder_is_one_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv('RAG_LAB_DATA', str(tmp_path / 'nowhere'))
    with pytest.raises(DataError, match='does not exist.*8b3276be'):
        data_path('pubmedqa/ori_pqal.json')

def test_corrupt_file_names_file_and_checksums(monkeypatch, tmp_path):
    (tmp_path / 'scifact').mkdir()
    (tmp_path / 'scifact' / 'claims_dev.jsonl').write_text('{"id": 1}\n')
    monkeypatch.setenv('RAG_LAB_DATA', str(tmp_path))
    with pytest.raises(DataError) as e: data.load_scifact_claims('dev')
    msg = str(e.value)
    assert 'claims_dev.jsonl' in msg and REGISTRY['scifact/claims_dev.jsonl'].sha256 in msg
    assert hashlib.sha256(b'{"id": 1}\n').hexdigest() in msg

def test_unregistered_file_is_refused():
    with pytest.raises(DataError, match='not a registered'):
        data_path('secret/other.json')

def test_download_verified_then_moved_into_place(empty_cache, http_dir, monkeypatch):
    root, url = http_dir
    (root / 'x.json').write_bytes(b'[1, 2, 3]')
    f = DataFile('toy/x.json', hashlib.sha256(b'[1, 2, 3]').hexdigest(), 'test server', f'{url}/x.json')
    _register(monkeypatch, f)
    p = data_path('toy/x.json')
    assert p == empty_cache / 'toy/x.json' and p.read_bytes() == b'[1, 2, 3]'
    assert sorted(x.name for x in p.parent.iterdir()) == ['x.json']      # no temp files left

def test_download_with_wrong_checksum_keeps_nothing(empty_cache, http_dir, monkeypatch):
    root, url = http_dir
    (root / 'x.json').write_bytes(b'tampered')
    _register(monkeypatch, DataFile('toy/x.json', '0' * 64, 'test server', f'{url}/x.json'))
    with pytest.raises(DataError, match='nothing was kept'):
        data_path('toy/x.json')
    assert not (empty_cache / 'toy' / 'x.json').exists()
    assert list((empty_cache / 'toy').iterdir()) == []

def test_download_from_archive_member(empty_cache, http_dir, monkeypatch):
    root, url = http_dir
    payload = b'{"doc_id": 1}\n'
    with tarfile.open(root / 'bundle.tar.gz', 'w:gz') as t:
        info = tarfile.TarInfo('data/corpus.jsonl'); info.size = len(payload)
        t.addfile(info, io.BytesIO(payload))
    _register(monkeypatch, DataFile('toy/corpus.jsonl', hashlib.sha256(payload).hexdigest(), 'test', f'{url}/bundle.tar.gz', 'data/corpus.jsonl'))
    assert data_path('toy/corpus.jsonl').read_bytes() == payload

def test_unreachable_source_is_a_clear_error(empty_cache, monkeypatch):
    _register(monkeypatch, DataFile('toy/y.json', '1' * 64, 'nowhere', 'http://127.0.0.1:9/y.json'))
    with pytest.raises(DataError, match='download from http://127.0.0.1:9/y.json failed'):
        data_path('toy/y.json')
    assert not (empty_cache / 'toy' / 'y.json').exists()

def test_no_download_source_says_how_to_get_it(empty_cache):
    with pytest.raises(DataError, match='no direct download.*RAG_LAB_DATA'):
        data_path('bioasq/bioasq_yesno_618_with_snippets.jsonl')

@pytest.mark.parametrize('call', [lambda: data.load_pubmedqa('dev'), lambda: data.load_mirage('medqa2'),
                                  lambda: data.load_mirage_predictions('bioasq', 'gpt-5', 'cot'),
                                  lambda: data.load_mirage_predictions('bioasq', 'gpt-4', 'rag8'),
                                  lambda: data.load_mmlu_med('surgery'), lambda: data.load_healthver('train'),
                                  lambda: data.load_scifact_claims('validation')])
def test_bad_arguments_are_value_errors(call):
    with pytest.raises(ValueError):
        call()

def _corrupt_archives(root: Path) -> dict:
    "Archives that fail to open in three ways: not a tar at all, a truncated zip, and a tar without the member."
    (root / 'bad.tar.gz').write_bytes(b'this is not a tar archive' * 20)
    good_zip = io.BytesIO()
    import zipfile
    with zipfile.ZipFile(good_zip, 'w') as z: z.writestr('data/corpus.jsonl', '{"doc_id": 1}\n' * 100)
    (root / 'cut.zip').write_bytes(good_zip.getvalue()[:60])
    with tarfile.open(root / 'other.tar.gz', 'w:gz') as t:
        info = tarfile.TarInfo('data/something_else.jsonl'); info.size = 2; t.addfile(info, io.BytesIO(b'{}'))
    return {'bad.tar.gz': 'ReadError', 'cut.zip': 'BadZipFile', 'other.tar.gz': 'KeyError'}

@pytest.mark.parametrize('name', ['bad.tar.gz', 'cut.zip', 'other.tar.gz'])
def test_broken_archive_is_one_clear_error_and_leaves_nothing(name, empty_cache, http_dir, monkeypatch):
    root, url = http_dir
    raw_error = _corrupt_archives(root)[name]
    _register(monkeypatch, DataFile('toy/corpus.jsonl', '2' * 64, 'test', f'{url}/{name}', 'data/corpus.jsonl'))
    with pytest.raises(DataError) as e:
        data_path('toy/corpus.jsonl')
    msg = str(e.value)
    assert f'{url}/{name}' in msg and 'data/corpus.jsonl' in msg and raw_error in msg and 'nothing was kept' in msg
    assert 'RAG_LAB_DATA' in msg                               # what to do about it
    assert list((empty_cache / 'toy').iterdir()) == []          # no temp folder, no partial file
