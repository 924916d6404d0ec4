// Tests of loom-egress.mjs against the real egress-proxy and egress-executor.
//
//   node --test clients/js/test/        # from the repository root
//
// Binaries: $EGRESS_BIN_DIR (set by tests/tests/clients.rs), else target/debug.
// Loopback only: the proxy's resolver points at a closed loopback port, and the
// one fetch these tests make names an unlisted host, denied before any DNS.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import fs from 'node:fs';
import http from 'node:http';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import { ProxyClient, ExecutorClient, EgressError } from '../loom-egress.mjs';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const ROOT = path.resolve(HERE, '..', '..', '..');
const TOKEN = 'clients-test-token-0123456789';

const TOOL = `
import time, urllib.request, urllib.error

def run(input, ctx):
    input = input or {}
    ctx.emit({"step": "start", "input": input})
    if input.get("sleep"):
        time.sleep(input["sleep"])
    if input.get("fail"):
        raise RuntimeError(input["fail"])
    out = {"echo": input, "run_id": ctx.run_id}
    if input.get("fetch"):
        try:
            with urllib.request.urlopen(input["fetch"], timeout=5) as r:
                out["status"] = r.status
        except urllib.error.HTTPError as e:
            out["status"] = e.code
            out["reason"] = e.headers.get("X-Egress-Deny-Reason")
    return out
`;

/** @returns {Promise<number>} */
function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.on('error', reject);
    s.listen(0, '127.0.0.1', () => {
      const { port } = /** @type {net.AddressInfo} */ (s.address());
      s.close(() => resolve(port));
    });
  });
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** A fetch through the run's proxy with node:http (absolute-form request, Proxy-Authorization). */
function deniedFetch(proxyUrl, target = 'http://unlisted.example/') {
  const p = new URL(proxyUrl);
  const auth = Buffer.from(`${decodeURIComponent(p.username)}:${decodeURIComponent(p.password)}`).toString('base64');
  return new Promise((resolve, reject) => {
    const req = http.request({
      host: p.hostname, port: p.port, method: 'GET', path: target,
      headers: { host: new URL(target).host, 'proxy-authorization': `Basic ${auth}` },
      timeout: 5000,
    }, (res) => {
      res.resume();
      res.on('end', () => resolve({ status: res.statusCode, reason: res.headers['x-egress-deny-reason'] }));
    });
    req.on('timeout', () => req.destroy(new Error('timeout')));
    req.on('error', reject);
    req.end();
  });
}

let dir;
const procs = [];
let proxy;
let executor;
let controlUrl;
let executorUrl;

