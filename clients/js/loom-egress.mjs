// Loom Egress kernel client for JavaScript/TypeScript (Node.js >= 18).
//
// One ES module, no dependencies, no build step: types are JSDoc, which
// TypeScript reads with `allowJs`/`checkJs`. Uses the global fetch.
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
    code = err.code || err.kind || code;
    message = err.message || message;
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
   * `unknown_tool` (404), `bad_request` (400) and `unauthorized` (401) throw
   * EgressError. The HTTP timeout defaults to the invocation's own budget
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
}
