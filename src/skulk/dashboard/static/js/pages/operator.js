// Operator: the cluster timeline per instance and rank, refreshed live, with stuck ranks and warnings
// highlighted as `skulk diag` does; one node's full diagnostics bundle; tracing, where the node has it.
import { useEffect, useState } from '../../vendor/hooks.js';
import { apiRoutes, request, useAction, usePoll } from '../api.js';
import { html, Badge, ErrorNote, Section, nodeName, secs, shortId } from '../ui.js';

export const TIMELINE_POLL_MS = 3000;
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
    ${act.result && html`<details open><summary>Bundle of ${nodeName(state, act.result.nodeId)}${' '}
        (${act.result.ok ? 'answered' : `not answering: ${act.result.error}`}) ·${' '}
        <a href=${`/v1/diagnostics/cluster/${act.result.nodeId}`} target="_blank" rel="noopener">raw JSON</a></summary>
      <pre class="json">${JSON.stringify(act.result.diagnostics || act.result, null, 2)}</pre></details>`}
  </div>`;
}

// Where one traced request's time went: per rank ("api" is the API node's stream) and per span kind, as bars.
function Breakdown({ title, buckets }) {
  const rows = Object.entries(buckets || {}).sort((a, b) => b[1].totalUs - a[1].totalUs);
  const max = Math.max(1, ...rows.map(([, b]) => b.totalUs));
  return html`<div class="trace-chart"><h3 class="small">${title}</h3>${rows.map(([name, b]) => html`<div class="bar-row">
    <span class="bar-label mono small">${name}</span>
    <span class="bar"><span class="bar-used" style=${{ width: `${(100 * b.totalUs) / max}%` }}></span></span>
    <span class="bar-text">${(b.totalUs / 1000).toFixed(1)} ms · ${b.count}×</span></div>`)}</div>`;
}

function TraceStats({ stats }) {
  return html`<div data-testid="trace-chart">
    <p>Task <span class="mono">${shortId(stats.taskId)}</span>: ${(stats.totalWallTimeUs / 1000).toFixed(1)} ms wall
      time, traced on ${(stats.sourceNodes || []).length} node(s).</p>
    <${Breakdown} title="Time per rank" buckets=${stats.byRank} />
    <${Breakdown} title="Time per span" buckets=${stats.byCategory} />
  </div>`;
}

function Tracing() {
  const [routes, setRoutes] = useState(null);
  const [failed, setFailed] = useState(null);
  useEffect(() => { apiRoutes().then(setRoutes, setFailed); }, []);
  const has = !!routes && routes.has('/v1/tracing');
  const cluster = !!routes && routes.has('/v1/traces/cluster');
  const [{ data: status, error }, refresh] = usePoll(has ? '/v1/tracing' : null, 10000, { enabled: has });
  const [{ data: traces }] = usePoll(has ? (cluster ? '/v1/traces/cluster' : '/v1/traces') : null, 5000, { enabled: has });
  const [act, run] = useAction();
  const [stats, statsRun] = useAction();
  if (failed) return html`<p class="muted">Tracing: could not read this node's routes (${failed.message}).</p>`;
  if (!routes) return html`<p class="muted">Loading…</p>`;
  if (!has) return html`<p class="muted" data-testid="tracing-absent">This node's version has no tracing API (/v1/tracing).</p>`;
  const enabled = !!(status && status.enabled);
  const toggle = () => run(() => request('/v1/tracing', { method: 'PUT', body: { enabled: !enabled } })).then(refresh);
  const list = (traces && traces.traces) || [];
  const base = cluster ? '/v1/traces/cluster' : '/v1/traces';
  const open = (id) => statsRun(() => request(`${base}/${encodeURIComponent(id)}/stats`, { timeout: 15000 }));
  return html`<div data-testid="tracing">
    <${ErrorNote} error=${error} what="tracing" />
    <div class="row"><span>Tracing is <strong data-testid="tracing-state">${status ? (enabled ? 'on' : 'off') : '…'}</strong>${' '}
      cluster-wide, for new requests only.</span>
      <button type="button" onClick=${toggle} disabled=${act.busy || !status}>${enabled ? 'Turn off' : 'Turn on'}</button></div>
    <${ErrorNote} error=${act.error} />
    ${list.length ? html`<div class="table-wrap"><table><thead><tr><th>task</th><th>model</th><th>created</th><th>nodes</th><th>spans</th></tr></thead>
      <tbody>${list.slice(0, 50).map((t) => html`<tr><td><button type="button" class="link mono"
        onClick=${() => open(t.taskId)}>${shortId(t.taskId)}</button></td>
        <td>${t.modelId || ''}</td><td>${t.createdAt || ''}</td><td>${(t.sourceNodes || []).length}</td>
        <td>${t.spanCount ?? ''}</td></tr>`)}</tbody></table></div>`
      : html`<p class="muted">No traces yet: turn tracing on and send a request.</p>`}
    <${ErrorNote} error=${stats.error} what="trace" />
    ${stats.result && html`<${TraceStats} stats=${stats.result} />`}
  </div>`;
}

export function OperatorPage({ state }) {
  return html`
    <${Section} id="timeline-title" title="Cluster timeline"><${Timeline} state=${state} /><//>
    <${Section} id="bundle-title" title="A node's diagnostics bundle"><${Bundle} state=${state} /><//>
    <${Section} id="tracing-title" title="Tracing"><${Tracing} /><//>`;
}
