// Types of loom-egress.mjs, written by hand (no build step). Every value the
// module exports is declared here; test/exports.test.mjs checks both ways.

/** Default timeout of one call, in milliseconds. */
export declare const DEFAULT_TIMEOUT_MS: number;
/** How many `in_progress` answers an invocation follows to the owning cell. */
export declare const FOLLOW_MAX: number;
/** The MCP revision this client asks for: the session-based one (`Mcp-Session-Id`). */
export declare const MCP_PROTOCOL_VERSION: string;
/** The most bytes one MCP answer may have. */
export declare const MCP_MAX_ANSWER_BYTES: number;

export interface FactTarget {
  kind: string;
  host: string;
  port: number;
}

export interface Fact {
  type: string;
  schema: string;
  seq: number;
  id: string;
  at: string;
  run_id: string | null;
  tool: string | null;
  reason: string;
  mode: string;
  target: FactTarget | null;
  resolved: string[];
  policy: string;
  detail: string;
  count: number;
  [key: string]: unknown;
}

export interface FactPage {
  facts: Fact[];
  next: number;
}

export interface RunView {
  run_id: string;
  tool: string;
  state: 'created' | 'active' | 'ended';
  created_at: string;
  expires_at: string;
  ended_at?: string;
  end_reason?: string;
  labels: Record<string, string>;
  slots: { max: number; in_use: number };
  upstream_idle?: number;
  bytes?: { up: number; down: number };
}

export interface NewRun extends RunView {
  secret: string;
  proxy_url: string;
}

export interface InvocationError {
  kind: string;
  message: string;
  stderr_tail?: string;
  phase?: string;
}

export interface InvocationResult {
  ok: boolean;
  tool: string;
  output?: any;
  error?: InvocationError;
  emits: any[];
  run_id?: string;
  facts: Fact[];
  stdout?: string;
  exit?: string;
  duration_ms?: number;
}

export interface ClientOptions {
  /** Bearer token; default: `EGRESS_CONTROL_TOKEN`. */
  token?: string;
  timeoutMs?: number;
}

export interface CallOptions {
  timeoutMs?: number;
}

export interface Grant {
  target: string;
  uses_left: number;
  expires_at: string;
  fact_id?: string;
}

export type PendingAnswer = boolean | { uses?: number; ttlMs?: number } | null | undefined;

export interface TailOptions {
  after?: number;
  timeoutMs?: number;
  readTimeoutMs?: number;
  reconnectDelayMs?: number;
  stop?: (fact: Fact) => boolean;
  signal?: AbortSignal;
}

/** A failed call: `status` 0 when no answer arrived; `code` the API's error code. */
export declare class EgressError extends Error {
  constructor(status: number, code: string, message: string, body?: any);
  status: number;
  code: string;
  detail: string;
  body: any;
}

/** The proxy's control API (`[proxy] control`, e.g. http://127.0.0.1:3129). */
export declare class ProxyClient {
  constructor(controlUrl: string, opts?: ClientOptions);
  createRun(
    tool: string,
    opts?: { runId?: string; labels?: Record<string, string>; activate?: boolean } & CallOptions,
  ): Promise<NewRun>;
  grant(runId: string, target: string, opts?: { ttlMs?: number; uses?: number } & CallOptions): Promise<Grant>;
  activateRun(runId: string, opts?: CallOptions): Promise<RunView>;
  endRun(runId: string, opts?: CallOptions): Promise<RunView>;
  getRun(runId: string, opts?: CallOptions): Promise<RunView>;
  facts(opts?: { after?: number; limit?: number; runId?: string } & CallOptions): Promise<FactPage>;
  tailFacts(opts?: TailOptions): AsyncGenerator<Fact, void, void>;
  onPending(
    decide: (fact: Fact) => PendingAnswer | Promise<PendingAnswer>,
    opts?: { after?: number; timeoutMs?: number; stop?: (fact: Fact) => boolean; signal?: AbortSignal },
  ): Promise<void>;
  reloadPolicy(opts?: CallOptions): Promise<{ policy: string; tools: string[] }>;
  health(opts?: CallOptions): Promise<boolean>;
  ready(opts?: CallOptions): Promise<boolean>;
  metrics(opts?: CallOptions): Promise<string>;
}

