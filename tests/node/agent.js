// A parallel Node agent on the official `openai` npm package, for quotawrap's gateway tests.
// It knows nothing of quotawrap: it reads OPENAI_BASE_URL and OPENAI_API_KEY like any Node agent.
// Each worker alternates streamed and plain calls until it is refused; one JSON line per call.
import OpenAI from "openai";

const client = new OpenAI(); // OPENAI_BASE_URL, OPENAI_API_KEY
const model = process.env.AGENT_MODEL ?? "deepseek-v4-flash";
const workers = Number(process.env.AGENT_WORKERS ?? "6");
const callsPerWorker = Number(process.env.AGENT_CALLS ?? "8");
const maxTokens = Number(process.env.AGENT_MAX_TOKENS ?? "300");

async function call(worker, n) {
  const stream = (worker + n) % 2 === 0;
  const request = { model, max_tokens: maxTokens, messages: [{ role: "user", content: `worker ${worker} call ${n}` }] };
  try {
    if (stream) {
      let text = "";
      let usageSeen = false;
      for await (const chunk of await client.chat.completions.create({ ...request, stream: true })) {
        text += chunk.choices[0]?.delta?.content ?? "";
        usageSeen ||= chunk.usage != null;
      }
      return { stream, outcome: "ok", chars: text.length, usage_seen: usageSeen };
    }
    const answer = await client.chat.completions.create(request);
    return { stream, outcome: "ok", chars: answer.choices[0].message.content.length, usage: answer.usage.total_tokens };
  } catch (error) {
    if (error instanceof OpenAI.APIError && error.status === 429) {
      return { stream, outcome: "blocked", status: error.status, code: error.code, type: error.type };
    }
    throw error;
  }
}

async function worker(index) {
  for (let n = 0; n < callsPerWorker; n++) {
    const record = await call(index, n);
    console.log(JSON.stringify({ worker: index, ...record }));
    if (record.outcome === "blocked") return;
  }
}

await Promise.all(Array.from({ length: workers }, (_, index) => worker(index)));
