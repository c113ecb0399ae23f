// Chat: a streamed answer from any served model, a stop button that cancels it (closing the stream makes the
// node cancel the request), time to first token and tokens/s per answer, a system prompt, Markdown rendering
// (tables, highlighted code with a copy button), regenerate the last answer, edit a sent message, and
// conversations kept in this browser's localStorage.
import { useEffect, useRef, useState } from '../../vendor/hooks.js';
import { ApiError, errorOf, headers, unauthorized } from '../api.js';
import { markdown } from '../markdown.js';
import { html, ErrorNote, servedModels } from '../ui.js';

const STORE = 'skulk.conversations';
// crypto.randomUUID exists only in secure contexts, and a LAN node is usually plain http://<address>.
const newId = () => `${Date.now().toString(36)}-${Math.random().toString(36).slice(2, 10)}`;
const newConversation = () => ({ id: newId(), title: 'New chat', system: '', messages: [], at: Date.now() });

function load() {
  try {
    const list = JSON.parse(localStorage.getItem(STORE) || '[]');
    return Array.isArray(list) && list.length ? list : [newConversation()];
  } catch { return [newConversation()]; }
}

function save(list) {
  try { localStorage.setItem(STORE, JSON.stringify(list.slice(0, 50))); } catch { /* full or disabled */ }
}

// Reads the SSE stream; calls onText for each content delta. Resolves with {finish, usage}.
export async function streamChat(body, signal, onText) {
  const res = await fetch('/v1/chat/completions', {
    method: 'POST', signal, body: JSON.stringify(body),
    headers: headers({ 'Content-Type': 'application/json', Accept: 'text/event-stream' }),
  });
  if (res.status === 401) throw unauthorized();
  if (!res.ok) throw await errorOf(res);
  const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
  const result = { finish: null, usage: null, id: null };
  let buffer = '';
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return result;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf('\n\n')) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split('\n')) {
        if (!line.startsWith('data: ')) continue;
        const data = line.slice(6);
        if (data === '[DONE]') return result;
        const payload = JSON.parse(data);
        if (payload.error) throw new ApiError(500, payload.error.message, payload.error.code, payload);
        result.id = result.id || payload.id;
        if (payload.usage) result.usage = payload.usage;
        const choice = (payload.choices || [])[0];
        if (choice && choice.delta && choice.delta.content) onText(choice.delta.content);
        if (choice && choice.finish_reason) result.finish = choice.finish_reason;
      }
    }
  }
}

function Stats({ stats }) {
  if (!stats) return null;
  const parts = [];
  if (stats.ttft != null) parts.push(`TTFT ${stats.ttft.toFixed(2)} s`);
  if (stats.tps != null) parts.push(`${stats.tps.toFixed(1)} tok/s`);
  if (stats.tokens != null) parts.push(`${stats.tokens} tokens`);
  if (stats.end) parts.push(stats.end);
  return html`<div class="stats small muted" data-testid="answer-stats">${parts.join(' · ')}</div>`;
}

// A user message can be edited (the conversation continues from it, the answers after it dropped); the last
// answer can be regenerated. Neither is offered while an answer streams.
function Message({ msg, live, busy, onEdit, onRegenerate }) {
  const [editing, setEditing] = useState(null);
  if (editing !== null) {
    const submit = (e) => { e.preventDefault(); if (editing.trim()) { onEdit(editing.trim()); setEditing(null); } };
    return html`<form class="msg user msg-edit" onSubmit=${submit} data-testid="msg-edit">
      <textarea rows="3" value=${editing} aria-label="Edit message" data-testid="edit-input"
        onInput=${(e) => setEditing(e.target.value)}></textarea>
      <div class="msg-actions"><button type="button" onClick=${() => setEditing(null)}>Cancel</button>
        <button type="submit" class="primary" disabled=${busy} data-testid="edit-send">Save and send</button></div>
    </form>`;
  }
  return html`<article class=${`msg ${msg.role}`} data-testid=${`msg-${msg.role}`}
      data-streaming=${live ? 'true' : 'false'}>
    <div class="msg-role">${msg.role === 'user' ? 'You' : msg.model || 'assistant'}</div>
    <div class="msg-body">${msg.role === 'assistant' ? markdown(msg.content) : msg.content}</div>
    ${msg.error && html`<p class="error" role="alert">${msg.error}</p>`}
    <${Stats} stats=${msg.stats} />
    ${!live && (onEdit || onRegenerate) && html`<div class="msg-actions">
      ${onEdit && html`<button type="button" class="link small" disabled=${busy} data-testid="edit-message"
        onClick=${() => setEditing(msg.content)}>Edit</button>`}
      ${onRegenerate && html`<button type="button" class="link small" disabled=${busy} data-testid="regenerate"
        onClick=${onRegenerate}>Regenerate</button>`}</div>`}
  </article>`;
}

