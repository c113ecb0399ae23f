// Settings: this node's skulk.yaml through GET/PUT /config. The keys the node applies at runtime (log level,
// JSON log lines, tracing: the server's liveKeys) are editable here; every other setting is listed with its
// value in force and marked "needs a restart" (edit skulk.yaml and restart the node to change it).
import { useState } from '../../vendor/hooks.js';
import { request, useAction, usePoll } from '../api.js';
import { html, Badge, ErrorNote, Section } from '../ui.js';

const LEVELS = ['DEBUG', 'INFO', 'WARNING', 'ERROR'];

// Dotted keys and values of the settings in force, for the "needs a restart" list.
function flatten(value, prefix = '') {
  if (value && typeof value === 'object' && !Array.isArray(value)) {
    return Object.entries(value).flatMap(([k, v]) => flatten(v, `${prefix}${k}.`));
  }
  return [[prefix.slice(0, -1), value]];
}

function LiveForm({ view, act, run, onSaved }) {
  const eff = view.effective;
  const [level, setLevel] = useState(eff.logging.level.toUpperCase());
  const [json, setJson] = useState(!!eff.logging.enabled);
  const [tracing, setTracing] = useState(!!eff.tracing.enabled);
  const file = view.config || {};
  const save = (e) => {
    e.preventDefault();
    const body = { ...file, logging: { ...(file.logging || {}), level, enabled: json },
      tracing: { ...(file.tracing || {}), enabled: tracing } };
    run(() => request('/config', { method: 'PUT', body })).then((r) => { if (r) onSaved(); });
  };
  const applied = act.result && (act.result.applied || []);
  return html`<form class="form-grid" onSubmit=${save} data-testid="live-settings">
    <label>Log level <select value=${level} onChange=${(e) => setLevel(e.target.value)} data-testid="log-level">
      ${LEVELS.map((l) => html`<option value=${l}>${l}</option>`)}</select></label>
    <label class="check"><input type="checkbox" checked=${json} onChange=${(e) => setJson(e.target.checked)}
      data-testid="json-logs" /> JSON log lines on stdout (logging.enabled)</label>
    <label class="check"><input type="checkbox" checked=${tracing} onChange=${(e) => setTracing(e.target.checked)}
      data-testid="tracing-enabled" /> Runtime tracing, cluster-wide (tracing.enabled)</label>
    <div class="row"><button type="submit" class="primary" disabled=${act.busy} data-testid="save-settings">
      Apply now</button></div>
    <${ErrorNote} error=${act.error} what="not applied" />
    ${applied && html`<p class="muted" role="status" data-testid="settings-applied">${applied.length
      ? `Applied without a restart: ${applied.join(', ')}; written to ${view.configPath}.` : 'No change.'}</p>`}
  </form>`;
}

export function SettingsPage() {
  const [{ data: view, error }, refresh] = usePoll('/config', 30000);
  const [act, run] = useAction();
  if (!view) return html`<${ErrorNote} error=${error} what="settings" />${!error && html`<p class="muted">Loading…</p>`}`;
  const live = new Set(view.liveKeys || []);
  const rows = flatten(view.effective).filter(([k]) => !live.has(k)).sort(([a], [b]) => a.localeCompare(b));
  return html`
    <${Section} id="live-title" title="Applied at runtime">
      <p class="muted small">These apply on this node as soon as you press Apply (tracing on every node) and are
        written to ${html`<span class="mono">${view.configPath}</span>`}.</p>
      <${LiveForm} key=${JSON.stringify(view.effective.logging) + view.effective.tracing.enabled} view=${view}
        act=${act} run=${run} onSaved=${refresh} />
    <//>
    <${Section} id="restart-title" title="Need a restart">
      <p class="muted small">In force now; to change one, edit skulk.yaml and restart the node.</p>
      <div class="table-wrap"><table data-testid="restart-settings"><thead><tr><th>key</th><th>value</th><th></th>
        </tr></thead><tbody>
        ${rows.map(([k, v]) => html`<tr data-key=${k}><td class="mono">${k}</td>
          <td class="mono small">${JSON.stringify(v)}</td><td><${Badge} kind="warn">needs a restart<//></td></tr>`)}
      </tbody></table></div>
    <//>`;
}
