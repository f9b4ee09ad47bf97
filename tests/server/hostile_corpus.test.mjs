// >= 200 malformed or hostile requests over raw TCP against a real `kestrel serve` (scripted
// backend; nothing here reaches generation). Each must get a 4xx JSON error object within 1 s (or,
// for slow/unfinished headers, a close after the read timeout) while /health stays 200.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import net from 'node:net';
import { startServer, TINY, SCRIPT, sleep } from './harness.mjs';

let srv;
before(async () => {
  srv = await startServer(['--model', TINY, '--test-script', SCRIPT, '--read-timeout', '2']);
});
after(async () => { await srv?.stop(); });

// Sends raw bytes, returns {status, headers, body, ms} of the first response (or status 0 if the
// server closed without one).
function raw(bytes, { timeoutMs = 5000, keepOpen = true } = {}) {
  return new Promise((resolve) => {
    const t0 = performance.now();
    const sock = net.connect(srv.port, '127.0.0.1');
    let buf = Buffer.alloc(0);
    let finished = false;
    const finish = (r) => { if (!finished) { finished = true; sock.destroy(); resolve({ ...r, ms: performance.now() - t0 }); } };
    const timer = setTimeout(() => finish({ status: -1 }), timeoutMs);
    sock.on('connect', () => { sock.write(bytes); if (!keepOpen) sock.end(); });
    sock.on('data', (d) => {
      buf = Buffer.concat([buf, d]);
      const s = buf.toString('latin1');
      const he = s.indexOf('\r\n\r\n');
      if (he < 0) return;
      const head = s.slice(0, he);
      const status = Number(head.split(' ')[1]);
      const headers = {};
      for (const l of head.split('\r\n').slice(1)) {
        const i = l.indexOf(':');
        headers[l.slice(0, i).toLowerCase()] = l.slice(i + 1).trim();
      }
      const len = Number(headers['content-length'] ?? -1);
      const body = buf.subarray(Buffer.byteLength(head, 'latin1') + 4);
      if (len >= 0 && body.length >= len) {
        clearTimeout(timer);
        finish({ status, headers, body: body.subarray(0, len).toString('utf8') });
      }
    });
    sock.on('error', () => {});
    sock.on('close', () => { clearTimeout(timer); finish({ status: 0 }); });
  });
}

const http = (method, path, body, headers = {}) => {
  const b = body === undefined ? Buffer.alloc(0) : Buffer.isBuffer(body) ? body : Buffer.from(body, 'utf8');
  const h = { Host: '127.0.0.1', 'Content-Type': 'application/json', Connection: 'close', ...headers };
  if (b.length || method !== 'GET') h['Content-Length'] = String(b.length);
  const head = `${method} ${path} HTTP/1.1\r\n` + Object.entries(h).filter(([, v]) => v !== null).map(([k, v]) => `${k}: ${v}\r\n`).join('') + '\r\n';
  return Buffer.concat([Buffer.from(head, 'latin1'), b]);
};
const chat = (obj) => http('POST', '/v1/chat/completions', typeof obj === 'string' || Buffer.isBuffer(obj) ? obj : JSON.stringify(obj));
const msgs = [{ role: 'user', content: 'hi' }];
const withField = (k, v) => chat({ messages: msgs, [k]: v });

