"""Issue 34 (records and cache): a bad record line names its file and line, a call recorded with two results names
both places, a choice whose options do not answer its request is not replayed, `same_result` wants the same chosen
option, and a cache that cannot be written is not called damaged (nor needed by a replay)."""
import errno, gc, json, os, sqlite3
from pathlib import Path
import pytest
from rag_lab import calls
from rag_lab.calls import CacheError, CallRecords, LLMCache, Ledger, RecordsError, same_result, _canonical, _digest, _gz_lines
from rag_lab.llm import LLM


@pytest.fixture(autouse=True)
def default_modes(monkeypatch):
    "Replay records, cache on: whatever the environment of the test run says."
    for var in ('RAG_LAB_RECORDS', 'RAG_LAB_LLM_CACHE', 'RAG_LAB_RECORD'): monkeypatch.delenv(var, raising=False)


class Scripted(LLM):
    "A backend without a model: every computed call is counted, so a test can tell a replay from a computation."
    backend, fingerprint = 'scripted', 'scripted-v1'
    def __init__(self, **kw):
        super().__init__('scripted', ledger=Ledger(), **kw)
        self.computed = 0
    def _chat_batch(self, batch, cfg):
        self.computed += len(batch)
        return [dict(text='computed', finish_reason='stop', prompt_tokens=3, completion_tokens=1) for _ in batch]
    def _choose(self, context, prefix, options):
        self.computed += 1
        return dict(logprobs=[-0.1 * (i + 1) for i in range(len(options))], n_tokens=[1] * len(options), context_tokens=3)


def line(req: dict, value: dict) -> tuple[str, str]:
    "A record line (key, JSON) exactly as the recorder writes it."
    key = LLMCache.key(**req)
    return key, _canonical(dict(key=key, request=req, value=value, sha256=_digest(_canonical(value))))


def chat_line(text: str, answer: str, seconds: float = 0.5) -> tuple[str, str]:
    req = dict(kind='chat', backend='scripted', model='m', messages=[{'role': 'user', 'content': text}])
    return line(req, dict(text=answer, finish_reason='stop', prompt_tokens=3, completion_tokens=1, seconds=seconds,
                          backend='scripted', model='m'))


def shard(root: Path, slug: str, lines: list[str], name: str = 'all') -> Path:
    f = root / slug / 'smoke' / f'calls-{name}.jsonl.gz'
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_bytes(_gz_lines(lines))
    return f


# ---------------------------------------------------------------- 1. a bad line names its file and line
@pytest.mark.parametrize('bad, what', [('', 'blank'), ('{"key": "abc", "request":', 'not JSON'),
                                       ('[1, 2, 3]', 'not an object'), ('"a string"', 'not an object')])
def test_a_bad_record_line_is_an_error_naming_its_file_and_line(tmp_path, bad, what):
    "Before: `CallRecords.get` of any key raised a bare JSONDecodeError (a list: AttributeError) that named no file."
    k1, l1 = chat_line('q1', 'a1')
    k2, l2 = chat_line('q2', 'a2')
    shard(tmp_path, 'good', [l1])
    broken = shard(tmp_path, 'broken', [l2, bad])
    before = broken.read_bytes()
    recs = CallRecords(tmp_path)
    with pytest.warns(UserWarning, match='line 2'):
        assert recs.get(k1)['text'] == 'a1'        # a call found in an intact line replays: the bad line cannot change it
    assert recs.get(k2)['text'] == 'a2'
    with pytest.raises(RecordsError) as e: recs.get(LLMCache.key(kind='chat', messages='not recorded'))
    msg = str(e.value)     # a call not found might be on the bad line: the run stops, naming the line and the way out
    assert f'{broken}, line 2' in msg and what in msg and 'git checkout' in msg and 'delete that line' in msg
    # a folder with a bad line is never rewritten (that would drop the line): the same error, the file untouched
    with pytest.raises(RecordsError, match='line 2'): recs.read_folder('broken', 'smoke')
    k3, l3 = chat_line('q3', 'a3')
    with pytest.raises(RecordsError, match='line 2'):
        recs.write('broken', 'smoke', {k3: dict(request=json.loads(l3)['request'], value=json.loads(l3)['value'])})
    assert broken.read_bytes() == before
    recs.write('good', 'smoke', {k3: dict(request=json.loads(l3)['request'], value=json.loads(l3)['value'])})  # other folders: fine
    assert CallRecords(tmp_path).read_folder('good', 'smoke').keys() == {k1, k3}


