// Loom Egress kernel client for JavaScript/TypeScript (Node.js >= 18).
//
// One ES module, no dependencies, no build step: `npm install ./clients/js`
// (package `loom-egress`), types in loom-egress.d.ts (and JSDoc here). Uses
// the global fetch.
//
//   import { ProxyClient, ExecutorClient, EgressError } from './loom-egress.mjs';
//
//   const proxy = new ProxyClient('http://127.0.0.1:3129');   // token: EGRESS_CONTROL_TOKEN
//   const run = await proxy.createRun('weather', { labels: { kernel: 'k1' } });
//   // ... hand run.proxy_url to the tool as HTTP_PROXY/HTTPS_PROXY ...
//   await proxy.endRun(run.run_id);
//   for await (const fact of proxy.tailFacts({ after: 0, timeoutMs: 5000 })) console.log(fact.reason);
//
//   const executor = new ExecutorClient('http://127.0.0.1:3130');
//   const result = await executor.invoke('weather', { city: 'Oslo' }, { idempotencyKey: 'k-1' });
//
//   const s = await executor.mcpSession('fetch');      // an MCP session with a confined tool
//   const tools = await s.listTools();
//   await s.close();
//
// Every call has a timeout. A non-2xx answer throws EgressError with the HTTP
// status, the JSON error `code` (the executor's `error.kind` for invocations)
// and its message. Node's fetch ignores HTTP_PROXY, so the kernel's own
// environment never reroutes these calls.
//
// API references: docs/api.md (proxy control API), docs/executor.md (invocation API).

/** Default timeout of one call, in milliseconds. @type {number} */
export const DEFAULT_TIMEOUT_MS = 10000;

/**
 * @typedef {{kind: string, host: string, port: number}} FactTarget
 * @typedef {{type: string, schema: string, seq: number, id: string, at: string,
 *   run_id: string|null, tool: string|null, reason: string, mode: string,
 *   target: FactTarget|null, resolved: string[], policy: string, detail: string,
 *   count: number}} Fact
 * @typedef {{facts: Fact[], next: number}} FactPage
 * @typedef {{run_id: string, tool: string, state: 'created'|'active'|'ended',
 *   created_at: string, expires_at: string, ended_at?: string, end_reason?: string,
 *   labels: Record<string, string>, slots: {max: number, in_use: number},
 *   upstream_idle?: number, bytes?: {up: number, down: number}}} RunView
 * @typedef {RunView & {secret: string, proxy_url: string}} NewRun
 * @typedef {{kind: string, message: string, stderr_tail?: string, phase?: string}} InvocationError
 * @typedef {{ok: boolean, tool: string, output?: any, error?: InvocationError,
 *   emits: any[], run_id?: string, facts: Fact[], stdout?: string, exit?: string,
 *   duration_ms?: number}} InvocationResult
 * @typedef {{token?: string, timeoutMs?: number}} ClientOptions
 * @typedef {{timeoutMs?: number}} CallOptions
 */

/**
 * A failed call. `status` is 0 when no answer arrived (`connection_error`,
 * `timeout`); `code` is the error body's `code` (or the executor's `error.kind`);
 * `detail` is the server's message, prefixed with the method and path.
 */
export class EgressError extends Error {
  /**
   * @param {number} status HTTP status, or 0
   * @param {string} code `run_not_found`, `unknown_tool`, `unauthorized`, `busy`, … or a client-side code
   * @param {string} message
   * @param {any} [body] the decoded JSON answer, if any
   */
  constructor(status, code, message, body) {
    super(`${status} ${code}: ${message}`);
    this.name = 'EgressError';
    /** @type {number} */ this.status = status;
    /** @type {string} */ this.code = code;
    /** @type {string} */ this.detail = message;
    /** @type {any} */ this.body = body;
  }
}

/**
 * @param {string} method
 * @param {string} path
 * @param {number} status
 * @param {string} text
 * @returns {never}
 */
function fail(method, path, status, text) {
  let code = `http_${status}`;
  let message = text.trim().slice(0, 500) || `HTTP ${status}`;
  let body;
  try {
    body = JSON.parse(text);
  } catch {
    body = undefined;
  }
  const err = body && typeof body === 'object' ? body.error : undefined;
  if (err && typeof err === 'object') {
    // Proxy and executor API: {"error":{"code",…}}; invocation: {"error":{"kind",…}}.
    const named = err.code || err.kind;
    if (typeof named === 'string') code = named;
    message = String(err.message || message);
  }
  throw new EgressError(status, code, `${method} ${path}: ${message}`.slice(0, 600), body);
}

