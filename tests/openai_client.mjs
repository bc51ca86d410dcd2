// openai_client.mjs - the official `openai` npm client against a tandem router.
//
//   node tests/openai_client.mjs BASE_URL MODEL MODE [API_KEY]
//
// MODE "chat": streamed chat completion (one user message "Hello");
// MODE "completion": streamed text completion of "Once upon a time".
// Prints one JSON line {"text", "chunks", "finish_reason", "usage"} and exits 0,
// or prints the error and exits 1. The package is loaded from $OPENAI_NPM_DIR
// (default build/npm), where tests/router/test_router.c installs it with npm.
import { createRequire } from 'node:module';
import path from 'node:path';

const [base, model, mode, key] = process.argv.slice(2);
const dir = path.resolve(process.env.OPENAI_NPM_DIR || 'build/npm');
const require = createRequire(path.join(dir, 'package.json'));
const OpenAI = require('openai');
const client = new OpenAI({ baseURL: base, apiKey: key || 'no-key', maxRetries: 0, timeout: 60000 });

async function main() {
  let stream;
  if (mode === 'chat') {
    stream = await client.chat.completions.create({
      model, stream: true, temperature: 0, max_tokens: 8, seed: 1,
      messages: [{ role: 'user', content: 'Hello' }],
      stream_options: { include_usage: true },
    });
  } else {
    stream = await client.completions.create({
      model, stream: true, temperature: 0, max_tokens: 8, prompt: 'Once upon a time',
      stream_options: { include_usage: true },
    });
  }
  let text = '', chunks = 0, finish = null, usage = null;
  for await (const c of stream) {
    chunks++;
    if (c.usage) usage = c.usage;
    const ch = c.choices && c.choices[0];
    if (!ch) continue;
    text += mode === 'chat' ? (ch.delta.content || '') : (ch.text || '');
    if (ch.finish_reason) finish = ch.finish_reason;
  }
  // The models list through the same client (GET /v1/models).
  const models = [];
  for await (const m of client.models.list()) models.push(m.id);
  console.log(JSON.stringify({ text, chunks, finish_reason: finish, usage, models }));
}

main().catch((e) => { console.error(`openai client error: ${e.status || ''} ${e.message}`); process.exit(1); });
