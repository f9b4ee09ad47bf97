// The official `openai` npm client against real `kestrel serve` processes on loopback:
//  - `real`: the tiny random fixture model on the CPU backend (seeds, sampling, streaming shape);
//  - `scripted`: the same tokenizer/template with the TEST-ONLY scripted backend (tool calls,
//    thinking, stop strings, cancellation), see docs/server.md.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { execFileSync } from 'node:child_process';
import OpenAI from 'openai';
import { startServer, metric, metrics, sleep, TINY, SCRIPT } from './harness.mjs';

let real, scripted;
const clients = {};
before(async () => {
  [real, scripted] = await Promise.all([
    startServer(['--model', TINY, '--parallel', '2']),
    startServer(['--model', TINY, '--test-script', SCRIPT, '--parallel', '2']),
  ]);
  clients.real = new OpenAI({ baseURL: `${real.base}/v1`, apiKey: 'unused', maxRetries: 0 });
  clients.scripted = new OpenAI({ baseURL: `${scripted.base}/v1`, apiKey: 'unused', maxRetries: 0 });
});
after(async () => {
  await Promise.all([real?.stop(), scripted?.stop()]);
});

const user = (content) => [{ role: 'user', content }];
const weatherTool = {
  type: 'function',
  function: {
    name: 'get_weather',
    description: 'Get the weather for a city',
    parameters: {
      type: 'object',
      properties: { city: { type: 'string' }, days: { type: 'integer' }, metric: { type: 'boolean' } },
      required: ['city'],
    },
  },
};

test('models lists the served name with its context length', async () => {
  const list = await clients.real.models.list();
  assert.equal(list.data.length, 1);
  assert.equal(list.data[0].id, 'tiny');
  assert.equal(list.data[0].max_model_len, 4096);
  const one = await clients.real.models.retrieve('tiny');
  assert.equal(one.id, 'tiny');
});

test('non-streaming chat completion', async () => {
  const r = await clients.real.chat.completions.create({ model: 'tiny', messages: user('Hi'), max_tokens: 12, seed: 3 });
  assert.match(r.id, /^chatcmpl-/);
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.model, 'tiny');
  assert.equal(r.choices.length, 1);
  assert.equal(r.choices[0].message.role, 'assistant');
  assert.ok(['length', 'stop'].includes(r.choices[0].finish_reason));
  assert.equal(r.usage.completion_tokens <= 12, true);
  assert.equal(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens);
  assert.ok(r.usage.prompt_tokens > 0);
});

test('streaming: role first, one id, usage chunk last (include_usage)', async () => {
  const stream = await clients.real.chat.completions.create({
    model: 'tiny', messages: user('Hello there'), max_tokens: 16, seed: 5, stream: true,
    stream_options: { include_usage: true }, chat_template_kwargs: { enable_thinking: false },
  });
  const chunks = [];
  for await (const c of stream) chunks.push(c);
  assert.ok(chunks.length >= 3);
  assert.equal(chunks[0].choices[0].delta.role, 'assistant');
  const ids = new Set(chunks.map((c) => c.id));
  const created = new Set(chunks.map((c) => c.created));
  assert.equal(ids.size, 1);
  assert.equal(created.size, 1);
  const last = chunks[chunks.length - 1];
  assert.deepEqual(last.choices, []);
  assert.ok(last.usage.completion_tokens > 0);
  for (const c of chunks.slice(0, -1)) assert.equal(c.usage, null);
  const fin = chunks[chunks.length - 2];
  assert.ok(['length', 'stop'].includes(fin.choices[0].finish_reason));
  // The SDK's accumulating helper accepts the stream too.
  const s2 = clients.real.chat.completions.stream({ model: 'tiny', messages: user('Hello there'), max_tokens: 16, seed: 5,
    chat_template_kwargs: { enable_thinking: false } });
  const final = await s2.finalChatCompletion();
  const streamed = chunks.map((c) => c.choices[0]?.delta?.content ?? '').join('');
  assert.equal(final.choices[0].message.content, streamed);
});

test('without include_usage there is no usage chunk', async () => {
  const stream = await clients.real.chat.completions.create({ model: 'tiny', messages: user('x'), max_tokens: 4, stream: true });
  const chunks = [];
  for await (const c of stream) chunks.push(c);
  assert.ok(chunks.every((c) => c.choices.length === 1));
});

