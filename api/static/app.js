// The chat page: sign in with a token, pick a model, stream answers, keep
// conversations server-side (/v1/chats). Plain DOM code, no build step.
//
// Generations go over ONE websocket per page (/v1/ws, the multiplexed socket),
// authenticated by the "bearer.<token>" subprotocol. If that socket cannot be
// opened (an API without /v1/ws), each job is submitted with POST /v1/jobs and
// read from its server-sent events through fetch(), which can send the token in
// a header — so the token never appears in a URL either way.
"use strict";

const $ = (id) => document.getElementById(id);

const state = {
  models: [],
  chats: [],
  chat: null, // the open chat, with .messages
  running: null, // the generation in flight
  transport: null,
};

// ---------------------------------------------------------------- transports

/** One websocket for every generation of this page (/v1/ws). */
class MuxTransport {
  constructor(socket) {
    this.socket = socket;
    this.pending = new Map(); // request id -> handlers
    this.closed = false;
    socket.addEventListener("message", (ev) => this._frame(ev.data));
    socket.addEventListener("close", (ev) => {
      this.closed = true;
      for (const handlers of this.pending.values()) {
        handlers.onError(
          ev.code === 1008
            ? "the server closed the stream: your API token was not accepted (401)"
            : "the connection to the server was lost before the answer was finished"
        );
      }
      this.pending.clear();
    });
  }

  /** Open /v1/ws; resolves to a transport, or null when the socket is refused. */
  static open(token) {
    return new Promise((resolve) => {
      let socket;
      try {
        socket = new WebSocket(Session.wsUrl("/v1/ws"), ["switchyard", `bearer.${token}`]);
      } catch (err) {
        resolve(null);
        return;
      }
      const fail = () => resolve(null);
      socket.addEventListener("error", fail, { once: true });
      socket.addEventListener("close", fail, { once: true });
      socket.addEventListener(
        "open",
        () => {
          socket.removeEventListener("error", fail);
          socket.removeEventListener("close", fail);
          resolve(new MuxTransport(socket));
        },
        { once: true }
      );
    });
  }

  get usable() {
    return !this.closed && this.socket.readyState === WebSocket.OPEN;
  }

  generate(request, handlers) {
    const id = `g${Date.now().toString(36)}${Math.random().toString(36).slice(2, 8)}`;
    this.pending.set(id, handlers);
    // detach: a reload or a lost socket does not cancel the job; its answer
    // still lands in the chat (the Stop button cancels explicitly).
    this.socket.send(JSON.stringify({ type: "generate", id, detach: true, ...request }));
    return { cancel: () => this.usable && this.socket.send(JSON.stringify({ type: "cancel", id })) };
  }

  _frame(raw) {
    let frame;
    try {
      frame = JSON.parse(raw);
    } catch (err) {
      return;
    }
    const handlers = this.pending.get(frame.id);
    if (!handlers) return;
    const jobId = frame.job_id || (frame.job && frame.job.id);
    if (jobId) handlers.onJob(jobId);
    if (frame.type === "token") handlers.onToken(frame.text || "");
    else if (frame.type === "started") handlers.onStarted();
    // "resumed" needs nothing: the next attempt's tokens continue the text.
    else if (frame.type === "restart") handlers.onRestart();
    else if (frame.type === "queued" && typeof frame.position === "number")
      handlers.onQueue(frame.position);
    else if (frame.type === "waiting") handlers.onWaiting(frame);
    else if (frame.type === "done") {
      this.pending.delete(frame.id);
      handlers.onDone(frame);
    } else if (frame.type === "error") {
      this.pending.delete(frame.id);
      // Refused before any job (401, 404, 422, 429…): the same words as an HTTP error.
      const refused = !jobId && frame.status;
      const message = refused
        ? Session.describe(new Session.ApiError(frame.status, frame, frame.retry_after))
        : frame.error || "the job failed";
      handlers.onError(message, frame.status, frame, refused);
    }
  }
}

