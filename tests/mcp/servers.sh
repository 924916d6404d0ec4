#!/usr/bin/env bash
# Installs the MCP servers of tests/mcp/requirements-servers.txt into a
# virtualenv of the system's python3 (readable by the executor's confined
# children, which run under other uids): target/mcp-servers by default, or
# $LOOM_MCP_SERVERS. Does nothing when it is there and complete.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest="${LOOM_MCP_SERVERS:-$PWD/target/mcp-servers}"
py=/usr/bin/python3
[ -x "$py" ] || py=/usr/local/bin/python3
if "$dest/bin/python3" -c 'import mcp_server_time, mcp_server_fetch, mcp_server_git' 2>/dev/null; then
  exit 0
fi
rm -rf "$dest"
"$py" -m venv "$dest"
"$dest/bin/pip" install -q --disable-pip-version-check -r tests/mcp/requirements-servers.txt
chmod -R a+rX "$dest"
"$dest/bin/python3" -c 'import mcp_server_time, mcp_server_fetch, mcp_server_git'
echo "MCP servers in $dest"
