// Every request the dashboard makes goes through here: a timeout on each (a dead or frozen node must never
// hang the page), the API key when one is set, and the API's error shape {"error": {message, code}} turned
// into an ApiError whose message says what to fix.
import { useEffect, useState, useRef, useCallback } from '../vendor/hooks.js';

const KEY_STORAGE = 'skulk.apiKey';
export const events = new EventTarget();

export class ApiError extends Error {
  constructor(status, message, code = null, body = null) {
    super(message);
    this.status = status;
    this.code = code;
    this.body = body;
  }
}

export function apiKey() {
  try { return localStorage.getItem(KEY_STORAGE) || ''; } catch { return ''; }
}

export function setApiKey(key) {
  try {
    if (key) localStorage.setItem(KEY_STORAGE, key); else localStorage.removeItem(KEY_STORAGE);
  } catch { /* storage disabled: the key lives for this page only */ }
  events.dispatchEvent(new Event('key'));
}

export function headers(extra = {}) {
  const key = apiKey();
  return { Accept: 'application/json', ...(key ? { Authorization: `Bearer ${key}` } : {}), ...extra };
}

function signalFor(timeout, signal) {
  const timer = AbortSignal.timeout(timeout);
  return signal ? AbortSignal.any([timer, signal]) : timer;
}

export async function errorOf(res) {
  let body = null;
  let text = '';
  try { text = await res.text(); body = JSON.parse(text); } catch { /* not JSON */ }
  const err = body && body.error;
  const message = (err && (err.message || err)) || (body && body.detail) || text || `HTTP ${res.status}`;
  return new ApiError(res.status, typeof message === 'string' ? message : JSON.stringify(message), err && err.code, body);
}

export function unauthorized() {
  events.dispatchEvent(new Event('unauthorized'));
  return new ApiError(401, 'this cluster needs an API key', 'unauthorized');
}

// fetch with the key, a timeout, and typed errors; resolves to the parsed JSON body.
export async function request(path, { method = 'GET', body, timeout = 10000, signal } = {}) {
  const init = { method, headers: headers(body === undefined ? {} : { 'Content-Type': 'application/json' }),
    signal: signalFor(timeout, signal) };
  if (body !== undefined) init.body = JSON.stringify(body);
  let res;
  try {
    res = await fetch(path, init);
  } catch (e) {
    if (signal && signal.aborted) throw e;
    const why = e && e.name === 'TimeoutError' ? `no answer in ${Math.round(timeout / 1000)} s` : 'node not reachable';
    throw new ApiError(0, `${method} ${path}: ${why}`, 'unreachable');
  }
  if (res.status === 401) throw unauthorized();
  if (!res.ok) throw await errorOf(res);
  const text = await res.text();
  return text ? JSON.parse(text) : null;
}

// Poll `path` every `interval` ms while the tab is visible; {data, error, at} of the last answer. The last good
// data stays while errors come, so a node that stops answering leaves the page readable.
export function usePoll(path, interval, { enabled = true, timeout } = {}) {
  const [result, setResult] = useState({ data: null, error: null, at: 0 });
  const [nonce, setNonce] = useState(0);
  const shown = useRef(path);
  const refresh = useCallback(() => setNonce((n) => n + 1), []);
  useEffect(() => {
    if (shown.current !== path) {  // another question: never show the old answer under it
      shown.current = path;
      setResult({ data: null, error: null, at: 0 });
    }
    if (!enabled || !path) return undefined;
    let stopped = false;
    let timer = null;
    const ctrl = new AbortController();
    const tick = async () => {
      if (!document.hidden) {
        try {
          const data = await request(path, { signal: ctrl.signal, timeout: timeout || Math.max(8000, interval * 2) });
          if (!stopped) setResult({ data, error: null, at: Date.now() });
        } catch (e) {
          if (!stopped) setResult((r) => ({ ...r, error: e }));
        }
      }
      if (!stopped) timer = setTimeout(tick, interval);
    };
    const onKey = () => { clearTimeout(timer); tick(); };
    events.addEventListener('key', onKey);
    tick();
    return () => { stopped = true; clearTimeout(timer); ctrl.abort(); events.removeEventListener('key', onKey); };
  }, [path, interval, enabled, nonce]);
  return [result, refresh];
}

// An action (POST, DELETE…) with its own busy flag and error, for buttons.
export function useAction() {
  const [state, setState] = useState({ busy: false, error: null, result: null });
  const alive = useRef(true);
  useEffect(() => () => { alive.current = false; }, []);
  const run = useCallback(async (fn) => {
    setState({ busy: true, error: null, result: null });
    try {
      const result = await fn();
      if (alive.current) setState({ busy: false, error: null, result });
      return result;
    } catch (e) {
      if (alive.current) setState({ busy: false, error: e, result: null });
      return undefined;
    }
  }, []);
  return [state, run];
}

// Whether this node's API has a route (another release may not): read once from its OpenAPI document.
let routesPromise = null;
export function apiRoutes() {
  if (!routesPromise) {
    routesPromise = request('/openapi.json', { timeout: 10000 })
      .then((doc) => new Set(Object.keys((doc && doc.paths) || {})))
      .catch((e) => { routesPromise = null; throw e; });
  }
  return routesPromise;
}