/** One base URL, a bearer token, JSON in and out, a timeout on every call. */
class Http {
  /**
   * @param {string} baseUrl
   * @param {ClientOptions} [opts]
   */
  constructor(baseUrl, opts = {}) {
    const u = new URL(baseUrl);
    if (u.protocol !== 'http:' && u.protocol !== 'https:') {
      throw new TypeError(`base URL must be http(s)://host:port, got ${baseUrl}`);
    }
    this.baseUrl = baseUrl.replace(/\/+$/, '');
    this.token = opts.token ?? (typeof process !== 'undefined' ? process.env.EGRESS_CONTROL_TOKEN : undefined);
    this.timeoutMs = opts.timeoutMs ?? DEFAULT_TIMEOUT_MS;
  }

  /** @param {boolean} json */
  headers(json) {
    /** @type {Record<string, string>} */
    const h = { accept: 'application/json' };
    if (this.token) h.authorization = `Bearer ${this.token}`;
    if (json) h['content-type'] = 'application/json';
    return h;
  }

  /**
   * @param {string} method
   * @param {string} path
   * @param {any} [body]
   * @param {{timeoutMs?: number, raw?: boolean}} [opts]
   * @returns {Promise<any>}
   */
  async request(method, path, body, opts = {}) {
    const timeoutMs = opts.timeoutMs ?? this.timeoutMs;
    let res;
    let text;
    try {
      res = await fetch(this.baseUrl + path, {
        method,
        headers: this.headers(body !== undefined),
        body: body === undefined ? undefined : JSON.stringify(body),
        signal: AbortSignal.timeout(timeoutMs),
      });
      text = await res.text();
    } catch (e) {
      const err = /** @type {any} */ (e);
      if (err && (err.name === 'TimeoutError' || err.name === 'AbortError')) {
        throw new EgressError(0, 'timeout', `${method} ${path}: no answer within ${timeoutMs} ms`);
      }
      const cause = err && err.cause ? `: ${err.cause.code || err.cause.message}` : '';
      throw new EgressError(0, 'connection_error', `${method} ${path}: ${err && err.message}${cause}`);
    }
    if (!res.ok) fail(method, path, res.status, text);
    if (opts.raw) return text;
    try {
      return text ? JSON.parse(text) : null;
    } catch {
      throw new EgressError(res.status, 'bad_response', `${method} ${path}: answer is not JSON`);
    }
  }

  /** @param {string} path @param {CallOptions} [opts] */
  async probe(path, opts = {}) {
    try {
      await this.request('GET', path, undefined, { ...opts, raw: true });
      return true;
    } catch (e) {
      if (e instanceof EgressError) return false;
      throw e;
    }
  }
}

/** @param {string} s */
const seg = (s) => encodeURIComponent(String(s));

/** @param {number} ms */
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** The proxy's control API (`[proxy] control`, e.g. http://127.0.0.1:3129). */
export class ProxyClient {
  /**
   * @param {string} controlUrl
   * @param {ClientOptions} [opts] token (default: EGRESS_CONTROL_TOKEN), timeoutMs
   */
  constructor(controlUrl, opts = {}) {
    this.http = new Http(controlUrl, opts);
  }

  /**
   * `POST /v1/runs`: the run with its `secret` and `proxy_url` (only returned here).
   * @param {string} tool
   * @param {{runId?: string, labels?: Record<string, string>, activate?: boolean} & CallOptions} [opts]
   * @returns {Promise<NewRun>}
   */
  createRun(tool, opts = {}) {
    /** @type {Record<string, any>} */
    const body = { tool, activate: opts.activate ?? true };
    if (opts.runId !== undefined) body.run_id = opts.runId;
    if (opts.labels !== undefined) body.labels = opts.labels;
    return this.http.request('POST', '/v1/runs', body, opts);
  }

  /**
   * `POST /v1/runs/{id}/grants`: allow this one run `target` ("name:port")
   * beyond its tool's allowlist, for `uses` fetches (default 1) until `ttlMs`
   * (default: the run's end). For a kernel, after asking a person; an
   * address, a name resolving only to denied addresses or a host of another
   * tool's credential is `422 grant_not_permitted`.
   * @param {string} runId @param {string} target
   * @param {{ttlMs?: number, uses?: number} & CallOptions} [opts]
   * @returns {Promise<{target: string, uses_left: number, expires_at: string, fact_id?: string}>}
   */
  grant(runId, target, opts = {}) {
    const body = { target };
    if (opts.ttlMs !== undefined) body.ttl_ms = opts.ttlMs;
    if (opts.uses !== undefined) body.uses = opts.uses;
    return this.http.request('POST', `/v1/runs/${seg(runId)}/grants`, body, opts);
  }

  /**
   * `POST /v1/runs/{id}/activate`.
   * @param {string} runId @param {CallOptions} [opts] @returns {Promise<RunView>}
   */
  activateRun(runId, opts) {
    return this.http.request('POST', `/v1/runs/${seg(runId)}/activate`, undefined, opts);
  }