before(async () => {
  const binDir = process.env.EGRESS_BIN_DIR || path.join(ROOT, 'target', 'debug');
  for (const b of ['egress-proxy', 'egress-executor']) {
    assert.ok(fs.existsSync(path.join(binDir, b)), `${binDir}/${b} not built (cargo build -p egress-proxy -p egress-executor)`);
  }
  dir = fs.mkdtempSync(path.join(os.tmpdir(), 'loom-clients-js-'));
  // Confined tools run as an unprivileged uid: the tool's directory (its
  // cwd, holding its file) must be readable by it.
  fs.chmodSync(dir, 0o755);
  const [pListen, pControl, pExec, pDns] = [await freePort(), await freePort(), await freePort(), await freePort()];
  fs.writeFileSync(path.join(dir, 'echo.py'), TOOL);
  fs.mkdirSync(path.join(dir, 'scratch'));
  const runner = path.join(ROOT, 'executor', 'runners', 'loom_runner.py');
  const config = path.join(dir, 'egress.toml');
  fs.writeFileSync(config, [
    '[proxy]', `listen = "127.0.0.1:${pListen}"`, `control = "127.0.0.1:${pControl}"`, 'facts = ":memory:"',
    '[proxy.dns]', `servers = ["127.0.0.1:${pDns}"]`, 'timeout_ms = 500',
    '[executor]', `listen = "127.0.0.1:${pExec}"`, 'scratch_dir = "scratch"',
    '[tools.asker]', 'egress = []', 'on_unlisted = "ask"', 'ask_timeout_ms = 1500',
    '[tools.echo]', 'egress = ["allowed.example:80"]',
    '[tools.echo.process]', `command = ["python3", ${JSON.stringify(runner)}, "echo.py"]`,
    'timeout_ms = 20000', 'pool = { warm = 1, max = 4 }', '',
  ].join('\n'));
  controlUrl = `http://127.0.0.1:${pControl}`;
  executorUrl = `http://127.0.0.1:${pExec}`;
  proxy = new ProxyClient(controlUrl, { token: TOKEN });
  executor = new ExecutorClient(executorUrl, { token: TOKEN });
  const env = { ...process.env, EGRESS_CONTROL_TOKEN: TOKEN, EGRESS_LOG: 'warn', RUST_LOG: 'warn' };
  for (const [name, client] of [['egress-proxy', proxy], ['egress-executor', executor]]) {
    const log = path.join(dir, `${name}.log`);
    const out = fs.openSync(log, 'w');
    const child = spawn(path.join(binDir, name), ['serve', '--config', config], { env, stdio: ['ignore', 'ignore', out] });
    fs.closeSync(out);
    procs.push(child);
    const t0 = Date.now();
    while (!(await client.health({ timeoutMs: 1000 }))) {
      if (child.exitCode !== null || Date.now() - t0 > 30000) {
        throw new Error(`${name} did not start:\n${fs.readFileSync(log, 'utf8')}`);
      }
      await sleep(50);
    }
  }
});

after(async () => {
  for (const p of procs.reverse()) {
    if (p.exitCode === null) {
      const gone = new Promise((r) => p.once('exit', r));
      p.kill('SIGTERM');
      let timer;
      await Promise.race([gone, new Promise((r) => { timer = setTimeout(r, 10000); })]);
      clearTimeout(timer);
      if (p.exitCode === null && p.signalCode === null) p.kill('SIGKILL');
    }
  }
  if (dir) fs.rmSync(dir, { recursive: true, force: true });
});

/** @param {() => Promise<any>} call @param {number} status @param {string} code */
async function rejectsWith(call, status, code) {
  await assert.rejects(call, (e) => {
    assert.ok(e instanceof EgressError, String(e));
    assert.equal(e.status, status, e.message);
    assert.equal(e.code, code, e.message);
    assert.ok(e.detail);
    return true;
  });
}

test('run lifecycle: create inactive, get, activate, end', async () => {
  const run = await proxy.createRun('echo', { runId: 'js-life-1', labels: { kernel: 'js' }, activate: false });
  assert.equal(run.run_id, 'js-life-1');
  assert.equal(run.state, 'created');
  assert.deepEqual(run.labels, { kernel: 'js' });
  assert.ok(run.secret);
  assert.ok(run.proxy_url.startsWith('http://js-life-1:'));
  assert.equal((await proxy.getRun('js-life-1')).state, 'created');
  assert.equal((await proxy.activateRun('js-life-1')).state, 'active');
  const ended = await proxy.endRun('js-life-1');
  assert.equal(ended.state, 'ended');
  assert.equal(ended.end_reason, 'ended');
  await rejectsWith(() => proxy.activateRun('js-life-1'), 409, 'run_ended');
  // Grants: an address is never granted; an ended run takes none.
  const live = await proxy.createRun('echo');
  await rejectsWith(() => proxy.grant(live.run_id, '127.0.0.1:443', { uses: 2 }), 422, 'grant_not_permitted');
  await proxy.endRun(live.run_id);
  await rejectsWith(() => proxy.grant(live.run_id, 'api.example:443'), 409, 'run_ended');
  const gen = await proxy.createRun('echo');
  assert.equal(gen.state, 'active');
  await proxy.endRun(gen.run_id);
});