function corpus() {
  const c = [];
  const add = (name, bytes, expect = null) => c.push({ name, bytes, expect });
  // Malformed JSON.
  for (const s of ['{', '}', '{"messages":', '{"messages": [}', '{"a":1,}', "{'a':1}", '{"a":NaN}', '{"a":Infinity}',
    '{"a":1} {"b":2}', '{"a":1}garbage', '/* c */{}', '{"a":01}', '{"a":.5}', '{"a":"\\x41"}', '{"a":"\t"}', '{"a" 1}',
    '{"a":tru}', '{"a":nul}', '{"a":"unterminated}', '{"a":[1,2,}', '{,}', '{"a":1e}', '{"a":-}', '{"\\u00"}', '\u0000{}',
    '{"a":"\\ud800"}', '{"a":"\\udc00"}', '{"a":"\\ud800\\u0041"}', '{"messages":[{"role":"user","content":"\\uZZZZ"}]}', ' '])
    add(`bad json ${JSON.stringify(s).slice(0, 40)}`, chat(s), 400);
  add('empty body', chat(''), 400);
  // Non-object bodies.
  for (const s of ['[]', '[{}]', '1', '-1', '"str"', 'null', 'true', 'false', '1e400', '[' + '1,'.repeat(1000) + '1]'])
    add(`non-object ${s.slice(0, 20)}`, chat(s), 400);
  // Deep nesting.
  for (const d of [65, 100, 1000, 100000]) {
    add(`deep array ${d} in unknown field`, chat(`{"messages":[],"x":${'['.repeat(d)}${']'.repeat(d)}}`), 400);
    add(`deep object ${d} in content`, chat(`{"messages":[{"role":"user","content":${'{"a":'.repeat(d)}1${'}'.repeat(d)}}]}`), 400);
    add(`deep unterminated ${d}`, chat('{"tools":' + '['.repeat(d)), 400);
  }
  // Invalid UTF-8 inside strings.
  for (const bad of [[0xff], [0xc0, 0x80], [0xed, 0xa0, 0x80], [0xe4, 0xbd], [0xf4, 0x90, 0x80, 0x80], [0x80], [0xfe, 0xfe]]) {
    const b = Buffer.concat([Buffer.from('{"messages":[{"role":"user","content":"a'), Buffer.from(bad), Buffer.from('"}]}')]);
    add(`invalid utf8 ${bad.map((x) => x.toString(16)).join(' ')}`, chat(b), 400);
  }
  // messages shapes.
  for (const m of ['x', 1, {}, [], [1], [null], [{}], [{ role: 1 }], [{ role: 'bad', content: 'x' }], [{ role: 'user', content: 1 }],
    [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'data:,' } }] }], [{ role: 'user', content: [{ type: 'weird' }] }],
    [{ role: 'user', content: [{ text: 'no type' }] }], [{ role: 'user', content: [{ type: 'text', text: 5 }] }],
    [{ role: 'assistant', content: 'only assistant' }], [{ role: 'system', content: 'only system' }],
    [{ role: 'user', content: 'x' }, { role: 'assistant', tool_calls: 'x' }],
    [{ role: 'user', content: 'x' }, { role: 'assistant', tool_calls: [{ function: { name: 1 } }] }],
    [{ role: 'user', content: 'x' }, { role: 'assistant', tool_calls: [{ function: { name: 'f', arguments: 5 } }] }],
    [{ role: 'user', content: 'x' }, { role: 'assistant', content: 'y', reasoning_content: 5 }],
    [{ role: 'tool', content: 'x', tool_call_id: 5 }], [{ role: 'user', content: 'x', name: 5 }], [{ role: 'function', content: 'x' }]])
    add(`messages ${JSON.stringify(m).slice(0, 50)}`, chat({ messages: m }), 400);
  add('messages missing', chat({}), 400);
  // Every numeric field at bad values.
  const nums = { temperature: [-1, 2.5, '1', true, [], {}, 1e308], top_p: [0, -0.1, 1.5, 'x'], top_k: [-5, 1.5, 'x', 1e30],
    min_p: [-1, 2, 'x'], presence_penalty: [-3, 3, 'x'], frequency_penalty: [-2.5, 2.5, null === 0 ? 0 : 'x'],
    repetition_penalty: [0, -1, 11, 'x'], seed: ['x', 1.5, [], 1e300], max_tokens: [0, -1, 1.5, '5', 2 ** 31, 2 ** 63, 1e308, true],
    max_completion_tokens: [0, -1, '5', 2 ** 40], n: [0, 2, 1e6, '1'], top_logprobs: [21, -1, 'x', 5] };
  for (const [k, vs] of Object.entries(nums)) for (const v of vs) add(`${k}=${JSON.stringify(v)}`, withField(k, v), 400);
  for (const [k, v] of [['stream', 'yes'], ['stream', 1], ['stream_options', 'x'], ['stream_options', { include_usage: 'y' }],
    ['logprobs', 'x'], ['logprobs', 1], ['stop', 5], ['stop', [1]], ['stop', ''], ['stop', Array(17).fill('a')], ['stop', 'x'.repeat(2000)],
    ['tools', 'x'], ['tools', [1]], ['tools', [{ type: 'code' }]], ['tools', [{ type: 'function' }]],
    ['tools', [{ type: 'function', function: { name: 'bad name!' } }]], ['tools', [{ type: 'function', function: { name: 'x'.repeat(65) } }]],
    ['tools', [{ type: 'function', function: { name: 'f', parameters: 'x' } }]], ['tool_choice', 'sometimes'], ['tool_choice', 5],
    ['tool_choice', { type: 'function', function: { name: 'missing' } }], ['tool_choice', 'required'],
    ['chat_template_kwargs', 'x'], ['chat_template_kwargs', { enable_thinking: 'yes' }], ['chat_template_kwargs', { tools: [] }],
    ['chat_template_kwargs', { add_generation_prompt: false }], ['reasoning_effort', 'ultra'], ['reasoning_effort', 5],
    ['response_format', { type: 'json_object' }], ['response_format', 'json'], ['logit_bias', { 1: 5 }], ['logit_bias', 5],
    ['functions', [{ name: 'f' }]], ['model', 123], ['parallel_tool_calls', 'no'], ['ignore_eos', 'x']])
    add(`${k}=${JSON.stringify(v).slice(0, 40)}`, withField(k, v), 400);
  add('unknown model', withField('model', 'gpt-4o'), 404);
  add('context overflow', withField('max_tokens', 4096), 400);
  // /v1/completions
  const comp = (o) => http('POST', '/v1/completions', JSON.stringify(o));
  for (const p of [undefined, 5, [], [5.5], [-1], [1e9], [[1, 2], [3]], ['a', 'b'], '', [true]])
    add(`completions prompt ${JSON.stringify(p)}`, comp({ prompt: p }), 400);
  for (const [k, v] of [['logprobs', 6], ['logprobs', true], ['echo', true], ['suffix', 'x'], ['best_of', 2], ['max_tokens', 0]])
    add(`completions ${k}=${v}`, comp({ prompt: 'x', [k]: v }), 400);
  // tokenize / detokenize / apply-template
  add('tokenize no content', http('POST', '/tokenize', '{}'), 400);
  add('tokenize content number', http('POST', '/tokenize', '{"content":5}'), 400);
  add('tokenize parse_special string', http('POST', '/tokenize', '{"content":"x","parse_special":"y"}'), 400);
  add('detokenize bad ids', http('POST', '/detokenize', '{"tokens":[-1]}'), 400);
  add('detokenize huge id', http('POST', '/detokenize', '{"tokens":[99999999]}'), 400);
  add('detokenize not array', http('POST', '/detokenize', '{"tokens":"x"}'), 400);
  add('apply-template no messages', http('POST', '/apply-template', '{}'), 400);
  add('apply-template system only', http('POST', '/apply-template', '{"messages":[{"role":"system","content":"s"}]}'), 400);
  // Routes and methods.
  for (const p of ['/', '/v1', '/v2/chat/completions', '/v1/chat', '/v1/chat/completions/x', '/admin', '/../etc/passwd',
    '/v1/%2e%2e/models', '/V1/MODELS', '/health/x', '/v1/models/unknown', '/v1/responses', '/v1/messages', '/slots', '/props'])
    add(`route ${p}`, http('GET', p), 404);
  for (const [m, p] of [['GET', '/v1/chat/completions'], ['PUT', '/v1/chat/completions'], ['DELETE', '/v1/models'],
    ['PATCH', '/v1/completions'], ['POST', '/v1/models'], ['POST', '/health'], ['GET', '/tokenize'], ['PUT', '/metrics'],
    ['DELETE', '/v1/chat/completions'], ['POST', '/metrics']])
    add(`method ${m} ${p}`, http(m, p, m === 'POST' ? '{}' : undefined), 405);
  for (const ct of ['text/plain', 'application/x-www-form-urlencoded', 'multipart/form-data; boundary=x', 'application/xml'])
    add(`content-type ${ct}`, chat({ messages: msgs }).toString('latin1').replace('Content-Type: application/json', `Content-Type: ${ct}`),
      ct.startsWith('multipart') ? 400 : 415);  // httplib itself rejects the malformed multipart body
  // Oversize bodies (limit 8 MiB).
  add('body 9 MiB', chat('{"messages":"' + 'a'.repeat(9 << 20) + '"}'), 413);
  // HTTP framing.
  for (const [name, s] of [['garbage request line', 'GARBAGE\r\n\r\n'], ['no version', 'GET /health\r\n\r\n'],
    ['bad content-length', 'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n{}'],
    ['negative content-length', 'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n{}'],
    ['bad chunk size', 'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\nzz\r\n{}\r\n0\r\n\r\n'],
    ['chunked empty body', 'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n0\r\n\r\n'],
    ['chunked json non-object', 'POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n2\r\n[]\r\n0\r\n\r\n'],
    ['uri too long', `GET /${'a'.repeat(10000)} HTTP/1.1\r\nHost: x\r\n\r\n`],
    ['encoded crlf in path', 'GET /v1/models%0D%0AX-Injected:%201 HTTP/1.1\r\nHost: x\r\n\r\n'],
    ['unknown method', 'BREW /v1/models HTTP/1.1\r\nHost: x\r\n\r\n']])
    add(`framing ${name}`, Buffer.from(s, 'latin1'), 'framing');
  return c;
}