  /**
   * `DELETE /v1/runs/{id}`: revokes the credential, severs open fetches.
   * @param {string} runId @param {CallOptions} [opts] @returns {Promise<RunView>}
   */
  endRun(runId, opts) {
    return this.http.request('DELETE', `/v1/runs/${seg(runId)}`, undefined, opts);
  }

  /**
   * `GET /v1/runs/{id}`.
   * @param {string} runId @param {CallOptions} [opts] @returns {Promise<RunView>}
   */
  getRun(runId, opts) {
    return this.http.request('GET', `/v1/runs/${seg(runId)}`, undefined, opts);
  }

  /**
   * One page of facts with `seq > after` (all runs, or one with `runId`).
   * @param {{after?: number, limit?: number, runId?: string} & CallOptions} [opts]
   * @returns {Promise<FactPage>}
   */
  facts(opts = {}) {
    const q = `?after=${Math.trunc(opts.after ?? 0)}&limit=${Math.trunc(opts.limit ?? 100)}`;
    const path = opts.runId === undefined ? `/v1/facts${q}` : `/v1/runs/${seg(opts.runId)}/facts${q}`;
    return this.http.request('GET', path, undefined, opts);
  }

  /**
   * Facts from `GET /v1/facts/stream` (replay after the cursor, then live).
   * Keep-alive comments are skipped; a dropped or silent connection (nothing
   * for `readTimeoutMs`; the proxy sends a keep-alive every 15 s) is reopened
   * from the last `id` seen. Ends after `timeoutMs` (total), when
   * `stop(fact)` returns true (after yielding that fact), when `signal`
   * aborts, or when the caller breaks out of the loop. Caller errors (401,
   * 400, …) throw EgressError; `503 too_many_streams` and connection failures
   * are retried.
   * @param {{after?: number, timeoutMs?: number, readTimeoutMs?: number,
   *   reconnectDelayMs?: number, stop?: (fact: Fact) => boolean, signal?: AbortSignal}} [opts]
   * @returns {AsyncGenerator<Fact, void, void>}
   */
  async *tailFacts(opts = {}) {
    let cursor = Math.trunc(opts.after ?? 0);
    const readTimeoutMs = opts.readTimeoutMs ?? 45000;
    const reconnectDelayMs = opts.reconnectDelayMs ?? 500;
    const deadline = opts.timeoutMs === undefined ? Infinity : Date.now() + opts.timeoutMs;
    const done = () => Date.now() >= deadline || (opts.signal?.aborted ?? false);
    while (!done()) {
      const ctl = new AbortController();
      const onAbort = () => ctl.abort();
      opts.signal?.addEventListener('abort', onAbort);
      /** @type {ReturnType<typeof setTimeout>|undefined} */
      let idle;
      const arm = () => {
        clearTimeout(idle);
        idle = setTimeout(() => ctl.abort(), Math.max(0, Math.min(readTimeoutMs, deadline - Date.now())));
      };
      /** @type {ReadableStreamDefaultReader<Uint8Array>|undefined} */
      let reader;
      try {
        arm();
        const path = `/v1/facts/stream?after=${cursor}`;
        const res = await fetch(this.http.baseUrl + path, {
          headers: { ...this.http.headers(false), accept: 'text/event-stream' },
          signal: ctl.signal,
        });
        if (res.status === 503) throw new Error('stream refused: 503');
        if (!res.ok) fail('GET', path, res.status, await res.text());
        if (!res.body) throw new Error('no body');
        reader = res.body.getReader();
        const decoder = new TextDecoder();
        let buf = '';
        let event = 'message';
        /** @type {string[]} */
        let data = [];
        for (;;) {
          arm();
          const { value, done: eof } = await reader.read();
          if (eof) throw new Error('stream closed');
          buf += decoder.decode(value, { stream: true });
          let nl;
          while ((nl = buf.indexOf('\n')) >= 0) {
            const line = buf.slice(0, nl).replace(/\r$/, '');
            buf = buf.slice(nl + 1);
            if (line === '') {
              const fact = dispatch(event, data);
              event = 'message';
              data = [];
              if (!fact) continue;
              if (Number.isSafeInteger(fact.seq)) cursor = Math.max(cursor, fact.seq);
              yield fact;
              if (opts.stop && opts.stop(fact)) return;
              if (done()) return;
              continue;
            }
            if (line.startsWith(':')) continue; // keep-alive comment
            const i = line.indexOf(':');
            const field = i < 0 ? line : line.slice(0, i);
            let v = i < 0 ? '' : line.slice(i + 1);
            if (v.startsWith(' ')) v = v.slice(1);
            if (field === 'data') data.push(v);
            else if (field === 'event') event = v;
            else if (field === 'id' && /^\d+$/.test(v)) cursor = Math.max(cursor, Number(v));
          }
        }
      } catch (e) {
        if (e instanceof EgressError) throw e;
        // Dropped, refused or silent: reconnect from the cursor.
        if (done()) return;
        await sleep(Math.max(0, Math.min(reconnectDelayMs, deadline - Date.now())));
      } finally {
        clearTimeout(idle);
        opts.signal?.removeEventListener('abort', onAbort);
        ctl.abort();
        reader?.releaseLock?.();
      }
    }
  }

