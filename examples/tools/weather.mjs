// Example Node.js tool, run by executor/runners/loom_runner.js.
//
// Module-level code is the load phase (the run is not active yet: no network);
// run(input, ctx) is called once. Its only network is HTTP_PROXY, the run's
// proxy URL. Node's global fetch ignores HTTP_PROXY (before Node 24), so
// proxyGet() below shows what a request through the proxy is: plain HTTP in
// absolute form to the proxy with node:http (https:// targets would need a
// CONNECT tunnel instead). The runner's ctx.fetch(url, init) does both for a
// tool (see docs/executor.md, "Tools under strict").
//
// input: {"city": "Oslo", "origin": "http://127.0.0.2:8787", "also_try": "http://evil.example/"}

import http from 'node:http';

/**
 * GET `url` through the run's proxy.
 * @param {string} url an http:// URL
 * @returns {Promise<{status: number, headers: http.IncomingHttpHeaders, body: string}>}
 */
export function proxyGet(url) {
  const proxy = new URL(process.env.HTTP_PROXY || process.env.http_proxy || '');
  const target = new URL(url);
  const auth = Buffer.from(`${decodeURIComponent(proxy.username)}:${decodeURIComponent(proxy.password)}`).toString('base64');
  return new Promise((resolve, reject) => {
    const req = http.request({
      host: proxy.hostname,
      port: proxy.port || 80,
      method: 'GET',
      path: target.href, // absolute form: the proxy reads the target from it
      headers: { host: target.host, 'proxy-authorization': `Basic ${auth}` },
      timeout: 5000,
    }, (res) => {
      const chunks = [];
      res.on('data', (c) => chunks.push(c));
      res.on('end', () => resolve({ status: res.statusCode ?? 0, headers: res.headers, body: Buffer.concat(chunks).toString('utf8') }));
      res.on('error', reject);
    });
    req.on('timeout', () => req.destroy(new Error(`no answer from ${url} within 5 s`)));
    req.on('error', reject);
    req.end();
  });
}

export async function run(input, ctx) {
  const city = input.city ?? 'Oslo';
  const origin = input.origin ?? 'http://127.0.0.2:8787';
  ctx.emit({ step: 'fetch', city });
  const r = await proxyGet(`${origin}/v1/now?city=${encodeURIComponent(city)}`);
  const out = { city, status: r.status, weather: r.status === 200 ? JSON.parse(r.body) : r.body.trim(), by: 'node' };
  if (input.also_try) {
    // Not in this tool's allowlist: 403 before any DNS, recorded as a fact.
    const d = await proxyGet(input.also_try);
    ctx.emit({ step: 'also_try', url: input.also_try, status: d.status });
    out.also_try = { url: input.also_try, status: d.status, deny_reason: d.headers['x-egress-deny-reason'] ?? null };
  }
  return out;
}
