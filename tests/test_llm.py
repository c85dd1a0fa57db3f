"Tests of rag_lab.llm, rag_lab.calls and rag_lab.models: the three backends, model verification, the call cache, structured output and parsers."
import json, math, multiprocessing as mp, os, shutil, socket, sqlite3, subprocess, sys, time, urllib.request
from pathlib import Path
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

os.environ.setdefault('HF_HUB_OFFLINE', '1')
from conftest import build_tiny_checkpoint
from rag_lab.models import EMBEDDED_MODELS, ModelError, assemble_parts, checkpoint_fingerprint, distribution_data_files, embedded_model_path, verify_model_file
from rag_lab.calls import LLMCache, Ledger
from rag_lab.llm import LLMError, LlamaCppLLM, OpenAILLM, TransformersLLM, chat_structured, get_llm, retry_call
from rag_lab.parsing import ParsedAnswer, extract_json, parse_answer_statement, parse_final_answer, parse_json_verdict
from rag_lab.data import RateLimiter
from rag_lab.config import file_sha256, resolve_params
from pydantic import BaseModel
from typing import Literal

SMOL, QWEN = 'smollm2-135m-instruct-q4_1', 'qwen2.5-coder-0.5b-instruct-q4_k_m'
QUESTION = [{'role': 'user', 'content': 'What is the capital of France? Answer in one sentence.'}]


@pytest.fixture(scope='module')
def smol(tmp_path_factory):
    return LlamaCppLLM(SMOL, n_threads=1, cache=LLMCache(tmp_path_factory.mktemp('c') / 'calls.sqlite'), ledger=Ledger())


# ---------------------------------------------------------------- embedded models and their checksums
def test_qwen_is_assembled_from_its_packages_and_matches_the_release(tmp_path):
    parts = [p for d in EMBEDDED_MODELS[QWEN].distributions for p in distribution_data_files(d)]
    assert [p.name for p in parts] == [f'part0{i}.bin' for i in range(1, 7)]
    joined = assemble_parts(parts, tmp_path / 'q.gguf', EMBEDDED_MODELS[QWEN].sha256)
    assert file_sha256(joined) == '1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32'
    assert file_sha256(embedded_model_path(QWEN)) == EMBEDDED_MODELS[QWEN].sha256
    assert [p.name for p in tmp_path.iterdir()] == ['q.gguf']  # no temp file left behind


def test_tampered_model_is_refused(tmp_path, monkeypatch):
    good = embedded_model_path(SMOL)
    bad = tmp_path / 'tampered.gguf'
    shutil.copyfile(good, bad)
    with open(bad, 'r+b') as f:
        f.seek(123456); b = f.read(1); f.seek(123456); f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(ModelError, match='Refusing'): verify_model_file(bad, EMBEDDED_MODELS[SMOL].sha256)
    with pytest.raises(ModelError, match='Refusing'): LlamaCppLLM(str(bad), sha256=EMBEDDED_MODELS[SMOL].sha256)
    # a tampered file in the model cache is refused too, not silently loaded
    monkeypatch.setenv('RAG_LAB_CACHE', str(tmp_path / 'cache'))
    (tmp_path / 'cache' / 'models').mkdir(parents=True)
    (tmp_path / 'cache' / 'models' / EMBEDDED_MODELS[QWEN].filename).write_bytes(b'GGUF not really')
    with pytest.raises(ModelError, match='sha256 mismatch'): embedded_model_path(QWEN)
    # joining parts that are not the release writes nothing
    with pytest.raises(ModelError, match='Nothing was written'): assemble_parts([good], tmp_path / 'x.gguf', '0' * 64)
    assert not (tmp_path / 'x.gguf').exists() and not list(tmp_path.glob('x.gguf.*'))


def test_missing_package_is_a_clear_error():
    with pytest.raises(ModelError, match='not installed'): distribution_data_files('no-such-package-rag-lab')


# ---------------------------------------------------------------- llama.cpp backend
def test_llamacpp_generates_with_token_counts(smol):
    g = smol.chat(QUESTION, max_tokens=24, cache='off')
    assert 'Paris' in g.text
    assert g.prompt_tokens > 10 and 0 < g.completion_tokens <= 24 and g.finish_reason in ('stop', 'length')
    cut = smol.chat(QUESTION, max_tokens=3, cache='off')
    assert cut.completion_tokens == 3 and cut.finish_reason == 'length'
    stopped = smol.chat(QUESTION, max_tokens=24, stop=['France'], cache='off')
    assert 'France' not in stopped.text


def test_llamacpp_score_matches_an_independent_computation(smol):
    "Scores from the batched logits path equal a log-softmax over llama-cpp-python's logits_all=True scores."
    import numpy as np
    from llama_cpp import Llama
    ctx, cont = 'The capital of France is', ' Paris, a city on the Seine.'
    s = smol.score(ctx, cont, cache='off')
    ref = Llama(model_path=str(smol.path), n_ctx=256, logits_all=True, verbose=False, n_threads=1)
    a = ref.tokenize(ctx.encode(), add_bos=True, special=True); b = ref.tokenize(cont.encode(), add_bos=False)
    ref.eval(a + b)
    logits = ref.scores[:len(a) + len(b)].astype(np.float64)
    logp = logits - logits.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    expected = [logp[len(a) - 1 + i, t] for i, t in enumerate(b)]
    assert s.n_tokens == len(b) and ''.join(s.tokens) == cont
    np.testing.assert_allclose(s.logprobs, expected, atol=2e-3)
    assert math.isclose(s.perplexity, math.exp(-sum(expected) / len(b)), rel_tol=1e-2)


