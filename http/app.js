// asyncengine's chat page. Plain JavaScript, no build step; the libraries are vendored
// (webui/vendor/): marked renders markdown, DOMPurify sanitizes its HTML, highlight.js
// colours code. Every URL is relative to the page, so the page works under --root-path.
//
// Model output never becomes markup: raw HTML in it is escaped by the markdown renderer (it
// shows as text), the rendered HTML goes through DOMPurify, and the page's
// Content-Security-Policy allows no inline script and no other host besides.
"use strict";

(() => {
  const STORE = "asyncengine.webui.";
  const $ = (id) => document.getElementById(id);
  const EMPTY = document.getElementById("empty"); // taken out of the page and put back
  const el = (tag, cls, text) => {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  };

  // ---------------------------------------------------------------- storage

  function load(key, fallback) {
    try {
      const raw = localStorage.getItem(STORE + key);
      return raw === null ? fallback : JSON.parse(raw);
    } catch (e) {
      return fallback;
    }
  }

  function store(key, value) {
    try {
      if (value === null || value === undefined) localStorage.removeItem(STORE + key);
      else localStorage.setItem(STORE + key, JSON.stringify(value));
    } catch (e) {
      showError("Cannot save to this browser's storage: " + e.message);
    }
  }

  const state = {
    conversations: load("conversations", []),
    currentId: load("current", null),
    // null: the server's default.
    settings: Object.assign({ model: null, system: "", temperature: null, maxTokens: null },
                            load("settings", {})),
    apiKey: load("apiKey", null),
    config: { api_key_required: false, defaults: { temperature: 1.0, max_tokens: null } },
    models: [],
    modelStatus: {}, // a router's models: id -> "loaded", "unloaded", ...
    busy: null, // { controller, conversation } while a request is in flight
  };

  const saveConversations = () => store("conversations", state.conversations);
  const saveSettings = () => store("settings", state.settings);

  function current() {
    return state.conversations.find((c) => c.id === state.currentId) || null;
  }

  function newId() {
    return Date.now().toString(36) + Math.random().toString(36).slice(2, 8);
  }

  function createConversation() {
    const conv = { id: newId(), title: "New chat", created: Date.now(), updated: Date.now(),
                   messages: [] };
    state.conversations.unshift(conv);
    selectConversation(conv.id);
    return conv;
  }

  function selectConversation(id) {
    state.currentId = id;
    store("current", id);
    closeSidebar();
    renderSidebar();
    renderMessages();
  }

  // ---------------------------------------------------------------- markdown

  const escapeHtml = (s) => String(s).replace(/[&<>"']/g, (c) => (
    { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));

  const md = new marked.Marked({ gfm: true, breaks: true, async: false });
  md.use({
    renderer: {
      // Raw HTML in the output is shown as text, never parsed.
      html(token) { return escapeHtml(token.text || token.raw || ""); },
      // An image would be fetched at once (from anywhere): show a link instead.
      image(token) {
        const label = "[image: " + (token.text || token.href || "") + "]";
        return '<a href="' + escapeHtml(token.href || "") + '">' + escapeHtml(label) + "</a>";
      },
      code(token) {
        const lang = (token.lang || "").trim().split(/\s+/)[0].toLowerCase();
        let body;
        if (lang && window.hljs && hljs.getLanguage(lang)) {
          body = hljs.highlight(token.text, { language: lang, ignoreIllegals: true }).value;
        } else {
          body = escapeHtml(token.text);
        }
        const cls = "hljs" + (lang ? " language-" + escapeHtml(lang) : "");
        return '<pre><code class="' + cls + '">' + body + "</code></pre>\n";
      },
    },
  });

  const PURIFY = {
    FORBID_TAGS: ["img", "svg", "math", "style", "form", "input", "button", "textarea",
                  "select", "iframe", "object", "embed", "video", "audio", "source",
                  "picture", "link", "meta", "base"],
    FORBID_ATTR: ["style", "srcset"],
  };
  DOMPurify.addHook("afterSanitizeAttributes", (node) => {
    if (node.tagName === "A" && node.hasAttribute("href")) {
      node.setAttribute("target", "_blank");
      node.setAttribute("rel", "noopener noreferrer");
    }
  });

  function renderMarkdown(target, text) {
    const html = md.parse(text || "");
    target.replaceChildren(DOMPurify.sanitize(html, { ...PURIFY, RETURN_DOM_FRAGMENT: true }));
  }

  // ---------------------------------------------------------------- API

  class ApiError extends Error {
    constructor(status, message, retryAfter) {
      super(message);
      this.status = status;
      this.retryAfter = retryAfter;
    }
  }

  function apiFetch(path, options = {}) {
    const headers = Object.assign({}, options.headers || {});
    if (state.apiKey) headers.Authorization = "Bearer " + state.apiKey;
    return fetch(path, Object.assign({}, options, { headers }));
  }

  async function responseError(resp) {
    let message = resp.statusText || "";
    try {
      const text = await resp.text();
      try {
        const body = JSON.parse(text);
        message = (body.error && (body.error.message || body.error)) || body.message || text;
      } catch (e) {
        if (text) message = text.slice(0, 300);
      }
    } catch (e) { /* no body */ }
    return new ApiError(resp.status, String(message), resp.headers.get("Retry-After"));
  }

  function describeError(e) {
    if (e instanceof ApiError) {
      const msg = e.message ? ": " + e.message : "";
      const retry = e.retryAfter ? " Try again in " + e.retryAfter + " s." : "";
      switch (e.status) {
        case 400: return "The server refused the request (400)" + msg;
        case 401: return "The API key was refused (401)" + msg;
        case 404: return "Not found (404)" + msg;
        case 413: return "The conversation is too large for the server (413)" + msg;
        case 503: return "The server is busy or shutting down (503)" + msg + retry;
        case 0: return "The stream failed" + msg;
        default: return "The server answered " + e.status + msg + retry;
      }
    }
    if (e instanceof TypeError) return "Cannot reach the server: " + e.message;
    return String(e && e.message ? e.message : e);
  }

  // The events of a text/event-stream body: parsed JSON objects, and "[DONE]".
  async function* sseEvents(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      buffer += done ? decoder.decode() : decoder.decode(value, { stream: true });
      const blocks = buffer.split(/\r?\n\r?\n/);
      buffer = done ? "" : blocks.pop();
      for (const block of blocks) {
        const data = block.split(/\r?\n/).filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, "")).join("\n");
        if (!data) continue;
        yield data === "[DONE]" ? data : JSON.parse(data);
      }
      if (done) return;
    }
  }

  // ---------------------------------------------------------------- API key

  function askKey(message) {
    const dialog = $("key-dialog");
    $("key-message").textContent = message ||
      "This server needs an API key (its --api-key).";
    $("key-input").value = "";
    return new Promise((resolve) => {
      const onSubmit = (event) => {
        event.preventDefault();
        const key = $("key-input").value.trim();
        if (!key) return;
        $("key-form").removeEventListener("submit", onSubmit);
        state.apiKey = key;
        store("apiKey", key);
        $("forget-key").hidden = false;
        dialog.close();
        resolve(key);
      };
      $("key-form").addEventListener("submit", onSubmit);
      if (!dialog.open) dialog.showModal();
      $("key-input").focus();
    });
  }
  $("key-dialog").addEventListener("cancel", (e) => e.preventDefault()); // no key, no chat

  function forgetKey() {
    state.apiKey = null;
    store("apiKey", null);
    $("forget-key").hidden = true;
  }

  async function refusedKey(e) {
    forgetKey();
    await askKey(describeError(e) + " Enter the server's key.");
  }

  // ---------------------------------------------------------------- models, settings

  async function loadConfig() {
    try {
      const resp = await fetch("webui/config");
      if (resp.ok) state.config = await resp.json();
    } catch (e) { /* keep the defaults */ }
  }

  async function loadModels() {
    for (;;) {
      let resp;
      try {
        resp = await apiFetch("v1/models");
      } catch (e) {
        showError(describeError(e), loadModels);
        return;
      }
      if (resp.status === 401) {
        await refusedKey(await responseError(resp));
        continue;
      }
      if (!resp.ok) {
        showError(describeError(await responseError(resp)), loadModels);
        return;
      }
      const body = await resp.json();
      state.models = (body.data || []).map((m) => m.id);
      // A router (--models-dir) says each model's status: loaded, loading, unloaded...
      state.modelStatus = Object.fromEntries((body.data || []).filter((m) => m.status)
        .map((m) => [m.id, m.status.value]));
      break;
    }
    hideError();
    const select = $("model");
    const chosen = select.value;
    select.replaceChildren(...state.models.map((id) => {
      const status = state.modelStatus[id];
      const option = el("option", null, status ? `${id} (${status})` : id);
      option.value = id;
      return option;
    }));
    if (chosen && state.models.includes(chosen)) {
      select.value = chosen;
    } else if (state.settings.model && state.models.includes(state.settings.model)) {
      select.value = state.settings.model;
    }
    showLoadButton();
  }

  // A router's model that is not loaded: a button loads it (a request would load it too).
  function showLoadButton() {
    const status = state.modelStatus[$("model").value];
    const button = $("load-model");
    button.hidden = !status || status === "loaded";
    button.disabled = status === "loading";
    button.textContent = status === "loading" ? "Loading…" :
      status === "sleeping" ? "Wake" : "Load";
  }

  async function loadChosenModel() {
    const model = $("model").value;
    state.modelStatus[model] = "loading";
    showLoadButton();
    let resp;
    try {
      resp = await apiFetch("models/load", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify({ model }) });
    } catch (e) {
      showError(describeError(e), loadChosenModel);
      return loadModels();
    }
    if (resp.status === 401) {
      await refusedKey(await responseError(resp));
      return loadChosenModel();
    }
    if (!resp.ok) showError(describeError(await responseError(resp)), loadChosenModel);
    await loadModels();
  }

  const serverDefault = (name) => (state.config.defaults || {})[name] ?? null;

  function showSettings() {
    const s = state.settings;
    $("system").value = s.system || "";
    $("temperature").value = s.temperature ?? serverDefault("temperature") ?? "";
    $("max-tokens").value = s.maxTokens ?? serverDefault("max_tokens") ?? "";
  }

  function numberOrNull(input) {
    const v = input.value.trim();
    return v === "" || Number.isNaN(Number(v)) ? null : Number(v);
  }

  $("system").addEventListener("input", () => {
    state.settings.system = $("system").value;
    saveSettings();
  });
  $("temperature").addEventListener("change", () => {
    state.settings.temperature = numberOrNull($("temperature"));
    saveSettings();
  });
  $("max-tokens").addEventListener("change", () => {
    state.settings.maxTokens = numberOrNull($("max-tokens"));
    saveSettings();
  });
  $("model").addEventListener("change", () => {
    state.settings.model = $("model").value;
    saveSettings();
    showLoadButton();
  });
  $("load-model").addEventListener("click", loadChosenModel);
  $("reset-settings").addEventListener("click", () => {
    Object.assign(state.settings, { system: "", temperature: null, maxTokens: null });
    saveSettings();
    showSettings();
  });
  $("forget-key").addEventListener("click", forgetKey);
  $("toggle-settings").addEventListener("click", () => {
    const panel = $("settings");
    panel.hidden = !panel.hidden;
    $("toggle-settings").setAttribute("aria-expanded", String(!panel.hidden));
  });

  // ---------------------------------------------------------------- chat

  function requestBody(conv) {
    const s = state.settings;
    const messages = [];
    if (conv.system) messages.push({ role: "system", content: conv.system });
    for (const m of conv.messages) {
      if (m.role === "assistant" && !m.content) continue;
      if (m.images && m.images.length) {  // the images first, as data URLs, then the text
        const parts = m.images.map((url) => ({ type: "image_url", image_url: { url } }));
        if (m.content) parts.push({ type: "text", text: m.content });
        messages.push({ role: m.role, content: parts });
      } else {
        messages.push({ role: m.role, content: m.content });
      }
    }
    const body = { model: $("model").value || state.models[0] || undefined, messages,
                   stream: true, stream_options: { include_usage: true } };
    const temperature = s.temperature ?? serverDefault("temperature");
    if (temperature !== null) body.temperature = temperature;
    const maxTokens = s.maxTokens ?? serverDefault("max_tokens");
    if (maxTokens !== null) body.max_tokens = maxTokens;
    return body;
  }

  async function generate(conv) {
    if (state.busy) return;
    hideError();
    conv.system = state.settings.system || "";
    const body = requestBody(conv);
    const answer = { role: "assistant", content: "", reasoning: "", model: body.model };
    conv.messages.push(answer);
    conv.updated = Date.now();
    const controller = new AbortController();
    state.busy = { controller, conversation: conv };
    setBusy(true);
    renderMessages();
    const started = performance.now();
    let first = null;
    let usage = null;
    let pieces = 0;
    try {
      const resp = await apiFetch("v1/chat/completions", {
        method: "POST", headers: { "Content-Type": "application/json" },
        body: JSON.stringify(body), signal: controller.signal,
      });
      if (!resp.ok) throw await responseError(resp);
      for await (const event of sseEvents(resp.body)) {
        if (event === "[DONE]") break;
        if (event.error) {
          const err = event.error;
          throw new ApiError(err.code && Number(err.code) ? Number(err.code) : 0,
                             err.message || String(err));
        }
        if (event.usage) usage = event.usage;
        const choice = event.choices && event.choices[0];
        if (!choice) continue;
        const delta = choice.delta || {};
        const reasoning = delta.reasoning_content ?? delta.reasoning;
        if (reasoning) answer.reasoning += reasoning;
        if (delta.content) answer.content += delta.content;
        if (reasoning || delta.content) {
          pieces += 1;
          if (first === null) first = performance.now();
        }
        if (choice.finish_reason) answer.finish_reason = choice.finish_reason;
        scheduleStreamRender(conv, answer);
      }
      const end = performance.now();
      answer.stats = stats(usage, started, first, end);
    } catch (e) {
      if (e.name === "AbortError") {
        answer.stopped = true;
        answer.stats = { stopped: true, pieces };
      } else {
        if (!answer.content && !answer.reasoning) conv.messages.pop();
        else answer.error = describeError(e);
        if (e instanceof ApiError && e.status === 401) {
          finish(conv);
          await refusedKey(e);
          return generate(conv);
        }
        showError(describeError(e), () => generate(conv));
      }
    }
    finish(conv);
  }

  function finish(conv) {
    state.busy = null;
    conv.updated = Date.now();
    saveConversations();
    setBusy(false);
    renderSidebar();
    if (conv === current()) renderMessages();
    if (Object.keys(state.modelStatus).length) loadModels(); // the request may have loaded it
  }

  function stats(usage, started, first, end) {
    const out = { total_s: (end - started) / 1000 };
    if (first !== null) out.ttft_s = (first - started) / 1000;
    if (usage) {
      out.prompt_tokens = usage.prompt_tokens;
      out.completion_tokens = usage.completion_tokens;
      const decode = first !== null ? (end - first) / 1000 : 0;
      // The first token's time is the prompt's; the rate is over the rest (when they did
      // not all arrive at once).
      if (decode >= 0.05 && usage.completion_tokens > 1) {
        out.tokens_per_s = (usage.completion_tokens - 1) / decode;
      }
    }
    return out;
  }

  function statsText(s) {
    if (!s) return "";
    if (s.stopped) return "stopped" + (s.pieces ? " after ~" + s.pieces + " tokens" : "");
    const parts = [];
    if (s.completion_tokens !== undefined) parts.push(s.completion_tokens + " tokens");
    if (s.tokens_per_s !== undefined) parts.push(s.tokens_per_s.toFixed(1) + " tok/s");
    if (s.prompt_tokens !== undefined) parts.push("prompt " + s.prompt_tokens + " tokens");
    if (s.ttft_s !== undefined) parts.push("first token " + s.ttft_s.toFixed(2) + " s");
    return parts.join(" · ");
  }

  function stop() {
    if (state.busy) state.busy.controller.abort();
  }

  function send() {
    const text = $("input").value;
    const images = state.attached.slice();
    if ((!text.trim() && !images.length) || state.busy) return;
    const conv = current() || createConversation();
    if (!conv.messages.length) conv.title = titleOf(text) || "Image";
    const msg = { role: "user", content: text };
    if (images.length) msg.images = images;
    conv.messages.push(msg);
    $("input").value = "";
    state.attached = [];
    renderAttachments();
    autoGrow();
    renderSidebar();
    generate(conv);
  }

  function titleOf(text) {
    const line = text.trim().split(/\n/)[0];
    return line.length > 48 ? line.slice(0, 47) + "…" : line;
  }

  function regenerate() {
    const conv = current();
    if (!conv || state.busy) return;
    while (conv.messages.length && conv.messages[conv.messages.length - 1].role === "assistant") {
      conv.messages.pop();
    }
    if (conv.messages.length) generate(conv);
  }

  function setBusy(busy) {
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    document.body.classList.toggle("busy", busy);
  }

  // ---------------------------------------------------------------- rendering

  let pending = null;
  function scheduleStreamRender(conv, answer) {
    if (pending) return;
    pending = requestAnimationFrame(() => {
      pending = null;
      // finish() has drawn the final state already.
      if (conv !== current() || !state.busy || state.busy.conversation !== conv) return;
      const node = $("messages").lastElementChild;
      if (node && node.classList.contains("assistant")) fillAssistant(node, answer, true);
      stickToBottom();
    });
  }

  function nearBottom() {
    const m = $("messages");
    return m.scrollHeight - m.scrollTop - m.clientHeight < 80;
  }

  function stickToBottom() {
    const m = $("messages");
    if (nearBottom() || state.busy) m.scrollTop = m.scrollHeight;
  }

  function fillAssistant(node, msg, streaming) {
    let details = node.querySelector(".reasoning");
    if (msg.reasoning) {
      if (!details) {
        details = el("details", "reasoning");
        details.append(el("summary", null, "Reasoning"), el("div", "reasoning-text"));
        details.open = streaming;
        node.querySelector(".body").before(details);
      }
      details.querySelector(".reasoning-text").textContent = msg.reasoning;
      if (streaming && msg.content) details.open = false;
    }
    renderMarkdown(node.querySelector(".body"), msg.content);
    node.classList.toggle("streaming", streaming);
  }

  function messageNode(conv, msg, index) {
    const last = index === conv.messages.length - 1;
    const node = el("div", "msg " + msg.role);
    node.dataset.index = String(index);
    node.append(el("div", "role", msg.role === "user" ? "You" : "Assistant"));
    const body = el("div", "body" + (msg.role === "assistant" ? " markdown" : ""));
    node.append(body);
    if (msg.role === "assistant") {
      const streaming = !!state.busy && last && state.busy.conversation === conv;
      fillAssistant(node, msg, streaming);
      if (msg.error) node.append(el("div", "msg-error", msg.error));
    } else {
      if (msg.images && msg.images.length) {
        const strip = el("div", "images");
        for (const url of msg.images) {
          const img = el("img");
          img.src = url;
          img.alt = "attached image";
          strip.append(img);
        }
        node.insertBefore(strip, body);
      }
      body.textContent = msg.content;
    }
    const meta = el("div", "meta");
    if (msg.role === "assistant") meta.append(el("span", "stats", statsText(msg.stats)));
    const actions = el("span", "actions");
    const button = (label, cls, handler) => {
      const b = el("button", cls, label);
      b.type = "button";
      b.addEventListener("click", handler);
      actions.append(b);
    };
    button("Edit", "edit", () => editMessage(node, conv, index));
    if (msg.role === "assistant") {
      button("Copy", "copy", () => navigator.clipboard && navigator.clipboard.writeText(msg.content));
      if (last) button("Regenerate", "regenerate", regenerate);
    }
    meta.append(actions);
    node.append(meta);
    return node;
  }

  function editMessage(node, conv, index) {
    if (state.busy) return;
    const msg = conv.messages[index];
    const body = node.querySelector(".body");
    const box = el("div", "edit-box");
    const area = el("textarea", "edit-text");
    area.value = msg.content;
    area.rows = Math.min(12, Math.max(2, msg.content.split("\n").length));
    const save = el("button", "primary save", msg.role === "user" ? "Save & send" : "Save");
    const cancel = el("button", "cancel", "Cancel");
    save.type = cancel.type = "button";
    save.addEventListener("click", () => {
      msg.content = area.value;
      if (msg.role === "user") {
        conv.messages.length = index + 1; // what followed answered the old text
        if (index === 0) conv.title = titleOf(area.value);
        renderSidebar();
        generate(conv);
      } else {
        saveConversations();
        renderMessages();
      }
    });
    cancel.addEventListener("click", renderMessages);
    area.addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        save.click();
      } else if (e.key === "Escape") {
        renderMessages();
      }
    });
    box.append(area, el("div", "edit-actions"));
    box.lastChild.append(save, cancel);
    body.replaceWith(box);
    node.querySelector(".meta").hidden = true;
    area.focus();
  }

  function renderMessages() {
    const conv = current();
    const list = $("messages");
    list.replaceChildren();
    if (!conv || !conv.messages.length) {
      list.append(EMPTY);
      return;
    }
    conv.messages.forEach((m, i) => list.append(messageNode(conv, m, i)));
    list.scrollTop = list.scrollHeight;
  }

  function renderSidebar() {
    const ul = $("conversations");
    ul.replaceChildren(...state.conversations.map((conv) => {
      const li = el("li", conv.id === state.currentId ? "active" : "");
      li.dataset.id = conv.id;
      const title = el("button", "conv-title", conv.title || "New chat");
      title.type = "button";
      title.title = conv.title || "";
      title.addEventListener("click", () => selectConversation(conv.id));
      const rename = el("button", "icon rename", "✎");
      rename.type = "button";
      rename.setAttribute("aria-label", "Rename");
      rename.title = "Rename";
      rename.addEventListener("click", () => renameConversation(li, conv));
      const del = el("button", "icon delete", "×");
      del.type = "button";
      del.setAttribute("aria-label", "Delete");
      del.title = "Delete";
      del.addEventListener("click", () => deleteConversation(conv));
      li.append(title, rename, del);
      return li;
    }));
  }

  function renameConversation(li, conv) {
    const input = el("input", "rename-input");
    input.value = conv.title || "";
    input.setAttribute("aria-label", "Conversation name");
    let done = false;
    const commit = (keep) => {
      if (done) return;
      done = true;
      if (keep && input.value.trim()) {
        conv.title = input.value.trim();
        saveConversations();
      }
      renderSidebar();
    };
    input.addEventListener("keydown", (e) => {
      if (e.key === "Enter") commit(true);
      else if (e.key === "Escape") commit(false);
    });
    input.addEventListener("blur", () => commit(true));
    li.replaceChildren(input);
    input.focus();
    input.select();
  }

  function deleteConversation(conv) {
    if (state.busy && state.busy.conversation === conv) stop();
    state.conversations = state.conversations.filter((c) => c !== conv);
    saveConversations();
    if (state.currentId === conv.id) {
      state.currentId = state.conversations.length ? state.conversations[0].id : null;
      store("current", state.currentId);
    }
    renderSidebar();
    renderMessages();
  }

  function download(name, data) {
    const blob = new Blob([JSON.stringify(data, null, 2)], { type: "application/json" });
    const a = el("a");
    a.href = URL.createObjectURL(blob);
    a.download = name;
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(a.href), 1000);
  }

  const stamp = () => new Date().toISOString().slice(0, 19).replace(/[:T]/g, "-");
  $("export-all").addEventListener("click", () => download(
    "asyncengine-chats-" + stamp() + ".json",
    { exported: new Date().toISOString(), conversations: state.conversations }));
  $("export-chat").addEventListener("click", () => {
    const conv = current();
    if (conv) download("asyncengine-chat-" + stamp() + ".json", conv);
  });

  // ---------------------------------------------------------------- errors

  let retryAction = null;
  function showError(text, retry) {
    $("error-text").textContent = text;
    retryAction = retry || null;
    $("error-retry").hidden = !retry;
    $("error").hidden = false;
  }
  function hideError() {
    $("error").hidden = true;
    retryAction = null;
  }
  $("error-close").addEventListener("click", hideError);
  $("error-retry").addEventListener("click", () => {
    const action = retryAction;
    hideError();
    if (action) action();
  });

  // ---------------------------------------------------------------- layout, input

  function openSidebar() {
    $("sidebar").classList.add("open");
    $("backdrop").hidden = false;
  }
  function closeSidebar() {
    $("sidebar").classList.remove("open");
    $("backdrop").hidden = true;
  }
  $("open-sidebar").addEventListener("click", openSidebar);
  $("close-sidebar").addEventListener("click", closeSidebar);
  $("backdrop").addEventListener("click", closeSidebar);

  function autoGrow() {
    const input = $("input");
    input.style.height = "auto";
    input.style.height = Math.min(input.scrollHeight, 240) + "px";
  }

  // ---------------------------------------------------------------- images

  // Images to send with the next message, as data URLs: chosen with the button, dropped on
  // the page or pasted into the message box.
  state.attached = [];

  function renderAttachments() {
    const box = $("attachments");
    box.replaceChildren();
    state.attached.forEach((url, i) => {
      const thumb = el("span", "thumb");
      const img = el("img");
      img.src = url;
      img.alt = "image " + (i + 1);
      const remove = el("button", "remove", "✕");
      remove.type = "button";
      remove.setAttribute("aria-label", "Remove image " + (i + 1));
      remove.addEventListener("click", () => {
        state.attached.splice(i, 1);
        renderAttachments();
      });
      thumb.append(img, remove);
      box.append(thumb);
    });
    box.hidden = !state.attached.length;
  }

  function attachFiles(files) {
    const images = Array.from(files || []).filter((f) => f.type.startsWith("image/"));
    return Promise.all(images.map((file) => new Promise((resolve) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => resolve(null);
      reader.readAsDataURL(file);
    }))).then((urls) => {
      for (const url of urls) if (url) state.attached.push(url);
      renderAttachments();
      return images.length;
    });
  }

  $("attach").addEventListener("click", () => $("image-input").click());
  $("image-input").addEventListener("change", (e) => {
    attachFiles(e.target.files).then(() => { e.target.value = ""; });
  });
  $("input").addEventListener("paste", (e) => {
    const files = Array.from(e.clipboardData ? e.clipboardData.files : []);
    if (files.some((f) => f.type.startsWith("image/"))) {
      e.preventDefault();
      attachFiles(files);
    }
  });
  const main = document.querySelector("main");
  main.addEventListener("dragover", (e) => {
    if (e.dataTransfer && Array.from(e.dataTransfer.types).includes("Files")) {
      e.preventDefault();
      main.classList.add("dropping");
    }
  });
  main.addEventListener("dragleave", () => main.classList.remove("dropping"));
  main.addEventListener("drop", (e) => {
    main.classList.remove("dropping");
    if (e.dataTransfer && e.dataTransfer.files.length) {
      e.preventDefault();
      attachFiles(e.dataTransfer.files);
    }
  });

  $("input").addEventListener("input", autoGrow);
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", () => {
    const conv = current();
    if (conv && !conv.messages.length) selectConversation(conv.id);
    else createConversation();
    $("input").focus();
  });

  // ---------------------------------------------------------------- start

  async function start() {
    // A conversation cut off by a reload while streaming keeps what arrived.
    if (!current() && state.conversations.length) state.currentId = state.conversations[0].id;
    renderSidebar();
    renderMessages();
    $("forget-key").hidden = !state.apiKey;
    await loadConfig();
    showSettings();
    if (state.config.api_key_required && !state.apiKey) await askKey();
    await loadModels();
    document.body.dataset.ready = "true";
    $("input").focus();
  }

  start();
})();
