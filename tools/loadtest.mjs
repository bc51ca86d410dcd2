// loadtest.mjs - N concurrent streaming clients against a tandem router for a
// bounded time; prints requests/s, TTFT and TPOT percentiles, errors.
//   node tools/loadtest.mjs URL MODEL CLIENTS SECONDS [MAX_TOKENS] [ROUTER_PID]
// Each client loops: POST /v1/completions (stream) with a distinct prompt,
// reads the SSE to [DONE]. With ROUTER_PID, the router's RSS is sampled every
// second (memory must stay flat).
import fs from 'node:fs';
const [url, model, clients = '8', seconds = '20', maxTok = '32', pid] = process.argv.slice(2);
const words = ['Once upon a time', 'One day', 'Lily and Max', 'The big dog', 'In the park', 'A little bird', 'The sun was'];
const ttft = [], tpot = [];
let ok = 0, errors = 0, tokens = 0;
const errs = {};
const rss = () => { try { return +/VmRSS:\s+(\d+)/.exec(fs.readFileSync(`/proc/${pid}/status`, 'utf8'))[1]; } catch { return -1; } };
const rssSamples = [];
const end = Date.now() + seconds * 1000;

async function one(i, n) {
  const t0 = performance.now();
  const body = { model, prompt: `${words[(i + n) % words.length]} ${i}-${n}`, max_tokens: +maxTok, temperature: 0.8, seed: n, stream: true };
  const res = await fetch(`${url}/v1/completions`, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body) });
  if (res.status !== 200) throw new Error(`HTTP ${res.status} ${await res.text()}`);
  const dec = new TextDecoder();
  let buf = '', first = 0, last = 0, n_tok = 0, done = false;
  for await (const chunk of res.body) {
    buf += dec.decode(chunk, { stream: true });
    let k;
    while ((k = buf.indexOf('\n\n')) >= 0) {
      const ev = buf.slice(0, k); buf = buf.slice(k + 2);
      if (!ev.startsWith('data: ')) continue;
      const d = ev.slice(6);
      if (d === '[DONE]') { done = true; continue; }
      const j = JSON.parse(d);
      if (j.error) throw new Error(`stream error: ${j.error.message}`);
      if (j.choices?.[0]?.text) { const now = performance.now(); if (!first) first = now; last = now; n_tok++; }
    }
  }
  if (!done) throw new Error('stream ended without [DONE]');
  if (first) ttft.push(first - t0);
  if (n_tok > 1) tpot.push((last - first) / (n_tok - 1));
  tokens += n_tok;
}

async function client(i) {
  for (let n = 0; Date.now() < end; n++) {
    try { await one(i, n); ok++; } catch (e) { errors++; const m = String(e.message).slice(0, 120); errs[m] = (errs[m] || 0) + 1; }
  }
}

const pct = (a, p) => { if (!a.length) return NaN; const s = [...a].sort((x, y) => x - y); return s[Math.min(s.length - 1, Math.floor(p / 100 * s.length))]; };
const timer = pid ? setInterval(() => rssSamples.push(rss()), 1000) : null;
if (pid) rssSamples.push(rss());
const t0 = Date.now();
await Promise.all(Array.from({ length: +clients }, (_, i) => client(i)));
const el = (Date.now() - t0) / 1000;
if (timer) { clearInterval(timer); rssSamples.push(rss()); }
console.log(`clients ${clients}, ${el.toFixed(1)} s: ${ok} ok, ${errors} errors, ${(ok / el).toFixed(2)} req/s, ${(tokens / el).toFixed(1)} tokens/s`);
for (const [name, a] of [['TTFT ms', ttft], ['TPOT ms', tpot]])
  console.log(`${name}: p50 ${pct(a, 50).toFixed(1)}  p90 ${pct(a, 90).toFixed(1)}  p99 ${pct(a, 99).toFixed(1)}  max ${pct(a, 100).toFixed(1)}`);
if (pid) console.log(`router RSS KiB: start ${rssSamples[0]}, after 1 s ${rssSamples[1]}, end ${rssSamples.at(-1)}, max ${Math.max(...rssSamples)}`);
for (const [m, c] of Object.entries(errs)) console.log(`error x${c}: ${m}`);
process.exit(errors ? 1 : 0);
