"""The `llamaserver` backend against a real llama.cpp server on 127.0.0.1: llama-server built from the llama.cpp sources
the pinned llama-cpp-python sdist vendors (tools/build_llama_server.sh, cached under .cache/llama-server; `make
llama-server` builds it before the suite), serving the smoke GGUF. Parity with the local llamacpp backend on 24 scored
calls, structured output, requests in flight through `map_calls`, and `rag-lab check-server`."""
import json, os, time
from pathlib import Path
import pytest
from pydantic import BaseModel
from typing import Literal

from rag_lab.calls import CallRecords, LLMCache, Ledger, map_calls
from rag_lab.config import LLMParams, SMOKE_LLM
from rag_lab.llm import LLMError, LlamaCppLLM, LlamaServerLLM, chat_structured, get_llm
from rag_lab.models import EMBEDDED_MODELS, embedded_model_path
from rag_lab.server import LlamaServer, LlamaServerProcess, ServerError, SlotWatch, probe_server

SMOL = SMOKE_LLM['model']
IN_FLIGHT_NATS = 0.5   # nats: calls computed beside others round differently (tests/test_chapters_over_server.py's BATCHED_NATS)
TOL = 1e-3   # nats: the parity the issue asks for (llama.cpp's logits change slightly with how tokens are batched)


@pytest.fixture(scope='module')
def served(llama_server_bin, tmp_path_factory):   # llama_server_bin (conftest): built once, or the module skipped
    log = tmp_path_factory.mktemp('srv') / 'llama-server.log'
    with LlamaServerProcess(embedded_model_path(SMOL), parallel=4, n_ctx=2048, alias='smollm2', log=log) as p:
        yield p


@pytest.fixture(scope='module')
def local(tmp_path_factory):
    return LlamaCppLLM(SMOL, n_threads=1, cache=LLMCache(tmp_path_factory.mktemp('c') / 'calls.sqlite'), ledger=Ledger())


@pytest.fixture
def remote(served, tmp_path):
    return LlamaServerLLM('smollm2', base_url=served.base_url, timeout=120, retries=1, backoff=0.1,
                          cache=LLMCache(tmp_path / 'c.sqlite'), ledger=Ledger())


QUESTIONS = ['Is aspirin an anti-inflammatory drug?', 'Does smoking cause lung cancer?', 'Is the Earth flat?',
             'Can vitamin C cure the common cold?', 'Is water made of hydrogen and oxygen?',
             'Does regular exercise lower blood pressure?', 'Is Paris the capital of Germany?', 'Do antibiotics kill viruses?']
OPTIONS = {'A': 'yes', 'B': 'no', 'C': 'maybe'}


def _calls(llm):
    "24 scored calls of the kinds the chapters make: key choices after a prefix, word choices, multi-token options, scores."
    out = []
    for q in QUESTIONS:
        mcq = f"{q}\nA. yes\nB. no\nC. maybe\nAnswer with the letter."
        out.append(('choose_option', llm.choose_option(mcq, OPTIONS, prefix='Answer:', cache='off').logprobs))
        c = llm.choose([{'role': 'system', 'content': 'You are a careful biomedical assistant.'}, {'role': 'user', 'content': q}],
                       [' yes', ' no', ' it depends on the evidence'], prefix='FINAL ANSWER:', cache='off')
        out.append(('choose', dict(zip(c.options, c.logprobs)) | {'n_tokens': c.n_tokens, 'context_tokens': c.context_tokens}))
        s = llm.score([{'role': 'user', 'content': q}], ' The evidence says yes, with some caveats.', cache='off')
        out.append(('score', {'logprobs': s.logprobs, 'tokens': s.tokens, 'context_tokens': s.context_tokens}))
    return out


def test_probe_tells_the_server_apart_and_reads_what_it_serves(served):
    info = probe_server(served.base_url)
    assert (info.kind, info.slots, info.n_ctx) == ('llama.cpp', 4, 2048)
    assert Path(info.model_path).resolve() == embedded_model_path(SMOL).resolve()
    with pytest.raises(ServerError, match='failed after 2 attempts'): probe_server('http://127.0.0.1:9/v1', timeout=1, retries=1, backoff=0.01)


def test_prompts_and_options_are_the_local_backend_tokens(remote, local):
    msgs = [{'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Is water wet?'}]
    assert remote.render(msgs) == local.render(msgs)   # the server's template renders what llama-cpp-python's jinja does
    assert remote._tokens(msgs, 'Answer:') == local._tokens(msgs, 'Answer:')
    for o in [' A', ' yes', ' it depends on the evidence', 'Paris']:
        assert remote.server.tokenize(o, special=False) == local.llama.tokenize(o.encode(), add_bos=False, special=False)