/** The executor's invocation API and MCP endpoint (`[executor] listen`, e.g. http://127.0.0.1:3130). */
export declare class ExecutorClient {
  constructor(url: string, opts?: ClientOptions);
  invoke(
    tool: string,
    input?: any,
    opts?: { idempotencyKey?: string; invocationTimeoutMs?: number; runId?: string } & CallOptions,
  ): Promise<InvocationResult>;
  abort(keyOrRunId: string, opts?: CallOptions): Promise<{ aborted: boolean; id: string }>;
  health(opts?: CallOptions): Promise<boolean>;
  metrics(opts?: CallOptions): Promise<string>;
  /** `<url>/v1/mcp/<tool>`, for an MCP SDK or an agent host. */
  mcpUrl(tool: string): string;
  /** `{ Authorization: 'Bearer …' }` (empty without a token). */
  mcpHeaders(): Record<string, string>;
  /** An opened MCP session with a confined tool. */
  mcpSession(tool: string, opts?: { timeoutMs?: number; maxAnswerBytes?: number }): Promise<McpSession>;
}

/** A JSON-RPC error answer; a refusal carries `reason` and `fact_id` in `data`. */
export declare class McpError extends Error {
  constructor(code: number, message: string, data?: any, method?: string, status?: number);
  /** The HTTP status it came with: 200, or e.g. 404 for a session the server no longer knows. */
  status: number;
  /** The JSON-RPC error code, e.g. -32602. */
  code: number;
  /** The JSON-RPC error message (`message` holds the method and code too). */
  rpcMessage: string;
  data: any;
  method: string;
  /** `data.reason`, e.g. `mcp_tool_not_allowed`. */
  readonly reason: string | undefined;
  /** `data.fact_id`: the fact the refusal recorded. */
  readonly factId: string | undefined;
}

export interface SseEvent {
  event: string;
  data: string;
  id: string | undefined;
}

/** An incremental `text/event-stream` parser. */
export declare class SseParser {
  constructor();
  /** Feed text; returns the events completed by it. */
  push(text: string): SseEvent[];
}

export interface McpOptions extends ClientOptions {
  maxAnswerBytes?: number;
}

export interface McpTool {
  name: string;
  description?: string;
  inputSchema?: any;
  [key: string]: any;
}

export interface McpToolResult {
  content: any[];
  isError?: boolean;
  structuredContent?: any;
  [key: string]: any;
}

/** One MCP session through the executor's Streamable HTTP endpoint. */
export declare class McpSession {
  constructor(url: string, opts?: McpOptions);
  readonly url: string;
  maxAnswerBytes: number;
  sessionId: string | undefined;
  protocolVersion: string | undefined;
  serverInfo: Record<string, any>;
  capabilities: Record<string, any>;
  open(opts?: { clientName?: string; clientVersion?: string }): Promise<Record<string, any>>;
  close(opts?: CallOptions): Promise<void>;
  [Symbol.asyncDispose](): Promise<void>;
  listTools(): Promise<McpTool[]>;
  callTool(name: string, args?: Record<string, any>, opts?: CallOptions): Promise<McpToolResult>;
  listResources(): Promise<Record<string, any>[]>;
  readResource(uri: string): Promise<Record<string, any>>;
  listPrompts(): Promise<Record<string, any>[]>;
  getPrompt(name: string, args?: Record<string, string>): Promise<Record<string, any>>;
  ping(): Promise<void>;
  request(method: string, params?: Record<string, any>, opts?: CallOptions): Promise<Record<string, any>>;
  notify(method: string, params?: Record<string, any>, opts?: CallOptions): Promise<void>;
}