/** POST /v1/jobs, then the job's server-sent events read with fetch(). */
class JobTransport {
  get usable() {
    return true;
  }

  generate(request, handlers) {
    const ctl = { jobId: null, cancelWanted: false, aborter: new AbortController() };
    const cancel = () => {
      ctl.cancelWanted = true;
      if (ctl.jobId) Session.api("DELETE", `/v1/jobs/${ctl.jobId}`).catch(() => {});
    };
    (async () => {
      let job;
      try {
        job = await Session.api("POST", "/v1/jobs", request);
      } catch (err) {
        handlers.onError(Session.describe(err), err.status, null, true);
        return;
      }
      ctl.jobId = job.id;
      handlers.onJob(job.id);
      if (ctl.cancelWanted) cancel();
      let after = -1;
      for (let attempt = 0; attempt < 5; attempt++) {
        try {
          const ended = await this._read(job.id, after, handlers, (seq) => (after = seq), ctl);
          if (ended) return;
        } catch (err) {
          if (err instanceof Session.ApiError) {
            handlers.onError(Session.describe(err), err.status, null, true);
            return;
          }
        }
        await new Promise((r) => setTimeout(r, 500 * (attempt + 1)));
      }
      handlers.onError("the connection to the server was lost before the answer was finished");
    })();
    return { cancel };
  }

  async _read(jobId, after, handlers, seen, ctl) {
    const headers = { Accept: "text/event-stream", Authorization: `Bearer ${Session.token()}` };
    if (after >= 0) headers["Last-Event-ID"] = String(after);
    const response = await fetch(`/v1/jobs/${jobId}/events`, { headers, signal: ctl.aborter.signal });
    if (!response.ok) {
      let body = null;
      try {
        body = await response.json();
      } catch (err) {
        body = null;
      }
      throw new Session.ApiError(response.status, body, response.headers.get("Retry-After"));
    }
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return false;
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let cut;
      while ((cut = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, cut);
        buffer = buffer.slice(cut + 2);
        const data = block
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (!data) continue;
        const event = JSON.parse(data);
        seen(event.seq);
        if (event.type === "token") handlers.onToken(event.text || "");
        else if (event.type === "started") handlers.onStarted();
        else if (event.type === "restart") handlers.onRestart(); // not "resumed": it continues
        else if (event.type === "done") {
          handlers.onDone(event);
          return true;
        } else if (event.type === "error") {
          handlers.onError(event.error || "the job failed", null, event);
          return true;
        }
      }
    }
  }
}

async function transport() {
  if (state.transport && state.transport.usable) return state.transport;
  state.transport = (await MuxTransport.open(Session.token())) || new JobTransport();
  return state.transport;
}

// ---------------------------------------------------------------- rendering

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (name === "class") node.className = value;
    else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
    else if (value !== null && value !== undefined && value !== false) node.setAttribute(name, value);
  }
  for (const child of children) node.append(child);
  return node;
}

function showError(message) {
  $("chat-error").textContent = message || "";
}

function showQueue(text) {
  const node = $("queue-status");
  node.hidden = !text;
  node.textContent = text || "";
}

/** Words for a job whose model has no ready worker yet (a ``waiting`` frame). */
function waitingText(frame) {
  const n = frame.replicas_starting || 0;
  if (!n) return "Waiting for a worker to be started for this model…";
  const workers = n === 1 ? "A worker is" : `${n} workers are`;
  let text = `${workers} loading this model`;
  if (typeof frame.progress === "number") text += `: ${Math.round(frame.progress)}%`;
  if (typeof frame.eta_s === "number") text += `, about ${Math.ceil(frame.eta_s)} s left`;
  return `${text}.`;
}

/** The worker-start progress bar: a ``waiting`` frame, or null to hide it. */
function showLoading(frame) {
  $("load-status").hidden = !frame;
  if (!frame) return;
  $("load-text").textContent = waitingText(frame);
  const bar = $("load-progress");
  if (typeof frame.progress === "number") bar.value = frame.progress;
  else bar.removeAttribute("value"); // indeterminate: no earlier start to go by
}

