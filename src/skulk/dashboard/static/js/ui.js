// Small shared pieces: the html tag, number formats, bars, badges, a confirm-in-place button.
import { h } from '../vendor/preact.js';
import { useEffect, useRef, useState } from '../vendor/hooks.js';
import htm from '../vendor/htm.js';

export const html = htm.bind(h);

// The placement arithmetic counts GiB and prints "GB"; the dashboard prints the same numbers.
const GIB = 2 ** 30;
export const gb = (bytes) => `${((bytes || 0) / GIB).toFixed(2)} GB`;
export const bytesOf = (size) => (size && typeof size === 'object' ? size.inBytes || 0 : size || 0);
export const pct = (part, whole) => (whole > 0 ? Math.max(0, Math.min(100, (100 * part) / whole)) : 0);
export const shortId = (id) => (id ? String(id).slice(0, 8) : '');
export const secs = (s) => (s == null ? '–' : s < 10 ? `${s.toFixed(1)} s` : `${Math.round(s)} s`);

export function ago(ms) {
  const s = Math.max(0, (Date.now() - ms) / 1000);
  if (s < 60) return `${Math.round(s)} s ago`;
  if (s < 3600) return `${Math.round(s / 60)} min ago`;
  return `${Math.round(s / 3600)} h ago`;
}

// The single key of a tagged union as the API writes it ({"RunnerReady": {...}} -> ["RunnerReady", {...}]).
export function tagged(value) {
  if (!value || typeof value !== 'object') return [String(value || ''), {}];
  const [key] = Object.keys(value);
  return [key, value[key] || {}];
}

export function Bar({ label, used, total, extra = 0, title }) {
  const usedPct = pct(used, total);
  const extraPct = Math.min(100 - usedPct, pct(extra, total));
  // used and free said in words (a bare "3 GB of 16 GB" reads either way); free after `extra` when it is given
  const free = Math.max(0, total - used - extra);
  const text = `${gb(used)} used${extra ? ` + ${gb(extra)} this model` : ''} · ${gb(free)} free of ${gb(total)}`;
  const level = usedPct + extraPct > 90 ? 'bar-high' : usedPct + extraPct > 75 ? 'bar-mid' : '';
  return html`<div class=${label ? 'bar-row' : 'bar-row no-label'} title=${title || text}>
    ${label && html`<span class="bar-label">${label}</span>`}
    <span class=${`bar ${level}`} role="meter" aria-label=${label || 'usage'} aria-valuemin="0" aria-valuemax="100"
      aria-valuenow=${Math.round(usedPct + extraPct)} aria-valuetext=${text}>
      <span class="bar-used" style=${{ width: `${usedPct}%` }}></span>
      ${extra > 0 && html`<span class="bar-extra" style=${{ width: `${extraPct}%` }}></span>`}
    </span>
    <span class="bar-text">${text}</span>
  </div>`;
}

export function Badge({ kind = '', children, title }) {
  return html`<span class=${`badge ${kind}`} title=${title}>${children}</span>`;
}

export function ErrorNote({ error, what }) {
  if (!error) return null;
  return html`<p class="error" role="alert">${what ? `${what}: ` : ''}${error.message || String(error)}</p>`;
}

export function Section({ title, actions, children, id }) {
  return html`<section class="panel" aria-labelledby=${id}>
    <header class="panel-head"><h2 id=${id}>${title}</h2>${actions}</header>
    ${children}
  </section>`;
}

// A destructive button that asks in place ("Delete?" → Yes / Cancel) instead of a blocking window.confirm.
export function ConfirmButton({ label, question, onConfirm, busy, testid }) {
  const [asking, setAsking] = useState(false);
  const yes = useRef(null);
  useEffect(() => { if (asking && yes.current) yes.current.focus(); }, [asking]);
  if (!asking) {
    return html`<button class="danger" type="button" disabled=${busy} data-testid=${testid}
      onClick=${() => setAsking(true)}>${busy ? '…' : label}</button>`;
  }
  return html`<span class="confirm" role="group" aria-label=${question}>
    <span>${question}</span>
    <button class="danger" type="button" data-testid=${testid && `${testid}-yes`} ref=${yes}
      onClick=${() => { setAsking(false); onConfirm(); }}>Yes, ${label.toLowerCase()}</button>
    <button type="button" onClick=${() => setAsking(false)}>Cancel</button>
  </span>`;
}

// Runner status → instance status, as `skulk diag` and seed 003 word it.
const SERVING = new Set(['RunnerReady', 'RunnerRunning']);
export function instanceStatus(state, instanceId) {
  const inst = (state.instances || {})[instanceId];
  if (!inst) return { kind: 'gone', text: 'gone' };
  const [, body] = tagged(inst);
  const runners = Object.keys((body.shardAssignments || {}).runnerToShard || {});
  const kinds = runners.map((r) => tagged((state.runners || {})[r])[0] || 'pending');
  const retries = (state.instanceRetries || {})[instanceId];
  if (retries && retries.failed) return { kind: 'error', text: `failed: ${retries.failed}` };
  if (kinds.some((k) => k === 'RunnerFailed')) return { kind: 'error', text: 'runner failed' };
  if (kinds.length && kinds.every((k) => SERVING.has(k))) return { kind: 'ok', text: 'healthy' };
  const waiting = kinds.filter((k) => !SERVING.has(k)).map((k) => k.replace('Runner', '') || 'pending');
  return { kind: 'busy', text: `starting (${[...new Set(waiting)].join(', ') || 'pending'})` };
}

// Models that can chat now: a served instance whose card is not an embedding model's (those answer only
// POST /v1/embeddings).
export function servedModels(state) {
  const models = new Set();
  for (const [id, inst] of Object.entries(state.instances || {})) {
    const [, body] = tagged(inst);
    const shards = Object.values(body.shardAssignments.runnerToShard || {}).map((s) => tagged(s)[1]);
    const embeds = shards.some((s) => (s.modelCard?.tasks || []).includes('TextEmbedding'));
    if (instanceStatus(state, id).kind === 'ok' && !embeds) models.add(body.shardAssignments.modelId);
  }
  return [...models].sort();
}

export function nodeName(state, nodeId) {
  const ident = (state.nodeIdentities || {})[nodeId];
  return ident && ident.friendlyName ? `${ident.friendlyName} · ${shortId(nodeId)}` : shortId(nodeId);
}