def test_an_unreadable_record_file_is_named_and_blocks_only_misses(tmp_path):
    "Before: one unreadable file raised a RecordsError on every lookup, even of calls recorded in intact files."
    k1, l1 = chat_line('q1', 'a1')
    shard(tmp_path, 'good', [l1])
    bad = tmp_path / 'broken' / 'smoke' / 'calls-all.jsonl.gz'; bad.parent.mkdir(parents=True)
    bad.write_bytes(b'\x1f\x8b truncated')
    recs = CallRecords(tmp_path)
    with pytest.warns(UserWarning): assert recs.get(k1)['text'] == 'a1'
    with pytest.raises(RecordsError, match=str(bad)): recs.get('0' * 64)


def test_an_object_without_a_key_is_a_bad_line(tmp_path):
    k1, l1 = chat_line('q1', 'a1')
    f = shard(tmp_path, 'x', [l1, '{"request": {}, "value": {}}'])
    with pytest.warns(UserWarning): recs = CallRecords(tmp_path); recs.get(k1)
    with pytest.raises(RecordsError, match=f'{f}, line 2'): recs.get('0' * 64)


# ---------------------------------------------------------------- 2. one call, two results
def test_a_call_recorded_with_two_results_names_both_places(tmp_path):
    "Before: the last line read won silently (across folders and within one file)."
    k, first = chat_line('q', 'yes', seconds=0.5)
    _, second = chat_line('q', 'no', seconds=0.5)
    a = shard(tmp_path, 'a', [first])
    b = shard(tmp_path, 'b', [second])
    with pytest.raises(RecordsError) as e: CallRecords(tmp_path).get(k)
    assert f'{a}, line 1' in str(e.value) and f'{b}, line 1' in str(e.value)
    # within one file: both lines named, and the folder is not rewritten over it
    b.unlink()
    k2, other = chat_line('other', 'x')
    one = shard(tmp_path, 'a', sorted([first, second, other]))
    places = sorted([f'{one}, line {i + 1}' for i, l in enumerate(sorted([first, second, other])) if l != other])
    with pytest.raises(RecordsError) as e: CallRecords(tmp_path).get(k)
    assert all(p in str(e.value) for p in places)
    assert CallRecords(tmp_path).get(k2)['text'] == 'x'            # the other calls still replay
    with pytest.raises(RecordsError, match='different results'): CallRecords(tmp_path).read_folder('a', 'smoke')


def test_identical_duplicates_are_fine(tmp_path):
    k, l = chat_line('q', 'yes')
    shard(tmp_path, 'a', [l]); shard(tmp_path, 'b', [l]); shard(tmp_path, 'c', [l, l])
    recs = CallRecords(tmp_path)
    assert recs.get(k)['text'] == 'yes' and len(recs) == 1 and recs.read_folder('c', 'smoke')[k]['value']['text'] == 'yes'


# ---------------------------------------------------------------- 3. a result must answer its request
def _choice_record(tmp_path: Path, edit) -> tuple[Scripted, str]:
    "Record one choice, then rewrite its value with `edit` and a recomputed checksum (a consistent, wrong line)."
    a = Scripted(cache=LLMCache(tmp_path / 'a.sqlite', mode='off'), records=CallRecords(tmp_path / 'none'))
    a.choose('Is the sky blue?', [' yes', ' no'])
    (key, call), = a.ledger.calls.items()
    _, l = line(call['request'], edit(dict(call['value'])))
    shard(tmp_path / 'records', 'demo', [l])
    return Scripted(cache=LLMCache(tmp_path / 'b.sqlite', mode='off'), records=CallRecords(tmp_path / 'records')), key