function renderChatList() {
  const list = $("chat-list");
  list.replaceChildren();
  if (!state.chats.length) {
    list.append(el("li", { class: "muted empty" }, "No conversations yet."));
    return;
  }
  for (const chat of state.chats) {
    const current = state.chat && state.chat.id === chat.id;
    list.append(
      el(
        "li",
        {},
        el(
          "button",
          {
            type: "button",
            class: "chat-link",
            disabled: state.running ? "" : null,
            "aria-current": current ? "true" : null,
            "data-chat-id": chat.id,
            onclick: () => openChat(chat.id),
          },
          chat.title || "Untitled conversation"
        )
      )
    );
  }
}

/** Show ``text`` in an answer's bubble: Markdown for the assistant, plain text for the user. */
function setBubbleText(body, role, text) {
  body.dataset.source = text;
  if (role === "assistant") Markdown.render(text, body);
  else body.textContent = text;
}

function turnNode(turn) {
  const who = turn.role === "user" ? "You" : "Assistant";
  const body = el("div", { class: "bubble-text" });
  setBubbleText(body, turn.role, turn.content || "");
  const node = el(
    "li",
    { class: `turn ${turn.role}`, "data-message-id": turn.id || "" },
    el("span", { class: "who" }, who),
    body
  );
  const job = turn.job;
  if (job) {
    if (job.status === "failed") {
      node.append(el("p", { class: "note error" }, `This answer failed: ${job.error || "unknown error"}`));
    } else if (job.status === "cancelled") {
      node.append(el("p", { class: "note muted" }, "Stopped."));
    } else if (job.status === "queued" || job.status === "running") {
      node.append(el("p", { class: "note muted" }, "Still generating — reopen later to see the answer."));
    }
  }
  return node;
}

function renderChat() {
  const chat = state.chat;
  $("chat-title").textContent = chat ? chat.title || "Untitled conversation" : "New conversation";
  $("rename-chat").disabled = !chat;
  $("delete-chat").disabled = !chat;
  const list = $("messages");
  list.replaceChildren(...(chat ? chat.messages.map(turnNode) : []));
  const params = (chat && chat.params) || {};
  $("temperature").value = params.temperature ?? "";
  $("top-p").value = params.top_p ?? "";
  $("max-tokens").value = params.max_new_tokens ?? "";
  $("system-prompt").value = (chat && chat.system_prompt) || "";
  if (chat && chat.model && state.models.some((m) => m.id === chat.model)) {
    $("model-select").value = chat.model;
  }
  renderChatList();
  list.scrollTop = list.scrollHeight;
}

function renderModels() {
  const select = $("model-select");
  select.replaceChildren();
  for (const model of state.models) {
    const ready = model.state ? model.state.replicas_ready : 0;
    const label = `${model.id} — ${ready} ready${model.description ? ` · ${model.description}` : ""}`;
    select.append(el("option", { value: model.id }, label));
  }
  if (!state.models.length) select.append(el("option", { value: "" }, "No models are served"));
}

// ---------------------------------------------------------------- data

async function loadModels() {
  const body = await Session.api("GET", "/v1/models");
  state.models = body.data.filter((m) => m.enabled !== false);
  renderModels();
}

async function loadChats() {
  const body = await Session.api("GET", "/v1/chats");
  state.chats = body.data;
  renderChatList();
}

async function openChat(chatId) {
  if (state.running) return;
  showError("");
  try {
    state.chat = await Session.api("GET", `/v1/chats/${chatId}`);
    history.replaceState(null, "", `#chat=${encodeURIComponent(chatId)}`);
  } catch (err) {
    showError(Session.describe(err));
    if (err.status === 401) return signOut(Session.describe(err));
    state.chat = null;
  }
  renderChat();
}

function newChat() {
  if (state.running) return;
  state.chat = null;
  history.replaceState(null, "", location.pathname);
  showError("");
  renderChat();
  $("composer-input").focus();
}