def test_llamacpp_scores_its_own_greedy_answer_above_a_scrambled_one(smol):
    g = smol.chat(QUESTION, max_tokens=16, cache='off')
    own = smol.score(QUESTION, g.text, cache='off')
    scrambled = smol.score(QUESTION, ' '.join(reversed(g.text.split())), cache='off')
    assert ''.join(own.tokens) == g.text
    assert own.perplexity < scrambled.perplexity


def test_determinism_temperature_zero_and_seeded_sampling(smol):
    greedy = {smol.chat(QUESTION, max_tokens=20, cache='off').text for _ in range(2)}
    assert len(greedy) == 1
    hot = lambda seed: smol.chat('Write a line of poetry about rain.', temperature=1.0, seed=seed, max_tokens=20, cache='off').text
    assert hot(7) == hot(7)
    assert len({hot(s) for s in (1, 2, 3)}) > 1  # the seed matters: the test above is not vacuous


# ---------------------------------------------------------------- cache and accounting
def test_cache_hit_keying_refresh_and_identical_tables(tmp_path):
    cache = LLMCache(tmp_path / 'c.sqlite')
    first, second = Ledger(), Ledger()
    llm = LlamaCppLLM(SMOL, n_threads=1, cache=cache, ledger=first)
    prompts = ['Name a colour.', 'Name an animal.']
    with first.experiment('exp'): a = llm.chat_many(prompts, max_tokens=8)
    llm2 = LlamaCppLLM(SMOL, n_threads=1, cache=cache, ledger=second)
    t0 = time.perf_counter()
    with second.experiment('exp'): b = llm2.chat_many(prompts, max_tokens=8)
    assert (time.perf_counter() - t0) / 2 < 0.05
    assert [x.cached for x in a] == [False, False] and [x.cached for x in b] == [True, True]
    assert [x.text for x in a] == [x.text for x in b]
    assert first.summary().equals(second.summary())  # a re-run from the cache gives the same cost table
    assert first.summary().calls.tolist() == [2] and first.summary().total_tokens[0] > 0
    assert first.frame().key.tolist() == second.frame().key.tolist() and first.frame().key.nunique() == 2  # the cache key identifies a call
    assert llm.chat(prompts[0], max_tokens=9).cached is False  # other parameters: another key
    assert llm.chat(prompts[0], max_tokens=8, cache='refresh').cached is False
    assert cache.stats()['hits'] == 2 and len(cache) == 3


def test_cache_mode_from_environment(tmp_path, monkeypatch):
    monkeypatch.setenv('RAG_LAB_LLM_CACHE', 'off')
    c = LLMCache(tmp_path / 'c.sqlite')
    c.put('k', {'v': 1}); assert c.get('k') is None and len(c) == 0
    monkeypatch.setenv('RAG_LAB_LLM_CACHE', 'sometimes')
    with pytest.raises(ValueError, match='RAG_LAB_LLM_CACHE'): LLMCache(tmp_path / 'c.sqlite')   # names the variable


def _writer(path: str, who: int, n: int, start):
    start.wait()
    c = LLMCache(path)
    for i in range(n):
        key = f'shared-{i}' if i < n // 3 else f'w{who}-{i}'  # a third of the keys are written by both
        c.put(key, {'who': who, 'i': i, 'text': 'x' * 500})
        c.get(f'shared-{(i * 7) % (n // 3)}')


