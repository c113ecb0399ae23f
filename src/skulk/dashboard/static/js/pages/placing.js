// Placing: pick a model, sharding, minimum nodes or the nodes themselves; the previews of
// /instance/previews with per-node memory bars, or the typed refusal with its GB arithmetic; launch creates a
// MetaInstance. MetaInstances are listed with their seed-003 status, directly placed instances apart.
import { useState } from '../../vendor/hooks.js';
import { request, useAction, usePoll } from '../api.js';
import {
  html, Badge, Bar, ConfirmButton, ErrorNote, Section, bytesOf, gb, instanceStatus, nodeName, shortId, tagged,
} from '../ui.js';

const DEMO = 'skulk/tiny-random-llama';

// "node X (name) needs A GB (B GB weights share × F + R GB runtime + C GB KV pool) but has D GB free (… over N
// node(s) …)"; an older node's message has no runtime term.
const ARITHMETIC = /node (\w+) \(([^)]*)\) needs ([\d.]+) GB \(([\d.]+) GB weights(?: share × ([\d.]+))?(?: \+ ([\d.]+) GB runtime)? \+ ([\d.]+) GB KV pool\) but has ([\d.]+) GB free/;
const GIB = 2 ** 30;

// A refusal as {kind, message, numbers}: structured fields when the node gives them, else read from its message.
export function refusalOf(error) {
  if (!error) return null;
  if (typeof error === 'string') {
    const m = error.match(ARITHMETIC);
    const numbers = m && { nodeId: m[1], nodeName: m[2], needed: +m[3] * GIB, weightsShare: +m[4] * GIB,
      overheadFactor: m[5] ? +m[5] : 1, runtime: (+m[6] || 0) * GIB, kvPool: +m[7] * GIB, available: +m[8] * GIB };
    return { kind: m ? 'InsufficientMemory' : 'refused', message: error, numbers };
  }
  const [kind, body] = tagged(error);
  const numbers = body.needed && body.available && { nodeId: body.nodeId, nodeName: body.nodeName,
    needed: bytesOf(body.needed), weightsShare: bytesOf(body.weightsShare), overheadFactor: body.overheadFactor,
    runtime: bytesOf(body.runtimeOverhead), kvPool: bytesOf(body.kvPool), available: bytesOf(body.available) };
  return { kind, message: body.message || kind, numbers };
}

// Both shapes of GET /instance/previews: Skulk's ({instance, memory_delta_by_node, error: string}) and the
// per-node one ({nodeIds, nodes: [{needed, free, …}], error: {Kind: {…}}}), as one.
export function normalizePreview(p, state) {
  const error = refusalOf(p.error);
  const memory = state.nodeMemory || {};
  if ('memory_delta_by_node' in p || 'instance' in p) {
    const [, inst] = tagged(p.instance);
    const assign = (inst && inst.shardAssignments) || {};
    const nodes = Object.entries(assign.nodeToRunner || {}).map(([nodeId, runner]) => {
      const [, shard] = tagged((assign.runnerToShard || {})[runner]);
      return { nodeId, ...shard, needed: (p.memory_delta_by_node || {})[nodeId] || 0,
        kvPool: (p.kv_cache_bytes_by_node || {})[nodeId] || 0, free: bytesOf((memory[nodeId] || {}).ramAvailable),
        weights: (p.weights_bytes_by_node || {})[nodeId] || 0, runtime: (p.runtime_bytes_by_node || {})[nodeId] || 0,
        runtimeMeasured: !!(p.runtime_measured_by_node || {})[nodeId] };
    }).sort((a, b) => a.deviceRank - b.deviceRank);
    const over = error && error.message.match(/over (\d+) node/);
    return { sharding: p.sharding, instanceMeta: p.instance_meta, nodeIds: nodes.map((n) => n.nodeId),
      size: nodes.length || (over ? +over[1] : 0), nodes, error, instance: p.instance, contextLength: p.context_length,
      predicted: { decode: p.predicted_decode_tps, aggregate: p.predicted_aggregate_tps, batch: p.predicted_batch,
        warning: p.predicted_warning } };
  }
  const nodes = (p.nodes || []).map((n) => ({ ...n, needed: bytesOf(n.needed), free: bytesOf(n.free) }));
  return { sharding: p.sharding, instanceMeta: p.instanceMeta, nodeIds: p.nodeIds || [],
    size: (p.nodeIds || []).length, nodes, error };
}