function settingsFromForm() {
  const params = {};
  const number = (id, key, parse) => {
    const raw = $(id).value.trim();
    if (raw !== "") params[key] = parse(raw);
  };
  number("temperature", "temperature", parseFloat);
  number("top-p", "top_p", parseFloat);
  number("max-tokens", "max_new_tokens", (v) => parseInt(v, 10));
  return { params, system_prompt: $("system-prompt").value };
}

async function ensureChat() {
  if (state.chat) return state.chat;
  const { params, system_prompt } = settingsFromForm();
  const created = await Session.api("POST", "/v1/chats", {
    model: $("model-select").value || null,
    params,
    system_prompt,
  });
  state.chat = created;
  state.chats.unshift(created);
  history.replaceState(null, "", `#chat=${encodeURIComponent(created.id)}`);
  $("rename-chat").disabled = false;
  $("delete-chat").disabled = false;
  renderChatList();
  return created;
}

function conversationMessages(chat, text) {
  const messages = [];
  if (chat.system_prompt && chat.system_prompt.trim()) {
    messages.push({ role: "system", content: chat.system_prompt });
  }
  for (const turn of chat.messages) {
    if (turn.content && turn.content.length) messages.push({ role: turn.role, content: turn.content });
  }
  messages.push({ role: "user", content: text });
  return messages;
}

// ---------------------------------------------------------------- generation

/** Words for a waiting job with ``ahead`` jobs of its model queued before it. */
function queueText(ahead) {
  if (ahead <= 0) return "Waiting for a worker: your request is next in the queue.";
  const jobs = ahead === 1 ? "1 request" : `${ahead} requests`;
  return `Waiting in the queue: position ${ahead + 1} (${jobs} ahead of yours).`;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  $("composer-input").setAttribute("aria-busy", busy ? "true" : "false");
  // A chat cannot be left or deleted while its answer streams in.
  $("new-chat").disabled = busy;
  $("delete-chat").disabled = busy || !state.chat;
  for (const link of document.querySelectorAll(".chat-link")) link.disabled = busy;
}