test('hostile corpus: every request gets a 4xx JSON error in < 1 s; /health stays 200', async () => {
  const cases = corpus();
  assert.ok(cases.length >= 200, `corpus has ${cases.length} cases`);
  const statuses = {};
  let worst = 0;
  for (const [i, k] of cases.entries()) {
    const r = await raw(k.bytes);
    statuses[r.status] = (statuses[r.status] ?? 0) + 1;
    worst = Math.max(worst, r.ms);
    assert.ok(r.ms < 1000, `${k.name}: took ${r.ms} ms`);
    if (k.expect === 'framing') {
      // Broken framing: a 4xx (JSON) answer, or the connection closed; never a 5xx.
      assert.ok(r.status === 0 || (r.status >= 400 && r.status < 500), `${k.name}: status ${r.status}`);
    } else {
      assert.equal(r.status, k.expect, `${k.name}: status ${r.status} body ${r.body}`);
    }
    if (r.status >= 400) {
      assert.match(r.headers['content-type'] ?? '', /application\/json/, k.name);
      const j = JSON.parse(r.body);
      assert.equal(typeof j.error.message, 'string', k.name);
      assert.equal(typeof j.error.type, 'string', k.name);
      assert.ok(!/\xff|<\|im_start\|>|std::|nlohmann|\.cpp/.test(j.error.message), `${k.name}: leaky message ${j.error.message}`);
    }
    if (i % 10 === 0) {
      const h = await raw(http('GET', '/health'));
      assert.equal(h.status, 200, `health after ${k.name}`);
    }
  }
  const h = await raw(http('GET', '/health'));
  assert.equal(h.status, 200);
  console.log(`# ${cases.length} hostile requests; statuses ${JSON.stringify(statuses)}; slowest ${worst.toFixed(1)} ms`);
});