test('same seed, same request -> same output; streaming equals non-streaming', async () => {
  const req = { model: 'tiny', messages: user('Tell me something'), max_tokens: 24, seed: 1234, temperature: 1.0 };
  const a = await clients.real.chat.completions.create(req);
  const b = await clients.real.chat.completions.create(req);
  assert.deepEqual(a.choices[0].message, b.choices[0].message);
  // (The SDK's stream helper overwrites unknown delta keys such as reasoning_content instead of
  // concatenating them, so the deltas are joined here.)
  const st = await clients.real.chat.completions.create({ ...req, stream: true });
  let content = '', reasoning = '';
  for await (const c of st) {
    content += c.choices[0]?.delta?.content ?? '';
    reasoning += c.choices[0]?.delta?.reasoning_content ?? '';
  }
  assert.equal(content, a.choices[0].message.content ?? '');
  assert.equal(reasoning, a.choices[0].message.reasoning_content ?? '');
  const outs = new Set();
  for (const seed of [1, 2, 3, 4]) {
    const r = await clients.real.chat.completions.create({ ...req, seed });
    outs.add(JSON.stringify(r.choices[0].message));
  }
  assert.ok(outs.size > 1, 'different seeds should give different samples');
});

test('logprobs of chosen and top tokens', async () => {
  const r = await clients.real.chat.completions.create({ model: 'tiny', messages: user('Hi'), max_tokens: 5, seed: 9,
    logprobs: true, top_logprobs: 3 });
  const lp = r.choices[0].logprobs.content;
  assert.equal(lp.length, r.usage.completion_tokens - (r.choices[0].finish_reason === 'stop' ? 1 : 0));
  for (const e of lp) {
    assert.ok(e.logprob <= 0);
    assert.equal(e.top_logprobs.length, 3);
    assert.ok(e.top_logprobs[0].logprob >= e.top_logprobs[2].logprob);
    assert.ok(Array.isArray(e.bytes));
  }
});

test('legacy completions, streaming and not', async () => {
  const r = await clients.real.completions.create({ model: 'tiny', prompt: 'Once upon a time', max_tokens: 8, seed: 2 });
  assert.equal(r.object, 'text_completion');
  assert.equal(typeof r.choices[0].text, 'string');
  assert.equal(r.usage.completion_tokens <= 8, true);
  const s = await clients.real.completions.create({ model: 'tiny', prompt: 'Once upon a time', max_tokens: 8, seed: 2, stream: true });
  let text = '';
  for await (const c of s) text += c.choices[0]?.text ?? '';
  assert.equal(text, r.choices[0].text);
});

test('stop strings are cut and never streamed', async () => {
  const req = { model: 'tiny', messages: user('stop test'), stop: ['STOP'], chat_template_kwargs: { enable_thinking: false } };
  const r = await clients.scripted.chat.completions.create(req);
  assert.equal(r.choices[0].message.content, 'one two three ');
  assert.equal(r.choices[0].finish_reason, 'stop');
  const stream = await clients.scripted.chat.completions.create({ ...req, stream: true });
  let text = '';
  for await (const c of stream) text += c.choices[0]?.delta?.content ?? '';
  assert.equal(text, 'one two three ');
});

test('tools: a call is parsed into tool_calls (non-streaming)', async () => {
  const r = await clients.scripted.chat.completions.create({ model: 'tiny', messages: user('What is the weather in Paris?'),
    tools: [weatherTool] });
  const m = r.choices[0].message;
  assert.equal(r.choices[0].finish_reason, 'tool_calls');
  assert.equal(m.content, null);
  assert.equal(m.reasoning_content, 'The user wants the weather in Paris.');
  assert.equal(m.tool_calls.length, 1);
  assert.equal(m.tool_calls[0].type, 'function');
  assert.match(m.tool_calls[0].id, /^call_[0-9a-f]{24}$/);
  assert.equal(m.tool_calls[0].function.name, 'get_weather');
  assert.deepEqual(JSON.parse(m.tool_calls[0].function.arguments), { city: 'Paris', days: 3, metric: true });
});

