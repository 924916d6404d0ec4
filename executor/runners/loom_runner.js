'use strict';
/*
 * Loom Egress reference runner for Node.js tools (one file, no dependencies).
 *
 * Speaks the child side of the executor's protocol (docs/protocol.md):
 * newline-delimited JSON on the fds named in LOOM_IPC_FDS ("3,4": read, write).
 *
 *   // As a launcher: the tool module exports run(input, ctx) (may be async).
 *   command = ["node", "loom_runner.js", "tools/weather.js"]
 *   command = ["node", "loom_runner.js", "tools/weather.js:handler"]
 *
 *   // As a library, from the tool's own main:
 *   const loom = require('./loom_runner.js');
 *   loom.main(async (input, ctx) => { ctx.emit({step: 'fetched'}); return {temp: 21}; });
 *
 * Requiring the tool module is the load phase: it runs before `ready`, while
 * the run is not active, so load-time code gets no network. run() is called
 * exactly once; its (awaited) return value is the result, and a thrown error
 * becomes an `error` message (stack on stderr).
 */

const fs = require('fs');
const net = require('net');
const path = require('path');

function channel() {
  const spec = process.env.LOOM_IPC_FDS;
  if (!spec) throw new Error('LOOM_IPC_FDS is not set: not started by the executor');
  const parts = spec.split(',').map((x) => parseInt(x, 10));
  if (parts.length !== 2 || parts.some((x) => !Number.isInteger(x))) {
    throw new Error('bad LOOM_IPC_FDS ' + JSON.stringify(spec));
  }
  const [rfd, wfd] = parts;
  let buf = Buffer.alloc(0);
  let waiting = null;
  let ended = false;
  const lines = [];
  // A socket handle (epoll), not fs.createReadStream: the latter parks a
  // blocking read() in a libuv worker thread, and exit then waits for that
  // thread forever, so the child never exited on its own.
  const stream = new net.Socket({ fd: rfd, readable: true, writable: false });
  stream.on('data', (chunk) => {
    buf = Buffer.concat([buf, chunk]);
    let i;
    while ((i = buf.indexOf(10)) >= 0) {
      lines.push(buf.subarray(0, i).toString('utf8'));
      buf = buf.subarray(i + 1);
    }
    flush();
  });
  const finish = () => { ended = true; flush(); };
  stream.on('end', finish);
  stream.on('error', finish);
  function flush() {
    if (!waiting) return;
    if (lines.length) {
      const w = waiting; waiting = null;
      let msg;
      try { msg = JSON.parse(lines.shift()); } catch (e) { w.reject(e); return; }
      w.resolve(msg);
    } else if (ended) {
      const w = waiting; waiting = null;
      w.resolve(null);
    }
  }
  return {
    send(msg) {
      // Synchronous writes keep messages ordered and complete before exit.
      const data = Buffer.from(JSON.stringify(msg) + '\n', 'utf8');
      let off = 0;
      while (off < data.length) {
        try {
          off += fs.writeSync(wfd, data, off);
        } catch (e) {
          if (e.code !== 'EAGAIN') throw e;
        }
      }
    },
    recv() {
      return new Promise((resolve, reject) => { waiting = { resolve, reject }; flush(); });
    },
    close() { stream.destroy(); },
  };
}

class Context {
  constructor(ch, msg) {
    this._ch = ch;
    this.runId = msg.run_id;
    this.idempotencyKey = msg.idempotency_key;
  }
  /** Record a fact for this run; it lands before the result. */
  emit(fact) { this._ch.send({ t: 'emit', fact }); }
  /**
   * fetch(url, init) through the run's proxy, always (Node's global fetch and
   * http ignore HTTP_PROXY). init: {method, headers, body}. Resolves to
   * {status, headers, body (string), text(), json()}.
   */
  fetch(url, init) { return proxyFetch(url, init || {}); }
}

/** The run's proxy from HTTP_PROXY: {host, port, auth header}. */
function runProxy() {
  const raw = process.env.HTTPS_PROXY || process.env.HTTP_PROXY;
  if (!raw) throw new Error('no HTTP_PROXY: not started by the executor');
  const u = new URL(raw);
  const auth = 'Basic ' + Buffer.from(decodeURIComponent(u.username) + ':' + decodeURIComponent(u.password)).toString('base64');
  return { host: u.hostname, port: Number(u.port || 3128), auth };
}