@pytest.mark.parametrize('edit', [
    lambda v: v | dict(options=[' no', ' yes']),                                        # the options in another order
    lambda v: v | dict(options=[' yes', ' no', ' maybe'], logprobs=[-3.0, -2.0, -0.1], n_tokens=[1, 1, 1]),  # other options
    lambda v: v | dict(logprobs=[-3.0, -2.0, -0.1]),                                    # a log-probability too many
    lambda v: v | dict(n_tokens=[1]),                                                   # a token count too few
], ids=['reordered', 'other-options', 'extra-logprob', 'missing-count'])
def test_a_choice_that_does_not_answer_its_request_is_not_replayed(tmp_path, edit):
    "Before: replayed as it was (its checksum matches), so its `best` could be an option that was never asked."
    b, key = _choice_record(tmp_path, edit)
    c = b.choose('Is the sky blue?', [' yes', ' no'])
    assert (c.source, c.best, b.computed) == ('computed', ' yes', 1)      # recomputed, like a failed checksum ...
    assert b.records.tampered == {key} and b.records.get(key) is None      # ... and counted


def test_a_choice_that_answers_its_request_replays(tmp_path):
    b, key = _choice_record(tmp_path, lambda v: v)
    assert b.choose('Is the sky blue?', [' yes', ' no']).source == 'record' and b.computed == 0 and not b.records.tampered


# ---------------------------------------------------------------- 5. agreement means the same chosen option
def test_same_result_requires_the_same_chosen_option():
    "Before: each option within LOGPROB_TOL was enough, so this pair, whose answer flips, 'agreed'."
    flipped = ({'logprobs': [-0.70, -0.75, -3.0]}, {'logprobs': [-0.76, -0.69, -3.0]})
    assert max(abs(x - y) for x, y in zip(flipped[0]['logprobs'], flipped[1]['logprobs'])) <= calls.LOGPROB_TOL
    assert same_result('choice', *flipped) is False
    assert same_result('choice', {'logprobs': [-0.70, -0.75]}, {'logprobs': [-0.62, -0.80]}) is True   # same choice, close
    assert same_result('choice', {'logprobs': [-1.0, -1.0]}, {'logprobs': [-1.0, -1.0]}) is True       # a tie: the first, both
    assert same_result('choice', {'logprobs': [-1.0, -1.0]}, {'logprobs': [-1.01, -1.0]}) is False
    assert same_result('score', *flipped) is True     # a score's tokens are not alternatives: no choice to flip


def test_fresh_mode_counts_a_flipped_choice_as_differing(tmp_path, monkeypatch):
    "Before: a recomputed choice that picks the other option within the tolerance was not counted in `differs`."
    b, key = _choice_record(tmp_path, lambda v: v | dict(logprobs=[-0.2, -0.1]))   # recorded: ' no'; recomputed: ' yes'
    monkeypatch.setenv('RAG_LAB_RECORDS', 'fresh')
    assert b.choose('Is the sky blue?', [' yes', ' no']).source == 'computed'
    assert b.ledger.differs == {key}


def test_records_verify_flags_a_choice_that_flips(tmp_path, monkeypatch):
    "Before: `rag-lab records verify` (`verify_records`) said this recomputed choice agreed with its record."
    from rag_lab import verify
    b, key = _choice_record(tmp_path, lambda v: v | dict(logprobs=[-0.2, -0.1]))   # recorded: ' no'; recomputed: ' yes'
    monkeypatch.setattr(verify, '_llm_for', lambda request, tmp: Scripted(cache=LLMCache(tmp_path / 'v.sqlite', mode='off'),
                                                                      records=CallRecords(tmp_path / 'none')))
    v = verify.verify_records(5, records=CallRecords(tmp_path / 'records'))
    assert (len(v), bool(v.agree[0]), v.note[0]) == (1, False, "chooses ' yes', its record ' no'")
    assert v.max_abs_diff[0] == pytest.approx(0.1)          # within LOGPROB_TOL: the tolerance alone let it through


# ---------------------------------------------------------------- 6. a cache that cannot be written is not damaged
def _sqlite_error(message: str, code: int) -> sqlite3.OperationalError:
    e = sqlite3.OperationalError(message); e.sqlite_errorcode = code; e.sqlite_errorname = message
    return e


