// Example kernel in JavaScript: the same as examples/kernel.py with the
// JavaScript client (clients/js/loom-egress.mjs). Start the proxy and the
// executor as the README says, then:
//
//   node examples/kernel.mjs
//
// Serves the fake weather API on 127.0.0.2:8787, invokes the three tools,
// prints their results and every denial the proxy recorded meanwhile. Exit
// status 0 when everything behaved as described.

import http from 'node:http';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import { ProxyClient, ExecutorClient, EgressError } from '../clients/js/loom-egress.mjs';

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const CONTROL = process.env.EGRESS_CONTROL_URL || 'http://127.0.0.1:3129';
const EXECUTOR = process.env.EGRESS_EXECUTOR_URL || 'http://127.0.0.1:3130';

function token() {
  if (process.env.EGRESS_CONTROL_TOKEN) return process.env.EGRESS_CONTROL_TOKEN;
  const file = path.join(ROOT, 'var', 'egress-control.token');
  try {
    return fs.readFileSync(file, 'utf8').trim();
  } catch {
    console.error(`no control token: set EGRESS_CONTROL_TOKEN (or start the proxy so it writes ${file})`);
    process.exit(1);
  }
}

const show = (facts, indent = '   ') => {
  for (const f of facts) {
    console.log(`${indent}fact seq=${f.seq} ${f.reason} ${f.target?.host}:${f.target?.port} (${f.detail})`);
  }
};

const proxy = new ProxyClient(CONTROL, { token: token() });
const executor = new ExecutorClient(EXECUTOR, { token: token() });
for (const [name, c] of [['proxy', proxy], ['executor', executor]]) {
  if (!(await c.health({ timeoutMs: 2000 }))) {
    console.error(`the ${name} does not answer; start it first (see docs/clients.md, 'The examples')`);
    process.exit(1);
  }
}

const origin = http.createServer((req, res) => {
  const city = new URL(req.url ?? '/', 'http://x').searchParams.get('city') ?? '?';
  res.writeHead(200, { 'content-type': 'application/json' });
  res.end(JSON.stringify({ city, temp: 21, sky: 'clear' }));
});
await new Promise((resolve, reject) => origin.once('error', reject).listen(8787, '127.0.0.2', resolve));

// The newest fact so far: everything after it is this script's doing.
let start = 0;
for (;;) {
  const page = await proxy.facts({ after: start, limit: 1000 });
  start = page.next;
  if (page.facts.length < 1000) break;
}

const problems = [];
const weather = { city: 'Oslo', origin: 'http://127.0.0.2:8787', also_try: 'http://evil.example/' };
for (const [tool, input] of [['weather-py', weather], ['weather-js', weather], ['hello-rust', { name: 'kernel' }]]) {
  console.log(`== invoke ${tool} ${JSON.stringify(input)}`);
  let r;
  try {
    r = await executor.invoke(tool, input, { idempotencyKey: `example-js-${tool}-${process.pid}`, invocationTimeoutMs: 15000 });
  } catch (e) {
    if (!(e instanceof EgressError)) throw e;
    console.log(`   failed: ${e.message}`);
    problems.push(tool);
    continue;
  }
  if (!r.ok) {
    console.log(`   error: ${JSON.stringify(r.error)}`);
    problems.push(tool);
    continue;
  }
  console.log(`   run ${r.run_id} in ${r.duration_ms} ms`);
  console.log(`   output: ${JSON.stringify(r.output)}`);
  for (const e of r.emits) console.log(`   emit:   ${JSON.stringify(e)}`);
  show(r.facts);
  if (tool.startsWith('weather') && (r.output.status !== 200 || r.facts.map((f) => f.reason).join() !== 'not_allowlisted')) {
    problems.push(tool);
  }
}

console.log(`== facts since seq ${start} (GET /v1/facts/stream)`);
const seen = [];
for await (const f of proxy.tailFacts({ after: start, timeoutMs: 2000 })) seen.push(f);
show(seen);
if (seen.length < 2) problems.push(`expected 2 denial facts, saw ${seen.length}`);

origin.close();
origin.closeAllConnections?.();
if (problems.length) {
  console.log(`PROBLEMS: ${problems.join(', ')}`);
  process.exit(1);
}
console.log('all good');
