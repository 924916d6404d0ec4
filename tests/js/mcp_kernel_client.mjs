// The project's own JavaScript kernel client (clients/js) against a confined
// session tool's endpoint: argv is the executor's base URL, the token, the
// tool, a tool the rules allow and one they refuse; prints one JSON object:
// the listed tool names, the allowed call's text, and the refused call's
// McpError (code, reason, factId).
import { ExecutorClient, McpError } from '../../clients/js/loom-egress.mjs';

const [base, token, tool, allowed, refused] = process.argv.slice(2);
const s = await new ExecutorClient(base, { token }).mcpSession(tool);
const out = {};
try {
  out.tools = (await s.listTools()).map((t) => t.name).sort();
  const r = await s.callTool(allowed, { timezone: 'Etc/UTC' });
  out.text = (r.content || []).map((c) => c.text || '').join('');
  try {
    await s.callTool(refused, {});
    out.refused = null;
  } catch (e) {
    if (!(e instanceof McpError)) throw e;
    out.refused = { code: e.code, reason: e.reason, factId: e.factId };
  }
} finally {
  await s.close();
}
console.log(JSON.stringify(out));