class _NoWrites:
    "A connection whose every write fails as SQLite reports it (ENOSPC: SQLITE_FULL; a read-only folder: SQLITE_READONLY)."
    def __init__(self, conn, error): self.conn, self.error = conn, error
    def execute(self, query, args=()):
        if query.lstrip().split()[0].upper() in ('INSERT', 'CREATE', 'DELETE', 'ALTER', 'UPDATE', 'REPLACE'): raise self.error
        return self.conn.execute(query, args)
    def close(self): self.conn.close()


def _no_writes(monkeypatch, message: str, code: int):
    real = sqlite3.connect
    monkeypatch.setattr(calls.sqlite3, 'connect', lambda *a, **kw: _NoWrites(real(*a, **kw), _sqlite_error(message, code)))


def _never_opened(monkeypatch):
    def boom(*a, **kw): raise AssertionError('the cache was opened')
    monkeypatch.setattr(calls.sqlite3, 'connect', boom)


@pytest.mark.parametrize('message, code, says', [('database or disk is full', sqlite3.SQLITE_FULL, 'full'),
                                                 ('attempt to write a readonly database', sqlite3.SQLITE_READONLY, 'read-only')])
def test_a_cache_that_cannot_be_written_is_not_called_damaged(tmp_path, monkeypatch, message, code, says):
    "Before: LLMCache(path) itself raised 'unreadable ... Delete it' (it creates its table on construction)."
    path = tmp_path / 'llm' / 'calls.sqlite'
    LLMCache(path).put('k', {'text': 'kept'})        # a healthy cache, then a full disk or a read-only folder: SQLite's
    _no_writes(monkeypatch, message, code)            # own error is simulated (tests run as root: chmod stops nothing)
    c = LLMCache(path)
    assert c.get('k') == {'text': 'kept'}             # reading still works
    with pytest.raises(CacheError) as e: c.put('k2', {'text': 'new'})
    msg = str(e.value)
    assert str(path) in msg and says in msg and 'Delete it' not in msg and 'not damaged' in msg
    assert 'RAG_LAB_LLM_CACHE=off' in msg


@pytest.mark.skipif(os.geteuid() == 0, reason='root writes into a 0555 folder: see the simulated test above')
def test_a_read_only_cache_folder_is_not_called_damaged(tmp_path):
    folder = tmp_path / 'llm'
    LLMCache(folder / 'calls.sqlite').put('k', {'text': 'kept'})
    gc.collect()             # its connection closed: SQLite removes the -wal/-shm files it would otherwise still write
    folder.chmod(0o555)
    try:
        with pytest.raises(CacheError) as e: LLMCache(folder / 'calls.sqlite').put('k2', {'text': 'new'})
    finally: folder.chmod(0o755)
    assert 'read-only' in str(e.value) and 'Delete it' not in str(e.value)
    assert LLMCache(folder / 'calls.sqlite').get('k') == {'text': 'kept'}


def test_no_space_for_the_cache_folder_is_not_called_damaged(tmp_path, monkeypatch):
    "Before: a raw OSError from LLMCache(path) (its folder is made on construction)."
    def full(self, *a, **kw): raise OSError(errno.ENOSPC, 'No space left on device', str(self))
    monkeypatch.setattr(Path, 'mkdir', full)
    c = LLMCache(tmp_path / 'new' / 'calls.sqlite')
    with pytest.raises(CacheError) as e: c.put('k', {'text': 'x'})
    assert 'No space left' in str(e.value) and 'Delete it' not in str(e.value)


def test_a_damaged_cache_still_says_delete_it(tmp_path):
    bad = tmp_path / 'calls.sqlite'; bad.write_bytes(b'not a database' * 1000)
    with pytest.raises(CacheError) as e: len(LLMCache(bad))
    assert str(bad) in str(e.value) and 'Delete it' in str(e.value)


