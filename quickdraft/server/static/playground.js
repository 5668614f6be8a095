// The quickdraft playground: a chat over /v1/chat/completions that draws each streamed token by its
// origin (the "quickdraft" field of every stream chunk, docs/server.md), live figures from the same
// field, and a race of one prompt run plain, then speculative. No libraries, no network beyond this server.
const $ = (id) => document.getElementById(id);
const ORIGINS = ["accepted", "branch", "recovered", "bonus", "target"];
const NAMES = {
  accepted: "accepted draft token", branch: "accepted draft token (tree branch)",
  recovered: "recovered: the target's token after a rejection",
  bonus: "bonus: the target's token after a fully accepted draft", target: "target: no draft verified in this pass",
};
// Who drafted an accepted token: the part the stream names (a hybrid's "ngram", "head" or "draft"),
// else the request's proposer. Prompt lookup's tokens get their own mark: copied, not predicted.
const LOOKUP = new Set(["ngram", "ngram-tree"]);
const PARTS = { ngram: "prompt lookup", "ngram-tree": "prompt lookup (tree)", head: "draft head", draft: "draft model" };
const drafted = (token) => token.origin === "accepted" || token.origin === "branch";
let config = null;
const history = [];

async function init() {
  config = await (await fetch("/playground/config")).json();
  $("model").textContent = config.model;
  $("default-spec").textContent = specLabel(config.speculative);
  for (const method of config.methods) $("method").add(new Option(method, method));
  $("method").value = config.speculative.method;
  $("k").value = config.speculative.k;
  $("k").max = config.max_k;
  $("max-tokens").max = config.context - 1;
  $("ask").addEventListener("submit", (e) => { e.preventDefault(); send(); });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); send(); }
  });
  $("race").addEventListener("click", race);
  $("clear").addEventListener("click", () => { history.length = 0; $("log").replaceChildren(); });
  $("show-origins").addEventListener("change", (e) => {
    for (const el of document.querySelectorAll("#log, .pane .out")) el.classList.toggle("show", e.target.checked);
  });
  for (const area of [$("log"), $("race-view")]) {
    area.addEventListener("mouseover", (e) => { if (e.target.dataset.origin) $("hover-info").textContent = e.target.title; });
  }
  document.body.dataset.ready = "1";
}

function specLabel(spec) {
  return spec.method === "none" ? "plain decoding" : `${spec.method}, k = ${spec.k}`;
}

function settings() {
  const number = (id) => ($(id).value === "" ? undefined : Number($(id).value));
  const method = $("method").value;
  return {
    model: config.model, temperature: number("temperature"), top_p: number("top-p"), seed: number("seed"),
    max_tokens: number("max-tokens"),
    speculative: method === "none" ? { method } : { method, k: number("k") },
  };
}

async function* stream(body) {
  const headers = { "Content-Type": "application/json" };
  if ($("api-key").value) headers.Authorization = `Bearer ${$("api-key").value}`;
  const r = await fetch("/v1/chat/completions", { method: "POST", headers, body: JSON.stringify({ ...body, stream: true }) });
  if (!r.ok) {
    let message = `HTTP ${r.status}`;
    try { message = (await r.json()).error.message; } catch { /* not an OpenAI error body */ }
    throw new Error(message);
  }
  const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      if (!event.startsWith("data: ")) continue;
      if (event === "data: [DONE]") return;
      const chunk = JSON.parse(event.slice(6));
      if (chunk.error) throw new Error(chunk.error.message);
      yield chunk;
    }
  }
}

function tokenSpan(token, pass, method) {
  const span = document.createElement("span");
  const source = drafted(token) ? token.source ?? method : "";
  span.className = `tok o-${token.origin}${LOOKUP.has(source) ? " s-lookup" : ""}`;
  span.textContent = token.text;
  Object.assign(span.dataset, { origin: token.origin, pass, depth: token.depth, id: token.id, source });
  const by = source ? `, proposed by ${PARTS[source] ? `${PARTS[source]} (${source})` : source}` : "";
  const where = token.depth ? ` · position ${token.depth} in the draft` : "";
  span.title = `${NAMES[token.origin]}${by} · target pass ${pass}${where} · token id ${token.id}`;
  return span;
}

// One streamed answer drawn into `out`; keeps its counts, ids and the last extension for the figures.
class Run {
  constructor(out, method, label) {
    Object.assign(this, { out, method, label, text: "", ids: [], last: null, stats: null });
    this.counts = Object.fromEntries(ORIGINS.map((o) => [o, 0]));
    this.sources = {}; // accepted draft tokens by the part that drafted them
  }

  add(chunk) {
    const choice = chunk.choices[0];
    const text = choice.delta.content ?? "";
    const ext = chunk.quickdraft;
    let covered = "";
    for (const token of ext.tokens) {
      this.out.append(tokenSpan(token, ext.pass, this.method));
      covered += token.text;
      this.counts[token.origin] += 1;
      if (drafted(token)) {
        const source = token.source ?? this.method;
        this.sources[source] = (this.sources[source] ?? 0) + 1;
      }
      this.ids.push(token.id);
    }
    if (covered !== text) this.out.append(text.slice(covered.length)); // text no token of this chunk released
    this.text += text;
    this.last = ext;
    if (choice.finish_reason) this.stats = chunk.stats;
  }