  /**
   * Answer fetches held for a grant (tools with `on_unlisted = "ask"`): for
   * each `EGRESS_PENDING` fact on the fact stream, `decide(fact)` returns a
   * falsy value (leave it: it is denied when its `ask_timeout_ms` runs out),
   * `true` (grant its target once to its run) or `{uses, ttlMs}`. A run that
   * ended meanwhile is skipped. Ends as `tailFacts` does (`timeoutMs`,
   * `stop`, `signal`).
   * @param {(fact: Fact) => (boolean | {uses?: number, ttlMs?: number} | Promise<boolean | {uses?: number, ttlMs?: number}>)} decide
   * @param {{after?: number, timeoutMs?: number, stop?: (fact: Fact) => boolean, signal?: AbortSignal}} [opts]
   * @returns {Promise<void>}
   */
  async onPending(decide, opts = {}) {
    for await (const fact of this.tailFacts(opts)) {
      if (fact.type !== 'EGRESS_PENDING' || !fact.run_id) continue;
      const answer = await decide(fact);
      if (!answer) continue;
      const t = fact.target ?? {};
      try {
        await this.grant(fact.run_id, `${t.host}:${t.port}`, answer === true ? {} : answer);
      } catch (e) {
        if (!(e instanceof EgressError) || (e.status !== 404 && e.status !== 409)) throw e;
      }
    }
  }

  /** `POST /v1/policy/reload`. @param {CallOptions} [opts] @returns {Promise<{policy: string, tools: string[]}>} */
  reloadPolicy(opts) {
    return this.http.request('POST', '/v1/policy/reload', undefined, opts);
  }

  /** True when `/healthz` answers 200. @param {CallOptions} [opts] @returns {Promise<boolean>} */
  health(opts) {
    return this.http.probe('/healthz', opts);
  }

  /** True when `/readyz` answers 200. @param {CallOptions} [opts] @returns {Promise<boolean>} */
  ready(opts) {
    return this.http.probe('/readyz', opts);
  }

  /** Prometheus/OpenMetrics text. @param {CallOptions} [opts] @returns {Promise<string>} */
  metrics(opts = {}) {
    return this.http.request('GET', '/metrics', undefined, { ...opts, raw: true });
  }
}

/**
 * @param {string} event
 * @param {string[]} data
 * @returns {Fact|null}
 */
function dispatch(event, data) {
  if (!data.length || (event !== 'fact' && event !== 'pending' && event !== 'message')) return null;
  try {
    const v = JSON.parse(data.join('\n'));
    return v && typeof v === 'object' ? v : null;
  } catch {
    return null;
  }
}

/** How many `in_progress` answers an invocation follows to the owning cell. */
export const FOLLOW_MAX = 3;

/** The executor's invocation API (`[executor] listen`, e.g. http://127.0.0.1:3130). */
export class ExecutorClient {
  /**
   * @param {string} url
   * @param {ClientOptions} [opts] token (default: EGRESS_CONTROL_TOKEN), timeoutMs
   */
  constructor(url, opts = {}) {
    this.http = new Http(url, opts);
  }

  /**
   * `POST /v1/invocations`. A tool that failed (`ok: false`: timeout,
   * aborted, tool_error, …) is a result, not an exception; `busy` (503),
   * `executable_mismatch` (503: a file the tool runs does not match its pin,
   * no child starts), `unknown_tool` (404), `bad_request` (400) and
   * `unauthorized` (401) throw EgressError. The HTTP timeout defaults to the invocation's own budget
   * (`invocationTimeoutMs`, the request's `timeout_ms`) plus 30 s.
   *
   * In a fleet, a keyed invocation running at another cell answers `409
   * in_progress` naming that cell's `control_url`: the same request is sent
   * there (at most `FOLLOW_MAX` hops), where it waits for the answer.
   * `idempotency_unavailable` (503) throws: nothing ran.
   * @param {string} tool
   * @param {any} input
   * @param {{idempotencyKey?: string, invocationTimeoutMs?: number, runId?: string} & CallOptions} [opts]
   * @returns {Promise<InvocationResult>}
   */
  async invoke(tool, input, opts = {}) {
    /** @type {Record<string, any>} */
    const body = { tool, input: input === undefined ? null : input };
    if (opts.idempotencyKey !== undefined) body.idempotency_key = opts.idempotencyKey;
    if (opts.invocationTimeoutMs !== undefined) body.timeout_ms = Math.trunc(opts.invocationTimeoutMs);
    if (opts.runId !== undefined) body.run_id = opts.runId;
    const timeoutMs = opts.timeoutMs ?? Math.max(this.http.timeoutMs, (opts.invocationTimeoutMs ?? 30000) + 30000);
    let http = this.http;
    for (let hop = 0; ; hop++) {
      try {
        return await http.request('POST', '/v1/invocations', body, { timeoutMs });
      } catch (e) {
        const owner = e instanceof EgressError && e.status === 409 && e.code === 'in_progress' ? e.body?.control_url : null;
        if (!owner || hop >= FOLLOW_MAX || owner.replace(/\/+$/, '') === http.baseUrl) throw e;
        http = new Http(owner, { token: http.token, timeoutMs: http.timeoutMs });
      }
    }
  }

