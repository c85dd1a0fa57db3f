"""What `OpenAILLM` sends: a small stdlib HTTP server on 127.0.0.1 records the JSON body of every `/v1/chat/completions`
request and answers with a canned, well-formed completion. This tests the request format (the point: each server reads
its own `response_format`), checked against the `openai` package's own types and llama-cpp-python's server request
model; it does not test a model server. The last test sends the same requests to llama-cpp-python's real server
(SmolLM2, the fixture of tests/test_llm.py), the one server kind here that needs `schema_format='json_object'`."""
import json, socket, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal, get_type_hints
import pytest
from pydantic import BaseModel, Field, TypeAdapter
from rag_lab.calls import LLMCache, Ledger
from rag_lab.config import LLMParams
from rag_lab.llm import LLMError, OpenAILLM, chat_structured, get_llm


class Answer(BaseModel):
    answer: Literal['yes', 'no', 'maybe']
    reason: str = Field(max_length=120)

REPLY = '{"answer": "yes", "reason": "aspirin inhibits prostaglandin synthesis"}'


class Recorder(ThreadingHTTPServer):
    "Records request bodies; optionally validates them as llama-cpp-python's server does, or answers late."
    daemon_threads = True
    def __init__(self):
        super().__init__(('127.0.0.1', 0), Handler)
        self.bodies, self.validate_as, self.delay = [], None, 0.0

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *a): pass

    def _send(self, code: int, obj: dict):
        data = json.dumps(obj).encode()
        try:
            self.send_response(code); self.send_header('Content-Type', 'application/json')
            self.send_header('Content-Length', str(len(data))); self.end_headers(); self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError): pass   # the client timed out and left

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers['Content-Length'])))
        srv = self.server
        srv.bodies.append((self.path, body))
        if self.path != '/v1/chat/completions': return self._send(404, {'error': {'message': f'no route {self.path}'}})
        if srv.delay: time.sleep(srv.delay)
        if srv.validate_as == 'llama-cpp-python':   # its own request model; its route handler turns a failure into a 500
            from pydantic import ValidationError
            from llama_cpp.server.types import CreateChatCompletionRequest
            try: CreateChatCompletionRequest(**body)
            except ValidationError as e:
                return self._send(500, {'error': {'message': str(e), 'type': 'internal_server_error', 'param': None, 'code': None}})
        content = REPLY if 'response_format' in body else 'Paris.'
        self._send(200, {'id': 'chatcmpl-1', 'object': 'chat.completion', 'created': 0, 'model': body['model'],
                         'choices': [{'index': 0, 'finish_reason': 'stop', 'message': {'role': 'assistant', 'content': content}}],
                         'usage': {'prompt_tokens': 7, 'completion_tokens': 11, 'total_tokens': 18}})


@pytest.fixture
def recorder():
    srv = Recorder()
    t = threading.Thread(target=srv.serve_forever, daemon=True); t.start()
    try: yield srv
    finally: srv.shutdown(); srv.server_close()


def url(srv) -> str: return f'http://127.0.0.1:{srv.server_address[1]}/v1'

def chats(srv) -> list[dict]: return [b for p, b in srv.bodies if p == '/v1/chat/completions']

@pytest.fixture
def store(tmp_path): return dict(cache=LLMCache(tmp_path / 'calls.sqlite'), ledger=Ledger())


# ---------------------------------------------------------------- the response_format on the wire
def test_a_schema_goes_in_the_openai_and_vllm_form(recorder, store):
    llm = OpenAILLM('served-model', base_url=url(recorder), retries=0, **store)
    r = chat_structured(llm, 'Does aspirin lower fever? Answer in JSON.', Answer, max_tokens=64)
    assert r.status == 'ok' and r.value == Answer.model_validate_json(REPLY)
    [body] = chats(recorder)
    assert body['response_format'] == {'type': 'json_schema',
                                       'json_schema': {'name': 'response', 'schema': Answer.model_json_schema(), 'strict': False}}
    # the openai package's own definition of this form, with no key it does not know (vLLM would drop one silently)
    from openai.types.shared_params import ResponseFormatJSONSchema
    from openai.types.shared_params.response_format_json_schema import JSONSchema
    TypeAdapter(ResponseFormatJSONSchema).validate_python(body['response_format'])
    assert set(body['response_format']) == {'type', 'json_schema'}
    assert set(body['response_format']['json_schema']) <= set(get_type_hints(JSONSchema))
    assert (body['model'], body['max_tokens'], body['temperature'], body['messages'][0]['role']) == ('served-model', 64, 0.0, 'user')
    # strict on request
    OpenAILLM('served-model', base_url=url(recorder), retries=0, strict_schema=True, **store).chat('x', json_schema=Answer.model_json_schema())
    assert chats(recorder)[-1]['response_format']['json_schema']['strict'] is True