  async run(body, onChunk = () => {}) {
    for await (const chunk of stream(body)) {
      if (!chunk.choices.length) continue;
      this.add(chunk);
      onChunk(this);
    }
    this.out.dataset.done = "1";
    return this;
  }
}

const fixed = (x, digits = 1) => (Number.isFinite(x) ? x.toFixed(digits) : "–");

function drawFigures(run) {
  const ext = run.last;
  $("fig-of").textContent = `of ${run.label}`;
  $("fig-tps").textContent = fixed(ext.elapsed_s > 0 ? ext.new_tokens / ext.elapsed_s : NaN);
  $("fig-tpp").textContent = fixed(ext.committed_tokens / ext.pass, 2); // as stats.tokens_per_pass: a stop token counts
  $("fig-ttft").textContent = `${fixed(ext.ttft_s * 1000, 0)} ms`;
  $("fig-passes").textContent = ext.pass;
  $("fig-origins").replaceChildren(...ORIGINS.map((o) => {
    const li = document.createElement("li");
    li.dataset.origin = o;
    li.dataset.count = run.counts[o];
    li.innerHTML = `<span class="tok o-${o}"></span><span></span><b></b>`;
    li.children[1].textContent = NAMES[o].split(":")[0];
    li.children[2].textContent = run.counts[o];
    return li;
  }));
  $("fig-sources").replaceChildren(...Object.entries(run.sources).map(([source, count]) => {
    const li = document.createElement("li");
    Object.assign(li.dataset, { source, count });
    li.innerHTML = `<span class="tok o-accepted${LOOKUP.has(source) ? " s-lookup" : ""}"></span><span></span><b></b>`;
    li.children[1].textContent = PARTS[source] ?? source;
    li.children[2].textContent = count;
    return li;
  }));
  $("fig-bars").replaceChildren(...ext.drafted_at.map((drafted, i) => {
    const rate = drafted ? ext.accepted_at[i] / drafted : 0;
    const bar = document.createElement("div");
    bar.className = "bar";
    bar.style.height = `${Math.max(rate * 100, 1)}%`;
    bar.title = `position ${i + 1}: ${ext.accepted_at[i]} of ${drafted} drafted accepted`;
    bar.innerHTML = `<span>${Math.round(rate * 100)}%</span><i>${i + 1}</i>`;
    return bar;
  }));
}

function message(role) {
  const div = document.createElement("div");
  div.className = `msg ${role}`;
  div.innerHTML = `<span class="who"></span>`;
  div.firstChild.textContent = role;
  $("log").append(div);
  return div;
}

async function send() {
  const prompt = $("prompt").value.trim();
  if (!prompt) return;
  $("prompt").value = "";
  history.push({ role: "user", content: prompt });
  message("user").append(prompt);
  const body = { ...settings(), messages: [...history] };
  const answer = message("assistant");
  const run = new Run(answer, body.speculative.method, `the chat answer (${specLabel(body.speculative)})`);
  try {
    await run.run(body, (r) => { drawFigures(r); $("log").scrollTop = $("log").scrollHeight; });
    history.push({ role: "assistant", content: run.text });
  } catch (e) {
    answer.classList.add("error");
    answer.append(`error: ${e.message}`);
    history.pop();
  }
}

async function race() {
  const prompt = $("prompt").value.trim() || history.findLast((m) => m.role === "user")?.content;
  if (!prompt) return;
  const body = { ...settings(), messages: [{ role: "user", content: prompt }] };
  $("race-view").hidden = false;
  $("race-result").textContent = "running plain decoding…";
  const panes = ["plain", "spec"].map((name) => $(`pane-${name}`));
  for (const pane of panes) {
    pane.querySelector(".out").replaceChildren();
    delete pane.querySelector(".out").dataset.done;
    pane.querySelector(".meta").textContent = "";
  }
  const runs = [];
  try {
    // one after the other, so that neither run's passes slow the other's
    for (const [pane, speculative] of [[panes[0], { method: "none" }], [panes[1], body.speculative]]) {
      const label = specLabel(speculative);
      const run = new Run(pane.querySelector(".out"), speculative.method, `the race's ${label} run`);
      pane.querySelector("h3").textContent = label;
      await run.run({ ...body, speculative }, drawFigures);
      const s = run.stats;
      pane.querySelector(".meta").textContent =
        `${s.new_tokens} tokens in ${fixed(s.total_s, 2)} s · ${fixed(s.tokens_per_s)} tokens/s · ` +
        `${fixed(s.tokens_per_pass, 2)} tokens per pass`;
      runs.push(run);
      $("race-result").textContent = "running speculative decoding…";
    }
  } catch (e) {
    $("race-result").textContent = `error: ${e.message}`;
    return;
  }
  const [plain, spec] = runs;
  const speedup = plain.stats.total_s / spec.stats.total_s;
  let identity;
  if (body.temperature !== 0) {
    identity = "sampling (temperature > 0): the outputs are equally distributed, not identical, so they are not compared";
  } else if (plain.ids.join() === spec.ids.join() && plain.text === spec.text) {
    identity = "identical: speculative output equals plain greedy decoding, token for token";
  } else {
    identity = "DIFFERENT: speculative output differs from plain greedy decoding";
  }
  $("race-result").dataset.identity = identity.split(":")[0];
  $("race-result").textContent = `speedup ${fixed(speedup, 2)}x · ${identity}`;
}

init();