def test_cache_survives_two_concurrent_writers(tmp_path):
    path, n = str(tmp_path / 'shared.sqlite'), 300
    LLMCache(path)  # create the table first, as a notebook would
    ctx = mp.get_context('spawn')
    start = ctx.Barrier(2)
    procs = [ctx.Process(target=_writer, args=(path, w, n, start)) for w in (1, 2)]
    for p in procs: p.start()
    for p in procs: p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    con = sqlite3.connect(path)
    assert con.execute('PRAGMA integrity_check').fetchone()[0] == 'ok'
    rows = con.execute('SELECT key, value FROM calls').fetchall()
    assert len(rows) == n // 3 + 2 * (n - n // 3)
    vals = {k: json.loads(v) for k, v in rows}
    assert all(v['who'] in (1, 2) and len(v['text']) == 500 for v in vals.values())
    assert all(vals[f'shared-{i}']['i'] == i for i in range(n // 3))


def test_altered_cache_row_is_detected_recomputed_and_counted(tmp_path):
    cache = LLMCache(tmp_path / 'c.sqlite')
    llm = LlamaCppLLM(SMOL, n_threads=1, cache=cache, ledger=Ledger())
    first = llm.chat('Name a colour.', max_tokens=6)
    con = sqlite3.connect(tmp_path / 'c.sqlite')
    (key, value), = con.execute('SELECT key, value FROM calls').fetchall()
    forged = json.loads(value) | {'text': 'FORGED'}
    con.execute('UPDATE calls SET value = ? WHERE key = ?', (json.dumps(forged), key)); con.commit(); con.close()
    again = llm.chat('Name a colour.', max_tokens=6)
    assert again.text == first.text and again.cached is False   # never trusted: recomputed
    assert cache.stats()['rejected'] == 1
    assert llm.chat('Name a colour.', max_tokens=6).cached is True  # the recomputed row is good again


def test_corrupt_cache_file_is_one_clear_error_naming_it(tmp_path):
    bad = tmp_path / 'calls.sqlite'
    bad.write_bytes(os.urandom(8192))
    with pytest.raises(Exception) as e: len(LLMCache(bad))   # opened on first use (a replay never needs the cache)
    assert type(e.value).__name__ == 'CacheError' and str(bad) in str(e.value) and 'Delete it' in str(e.value)


# ---------------------------------------------------------------- structured output and parsers
class Verdict(BaseModel):
    verdict: Literal['SUPPORTS', 'REFUTES', 'NOT ENOUGH INFO']
    reason: str


CLAIM = 'Claim: "Aspirin reduces fever." Evidence: "Aspirin is an antipyretic drug." Reply with a JSON verdict and a reason.'


def test_structured_output_valid_with_grammar_and_reported_when_not(smol):
    ok = chat_structured(smol, CLAIM, Verdict, max_tokens=96)
    assert ok.status == 'ok' and isinstance(ok.value, Verdict) and ok.attempts == 1
    cut = chat_structured(smol, CLAIM, Verdict, max_tokens=4, max_repairs=2)
    assert (cut.status, cut.value, cut.attempts, len(cut.raw)) == ('unparseable', None, 3, 3)
    assert cut.error


def test_structured_output_free_text_is_repaired_or_reported(smol):
    r = chat_structured(smol, CLAIM, Verdict, json_mode=False, max_tokens=96, max_repairs=2)
    if r.status == 'ok': assert isinstance(r.value, Verdict) and len(r.raw) == r.attempts <= 3
    else: assert r.value is None and r.attempts == 3 and len(r.raw) == 3 and r.error


def test_extract_json_repairs_and_refuses():
    assert extract_json('```json\n{"a": [1, 2,],}\n```') == {'a': [1, 2]}
    assert extract_json("Here: {'verdict': 'SUPPORTS', 'sure': true}. Done.") == {'verdict': 'SUPPORTS', 'sure': True}
    for broken in ['{"a": ', 'no json here', '{"a": 1]']:
        with pytest.raises(ValueError): extract_json(broken)
    for deep in ['[' * 1000 + ']' * 1000, '{"a":' * 2000 + '1' + '}' * 2000]:   # bounded, never a RecursionError
        with pytest.raises(ValueError, match='nested deeper'): extract_json(deep)


def test_parsers_never_default():
    yn = {'A': 'yes', 'B': 'no', 'C': 'maybe'}
    assert parse_final_answer('reasoning...\nFINAL ANSWER: B. no', yn).answer == 'B'
    assert parse_final_answer('FINAL ANSWER: A\nFINAL ANSWER: C. maybe', yn).answer == 'C'
    assert parse_final_answer('**FINAL ANSWER: A. yes**', yn).answer == 'A'
    assert parse_final_answer('ANSWER UNAVAILABLE', yn) == ParsedAnswer(status='unavailable', raw='ANSWER UNAVAILABLE')
    assert parse_final_answer('yes', yn).answer == 'A'   # a reply that is only an option is that option
    for text in ['', 'it could be yes', 'FINAL ANSWER: D. perhaps', 'FINAL ANSWER: B. yes']:
        p = parse_final_answer(text, yn)
        assert p.status == 'unparseable' and p.answer is None, text
    opts = {'A': 'a', 'B': 'b', 'C': 'c', 'D': 'd'}
    assert parse_answer_statement('I think (A) but on reflection the answer is (C).', opts).answer == 'C'
    assert parse_answer_statement('The answer is: D', opts).answer == 'D'
    assert parse_answer_statement('It could be anything.', opts).status == 'unparseable'
    labels = ['SUPPORT', 'CONTRADICT', 'NEI']
    assert parse_json_verdict('{"label": "contradict"}', labels, key='label').answer == 'CONTRADICT'
    assert parse_json_verdict('{"label": "contra', labels, key='label').status == 'unparseable'
    assert parse_json_verdict('["SUPPORT"]', labels).status == 'unparseable'


# ---------------------------------------------------------------- retries and the openai backend
def test_retry_call_backs_off_then_gives_one_clear_error():
    calls = []
    def flaky():
        calls.append(time.perf_counter())
        if len(calls) < 3: raise ConnectionError('reset by peer')
        return 'ok'
    assert retry_call(flaky, 'test call', retries=3, backoff=0.01, retryable=lambda e: 0.0) == 'ok' and len(calls) == 3
    with pytest.raises(LLMError, match='failed after 2 attempts'):
        retry_call(lambda: 1 / 0, 'division', retries=1, backoff=0.01, retryable=lambda e: 0.0)
    with pytest.raises(LLMError, match='division failed: ZeroDivisionError'):  # not retryable: at once
        retry_call(lambda: 1 / 0, 'division', retries=5, backoff=10)


def test_rate_limiter_spaces_requests_across_threads():
    from concurrent.futures import ThreadPoolExecutor
    lim, t0 = RateLimiter(20), time.perf_counter()
    with ThreadPoolExecutor(4) as ex: list(ex.map(lambda _: lim.wait(), range(6)))
    assert time.perf_counter() - t0 >= 5 / 20 - 0.01  # 6 requests at 20/s: at least 5 gaps of 50 ms
    t0 = time.perf_counter(); [RateLimiter(None).wait() for _ in range(100)]; assert time.perf_counter() - t0 < 0.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0)); return s.getsockname()[1]