def test_scored_calls_agree_with_the_local_backend_within_1e_3_nats(remote, local):
    t0 = time.perf_counter(); far = _calls(remote); secs = time.perf_counter() - t0
    near = _calls(local)
    assert len(far) == len(near) == 24
    worst, answers = 0.0, 0
    for (kind, a), (_, b) in zip(far, near):
        if kind == 'score':
            assert (a['tokens'], a['context_tokens'], len(a['logprobs'])) == (b['tokens'], b['context_tokens'], len(b['logprobs']))
            diffs = [abs(x - y) for x, y in zip(a['logprobs'], b['logprobs'])]
        else:
            if kind == 'choose': assert (a.pop('n_tokens'), a.pop('context_tokens')) == (b.pop('n_tokens'), b.pop('context_tokens'))
            assert max(a, key=a.get) == max(b, key=b.get)   # the same answer, exactly
            answers += 1
            diffs = [abs(a[k] - b[k]) for k in a]
        worst = max(worst, *diffs)
    print(f"\nparity over {len(far)} calls ({answers} answers): largest |Δ log-prob| = {worst:.2e} nats; {secs:.1f} s over the server")
    assert worst <= TOL, f"largest log-probability difference {worst:.2e} > {TOL}"
    assert remote.server.fallbacks == 0   # every continuation scored on its slot's prompt cache, none the slow way


def test_a_long_rationale_after_a_long_prompt_agrees_and_costs_about_two_prefills(remote, local):
    "RAG²'s ΔPPL label: ~100 tokens scored after a ~600-token prompt, per token as the local backend, two prefills not 100."
    from rag_lab.server import score_plan
    msgs = [{'role': 'user', 'content': EVIDENCE * 7 + '\nWhat does aspirin inhibit?'}]
    rationale = ' Aspirin inhibits cyclooxygenase-1 and -2, so prostaglandin synthesis falls; the evidence above says so.' * 4
    t0 = time.perf_counter(); a = remote.score(msgs, rationale, cache='off'); secs = time.perf_counter() - t0
    b = local.score(msgs, rationale, cache='off')
    assert (a.tokens, a.context_tokens) == (b.tokens, b.context_tokens) and a.context_tokens > 500 and len(a.tokens) > 90
    worst = max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs))
    n_eval = sum(p - r for chain in score_plan(a.context_tokens, len(a.tokens)) for p, r in chain)
    print(f"\n{len(a.tokens)} tokens after {a.context_tokens}: largest |Δ log-prob| = {worst:.2e} nats; {secs:.1f} s, "
          f"{n_eval} tokens evaluated (a whole prompt per token: {sum(a.context_tokens + i for i in range(len(a.tokens)))})")
    assert worst <= TOL and remote.server.fallbacks == 0
    assert n_eval <= 2 * (a.context_tokens + len(a.tokens))


def test_structured_output_over_the_server(remote):
    class Verdict(BaseModel):
        verdict: Literal['SUPPORTS', 'REFUTES', 'NOT ENOUGH INFO']
        reason: str
    r = chat_structured(remote, 'Claim: "Aspirin reduces fever." Evidence: "Aspirin is an antipyretic drug." '
                                'Reply with a JSON verdict and a reason.', Verdict, max_tokens=96, max_repairs=0)
    assert r.status == 'ok' and isinstance(r.value, Verdict), r   # the json_schema form, decoded by the server's grammar
    assert remote.schema_format == 'json_schema'
    # a schema the server enforces: without it the 135M model's answer to this prompt is not this JSON
    schema = {'type': 'object', 'properties': {'n': {'type': 'integer', 'minimum': 10, 'maximum': 12}}, 'required': ['n'], 'additionalProperties': False}
    g = remote.chat('Pick a number.', json_schema=schema, max_tokens=64)
    assert 10 <= json.loads(g.text)['n'] <= 12


EVIDENCE = "Aspirin irreversibly inhibits cyclooxygenase-1 and -2, lowering prostaglandin synthesis. " * 4


def test_four_requests_in_flight_with_results_and_ledger_as_sequential(served, remote, tmp_path):
    "map_calls keeps 4 items in flight (the server's 4 slots all computing at once); keys and ledger rows as sequential, log-probabilities within the in-flight bound."
    prompts = [f"{EVIDENCE}\n{q}\nA. yes\nB. no\nC. maybe" for q in QUESTIONS]
    t0 = time.perf_counter()
    with SlotWatch(served.base_url) as watch:   # the server's own view: how many of its slots are computing a request
        with remote.ledger.experiment('stage'), remote.ledger.trace() as keys:
            together = map_calls(lambda p: remote.choose_option(p, OPTIONS, prefix='Answer:'), prompts, workers=4,
                                 timeout=600, ledger=remote.ledger)
    wall4 = time.perf_counter() - t0
    busy = watch.busy
    seq = LlamaServerLLM('smollm2', base_url=served.base_url, cache=LLMCache(tmp_path / 'seq.sqlite'), ledger=Ledger())
    t0 = time.perf_counter()
    with seq.ledger.experiment('stage'), seq.ledger.trace() as seq_keys:
        alone = map_calls(lambda p: seq.choose_option(p, OPTIONS, prefix='Answer:'), prompts, workers=1, ledger=seq.ledger)
    wall1 = time.perf_counter() - t0
    print(f"\nin flight: up to {max(busy, default=0)} of 4 slots busy ({len(busy)} polls); 8 choices in {wall4:.1f} s "
          f"with 4 workers, {wall1:.1f} s with 1 (one server thread on this CPU: no speed-up to expect)")
    assert max(busy, default=0) == 4
    # in flight, a call's tokens after the prefix its slot reused are batched beside other slots' tokens and round
    # differently (up to 0.15 nats measured on this 135M model, 2026-12-03); one at a time the numbers are exact
    # (test_scored_calls_agree_with_the_local_backend_within_1e_3_nats), so in flight: the in-flight bound, and the same
    # answers off near ties
    assert all(abs(a.logprobs[k] - b.logprobs[k]) <= IN_FLIGHT_NATS for a, b in zip(together, alone) for k in OPTIONS)
    for a, b in zip(together, alone):
        top = sorted(b.logprobs.values(), reverse=True)
        if top[0] - top[1] > 2 * IN_FLIGHT_NATS: assert a.answer == b.answer, (a.logprobs, b.logprobs)
    assert keys == seq_keys and list(remote.ledger.calls) == list(seq.ledger.calls)   # the same calls in the same order
    cols = ['experiment', 'kind', 'key', 'prompt_tokens', 'source']
    assert remote.ledger.frame()[cols].equals(seq.ledger.frame()[cols])


