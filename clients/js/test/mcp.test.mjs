// The MCP session methods of loom-egress.mjs against a real Streamable HTTP MCP
// server: the official Python SDK's, started by clients/testing/mcp_server.py
// on 127.0.0.1 (port 0) at /v1/mcp/<tool>, behind a bearer check, answering
// as SSE (and, in a second server, as JSON).
//
//   node --test clients/js/test/        # from the repository root
//
// Needs python3 with the `mcp` package (clients/python/requirements-test.txt);
// without it these tests fail, they do not skip.

import { test, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import http from 'node:http';
import path from 'node:path';
import readline from 'node:readline';
import { fileURLToPath } from 'node:url';

import { ExecutorClient, McpSession, McpError, EgressError, SseParser } from '../loom-egress.mjs';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const SERVER = path.resolve(HERE, '..', '..', 'testing', 'mcp_server.py');
const TOKEN = 'mcp-test-token-0123456789';

/** @param {boolean} json */
async function startServer(json) {
  const args = [SERVER, '--tool', 'demo', '--token', TOKEN];
  if (json) args.push('--json');
  const proc = spawn(process.env.PYTHON ?? 'python3', args, { stdio: ['ignore', 'pipe', 'ignore'] });
  const rl = readline.createInterface({ input: proc.stdout });
  const line = await new Promise((resolve) => {
    rl.once('line', resolve);
    proc.once('exit', () => resolve(''));
  });
  rl.close();
  const m = /^port (\d+)$/.exec(String(line));
  if (!m) {
    proc.kill();
    throw new Error(`the MCP test server did not start (is \`mcp\` installed?): ${line}`);
  }
  return { proc, url: `http://127.0.0.1:${m[1]}` };
}

/** @type {{proc: import('node:child_process').ChildProcess, url: string}} */
let sse;
/** @type {{proc: import('node:child_process').ChildProcess, url: string}} */
let jsonSrv;

before(async () => {
  [sse, jsonSrv] = await Promise.all([startServer(false), startServer(true)]);
});

after(() => {
  for (const s of [sse, jsonSrv]) s?.proc.kill('SIGTERM');
});

/** @param {string} url @param {string} [token] */
const client = (url, token = TOKEN) => new ExecutorClient(url, { token, timeoutMs: 10000 });

/** @param {string} url */
async function checkSession(url) {
  const s = await client(url).mcpSession('demo');
  let sid;
  try {
    assert.ok(s.sessionId);
    assert.equal(s.protocolVersion, '2025-11-25');
    assert.equal(s.serverInfo.name, 'clients-test');
    assert.deepEqual((await s.listTools()).map((t) => t.name).sort(), ['echo', 'refused', 'shout']);
    const r = await s.callTool('echo', { text: 'hi' });
    assert.equal(r.isError, false);
    assert.equal(r.content[0].text, 'echo: hi');
    assert.deepEqual((await s.listResources()).map((x) => x.uri), ['demo://greeting']);
    assert.equal((await s.readResource('demo://greeting')).contents[0].text, 'hello from a resource');
    assert.deepEqual((await s.listPrompts()).map((p) => p.name), ['greet']);
    assert.equal((await s.getPrompt('greet', { name: 'Ann' })).messages[0].content.text, 'Say hello to Ann');
    const shout = await s.request('tools/call', { name: 'shout', arguments: { text: 'a' } });
    assert.equal(shout.content[0].text, 'A');
    await s.ping();
    sid = s.sessionId;
  } finally {
    await s.close();
  }
  assert.equal(s.sessionId, undefined);
  // Closed: the server no longer knows the session id.
  const stale = new McpSession(client(url).mcpUrl('demo'), { token: TOKEN });
  stale.sessionId = sid;
  stale.protocolVersion = '2025-11-25';
  await assert.rejects(stale.listTools(), (e) => (e instanceof EgressError || e instanceof McpError) && e.status === 404);
}

test('a session over SSE answers', async () => {
  await checkSession(sse.url);
});

test('a session over JSON answers', async () => {
  await checkSession(jsonSrv.url);
});

test('a JSON-RPC error is typed, with reason and fact_id', async () => {
  for (const url of [sse.url, jsonSrv.url]) {
    const s = await client(url).mcpSession('demo');
    try {
      await assert.rejects(s.callTool('refused', { url: 'https://example.org/' }), (e) => {
        assert.ok(e instanceof McpError);
        assert.equal(e.code, -32001);
        assert.match(e.rpcMessage, /not allowed/);
        assert.equal(e.reason, 'mcp_tool_not_allowed');
        assert.equal(e.factId, 'fact-0001');
        assert.equal(e.data.tool, 'refused');
        return true;
      });
      await assert.rejects(s.request('no/such/method'), (e) => e instanceof McpError && e.code === -32601 && e.reason === undefined);
      assert.equal((await s.callTool('echo', { text: 'x' })).content[0].text, 'echo: x');
    } finally {
      await s.close();
    }
  }
});

test('await using closes the session', async () => {
  const s = await client(sse.url).mcpSession('demo');
  const sid = s.sessionId;
  await s[Symbol.asyncDispose]();
  assert.equal(s.sessionId, undefined);
  const stale = new McpSession(client(sse.url).mcpUrl('demo'), { token: TOKEN });
  stale.sessionId = sid;
  stale.protocolVersion = '2025-11-25';
  await assert.rejects(stale.ping());
});

test('the bearer token is sent', async () => {
  await assert.rejects(client(sse.url, 'wrong-token').mcpSession('demo'), (e) => {
    assert.ok(e instanceof EgressError);
    assert.equal(e.status, 401);
    assert.equal(e.code, 'unauthorized');
    return true;
  });
});

test('mcpUrl and mcpHeaders for an SDK', () => {
  const c = new ExecutorClient('http://127.0.0.1:3130/', { token: 't0k' });
  assert.equal(c.mcpUrl('my tool'), 'http://127.0.0.1:3130/v1/mcp/my%20tool');
  assert.deepEqual(c.mcpHeaders(), { Authorization: 'Bearer t0k' });
});

test('answers are read within maxAnswerBytes', async () => {
  const s = await client(sse.url).mcpSession('demo', { maxAnswerBytes: 600 });
  try {
    await assert.rejects(s.listTools(), (e) => e instanceof EgressError && e.code === 'too_large');
  } finally {
    await s.close();
  }
});

test('the SSE parser: multi-line data, comments, ids, split chunks', () => {
  const p = new SseParser();
  const text = '\ufeff: a comment\r\nevent: message\nid: 7\ndata: {"a":\ndata:  1}\nretry: 10\nunknown: x\n\n:keep-alive\n\ndata\n\nid: 8\r\ndata:x\r\n\r\ndata: unfinished';
  const got = [];
  for (let i = 0; i < text.length; i += 3) got.push(...p.push(text.slice(i, i + 3)));
  assert.deepEqual(got, [
    { event: 'message', data: '{"a":\n 1}', id: '7' },
    { event: 'message', data: '', id: '7' },
    { event: 'message', data: 'x', id: '8' },
  ]);
  assert.throws(() => new SseParser().push('data: ' + 'x'.repeat(2 << 20)), (e) => e instanceof EgressError && e.code === 'too_large');
});

test('a stream of comments only is cut at the timeout', async () => {
  const timers = new Set();
  const srv = http.createServer((req, res) => {
    req.resume();
    res.writeHead(200, { 'content-type': 'text/event-stream', 'mcp-session-id': 's-1' });
    const t = setInterval(() => res.write(': still here\n\n'), 50);
    timers.add(t);
    res.on('close', () => clearInterval(t));
  });
  await new Promise((r) => srv.listen(0, '127.0.0.1', r));
  try {
    const url = `http://127.0.0.1:${srv.address().port}/v1/mcp/demo`;
    const t0 = Date.now();
    await assert.rejects(new McpSession(url, { token: 't', timeoutMs: 1000 }).open(), (e) => e instanceof EgressError && e.code === 'timeout');
    assert.ok(Date.now() - t0 < 10000);
  } finally {
    for (const t of timers) clearInterval(t);
    srv.closeAllConnections();
    await new Promise((r) => srv.close(r));
  }
});