test('a denial shows up in facts() and live in tailFacts()', async () => {
  const start = (await proxy.facts({ after: 0, limit: 1000 })).next;
  const run = await proxy.createRun('echo', { runId: 'js-deny-1' });
  const got = [];
  const tail = (async () => {
    for await (const f of proxy.tailFacts({ after: start, timeoutMs: 15000, stop: (f) => f.run_id === 'js-deny-1' })) {
      got.push(f);
    }
  })();
  await sleep(200); // let the stream open: this denial should arrive live
  assert.deepEqual(await deniedFetch(run.proxy_url), { status: 403, reason: 'not_allowlisted' });
  await tail;
  const mine = got.filter((f) => f.run_id === 'js-deny-1');
  assert.equal(mine.length, 1, JSON.stringify(got));
  assert.equal(mine[0].reason, 'not_allowlisted');
  assert.equal(mine[0].target.host, 'unlisted.example');

  const page = await proxy.facts({ runId: 'js-deny-1' });
  assert.deepEqual(page.facts.map((f) => f.id), [mine[0].id]);
  const all = await proxy.facts({ after: start, limit: 1000 });
  assert.ok(all.facts.some((f) => f.id === mine[0].id));
  assert.ok(all.next >= mine[0].seq);
  // Replay with a deadline: the stream ends by itself.
  const replay = [];
  for await (const f of proxy.tailFacts({ after: start, timeoutMs: 1500 })) replay.push(f);
  assert.ok(replay.some((f) => f.id === mine[0].id));
  await proxy.endRun('js-deny-1');
});

test('onPending sees a held fetch', async () => {
  const start = (await proxy.facts({ after: 0, limit: 1000 })).next;
  const run = await proxy.createRun('asker', { runId: 'js-ask-1' });
  const fetched = deniedFetch(run.proxy_url);
  const seen = [];
  await proxy.onPending((f) => { seen.push(f); return false; }, {
    after: start, timeoutMs: 10000, stop: (f) => f.type === 'EGRESS_PENDING',
  });
  assert.equal(seen.length, 1, JSON.stringify(seen));
  assert.equal(seen[0].run_id, 'js-ask-1');
  assert.equal(seen[0].reason, 'pending');
  assert.equal(seen[0].target.host, 'unlisted.example');
  // Left alone: denied when ask_timeout_ms runs out.
  assert.deepEqual(await fetched, { status: 403, reason: 'not_allowlisted' });
  await proxy.endRun('js-ask-1');
});

test('proxy errors are typed', async () => {
  await rejectsWith(() => proxy.createRun('no-such-tool'), 404, 'unknown_tool');
  await rejectsWith(() => proxy.getRun('js-never-made'), 404, 'run_not_found');
  await rejectsWith(() => new ProxyClient(controlUrl, { token: 'wrong-token-0123456789' }).facts(), 401, 'unauthorized');
  await rejectsWith(() => proxy.facts({ after: 2 ** 64 }), 400, 'bad_request');
  await proxy.createRun('echo', { runId: 'js-dup-1' });
  await rejectsWith(() => proxy.createRun('echo', { runId: 'js-dup-1' }), 409, 'run_exists');
  await proxy.endRun('js-dup-1');
  const closed = new ProxyClient(`http://127.0.0.1:${await freePort()}`, { token: TOKEN, timeoutMs: 2000 });
  await rejectsWith(() => closed.getRun('x'), 0, 'connection_error');
});

test('token from EGRESS_CONTROL_TOKEN', async () => {
  const old = process.env.EGRESS_CONTROL_TOKEN;
  process.env.EGRESS_CONTROL_TOKEN = TOKEN;
  try {
    assert.ok(Array.isArray((await new ProxyClient(controlUrl).facts({ limit: 1 })).facts));
  } finally {
    if (old === undefined) delete process.env.EGRESS_CONTROL_TOKEN;
    else process.env.EGRESS_CONTROL_TOKEN = old;
  }
});

test('proxy health, readiness and metrics', async () => {
  assert.equal(await proxy.health(), true);
  assert.equal(await proxy.ready(), true);
  assert.match(await proxy.metrics(), /egress_runs_active/);
});