def test_dead_endpoint_fails_fast_with_a_clear_message(tmp_path):
    port = _free_port()
    llm = OpenAILLM('smollm2', base_url=f'http://127.0.0.1:{port}/v1', timeout=2, retries=2, backoff=0.1,
                    cache=LLMCache(tmp_path / 'c.sqlite'), ledger=Ledger())
    t0 = time.perf_counter()
    with pytest.raises(LLMError) as e: llm.chat('hello')
    assert time.perf_counter() - t0 < 10
    assert 'failed after 3 attempts' in str(e.value) and f'127.0.0.1:{port}' in str(e.value)
    assert len(llm.cache) == 0  # nothing cached for a failed call


def test_openai_without_key_or_base_url_is_a_clear_error(monkeypatch):
    monkeypatch.delenv('OPENAI_API_KEY', raising=False)
    with pytest.raises(LLMError, match='OPENAI_API_KEY'): OpenAILLM('gpt-4o')


@pytest.fixture(scope='module')
def server(tmp_path_factory):
    "A llama.cpp OpenAI-compatible server with SmolLM2 on 127.0.0.1, stopped after the tests."
    port = _free_port()
    log = open(tmp_path_factory.mktemp('server') / 'server.log', 'w+')  # a file, not a pipe: the server logs a lot
    proc = subprocess.Popen([sys.executable, '-m', 'llama_cpp.server', '--model', str(embedded_model_path(SMOL)),
                             '--host', '127.0.0.1', '--port', str(port), '--n_ctx', '2048', '--n_threads', '1',
                             '--model_alias', 'smollm2'],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f'http://127.0.0.1:{port}/v1'
    try:
        deadline = time.time() + 90
        while True:
            if proc.poll() is not None: log.seek(0); pytest.fail(f'llama_cpp.server exited: {log.read()[-2000:]}')
            try:
                with urllib.request.urlopen(url + '/models', timeout=2) as r:
                    if json.load(r)['data']: break
            except OSError: pass
            if time.time() > deadline: pytest.fail('llama_cpp.server did not start within 90 s')
            time.sleep(0.3)
        yield url
    finally:
        proc.terminate()
        try: proc.wait(10)
        except subprocess.TimeoutExpired: proc.kill(); proc.wait()
        log.close()


@pytest.fixture
def remote(server, tmp_path):
    return OpenAILLM('smollm2', base_url=server, timeout=60, retries=1, backoff=0.1, workers=2, schema_format='json_object',
                     cache=LLMCache(tmp_path / 'c.sqlite'), ledger=Ledger())


def test_openai_backend_generates_like_the_embedded_model(remote, smol):
    g = remote.chat(QUESTION, max_tokens=24)
    assert 'Paris' in g.text and g.prompt_tokens > 10 and 0 < g.completion_tokens <= 24
    assert remote.chat(QUESTION, max_tokens=24, cache='off').text == g.text  # temperature 0: deterministic
    assert g.text == smol.chat(QUESTION, max_tokens=24, cache='off').text    # same GGUF, same template, greedy
    assert remote.chat(QUESTION, max_tokens=24).cached


def test_openai_backend_concurrent_batch_and_json_mode(remote):
    prompts = ['Name a colour.', 'Name an animal.', 'Name a country.']
    together = remote.chat_many(prompts, max_tokens=10)
    one_by_one = [remote.chat(p, max_tokens=10, cache='off') for p in prompts]
    assert [g.text for g in together] == [g.text for g in one_by_one]
    r = chat_structured(remote, CLAIM, Verdict, max_tokens=96)
    assert r.status == 'ok' and isinstance(r.value, Verdict)
    s = remote.ledger.summary()
    assert s.calls.sum() == 6 + r.attempts and s.prompt_tokens.sum() > 0


def test_scoring_on_llama_cpp_python_server_is_refused_naming_the_alternative(remote, server, tmp_path):
    "Its echoed log-probabilities are shifted by one token (abetlen/llama-cpp-python#1983): refused before any request, not wrong numbers."
    with pytest.raises(LLMError, match=r"shifted by one token.*backend='llamaserver'"):
        remote.score('The capital of France is', ' Paris, a city on the Seine.')
    assert remote.server_kind() == 'llama-cpp-python' and remote.ledger.frame().query("kind == 'score'").empty
    from rag_lab.llm import LlamaServerLLM
    with pytest.raises(LLMError, match="is llama-cpp-python's server .* not llama.cpp's llama-server"):
        LlamaServerLLM('smollm2', base_url=server, cache=LLMCache(tmp_path / 'c.sqlite'), ledger=Ledger())


# ---------------------------------------------------------------- transformers backend
@pytest.fixture(scope='module')
def tiny_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp('ckpt') / 'tiny')