  /**
   * `POST /v1/invocations/{id}/abort` by idempotency key or run id; 404
   * `not_found` when nothing with that id is in flight.
   * @param {string} keyOrRunId @param {CallOptions} [opts] @returns {Promise<{aborted: boolean, id: string}>}
   */
  abort(keyOrRunId, opts) {
    return this.http.request('POST', `/v1/invocations/${seg(keyOrRunId)}/abort`, undefined, opts);
  }

  /** True when `/healthz` answers 200. @param {CallOptions} [opts] @returns {Promise<boolean>} */
  health(opts) {
    return this.http.probe('/healthz', opts);
  }

  /** OpenMetrics text. @param {CallOptions} [opts] @returns {Promise<string>} */
  metrics(opts = {}) {
    return this.http.request('GET', '/metrics', undefined, { ...opts, raw: true });
  }

  /**
   * The Streamable HTTP endpoint of an MCP tool, `<url>/v1/mcp/<tool>`: what
   * to give an MCP SDK or an agent host, with `mcpHeaders()`.
   * @param {string} tool @returns {string}
   */
  mcpUrl(tool) {
    return `${this.http.baseUrl}/v1/mcp/${seg(tool)}`;
  }

  /**
   * The headers an MCP SDK sends to `mcpUrl(tool)`: the executor's bearer
   * token (empty when there is none).
   * @returns {Record<string, string>}
   */
  mcpHeaders() {
    return this.http.token ? { Authorization: `Bearer ${this.http.token}` } : {};
  }

  /**
   * Open an MCP session with a confined tool (`initialize`, then
   * `notifications/initialized`); end it with `close()` or `await using`.
   * @param {string} tool @param {{timeoutMs?: number, maxAnswerBytes?: number}} [opts]
   * @returns {Promise<McpSession>}
   */
  async mcpSession(tool, opts = {}) {
    const s = new McpSession(this.mcpUrl(tool), {
      token: this.http.token,
      timeoutMs: opts.timeoutMs ?? this.http.timeoutMs,
      maxAnswerBytes: opts.maxAnswerBytes,
    });
    await s.open();
    return s;
  }
}

// -- MCP ----------------------------------------------------------------------

/** The MCP revision this client asks for: the session-based one (`Mcp-Session-Id`). */
export const MCP_PROTOCOL_VERSION = '2025-11-25';
/** The most bytes one MCP answer may have (a JSON body, or an SSE stream up to the answer). */
export const MCP_MAX_ANSWER_BYTES = 16 << 20;
const SSE_LINE_MAX = 1 << 20;

/**
 * A JSON-RPC error answer: `code` (an integer, e.g. -32602), `message` and
 * `data`. A call the executor refused carries the deny `reason`
 * (`mcp_tool_not_allowed`, `mcp_arguments_not_allowed`, …) and the `fact_id`
 * of the fact it recorded in `data`: see `reason`, `factId`.
 */
export class McpError extends Error {
  /**
   * @param {number} code
   * @param {string} message
   * @param {any} [data]
   * @param {string} [method]
   * @param {number} [status] the HTTP status it came with (200, or e.g. 404 for a session the server no longer knows)
   */
  constructor(code, message, data, method = '', status = 200) {
    super(`${method || 'mcp'}: JSON-RPC error ${code}: ${message}`);
    this.name = 'McpError';
    /** @type {number} */ this.status = status;
    /** @type {number} */ this.code = code;
    /** @type {string} */ this.rpcMessage = message;
    /** @type {any} */ this.data = data;
    /** @type {string} */ this.method = method;
  }

  /** `data.reason`, when the answer carries one. @returns {string|undefined} */
  get reason() {
    const v = this.data && typeof this.data === 'object' ? this.data.reason : undefined;
    return typeof v === 'string' ? v : undefined;
  }

  /** `data.fact_id`, when the answer carries one. @returns {string|undefined} */
  get factId() {
    const v = this.data && typeof this.data === 'object' ? this.data.fact_id : undefined;
    return typeof v === 'string' ? v : undefined;
  }
}