test('invoke returns output and emits', async () => {
  const r = await executor.invoke('echo', { x: 1 }, { idempotencyKey: 'js-k-1', invocationTimeoutMs: 10000 });
  assert.equal(r.ok, true, JSON.stringify(r));
  assert.deepEqual(r.output.echo, { x: 1 });
  assert.equal(r.output.run_id, r.run_id);
  assert.deepEqual(r.emits, [{ step: 'start', input: { x: 1 } }]);
  assert.deepEqual(r.facts, []);
});

test('an invocation whose tool is denied reports the fact', async () => {
  const r = await executor.invoke('echo', { fetch: 'http://unlisted.example/' }, { runId: 'js-inv-deny-1' });
  assert.equal(r.ok, true, JSON.stringify(r));
  assert.equal(r.run_id, 'js-inv-deny-1');
  assert.equal(r.output.status, 403);
  assert.equal(r.output.reason, 'not_allowlisted');
  assert.deepEqual(r.facts.map((f) => f.reason), ['not_allowlisted']);
  const facts = (await proxy.facts({ runId: 'js-inv-deny-1' })).facts;
  assert.deepEqual(facts.map((f) => f.id), r.facts.map((f) => f.id));
});

test('a failing tool is a result, not an exception', async () => {
  const r = await executor.invoke('echo', { fail: 'boom' });
  assert.equal(r.ok, false);
  assert.equal(r.error.kind, 'tool_error');
  assert.match(r.error.message, /boom/);
});

test('abort a slow tool by its idempotency key', async () => {
  const t0 = Date.now();
  const pending = executor.invoke('echo', { sleep: 30 }, { idempotencyKey: 'js-slow-1' });
  for (;;) {
    try {
      assert.equal((await executor.abort('js-slow-1')).aborted, true);
      break;
    } catch (e) {
      assert.ok(e instanceof EgressError && e.status === 404 && e.code === 'not_found', String(e));
      assert.ok(Date.now() - t0 < 15000, 'never in flight');
      await sleep(50);
    }
  }
  const r = await pending;
  assert.equal(r.ok, false);
  assert.equal(r.error.kind, 'aborted');
  assert.ok(Date.now() - t0 < 20000);
});

test('executor errors are typed', async () => {
  await rejectsWith(() => executor.invoke('no-such-tool', {}), 404, 'unknown_tool');
  await rejectsWith(() => executor.abort('nothing-in-flight'), 404, 'not_found');
  await rejectsWith(() => new ExecutorClient(executorUrl, { token: 'wrong-token-0123456789' }).invoke('echo', {}), 401, 'unauthorized');
});

test('executor health and metrics', async () => {
  assert.equal(await executor.health(), true);
  assert.match(await executor.metrics(), /executor_invocations_total/);
});

test('tailFacts reconnects from the last id after a dropped stream', async () => {
  const cursors = [];
  const srv = http.createServer((req, res) => {
    const after = Number(new URL(req.url, 'http://x').searchParams.get('after'));
    cursors.push(after);
    res.writeHead(200, { 'content-type': 'text/event-stream', connection: 'close' });
    const seq = after + 1;
    res.end(`: keep-alive\n\nevent: fact\nid: ${seq}\ndata: {"seq": ${seq},\ndata:  "reason": "x"}\n\n`);
  });
  await new Promise((r) => srv.listen(0, '127.0.0.1', r));
  try {
    const c = new ProxyClient(`http://127.0.0.1:${srv.address().port}`, { token: TOKEN });
    const seqs = [];
    for await (const f of c.tailFacts({ after: 5, timeoutMs: 10000, reconnectDelayMs: 10, stop: (f) => f.seq >= 8 })) {
      seqs.push(f.seq);
    }
    assert.deepEqual(seqs, [6, 7, 8]);
    assert.deepEqual(cursors, [5, 6, 7]);
  } finally {
    srv.closeAllConnections?.();
    await new Promise((r) => srv.close(r));
  }
});