def test_transformers_generates_in_batches_and_scores(tiny_dir, tmp_path):
    import torch
    llm = TransformersLLM(str(tiny_dir), cache=LLMCache(tmp_path / 'c.sqlite'), ledger=Ledger(), batch_size=4)
    prompts = ['what is the capital of france', 'the answer is', 'aspirin reduces fever']
    batched = llm.chat_many(prompts, max_tokens=5)
    alone = [llm.chat(p, max_tokens=5, cache='off') for p in prompts]
    assert [g.text for g in batched] == [g.text for g in alone]  # left padding does not change greedy outputs
    assert all(0 < g.completion_tokens <= 5 and g.prompt_tokens >= 5 for g in batched)
    assert [g.prompt_tokens for g in batched] == [g.prompt_tokens for g in alone]
    s = llm.score('the answer is', ' yes no maybe', cache='off')
    ids = llm.tok('the answer is yes no maybe', return_tensors='pt')['input_ids']
    with torch.no_grad(): lp = torch.log_softmax(llm.net(ids).logits[0], -1)
    n_ctx = len(llm.tok('the answer is')['input_ids'])
    expected = [float(lp[n_ctx - 1 + i, ids[0, n_ctx + i]]) for i in range(3)]
    assert s.tokens == [' yes', ' no', ' maybe']
    assert all(abs(a - b) < 1e-4 for a, b in zip(s.logprobs, expected))
    msgs = [{'role': 'user', 'content': 'what is the capital of france'}]
    assert llm.render(msgs).endswith('<|im_start|> assistant ')
    assert llm.score(msgs, ' paris').n_tokens == 1
    from rag_lab.papers.reason_verify import unique_calls
    # a batch shares one compute time per call: distinct calls are told apart by their cache keys, not their counts
    assert len(unique_calls(llm.ledger.frame().loc[lambda d: d.kind == 'chat'])) == len(prompts)


def test_transformers_scores_a_choice_in_one_batched_forward_pass(tiny_dir, tmp_path):
    llm = TransformersLLM(str(tiny_dir), cache=LLMCache(tmp_path / 'c.sqlite'), ledger=Ledger())
    options = [' yes', ' no maybe', ' a b c']   # 1, 2 and 3 tokens: the batch is right-padded
    passes = []
    hook = llm.net.register_forward_hook(lambda *_: passes.append(1))
    try:
        for ctx in ['the answer is', [{'role': 'user', 'content': 'what is the capital of france'}]]:
            passes.clear()
            c = llm.choose(ctx, options, prefix=' final answer', cache='off')
            assert len(passes) == 1   # one forward pass for the three options
            text = llm.render(ctx) + ' final answer'   # choose renders a string prompt as a user message too
            singles = [llm.score(text, o, cache='off') for o in options]   # one pass each, no padding
            assert c.n_tokens == [s.n_tokens for s in singles] == [1, 2, 3]
            assert c.context_tokens == singles[0].context_tokens
            assert max(abs(a - s.total_logprob) for a, s in zip(c.logprobs, singles)) < 1e-5
    finally: hook.remove()
    with pytest.raises(ValueError, match='has no tokens'): llm._choose('the answer is', '', [' yes', ''])


def test_transformers_fingerprint_tracks_the_weights(tiny_dir, tmp_path):
    other = build_tiny_checkpoint(tmp_path / 'other', seed=1)
    assert checkpoint_fingerprint(tiny_dir) == checkpoint_fingerprint(tiny_dir)
    assert checkpoint_fingerprint(tiny_dir) != checkpoint_fingerprint(other)


def test_transformers_missing_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ModelError, match='could not load'): TransformersLLM(str(tmp_path / 'nothing-here'))


# ---------------------------------------------------------------- choosing a backend
def test_get_llm_maps_notebook_parameters(tiny_dir, tmp_path):
    cache = LLMCache(tmp_path / 'c.sqlite')
    params = resolve_params('rag2', 'smoke')
    smoke = get_llm(params, cache=cache, n_threads=1)
    assert isinstance(smoke, LlamaCppLLM) and smoke.model == params.model == SMOL
    assert (smoke.defaults.max_tokens, smoke.defaults.temperature, smoke.defaults.seed) == (params.max_tokens, params.temperature, params.seed)
    assert smoke.fingerprint == f'sha256:{EMBEDDED_MODELS[SMOL].sha256}'
    tf = get_llm(backend='transformers', model=str(tiny_dir), cache=cache)
    assert isinstance(tf, TransformersLLM) and tf.fingerprint.startswith('sha256:')
    api = get_llm(resolve_params('verirag', 'paper'), base_url='http://127.0.0.1:9/v1', cache=cache)
    assert isinstance(api, OpenAILLM) and api.model == 'gpt-4o' and api.fingerprint == 'http://127.0.0.1:9/v1|gpt-4o'
    with pytest.raises(ValueError, match='unknown backend'): get_llm(backend='vllm')
    with pytest.raises(ValueError, match='only for backend'): get_llm(model=SMOL, base_url='http://x/v1')