function Sidebar({ list, current, onPick, onNew, onDelete }) {
  return html`<aside class="chat-list" aria-label="Conversations">
    <button type="button" onClick=${onNew} data-testid="new-chat">New chat</button>
    <ul class="plain">${list.map((c) => html`<li class=${c.id === current ? 'current' : ''}>
      <button type="button" class="link" aria-current=${c.id === current ? 'true' : undefined}
        onClick=${() => onPick(c.id)}>${c.title}</button>
      <button type="button" class="link small" aria-label=${`delete ${c.title}`} onClick=${() => onDelete(c.id)}>×</button>
    </li>`)}</ul>
  </aside>`;
}

function timing(started, first, last, tokens) {
  const ttft = first ? (first - started) / 1000 : null;
  const tps = first && last > first && tokens > 1 ? ((tokens - 1) * 1000) / (last - first) : null;
  return { ttft, tps, tokens };
}

export function ChatPage({ state }) {
  const models = servedModels(state);
  const [list, setList] = useState(load);
  const [currentId, setCurrentId] = useState(() => list[0].id);
  const [model, setModel] = useState('');
  const [maxTokens, setMaxTokens] = useState(512);
  const [temperature, setTemperature] = useState('');
  const [draft, setDraft] = useState('');
  const [live, setLive] = useState(null);
  const [error, setError] = useState(null);
  const ctrl = useRef(null);
  const bottom = useRef(null);
  const conv = list.find((c) => c.id === currentId) || list[0];
  const chosen = models.includes(model) ? model : models[0] || '';
  useEffect(() => save(list), [list]);
  useEffect(() => () => ctrl.current && ctrl.current.abort(), []);
  useEffect(() => { if (bottom.current) bottom.current.scrollIntoView({ block: 'nearest' }); }, [live, conv.messages.length]);
  const update = (fn) => setList((all) => all.map((c) => (c.id === conv.id ? fn(c) : c)));

  const send = (e) => {
    e.preventDefault();
    const text = draft.trim();
    if (!text || live || !chosen) return;
    setDraft('');
    ask([...conv.messages, { role: 'user', content: text }]);
  };
  // The conversation up to and including its last user message, answered afresh.
  const regenerate = () => {
    if (live || !chosen) return;
    const lastUser = conv.messages.map((m) => m.role).lastIndexOf('user');
    if (lastUser >= 0) ask(conv.messages.slice(0, lastUser + 1));
  };
  const edit = (index) => (text) => {
    if (live || !chosen) return;
    ask([...conv.messages.slice(0, index), { ...conv.messages[index], content: text }]);
  };

  const ask = async (history) => {
    const text = history[history.length - 1].content;
    update((c) => ({ ...c, title: c.messages.length ? c.title : text.slice(0, 40), messages: history }));
    setError(null);
    const messages = [...(conv.system.trim() ? [{ role: 'system', content: conv.system }] : []),
      ...history.map(({ role, content }) => ({ role, content }))];
    const answer = { role: 'assistant', content: '', model: chosen };
    const started = performance.now();
    let first = 0;
    let last = 0;
    let chunks = 0;
    let frame = 0;
    const controller = new AbortController();
    ctrl.current = controller;
    setLive({ ...answer });
    const onText = (t) => {
      last = performance.now();
      first = first || last;
      chunks += 1;
      answer.content += t;
      if (!frame) frame = requestAnimationFrame(() => { frame = 0; setLive({ ...answer, stats: timing(started, first, last, chunks) }); });
    };
    let end = null;
    try {
      const body = { model: chosen, messages, stream: true, max_tokens: maxTokens, stream_options: { include_usage: true } };
      if (temperature !== '') body.temperature = Number(temperature);
      const result = await streamChat(body, controller.signal, onText);
      const tokens = result.usage ? result.usage.completion_tokens : chunks;
      answer.stats = { ...timing(started, first, last, tokens), end: result.finish === 'length' ? 'max tokens reached' : 'done' };
    } catch (err) {
      end = controller.signal.aborted ? 'stopped' : 'failed';
      answer.stats = { ...timing(started, first, last, chunks), end };
      if (!controller.signal.aborted) answer.error = err.message || String(err);
    }
    if (frame) cancelAnimationFrame(frame);
    ctrl.current = null;
    setLive(null);
    update((c) => ({ ...c, messages: [...history, answer], at: Date.now() }));
  };

  const stop = () => { if (ctrl.current) ctrl.current.abort(); };
  const onKey = (e) => { if (e.key === 'Enter' && !e.shiftKey && !e.isComposing) send(e); };
  const fresh = () => {
    if (!conv.messages.length) return;  // the current one is still empty: use it
    const c = newConversation();
    setList((all) => [c, ...all]);
    setCurrentId(c.id);
  };
  const remove = (id) => setList((all) => {
    const rest = all.filter((c) => c.id !== id);
    if (id === currentId && rest.length) setCurrentId(rest[0].id);
    return rest.length ? rest : [newConversation()];
  });

  // Stop and Send are keyed so Preact replaces one with the other instead of morphing the same element: a click on
  // Stop that lands just as the answer ends must not submit a draft typed meanwhile.
  return html`<div class="chat">
    <${Sidebar} list=${list} current=${conv.id} onPick=${setCurrentId} onNew=${fresh} onDelete=${remove} />
    <section class="panel chat-main" aria-label="Chat">
      <div class="form-grid">
        <label class="model-pick">Model <select value=${chosen} onChange=${(e) => setModel(e.target.value)}
          data-testid="chat-model" title=${chosen}>
          ${models.map((m) => html`<option value=${m}>${m}</option>`)}</select></label>
        <label>Max tokens <input type="number" min="1" max="32768" value=${maxTokens} data-testid="max-tokens"
          onInput=${(e) => setMaxTokens(Math.max(1, Number(e.target.value) || 1))} /></label>
        <label>Temperature <input type="number" min="0" max="2" step="0.1" value=${temperature}
          placeholder="model default" data-testid="temperature" onInput=${(e) => setTemperature(e.target.value)} /></label>
        <label class="wide">System prompt <textarea rows="2" value=${conv.system} data-testid="system-prompt"
          onInput=${(e) => update((c) => ({ ...c, system: e.target.value }))}></textarea></label>
      </div>
      ${!models.length && html`<p class="muted">No model is served yet: place one on the${' '}
        <a href="/placing">Placing</a> page.</p>`}
      <div class="messages" aria-live="polite">
        ${conv.messages.map((m, i) => html`<${Message} key=${`${conv.id}-${i}`} msg=${m} busy=${!!live || !chosen}
          onEdit=${m.role === 'user' ? edit(i) : null}
          onRegenerate=${m.role === 'assistant' && i === conv.messages.length - 1 ? regenerate : null} />`)}
        ${live && html`<${Message} msg=${live} live=${true} />`}
        <div ref=${bottom}></div>
      </div>
      <${ErrorNote} error=${error} />
      <form class="composer" onSubmit=${send}>
        <textarea rows="3" value=${draft} placeholder="Message (Enter sends, Shift+Enter for a new line)"
          aria-label="Message" data-testid="chat-input" onInput=${(e) => setDraft(e.target.value)} onKeyDown=${onKey}></textarea>
        ${live ? html`<button key="stop" type="button" class="danger" onClick=${stop} data-testid="chat-stop">Stop</button>`
          : html`<button key="send" type="submit" class="primary" disabled=${!chosen || !draft.trim()} data-testid="chat-send">Send</button>`}
      </form>
    </section>
  </div>`;
}