test('tools: streaming deltas accumulate in the SDK; several calls', async () => {
  const req = { model: 'tiny', messages: user('Weather in two cities please'), tools: [weatherTool] };
  const final = await clients.scripted.chat.completions.stream(req).finalChatCompletion();
  const m = final.choices[0].message;
  assert.equal(final.choices[0].finish_reason, 'tool_calls');
  assert.equal(m.tool_calls.length, 2);
  assert.deepEqual(JSON.parse(m.tool_calls[0].function.arguments), { city: 'Paris', days: 3 });
  assert.deepEqual(JSON.parse(m.tool_calls[1].function.arguments), { city: 'Tōkyō 東京', days: 1 });
  assert.notEqual(m.tool_calls[0].id, m.tool_calls[1].id);
  // Raw chunk shape: the first delta of each call has index/id/type/name/arguments:"".
  const stream = await clients.scripted.chat.completions.create({ ...req, stream: true });
  const heads = [];
  for await (const c of stream)
    for (const tc of c.choices[0]?.delta?.tool_calls ?? []) if (tc.id) heads.push(tc);
  assert.equal(heads.length, 2);
  for (const [i, h] of heads.entries()) {
    assert.equal(h.index, i);
    assert.equal(h.type, 'function');
    assert.equal(h.function.name, 'get_weather');
    assert.equal(h.function.arguments, '');
  }
  const non = await clients.scripted.chat.completions.create(req);
  assert.deepEqual(non.choices[0].message.tool_calls.map((t) => t.function), m.tool_calls.map((t) => t.function));
});

test('tools: tool_choice none leaves the markup as content; named forces a call', async () => {
  const r = await clients.scripted.chat.completions.create({ model: 'tiny', messages: user('What is the weather?'),
    tools: [weatherTool], tool_choice: 'none' });
  assert.equal(r.choices[0].message.tool_calls, undefined);
  assert.match(r.choices[0].message.content, /<tool_call>/);
  const f = await clients.scripted.chat.completions.create({ model: 'tiny', messages: user('plain'), tools: [weatherTool],
    tool_choice: { type: 'function', function: { name: 'get_weather' } }, chat_template_kwargs: { enable_thinking: false } });
  assert.equal(f.choices[0].finish_reason, 'tool_calls');
  assert.equal(f.choices[0].message.tool_calls[0].function.name, 'get_weather');
  assert.equal(typeof JSON.parse(f.choices[0].message.tool_calls[0].function.arguments), 'object');
});

test('tool results round-trip through the template', async () => {
  const r = await clients.scripted.chat.completions.create({ model: 'tiny', tools: [weatherTool], messages: [
    { role: 'user', content: 'plain question' },
    { role: 'assistant', content: null, tool_calls: [{ id: 'call_1', type: 'function',
      function: { name: 'get_weather', arguments: '{"city": "Paris"}' } }] },
    { role: 'tool', tool_call_id: 'call_1', content: 'sunny' },
  ], chat_template_kwargs: { enable_thinking: false } });
  assert.equal(r.choices[0].message.content, 'Hello! How can I help you today?');
});

test('thinking on: reasoning_content separate, never in content; off: no reasoning', async () => {
  const on = await clients.scripted.chat.completions.create({ model: 'tiny', messages: user('What is the answer?') });
  assert.equal(on.choices[0].message.reasoning_content, 'Let me think about this carefully.');
  assert.equal(on.choices[0].message.content, 'The answer is 42.');
  assert.ok(on.usage.completion_tokens_details.reasoning_tokens > 0);
  const st = await clients.scripted.chat.completions.create({ model: 'tiny', messages: user('What is the answer?'), stream: true });
  let reasoning = '', content = '';
  for await (const c of st) {
    reasoning += c.choices[0]?.delta?.reasoning_content ?? '';
    content += c.choices[0]?.delta?.content ?? '';
  }
  assert.equal(reasoning, 'Let me think about this carefully.');
  assert.equal(content, 'The answer is 42.');
  for (const off of [{ chat_template_kwargs: { enable_thinking: false } }, { reasoning_effort: 'none' }]) {
    const r = await clients.scripted.chat.completions.create({ model: 'tiny', messages: user('plain'), ...off });
    assert.equal(r.choices[0].message.reasoning_content, undefined);
    assert.equal(r.choices[0].message.content, 'The answer is 42.');
    assert.equal(r.usage.completion_tokens_details.reasoning_tokens, 0);
  }
  const t = await (await fetch(`${scripted.base}/apply-template`, { method: 'POST', headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ messages: user('plain'), chat_template_kwargs: { enable_thinking: false } }) })).json();
  assert.ok(t.prompt.endsWith('<|im_start|>assistant\n<think>\n\n</think>\n\n'));
});