async function send(text) {
  showError("");
  let chat;
  try {
    chat = await ensureChat();
  } catch (err) {
    showError(Session.describe(err));
    if (err.status === 401) signOut(Session.describe(err));
    return;
  }
  const model = $("model-select").value;
  if (!model) {
    showError("Pick a model first: this server lists none.");
    return;
  }
  const request = { model, messages: conversationMessages(chat, text), params: chat.params || {} };

  const userTurn = { role: "user", content: text };
  const answer = { role: "assistant", content: "", job: null };
  const userNode = turnNode(userTurn);
  const answerNode = turnNode(answer);
  answerNode.classList.add("streaming");
  answerNode.setAttribute("aria-busy", "true");
  $("messages").append(userNode, answerNode);
  const textNode = answerNode.querySelector(".bubble-text");
  // The answer's Markdown source; redrawn at most once a frame while tokens arrive.
  let source = "";
  let pendingDraw = null;
  const draw = () => {
    if (pendingDraw !== null) cancelAnimationFrame(pendingDraw);
    pendingDraw = null;
    setBubbleText(textNode, "assistant", source);
  };
  const redraw = () => {
    if (pendingDraw === null) pendingDraw = requestAnimationFrame(draw);
  };
  $("composer-input").value = "";
  setBusy(true);

  const run = { jobId: null, messageId: null, started: false, ended: false, poll: null, handle: null };
  state.running = run;

  const finish = () => {
    run.ended = true;
    clearInterval(run.poll);
    showQueue("");
    showLoading(null);
    answerNode.classList.remove("streaming");
    answerNode.removeAttribute("aria-busy");
    if (state.running === run) state.running = null;
    setBusy(false);
    refreshChatList();
  };

  const pollQueue = async () => {
    if (run.started || run.ended || !run.messageId || run.muxPositions) return;
    try {
      const turn = await Session.api("GET", `/v1/chats/${chat.id}/messages/${run.messageId}`);
      if (run.started || run.ended) return;
      const ahead = turn.job && turn.job.queue_position;
      if (turn.job && turn.job.status === "queued" && typeof ahead === "number") {
        showQueue(queueText(ahead));
      } else if (turn.job && turn.job.status === "running") {
        showQueue("");
      }
    } catch (err) {
      /* the stream reports real failures; a missed poll is harmless */
    }
  };

  const handlers = {
    onJob: async (jobId) => {
      if (run.jobId) return;
      run.jobId = jobId;
      answerNode.dataset.jobId = jobId;
      try {
        const stored = await Session.api("POST", `/v1/chats/${chat.id}/messages`, userTurn);
        userNode.dataset.messageId = stored.id;
        chat.messages.push(stored);
        const linked = await Session.api("POST", `/v1/chats/${chat.id}/messages`, {
          role: "assistant",
          job_id: jobId,
        });
        run.messageId = linked.id;
        answerNode.dataset.messageId = linked.id;
        chat.messages.push(linked);
        if (!chat.title) chat.title = text.split(/\s+/).join(" ").slice(0, 60);
        $("chat-title").textContent = chat.title || "Untitled conversation";
        refreshChatList();
        if (!run.started && !run.ended) {
          pollQueue();
          run.poll = setInterval(pollQueue, 1000);
        }
      } catch (err) {
        showError(`The answer is streaming but could not be saved: ${Session.describe(err)}`);
      }
    },
    onQueue: (ahead) => {
      run.muxPositions = true;
      if (!run.started && !run.ended) showQueue(queueText(ahead));
    },
    onWaiting: (frame) => {
      if (!run.started && !run.ended) showLoading(frame);
    },
    onStarted: () => {
      run.started = true;
      showQueue("");
      showLoading(null);
    },
    onRestart: () => {
      source = "";
      draw();
      // Only when the answer could not be continued (a "resumed" job keeps its text).
      showQueue("The answer could not be continued on another worker; it starts again.");
    },
    onToken: (piece) => {
      if (!run.started) {
        run.started = true;
        showQueue("");
        showLoading(null);
      }
      source += piece;
      redraw();
      const list = $("messages");
      list.scrollTop = list.scrollHeight;
    },
    onDone: (frame) => {
      if (typeof frame.text === "string" && frame.text.length >= source.length) source = frame.text;
      draw();
      const last = chat.messages[chat.messages.length - 1];
      if (last && last.job_id === run.jobId) {
        last.content = source;
        last.job = { ...(last.job || {}), status: frame.finish_reason === "cancelled" ? "cancelled" : "succeeded" };
      }
      if (frame.finish_reason === "cancelled") {
        answerNode.append(el("p", { class: "note muted" }, "Stopped."));
      }
      finish();
    },
    onError: (message, status, frame, beforeJob) => {
      if (beforeJob || !run.jobId) {
        // Nothing was generated: take the two bubbles back, keep the text to retry.
        userNode.remove();
        answerNode.remove();
        $("composer-input").value = text;
        showError(message);
        if (status === 401) signOut(message);
      } else {
        answerNode.append(el("p", { class: "note error" }, `This answer failed: ${message}`));
        showError(`The generation failed: ${message}`);
      }
      finish();
    },
  };

  try {
    const channel = await transport();
    run.handle = channel.generate(request, handlers);
  } catch (err) {
    handlers.onError(Session.describe(err), err.status, null, true);
  }
}

async function refreshChatList() {
  try {
    await loadChats();
  } catch (err) {
    /* the list is a convenience; errors show on the next action */
  }
}

function stop() {
  const run = state.running;
  if (!run || !run.handle) return;
  $("stop").disabled = true;
  showQueue("Stopping…");
  run.handle.cancel();
}

// ---------------------------------------------------------------- chat actions

