// Starts and stops a real `kestrel serve` process on loopback for the node tests.
// KESTREL_BINARY and KESTREL_SOURCE_DIR come from ctest (tests/server/tests.cmake).
import { spawn } from 'node:child_process';
import fs from 'node:fs';
import path from 'node:path';

export const SRC = process.env.KESTREL_SOURCE_DIR ?? path.resolve(new URL('../..', import.meta.url).pathname);
export const BIN = process.env.KESTREL_BINARY ?? path.join(SRC, 'build', 'kestrel');
export const TINY = path.join(SRC, 'tests', 'fixtures', 'tiny');
export const SCRIPT = path.join(SRC, 'tests', 'server', 'script.json');

// Resolves once "listening on" (and, with waitReady, "ready on") has been printed.
export function startServer(args, { waitReady = true, timeoutMs = 60000 } = {}) {
  return new Promise((resolve, reject) => {
    const proc = spawn(BIN, ['serve', '--port', '0', '--threads', '1', ...args], { stdio: ['ignore', 'pipe', 'pipe'] });
    let out = '';
    let log = '';
    let port = 0;
    let done = false;
    const timer = setTimeout(() => {
      if (!done) { done = true; proc.kill('SIGKILL'); reject(new Error(`server did not start:\n${out}\n${log}`)); }
    }, timeoutMs);
    const srv = {
      proc,
      get port() { return port; },
      get base() { return `http://127.0.0.1:${port}`; },
      get log() { return log; },
      exited: new Promise((r) => proc.on('exit', (code, signal) => r({ code, signal }))),
      async stop(signal = 'SIGTERM', graceMs = 10000) {
        if (proc.exitCode !== null || proc.signalCode !== null) return srv.exited;
        proc.kill(signal);
        const t = setTimeout(() => proc.kill('SIGKILL'), graceMs);
        const r = await srv.exited;
        clearTimeout(t);
        return r;
      },
    };
    proc.stdout.on('data', (d) => {
      out += d;
      const m = out.match(/listening on http:\/\/127\.0\.0\.1:(\d+)\/v1/);
      if (m) port = Number(m[1]);
      if (!done && port && (!waitReady || /ready on /.test(out))) {
        done = true; clearTimeout(timer); resolve(srv);
      }
    });
    proc.stderr.on('data', (d) => { log += d; });
    proc.on('exit', (code) => {
      if (!done) { done = true; clearTimeout(timer); reject(new Error(`server exited (${code}):\n${out}\n${log}`)); }
    });
  });
}

export async function metric(base, name, headers = {}) {
  const r = await fetch(`${base}/metrics`, { headers });
  const t = await r.text();
  const m = t.match(new RegExp(`^${name} (\\S+)$`, 'm'));
  return m ? Number(m[1]) : NaN;
}

// All unlabelled metrics of one /metrics scrape, by name.
export async function metrics(base, headers = {}) {
  const t = await (await fetch(`${base}/metrics`, { headers })).text();
  const out = {};
  for (const m of t.matchAll(/^([a-z_]+) (\S+)$/gm)) out[m[1]] = Number(m[2]);
  return out;
}

export function rssKiB(pid) {
  const s = fs.readFileSync(`/proc/${pid}/status`, 'utf8');
  return Number(s.match(/VmRSS:\s+(\d+) kB/)[1]);
}

export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