test('slow headers: stalled connections are closed after the read timeout; trickling ones do not block /health', async () => {
  // httplib 0.11.4 applies its read timeout per read, so a client that keeps trickling header bytes
  // holds one HTTP thread (bounded by --threads-http) until the 8 KiB header limit; one that stalls is
  // closed after --read-timeout (2 s here). Either way /health keeps answering.
  const open = (trickle) => {
    const s = net.connect(srv.port, '127.0.0.1');
    s.on('error', () => {});
    s.write('POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ');
    const t0 = performance.now();
    const iv = trickle ? setInterval(() => { if (!s.destroyed) s.write('a'); }, 300) : null;
    // Answered (httplib sends a 400 once the read times out) or closed.
    const closed = new Promise((resolve) => {
      s.on('data', (d) => { if (/^HTTP\/1\.1 4\d\d /.test(d.toString('latin1'))) resolve(performance.now() - t0); });
      s.on('close', () => resolve(performance.now() - t0));
    });
    return { s, iv, closed };
  };
  const stalled = Array.from({ length: 10 }, () => open(false));
  const trickling = Array.from({ length: 20 }, () => open(true));
  for (let i = 0; i < 15; ++i) {
    const r = await raw(http('GET', '/health'));
    assert.equal(r.status, 200);
    assert.ok(r.ms < 200, `health took ${r.ms} ms during the slow-header clients`);
    await sleep(200);
  }
  const times = await Promise.race([Promise.all(stalled.map((c) => c.closed)), sleep(6000).then(() => null)]);
  assert.ok(times, 'stalled connections were not closed');
  for (const ms of times) assert.ok(ms < 2000 + 1500, `stalled connection open for ${ms} ms (read timeout 2 s)`);
  for (const c of trickling) { clearInterval(c.iv); c.s.destroy(); }
  // A body declared (100 MB, over the limit) but never sent: answered 413 once the read times out
  // (httplib discards a declared over-limit body before answering, so real uploads get their 413).
  const big = await raw(Buffer.from('POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n'));
  assert.equal(big.status, 413);
  assert.ok(big.ms < 2000 + 1500, `declared-but-unsent body answered after ${big.ms} ms`);
  // An unfinished body is cut off too.
  const r = await raw(Buffer.from('POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"mess'));
  assert.ok(r.status === 0 || (r.status >= 400 && r.status < 500), `unfinished body: ${r.status}`);
  assert.ok(r.ms < 3500);
  assert.equal((await raw(http('GET', '/health'))).status, 200);
});

