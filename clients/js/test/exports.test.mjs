// loom-egress.d.ts against loom-egress.mjs, without TypeScript: every value
// the module exports is declared, every declared value is exported, and
// every method a declared class names exists on the class.
//
//   node --test clients/js/test/        # from the repository root

import { test } from 'node:test';
import assert from 'node:assert/strict';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

import * as mod from '../loom-egress.mjs';

const HERE = path.dirname(fileURLToPath(import.meta.url));
const DTS = fs.readFileSync(path.join(HERE, '..', 'loom-egress.d.ts'), 'utf8');

/** The `export declare` values of the .d.ts, and each class's members. */
function declared() {
  const values = new Set();
  /** @type {Map<string, Set<string>>} */
  const classes = new Map();
  let current = null;
  for (const line of DTS.split('\n')) {
    const m = /^export declare (const|class|function|let|var) (\w+)/.exec(line);
    if (m) {
      values.add(m[2]);
      if (m[1] === 'class') classes.set(m[2], (current = new Set()));
      continue;
    }
    if (/^}/.test(line)) current = null;
    const member = current && /^ {2}(?:readonly )?(\w+)\??[(:]/.exec(line);
    if (member && member[1] !== 'constructor') current.add(member[1]);
  }
  return { values, classes };
}

test('the .d.ts declares exactly the module’s exports', () => {
  const { values } = declared();
  assert.deepEqual([...values].sort(), Object.keys(mod).sort());
});

test('every member a declared class names exists', () => {
  const { classes } = declared();
  for (const [name, members] of classes) {
    const C = /** @type {any} */ (mod)[name];
    assert.equal(typeof C, 'function', `${name} is a class`);
    const proto = C.prototype;
    for (const m of members) {
      const onProto = m in proto;
      const onInstance = !onProto && Object.getOwnPropertyNames(new C(...ctorArgs(name))).includes(m);
      assert.ok(onProto || onInstance, `${name}.${m} is declared but missing`);
    }
  }
  assert.equal(typeof mod.McpSession.prototype[Symbol.asyncDispose], 'function', 'McpSession is async-disposable');
});

/** @param {string} name */
function ctorArgs(name) {
  if (name === 'EgressError') return [0, 'x', 'y'];
  if (name === 'McpError') return [-1, 'x'];
  if (name === 'SseParser') return [];
  return ['http://127.0.0.1:1', { token: 't' }];
}
