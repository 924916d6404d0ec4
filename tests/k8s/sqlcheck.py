#!/usr/bin/env python3
"""Checks deploy/sql/*.sql without a database: every statement parses with
PostgreSQL's own parser (pglast, libpg_query), each is a CREATE OR REPLACE
VIEW (the file only reads the exported facts), reads only egress_facts, and
names only the columns of issue 23's egress_facts table (or its own output
columns). Exit 1 with every problem."""

import pathlib
import sys

import pglast
from pglast import ast
from pglast.visitors import Visitor

ROOT = pathlib.Path(__file__).resolve().parents[2]
TABLE = "egress_facts"
COLUMNS = {"cell", "epoch", "seq", "id", "at", "run_id", "tool", "reason", "mode", "policy", "body"}


class Refs(Visitor):
    def __init__(self):
        self.tables, self.columns, self.aliases = set(), set(), set()

    def visit_RangeVar(self, _ancestors, node):
        self.tables.add(node.relname)

    def visit_ColumnRef(self, _ancestors, node):
        names = [f.sval for f in node.fields if isinstance(f, ast.String)]
        if names:
            self.columns.add(names[-1])

    def visit_ResTarget(self, _ancestors, node):
        if node.name:
            self.aliases.add(node.name)


def check(path):
    problems = []
    try:
        stmts = pglast.parse_sql(path.read_text())
    except pglast.parser.ParseError as e:
        return [f"{path.relative_to(ROOT)}: does not parse: {e}"]
    if not stmts:
        problems.append(f"{path.relative_to(ROOT)}: no statements")
    for raw in stmts:
        s = raw.stmt
        if not (isinstance(s, ast.ViewStmt) and s.replace):
            problems.append(f"{path.relative_to(ROOT)}: {type(s).__name__}: only CREATE OR REPLACE VIEW belongs here")
            continue
        v = Refs()
        v(s.query)
        view = s.view.relname
        if v.tables != {TABLE}:
            problems.append(f"{path.relative_to(ROOT)}: view {view} reads {sorted(v.tables)}, not only {TABLE}")
        unknown = v.columns - COLUMNS - v.aliases
        if unknown:
            problems.append(f"{path.relative_to(ROOT)}: view {view} names columns {sorted(unknown)} that {TABLE} lacks")
    return problems


def main():
    files = sorted((ROOT / "deploy/sql").glob("*.sql"))
    problems = [p for f in files for p in check(f)]
    for p in problems:
        print("FAIL", p)
    if problems or not files:
        sys.exit("sqlcheck: %d problem(s)" % len(problems) if files else "sqlcheck: no deploy/sql/*.sql")
    n = sum(len(pglast.parse_sql(f.read_text())) for f in files)
    print(f"sqlcheck: {n} views in {len(files)} file(s) parse and read only {TABLE}'s columns")


if __name__ == "__main__":
    main()