# ---------------------------------------------------------------- scored answers, prefix reuse, records
QWEN15 = 'qwen2.5-coder-1.5b-instruct-q4_k_m'
EVIDENCE = ("Aspirin irreversibly inhibits cyclooxygenase-1 and -2, lowering prostaglandin synthesis. In randomised "
            "trials low-dose aspirin reduced the risk of a first myocardial infarction but increased major bleeding. ") * 6


def _clear_kv(llm):
    llm.llama.reset(); llm.llama._ctx.kv_cache_seq_rm(-1, 0, -1)


@pytest.fixture(scope='module')
def qwen_k(tmp_path_factory):
    "Qwen2.5-Coder-0.5B, Q4_K_M: the default generator's architecture, chat template and quantisation at a third of its size."
    return LlamaCppLLM(QWEN, n_threads=1, cache=LLMCache(tmp_path_factory.mktemp('c') / 'calls.sqlite'), ledger=Ledger())


def test_choice_with_prefix_reuse_matches_separate_full_scoring_and_is_faster(qwen_k):
    "One prefill shared by 4 options gives the same log-probabilities as 4 full scoring passes, at least 2x faster."
    msgs = [{'role': 'user', 'content': f'{EVIDENCE}\nQuestion: does aspirin increase bleeding? Answer yes, no or maybe.'}]
    options = [' yes', ' no', ' maybe', ' it depends on the dose']
    prefix = 'Answer:'
    ctx = qwen_k.render(msgs) + prefix
    t0 = time.perf_counter(); separate = []
    for o in options:
        _clear_kv(qwen_k)                       # each option scored from scratch: no reuse at all
        separate.append(qwen_k.score(ctx, o, cache='off').total_logprob)
    t_separate = time.perf_counter() - t0
    _clear_kv(qwen_k)
    t0 = time.perf_counter(); ch = qwen_k.choose(msgs, options, prefix=prefix, cache='off'); t_choice = time.perf_counter() - t0
    assert ch.best == options[max(range(4), key=separate.__getitem__)]
    assert ch.logprobs == pytest.approx(separate, abs=1e-6)   # aligned prefill: bit-identical, not just close
    assert ch.n_tokens[:3] == [1, 1, 1] and ch.n_tokens[3] > 1 and ch.context_tokens > 300
    assert t_separate / t_choice >= 2, (t_separate, t_choice)


def test_results_do_not_depend_on_earlier_calls(qwen_k):
    "Prefix reuse is exact: a call gives the same result fresh, after an unrelated call, and after a call sharing its prefix."
    q = [{'role': 'user', 'content': f'{EVIDENCE}\nIn one sentence: what does aspirin inhibit?'}]
    other = [{'role': 'user', 'content': 'Name three primary colours.'}]
    sibling = [{'role': 'user', 'content': f'{EVIDENCE}\nIn one sentence: what does aspirin increase?'}]
    runs = []
    for before in (None, other, sibling):
        _clear_kv(qwen_k)
        if before: qwen_k.chat(before, max_tokens=12, cache='off')
        runs.append((qwen_k.chat(q, max_tokens=24, cache='off').text,
                     qwen_k.choose(q, [' COX', ' platelets', ' bleeding'], prefix='Aspirin inhibits', cache='off').logprobs))
    assert runs[0] == runs[1] == runs[2]


def test_choose_refuses_bad_options(smol):
    for bad in ([' yes'], [' yes', ' yes'], [' yes', '']):
        with pytest.raises(ValueError, match='distinct'): smol.choose('Question?', bad)


