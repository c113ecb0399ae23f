// Operator: the cluster timeline per instance and rank, refreshed live, with stuck ranks and warnings
// highlighted as `skulk diag` does; one node's full diagnostics bundle; tracing, where the node has it.
import { useEffect, useState } from '../../vendor/hooks.js';
import { apiRoutes, request, useAction, usePoll } from '../api.js';
import { html, Badge, ErrorNote, Section, nodeName, secs, shortId } from '../ui.js';

export const TIMELINE_POLL_MS = 2000;
// As skulk diag (diagnostics/cli.py): these warnings mark a runner stuck; a barrier wait past 5 s in an
// instance whose ranks disagree is stuck too, its peers are highlighted as involved.
const STUCK_CODES = new Set(['rank_disagreement', 'phase_stuck']);
const BARRIER_PHASES = new Set(['task_agreement', 'prefill_barrier', 'decode_barrier', 'decode_wait_first_token', 'connect_group']);
const BARRIER_WAIT_S = 5;

export function flags(timeline) {
  const warnings = timeline.warnings || [];
  const stuck = new Set(warnings.filter((w) => STUCK_CODES.has(w.code) && w.runnerId).map((w) => w.runnerId));
  const disagreeing = new Set(warnings.filter((w) => w.code === 'rank_disagreement' && w.instanceId).map((w) => w.instanceId));
  const style = (r) => {
    const longWait = BARRIER_PHASES.has(r.phase) && r.secondsInPhase > BARRIER_WAIT_S;
    if (stuck.has(r.runnerId) || (longWait && disagreeing.has(r.instanceId))) return 'stuck';
    return disagreeing.has(r.instanceId) ? 'peer' : '';
  };
  return { warnings, style };
}

function RunnerRow({ state, r, style }) {
  return html`<tr class=${style} data-testid="timeline-row" data-runner-id=${r.runnerId} data-rank=${r.deviceRank}
      data-stuck=${style === 'stuck' ? 'true' : 'false'}>
    <td>${nodeName(state, r.nodeId)}</td>
    <td>${r.deviceRank}/${r.worldSize}</td>
    <td>${(r.statusKind || '').replace('Runner', '')}${r.processAlive ? '' : ' (dead)'}</td>
    <td><span class="mono">${r.phase}</span>${style === 'stuck' && html` <strong class="stuck-mark">⚠ STUCK</strong>`}
      ${r.phaseDetail && html`<div class="muted small">${r.phaseDetail}</div>`}</td>
    <td class="num">${secs(r.secondsInPhase)}</td>
    <td class="mono small">${r.activeTaskId ? shortId(r.activeTaskId) : '–'}</td>
  </tr>`;
}

function Timeline({ state }) {
  const [{ data, error }] = usePoll('/v1/diagnostics/cluster/timeline', TIMELINE_POLL_MS, { timeout: 15000 });
  if (!data) return html`<${ErrorNote} error=${error} what="timeline" />${!error && html`<p class="muted">Loading…</p>`}`;
  const { warnings, style } = flags(data);
  const byInstance = new Map();
  for (const r of data.runners || []) {
    const key = r.instanceId || 'none';
    if (!byInstance.has(key)) byInstance.set(key, []);
    byInstance.get(key).push(r);
  }
  return html`<div data-testid="timeline">
    <${ErrorNote} error=${error} what="timeline (showing the last answer)" />
    <p class="muted small">Generated ${data.generatedAt}; refreshed every ${TIMELINE_POLL_MS / 1000} s
</p>
    ${warnings.length ? html`<ul class="warnings" data-testid="warnings">${warnings.map((w) => html`<li
        class=${`warning ${w.severity}`} data-code=${w.code}>
        <${Badge} kind=${w.severity === 'critical' ? 'error' : 'warn'}>${w.severity}<//> <strong>${w.code}</strong>: ${w.message}
      </li>`)}</ul>` : html`<p class="muted">No warnings.</p>`}
    ${(data.unreachableNodes || []).length > 0 && html`<p class="error">Not answering: ${data.unreachableNodes.map((n) => nodeName(state, n)).join(', ')}</p>`}
    ${byInstance.size === 0 && html`<p class="muted">No runners: nothing is placed.</p>`}
    ${[...byInstance.entries()].map(([instanceId, runners]) => html`<div class="table-wrap" data-instance-id=${instanceId}>
      <h3 class="small">${runners[0].modelId} <span class="muted mono">${shortId(instanceId)}</span></h3>
      <table><thead><tr><th>node</th><th>rank</th><th>status</th><th>phase</th><th>in phase</th><th>active task</th></tr></thead>
        <tbody>${runners.map((r) => html`<${RunnerRow} key=${r.runnerId} state=${state} r=${r} style=${style(r)} />`)}</tbody>
      </table></div>`)}
  </div>`;
}