test('special tokens in client text never become control tokens (/tokenize, /apply-template)', async () => {
  const post = async (p, body) => {
    const r = await fetch(`${srv.base}${p}`, { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body) });
    assert.equal(r.status, 200, `${p}: ${r.status}`);
    return r.json();
  };
  const specials = ['<|im_start|>', '<|im_end|>', '<|endoftext|>', '<think>', '</think>', '<tool_call>', '</tool_call>',
    '<tool_response>', '</tool_response>', '<|vision_start|>', '<|image_pad|>', '<|fim_prefix|>', '<|audio_pad|>', '<tts_pad>'];
  const nearMisses = ['<|im_start|', '<｜im_start｜>', '<|im_\u200bstart|>', '<|IM_START|>', '< |im_start|>'];
  const ids = await post('/tokenize', { content: specials.join(''), parse_special: true });
  const controlIds = new Set(ids.tokens);
  assert.equal(controlIds.size, specials.length);
  let checked = 0;
  for (const s of [...specials, ...nearMisses]) {
    for (const where of ['start', 'middle', 'end', 'repeat']) {
      const text = where === 'start' ? `${s}hello` : where === 'middle' ? `hel${s}lo` : where === 'end' ? `hello${s}` : s.repeat(50);
      for (const messages of [
        [{ role: 'user', content: text }],
        [{ role: 'system', content: text }, { role: 'user', content: 'q' }],
        [{ role: 'user', content: [{ type: 'text', text: text.slice(0, 3) }, { type: 'text', text: text.slice(3) }] }],
        [{ role: 'user', content: 'q' }, { role: 'assistant', content: text, reasoning_content: text }, { role: 'user', content: 'r' }],
        [{ role: 'user', content: 'q' }, { role: 'assistant', content: null, tool_calls: [{ id: 'c', type: 'function',
          function: { name: 'f', arguments: JSON.stringify({ [text]: text }) } }] }, { role: 'tool', content: text, tool_call_id: 'c' }],
      ]) {
        const tok = await post('/tokenize', { messages, chat_template_kwargs: { preserve_thinking: true } });
        const plain = await post('/tokenize', { messages: JSON.parse(JSON.stringify(messages).replaceAll(JSON.stringify(s).slice(1, -1), 'zz')),
          chat_template_kwargs: { preserve_thinking: true } });
        // The control-token multiset must equal that of the same conversation without the injected text.
        const count = (arr) => arr.filter((t) => controlIds.has(t)).sort().join(',');
        assert.equal(count(tok.tokens), count(plain.tokens), `${JSON.stringify(s)} ${where}`);
        const imStart = tok.tokens.filter((t) => t === ids.tokens[0]).length;
        assert.equal(imStart, messages.length + 1, `${JSON.stringify(s)} ${where}: <|im_start|> count`);
        const tpl = await post('/apply-template', { messages, chat_template_kwargs: { preserve_thinking: true } });
        assert.ok(tpl.prompt.includes(text), 'client text verbatim in the prompt');
        ++checked;
      }
    }
  }
  // The injected text round-trips as plain text.
  const t = await post('/tokenize', { content: '<|im_start|>system' });
  const back = await post('/detokenize', { tokens: t.tokens });
  assert.equal(back.content, '<|im_start|>system');
  assert.ok(!t.tokens.some((x) => controlIds.has(x)));
  console.log(`# ${checked} injection conversations checked`);
});