/**
 * An incremental `text/event-stream` parser (HTML Living Standard, "Parsing
 * an event stream"): feed it text, get the events whose blank line arrived.
 * `data:` lines are joined with newlines, comments skipped, `retry:` and
 * unknown fields ignored, an event without data not dispatched. A line over
 * 1 MiB throws EgressError.
 */
export class SseParser {
  constructor() {
    this.buf = '';
    this.event = '';
    /** @type {string[]} */ this.data = [];
    /** @type {string|undefined} */ this.lastId = undefined;
    this.first = true;
  }

  /**
   * @param {string} text
   * @returns {{event: string, data: string, id: string|undefined}[]}
   */
  push(text) {
    this.buf += text;
    if (this.first && this.buf.length > 0) {
      if (this.buf.charCodeAt(0) === 0xfeff) this.buf = this.buf.slice(1);
      this.first = false;
    }
    /** @type {{event: string, data: string, id: string|undefined}[]} */
    const out = [];
    for (;;) {
      const m = /\r\n|\r|\n/.exec(this.buf);
      if (!m) break;
      // A lone \r at the very end may be half of \r\n: wait for more.
      if (m[0] === '\r' && m.index === this.buf.length - 1) break;
      const line = this.buf.slice(0, m.index);
      this.buf = this.buf.slice(m.index + m[0].length);
      this.line(line, out);
    }
    if (this.buf.length > SSE_LINE_MAX) {
      throw new EgressError(0, 'too_large', `an SSE line is over ${SSE_LINE_MAX} bytes`);
    }
    return out;
  }

  /**
   * @param {string} line
   * @param {{event: string, data: string, id: string|undefined}[]} out
   */
  line(line, out) {
    if (line === '') {
      if (this.data.length) out.push({ event: this.event || 'message', data: this.data.join('\n'), id: this.lastId });
      this.event = '';
      this.data = [];
      return;
    }
    if (line.startsWith(':')) return;
    const i = line.indexOf(':');
    const field = i < 0 ? line : line.slice(0, i);
    let v = i < 0 ? '' : line.slice(i + 1);
    if (v.startsWith(' ')) v = v.slice(1);
    if (field === 'data') this.data.push(v);
    else if (field === 'event') this.event = v;
    else if (field === 'id' && !v.includes('\0')) this.lastId = v;
  }
}

/**
 * The JSON-RPC answer with id `id` in a message or a batch, if any.
 * @param {any} value @param {number} id @returns {any}
 */
function answerTo(value, id) {
  for (const m of Array.isArray(value) ? value : [value]) {
    if (m && typeof m === 'object' && m.id === id && ('result' in m || 'error' in m)) return m;
  }
  return undefined;
}

const asyncDispose = /** @type {symbol} */ (Symbol.asyncDispose ?? Symbol.for('Symbol.asyncDispose'));

/**
 * @typedef {{token?: string, timeoutMs?: number, maxAnswerBytes?: number}} McpOptions
 * @typedef {{name: string, description?: string, inputSchema?: any, [k: string]: any}} McpTool
 * @typedef {{content: any[], isError?: boolean, structuredContent?: any, [k: string]: any}} McpToolResult
 */

/**
 * One MCP session with a tool through the executor's Streamable HTTP endpoint
 * (`/v1/mcp/<tool>`): JSON-RPC over POST, each answer JSON or an SSE stream,
 * the session named by `Mcp-Session-Id`, ended by DELETE.
 *
 *   await using s = await executor.mcpSession('fetch');   // or: try { … } finally { await s.close(); }
 *   const tools = await s.listTools();
 *   const r = await s.callTool('fetch', { url: 'https://example.org/' });
 *
 * A JSON-RPC error answer throws McpError; a transport failure or a non-2xx
 * answer that is not JSON-RPC throws EgressError. Every answer is read within
 * `maxAnswerBytes`. Requests and notifications the server sends on an
 * answer's stream are skipped (this client declares no capabilities).
 */
export class McpSession {
  /**
   * @param {string} url the endpoint, e.g. `executor.mcpUrl('fetch')`
   * @param {McpOptions} [opts] token (default: EGRESS_CONTROL_TOKEN), timeoutMs, maxAnswerBytes
   */
  constructor(url, opts = {}) {
    this.http = new Http(url, opts);
    this.url = this.http.baseUrl;
    this.maxAnswerBytes = opts.maxAnswerBytes ?? MCP_MAX_ANSWER_BYTES;
    /** @type {string|undefined} */ this.sessionId = undefined;
    /** @type {string|undefined} */ this.protocolVersion = undefined;
    /** @type {Record<string, any>} */ this.serverInfo = {};
    /** @type {Record<string, any>} */ this.capabilities = {};
    this.nextId = 1;
  }