function proxyFetch(url, init) {
  const http = require('http');
  const target = new URL(url);
  const proxy = runProxy();
  const method = (init.method || 'GET').toUpperCase();
  const headers = Object.assign({}, init.headers || {});
  const body = init.body === undefined || init.body === null ? null : Buffer.from(init.body);
  if (body) headers['content-length'] = String(body.length);
  const collect = (res, resolve) => {
    const chunks = [];
    res.on('data', (c) => chunks.push(c));
    res.on('end', () => {
      const text = Buffer.concat(chunks).toString('utf8');
      resolve({ status: res.statusCode, headers: res.headers, body: text, text: async () => text, json: async () => JSON.parse(text) });
    });
  };
  if (target.protocol === 'http:') {
    // Absolute-form request to the proxy.
    return new Promise((resolve, reject) => {
      const req = http.request({
        host: proxy.host, port: proxy.port, method, path: target.href,
        headers: Object.assign({ host: target.host, 'proxy-authorization': proxy.auth }, headers),
        agent: false,
      }, (res) => collect(res, resolve));
      req.on('error', reject);
      req.end(body || undefined);
    });
  }
  if (target.protocol !== 'https:') return Promise.reject(new Error('ctx.fetch: unsupported scheme ' + target.protocol));
  const https = require('https');
  const tls = require('tls');
  const port = Number(target.port || 443);
  const authority = target.hostname + ':' + port;
  return new Promise((resolve, reject) => {
    const connect = http.request({
      host: proxy.host, port: proxy.port, method: 'CONNECT', path: authority,
      headers: { host: authority, 'proxy-authorization': proxy.auth }, agent: false,
    });
    connect.on('error', reject);
    connect.on('connect', (res, socket) => {
      if (res.statusCode !== 200) {
        socket.destroy();
        resolve({ status: res.statusCode, headers: res.headers, body: '', text: async () => '', json: async () => null });
        return;
      }
      const req = https.request({
        method, path: target.pathname + target.search, headers: Object.assign({ host: target.host }, headers),
        // No agent: an agent (even agent: false) would open its own
        // connection instead of this TLS over the tunnel. SNI names hosts
        // only (RFC 6066): none for an address.
        createConnection: () => tls.connect({ socket, servername: require('net').isIP(target.hostname) ? undefined : target.hostname }),
      }, (r) => collect(r, resolve));
      req.on('error', reject);
      req.end(body || undefined);
    });
    connect.end();
  });
}

/**
 * Resolve once everything written to stdout/stderr so far is flushed. Writes
 * to pipes and files complete synchronously on Linux, so usually nothing is
 * pending and this resolves at once (an empty write's callback would cost the
 * invocation a turn of the event loop, ~0.6 ms); what a full pipe left
 * queued is waited for.
 */
function flushStdio() {
  const pending = [process.stdout, process.stderr].filter((s) => s.writableLength > 0);
  return Promise.all(pending.map((s) => new Promise((resolve) => {
    try { s.write('', () => resolve()); } catch (_) { resolve(); }
  })));
}

function errorMessage(e) {
  if (e && e.name && e.message !== undefined) return e.name + ': ' + e.message;
  return String(e);
}

/**
 * Serve one invocation with run(input, ctx); load() (optional) runs before
 * `ready` and may return the run function. Exits the process.
 */
async function main(run, load) {
  const ch = channel();
  ch.send({ t: 'booted' });
  try {
    if (load) {
      const loaded = await load();
      if (!run) run = loaded;
    }
    if (typeof run !== 'function') throw new TypeError('the tool has no run(input, ctx) function');
  } catch (e) {
    process.stderr.write((e && e.stack ? e.stack : String(e)) + '\n');
    await flushStdio();
    ch.send({ t: 'error', message: 'load failed: ' + errorMessage(e) });
    process.exit(1);
  }
  // stdout and stderr are created on first use: before ready, so not on
  // the invocation's path.
  void process.stdout;
  void process.stderr;
  ch.send({ t: 'ready' });
  const msg = await ch.recv();
  if (!msg || msg.t !== 'invoke') process.exit(0);
  let code = 0;
  let reply;
  try {
    const output = await run(msg.input, new Context(ch, msg));
    reply = { t: 'result', output: output === undefined ? null : output };
    JSON.stringify(reply);
  } catch (e) {
    process.stderr.write((e && e.stack ? e.stack : String(e)) + '\n');
    reply = { t: 'error', message: errorMessage(e) };
    code = 1;
  }
  // The executor kills the child as soon as the result arrives: flush the
  // tool's own output first so none of it is lost.
  await flushStdio();
  ch.send(reply);
  ch.close();
  process.exit(code);
}

/**
 * `path/to/tool.js[:fn]` → the function (`run` by default, or a module that is
 * itself a function). CommonJS modules are required; ES modules (`.mjs`, or
 * `"type": "module"` packages) are imported.
 */
async function loadTarget(target) {
  const idx = target.lastIndexOf(':');
  const file = path.resolve(idx > 0 ? target.slice(0, idx) : target);
  const fn = idx > 0 ? target.slice(idx + 1) : 'run';
  let mod;
  if (file.endsWith('.mjs')) {
    mod = await import(require('url').pathToFileURL(file).href);
  } else {
    try {
      mod = require(file);
    } catch (e) {
      if (!e || e.code !== 'ERR_REQUIRE_ESM') throw e;
      mod = await import(require('url').pathToFileURL(file).href);
    }
  }
  if (typeof mod === 'function' && fn === 'run') return mod;
  if (mod && typeof mod[fn] === 'function') return mod[fn];
  if (mod && mod.default && typeof mod.default[fn] === 'function') return mod.default[fn];
  if (mod && typeof mod.default === 'function' && fn === 'run') return mod.default;
  throw new Error(file + ' exports no function ' + JSON.stringify(fn));
}

module.exports = { main, loadTarget, Context, proxyFetch };

if (require.main === module) {
  if (process.argv.length !== 3) {
    process.stderr.write('usage: loom_runner.js path/to/tool.js[:function]\n');
    process.exit(2);
  }
  main(null, () => loadTarget(process.argv[2]));
}
