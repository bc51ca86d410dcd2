// openai_n_client.mjs - the official `openai` npm client asking a tandem router
// for n = 2 choices, not streamed and streamed.
//
//   node tests/openai_n_client.mjs BASE_URL COMPLETION_MODEL CHAT_MODEL
//
// 1. completions.create (not streamed): greedy "Once upon a time", n 2;
// 2. chat.completions.create (streamed, usage chunk): greedy "Hello", n 2,
//    the deltas gathered per choice index.
// Prints one JSON line {"plain": {"texts", "indexes", "finish", "usage"},
// "streamed": {"texts", "finish", "roles", "usage"}} and exits 0, or prints
// the error and exits 1. The package comes from $OPENAI_NPM_DIR (default
// build/npm), where tests/router/test_router_n.c installs it with npm.
import { createRequire } from 'node:module';
import path from 'node:path';

const [base, cmodel, chatModel] = process.argv.slice(2);
const dir = path.resolve(process.env.OPENAI_NPM_DIR || 'build/npm');
const require = createRequire(path.join(dir, 'package.json'));
const OpenAI = require('openai');
const client = new OpenAI({ baseURL: base, apiKey: 'no-key', maxRetries: 0, timeout: 60000 });

async function main() {
  const r = await client.completions.create({
    model: cmodel, n: 2, temperature: 0, max_tokens: 8, prompt: 'Once upon a time',
  });
  const plain = {
    texts: r.choices.map((c) => c.text),
    indexes: r.choices.map((c) => c.index),
    finish: r.choices.map((c) => c.finish_reason),
    usage: r.usage,
  };
  const stream = await client.chat.completions.create({
    model: chatModel, n: 2, stream: true, temperature: 0, max_tokens: 8,
    messages: [{ role: 'user', content: 'Hello' }],
    stream_options: { include_usage: true },
  });
  const streamed = { texts: [], finish: [], roles: [], usage: null };
  for await (const c of stream) {
    if (c.usage) streamed.usage = c.usage;
    for (const ch of c.choices || []) {
      const i = ch.index;
      streamed.texts[i] = (streamed.texts[i] || '') + (ch.delta.content || '');
      if (ch.delta.role) streamed.roles[i] = ch.delta.role;
      if (ch.finish_reason) streamed.finish[i] = ch.finish_reason;
    }
  }
  console.log(JSON.stringify({ plain, streamed }));
}

main().catch((e) => { console.error(`openai client error: ${e.status || ''} ${e.message}`); process.exit(1); });