test('reasoning sent back as `reasoning` or `reasoning_content` is accepted', async () => {
  for (const key of ['reasoning', 'reasoning_content']) {
    const body = { messages: [{ role: 'user', content: 'q1' }, { role: 'assistant', content: 'a1', [key]: 'my thoughts' },
      { role: 'user', content: 'q2' }], chat_template_kwargs: { preserve_thinking: true } };
    const t = await (await fetch(`${scripted.base}/apply-template`, { method: 'POST', headers: { 'content-type': 'application/json' },
      body: JSON.stringify(body) })).json();
    assert.ok(t.prompt.includes('<think>\nmy thoughts\n</think>\n\na1'), t.prompt);
  }
});

test('unicode output is never broken, streamed equals non-streamed', async () => {
  const req = { model: 'tiny', messages: user('unicode please'), chat_template_kwargs: { enable_thinking: false } };
  const r = await clients.scripted.chat.completions.create(req);
  assert.equal(r.choices[0].message.content, 'héllo wörld 你好世界 😀🎉 Ελληνικά done');
  const s = await clients.scripted.chat.completions.create({ ...req, stream: true });
  let text = '';
  for await (const c of s) {
    const d = c.choices[0]?.delta?.content ?? '';
    assert.ok(!d.includes('\uFFFD'));
    text += d;
  }
  assert.equal(text, r.choices[0].message.content);
});

test('abort mid-stream cancels the generation within 100 ms', async () => {
  const before = await metric(scripted.base, 'kestrel_requests_cancelled_total');
  const controller = new AbortController();
  const stream = await clients.scripted.chat.completions.create({ model: 'tiny', messages: user('a long story'),
    stream: true, chat_template_kwargs: { enable_thinking: false } }, { signal: controller.signal });
  let n = 0;
  let tAbort = 0;
  try {
    for await (const c of stream) {
      if (++n === 5) { tAbort = performance.now(); controller.abort(); }
    }
  } catch (e) {
    assert.ok(e.name === 'APIUserAbortError' || e.name === 'AbortError', e.name);
  }
  assert.ok(tAbort > 0);
  let elapsed = Infinity;
  for (;;) {
    const m = await metrics(scripted.base);
    if (m.kestrel_requests_running === 0 && m.kestrel_requests_cancelled_total === before + 1) {
      elapsed = performance.now() - tAbort;
      break;
    }
    if (performance.now() - tAbort > 2000) break;
    await sleep(2);
  }
  console.log(`# cancel latency ${elapsed.toFixed(1)} ms`);
  assert.ok(elapsed < 100, `generation still running ${elapsed} ms after the abort`);
});