def test_records_replay_tamper_and_fresh_mode(tmp_path, monkeypatch):
    from rag_lab.calls import CallRecords
    recs = CallRecords(tmp_path / 'records')
    make = lambda: LlamaCppLLM(SMOL, n_threads=1, cache=LLMCache(tmp_path / f'c{time.time_ns()}.sqlite'), ledger=Ledger(), records=recs)
    a = make()
    g = a.chat('Name a colour.', max_tokens=6); c = a.choose('Is the sky blue? Answer:', [' yes', ' no'])
    assert (g.source, c.source) == ('computed', 'computed')
    recs.write('demo', 'smoke', a.ledger.calls)
    # a fresh checkout: empty cache, the records replay every call
    b = make()
    assert b.chat('Name a colour.', max_tokens=6).source == 'record' and b.choose('Is the sky blue? Answer:', [' yes', ' no']).source == 'record'
    assert b.ledger.sources() == dict(record=2, cache=0, computed=0, distinct=2, differs_from_record=0)
    # a tampered line is never replayed: the call is computed again and the tampering is reported
    f = next((tmp_path / 'records' / 'demo' / 'smoke').glob('calls-*.jsonl.gz'))
    import gzip as gz
    lines = gz.decompress(f.read_bytes()).decode().splitlines()
    forged = [l.replace(g.text.replace('"', '\\"'), 'FORGED') if '"chat"' in l else l for l in lines]
    assert forged != lines
    f.write_bytes(gz.compress(('\n'.join(forged) + '\n').encode()))
    t = LlamaCppLLM(SMOL, n_threads=1, cache=LLMCache(tmp_path / 't.sqlite'), ledger=Ledger(), records=CallRecords(tmp_path / 'records'))
    again = t.chat('Name a colour.', max_tokens=6)
    assert again.source == 'computed' and again.text == g.text and len(t.records.tampered) == 1
    # fresh mode: records are not read; a computed result that differs from its record is counted
    monkeypatch.setenv('RAG_LAB_RECORDS', 'fresh')
    recs2 = CallRecords(tmp_path / 'records')
    req_key = next(iter(k for k, v in a.ledger.calls.items() if v['request']['kind'] == 'choice'))
    changed = {req_key: dict(request=a.ledger.calls[req_key]['request'],
                             value=a.ledger.calls[req_key]['value'] | {'logprobs': [0.0, -50.0]})}
    recs2.write('demo', 'smoke', changed)
    f2 = make(); f2.records = CallRecords(tmp_path / 'records')
    assert f2.choose('Is the sky blue? Answer:', [' yes', ' no']).source == 'computed'
    assert f2.ledger.differs == {req_key}


def test_a_records_request_reproduces_its_json_schema_output(tmp_path):
    "The grammar emits an object's fields in its schema's property order. The key and the stored request used to "
    "sort dict keys, so they lost that order: `records verify` found 4 of 12 structured calls differing only in field "
    "order. The schema now travels as JSON text: order is part of the key, and a record's request reproduces its output."
    from rag_lab.calls import CallRecords
    from rag_lab.llm import GenConfig
    class Flags(BaseModel):
        relevant: bool
        support: Literal['explicit', 'implicit', 'none']
        logical: bool
    schema = Flags.model_json_schema()
    reordered = dict(schema, properties=dict(reversed(list(schema['properties'].items()))))
    msgs = [{'role': 'user', 'content': 'Is the sky blue? Give the flags as JSON.'}]
    smol = LlamaCppLLM(SMOL, n_threads=1, cache=LLMCache(tmp_path / 'calls.sqlite'), ledger=Ledger())
    first = smol.chat(msgs, json_schema=schema, max_tokens=40, cache='off')
    (key, call), = smol.ledger.calls.items()
    assert list(json.loads(first.text)) == ['relevant', 'support', 'logical']
    other = smol.chat(msgs, json_schema=reordered, max_tokens=40, cache='off')
    assert list(json.loads(other.text)) == ['logical', 'support', 'relevant'] and len(smol.ledger.calls) == 2   # another key
    recs = CallRecords(tmp_path / 'records')
    recs.write('t', 'smoke', {key: call})
    stored = recs.read_folder('t', 'smoke')[key]['request']   # what `records verify` recomputes from
    cfg = {f: stored[f] for f in GenConfig.model_fields if f in stored}
    assert list(GenConfig(**cfg).json_schema['properties']) == ['relevant', 'support', 'logical']
    assert smol.chat(stored['messages'], **cfg, cache='off').text == first.text


# ---------------------------------------------------------------- greedy decoding under a grammar
def test_greedy_grammar_sampler_decodes_the_same_tokens_as_llama_cpp(tmp_path):
    "The shortlist-first sampler is an optimisation only: on the papers' own schemas it writes llama.cpp's exact tokens."
    from rag_lab.papers.verirag import ClaimFeatures, ProbeAnswer, selfrag_schema
    from rag_lab.papers.pubmed_reasoner import Critique
    llm = LlamaCppLLM(QWEN, n_threads=1, cache=LLMCache(tmp_path / 'calls.sqlite'), ledger=Ledger())
    ll = llm.llama
    asks = [(ClaimFeatures, 'Describe the claim "Statins lower LDL cholesterol by 30% in adults" as JSON.'),
            (ProbeAnswer, 'Does aspirin reduce fever? Answer as JSON with a one-sentence justification.'),
            (Critique, 'Critique the PubMed search terms 1. aspirin 2. fever 3. children for "does aspirin reduce fever '
                       'in children?" as JSON.'),
            (selfrag_schema(2), 'Passage 1: aspirin inhibits COX. Passage 2: the sky is blue. Critique each passage for '
                                'the claim "aspirin lowers fever" as JSON.')]
    masks = tokens = 0
    for schema, q in asks:
        ask = dict(messages=[{'role': 'user', 'content': q}], temperature=0, max_tokens=64, seed=0,
                   response_format={'type': 'json_object', 'schema': schema.model_json_schema()})
        out = {}
        for first in (True, False):
            ll.greedy_grammar_first = first; ll.reset()
            out[first] = ll.create_chat_completion(**ask)['choices'][0]['message']['content']
        ll.greedy_grammar_first = True
        assert out[True] == out[False], schema.__name__
        masks += ll.last_grammar_sampler.full_masks; tokens += ll.last_grammar_sampler.tokens
    assert tokens > 150 and masks < tokens / 3, (masks, tokens)   # the point of it: most tokens skip the full mask
    # the library path uses it: a structured call decodes with this sampler
    ll.last_grammar_sampler = None
    r = chat_structured(llm, 'Does aspirin reduce fever? Answer as JSON.', ProbeAnswer, max_tokens=48)
    assert ll.last_grammar_sampler is not None and ll.last_grammar_sampler.tokens > 0, r


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), state=st.sampled_from(['', '{"a": "']),
       case=st.sampled_from(['top allowed', 'tie among allowed', 'beyond shortlist', 'tie at the shortlist edge', 'nothing allowed']))
