// tools_client.mjs - tool-call round trips through real npm clients against a tandem router.
//
//   node tests/tools_client.mjs BASE_URL MODEL MODE
//
// MODE "langchain": @langchain/openai ChatOpenAI.bindTools with tool_choice
// naming get_time -> AIMessage.tool_calls (invoke, and stream aggregated from
// tool_call_chunks) -> ToolMessage -> an answer.
// MODE "aisdk": AI SDK generateText/streamText over @ai-sdk/openai-compatible
// with toolChoice naming get_time and an execute function -> tool call and
// tool result -> a second generateText with the tool messages -> an answer.
// get_time takes no arguments (its schema admits only {}), so the router
// forces the whole call; see docs/router.md.
// Prints one JSON line with what the clients saw and exits 0, or prints the
// error and exits 1. Packages load from $OPENAI_NPM_DIR (default build/npm),
// where tests/router/test_router.c installs them with npm.
import { createRequire } from 'node:module';
import path from 'node:path';

const [base, model, mode] = process.argv.slice(2);
const dir = path.resolve(process.env.OPENAI_NPM_DIR || 'build/npm');
const require = createRequire(path.join(dir, 'package.json'));

const timeSchema = { type: 'object', properties: {}, additionalProperties: false };

async function langchain() {
  const { ChatOpenAI } = require('@langchain/openai');
  const { HumanMessage, ToolMessage } = require('@langchain/core/messages');
  const llm = new ChatOpenAI({ model, apiKey: 'no-key', configuration: { baseURL: base }, temperature: 0, maxTokens: 8,
                               maxRetries: 0 });
  const getTime = { type: 'function', function: { name: 'get_time', description: 'The current time', parameters: timeSchema } };
  const bound = llm.bindTools([getTime], { tool_choice: 'get_time' });
  const question = new HumanMessage('What time is it?');
  const ai = await bound.invoke([question]);
  let agg;
  for await (const c of await bound.stream([question])) agg = agg ? agg.concat(c) : c;
  const results = ai.tool_calls.map((tc) => new ToolMessage({ content: '12:00', tool_call_id: tc.id, name: tc.name }));
  const answer = await llm.invoke([question, ai, ...results]);
  return {
    calls: ai.tool_calls.map((t) => ({ name: t.name, args: t.args, id: t.id })),
    stream_calls: (agg.tool_calls || []).map((t) => ({ name: t.name, args: t.args, id: t.id })),
    answer: typeof answer.content === 'string' ? answer.content : JSON.stringify(answer.content),
    finish_reason: answer.response_metadata && answer.response_metadata.finish_reason,
  };
}

async function aisdk() {
  const { generateText, streamText, tool, jsonSchema } = require('ai');
  const { createOpenAICompatible } = require('@ai-sdk/openai-compatible');
  const provider = createOpenAICompatible({ name: 'tandem', baseURL: base, apiKey: 'no-key' });
  let executed = 0;
  const tools = {
    get_time: tool({ description: 'The current time', inputSchema: jsonSchema(timeSchema),
                     execute: async () => { executed++; return '12:00'; } }),
  };
  const first = await generateText({ model: provider(model), tools, toolChoice: { type: 'tool', toolName: 'get_time' },
                                     prompt: 'What time is it?', maxOutputTokens: 8, temperature: 0, maxRetries: 0 });
  const streamed = streamText({ model: provider(model), tools, toolChoice: { type: 'tool', toolName: 'get_time' },
                                prompt: 'What time is it?', maxOutputTokens: 8, temperature: 0, maxRetries: 0 });
  const stream_calls = [];
  for await (const part of streamed.fullStream) {
    if (part.type === 'tool-call') stream_calls.push({ name: part.toolName, input: part.input, id: part.toolCallId });
    if (part.type === 'error') throw part.error;
  }
  const second = await generateText({
    model: provider(model), tools, toolChoice: 'auto', maxOutputTokens: 8, temperature: 0, maxRetries: 0,
    messages: [{ role: 'user', content: 'What time is it?' }, ...first.response.messages],
  });
  return {
    calls: first.toolCalls.map((t) => ({ name: t.toolName, input: t.input, id: t.toolCallId })),
    results: first.toolResults.map((t) => t.output),
    stream_calls, executed,
    first_finish: first.finishReason,
    answer: second.text, finish_reason: second.finishReason,
  };
}

// MODE "structured": response_format json_schema through all three clients:
// the openai client's response_format, AI SDK generateObject and LangChain
// withStructuredOutput. The schema's strings are enums: random-weight models
// close a free-form string only by chance, while a grammar-forced enum or
// number always ends. Returns the three objects; the C test validates them.
const gradeSchema = {
  type: 'object',
  properties: {
    verdict: { type: 'string', enum: ['pass', 'fail', 'partial'] },
    score: { type: 'integer', minimum: 0, maximum: 10 },
    late: { type: 'boolean' },
    items: { type: 'array', items: { type: 'integer', minimum: 1, maximum: 5 }, minItems: 1, maxItems: 3 },
  },
  required: ['verdict', 'score', 'late', 'items'],
  additionalProperties: false,
};

async function structured() {
  const OpenAI = require('openai');
  const client = new OpenAI({ baseURL: base, apiKey: 'no-key', maxRetries: 0 });
  const r = await client.chat.completions.create({
    model, max_tokens: 64, temperature: 0,
    messages: [{ role: 'user', content: 'Grade this submission.' }],
    response_format: { type: 'json_schema', json_schema: { name: 'grade', strict: true, schema: gradeSchema } },
  });
  const openai = JSON.parse(r.choices[0].message.content);
  const { generateObject, jsonSchema } = require('ai');
  const { createOpenAICompatible } = require('@ai-sdk/openai-compatible');
  const provider = createOpenAICompatible({ name: 'tandem', baseURL: base, apiKey: 'no-key', supportsStructuredOutputs: true });
  const g = await generateObject({ model: provider(model), schema: jsonSchema(gradeSchema), schemaName: 'grade',
                                   prompt: 'Grade this submission.', maxOutputTokens: 64, temperature: 0, maxRetries: 0 });
  const { ChatOpenAI } = require('@langchain/openai');
  const llm = new ChatOpenAI({ model, apiKey: 'no-key', configuration: { baseURL: base }, temperature: 0, maxTokens: 64,
                               maxRetries: 0 });
  const lc = await llm.withStructuredOutput(gradeSchema, { name: 'grade', method: 'jsonSchema' })
    .invoke('Grade this submission.');
  return { openai, aisdk: g.object, langchain: lc };
}

const run = mode === 'langchain' ? langchain : mode === 'structured' ? structured : aisdk;
run().then((r) => console.log(JSON.stringify(r)))
  .catch((e) => { console.error(`${mode} client error: ${e.status || ''} ${e.stack || e.message}`); process.exit(1); });