// What a rank's bytes are made of, where the preview says: weights, the runner's runtime (measured on that node,
// or the default until one of its runners has loaded) and the KV pool.
function terms(n) {
  const parts = [n.weights ? `weights ${gb(n.weights)}` : '',
    n.runtime ? `runtime ${gb(n.runtime)}${n.runtimeMeasured ? ' measured' : ''}` : '',
    n.kvPool ? `KV pool ${gb(n.kvPool)}` : ''].filter(Boolean);
  return parts.length ? `(${parts.join(' + ')})` : '';
}

// The refusal as numbers: "needs X GB (weights [share × 1.05 for an estimate] + runtime + KV pool) but has Y GB
// free".
export function Refusal({ state, refusal }) {
  const n = refusal.numbers;
  const arithmetic = n && html`<p class="arithmetic" data-testid="gb-arithmetic">
    ${n.nodeName || nodeName(state, n.nodeId)} needs <strong>${gb(n.needed)}</strong>${' '}
    (${gb(n.weightsShare)} weights${n.overheadFactor !== 1 ? ` share × ${n.overheadFactor}` : ''}${' '}
    ${n.runtime ? `+ ${gb(n.runtime)} runtime` : ''}${' '}
    + ${gb(n.kvPool)} KV pool) but has${' '}
    <strong>${gb(n.available)}</strong> free</p>`;
  return html`<div class="refusal" data-testid="refusal">
    <${Badge} kind="error">${refusal.kind}<//> ${arithmetic}
    <p class="muted">${refusal.message}</p>
  </div>`;
}

// What the preview predicts (master/speed.py), and a warning when the split is slower than fewer nodes.
function Prediction({ predicted }) {
  const p = predicted || {};
  if (p.decode == null) {
    return html`<p class="muted small" data-testid="prediction">Speed not predicted yet: no node has served a
      request, or a link of this ring is not measured.</p>`;
  }
  const many = p.aggregate == null ? '' : ` · ${p.aggregate.toFixed(1)} tok/s over ${p.batch} streams`;
  return html`<div data-testid="prediction">
    <p class="small">Predicted <strong>${p.decode.toFixed(1)} tok/s</strong> one stream${many}</p>
    ${p.warning && html`<p class="small" data-testid="prediction-warning"><${Badge} kind="warn">slower split<//>${' '}
      ${p.warning}</p>`}
  </div>`;
}

// A preview's title names its nodes: two previews over the same number of nodes (one per node of the cluster)
// read differently, and the name says where Launch places it before the card's details do.
function previewTitle(state, preview) {
  const names = preview.nodeIds.map((n) => nodeName(state, n));
  const size = preview.size;
  const over = size > 1 ? `over ${size} nodes: ${names.join(', ')}` : `on ${names[0] || '?'}`;
  return `${preview.sharding} ${over}`;
}