def test_greedy_grammar_pick_is_the_masked_argmax_even_with_ties(smol, seed, state, case):
    "Whatever the logits (ties, the best allowed token far down, none allowed), the pick is the first maximum after masking."
    from llama_cpp import LlamaGrammar, llama_sampler_accept
    from rag_lab.llm import GreedyGrammarSampler
    g = LlamaGrammar.from_json_schema(json.dumps({'type': 'object', 'properties': {'a': {'type': 'string'}}, 'required': ['a']}), verbose=False)
    s = GreedyGrammarSampler(smol.llama, g)
    for t in smol.llama.tokenize(state.encode(), add_bos=False, special=False): llama_sampler_accept(s.grammar, t)
    n, rng = s.n_vocab, np.random.default_rng(seed)
    allowed = np.flatnonzero(_allowed_mask(s, np.zeros(n, dtype=np.float32)))   # start: 2 tokens; in a string: most of them
    refused = np.setdiff1d(np.arange(n), allowed)
    logits = rng.normal(0, 1, n).astype(np.float32)
    if case == 'tie among allowed':      # the best refused token on top; several allowed ones share the next value
        logits[rng.choice(refused)] = 10; logits[rng.choice(allowed, min(3, len(allowed)), replace=False)] = 9
    elif case == 'beyond shortlist':     # 200 refused tokens above every allowed one
        logits[allowed] -= 20; logits[rng.choice(refused, 200, replace=False)] = 5
    elif case == 'tie at the shortlist edge':   # hundreds of tokens share the value at the shortlist's last place
        logits[rng.choice(refused, 10, replace=False)] = 10
        logits[rng.choice(refused, 100, replace=False)] = 3
        logits[rng.choice(allowed, min(300, len(allowed)), replace=False)] = 3
        logits[(logits > 3) & (logits < 10)] = 2
    elif case == 'nothing allowed':      # every allowed token at -inf: llama.cpp then takes the first maximum, token 0
        logits[allowed] = -np.inf
    assert s.pick(logits.copy()) == _masked_reference(s, logits), case
    s.close()


def _allowed_mask(s, logits):
    full = np.zeros(s.n_vocab, dtype=[('id', np.int32), ('logit', np.float32), ('p', np.float32)])
    full['id'], full['logit'] = np.arange(s.n_vocab), logits
    s._apply(full.ctypes.data, s.n_vocab)
    return full['logit'] != -np.inf


def _masked_reference(s, logits):
    "llama.cpp's own chain: grammar over the whole vocabulary, then greedy (the first maximum)."
    return int(np.argmax(np.where(_allowed_mask(s, logits), logits, -np.inf)))


def test_a_replay_never_loads_the_model_nor_needs_llama_cpp(tmp_path, monkeypatch):
    "`make reproduce` installs no llama-cpp-python: recorded calls replay without it; a call to compute names `make install`."
    import sys
    from rag_lab import llm as llm_mod
    from rag_lab.calls import CallRecords
    recs = CallRecords(tmp_path / 'records')
    a = LlamaCppLLM(SMOL, n_threads=1, cache=LLMCache(tmp_path / 'a.sqlite'), ledger=Ledger(), records=recs)
    g = a.chat('Name a colour.', max_tokens=6)
    recs.write('demo', 'smoke', a.ledger.calls)
    monkeypatch.setitem(sys.modules, 'llama_cpp', None)   # as if llama-cpp-python were not installed: importing it fails
    llm_mod._load_llama.cache_clear()
    b = LlamaCppLLM(QWEN15, n_threads=1, cache=LLMCache(tmp_path / 'b.sqlite'),
                    ledger=Ledger(), records=CallRecords(tmp_path / 'records'))
    assert b._llama is None and b._path is None   # nothing loaded, not even the GGUF assembled
    c = LlamaCppLLM(SMOL, n_threads=1, cache=LLMCache(tmp_path / 'c.sqlite'), ledger=Ledger(), records=CallRecords(tmp_path / 'records'))
    r = c.chat('Name a colour.', max_tokens=6)
    assert (r.source, r.text, c._llama) == ('record', g.text, None)
    with pytest.raises(ModelError, match='make install'): c.chat('Name a fruit.', max_tokens=6)
