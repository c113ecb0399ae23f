// The dashboard shell: navigation between the six pages (real paths; the server falls back to index.html),
// the cluster state polled once for every page, the API-key prompt, and what to show while this node is down.
import { render } from '../vendor/preact.js';
import { useEffect, useRef, useState } from '../vendor/hooks.js';
import { events, setApiKey, usePoll } from './api.js';
import { html, ago, nodeName } from './ui.js';
import { navigate } from './nav.js';
import { ClusterPage } from './pages/cluster.js';
import { ModelsPage } from './pages/models.js';
import { PlacingPage } from './pages/placing.js';
import { ChatPage } from './pages/chat.js';
import { OperatorPage } from './pages/operator.js';
import { SettingsPage } from './pages/settings.js';

export const STATE_POLL_MS = 2000;

const PAGES = [
  { path: '/', title: 'Cluster', view: ClusterPage },
  { path: '/catalog', title: 'Models', view: ModelsPage },
  { path: '/placing', title: 'Placing', view: PlacingPage },
  { path: '/chat', title: 'Chat', view: ChatPage },
  { path: '/operator', title: 'Operator', view: OperatorPage },
  { path: '/settings', title: 'Settings', view: SettingsPage },
];
const pageFor = (path) => PAGES.find((p) => p.path === path) || (path === '/cluster' ? PAGES[0] : null);


export const plural = (n, word) => `${n} ${word}${n === 1 ? '' : 's'}`;

// Light, dark, or the system's choice (auto), kept in this browser; app.css reads <html data-theme>.
const THEME_STORE = 'skulk.theme';
const THEMES = ['auto', 'light', 'dark'];
function applyTheme(theme) {
  if (theme === 'auto') delete document.documentElement.dataset.theme;
  else document.documentElement.dataset.theme = theme;
}
function savedTheme() {
  try { return THEMES.includes(localStorage.getItem(THEME_STORE)) ? localStorage.getItem(THEME_STORE) : 'auto'; } catch { return 'auto'; }
}
applyTheme(savedTheme());

function ThemeSwitch() {
  const [theme, setTheme] = useState(savedTheme);
  const next = () => {
    const t = THEMES[(THEMES.indexOf(theme) + 1) % THEMES.length];
    try { localStorage.setItem(THEME_STORE, t); } catch { /* disabled */ }
    applyTheme(t);
    setTheme(t);
  };
  return html`<button type="button" class="theme-switch" onClick=${next} data-testid="theme-switch"
    title="Colour theme: auto follows the system" aria-label=${`Theme: ${theme}`}>Theme: ${theme}</button>`;
}

function usePath() {
  const [path, setPath] = useState(window.location.pathname);
  useEffect(() => {
    const update = () => setPath(window.location.pathname);
    window.addEventListener('popstate', update);
    window.addEventListener('skulk:navigate', update);
    return () => { window.removeEventListener('popstate', update); window.removeEventListener('skulk:navigate', update); };
  }, []);
  return path;
}

function NavLink({ page, current }) {
  const onClick = (e) => {
    if (e.metaKey || e.ctrlKey || e.shiftKey || e.button !== 0) return;
    e.preventDefault();
    navigate(page.path);
  };
  return html`<a href=${page.path} class="nav-link" aria-current=${current ? 'page' : undefined}
    onClick=${onClick}>${page.title}</a>`;
}

// Nodes this page has seen that the cluster no longer lists: shown as gone rather than silently dropped.
function useGoneNodes(state) {
  const seen = useRef(new Map());
  if (!state) return [];
  const live = new Set(Object.keys(state.nodeIdentities || {}).concat((state.topology || {}).nodes || []));
  for (const id of live) seen.current.set(id, { id, name: nodeName(state, id), goneAt: null });
  const gone = [];
  for (const entry of seen.current.values()) {
    if (live.has(entry.id)) continue;
    if (!entry.goneAt) entry.goneAt = Date.now();
    gone.push(entry);
  }
  return gone;
}

function KeyPrompt({ onDone }) {
  const [key, setKey] = useState('');
  const input = useRef(null);
  useEffect(() => { if (input.current) input.current.focus(); }, []);
  const submit = (e) => { e.preventDefault(); setApiKey(key.trim()); onDone(false); };
  return html`<div class="modal-backdrop">
    <form class="modal" role="dialog" aria-modal="true" aria-labelledby="key-title" onSubmit=${submit}>
      <h2 id="key-title">API key needed</h2>
      <p>This cluster asks for an API key. It is kept in this browser only and sent as${' '}
        <code>Authorization: Bearer …</code> with every request.</p>
      <label>API key <input ref=${input} type="password" autocomplete="off" value=${key}
        onInput=${(e) => setKey(e.target.value)} data-testid="api-key" required /></label>
      <div class="row"><button type="submit" class="primary">Use this key</button>
        <button type="button" onClick=${() => onDone(true)}>Not now</button></div>
    </form>
  </div>`;
}

function DownBanner({ error, at }) {
  if (!error || (error.status > 0 && error.status < 500)) return null;  // 401/403 are not "down"; the key prompt says
  const since = at ? `; showing the cluster as it was ${ago(at)}` : '';
  return html`<div class="banner" role="status" data-testid="node-down">
    This node is not answering (${error.message})${since}. The page keeps trying; any other node's dashboard works too.
  </div>`;
}

function App() {
  const path = usePath();
  const page = pageFor(path);
  const [askKey, setAskKey] = useState(false);
  const dismissed = useRef(false);
  const [{ data: state, error, at }, refreshState] = usePoll('/state', STATE_POLL_MS);
  const gone = useGoneNodes(state);
  useEffect(() => {
    const ask = () => { if (!dismissed.current) setAskKey(true); };
    events.addEventListener('unauthorized', ask);
    return () => events.removeEventListener('unauthorized', ask);
  }, []);
  useEffect(() => { document.title = `${page ? page.title : 'Not found'} · Skulk`; }, [page]);
  const View = page && page.view;
  const master = state && state.masterNodeId ? nodeName(state, state.masterNodeId) : null;
  return html`
    <header class="top">
      <a class="brand" href="/" onClick=${(e) => { e.preventDefault(); navigate('/'); }}>Skulk</a>
      <nav aria-label="Pages">${PAGES.map((p) => html`<${NavLink} page=${p} current=${p === page} />`)}</nav>
      <span class="top-meta" data-testid="top-meta">${state
        ? `${plural(Object.keys(state.nodeIdentities || {}).length, 'node')} · master ${master || 'none'}`
        : error ? (error.status === 401 ? 'API key needed' : 'offline') : 'loading…'}</span>
      <${ThemeSwitch} />
      <button type="button" class="link" onClick=${() => { dismissed.current = false; setAskKey(true); }}>API key</button>
    </header>
    <${DownBanner} error=${error} at=${at} />
    <main id="main">
      ${View
        ? state ? html`<${View} state=${state} gone=${gone} refreshState=${refreshState} />`
          : html`<p class="muted">${error ? error.message : 'Loading the cluster state…'}</p>`
        : html`<section class="panel"><h2>Not found</h2><p>No page at ${path}. <a href="/">Cluster</a></p></section>`}
    </main>
    ${askKey && html`<${KeyPrompt} onDone=${(skipped) => { dismissed.current = !!skipped; setAskKey(false); }} />`}`;
}

render(html`<${App} />`, document.getElementById('root'));