test('errors: statuses, OpenAI error shape and param', async () => {
  const c = clients.real;
  await assert.rejects(c.chat.completions.create({ model: 'tiny', messages: user('x'), temperature: 5 }),
    (e) => e.status === 400 && e.param === 'temperature' && e.type === 'invalid_request_error');
  await assert.rejects(c.chat.completions.create({ model: 'tiny', messages: user('x'), max_tokens: 10000 }),
    (e) => e.status === 400 && e.code === 'context_length_exceeded' && /maximum context length is 4096/.test(e.message));
  await assert.rejects(c.chat.completions.create({ model: 'tiny', messages: user('x'), n: 2 }), (e) => e.status === 400 && e.param === 'n');
  await assert.rejects(c.chat.completions.create({ model: 'gpt-4o', messages: user('x') }),
    (e) => e.status === 404 && e.code === 'model_not_found');
  await assert.rejects(c.get('/nope'), (e) => e.status === 404);
  await assert.rejects(c.get('/chat/completions'), (e) => e.status === 405);
  const big = await fetch(`${real.base}/v1/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json' },
    body: '{"messages":"' + 'a'.repeat(9 << 20) + '"}' });
  assert.equal(big.status, 413);
  assert.equal(typeof (await big.json()).error.message, 'string');
  const h = await fetch(`${real.base}/health`);
  assert.equal(h.status, 200);
});

test('401 with --api-key (constant-time check; /health stays open)', async () => {
  const s = await startServer(['--model', TINY, '--test-script', SCRIPT, '--api-key', 'sekret']);
  try {
    const bad = new OpenAI({ baseURL: `${s.base}/v1`, apiKey: 'wrong', maxRetries: 0 });
    await assert.rejects(bad.models.list(), (e) => e.status === 401);
    await assert.rejects(bad.chat.completions.create({ model: 'tiny', messages: user('x') }), (e) => e.status === 401);
    for (const p of ['/metrics', '/tokenize', '/v1//models', '/v1/models/']) {
      const r = await fetch(`${s.base}${p}`, { method: p === '/tokenize' ? 'POST' : 'GET' });
      assert.equal(r.status, 401, p);
    }
    assert.equal((await fetch(`${s.base}/health`)).status, 200);
    const good = new OpenAI({ baseURL: `${s.base}/v1`, apiKey: 'sekret', maxRetries: 0 });
    const r = await good.chat.completions.create({ model: 'tiny', messages: user('plain'), chat_template_kwargs: { enable_thinking: false } });
    assert.equal(r.choices[0].message.content, 'The answer is 42.');
    const x = await fetch(`${s.base}/v1/models`, { headers: { 'x-api-key': 'sekret' } });
    assert.equal(x.status, 200);
  } finally {
    await s.stop();
  }
});

test('429 with Retry-After when the bounded queue is full', async () => {
  const s = await startServer(['--model', TINY, '--test-script', SCRIPT, '--max-queue', '1', '--parallel', '1']);
  try {
    const c = new OpenAI({ baseURL: `${s.base}/v1`, apiKey: 'x', maxRetries: 0 });
    const ctl = new AbortController();
    const long = () => c.chat.completions.create({ model: 'tiny', messages: user('a long story'), max_tokens: 400,
      chat_template_kwargs: { enable_thinking: false } }, { signal: ctl.signal }).catch((e) => e);
    const running = long();
    await sleep(100);
    const queued = long();
    await sleep(100);
    const raw = await fetch(`${s.base}/v1/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ messages: user('plain') }) });
    assert.equal(raw.status, 429);
    assert.equal(raw.headers.get('retry-after'), '1');
    assert.equal((await raw.json()).error.type, 'rate_limit_error');
    await assert.rejects(c.chat.completions.create({ model: 'tiny', messages: user('plain') }), (e) => e.status === 429);
    const [a, b] = await Promise.all([running, queued]);
    assert.equal(a.choices[0].finish_reason, 'length');
    assert.equal(b.choices[0].finish_reason, 'length');
  } finally {
    await s.stop();
  }
});

test('503 while loading, then 200 (tokenizer.json held back through a FIFO)', async () => {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'kestrel-load-'));
  for (const f of fs.readdirSync(TINY)) if (f !== 'tokenizer.json') fs.symlinkSync(path.join(TINY, f), path.join(dir, f));
  execFileSync('mkfifo', [path.join(dir, 'tokenizer.json')]);
  const s = await startServer(['--model', dir, '--served-model-name', 'tiny'], { waitReady: false });
  try {
    const h = await fetch(`${s.base}/health`);
    assert.equal(h.status, 503);
    assert.equal((await h.json()).error.message, 'Loading model');
    const c = await fetch(`${s.base}/v1/chat/completions`, { method: 'POST', body: '{}', headers: { 'content-type': 'application/json' } });
    assert.equal(c.status, 503);
    fs.writeFileSync(path.join(dir, 'tokenizer.json'), fs.readFileSync(path.join(TINY, 'tokenizer.json')));
    let status = 0;
    for (let i = 0; i < 300 && status !== 200; ++i) {
      status = (await fetch(`${s.base}/health`)).status;
      if (status !== 200) await sleep(50);
    }
    assert.equal(status, 200);
  } finally {
    await s.stop();
    fs.rmSync(dir, { recursive: true, force: true });
  }
});

test('SIGTERM: in-flight streams get a final error event, new requests 503, clean exit', async () => {
  const s = await startServer(['--model', TINY, '--test-script', SCRIPT, '--drain-timeout', '0.3']);
  const c = new OpenAI({ baseURL: `${s.base}/v1`, apiKey: 'x', maxRetries: 0 });
  const stream = await c.chat.completions.create({ model: 'tiny', messages: user('a long story'), stream: true,
    chat_template_kwargs: { enable_thinking: false } });
  let n = 0;
  let err = null;
  const t0 = performance.now();
  try {
    for await (const ch of stream) {
      if (++n === 3) {
        s.proc.kill('SIGTERM');
        await sleep(50);
        const r = await fetch(`${s.base}/v1/models`).catch(() => null);
        if (r) assert.equal(r.status, 503);
      }
    }
  } catch (e) {
    err = e;
  }
  assert.ok(err, 'the stream should end with an error event');
  assert.match(String(err.message), /shutting down/);
  const { code } = await s.exited;
  assert.equal(code, 0);
  assert.ok(performance.now() - t0 < 5000);
});