def test_a_pure_replay_never_opens_the_cache(tmp_path, monkeypatch):
    "Before: every LLM opened (and created) its cache on construction, so a full disk or a read-only folder stopped a "
    "replay that needs no cache."
    a = Scripted(cache=LLMCache(tmp_path / 'a.sqlite', mode='off'), records=CallRecords(tmp_path / 'none'))
    a.chat('q'); a.choose('Is the sky blue?', [' yes', ' no'])
    CallRecords(tmp_path / 'records').write('demo', 'smoke', a.ledger.calls)
    _never_opened(monkeypatch)
    b = Scripted(cache=LLMCache(tmp_path / 'cache' / 'calls.sqlite'), records=CallRecords(tmp_path / 'records'))
    assert (b.chat('q').source, b.choose('Is the sky blue?', [' yes', ' no']).source, b.computed) == ('record', 'record', 0)
    monkeypatch.setenv('RAG_LAB_LLM_CACHE', 'off')           # cache off: computed calls never touch it either
    c = Scripted(cache=LLMCache(tmp_path / 'cache' / 'calls.sqlite'), records=CallRecords(tmp_path / 'none'))
    assert (c.chat('new').source, c.computed) == ('computed', 1)
    assert not (tmp_path / 'cache').exists()


def test_an_unwritable_cache_root_stops_only_the_calls_that_need_the_cache(tmp_path, monkeypatch):
    "Before: a raw NotADirectoryError/FileExistsError when any LLM was made (the default cache's folder is made first)."
    (tmp_path / 'a-file').write_text('not a folder')
    monkeypatch.setenv('RAG_LAB_CACHE', str(tmp_path / 'a-file' / 'cache'))   # no folder can be made there, even by root
    a = Scripted(cache=LLMCache(tmp_path / 'a.sqlite', mode='off'), records=CallRecords(tmp_path / 'none'))
    a.chat('q')
    CallRecords(tmp_path / 'records').write('demo', 'smoke', a.ledger.calls)
    b = Scripted(records=CallRecords(tmp_path / 'records'))                   # the default cache, under RAG_LAB_CACHE
    assert b.chat('q').source == 'record'
    with pytest.raises(CacheError) as e: b.chat('not recorded')
    assert str(tmp_path / 'a-file') in str(e.value) and 'Delete it' not in str(e.value) and 'RAG_LAB_CACHE' in str(e.value)


def test_records_stats_names_a_damaged_shard_instead_of_a_traceback(tmp_path):
    "`rag-lab records stats` over a folder with a bad line: one message naming the file, exit 2 (it used to print a traceback)."
    import gzip, os, subprocess, sys
    d = tmp_path / 'records' / 'reason_verify' / 'smoke'; d.mkdir(parents=True)
    (d / 'calls-all.jsonl.gz').write_bytes(gzip.compress(b'{not json\n'))
    env = {**os.environ, 'RAG_LAB_RECORDS_DIR': str(tmp_path / 'records')}
    r = subprocess.run([str(Path(sys.executable).parent / 'rag-lab'), 'records', 'stats'], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and 'calls-all.jsonl.gz' in r.stderr and 'Traceback' not in r.stderr, (r.returncode, r.stderr[-800:])


def test_records_prune_only_leaves_other_chapters_in_progress_records(tmp_path, monkeypatch):
    "`rag-lab records prune --only rag2` drops rag2's unused records and keeps verirag's (a recompute under way there)."
    import gzip
    from rag_lab.runner import main
    recs = CallRecords(tmp_path / 'records')
    for slug in ('rag2', 'verirag'):
        used, stale = LLMCache.key(kind='x', slug=slug, n=1), LLMCache.key(kind='x', slug=slug, n=2)
        recs.write(slug, 'default', {k: dict(request=dict(kind='x', slug=slug, n=n), value={'text': 'a'}) for k, n in ((used, 1), (stale, 2))})
        (recs.folder(slug, 'default') / 'used.txt.gz').write_bytes(gzip.compress(f'{used}\n'.encode()))
    monkeypatch.setenv('RAG_LAB_RECORDS_DIR', str(tmp_path / 'records'))
    assert main(['records', 'prune', '--only', 'rag2']) == 0
    after = CallRecords(tmp_path / 'records')
    assert (len(after.read_folder('rag2', 'default')), len(after.read_folder('verirag', 'default'))) == (1, 2)
    with pytest.raises(SystemExit): main(['records', 'prune', '--only', 'nosuchpaper'])