  /**
   * `initialize` (the session id comes with its answer), then
   * `notifications/initialized`. Resolves to the `initialize` result.
   * @param {{clientName?: string, clientVersion?: string}} [opts]
   * @returns {Promise<Record<string, any>>}
   */
  async open(opts = {}) {
    const result = await this.request('initialize', {
      protocolVersion: MCP_PROTOCOL_VERSION,
      capabilities: {},
      clientInfo: { name: opts.clientName ?? 'loom-egress', version: opts.clientVersion ?? '0.1.0' },
    });
    this.protocolVersion = typeof result.protocolVersion === 'string' ? result.protocolVersion : undefined;
    this.serverInfo = result.serverInfo ?? {};
    this.capabilities = result.capabilities ?? {};
    await this.notify('notifications/initialized');
    return result;
  }

  /**
   * `DELETE` the session. A session the server no longer knows (404) or one
   * it does not let clients end (405) counts as closed.
   * @param {CallOptions} [opts]
   * @returns {Promise<void>}
   */
  async close(opts = {}) {
    if (this.sessionId === undefined) return;
    const timeoutMs = opts.timeoutMs ?? this.http.timeoutMs;
    let res;
    try {
      res = await fetch(this.url, { method: 'DELETE', headers: this.headers(false), signal: AbortSignal.timeout(timeoutMs) });
    } catch (e) {
      throw new EgressError(0, 'connection_error', `DELETE ${this.url}: ${/** @type {any} */ (e)?.message}`);
    } finally {
      this.sessionId = undefined;
    }
    const text = await res.text();
    if (![200, 202, 204, 404, 405].includes(res.status)) fail('DELETE', this.url, res.status, text);
  }

  /** For `await using`. @returns {Promise<void>} */
  [asyncDispose]() {
    return this.close();
  }

  /** `tools/list`, every page: the tools the rules let through. @returns {Promise<McpTool[]>} */
  listTools() {
    return this.all('tools/list', 'tools');
  }

  /**
   * `tools/call`: its result (`content`, `isError`, `structuredContent`). A
   * call the rules refuse throws McpError with `reason` and `factId`.
   * @param {string} name @param {Record<string, any>} [args] @param {CallOptions} [opts]
   * @returns {Promise<McpToolResult>}
   */
  callTool(name, args = {}, opts) {
    return /** @type {Promise<McpToolResult>} */ (this.request('tools/call', { name, arguments: args }, opts));
  }

  /** `resources/list`, every page. @returns {Promise<Record<string, any>[]>} */
  listResources() {
    return this.all('resources/list', 'resources');
  }

  /** `resources/read`: `{contents: […]}`. @param {string} uri @returns {Promise<Record<string, any>>} */
  readResource(uri) {
    return this.request('resources/read', { uri });
  }

  /** `prompts/list`, every page. @returns {Promise<Record<string, any>[]>} */
  listPrompts() {
    return this.all('prompts/list', 'prompts');
  }

  /**
   * `prompts/get`: `{messages: […], …}`.
   * @param {string} name @param {Record<string, string>} [args] @returns {Promise<Record<string, any>>}
   */
  getPrompt(name, args) {
    return this.request('prompts/get', args === undefined ? { name } : { name, arguments: args });
  }

  /** `ping`. @returns {Promise<void>} */
  async ping() {
    await this.request('ping');
  }

  /**
   * @param {string} method @param {string} key
   * @returns {Promise<any[]>}
   */
  async all(method, key) {
    /** @type {any[]} */
    const out = [];
    /** @type {string|undefined} */
    let cursor;
    for (let page = 0; page < 1000; page++) {
      const result = await this.request(method, cursor === undefined ? {} : { cursor });
      const items = result[key];
      if (Array.isArray(items)) out.push(...items.filter((i) => i && typeof i === 'object'));
      if (typeof result.nextCursor !== 'string' || !result.nextCursor) return out;
      cursor = result.nextCursor;
    }
    throw new EgressError(0, 'bad_response', `${method}: more than 1000 pages`);
  }

  /**
   * Any JSON-RPC request: its `result` (an object); an error answer throws McpError.
   * @param {string} method @param {Record<string, any>} [params] @param {CallOptions} [opts]
   * @returns {Promise<Record<string, any>>}
   */
  async request(method, params, opts = {}) {
    const id = this.nextId++;
    /** @type {Record<string, any>} */
    const msg = { jsonrpc: '2.0', id, method };
    if (params !== undefined) msg.params = params;
    const answer = await this.post(msg, id, opts.timeoutMs);
    if (!answer) throw new EgressError(0, 'bad_response', `${method}: no answer to request ${id}`);
    const err = answer.error;
    if (err && typeof err === 'object') {
      throw new McpError(Number.isInteger(err.code) ? err.code : 0, String(err.message ?? ''), err.data, method);
    }
    if (!answer.result || typeof answer.result !== 'object' || Array.isArray(answer.result)) {
      throw new EgressError(0, 'bad_response', `${method}: the answer has no result object`);
    }
    return answer.result;
  }