function Bundle({ state }) {
  const nodes = Object.keys(state.nodeIdentities || {}).sort();
  const [act, run] = useAction();
  const [shown, setShown] = useState(null);
  const open = (id) => { setShown(id); run(() => request(`/v1/diagnostics/cluster/${encodeURIComponent(id)}`, { timeout: 15000 })); };
  return html`<div>
    <div class="row">${nodes.map((id) => html`<button type="button" onClick=${() => open(id)}
      aria-pressed=${shown === id ? 'true' : 'false'}>${nodeName(state, id)}</button>`)}</div>
    <${ErrorNote} error=${act.error} what="diagnostics" />
    ${act.busy && html`<p class="muted">Asking ${nodeName(state, shown)}…</p>`}
    ${act.result && html`<details open><summary>Bundle of ${nodeName(state, act.result.nodeId)}
        (${act.result.ok ? 'answered' : `not answering: ${act.result.error}`}) ·
        <a href=${`/v1/diagnostics/cluster/${act.result.nodeId}`} target="_blank" rel="noopener">raw JSON</a></summary>
      <pre class="json">${JSON.stringify(act.result.diagnostics || act.result, null, 2)}</pre></details>`}
  </div>`;
}

// Per-rank (or per-phase) time of one trace as horizontal bars; the stats' numeric fields, whatever they are.
function numbers(obj, prefix = '') {
  const out = [];
  for (const [k, v] of Object.entries(obj || {})) {
    if (typeof v === 'number') out.push([prefix + k, v]);
    else if (v && typeof v === 'object' && out.length < 64) out.push(...numbers(v, `${prefix}${k}.`));
  }
  return out;
}

function TraceChart({ stats }) {
  const rows = numbers(stats).filter(([k]) => /ms|sec|time|dur|_s$|seconds/i.test(k));
  const shown = rows.length ? rows : numbers(stats);
  const max = Math.max(1e-9, ...shown.map(([, v]) => v));
  return html`<div class="trace-chart" data-testid="trace-chart">${shown.map(([k, v]) => html`<div class="bar-row">
    <span class="bar-label mono small">${k}</span>
    <span class="bar"><span class="bar-used" style=${{ width: `${(100 * v) / max}%` }}></span></span>
    <span class="bar-text">${Number.isInteger(v) ? v : v.toFixed(3)}</span></div>`)}</div>`;
}

function Tracing() {
  const [routes, setRoutes] = useState(null);
  const [failed, setFailed] = useState(null);
  useEffect(() => { apiRoutes().then(setRoutes, setFailed); }, []);
  const has = routes && routes.has('/v1/tracing');
  const listPath = routes && (routes.has('/v1/traces/cluster') ? '/v1/traces/cluster' : routes.has('/v1/traces') ? '/v1/traces' : null);
  const [{ data: status, error }, refresh] = usePoll(has ? '/v1/tracing' : null, 10000, { enabled: !!has });
  const [{ data: traces }] = usePoll(listPath, 5000, { enabled: !!listPath });
  const [act, run] = useAction();
  const [stats, statsRun] = useAction();
  if (failed) return html`<p class="muted">Tracing: could not read this node's routes (${failed.message}).</p>`;
  if (!routes) return html`<p class="muted">Loading…</p>`;
  if (!has) return html`<p class="muted" data-testid="tracing-absent">This node's version has no tracing API (/v1/tracing).</p>`;
  const enabled = status && (status.enabled ?? status.tracingEnabled);
  const toggle = () => run(() => request('/v1/tracing', { method: 'PUT', body: { enabled: !enabled } })).then(refresh);
  const list = Array.isArray(traces) ? traces : (traces && (traces.traces || traces.data)) || [];
  const open = (id) => statsRun(() => request(`/v1/traces/${encodeURIComponent(id)}/stats`, { timeout: 15000 }));
  return html`<div>
    <${ErrorNote} error=${error} what="tracing" />
    <div class="row"><span>Tracing is <strong>${enabled ? 'on' : 'off'}</strong> (new requests only).</span>
      <button type="button" onClick=${toggle} disabled=${act.busy || !status}>${enabled ? 'Turn off' : 'Turn on'}</button></div>
    <${ErrorNote} error=${act.error} />
    ${list.length ? html`<div class="table-wrap"><table><thead><tr><th>task</th><th>model</th><th>created</th></tr></thead>
      <tbody>${list.slice(0, 50).map((t) => html`<tr><td><button type="button" class="link mono"
        onClick=${() => open(t.taskId || t.task_id)}>${shortId(t.taskId || t.task_id)}</button></td>
        <td>${t.modelId || t.model_id || ''}</td><td>${t.createdAt || t.created_at || ''}</td></tr>`)}</tbody></table></div>`
      : html`<p class="muted">No traces on this node yet.</p>`}
    <${ErrorNote} error=${stats.error} what="trace" />
    ${stats.result && html`<${TraceChart} stats=${stats.result} />`}
  </div>`;
}

export function OperatorPage({ state }) {
  return html`
    <${Section} id="timeline-title" title="Cluster timeline"><${Timeline} state=${state} /><//>
    <${Section} id="bundle-title" title="A node's diagnostics bundle"><${Bundle} state=${state} /><//>
    <${Section} id="tracing-title" title="Tracing"><${Tracing} /><//>`;
}