def test_without_a_schema_json_mode_is_json_object_and_plain_chat_sends_none(recorder, store):
    llm = OpenAILLM('m', base_url=url(recorder), retries=0, **store)
    llm.chat('Name a colour as JSON.', json_mode=True)
    llm.chat('Capital of France?')
    a, b = chats(recorder)
    assert a['response_format'] == {'type': 'json_object'}
    assert 'response_format' not in b


def test_llama_cpp_python_server_needs_the_json_object_form(recorder, store):
    recorder.validate_as = 'llama-cpp-python'
    default = OpenAILLM('m', base_url=url(recorder), retries=3, backoff=5, **store)
    with pytest.raises(LLMError, match="schema_format='json_object'") as e:
        default.chat('Answer in JSON.', json_schema=Answer.model_json_schema())
    assert 'response_format' in str(e.value) and 'json_object' in str(e.value)   # the server's own request model refused it
    assert len(chats(recorder)) == 1                                               # a refusal, not retried (a 500 otherwise is)
    lcp = OpenAILLM('m', base_url=url(recorder), retries=0, schema_format='json_object', **store)
    r = chat_structured(lcp, 'Answer in JSON.', Answer)
    assert r.status == 'ok'
    body = chats(recorder)[-1]
    assert body['response_format'] == {'type': 'json_object', 'schema': Answer.model_json_schema()}
    from llama_cpp.server.types import CreateChatCompletionRequest
    assert CreateChatCompletionRequest(**body).response_format['schema'] == Answer.model_json_schema()   # the grammar's source


# ---------------------------------------------------------------- timeouts and retries from the parameters
class ServerParams(LLMParams):
    "A chapter's parameters with the request options of backend 'openai'."
    timeout: float = Field(60.0, gt=0, le=3600)
    retries: int = Field(4, ge=0, le=20)
    schema_format: Literal['json_schema', 'json_object'] = 'json_schema'


def test_timeout_and_retries_reach_the_client_from_the_parameters(recorder, store):
    p = ServerParams(backend='openai', model='m', base_url=url(recorder), answer_mode='free_text', timeout=0.5, retries=2,
                     schema_format='json_object')
    llm = get_llm(p, backoff=0.01, **store)
    assert isinstance(llm, OpenAILLM) and llm.client.timeout == 0.5 and llm.retries == 2 and llm.schema_format == 'json_object'
    assert get_llm(p, timeout=7, retries=0, **store).client.timeout == 7       # the call's own options win
    recorder.delay = 1.5   # longer than the timeout: every attempt times out
    t0 = time.perf_counter()
    with pytest.raises(LLMError, match='failed after 3 attempts'): llm.chat('hello')
    assert len(chats(recorder)) == 3 and time.perf_counter() - t0 < 3 * 1.5   # 1 + 2 retries, each cut at 0.5 s
    recorder.delay = 0.0
    assert llm.chat('hello').text == 'Paris.'
    # parameters without these fields leave the backend's defaults
    plain = get_llm(LLMParams(backend='openai', model='m', base_url=url(recorder), answer_mode='free_text'), **store)
    assert (plain.client.timeout, plain.retries, plain.schema_format) == (60.0, 4, 'json_schema')


@pytest.mark.parametrize('bad, msg', [(dict(timeout=0), 'timeout must be'), (dict(timeout=7200), 'timeout must be'),
                                      (dict(retries=-1), 'retries must be'), (dict(retries=21), 'retries must be'),
                                      (dict(retries=1.5), 'retries must be'), (dict(schema_format='guided_json'), 'schema_format must be')])
def test_request_options_have_bounds(bad, msg, store):
    with pytest.raises(ValueError, match=msg): OpenAILLM('m', base_url='http://127.0.0.1:9/v1', **bad, **store)


# ---------------------------------------------------------------- the same, against llama-cpp-python's real server
from test_llm import server   # noqa: E402  the module-scoped llama_cpp.server with SmolLM2 on 127.0.0.1 (tests/test_llm.py)

def test_real_llama_cpp_python_server_refuses_json_schema_and_reads_json_object(server, store):
    class YesNo(BaseModel):
        answer: Literal['yes', 'no', 'maybe']
    t0 = time.perf_counter()
    with pytest.raises(LLMError, match="schema_format='json_object'"):
        OpenAILLM('smollm2', base_url=server, backoff=5, **store).chat('Answer in JSON.', json_schema=YesNo.model_json_schema())
    assert time.perf_counter() - t0 < 5   # refused at once: no retry with backoff
    r = chat_structured(OpenAILLM('smollm2', base_url=server, schema_format='json_object', **store),
                        'Does aspirin lower fever? Answer in JSON.', YesNo, max_tokens=24)
    assert r.status == 'ok' and r.attempts == 1   # the grammar built from the schema constrained decoding
