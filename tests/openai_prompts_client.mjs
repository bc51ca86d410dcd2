// openai_prompts_client.mjs - the official `openai` npm client asking a
// tandem router for completions of two prompts in one request.
//
//   node tests/openai_prompts_client.mjs BASE_URL MODEL
//
// completions.create with prompt ["Once upon a time", "The little dog"],
// greedy, 6 tokens each: once not streamed, once streamed with the usage
// chunk (the text gathered per choice index). Prints one JSON line
// {"plain": {"texts", "indexes", "usage"}, "streamed": {"texts", "usage"}}
// and exits 0, or prints the error and exits 1. The package comes from
// $OPENAI_NPM_DIR (default build/npm), where the C test installs it.
import { createRequire } from 'node:module';
import path from 'node:path';

const [base, model] = process.argv.slice(2);
const dir = path.resolve(process.env.OPENAI_NPM_DIR || 'build/npm');
const require = createRequire(path.join(dir, 'package.json'));
const OpenAI = require('openai');
const client = new OpenAI({ baseURL: base, apiKey: 'no-key', maxRetries: 0, timeout: 60000 });
const prompt = ['Once upon a time', 'The little dog'];

async function main() {
  const r = await client.completions.create({ model, prompt, temperature: 0, max_tokens: 6 });
  const plain = { texts: r.choices.map((c) => c.text), indexes: r.choices.map((c) => c.index), usage: r.usage };
  const stream = await client.completions.create({
    model, prompt, temperature: 0, max_tokens: 6, stream: true, stream_options: { include_usage: true },
  });
  const streamed = { texts: [], usage: null };
  for await (const c of stream) {
    if (c.usage) streamed.usage = c.usage;
    for (const ch of c.choices || []) streamed.texts[ch.index] = (streamed.texts[ch.index] || '') + ch.text;
  }
  console.log(JSON.stringify({ plain, streamed }));
}

main().catch((e) => { console.error(`openai client error: ${e.status || ''} ${e.message}`); process.exit(1); });