def test_anything_else_is_refused_before_any_work(served, tmp_path):
    store = dict(cache=LLMCache(tmp_path / 'c.sqlite'), ledger=Ledger())
    with pytest.raises(LLMError, match="failed after 1 attempts"): LlamaServerLLM('m', base_url='http://127.0.0.1:9/v1', retries=0, **store)
    with pytest.raises(ValueError, match='needs base_url'): LlamaServerLLM('m', **store)
    p = LLMParams(backend='llamaserver', model='smollm2', base_url=served.base_url, answer_mode='scored')
    assert isinstance(get_llm(p, **store), LlamaServerLLM)   # the parameters of a scored run validate for this backend
    with pytest.raises(ValueError, match="backend 'openai' cannot score"):
        LLMParams(backend='openai', model='smollm2', base_url=served.base_url, answer_mode='scored')
    with pytest.raises(LLMError, match="use backend='llamaserver'"):   # the OpenAI API of llama-server has no prompt log-probs
        get_llm(backend='openai', model='smollm2', base_url=served.base_url, **store).score('The sky is', ' blue')


def test_check_server_recomputes_records_and_reports_the_largest_difference(served, local, tmp_path, capsys):
    from rag_lab.runner import check_server_command
    recs = CallRecords(tmp_path / 'records')
    led = Ledger()
    m = LlamaCppLLM(SMOL, n_threads=1, cache=LLMCache(tmp_path / 'c.sqlite'), ledger=led, records=recs)
    for q in QUESTIONS[:3]: m.choose_option(f"{q}\nA. yes\nB. no\nC. maybe", OPTIONS, prefix='Answer:')
    m.score([{'role': 'user', 'content': QUESTIONS[0]}], ' Yes, it is.')
    m.chat('Name a fruit.', max_tokens=8)
    recs.write('demo', 'smoke', led.calls)
    code = check_server_command(SMOL, served.base_url, 'smollm2', sample=5, records=CallRecords(tmp_path / 'records'))
    out = capsys.readouterr().out
    assert '5 recorded calls of smollm2' in out and 'largest log-probability difference' in out, out
    worst = float(out.split('largest log-probability difference ')[1].split(' ')[0])
    assert code == 0 and worst <= TOL and '0 changed answer(s)' in out, out
    # a record that no longer matches what the model computes: the answer it recorded is reported as changed
    data = CallRecords(tmp_path / 'records')._load()
    key = next(k for k, r in data.items() if r['request']['kind'] == 'choice')
    bad = dict(data[key]['value']); bad['logprobs'] = [-x for x in bad['logprobs']]
    recs2 = CallRecords(tmp_path / 'records2'); recs2.write('demo', 'smoke', {key: dict(request=data[key]['request'], value=bad)})
    assert check_server_command(SMOL, served.base_url, 'smollm2', sample=5, records=CallRecords(tmp_path / 'records2')) == 1
    assert '1 changed answer(s)' in capsys.readouterr().out
    # a score whose record holds another number of log-probabilities (a continuation tokenized otherwise) has no
    # difference to compare: it fails the check too (it passed with exit code 0 while only `max_abs_diff > tol` counted)
    key = next(k for k, r in data.items() if r['request']['kind'] == 'score')
    odd = dict(data[key]['value']); odd['logprobs'] = odd['logprobs'] + [-1.0]; odd['tokens'] = odd['tokens'] + ['!']
    recs3 = CallRecords(tmp_path / 'records3'); recs3.write('demo', 'smoke', {key: dict(request=data[key]['request'], value=odd)})
    assert check_server_command(SMOL, served.base_url, 'smollm2', sample=5, records=CallRecords(tmp_path / 'records3')) == 1
    out = capsys.readouterr().out
    assert '0 changed answer(s), 1 other call(s) beyond the tolerance' in out and 'another number of log-probabilities' in out, out

