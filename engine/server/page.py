"""Chapter 38: a chat page served at `/`: one HTML document, no build step, no CDN.

The script posts the conversation to /v1/chat/completions with stream: true and reads the
response body as it arrives (fetch's ReadableStream), splitting it into server-sent events
at blank lines, so the reply grows on screen token by token. The page asks /v1/models
for the model's name, so it works for whatever model the server was started with.
"""

CHAT_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>Chat with the course engine</title>
<style>
  body { font-family: system-ui, sans-serif; max-width: 46rem; margin: 2rem auto; padding: 0 1rem; }
  #log { border: 1px solid #ccc; border-radius: 6px; padding: 0.5rem 1rem; min-height: 12rem; }
  .turn { white-space: pre-wrap; margin: 0.6rem 0; }
  .user b { color: #4c78a8; } .assistant b { color: #54a24b; } .error { color: #cf222e; }
  form { display: flex; gap: 0.5rem; margin-top: 1rem; }
  #prompt { flex: 1; padding: 0.4rem; }
</style>
</head>
<body>
<h1>Chat with the course engine</h1>
<p>Model: <span id="model">?</span>. Replies stream from the engine as they are generated.</p>
<div id="log"></div>
<form id="form">
  <input id="prompt" autocomplete="off" placeholder="Type a message and press Enter">
  <label>max tokens <input id="max_tokens" type="number" value="64" min="1" style="width: 4rem"></label>
  <label>temperature <input id="temperature" type="number" value="0.7" min="0" max="2" step="0.1"
                            style="width: 4rem"></label>
  <button id="send" type="submit">Send</button>
</form>
<script>
const log = document.getElementById("log");
const messages = [];
let model = null;

fetch("/v1/models").then(r => r.json()).then(body => {
  model = body.data[0].id;
  document.getElementById("model").textContent = model;
});

function addTurn(role, text) {
  const div = document.createElement("div");
  div.className = "turn " + role;
  const who = document.createElement("b");
  who.textContent = role + ": ";
  const span = document.createElement("span");
  span.textContent = text;
  div.append(who, span);
  log.append(div);
  return span;
}

async function send(text) {
  messages.push({role: "user", content: text});
  addTurn("user", text);
  const reply = addTurn("assistant", "");
  reply.parentElement.id = "pending";
  const response = await fetch("/v1/chat/completions", {
    method: "POST",
    headers: {"Content-Type": "application/json"},
    body: JSON.stringify({model: model, messages: messages, stream: true,
                          max_tokens: Number(document.getElementById("max_tokens").value),
                          temperature: Number(document.getElementById("temperature").value)}),
  });
  if (!response.ok) {
    const body = await response.json();
    reply.textContent = body.error.message;
    reply.className = "error";
    reply.parentElement.id = "";
    return;
  }
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, {stream: true});
    let end;
    while ((end = buffer.indexOf("\\n\\n")) >= 0) {     // one event ends at a blank line
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      if (!event.startsWith("data: ")) continue;
      const payload = event.slice(6);
      if (payload === "[DONE]") continue;
      const chunk = JSON.parse(payload);
      if (chunk.error) { reply.className = "error"; reply.textContent += chunk.error.message; continue; }
      for (const choice of chunk.choices) reply.textContent += choice.delta.content || "";
    }
  }
  messages.push({role: "assistant", content: reply.textContent});
  reply.parentElement.id = "";
  reply.parentElement.classList.add("done");
}

document.getElementById("form").addEventListener("submit", event => {
  event.preventDefault();
  const input = document.getElementById("prompt");
  if (input.value && model) { send(input.value); input.value = ""; }
});
</script>
</body>
</html>
"""

__all__ = ["CHAT_PAGE"]
