// Soak: 16 concurrent streaming clients against the tiny model on the CPU backend for
// KESTREL_SOAK_SECONDS (default 120). Every stream is validated frame by frame (valid UTF-8 JSON
// `data:` events, role first, one id, exactly one finish_reason, usage, [DONE] last); every 8th
// request is repeated non-streaming with the same seed and must match; the server's RSS may not grow
// by more than 32 MiB between the end of the warm-up and the end.
import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { startServer, rssKiB, metric, sleep, TINY } from './harness.mjs';

const SECONDS = Number(process.env.KESTREL_SOAK_SECONDS ?? 120);
const CLIENTS = 16;
let srv;
before(async () => { srv = await startServer(['--model', TINY, '--parallel', '4', '--max-queue', '64']); });
after(async () => { await srv?.stop(); });

const decoder = new TextDecoder('utf-8', { fatal: true });

async function streamOnce(body) {
  const r = await fetch(`${srv.base}/v1/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }) });
  assert.equal(r.status, 200);
  assert.match(r.headers.get('content-type'), /text\/event-stream/);
  const bytes = new Uint8Array(await r.arrayBuffer());
  const text = decoder.decode(bytes);  // throws on broken UTF-8
  assert.ok(text.endsWith('data: [DONE]\n\n'), 'stream must end with [DONE]');
  const events = text.split('\n\n').filter((e) => e.length);
  const chunks = [];
  for (const e of events.slice(0, -1)) {
    assert.ok(e.startsWith('data: '), `bad frame ${e.slice(0, 80)}`);
    chunks.push(JSON.parse(e.slice(6)));
  }
  assert.equal(chunks[0].choices[0].delta.role, 'assistant');
  assert.equal(new Set(chunks.map((c) => c.id)).size, 1);
  const finishes = chunks.filter((c) => c.choices[0]?.finish_reason);
  assert.equal(finishes.length, 1);
  const usage = chunks[chunks.length - 1];
  assert.deepEqual(usage.choices, []);
  assert.ok(usage.usage.completion_tokens >= 1 && usage.usage.completion_tokens <= body.max_tokens);
  let content = '', reasoning = '';
  for (const c of chunks) {
    content += c.choices[0]?.delta?.content ?? '';
    reasoning += c.choices[0]?.delta?.reasoning_content ?? '';
  }
  return { content, reasoning, finish: finishes[0].choices[0].finish_reason, tokens: usage.usage.completion_tokens };
}

test(`soak: ${CLIENTS} concurrent streaming clients for ${SECONDS} s`, async () => {
  const words = ['alpha', 'beta', 'gamma', 'delta', '你好', 'émoji 😀', 'code()', 'the', 'weather', 'story'];
  let ok = 0, failed = 0, compared = 0, tokens = 0;
  const errors = [];
  const t0 = performance.now();
  const warmupMs = Math.min(10000, SECONDS * 1000 / 4);
  let rss0 = 0;
  const endAt = t0 + SECONDS * 1000;
  const client = async (id) => {
    let n = 0;
    while (performance.now() < endAt) {
      const seed = id * 100000 + n;
      const prompt = Array.from({ length: 1 + (seed % 7) }, (_, i) => words[(seed + i * 3) % words.length]).join(' ');
      const body = { messages: [{ role: 'user', content: prompt }], max_tokens: 8 + (seed % 25), seed, temperature: 0.8,
        chat_template_kwargs: { enable_thinking: seed % 2 === 0 } };
      try {
        const s = await streamOnce(body);
        tokens += s.tokens;
        if (n % 8 === 0) {
          const r = await fetch(`${srv.base}/v1/chat/completions`, { method: 'POST', headers: { 'content-type': 'application/json' },
            body: JSON.stringify(body) });
          const j = await r.json();
          assert.equal(j.choices[0].message.content ?? '', s.content);
          assert.equal(j.choices[0].message.reasoning_content ?? '', s.reasoning);
          ++compared;
        }
        ++ok;
      } catch (e) {
        ++failed;
        if (errors.length < 5) errors.push(String(e.stack ?? e));
      }
      ++n;
    }
  };
  const sampler = (async () => {
    await sleep(warmupMs);
    rss0 = rssKiB(srv.proc.pid);
  })();
  await Promise.all([...Array.from({ length: CLIENTS }, (_, i) => client(i)), sampler]);
  const rss1 = rssKiB(srv.proc.pid);
  const secs = (performance.now() - t0) / 1000;
  const running = await metric(srv.base, 'kestrel_requests_running');
  const queued = await metric(srv.base, 'kestrel_queue_depth');
  console.log(`# soak ${secs.toFixed(1)} s: ${ok} streams ok, ${failed} failed, ${compared} stream/non-stream comparisons, ` +
    `${tokens} tokens (${(tokens / secs).toFixed(1)} tok/s), RSS ${(rss0 / 1024).toFixed(1)} -> ${(rss1 / 1024).toFixed(1)} MiB ` +
    `(+${((rss1 - rss0) / 1024).toFixed(1)} MiB)`);
  assert.deepEqual(errors, []);
  assert.equal(failed, 0);
  assert.ok(ok >= CLIENTS, `only ${ok} streams completed`);
  assert.ok(rss1 - rss0 <= 32 * 1024, `RSS grew by ${(rss1 - rss0) / 1024} MiB`);
  assert.equal(running, 0);
  assert.equal(queued, 0);
  assert.equal((await fetch(`${srv.base}/health`)).status, 200);
});