function startRename() {
  if (!state.chat) return;
  const head = $("chat-title");
  const input = el("input", { id: "rename-input", type: "text", maxlength: "200", "aria-label": "Chat title" });
  input.value = state.chat.title || "";
  const form = el(
    "form",
    { class: "rename-form" },
    input,
    el("button", { type: "submit" }, "Save"),
    el("button", { type: "button", class: "secondary", onclick: () => form.replaceWith(head) }, "Cancel")
  );
  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    try {
      const updated = await Session.api("PATCH", `/v1/chats/${state.chat.id}`, { title: input.value.trim() });
      state.chat.title = updated.title;
      form.replaceWith(head);
      renderChat();
      await loadChats();
      $("rename-chat").focus();
    } catch (err) {
      showError(Session.describe(err));
    }
  });
  input.addEventListener("keydown", (ev) => {
    if (ev.key === "Escape") form.replaceWith(head);
  });
  head.replaceWith(form);
  input.focus();
}

async function deleteChat() {
  if (!state.chat || state.running) return;
  if (!confirm(`Delete "${state.chat.title || "Untitled conversation"}"? This cannot be undone.`)) return;
  try {
    await Session.api("DELETE", `/v1/chats/${state.chat.id}`);
    state.chat = null;
    history.replaceState(null, "", location.pathname);
    await loadChats();
    renderChat();
  } catch (err) {
    showError(Session.describe(err));
  }
}

async function saveSettings(ev) {
  ev.preventDefault();
  const { params, system_prompt } = settingsFromForm();
  if (!state.chat) {
    $("settings-status").textContent = "Saved; used for the new conversation.";
    return;
  }
  try {
    const updated = await Session.api("PATCH", `/v1/chats/${state.chat.id}`, { params, system_prompt });
    Object.assign(state.chat, updated);
    $("settings-status").textContent = "Saved.";
  } catch (err) {
    $("settings-status").textContent = "";
    showError(Session.describe(err));
  }
}

async function changeModel() {
  if (!state.chat) return;
  try {
    const updated = await Session.api("PATCH", `/v1/chats/${state.chat.id}`, { model: $("model-select").value });
    state.chat.model = updated.model;
  } catch (err) {
    showError(Session.describe(err));
  }
}

// ---------------------------------------------------------------- session

function signOut(message) {
  Session.forget();
  if (state.transport && state.transport.socket) state.transport.socket.close();
  state.transport = null;
  state.chat = null;
  $("chat-app").hidden = true;
  $("sign-out").hidden = true;
  $("whoami").textContent = "";
  $("sign-in").hidden = false;
  $("sign-in-error").textContent = message || "";
  $("token-input").focus();
}

async function enter() {
  try {
    await Promise.all([loadChats(), loadModels()]);
  } catch (err) {
    return signOut(Session.describe(err));
  }
  $("sign-in").hidden = true;
  $("chat-app").hidden = false;
  $("sign-out").hidden = false;
  $("whoami").textContent = "Signed in";
  const wanted = new URLSearchParams(location.hash.slice(1)).get("chat");
  if (wanted && state.chats.some((c) => c.id === wanted)) await openChat(wanted);
  else renderChat();
  $("composer-input").focus();
}

function wire() {
  $("sign-in-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const value = $("token-input").value.trim();
    if (!value) return;
    Session.save(value, $("remember").checked);
    $("token-input").value = "";
    $("sign-in-error").textContent = "";
    await enter();
  });
  $("sign-out").addEventListener("click", () => signOut(""));
  $("new-chat").addEventListener("click", newChat);
  $("rename-chat").addEventListener("click", startRename);
  $("delete-chat").addEventListener("click", deleteChat);
  $("settings-form").addEventListener("submit", saveSettings);
  $("model-select").addEventListener("change", changeModel);
  $("stop").addEventListener("click", stop);
  $("composer").addEventListener("submit", (ev) => {
    ev.preventDefault();
    const text = $("composer-input").value.trim();
    if (text && !state.running) send(text);
  });
  $("composer-input").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
      ev.preventDefault();
      $("composer").requestSubmit();
    }
  });
  document.addEventListener("keydown", (ev) => {
    if (ev.key === "Escape" && state.running) stop();
  });
}

wire();
if (Session.token()) enter();
else signOut("");