function PreviewCard({ state, preview, onLaunch, busy }) {
  const size = preview.size;
  return html`<li class="card preview" data-testid="preview" data-ok=${preview.error ? 'false' : 'true'}
      data-nodes=${size} data-sharding=${preview.sharding} data-node-ids=${preview.nodeIds.join(',')}>
    <header class="card-head">
      <h3 data-testid="preview-title">${previewTitle(state, preview)}</h3>
      ${preview.error ? html`<${Badge} kind="error">does not fit<//>` : html`<${Badge} kind="ok">fits<//>`}
    </header>
    ${preview.error ? html`<${Refusal} state=${state} refusal=${preview.error} />` : html`
      <${Prediction} predicted=${preview.predicted} />
      ${preview.contextLength ? html`<p class="muted small" data-testid="preview-context">${
        `admits a context of ${preview.contextLength} tokens; each node's KV pool is part of what it needs`}</p>`
        : null}
      ${preview.nodes.map((n) => {
        // the node's memory as the Cluster page shows it (state.nodeMemory), plus what this model needs; the
        // "leaves" figure is placement's, which also counts shards committed but not loaded yet
        const mem = (state.nodeMemory || {})[n.nodeId] || {};
        const total = bytesOf(mem.ramTotal) || n.free;
        const used = mem.ramAvailable ? total - bytesOf(mem.ramAvailable) : total - n.free;
        return html`<div class="preview-node">
          <div class="small">${nodeName(state, n.nodeId)} · rank ${n.deviceRank}/${n.worldSize}${' '}
            · layers ${n.startLayer}–${n.endLayer} of ${n.nLayers} · needs ${gb(n.needed)}${' '}
            ${terms(n)}${' '}
            · leaves ${gb(n.free - n.needed)}</div>
          <${Bar} used=${used} extra=${n.needed} total=${total}
            title=${`used ${gb(used)} + this model ${gb(n.needed)} of ${gb(total)}`} />
        </div>`;
      })}
      <div class="row">
        <button type="button" class="primary" disabled=${busy} data-testid="launch"
          title="Places this preview on exactly these nodes as a MetaInstance: the master keeps one placed (re-created after failures)"
          onClick=${() => onLaunch(preview, true)}>Launch (keep placed)</button>
        <button type="button" disabled=${busy || !preview.instance} data-testid="launch-once"
          title="Places exactly this preview once: nothing re-creates it if it fails or a node leaves"
          onClick=${() => onLaunch(preview, false)}>Launch once</button>
      </div>`}
  </li>`;
}

// The form's last choice, kept in this browser (a visit does not reset it to the demo model).
const FORM_STORE = 'skulk.placeForm';

function savedForm() {
  try { return JSON.parse(localStorage.getItem(FORM_STORE) || '{}') || {}; } catch { return {}; }
}

function useSaved(field, initial) {
  const [value, setValue] = useState(savedForm()[field] ?? initial);
  const set = (next) => {
    setValue(next);
    try { localStorage.setItem(FORM_STORE, JSON.stringify({ ...savedForm(), [field]: next })); } catch { /* off */ }
  };
  return [value, set];
}

function PlaceForm({ state, onLaunched }) {
  const [{ data: catalog }] = usePoll('/models', 30000);
  const [model, setModel] = useSaved('model', DEMO);
  const [sharding, setSharding] = useSaved('sharding', '');
  const [minNodes, setMinNodes] = useSaved('minNodes', 1);
  const [picked, setPicked] = useState([]);
  const nodes = Object.keys(state.nodeIdentities || {}).sort();
  const excluded = picked.length ? nodes.filter((n) => !picked.includes(n)) : [];
  const query = new URLSearchParams({ model_id: model });
  if (sharding) query.set('sharding', sharding);
  excluded.forEach((n) => query.append('excluded_node_ids', n));
  const [{ data, error }] = usePoll(`/instance/previews?${query}`, 4000);
  const [act, run] = useAction();
  const wanted = ((data && data.previews) || []).map((p) => normalizePreview(p, state))
    .filter((p) => p.size >= minNodes && (!picked.length || p.nodeIds.every((n) => picked.includes(n))));
  // exactly the nodes the preview showed: a MetaInstance whose first instance goes there (re-placed within the
  // picked nodes, or anywhere, after a failure), or this preview's instance placed once as it is
  const launch = (preview, keep) => run(() => (keep
    ? request('/meta_instance', {
      method: 'POST', timeout: 30000,
      body: { model_id: model, sharding: preview.sharding, instance_meta: preview.instanceMeta,
        min_nodes: preview.size, node_ids: picked.length ? picked : null, first_node_ids: preview.nodeIds },
    })
    : request('/instance', { method: 'POST', timeout: 30000, body: { instance: preview.instance } })))
    .then((r) => { if (r) onLaunched(); });
  const togglePick = (id) => setPicked(picked.includes(id) ? picked.filter((n) => n !== id) : [...picked, id]);
  const fits = wanted.filter((p) => !p.error);
  return html`<div>
    <form class="form-grid" onSubmit=${(e) => e.preventDefault()}>
      <label class="model-pick">Model <select value=${model} onChange=${(e) => setModel(e.target.value)}
        data-testid="place-model" title=${model}>
        ${((catalog && catalog.data) || [{ id: DEMO }]).map((m) => html`<option value=${m.id}>${m.id}</option>`)}
      </select></label>
      <label>Sharding <select value=${sharding} onChange=${(e) => setSharding(e.target.value)}>
        <option value="">any</option><option>Pipeline</option><option>Tensor</option></select></label>
      <label>Minimum nodes <input type="number" min="1" max=${Math.max(1, nodes.length)} value=${minNodes}
        onInput=${(e) => setMinNodes(Math.max(1, Number(e.target.value) || 1))} /></label>
      <fieldset><legend>Only these nodes (optional)</legend>
        ${nodes.map((n) => html`<label class="check"><input type="checkbox" checked=${picked.includes(n)}
          onChange=${() => togglePick(n)} /> ${nodeName(state, n)}</label>`)}
      </fieldset>
    </form>
    <${ErrorNote} error=${error} what="previews" />
    <${ErrorNote} error=${act.error} what="not launched" />
    ${data && !fits.length && wanted.length > 0 && html`<p class="error" role="alert" data-testid="cannot-place">
      ${model} cannot be placed with these choices. The reasons, per candidate:</p>`}
    <ul class="grid plain" data-testid="previews">
      ${wanted.map((p, i) => html`<${PreviewCard} key=${`${p.sharding}${p.nodeIds.join()}${i}`} state=${state} preview=${p}
        onLaunch=${launch} busy=${act.busy} />`)}
    </ul>
    ${data && !wanted.length && html`<p class="muted" data-testid="no-candidate">No candidate with at least ${minNodes}${' '}
      node(s)${picked.length ? ' among the nodes picked' : ''}: the nodes must be linked in a ring (see the topology).</p>`}
  </div>`;
}

// Seed 003's words: PLACING / healthy / RETRYING (n/3) / error, with the last failure.
function metaBadge(status) {
  if (status.startsWith('healthy')) return ['ok', 'healthy'];
  if (status.startsWith('RETRYING')) return ['warn', status.split(':')[0]];
  if (status.startsWith('error')) return ['error', 'error'];
  if (status.startsWith('starting')) return ['busy', 'starting'];
  return ['busy', 'PLACING'];
}

function MetaRow({ state, meta, onDeleted }) {
  const [act, run] = useAction();
  const [kind, label] = metaBadge(meta.status || 'placing');
  const remove = () => run(() => request(`/meta_instance/${encodeURIComponent(meta.metaInstanceId)}`,
    { method: 'DELETE', timeout: 30000 })).then(onDeleted);
  let note = null;
  // the server's status says whether the instance was re-created or recovered in place (diagnostics/meta.py)
  const healthyNote = /^healthy \((.*)\)$/.exec(meta.status || '');
  if (healthyNote) note = healthyNote[1][0].toUpperCase() + healthyNote[1].slice(1);
  else if (meta.placementError) note = `Cannot place: ${meta.placementError}`;
  else if (meta.lastFailureError) note = `Retrying after error: ${meta.lastFailureError}`;
  return html`<tr data-testid="meta-row" data-meta-id=${meta.metaInstanceId} data-status=${label}>
    <td><span class="mono">${meta.modelId}</span><div class="muted small">${shortId(meta.metaInstanceId)}</div></td>
    <td>${meta.sharding} · ≥${meta.minNodes} node(s)${meta.nodeIds ? ` · on ${meta.nodeIds.map((n) => nodeName(state, n)).join(', ')}` : ''}</td>
    <td><${Badge} kind=${kind}>${label}<//>${note && html`<div class="small" data-testid="meta-note">${note}</div>`}</td>
    <td>${(meta.instance_ids || []).map((i) => html`<div class="small">${shortId(i)} on ${instanceNodes(state, i)}</div>`)}</td>
    <td><${ConfirmButton} label="Delete" question="Delete this MetaInstance and its instance?" busy=${act.busy}
      onConfirm=${remove} testid="delete-meta" /><${ErrorNote} error=${act.error} /></td>
  </tr>`;
}

function instanceNodes(state, instanceId) {
  const [, body] = tagged((state.instances || {})[instanceId]);
  return Object.keys(((body || {}).shardAssignments || {}).nodeToRunner || {}).map((n) => nodeName(state, n)).join(', ');
}

function DirectRow({ state, instanceId, onDeleted }) {
  const [act, run] = useAction();
  const [, body] = tagged(state.instances[instanceId]);
  const st = instanceStatus(state, instanceId);
  const remove = () => run(() => request(`/instance/${encodeURIComponent(instanceId)}`,
    { method: 'DELETE', timeout: 30000 })).then(onDeleted);
  const shards = Object.values(body.shardAssignments.runnerToShard || {}).map((s) => tagged(s));
  return html`<tr data-testid="instance-row" data-instance-id=${instanceId}>
    <td><span class="mono">${body.shardAssignments.modelId}</span><div class="muted small">${shortId(instanceId)}</div></td>
    <td>${(shards[0] || ['?'])[0].replace('ShardMetadata', '')} · ${instanceNodes(state, instanceId)}</td>
    <td><${Badge} kind=${st.kind}>${st.text}<//></td>
    <td><${ConfirmButton} label="Delete" question="Delete this instance?" busy=${act.busy} onConfirm=${remove}
      testid="delete-instance" /><${ErrorNote} error=${act.error} /></td>
  </tr>`;
}

export function PlacingPage({ state, refreshState }) {
  const [{ data, error }, refresh] = usePoll('/meta_instances', 2000);
  const changed = () => { refresh(); refreshState(); };
  const metas = Object.values((data && data.meta_instances) || {});
  const direct = Object.entries(state.instances || {}).filter(([, i]) => !tagged(i)[1].metaInstanceId).map(([id]) => id);
  return html`
    <${Section} id="place-title" title="Place a model"><${PlaceForm} state=${state} onLaunched=${changed} /><//>
    <${Section} id="meta-title" title=${`MetaInstances (${metas.length})`}>
      <${ErrorNote} error=${error} what="MetaInstances" />
      ${metas.length ? html`<div class="table-wrap"><table data-testid="meta-table">
        <thead><tr><th>model</th><th>wants</th><th>status</th><th>instance</th><th></th></tr></thead>
        <tbody>${metas.map((m) => html`<${MetaRow} key=${m.metaInstanceId} state=${state} meta=${m} onDeleted=${changed} />`)}</tbody>
      </table></div>` : html`<p class="muted">None. Launch a preview above to keep a model placed.</p>`}
    <//>
    <${Section} id="direct-title" title=${`Directly placed instances (${direct.length})`}>
      ${direct.length ? html`<div class="table-wrap"><table data-testid="instance-table">
        <thead><tr><th>model</th><th>placement</th><th>status</th><th></th></tr></thead>
        <tbody>${direct.map((id) => html`<${DirectRow} key=${id} state=${state} instanceId=${id} onDeleted=${changed} />`)}</tbody>
      </table></div>` : html`<p class="muted">None. (POST /place_instance places one that is not re-placed.)</p>`}
    <//>`;
}