  /**
   * A JSON-RPC notification (no answer expected; the server says 202).
   * @param {string} method @param {Record<string, any>} [params] @param {CallOptions} [opts]
   * @returns {Promise<void>}
   */
  async notify(method, params, opts = {}) {
    /** @type {Record<string, any>} */
    const msg = { jsonrpc: '2.0', method };
    if (params !== undefined) msg.params = params;
    await this.post(msg, undefined, opts.timeoutMs);
  }

  /** @param {boolean} json @returns {Record<string, string>} */
  headers(json) {
    const h = this.http.headers(json);
    h.accept = 'application/json, text/event-stream';
    if (this.sessionId !== undefined) h['mcp-session-id'] = this.sessionId;
    if (this.protocolVersion !== undefined) h['mcp-protocol-version'] = this.protocolVersion;
    return h;
  }

  /**
   * @param {Record<string, any>} msg @param {number|undefined} id @param {number|undefined} timeoutMs
   * @returns {Promise<any>}
   */
  async post(msg, id, timeoutMs) {
    const method = String(msg.method);
    const ms = timeoutMs ?? this.http.timeoutMs;
    const ctl = new AbortController();
    const timer = setTimeout(() => ctl.abort(), ms);
    try {
      const res = await fetch(this.url, { method: 'POST', headers: this.headers(true), body: JSON.stringify(msg), signal: ctl.signal });
      const sid = res.headers.get('mcp-session-id');
      if (sid !== null && this.sessionId === undefined) this.sessionId = sid;
      const ctype = (res.headers.get('content-type') ?? '').split(';')[0].trim().toLowerCase();
      if (ctype === 'text/event-stream' && res.ok && res.body) return await this.fromSse(res.body, id, method);
      const text = await this.readBounded(res.body, method);
      if (id === undefined && res.ok) return undefined;
      let value;
      try {
        value = text ? JSON.parse(text) : undefined;
      } catch {
        value = undefined;
      }
      if (id !== undefined) {
        const found = answerTo(value, id);
        if (found) return found;
      }
      const err = value && typeof value === 'object' && 'jsonrpc' in value ? value.error : undefined;
      if (!res.ok && err && typeof err === 'object' && Number.isInteger(err.code)) {
        // A JSON-RPC error not about this request (id null): the session or the message.
        throw new McpError(err.code, String(err.message ?? ''), err.data, method, res.status);
      }
      // Not JSON-RPC: the endpoint's own error ({"error": {"code", "message"}}).
      if (!res.ok) fail('POST', this.url, res.status, text);
      if (id === undefined) return undefined;
      throw new EgressError(res.status, 'bad_response', `${method}: the answer is not a JSON-RPC answer to ${id}`);
    } catch (e) {
      if (e instanceof EgressError || e instanceof McpError) throw e;
      const err = /** @type {any} */ (e);
      if (ctl.signal.aborted) throw new EgressError(0, 'timeout', `${method}: no answer within ${ms} ms`);
      const cause = err && err.cause ? `: ${err.cause.code || err.cause.message}` : '';
      throw new EgressError(0, 'connection_error', `${method} ${this.url}: ${err && err.message}${cause}`);
    } finally {
      clearTimeout(timer);
    }
  }

  /**
   * @param {ReadableStream<Uint8Array>|null} body @param {string} method
   * @returns {Promise<string>}
   */
  async readBounded(body, method) {
    if (!body) return '';
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let text = '';
    let n = 0;
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) return text + decoder.decode();
        n += value.byteLength;
        if (n > this.maxAnswerBytes) throw new EgressError(0, 'too_large', `${method}: answer is over ${this.maxAnswerBytes} bytes`);
        text += decoder.decode(value, { stream: true });
      }
    } finally {
      reader.cancel().catch(() => {});
    }
  }

  /**
   * @param {ReadableStream<Uint8Array>} body @param {number|undefined} id @param {string} method
   * @returns {Promise<any>}
   */
  async fromSse(body, id, method) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    const parser = new SseParser();
    let n = 0;
    try {
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        n += value.byteLength;
        if (n > this.maxAnswerBytes) throw new EgressError(0, 'too_large', `${method}: answer is over ${this.maxAnswerBytes} bytes`);
        for (const ev of parser.push(decoder.decode(value, { stream: true }))) {
          let v;
          try {
            v = JSON.parse(ev.data);
          } catch {
            continue;
          }
          const found = id === undefined ? undefined : answerTo(v, id);
          if (found) return found;
        }
      }
    } finally {
      reader.cancel().catch(() => {});
    }
    if (id === undefined) return undefined;
    throw new EgressError(0, 'bad_response', `${method}: the stream ended without an answer`);
  }
}
